"""``ShoalAverager``: hivemind's ``DecentralizedAverager`` plus what shoal needs of it.

It adds a pluggable state provider, state slices served to several joiners at once and past outer
steps to peers that catch up (``serving``, ``fetching``), robust aggregation (``allreduce``), a
private swarm's admission checks, and matchmaking with the ban list (``matchmaking``). Its
host-side owner is ``averaging.network.hivemind.backend.HivemindBackend``.

Hazards (docs/hivemind.md):
- The averager is a forked process sharing our buffer through shared memory: create it before
  CUDA is initialised and before other threads start; it leaves SIGINT ignored in the parent.
- hivemind's state-fetcher thread (host) takes no arguments: to ask the host for a past outer step
  the averager process writes the request into a shared-memory slot first, and one asyncio lock
  serializes every request (``ShoalAverager._ask_host``).
- Matchmaking for round r+1 may start while round r's all-reduce runs (the prepare lane), and
  hivemind refuses a part for a not-yet-registered group whenever *any* group (un)registers: a
  part waits for its group's registration instead (``registration_wait``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter, azip

from averaging.math.group_view import GroupView, decode_claims, group_view
from averaging.math.lattice import from_residues_, to_residues_
from averaging.math.robust import BanList, RobustConfig, Strikes
from averaging.network.hivemind import pins
from averaging.network.hivemind.allreduce import (
    ForgedGroup,
    GroupRefused,
    RobustAllReduceRunner,
    RobustCounters,
    ban,
    gathered_claim,
    gathered_proof,
    gathered_signature_problem,
    vet_group,
)
from averaging.network.hivemind.fetching import UPDATE_VERSION, StateFetching
from averaging.network.hivemind.matchmaking import ShoalMatchmaking, ShoalPotentialLeaders
from averaging.network.hivemind.serving import StateServing
from averaging.network.interface import StateProvider, UpdateProvider
from protocols import swarm_time
from protocols.admission import admitted, make_proof

logger = logging.getLogger(__name__)

ASSEMBLY_LATENCY_S = 0.5  # a leader's group message to its followers, beyond request_timeout
ENDED_GROUPS_KEPT = 256  # group ids of finished steps remembered (parts for them are refused at once)
STATE_REQUEST = -1  # the host-request slot's value for "the state" (else: an update's rounds_done)
# The ban list's round at the start of the step whose all-reduce runs in this task: round r+1's step
# may start while round r's all-reduce runs, and round r's failures must be struck in round r.
_STEP_ROUND: contextvars.ContextVar[int] = contextvars.ContextVar("shoal_step_round")


@dataclass(frozen=True, slots=True)
class GroupResult:
    """What the averager process hands the host for one step (the result of hivemind's ``StepControl``)."""

    gathered: dict[str, Any]  # each member's gathered report (its claim), raw, by peer id
    partial: float = 0.0  # fraction of the average that never arrived (a reducer failed)
    # Members on our ban list when the all-reduce ended (refused in it, or before): their reports
    # are dropped before the consistency check, so a peer we just refused cannot win a tie.
    distrusted: frozenset[str] = frozenset()
    far: frozenset[str] | None = None  # sub-groups: the group view's far members (None: no view)


def leader_group_cap(target_group_size: int | None, robust: RobustConfig | None) -> int | None:
    """The largest group we accept (``allreduce.vet_group`` refuses larger ones), passed to hivemind
    as ``target_group_size`` so that its leader stops gathering there: uncapped, a swarm larger than
    the cap could form no group at all."""
    caps = [c for c in (target_group_size, robust.max_group_size if robust is not None else None) if c]
    return min(caps) if caps else None


class ShoalAverager(StateServing, StateFetching, DecentralizedAverager):
    """hivemind's averager plus what shoal needs (module docstring); ``robust=None`` keeps
    hivemind's plain weighted mean."""

    # Hazard: hivemind caches the RPC table per class but finds the cache through the MRO, so a
    # plain DecentralizedAverager set up earlier in this process would lend us a table without
    # rpc_download_state_slice. Our own empty slots make hivemind build ours.
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, *args, state_provider: StateProvider, update_provider: UpdateProvider | None = None,
                 registration_wait: float = 10.0, robust: RobustConfig | None = None,
                 admission: bytes | None = None, signed_claims: bool = False, far_state_numel: int = 0,
                 lattice: bool = False, **kwargs):
        """``signed_claims``: every member's gathered claim must be signed by it.
        ``far_state_numel``: sub-groups, whose extra tensor carries that many values of state; far
        members get weight 0 on it (``_group_view``). ``lattice``: it travels as lattice residues."""
        self._state_provider = state_provider
        self._far_state_numel = far_state_numel
        self._lattice = lattice and bool(far_state_numel)
        self._signed_claims = signed_claims
        # A private swarm's key (protocols.admission); None (a public swarm) admits everyone.
        self._admission = admission
        self._update_provider = update_provider
        self._registration_wait = registration_wait
        # Several threads (downloads, the prepare lane) send commands at once; a pipe has no lock
        # for concurrent writers.
        self._command_lock = threading.Lock()
        # What the averager process asks the host for (module docstring); shared memory.
        self._host_request = torch.full((1,), STATE_REQUEST, dtype=torch.int64).share_memory_()
        # Sender and reducer timeouts set by the host (0: as configured); shared memory.
        self._part_timeouts = torch.zeros(2, dtype=torch.float64).share_memory_()
        self._host_lock: asyncio.Lock | None = None  # averager process, created on its event loop
        self._running: set[asyncio.Task] = set()  # averager process: commands in flight (_kept_alive)
        # Averager process: the shared state copy (what is being served is StateServing's own book).
        self._state_copy: tuple[float, Any] | None = None
        self._state_copy_lock: asyncio.Lock | None = None
        pins.check()  # the hivemind code we override is the code we reviewed
        self._robust = robust
        # The ban list lives in the averager process; the counters are shared memory, for the host.
        self._ban_list = BanList(robust.ban_rounds if robust is not None else 0)

        self._strikes = Strikes(robust.strike_limit, robust.strike_window) if robust is not None else None
        self._unknown_group_wait = kwargs.get("request_timeout", 3.0)  # (3.0: hivemind's default)
        self.robust_counters = RobustCounters()
        # Averager process: each running group's missing fraction and view (sub-groups).
        self._partial: dict[bytes, float] = {}
        self._views: dict[bytes, GroupView] = {}
        self._leaders: dict[bytes, PeerID] = {}  # group id -> the leader that sent it to us, while it runs
        # Averager process: groups our steps matched that will not run (any more), oldest first.
        self._ended_groups: dict[bytes, None] = {}
        self._max_group_size = leader_group_cap(kwargs.get("target_group_size"), robust) or 2**31
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
        matchmaking.leaders = {}
        # A group must reach its followers before they give up: up to request_timeout, plus latency.
        matchmaking.potential_leaders.__class__ = ShoalPotentialLeaders
        matchmaking.potential_leaders.margin = matchmaking.request_timeout + ASSEMBLY_LATENCY_S
        self.__dict__["_matchmaking"] = matchmaking

    @contextlib.contextmanager
    def _kept_alive(self):
        """Hold a strong reference to the running command's task: hivemind's command loop keeps
        none, so a garbage collection could destroy a step that awaits its trigger."""
        task = asyncio.current_task()
        self._running.add(task)
        try:
            yield
        finally:
            self._running.discard(task)

    async def _step(self, *, step: StepControl, **kwargs):
        # A ban counts averaging rounds (one step each), not all-reduces: a ban of our only possible
        # partner must end even though no group forms.
        self._ban_list.next_round()
        _STEP_ROUND.set(self._ban_list.round)
        with self._kept_alive():
            try:
                return await super()._step(step=step, **kwargs)
            finally:
                self._end_groups(self._matchmaking.matched.pop(id(step), ()))

    def _end_groups(self, group_ids: Sequence[bytes]) -> None:
        """Remember the groups a finished step matched: they will never be registered, so a part
        for one is refused at once rather than stalling its sender for the registration wait."""
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
        """hivemind's, but a part for a group not registered yet waits for it (``registration_wait``)."""
        request = await anext(stream)
        loop = asyncio.get_running_loop()
        start = loop.time()
        while request.group_id not in self._running_groups and request.group_id not in self._ended_groups:
            wait = registration_wait(request.group_id, getattr(self, "_matchmaking", None),
                                     known_group_wait=self._registration_wait,
                                     unknown_group_wait=self._unknown_group_wait)
            if loop.time() - start >= wait:
                break
            await asyncio.sleep(0.05)
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            # Hold the stream until the sender has read that and hung up: returning with its parts
            # unread resets the stream, and the sender would see a broken pipe, not BAD_GROUP_ID.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_drain(stream), timeout=min(self._registration_wait,
                                                                   self._unknown_group_wait))
            return
        group = await future
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    # -- robust all-reduce (averager process) ------------------------------------------------
    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        leader = self._matchmaking.leaders.pop(group_info.group_id, None)
        try:
            group_info = vet_group(group_info, peer_id=self.peer_id, bandwidth=self.bandwidth, mode=self.mode,
                                   max_group_size=self._max_group_size, serializer=self.serializer,
                                   admission=self._admission, signed_prefix=self.prefix if self._signed_claims else None)
        except GroupRefused as e:
            logger.warning(f"refused group {group_info.group_id.hex()[:8]} of {len(group_info.peer_ids)}: {e}")
            if isinstance(e, ForgedGroup) and leader is not None and leader != self.peer_id:
                ban(self._ban_list, str(leader), f"led a group with forged metadata ({e})", self.robust_counters)
            raise MatchmakingException(f"refused the group: {e}") from None
        if leader is not None and leader != self.peer_id:
            self._leaders[group_info.group_id] = leader
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            self._leaders.pop(group_info.group_id, None)
            # (a partial result: hivemind kept our local values where a reducer failed)
            missing = self._partial.pop(group_info.group_id, 0.0)
            view = self._views.pop(group_info.group_id, None)
        distrusted = frozenset(str(peer) for peer in group_info.peer_ids
                               if peer != self.peer_id and self._ban_list.is_banned(str(peer)))
        return GroupResult(gathered={str(peer): data for peer, data in gathered.items()}, partial=missing,
                           distrusted=distrusted, far=view.far if view is not None else None)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs):
        """hivemind's method (1.1.12, pinned in ``pins.REVIEWED``) with our runner
        (hivemind's own with ``robust=None``), and what part of the result never arrived."""
        group_id = group_info.group_id if group_id is None else group_id
        sender_timeout, reducer_timeout = self._part_timeouts.tolist()
        if reducer_timeout > 0:  # the host's scaled timeouts (averaging.network.hivemind.parts), once it measured any
            kwargs.update(sender_timeout=sender_timeout, reducer_timeout=reducer_timeout)
        common = dict(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
                      ordered_peer_ids=group_info.peer_ids, **kwargs)
        view = self._group_view(group_info) if self._far_state_numel else None  # sub-groups only
        if view is not None:
            self._views[group_id] = view
        if self._lattice and view.lattice is None:  # every member sees the same claims: all of us refuse alike
            raise AllreduceException("no member's claim decodes, so the group's lattice grid is unknown")
        far_peers = [p for p in group_info.peer_ids if view is not None and str(p) in view.far]
        if self._robust is None:
            runner = AllReduceRunner(**common)
        else:
            runner = RobustAllReduceRunner(robust_config=self._robust, ban_list=self._ban_list,
                                           counters=self.robust_counters, strikes=self._strikes,
                                           far_peers=far_peers, leader=self._leaders.get(group_id), **common)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        # Lattice-coded state: residues go out, the mean's residues come back; a far member cannot
        # decode them and keeps its own.
        lattice_grid = view.lattice if view is not None else None
        raw = tensors[1].clone() if lattice_grid is not None else None
        decoded = False
        try:
            if raw is not None:
                to_residues_(tensors[1], lattice_grid)
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for tensor, update in azip(as_aiter(*tensors), runner):
                    tensor.add_(update, alpha=self._averaging_alpha)
                    self.last_updated = swarm_time.now()
                    self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
            if raw is not None and self.peer_id not in far_peers:
                from_residues_(tensors[1], raw, lattice_grid)
                decoded = True
        finally:
            if raw is not None and not decoded:
                tensors[1].copy_(raw)  # failed, or far: our own state, never residues
        container = runner.tensor_part_container
        if container.failed_size:
            self._partial[group_id] = container.failed_size / max(1, container.total_size)
        if isinstance(runner, RobustAllReduceRunner):  # every reducer's stream has ended by now
            runner.strike_failed_reducers(round=_STEP_ROUND.get(self._ban_list.round))

    def _group_view(self, group_info: GroupInfo) -> GroupView:
        """A sub-group's view (``averaging.math.group_view``) from the members' gathered claims: the
        far members and the lattice grid, as every member and reducer finds them."""
        raw = {}
        for peer, gathered in zip(group_info.peer_ids, group_info.gathered):
            try:
                _, _, user_data = self.serializer.loads(gathered)
            except Exception:  # noqa: BLE001 - anything undecodable: no claim
                continue
            raw[str(peer)] = gathered_claim(self.serializer, user_data)
        return group_view(decode_claims(raw, numel=self._far_state_numel), lattice_coded=self._lattice)

    # -- admission (a private swarm) ----------------------------------------------------------
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
        if self._signed_claims:
            problem = gathered_signature_problem(self.serializer, request.gather, peer_id=str(context.remote_id),
                                                 prefix=self.prefix)
            if problem is not None:  # its own request, over its own connection: the peer is at fault
                ban(self._ban_list, str(context.remote_id), f"asked to join with a claim it did not sign ({problem})",
                    self.robust_counters)
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
        async for message in super().rpc_join_group(request, context):
            yield message



