"""The butterfly all-reduce of pseudo-gradients, on hivemind's ``DecentralizedAverager``.

Hazards this module owns (docs/hivemind.md):
- The averager is a forked process sharing our buffer through shared memory. It must be created
  before CUDA is initialised and before other threads start, and it sets SIGINT to ignored in
  the parent: the caller restores its handler.
- The averager holds the ``get_tensors()`` lock for the whole all-reduce. We write the buffer
  before triggering the all-reduce and read it only after the step's future resolves; nothing
  else touches it (the loop never sees this buffer).
- A "successful" step can leave parts un-averaged; the gather carries anchor fingerprints so the
  next round can detect that (``averaging.math.fingerprints``).
- A state download runs one host thread per donor (``averaging.network.slices``), each blocked on an
  MPFuture while the averager process receives its slice; donors serve slices from their averager
  process, which asks the host's state-fetcher thread for a full copy of the state per request.
- That fetcher thread takes no arguments: to ask the host for something else (a past outer update,
  for a peer catching up) the averager process writes the request into a shared-memory slot first,
  and one asyncio lock serializes every request to the host (``ShoalAverager._ask_host``).
- Matchmaking for round r+1 may start while round r's all-reduce still runs (the prepare lane).
  hivemind's ``rpc_aggregate_part`` refuses a part for a group it has not registered yet as soon
  as *any* group (un)registers, and a group registers only once its step is triggered: the end of
  round r's all-reduce would then refuse round r+1's early parts. ``ShoalAverager`` waits for the
  registration instead, for up to the sender timeout, unless the step that matched the group has
  ended without running it (cancelled while it awaited its trigger): then it refuses at once, and
  the members stop waiting for us (``RobustAllReduceRunner._drop_absent_sender``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import typing
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind import DHT, DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, aiter_with_timeout, as_aiter, azip
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import STREAMING_CHUNK_SIZE_BYTES, combine_from_streaming, split_for_streaming

from averaging.math.error_feedback import balanced_part_size
from averaging.math.robust import BanList, RobustConfig
from averaging.math.traffic import STATE_BYTES_PER_VALUE
from averaging.math.wire import OPEN_GROUP_PARTS, WireFormat
from averaging.network.hivemind.allreduce import (
    GroupRefused,
    RobustAllReduceRunner,
    RobustCounters,
    ShoalMatchmaking,
    ShoalPotentialLeaders,
    gathered_proof,
    vet_group,
)
from averaging.network.hivemind.allreduce import check_hivemind as check_robust_hooks
from averaging.network.hivemind.codecs import AVERAGE_RETURN_CODES, ShoalCodec
from averaging.network.hivemind.parts import REDUCER_SHARE, SENDER_SHARE, part_timeouts
from averaging.network.interface import (
    PARTIAL_ERROR,
    AppliedUpdate,
    AverageOutcome,
    CheckSlice,
    DownloadedState,
    Progress,
)
from averaging.network.slices import (
    SameState,
    default_slice_count,
    download_slices,
    flat_slice,
    slice_alignment,
    slice_bounds,
    slice_deadline_s,
)
from protocols.admission import admitted, make_proof
from protocols.messages import MAX_ROUND
from protocols.state_slices import (
    decode_slice_request,
    decode_update_request,
    encode_slice_request,
    encode_update_request,
)

logger = logging.getLogger(__name__)

FLOAT_COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {"fp16": Float16Compression, "fp32": NoCompression}


def averager_compression(wire: WireFormat, *, numel: int, target_group_size: int | None) -> CompressionBase:
    """The averager's ``compression``: hivemind's own for fp16/fp32, else shoal's codec with parts
    balanced for the target group and cut on block boundaries (``WireFormat.part_values``), so the
    reducers' re-encoding of an error-fed send is lossless. Importing ``averaging.network.hivemind.codecs``
    (above) registered the codecs in this process; the averager forks after, and inherits them."""
    if not wire.quantized:
        return FLOAT_COMPRESSIONS[wire.code]()
    return ShoalCodec(wire.code, return_code=wire.return_code, block_size=wire.block_size,
                      part_values=wire.part_values(numel, target_group_size))

def float_part_bytes(wire: WireFormat, numel: int) -> int:
    """hivemind's ``part_size_bytes`` for fp16/fp32: parts balanced over any usual group size
    (``OPEN_GROUP_PARTS``) instead of fixed 512 KiB parts, which hand a vector of a few parts out
    unevenly (1, 1, 0, 2 parts over 4 peers). Depends only on what peers share (layout and codec):
    every peer must cut the same parts."""
    bytes_per_value = wire.send_bytes_per_value()
    return int(balanced_part_size(numel, OPEN_GROUP_PARTS, 1, bytes_per_value=bytes_per_value) * bytes_per_value)


StateProvider = Callable[[], tuple[dict, list[torch.Tensor]]]
UpdateProvider = Callable[[int], AppliedUpdate | None]
FETCH_GRACE_S = 5.0  # how much longer the host waits for a slice than the averager process may take
LOOKING = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
ASSEMBLY_LATENCY_S = 0.5  # a leader's group message to its followers, beyond request_timeout
RECENT_ALLREDUCES = 3  # the part timeouts follow the longest of the last few all-reduces
ENDED_GROUPS_KEPT = 256  # group ids of finished steps remembered (parts for them are refused at once)
STATE_REQUEST = -1  # the host-request slot's value for "the state" (else: an update's rounds_done)
# The key under which the averager process adds, to a step's gathered reports, the fraction of the
# average that did not arrive (a reducer failed: ``ShoalAverager._aggregate_with_group``). Not a
# peer id (those are base58 multihashes), so no member's report can collide with it.
PARTIAL_KEY = "shoal:partial"
# Likewise: the members on our ban list when the all-reduce ended (refused in it, or before). Their
# reports are dropped before the consistency check: a peer we just refused must not win a tie.
DISTRUSTED_KEY = "shoal:distrusted"
UPDATE_VERSION = 1
# What a donor serves at once (state slices and outer updates), so that requests cannot exhaust
# its host: an honest joiner has one fetch in flight per donor (averaging.network.slices); one more
# covers a retry racing the end of the previous stream. Beyond these, a request gets an empty
# answer (the joiner moves to another donor) and the refusal is logged once a minute per peer.
MAX_SERVES_PER_PEER = 2
MAX_SERVES = 8
# Slice requests within this many seconds share one copy of the state: the host copies its whole
# state per request (8 bytes/param under the state lock), so a stream of requests, honest (one
# download is 2 slices per donor) or not, costs one copy per period, not one per request.
STATE_COPY_REUSE_S = 3.0
BUSY_LOG_PERIOD_S = 60.0


class ShoalAverager(DecentralizedAverager):
    """hivemind's averager plus what it lacks: a pluggable state provider, a state download cut
    into slices that several donors serve at once (``averaging.network.slices``), and robust aggregation
    (``averaging.network.hivemind.allreduce``; ``robust=None`` keeps hivemind's plain weighted mean)."""

    # Hazard: hivemind caches the RPC table per class but finds the cache through the MRO, so a
    # plain DecentralizedAverager set up earlier in this process would lend us a table without
    # rpc_download_state_slice. Our own empty slots make hivemind build ours.
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, *args, state_provider: StateProvider, update_provider: UpdateProvider | None = None,
                 registration_wait: float = 10.0, robust: RobustConfig | None = None,
                 admission: bytes | None = None, **kwargs):
        self._state_provider = state_provider
        # A private swarm's admission key (protocols.admission): every request we serve and every
        # member of a group we join must prove it; None (a public swarm) admits everyone.
        self._admission = admission
        self._update_provider = update_provider
        self._registration_wait = registration_wait
        # Several threads (downloads, the prepare lane) send commands at once; a pipe has no lock
        # for concurrent writers.
        self._command_lock = threading.Lock()
        # What the averager process asks the host for (see the module docstring); shared memory,
        # created before the fork.
        self._host_request = torch.full((1,), STATE_REQUEST, dtype=torch.int64).share_memory_()
        # The all-reduce's sender and reducer timeouts, set by the host from measured all-reduces
        # (0: as configured); shared memory, read by the averager process at each all-reduce.
        self._part_timeouts = torch.zeros(2, dtype=torch.float64).share_memory_()
        self._host_lock: asyncio.Lock | None = None  # averager process, created on its event loop
        self._running: set[asyncio.Task] = set()  # averager process: commands in flight (_kept_alive)
        # Averager process: requests being served per peer, the shared state copy, refusals logged.
        self._serving: Counter[str] = Counter()
        self._state_copy: tuple[float, Any] | None = None
        self._state_copy_lock: asyncio.Lock | None = None
        self._busy_logged: dict[str, float] = {}
        if changed := check_robust_hooks():
            raise RuntimeError(f"hivemind changed {', '.join(changed)} since shoal's robust all-reduce was "
                               "written; re-check averaging/network/hivemind/allreduce.py against it before running")
        self._robust = robust
        # The ban list lives in the averager process (this object is forked with it); the counters
        # are shared memory, for the host.
        self._ban_list = BanList(robust.ban_rounds if robust is not None else 0)
        self.robust_counters = RobustCounters()
        # Averager process: the fraction of the average each running group failed to deliver.
        self._partial: dict[bytes, float] = {}
        # Averager process: groups our steps matched that will not run (any more), oldest first.
        self._ended_groups: dict[bytes, None] = {}
        target = kwargs.get("target_group_size")
        self._max_group_size = min(robust.max_group_size if robust is not None else 2**31, target or 2**31)
        super().__init__(*args, **kwargs)

    # hivemind builds its Matchmaking in the averager process (``self._matchmaking = Matchmaking(...)``
    # in ``_run``, no hook): this setter gives it our class, which keeps banned peers out of groups.
    @property
    def _matchmaking(self) -> ShoalMatchmaking:
        try:
            return self.__dict__["_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Matchmaking) -> None:
        matchmaking.__class__ = ShoalMatchmaking
        matchmaking.ban_list = self._ban_list
        matchmaking.matched = {}
        # A group must reach its followers before they give up (robust_allreduce.declared_expiration):
        # a leader's answer can wait up to request_timeout behind its own join request, plus latency.
        matchmaking.potential_leaders.__class__ = ShoalPotentialLeaders
        matchmaking.potential_leaders.margin = matchmaking.request_timeout + ASSEMBLY_LATENCY_S
        self.__dict__["_matchmaking"] = matchmaking

    @contextlib.contextmanager
    def _kept_alive(self):
        """Hold a strong reference to the running command's task. hivemind's command loop drops the
        task it creates per command, and what a step waits on (its trigger, an MPFuture) refers to
        it only weakly: a garbage collection while a step awaits its trigger destroyed the step
        ("Task was destroyed but it is pending"), and its group waited for its parts until their
        sender timeout (seen with a slow peer: a 40 s stall, then rounds lost)."""
        task = asyncio.current_task()
        self._running.add(task)
        try:
            yield
        finally:
            self._running.discard(task)

    async def _step(self, *, step: StepControl, **kwargs):
        # A ban counts averaging rounds (one step each), whether or not a group formed: counted in
        # all-reduces, a ban of our only possible partner never ended (no group, so no all-reduce).
        self._ban_list.next_round()
        with self._kept_alive():
            try:
                return await super()._step(step=step, **kwargs)
            finally:
                self._end_groups(self._matchmaking.matched.pop(id(step), ()))

    def _end_groups(self, group_ids: Sequence[bytes]) -> None:
        """The groups a finished step matched will never (again) be registered: a part for one of
        them is refused at once. A step cancelled while it awaited its trigger (its round was
        passed, or its sync timed out) had told its group it was in; without this, every member's
        part to us waited the whole registration wait (0.4 x allreduce_timeout) and the members'
        all-reduce stalled that long (24 s of 6 s rounds in test_slow_sync, 1 CI run in 4)."""
        for group_id in group_ids:  # unregistered by now (hivemind's _register_allreduce_group)
            self._ended_groups[group_id] = None
        while len(self._ended_groups) > ENDED_GROUPS_KEPT:
            del self._ended_groups[next(iter(self._ended_groups))]

    def set_part_timeouts(self, sender_timeout: float, reducer_timeout: float) -> None:
        """Host: the timeouts the next all-reduces use (``averaging.network.hivemind.parts``)."""
        self._part_timeouts.copy_(torch.tensor([sender_timeout, reducer_timeout], dtype=torch.float64))

    def get_current_state(self):
        # Runs in the host process, in hivemind's state-fetcher thread.
        request = int(self._host_request[0])
        if request == STATE_REQUEST:
            metadata, tensors = self._state_provider()
            return metadata, tensors, None
        update = self._update_provider(request) if self._update_provider is not None else None
        if update is None:
            return {"v": UPDATE_VERSION, "missing": True}, [], None
        return {"v": UPDATE_VERSION, "round": update.round, "rounds_done": update.rounds_done}, [update.update], None

    async def _ask_host(self, request: int):
        """The host's answer to ``request`` (the state, or an update): one request at a time."""
        if self._host_lock is None:
            self._host_lock = asyncio.Lock()
        async with self._host_lock:
            self._host_request[0] = request
            try:
                return await super()._get_current_state_from_host_process()
            finally:
                self._host_request[0] = STATE_REQUEST

    async def _get_current_state_from_host_process(self):
        return await self._ask_host(STATE_REQUEST)

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, but a part for a group we have not registered yet waits for the registration
        (bounded) instead of being refused when another group (un)registers (module docstring)."""
        request = await anext(stream)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._registration_wait
        while (request.group_id not in self._running_groups and request.group_id not in self._ended_groups
               and loop.time() < deadline):
            await asyncio.sleep(0.05)
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            # Hold the stream until the sender has read that and hung up: returning with its parts
            # still unread resets the stream, and the sender often saw a broken pipe instead of
            # BAD_GROUP_ID, so it did not know to stop waiting for our parts (a 16 s stall in
            # tests/integration/test_cancelled_step.py, half the runs).
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_drain(stream), timeout=self._registration_wait)
            return
        group = await future
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    # -- robust all-reduce (averager process) ------------------------------------------------
    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        # The leader's group, vetted: size cap, our own entry, bandwidths dropped (vet_group).
        try:
            group_info = vet_group(group_info, peer_id=self.peer_id, bandwidth=self.bandwidth, mode=self.mode,
                                   max_group_size=self._max_group_size, serializer=self.serializer,
                                   admission=self._admission)
        except GroupRefused as e:
            logger.warning(f"refused group {group_info.group_id.hex()[:8]} of {len(group_info.peer_ids)}: {e}")
            raise MatchmakingException(f"refused the group: {e}") from None
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            missing = self._partial.pop(group_info.group_id, 0.0)
        # A partial result (hivemind keeps our local values where a reducer failed) would move our
        # anchor somewhere no other member's is: the host must not apply it (``HivemindBackend.average``).
        if missing > 0:
            gathered = {**gathered, PARTIAL_KEY: missing}
        distrusted = [str(peer) for peer in group_info.peer_ids
                      if peer != self.peer_id and self._ban_list.is_banned(str(peer))]
        return {**gathered, DISTRUSTED_KEY: distrusted} if distrusted else gathered

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs):
        """hivemind's method (1.1.12, checked by ``robust_allreduce.check_hivemind``) with our runner
        (hivemind's own with ``robust=None``), and what part of the result never arrived."""
        group_id = group_info.group_id if group_id is None else group_id
        sender_timeout, reducer_timeout = self._part_timeouts.tolist()
        if reducer_timeout > 0:  # the host's scaled timeouts (averaging.network.hivemind.parts), once it measured any
            kwargs.update(sender_timeout=sender_timeout, reducer_timeout=reducer_timeout)
        common = dict(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
                      ordered_peer_ids=group_info.peer_ids, **kwargs)
        if self._robust is None:
            runner = AllReduceRunner(**common)
        else:
            runner = RobustAllReduceRunner(robust_config=self._robust, ban_list=self._ban_list,
                                           counters=self.robust_counters, **common)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
        container = runner.tensor_part_container
        if container.failed_size:
            self._partial[group_id] = container.failed_size / max(1, container.total_size)

    # -- donor side -------------------------------------------------------------------------
    # Hazard: the annotations must be typing.AsyncIterator: hivemind detects a streaming RPC by
    # the hint's ``_name``, which collections.abc.AsyncIterator[...] does not have.
    def proof(self) -> bytes | None:
        """What our requests carry to show we hold the swarm key (None in a public swarm)."""
        return make_proof(self._admission, str(self.peer_id)) if self._admission is not None else None

    def _refused(self, what: str, proof: object, context: P2PContext) -> bool:
        """True (and logged, naming the peer) if the caller did not prove the swarm key."""
        if admitted(self._admission, str(context.remote_id), proof):
            return False
        logger.warning(f"refused {what} from {context.remote_id}: it did not prove the swarm key")
        return True

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's, after the joiner's gather proved the swarm key (a private swarm)."""
        if self._admission is not None and self._refused("a join request",
                                                         gathered_proof(self.serializer, request.gather), context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

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

    # -- joiner side ------------------------------------------------------------------------
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
                future.set_exception(RuntimeError(_describe(e)))
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
                future.set_exception(RuntimeError(_describe(e)))
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


class HivemindBackend:
    """Owns one ``ShoalAverager``; used only from the sync worker's thread (one owner)."""

    averager_class: type[ShoalAverager] = ShoalAverager  # tests put a faulty subclass here

    def __init__(
        self,
        dht: DHT,
        *,
        numel: int,
        prefix: str,
        state_provider: StateProvider,
        update_provider: UpdateProvider | None = None,
        wire: WireFormat | None = None,
        target_group_size: int | None = None,
        min_group_size: int = 2,
        min_matchmaking_time: float = 3.0,
        request_timeout: float = 1.5,
        allreduce_timeout: float = 60.0,
        client_mode: bool = False,
        state_lengths: Sequence[int] | None = None,
        robust: RobustConfig | None = RobustConfig(),
        admission: bytes | None = None,
    ):
        """``admission``: a private swarm's admission key (``protocols.admission.admission_key``)."""
        # request_timeout < min_matchmaking_time, or matchmaking can deadlock (docs/hivemind.md).
        assert request_timeout < min_matchmaking_time
        wire = wire or WireFormat()
        if robust is None and wire.return_code in AVERAGE_RETURN_CODES:
            raise ValueError(f"{wire.return_code} returns need shoal's all-reduce runner: pass a RobustConfig")
        extra = {} if wire.quantized else {"part_size_bytes": float_part_bytes(wire, numel)}
        self._averager = self.averager_class(
            averaged_tensors=[torch.zeros(numel, dtype=torch.float32)],
            dht=dht,
            start=True,
            prefix=prefix,
            state_provider=state_provider,
            update_provider=update_provider,
            registration_wait=allreduce_timeout * SENDER_SHARE,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            # Until all-reduces are measured (then averaging.network.hivemind.parts scales them); hivemind
            # requires sender < reducer timeout.
            sender_timeout=allreduce_timeout * SENDER_SHARE,
            reducer_timeout=allreduce_timeout * REDUCER_SHARE,
            compression=averager_compression(wire, numel=numel, target_group_size=target_group_size),
            state_compression=NoCompression(),  # shared state must arrive exact
            client_mode=client_mode,
            shutdown_timeout=3,
            robust=robust,
            admission=admission,
            **extra,
        )
        self.peer_id = str(dht.peer_id)
        # What state_provider returns: by default anchor and momentum (OuterState.shared_state).
        self._state_lengths = list(state_lengths) if state_lengths is not None else [numel, numel]
        self._request_timeout = request_timeout
        self._allreduce_timeout = allreduce_timeout
        self._recent_allreduce_s: deque[float] = deque(maxlen=RECENT_ALLREDUCES)
        # Steps by round: prepare (the prepare lane) and average (the sync lane) run on two threads.
        self._controls: dict[int, StepControl] = {}
        self._controls_lock = threading.Lock()

    def prepare(self, *, round: int, scheduled_time: float, gather: dict, timeout: float) -> None:
        # Older rounds' steps stay: their syncs may still be queued on the sync lane (a sync can
        # outlast a round, and the next one waits behind it); ``average`` cancels the ones it passed.
        self._settle_matchmaking(before=round)
        with self._averager._command_lock:
            # The round goes into the matchmaking key (hivemind's group bits), so a peer still
            # finishing round r-1 can never pull a peer of round r into its group (or wait for it).
            self._averager.set_group_bits(round_bits(round))
            proof = self._averager.proof()
            control = self._averager.step(
                gather=gather if proof is None else {**gather, "admit": proof},
                scheduled_time=scheduled_time,
                timeout=max(timeout, scheduled_time - time.time() + self._request_timeout),
                require_trigger=True,
                wait=False,
            )
        with self._controls_lock:
            self._controls[round] = control

    def _settle_matchmaking(self, *, before: int, wait_s: float = 5.0) -> None:
        """The group bits are the averager's, not a step's: changing them while an older round's
        step is still looking for a group would move that step into this round's key. Let it find
        its group (or give up) first; one still looking after ``wait_s`` is a round late, cancel it."""
        with self._controls_lock:
            older = [c for r, c in self._controls.items() if r < before]
        deadline = time.monotonic() + wait_s
        for control in older:
            while not control.done() and control.stage in LOOKING and time.monotonic() < deadline:
                time.sleep(0.05)
            if not control.done() and control.stage in LOOKING:
                logger.warning("an older round's matchmaking was still running; cancelled it")
                control.cancel()

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float,
                round: int | None = None) -> AverageOutcome:
        with self._controls_lock:
            if round is None and self._controls:
                round = max(self._controls)
            control = self._controls.pop(round, None)
            # Syncs run in round order: a step of an older round will never be averaged (that round
            # was skipped or jumped); cancel it, so no group waits for it.
            passed = [self._controls.pop(r) for r in [r for r in self._controls if round is not None and r < round]]
        for old in passed:
            if not old.done():
                old.cancel()
        if control is None:
            logger.warning(f"round {round}: no averaging step was prepared (steps held: {sorted(self._controls)})")
            return AverageOutcome(ok=False, error="no averaging step was prepared")
        if control.done():
            return AverageOutcome(ok=False, error=f"matchmaking ended early: {_reason(control)}")
        # 1. Fill the buffer while the averager cannot be using it (the step waits for our trigger).
        with self._averager.get_tensors() as (buffer,):
            buffer.copy_(vector)
        control.weight = float(weight)
        started, started_wall = time.perf_counter(), time.time()
        control.allow_allreduce()
        # 2. Wait for the group; a failure keeps the caller's vector as it was.
        try:
            gathered = control.result(timeout=timeout)
        except Exception as e:
            control.cancel()
            return AverageOutcome(ok=False, sync_s=time.perf_counter() - started, error=_describe(e))
        sync_s = time.perf_counter() - started
        allreduce_s = time.time() - max(started_wall, control.scheduled_time)
        if not gathered:
            return AverageOutcome(ok=False, sync_s=sync_s, error="averaging returned no group")
        missing = gathered.pop(PARTIAL_KEY, 0.0)
        distrusted = set(gathered.pop(DISTRUSTED_KEY, ()))
        gathered_by_peer = {str(peer): data for peer, data in gathered.items()}
        group = tuple(sorted(gathered_by_peer))
        # A member our robust aggregation refused speaks no more in this round's consistency check
        # (seen: a two-member group with a peer banned that round, which then won the tie and
        # the honest peer re-synced to its state).
        gathered_by_peer = {peer: data for peer, data in gathered_by_peer.items() if peer not in distrusted}
        if missing:
            # Our vector stays as it was: the round folds, and the step the others applied is
            # replayed from their history next round (OuterState.catch_up), not re-downloaded.
            return AverageOutcome(ok=False, group=group, sync_s=sync_s, allreduce_s=allreduce_s, partial=missing,
                                  error=f"{PARTIAL_ERROR}: {missing:.1%} of the average never arrived (a "
                                        "reducer failed, named in the log); this round's work is kept for the next")
        # 3. Read the result only after the step finished (the averager released the lock).
        with self._averager.get_tensors() as (buffer,):
            vector.copy_(buffer)
        self._note_allreduce(allreduce_s)
        return AverageOutcome(ok=True, group=group, gathered=gathered_by_peer, sync_s=sync_s, allreduce_s=allreduce_s)

    def _note_allreduce(self, seconds: float) -> None:
        """An all-reduce succeeded in ``seconds``: scale the part timeouts to it. Only whole ones
        measure the link: a partial one lasted as long as the timeout that failed it, and scaling
        to that made every later failure wait longer (a round skipped in test_swarm)."""
        self._recent_allreduce_s.append(seconds)
        sender, reducer = part_timeouts(self._recent_allreduce_s, self._allreduce_timeout)
        self._averager.set_part_timeouts(sender, reducer)

    def download_state(self, peers: list[str], *, timeout: float, progress: Progress | None = None,
                       slices: int | None = None, same_state: SameState | None = None,
                       max_round: int = MAX_ROUND, check: CheckSlice | None = None) -> DownloadedState | None:
        """Fetch the shared state from all of ``peers`` at once, in ``slices`` slices (default: two
        per donor); None if it cannot be completed from slices of one round.

        ``timeout`` is how long a donor may stay silent; a slice also has a deadline that grows with
        its size (``slice_deadline_s``). Threads: this runs in the caller's thread (the sync
        worker's), which also calls ``progress(done_bytes, total_bytes)``; each slice is fetched by a
        pool thread that waits on the averager process, where the network transfer runs."""
        donors = [peer for peer in dict.fromkeys(peers) if peer != self.peer_id]
        total = sum(self._state_lengths)
        if not donors or total == 0:
            return None
        align = slice_alignment(self._state_lengths[0])
        count = slices if slices is not None else default_slice_count(len(donors), total, align)
        deadline_s = slice_deadline_s(timeout, STATE_BYTES_PER_VALUE * (-(-total // count) + align))

        def fetch(donor: str, index: int, count: int) -> tuple[Any, torch.Tensor]:
            start, stop = slice_bounds(total, index, count, align)
            return self._averager.fetch_slice(donor, index, count, expected_numel=stop - start,
                                              stall_timeout=timeout, deadline_s=deadline_s)

        # The scheduler's own timeout is a backstop behind fetch_slice's (which cancels its future).
        result = download_slices(donors, lengths=self._state_lengths, count=count, fetch=fetch, progress=progress,
                                 slice_timeout=deadline_s + 2 * FETCH_GRACE_S, same_state=same_state,
                                 max_round=max_round, align=align, check=check)
        if result is None:
            return None
        served = tuple(sorted(result.served))
        return DownloadedState(peer=",".join(served), metadata=result.metadata, tensors=result.tensors,
                               donors=served)

    def robustness(self) -> dict[str, int]:
        """What robust aggregation refused since start (senders, reducers' returns, clipped parts,
        bans), for the round engine's metrics; the peers are named in the averager's log."""
        return self._averager.robust_counters.snapshot()

    @property
    def pid(self) -> int | None:
        """The averager process (its p2pd is the DHT's), for the caller's clean-up."""
        return self._averager.pid

    def fetch_update(self, peers: list[str], *, rounds_done: int, numel: int,
                     timeout: float) -> AppliedUpdate | None:
        """The update after ``rounds_done`` steps from the first of ``peers`` that sends a valid one."""
        for peer in dict.fromkeys(peers):
            if peer == self.peer_id:
                continue
            try:
                return self._averager.fetch_update(peer, rounds_done, numel=numel, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - any failure sends us to the next peer
                logger.info(f"outer step {rounds_done + 1} from {peer}: {_describe(e)}")
        return None

    def shutdown(self) -> None:
        with self._controls_lock:
            controls, self._controls = list(self._controls.values()), {}
        for control in controls:
            if not control.done():
                control.cancel()
        if self._averager.is_alive():
            self._averager.shutdown()


async def _drain(stream: typing.AsyncIterator) -> None:
    async for _ in stream:
        pass


def round_bits(round: int) -> str:
    """Matchmaking key bits for ``round``: neighbouring rounds always differ."""
    return format(round % 16, "04b")


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _reason(control: StepControl) -> str:
    try:
        control.result(timeout=0)
    except BaseException as e:  # noqa: BLE001 - we only describe it
        return _describe(e)
    return "finished without an all-reduce"
