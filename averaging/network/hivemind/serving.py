"""The donor side of the state download: serving state slices and past outer steps to peers.

A mixin of ``ShoalAverager``; runs in the averager process, which asks the host's state-fetcher
thread for a copy of the state (``ShoalAverager._ask_host``), one copy per ``STATE_COPY_REUSE_S``.
What a donor serves is bounded (``ServingBook``: requests at once, a deadline each, bytes per peer
per window) so that requests, honest or not, cannot exhaust the host or starve other joiners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass

from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from averaging.math.wire import STATE_BYTES_PER_VALUE
from averaging.network.slices import flat_slice, slice_alignment, slice_bounds, slice_deadline_s
from protocols.state_slices import decode_slice_request, decode_update_request

logger = logging.getLogger(__name__)

# What a donor serves at once: an honest joiner has one fetch in flight per donor, plus a retry
# racing the end of the previous stream. Beyond these a request gets an empty answer.
MAX_SERVES_PER_PEER = 2
MAX_SERVES = 8
# Slice requests within this many seconds share one copy of the state (a copy is 8 bytes/param
# taken under the state lock).
STATE_COPY_REUSE_S = 3.0
BUSY_LOG_PERIOD_S = 60.0
# A serve's deadline, from its first message: this long, plus its bytes at the slowest rate a joiner
# accepts (slices.slice_deadline_s); past it the joiner has stopped reading and its slot is freed.
SERVE_STALL_S = 30.0
# What one peer is served per window (a token bucket): a few full states, or four times as many
# outer updates; an honest joiner takes at most one or two states from a donor per download.
DOWNLOAD_WINDOW_S = 600.0
DOWNLOAD_BUDGET_STATES = 4
FULL_STATE_BYTES_PER_VALUE = 2 * STATE_BYTES_PER_VALUE
UPDATE_BYTES_PER_VALUE = 2  # fp16, as kept


@dataclass(eq=False, slots=True)
class Serve:
    """One request being served, from admission until its stream ends."""

    peer: str
    what: str  # for log lines: "a state slice", "an outer update"
    started: float | None = None  # its first message; before it, we wait on our own host (no deadline)
    sent: int = 0  # bytes handed to hivemind

    def deadline(self) -> float:
        if self.started is None:
            return float("inf")
        return self.started + slice_deadline_s(SERVE_STALL_S, self.sent)


class ServingBook:
    """Who is being served and what each peer was served lately (averager process, its event loop
    only; the clock passed in for tests).

    Hazard: hivemind 1.1.12 awaits ``writer.drain()`` with no timeout after each message a handler
    yields, so the handler of a joiner that stops reading hangs in its ``yield`` for good and its
    ``finally`` never runs: a serve past its deadline is forgotten here without waiting for it."""

    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._serves: set[Serve] = set()  # within their deadline, as of the last admission
        self._left: dict[str, tuple[float, float]] = {}  # peer -> (budget bytes left, when); absent: all
        self._logged: dict[str, float] = {}

    def admit(self, peer: str, what: str, size: int) -> Serve | str:
        """A serve of ``size`` bytes to ``peer`` (charged to its budget now), or why it is refused."""
        now = self._clock()
        self._serves = {serve for serve in self._serves if now <= serve.deadline()}  # past deadline: never again
        ours = sum(serve.peer == peer for serve in self._serves)
        if ours >= MAX_SERVES_PER_PEER or len(self._serves) >= MAX_SERVES:
            return (f"{ours} of its requests and {len(self._serves)} in all are being served (limits "
                    f"{MAX_SERVES_PER_PEER} and {MAX_SERVES})")
        self._refill(now)
        left = self._left.get(peer, (self.budget_bytes, now))[0]
        if size > left:
            return (f"it would exceed its download budget ({self.budget_bytes / 2**20:.1f} MiB per "
                    f"{DOWNLOAD_WINDOW_S:.0f}s; {left / 2**20:.1f} MiB left, {size / 2**20:.1f} MiB asked)")
        self._left[peer] = (left - size, now)
        serve = Serve(peer, what)
        self._serves.add(serve)
        return serve

    def _refill(self, now: float) -> None:
        """Every bucket refilled to ``now``; a full one is forgotten (few entries, however many peers)."""
        rate = self.budget_bytes / DOWNLOAD_WINDOW_S
        for peer, (left, at) in list(self._left.items()):
            left = min(self.budget_bytes, left + (now - at) * rate)
            if left >= self.budget_bytes:
                del self._left[peer]
            else:
                self._left[peer] = (left, now)

    def send(self, serve: Serve, size: int) -> bool:
        """Whether ``serve`` may hand its next ``size`` bytes to hivemind (False: past its deadline)."""
        now = self._clock()
        if serve.started is None:
            serve.started = now
        elif now > serve.deadline():
            return False
        serve.sent += size
        return True

    def release(self, serve: Serve) -> None:
        self._serves.discard(serve)

    def should_log(self, peer: str) -> bool:
        """True at most once per ``BUSY_LOG_PERIOD_S`` per peer."""
        now = self._clock()
        if now - self._logged.get(peer, -BUSY_LOG_PERIOD_S) < BUSY_LOG_PERIOD_S:
            return False
        for other, at in list(self._logged.items()):  # bounded by the peers refused within a period
            if now - at >= BUSY_LOG_PERIOD_S:
                del self._logged[other]
        self._logged[peer] = now
        return True


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
        # Charged before the copy: 1/count of a full state of ours (the slice itself is cut below).
        size = -(-FULL_STATE_BYTES_PER_VALUE * self.total_size // count)
        with self._serving_slot(str(context.remote_id), "a state slice", size) as serve:
            if serve is None:
                return
            metadata, tensors, _ = await self._shared_state_copy()
            start, stop = slice_bounds(sum(t.numel() for t in tensors), index, count,
                                       slice_alignment(tensors[0].numel() if tensors else 0))
            serialized = serialize_torch_tensor(flat_slice(tensors, start, stop), runtime_pb2.CompressionType.NONE)
            del tensors
            async for message in self._stream(serve, metadata, serialized):
                yield message

    @contextlib.contextmanager
    def _serving_slot(self, peer: str, what: str, size: int):
        """Yields the ``Serve`` of ``peer``'s request of ``size`` bytes, or None if it is refused now
        (``ServingBook.admit``; refusals are logged once a minute per peer)."""
        book = self._book()
        serve = book.admit(peer, what, size)
        if isinstance(serve, str):
            if book.should_log(peer):
                logger.warning(f"refused {what} to {peer}: {serve}; logged once a minute per peer")
            yield None
            return
        try:
            yield serve
        finally:
            book.release(serve)

    def _book(self) -> ServingBook:
        # Created on first use, in the averager process (the averager's own fields predate it).
        book = self.__dict__.get("_serving_book")
        if book is None:
            budget = DOWNLOAD_BUDGET_STATES * FULL_STATE_BYTES_PER_VALUE * self.total_size
            book = self.__dict__["_serving_book"] = ServingBook(budget)
        return book

    async def _stream(self, serve: Serve, metadata: bytes,
                      serialized: runtime_pb2.Tensor) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """``serialized`` in hivemind's streaming parts, metadata in the first; ends early once
        ``serve`` is past its deadline (each ``yield`` returns when hivemind drained the message)."""
        book = self._book()
        for part in split_for_streaming(serialized):
            if not book.send(serve, len(part.buffer) + len(metadata)):
                if book.should_log(serve.peer):
                    logger.warning(f"ended {serve.what} to {serve.peer} after {serve.sent} bytes: past its deadline "
                                   "(it stopped reading, or reads slower than we serve); logged once a minute per peer")
                return
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
            metadata = b""  # only in the first message

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
        size = UPDATE_BYTES_PER_VALUE * self.total_size
        with self._serving_slot(str(context.remote_id), "an outer update", size) as serve:
            if serve is None:
                return
            metadata, tensors, _ = await self._ask_host(rounds_done)
            if not tensors:
                return
            serialized = serialize_torch_tensor(tensors[0], runtime_pb2.CompressionType.NONE)
            del tensors
            async for message in self._stream(serve, metadata, serialized):
                yield message
