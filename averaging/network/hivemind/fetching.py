"""The joiner side of the state download: fetching state slices and past outer steps.

A mixin of ``ShoalAverager`` (``averaging.network.hivemind.averager``). ``fetch_slice`` and
``fetch_update`` block a host thread on an MPFuture while the transfer runs in the averager
process (one task per fetch, bounded by its deadline so none lingers). Everything received is
refused early where it could not be right: more bytes or parts than asked for, compression,
another dtype or size, another step, non-finite values.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import STREAMING_CHUNK_SIZE_BYTES, combine_from_streaming

from averaging.math.wire import STATE_BYTES_PER_VALUE
from averaging.state.served import AppliedUpdate
from protocols.state_slices import encode_slice_request, encode_update_request

FETCH_GRACE_S = 5.0  # how much longer the host waits for a slice than the averager process may take
UPDATE_VERSION = 1  # of a served outer step's metadata


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
        max_parts = max_bytes // STREAMING_CHUNK_SIZE_BYTES + 1
        stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
        stream = await stub.rpc_download_update(
            averaging_pb2.JoinRequest(gather=encode_update_request(rounds_done, self.proof())))
        metadata, parts, received = None, [], 0
        try:
            async for message in stream:
                if message.metadata and metadata is None:
                    metadata = self.serializer.loads(message.metadata)
                received += len(message.tensor_part.buffer)
                if received > max_bytes or len(parts) >= max_parts:
                    raise ValueError(f"sent more than the {max_bytes} bytes of an update")
                parts.append(message.tensor_part)
        finally:
            await stream.aclose()
        if not parts:
            raise ValueError(f"does not hold outer step {rounds_done + 1}")
        head = parts[0]
        if head.compression != runtime_pb2.CompressionType.NONE or head.dtype != "float16" \
                or list(head.size) != [numel] or received != max_bytes:
            raise ValueError(f"update is {head.dtype!r:.20} of size {list(head.size)[:4]} in {received} bytes, "
                             f"expected float16 [{numel}] in {max_bytes}")
        if not isinstance(metadata, dict) or metadata.get("v") != UPDATE_VERSION \
                or metadata.get("rounds_done") != rounds_done + 1:
            raise ValueError(f"update metadata does not describe outer step {rounds_done + 1}")
        round = metadata.get("round")
        if not isinstance(round, int) or isinstance(round, bool) or not 0 < round < 2**40:
            raise ValueError("update metadata has a bad round")
        update = deserialize_torch_tensor(combine_from_streaming(parts))
        if not torch.isfinite(update).all():
            raise ValueError("update has non-finite values")
        return AppliedUpdate(round, rounds_done + 1, update)

    async def _receive_slice(self, peer: str, index: int, count: int, expected_numel: int,
                             stall_timeout: float) -> tuple[Any, torch.Tensor]:
        """Receive one slice, refusing early what could not be right: more bytes or parts than the
        slice needs (a hostile donor cannot make us buffer more), compression, another dtype or size."""
        max_bytes = expected_numel * STATE_BYTES_PER_VALUE
        max_parts = max_bytes // STREAMING_CHUNK_SIZE_BYTES + 1
        stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
        stream = await stub.rpc_download_state_slice(
            averaging_pb2.JoinRequest(gather=encode_slice_request(index, count, self.proof())))
        metadata, parts, received = None, [], 0
        try:
            async for message in aiter_with_timeout(stream, timeout=stall_timeout):
                if message.metadata and metadata is None:
                    metadata = self.serializer.loads(message.metadata)
                received += len(message.tensor_part.buffer)
                if received > max_bytes or len(parts) >= max_parts:
                    raise ValueError(f"sent more than the {max_bytes} bytes of slice {index}/{count}")
                if parts and message.tensor_part.dtype:
                    raise ValueError("sent more than one tensor")
                parts.append(message.tensor_part)
        except TimeoutError:
            raise TimeoutError(f"silent for {stall_timeout:.1f}s") from None
        finally:
            await stream.aclose()
        if metadata is None or not parts:
            raise ValueError("did not share its state")
        head = parts[0]
        if head.compression != runtime_pb2.CompressionType.NONE or head.dtype != "float32":
            raise ValueError(f"slice is {runtime_pb2.CompressionType.Name(head.compression)} {head.dtype!r:.20},"
                             " expected uncompressed float32")
        if list(head.size) != [expected_numel] or received != max_bytes:
            raise ValueError(f"slice of size {list(head.size)[:4]} in {received} bytes,"
                             f" expected [{expected_numel}]")
        return metadata, deserialize_torch_tensor(combine_from_streaming(parts))
