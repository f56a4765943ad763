"""The donor side of the state download: serving state slices and past outer steps to peers.

A mixin of ``ShoalAverager`` (``averaging.network.hivemind.averager``); runs in the averager process.
A donor serves slices from its averager process, which asks the host's state-fetcher thread for a
copy of the state (``ShoalAverager._ask_host``). What it serves at once is bounded
(``MAX_SERVES_PER_PEER``, ``MAX_SERVES``) and one copy of the state serves every request within
``STATE_COPY_REUSE_S``, so that requests, honest or not, cannot exhaust the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing

from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from averaging.network.slices import flat_slice, slice_alignment, slice_bounds
from protocols.state_slices import decode_slice_request, decode_update_request

logger = logging.getLogger(__name__)

# What a donor serves at once (state slices and outer updates): an honest joiner has one fetch in
# flight per donor (averaging.network.slices); one more covers a retry racing the end of the
# previous stream. Beyond these, a request gets an empty answer (the joiner moves to another donor)
# and the refusal is logged once a minute per peer.
MAX_SERVES_PER_PEER = 2
MAX_SERVES = 8
# Slice requests within this many seconds share one copy of the state: the host copies its whole
# state per request (8 bytes/param under the state lock), so a stream of requests costs one copy
# per period, not one per request.
STATE_COPY_REUSE_S = 3.0
BUSY_LOG_PERIOD_S = 60.0


class StateServing:
    """``rpc_download_state_slice`` and ``rpc_download_update`` (hazard: the annotations must be
    ``typing.AsyncIterator``: hivemind detects a streaming RPC by the hint's ``_name``)."""

    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """Not served: hivemind's whole-state download carries no request to prove the swarm key
        with, and shoal peers download in slices (``rpc_download_state_slice``). An empty answer."""
        return
        yield  # an async generator

    async def rpc_download_state_slice(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """Stream slice i of n of our flat fp32 state, exactly (no compression), metadata first.
        The request's ``gather`` field carries ``encode_slice_request(i, n)``. Runs in the averager
        process, one task per request; a refusal raises, and hivemind relays the message."""
        if not self.allow_state_sharing:
            return  # like rpc_download_state: an empty answer sends the joiner elsewhere
        index, count, proof = decode_slice_request(request.gather)
        if self._refused("a state download", proof, context):
            return
        with self._serving_slot(str(context.remote_id), "a state slice") as admitted:
            if not admitted:
                return
            metadata, tensors, _ = await self._shared_state_copy()
            start, stop = slice_bounds(sum(t.numel() for t in tensors), index, count,
                                       slice_alignment(tensors[0].numel() if tensors else 0))
            serialized = serialize_torch_tensor(flat_slice(tensors, start, stop), runtime_pb2.CompressionType.NONE)
            del tensors
            for part in split_for_streaming(serialized):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                metadata = b""  # only in the first message

    @contextlib.contextmanager
    def _serving_slot(self, peer: str, what: str):
        """Yields whether ``peer``'s request may be served now (``MAX_SERVES_PER_PEER``, ``MAX_SERVES``)."""
        if self._serving[peer] >= MAX_SERVES_PER_PEER or sum(self._serving.values()) >= MAX_SERVES:
            now = time.monotonic()
            if now - self._busy_logged.get(peer, -BUSY_LOG_PERIOD_S) >= BUSY_LOG_PERIOD_S:
                self._busy_logged[peer] = now
                logger.warning(f"refused {what} to {peer}: {self._serving[peer]} of its requests and "
                               f"{sum(self._serving.values())} in all are being served (limits {MAX_SERVES_PER_PEER}"
                               f" and {MAX_SERVES}; logged once a minute per peer)")
            yield False
            return
        self._serving[peer] += 1
        try:
            yield True
        finally:
            self._serving[peer] -= 1
            if not self._serving[peer]:
                del self._serving[peer]

    async def _shared_state_copy(self):
        """The host's state, copied at most once per ``STATE_COPY_REUSE_S`` for every request that
        arrives meanwhile; the copy is released when the period ends."""
        loop = asyncio.get_running_loop()
        if self._state_copy_lock is None:
            self._state_copy_lock = asyncio.Lock()
        async with self._state_copy_lock:
            if self._state_copy is None or loop.time() - self._state_copy[0] >= STATE_COPY_REUSE_S:
                state = await self._get_current_state_from_host_process()
                self._state_copy = (loop.time(), state)
                loop.call_later(STATE_COPY_REUSE_S, self._release_state_copy, self._state_copy)
            return self._state_copy[1]

    def _release_state_copy(self, copy) -> None:
        if self._state_copy is copy:
            self._state_copy = None

    async def rpc_download_update(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """Stream the outer update that took us from ``rounds_done`` to ``rounds_done + 1`` steps
        (fp16, exactly as kept), metadata first; the request's ``gather`` is ``encode_update_request``.
        Nothing (an empty answer) if we no longer hold it."""
        rounds_done, proof = decode_update_request(request.gather)
        if self._refused("an outer update request", proof, context):
            return
        with self._serving_slot(str(context.remote_id), "an outer update") as admitted:
            if not admitted:
                return
            metadata, tensors, _ = await self._ask_host(rounds_done)
            if not tensors:
                return
            serialized = serialize_torch_tensor(tensors[0], runtime_pb2.CompressionType.NONE)
            del tensors
            for part in split_for_streaming(serialized):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                metadata = b""