def registration_wait(group_id: bytes, matchmaking: Matchmaking | None, *, known_group_wait: float,
                      unknown_group_wait: float) -> float:
    """How long a part for ``group_id`` (neither registered nor ended) may wait for the group's
    registration before it is answered BAD_GROUP_ID (hivemind 1.1.12 registers a group only once
    the step's trigger fired, so members triggered before us send first).

    - A group we know (a step of ours matched it, or we assemble it): ``known_group_wait``.
    - One we do not know, while we look for a group: our leader may be about to send it, so
      ``unknown_group_wait`` (``request_timeout``, network latency).
    - Otherwise no step of ours can register it: 0, so a stranger cannot hold our handler."""
    if matchmaking is None:  # (the averager is still starting: hivemind adds its handlers first)
        return 0.0
    if _knows_group(matchmaking, group_id):
        return known_group_wait
    return unknown_group_wait if matchmaking.is_looking_for_group else 0.0


def _knows_group(matchmaking: Matchmaking, group_id: bytes) -> bool:
    """Whether a step of ours matched this group, a leader sent it to us, or we just assembled it."""
    if any(group_id in groups for groups in getattr(matchmaking, "matched", {}).values()):
        return True
    if group_id in getattr(matchmaking, "leaders", {}):
        return True
    assembled = matchmaking.assembled_group
    return (assembled.done() and not assembled.cancelled() and assembled.exception() is None
            and assembled.result().group_id == group_id)


async def _drain(stream: typing.AsyncIterator) -> None:
    async for _ in stream:
        pass

