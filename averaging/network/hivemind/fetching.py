"""The joiner side of the state download: fetching state slices and past outer steps.

A mixin of ``ShoalAverager`` (``averaging.network.hivemind.averager``). ``fetch_slice`` and
``fetch_update`` block a host thread on an MPFuture while the transfer runs in the averager
process (one task per fetch, bounded by its deadline so none lingers). Everything received is
refused as early as it could not be right (``_download`` refuses a message before reading it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import STREAMING_CHUNK_SIZE_BYTES

from averaging.math.wire import STATE_BYTES_PER_VALUE
from averaging.state.served import AppliedUpdate
from protocols.state_slices import encode_slice_request, encode_update_request

FETCH_GRACE_S = 5.0  # how much longer the host waits for a slice than the averager process may take
UPDATE_VERSION = 1  # of a served outer step's metadata
# What a download may cost beyond the tensor's own bytes: the donor's metadata and each message's framing.
METADATA_CAP_BYTES = 64 * 1024
MESSAGE_OVERHEAD_BYTES = 128


def describe(e: BaseException) -> str:
    """One line for a log: the exception's type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


class StateFetching:
    """``fetch_slice`` and ``fetch_update``, host side, and their tasks in the averager process."""

    def fetch_slice(self, peer: str, index: int, count: int, *, expected_numel: int, stall_timeout: float,
                    deadline_s: float) -> tuple[Any, torch.Tensor]:
        """Slice ``index`` of ``count`` of ``peer``'s state as (metadata, flat tensor); raises on
        any failure. Blocks the calling host thread; the network part runs in the averager process."""
        future = MPFuture()
        command = dict(peer=peer, index=index, count=count, expected_numel=expected_numel,
                       stall_timeout=stall_timeout, deadline_s=deadline_s, future=future)
        with self._command_lock:
            self._outer_pipe.send(("_fetch_slice", [], command))
        try:
            return future.result(timeout=deadline_s + FETCH_GRACE_S)
        finally:
            if not future.done():
                future.cancel()

    async def _fetch_slice(self, peer: str, index: int, count: int, expected_numel: int, stall_timeout: float,
                           deadline_s: float, future: MPFuture) -> None:
        # Runs in the averager process, one task per slice; bounded by deadline_s so no task lingers.
        with self._kept_alive():
            await self._fetch_slice_into(peer, index, count, expected_numel, stall_timeout, deadline_s, future)

    async def _fetch_slice_into(self, peer: str, index: int, count: int, expected_numel: int, stall_timeout: float,
                                deadline_s: float, future: MPFuture) -> None:
        try:
            result = await asyncio.wait_for(
                self._receive_slice(peer, index, count, expected_numel, stall_timeout), timeout=deadline_s)
        except Exception as e:
            if isinstance(e, TimeoutError) and not str(e):
                e = TimeoutError(f"no complete slice within {deadline_s:.1f}s")
            # A plain RuntimeError: whatever the network raised may not pickle back to the host.
            if not future.done():
                future.set_exception(RuntimeError(describe(e)))
        else:
            if not future.done():
                future.set_result(result)

    def fetch_update(self, peer: str, rounds_done: int, *, numel: int, timeout: float) -> AppliedUpdate:
        """``peer``'s outer update after ``rounds_done`` steps; raises on any failure or refusal."""
        future = MPFuture()
        with self._command_lock:
            self._outer_pipe.send(("_fetch_update", [], dict(peer=peer, rounds_done=rounds_done, numel=numel,
                                                             timeout=timeout, future=future)))
        try:
            return future.result(timeout=timeout + FETCH_GRACE_S)
        finally:
            if not future.done():
                future.cancel()

    async def _fetch_update(self, peer: str, rounds_done: int, numel: int, timeout: float, future: MPFuture) -> None:
        with self._kept_alive():
            await self._fetch_update_into(peer, rounds_done, numel, timeout, future)

    async def _fetch_update_into(self, peer: str, rounds_done: int, numel: int, timeout: float,
                                 future: MPFuture) -> None:
        try:
            result = await asyncio.wait_for(self._receive_update(peer, rounds_done, numel), timeout=timeout)
        except Exception as e:
            if not future.done():
                future.set_exception(RuntimeError(describe(e)))
        else:
            if not future.done():
                future.set_result(result)

    async def _receive_update(self, peer: str, rounds_done: int, numel: int) -> AppliedUpdate:
        """Receive one update, refusing early what could not be right (more bytes than an fp16
        vector of ours, another dtype or size, another step than asked for, non-finite values)."""
        max_bytes = numel * 2
        received = Received(max_bytes)
        messages = self._download(peer, "rpc_download_update",
                                  averaging_pb2.JoinRequest(gather=encode_update_request(rounds_done, self.proof())),
                                  received.max_message_bytes())
        async with contextlib.aclosing(messages):
            async for message in messages:
                received.add(message)
        if not received.buffers:
            raise ValueError(f"does not hold outer step {rounds_done + 1}")
        head = received.head
        if head.compression != runtime_pb2.CompressionType.NONE or head.dtype != "float16" \
                or list(head.size) != [numel] or received.tensor_bytes != max_bytes:
            raise ValueError(f"update is {head.dtype!r:.20} of size {list(head.size)[:4]} in {received.tensor_bytes}"
                             f" bytes, expected float16 [{numel}] in {max_bytes}")
        metadata = self.serializer.loads(received.metadata) if received.metadata else None
        if not isinstance(metadata, dict) or metadata.get("v") != UPDATE_VERSION \
                or metadata.get("rounds_done") != rounds_done + 1:
            raise ValueError(f"update metadata does not describe outer step {rounds_done + 1}")
        round = metadata.get("round")
        if not isinstance(round, int) or isinstance(round, bool) or not 0 < round < 2**40:
            raise ValueError("update metadata has a bad round")
        update = received.tensor()
        if not torch.isfinite(update).all():
            raise ValueError("update has non-finite values")
        return AppliedUpdate(round, rounds_done + 1, update)

    async def _receive_slice(self, peer: str, index: int, count: int, expected_numel: int,
                             stall_timeout: float) -> tuple[Any, torch.Tensor]:
        """Receive one slice, refusing early what could not be right: more bytes or parts than the
        slice needs (a hostile donor cannot make us buffer more), compression, another dtype or size."""
        max_bytes = expected_numel * STATE_BYTES_PER_VALUE
        received = Received(max_bytes)
        messages = self._download(peer, "rpc_download_state_slice",
                                  averaging_pb2.JoinRequest(gather=encode_slice_request(index, count, self.proof())),
                                  received.max_message_bytes())
        try:
            async with contextlib.aclosing(messages):
                async for message in aiter_with_timeout(messages, timeout=stall_timeout):
                    received.add(message)
        except TimeoutError:
            raise TimeoutError(f"silent for {stall_timeout:.1f}s") from None
        if not received.metadata or not received.buffers:
            raise ValueError("did not share its state")
        head = received.head
        if head.compression != runtime_pb2.CompressionType.NONE or head.dtype != "float32":
            raise ValueError(f"slice is {runtime_pb2.CompressionType.Name(head.compression)} {head.dtype!r:.20},"
                             " expected uncompressed float32")
        if list(head.size) != [expected_numel] or received.tensor_bytes != max_bytes:
            raise ValueError(f"slice of size {list(head.size)[:4]} in {received.tensor_bytes} bytes,"
                             f" expected [{expected_numel}]")
        return self.serializer.loads(received.metadata), received.tensor()

    async def _download(self, peer: str, method: str, request: averaging_pb2.JoinRequest,
                        max_total_bytes: int) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The donor's answer to ``request`` (one of our streaming RPCs ``method``), at most
        ``max_total_bytes`` of messages in all, each refused before it is read. Not hivemind's stub:
        its reader (1.1.12) allocates whatever length a message's header announces, so one hostile
        message could fill our memory. This speaks hivemind's ``P2P`` framing (``send_protobuf``)."""
        handle = self._get_handle_name(self.prefix, method)
        _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), handle)
        try:
            await P2P.send_protobuf(request, writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            left = max_total_bytes
            while True:
                try:
                    marker = await reader.readexactly(1)
                except asyncio.IncompleteReadError:
                    return  # the donor ended its answer
                length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
                left -= 1 + P2P.HEADER_LEN + length  # the framing too: empty messages are not free
                if left < 0:
                    raise ValueError(f"sent a message of {length} bytes, past the {max_total_bytes} bytes its "
                                     "answer may take")
                data = await reader.readexactly(length)
                if marker == P2P.ERROR_MARKER:
                    raise P2PHandlerError(f"{method} at {peer} failed: {RPCError.FromString(data).message}")
                if marker != P2P.MESSAGE_MARKER:
                    raise ValueError(f"sent a message marked {marker!r}")
                yield averaging_pb2.DownloadData.FromString(data)
        finally:
            writer.close()


class Received:
    """A tensor as a donor streams it, keeping each part's buffer and never the messages (hazard: a
    part of a parsed protobuf keeps the whole message alive). ``add`` raises ``ValueError`` on what
    no honest donor sends."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.max_parts = max_bytes // STREAMING_CHUNK_SIZE_BYTES + 1
        self.head: runtime_pb2.Tensor | None = None  # the first part without its buffer
        self.buffers: list[bytes] = []
        self.tensor_bytes = 0
        self.metadata = b""

    def max_message_bytes(self) -> int:
        """What every message of an honest answer takes together, at most."""
        return self.max_bytes + self.max_parts * MESSAGE_OVERHEAD_BYTES + METADATA_CAP_BYTES

    def add(self, message: averaging_pb2.DownloadData) -> None:
        metadata = message.metadata
        if metadata:
            if self.buffers:
                raise ValueError("sent metadata after its first message")
            if len(metadata) > METADATA_CAP_BYTES:
                raise ValueError(f"sent {len(metadata)} bytes of metadata (at most {METADATA_CAP_BYTES})")
            self.metadata = metadata
        part = message.tensor_part
        buffer = part.buffer  # a copy: the message can go
        if len(self.buffers) >= self.max_parts or self.tensor_bytes + len(buffer) > self.max_bytes:
            raise ValueError(f"sent more than the {self.max_bytes} bytes asked for")
        if self.buffers and part.dtype:
            raise ValueError("sent more than one tensor")
        if self.head is None:
            self.head = runtime_pb2.Tensor(compression=part.compression, size=part.size, dtype=part.dtype,
                                           requires_grad=part.requires_grad)
        self.buffers.append(buffer)
        self.tensor_bytes += len(buffer)

    def tensor(self) -> torch.Tensor:
        assert self.head is not None
        serialized = runtime_pb2.Tensor()
        serialized.CopyFrom(self.head)
        serialized.buffer = b"".join(self.buffers)
        self.buffers = []
        return deserialize_torch_tensor(serialized)
