"""Robust aggregation inside hivemind's butterfly all-reduce (the rules are ``averaging.math.robust``).

What we change in hivemind 1.1.12 (``averaging.network.hivemind.pins`` fails if this code moves):
- ``RobustPartReducer`` keeps every sender's part until the part index is complete, checks each on
  arrival (a bad sender fails before its part is counted, so nobody waits for it), pins each
  sender's weight to the first it declared, and aggregates with ``averaging.math.robust``.
- ``CheckedPartContainer`` checks every delta a reducer returns; a bad one (and that reducer's
  later parts) becomes zeros, the result is partial and the host does not apply it.
- With int8/int4 returns a reducer quantizes each part's average once and sends every member the
  same bytes, so quantized returns do not make anchors drift apart.
- Banned peers are failed from the start of a round; reducers whose streams fail are struck
  (``robust.Strikes``) unless most reducers failed for us.
- hivemind constructs these classes by name, so ``ShoalAverager._run_allreduce_inplace_`` is a
  copy of hivemind's that builds ``RobustAllReduceRunner``.

Everything here runs in the averager process, on its event loop; ``RobustCounters`` is shared
memory read by the host.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

from averaging.math import lattice, robust
from averaging.math.robust import BanList, RobustConfig, Strikes
from averaging.math.wire import LATTICE_CODE
from averaging.network.hivemind import codecs as hivemind_codecs
from protocols.admission import admitted
from protocols.signed_claims import signature_problem

logger = logging.getLogger(__name__)

class RobustCounters:
    """What robust aggregation refused, in shared memory: written by the averager process, read by
    the host (the round engine's metrics)."""

    def __init__(self):
        self._refused_parts = mp.Value("q", 0)  # senders refused (bad part, weight or norm)
        self._refused_returns = mp.Value("q", 0)  # reducers whose returned averages were refused
        self._clipped = mp.Value("q", 0)  # parts clipped or trimmed by the aggregator
        self._bans = mp.Value("q", 0)  # peers put on the ban list
        # lattice-coded values a reducer unwrapped near the edge of their range (overflow suspects)
        self._lattice_edges = mp.Value("q", 0)
        # A gauge: senders whose answers we still stream as a reducer (``HivemindBackend.shutdown`` waits for 0).
        self._answering = mp.Value("q", 0)

    @staticmethod
    def _add(value, amount: int = 1) -> None:
        with value.get_lock():
            value.value += amount

    def snapshot(self) -> dict[str, int]:
        return {"refused_parts": self._refused_parts.value, "refused_returns": self._refused_returns.value,
                "clipped_parts": self._clipped.value, "bans": self._bans.value,
                "lattice_edges": self._lattice_edges.value}

    @property
    def answering(self) -> int:
        """Answer streams in flight (reducer -> sender), now."""
        return self._answering.value


def ban(ban_list: BanList, peer: str, reason: str, counters: RobustCounters | None = None) -> None:
    """Put ``peer`` on the ban list (it logs the reason) and count a new ban for the host."""
    if ban_list.ban(peer, reason) and counters is not None:
        RobustCounters._add(counters._bans)


class RobustPartReducer(TensorPartReducer):
    """A ``TensorPartReducer`` that keeps each sender's part until the part index is complete, then
    aggregates with ``averaging.math.robust``. ``refuse(sender_index, reason)`` fails a sender at once.
    With ``return_code`` (int8/int4) each part's average is quantized once: ``returns[part_index]``
    holds the bytes every member receives, and the part's result is what they decode to."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, config: RobustConfig,
                 local_sender_index: int | None, refuse: Callable[[int, str], None],
                 return_code: str | None = None, extra_parts: Sequence[bool] = (), extra_code: str | None = None,
                 far_senders: frozenset[int] = frozenset()):
        """``extra_parts[i]``: our part ``i`` is of the extra tensor (judged without work scaling,
        returned in ``extra_code``). ``far_senders``: members whose anchor is far from the rest get
        weight 0 on the extra parts unless nobody else sent one. With lat8 the extra parts are
        lattice residues, unwrapped against a near member's before they are judged."""
        self.config, self.local_sender_index, self.refuse = config, local_sender_index, refuse
        self.far_senders = far_senders
        self.return_code, self.extra_code = return_code, extra_code
        self.extra_parts = tuple(extra_parts) or (False,) * len(part_shapes)
        assert len(self.extra_parts) == len(part_shapes)
        self.returns: dict[int, bytes] = {}
        self.declared_weights: list[float | None] = [None] * num_senders
        self.contributions: dict[int, tuple[torch.Tensor, float]] = {}
        self.excluded: set[int] = set()  # senders refused after their part was counted
        self.clipped: Counter[int] = Counter()
        self.edge_values = 0  # lattice values unwrapped near the edge of their range (overflow suspects)
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        self.contributions = {}
        super().reset_accumulators()
        self.accumulator = None  # hivemind's running sum is not used

    def _problem(self, sender_index: int, part_index: int, part: torch.Tensor, weight: float) -> str | None:
        problem = robust.check_weight(weight) or robust.check_part(part, self.part_shapes[part_index])
        if problem is None:
            declared = self.declared_weights[sender_index]
            if declared is None:
                self.declared_weights[sender_index] = float(weight)
            elif float(weight) != declared:
                problem = f"weight changed from {declared:.6g} to {weight:.6g} within a round"
        return problem

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        # 1. Check on arrival, before the part is counted: a refused sender then fails exactly as
        #    if it had stopped sending before this part, and nobody waits for it.
        problem = self._problem(sender_index, part_index, tensor_part, weight)
        if problem is not None:
            if sender_index != self.local_sender_index:
                self.refuse(sender_index, f"part {part_index}: {problem}")
                raise BannedException(f"sender {sender_index} refused: {problem}")
            logger.error(f"our own part {part_index} is invalid ({problem}); it is left out of the average")
            self.excluded.add(sender_index)
            weight = 0.0
        self.num_parts_received[sender_index] += 1

        # 2. Wait for our turn, as hivemind does.
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise BannedException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index

        current_part_future = self.current_part_future
        self.contributions[sender_index] = (tensor_part, float(weight))
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            result = self._aggregate_current()
            if self.return_code is not None:
                code = self.extra_code if self.extra_parts[self.current_part_index] else self.return_code
                self.returns[self.current_part_index], result = hivemind_codecs.encode_average(result, code)
            self.current_part_future.set_result(result)
            self.reset_accumulators()

    def _exclude(self, senders: list[int], indices: list[int], why: Callable[[int], str]) -> None:
        """Refuse ``senders[i]`` for each i (never ourselves) after its part was counted."""
        for i in indices:
            if senders[i] != self.local_sender_index:
                self.excluded.add(senders[i])
                self.refuse(senders[i], f"part {self.current_part_index} {why(i)} the reference")

    def _aggregate_current(self) -> torch.Tensor:
        # 3. Norm screening against our own part and the median, then bounded weights, then the rule.
        senders = [s for s in sorted(self.contributions) if s not in self.excluded]
        if self.extra_parts[self.current_part_index] and self.extra_code == LATTICE_CODE:
            self._unwrap_current(senders)
        if self.extra_parts[self.current_part_index] and self.far_senders:
            senders = [s for s in senders if s not in self.far_senders] or senders
        parts = [self.contributions[s][0] for s in senders]
        part_norms = robust.norms(parts)
        own_norm = part_norms[senders.index(self.local_sender_index)] if self.local_sender_index in senders else 0.0
        outliers = robust.norm_outliers(part_norms, own_norm=own_norm, max_norm_ratio=self.config.max_norm_ratio)
        self._exclude(senders, outliers, lambda i: f"has norm {part_norms[i]:.3g}, over {self.config.max_norm_ratio:g}x")
        senders = [s for s in senders if s not in self.excluded]
        declared = [self.contributions[s][1] for s in senders]
        own_weight = declared[senders.index(self.local_sender_index)] if self.local_sender_index in senders else 0.0
        outliers = robust.weight_outliers(declared, own_weight=own_weight, max_ratio=self.config.refuse_weight_ratio)
        self._exclude(senders, outliers,
                      lambda i: f"declared weight {declared[i]:.3g}, over {self.config.refuse_weight_ratio:g}x")
        senders = [s for s in senders if s not in self.excluded]
        if not senders:  # every sender refused: nobody is left to receive this part
            return torch.zeros(self.part_shapes[self.current_part_index])
        weights = robust.bound_weights([self.contributions[s][1] for s in senders],
                                       max_ratio=self.config.max_weight_ratio, max_weight=self.config.max_weight)
        extra = self.extra_parts[self.current_part_index]
        result = robust.aggregate([self.contributions[s][0] for s in senders], weights, self.config,
                                  work_scaled=not extra)
        self.clipped.update(senders[i] for i in result.clipped)
        return result.value

    def _unwrap_current(self, senders: list[int]) -> None:
        """Lattice residues as values near a near member's (``lattice.reference_part``), in place."""
        parts = {s: self.contributions[s][0] for s in senders}
        reference = lattice.reference_part(parts, own=self.local_sender_index, far=self.far_senders)
        if reference is None:
            return
        for s in senders:
            value = lattice.unwrap(parts[s], reference)
            if s not in self.far_senders:
                self.edge_values += lattice.edge_values(value, reference)
            self.contributions[s] = (value, self.contributions[s][1])


class CheckedPartContainer(TensorPartContainer):
    """hivemind's container, plus a check of every delta a reducer returns (set up by
    ``RobustAllReduceRunner``; no ``__init__`` of its own: an existing container is given this class).
    The reducers in ``returns_average`` send the part's average itself (int8/int4 returns): it
    becomes our delta here, before the check."""

    max_norm_ratio: float
    on_bad_return: Callable[[int, str], None]
    distrusted: set[int]
    returns_average: frozenset[int]
    lattice_from: int | None = None  # the first part (in the payload's order) of lattice residues, if any

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        inputs = self._input_parts_by_peer[peer_index]
        if part_index < len(inputs):  # (after finalize the inputs are gone; hivemind then raises itself)
            own = inputs[part_index][0]
            residues = self.lattice_from is not None and (
                sum(self.num_parts_by_peer[:peer_index]) + part_index >= self.lattice_from)
            if peer_index in self.returns_average and part.shape == own.shape:
                part = part - own  # (a wrong shape is refused below as it arrived)
            if residues and part.shape == own.shape:
                # A residue's delta is the offset it stands for (its norm says little: members check
                # the state they rebuild, ``subgroups.state_problem``).
                part = lattice.wrap(part)
            problem = None if peer_index in self.distrusted else robust.check_returned(
                part, own, max_norm_ratio=self.max_norm_ratio)
            if problem is not None:
                self.distrusted.add(peer_index)
                self.on_bad_return(peer_index, f"part {part_index}: {problem}")
            if peer_index in self.distrusted:
                part = torch.zeros_like(own)  # keep our local values for this reducer's parts
                self.failed_size += part.numel()
        super().register_processed_part(peer_index, part_index, part)


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's runner with ``RobustPartReducer``, returned-delta checks and the ban list."""

    def __init__(self, *, robust_config: RobustConfig, ban_list: BanList, counters: RobustCounters | None = None,
                 strikes: Strikes | None = None, far_peers: Sequence[PeerID] = (), leader: PeerID | None = None,
                 **kwargs):
        """``far_peers``: members whose anchor and momentum get weight 0 (``RobustPartReducer``'s
        ``far_senders``). ``leader``: the peer that sent us this group (None: we assembled it), which
        answers for the members that turn out not to run it."""
        super().__init__(**kwargs)
        self.robust_config, self.ban_list, self.counters, self.strikes = robust_config, ban_list, counters, strikes
        self.leader = leader
        self.failed_reducers: list[PeerID] = []  # reducers whose stream failed, in the order they failed
        # hivemind's reducer was built in super().__init__ and never used; mark it finished so its
        # __del__ does not warn about parts it never received.
        self.tensor_part_reducer.finished.set()
        local_index = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        container = self.tensor_part_container
        self.return_code = hivemind_codecs.average_return_code(container.compression)
        # Our reducer's parts are a contiguous run of the payload's (tensor 0's, then the extra's).
        first = sum(container.num_parts_by_peer[:self.ordered_peer_ids.index(self.peer_id)])
        own = range(first, first + len(self.parts_for_local_averaging))
        self._answer_types = hivemind_codecs.part_types(container.compression, container.num_parts_by_tensor)[
            own.start:own.stop]
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids),
            config=robust_config, local_sender_index=local_index, refuse=self._refuse_sender,
            return_code=self.return_code, extra_parts=[i >= container.num_parts_by_tensor[0] for i in own],
            extra_code=hivemind_codecs.extra_code(container.compression),
            far_senders=frozenset(self.sender_peer_ids.index(p) for p in far_peers if p in self.sender_peer_ids))
        if far_peers:
            logger.info(f"group {self.group_id.hex()[:8]}: the anchors of {', '.join(map(str, far_peers))} are far "
                        "from the others' (their claims): weight 0 in the group's mean state")
        container.__class__ = CheckedPartContainer
        container.max_norm_ratio, container.on_bad_return, container.distrusted = (
            robust_config.max_norm_ratio, self._refuse_reducer, set())
        # Our own reducer hands us its result as a delta already (hivemind's local path).
        container.returns_average = frozenset(
            index for index, peer in enumerate(self.ordered_peer_ids)
            if peer != self.peer_id) if self.return_code is not None else frozenset()
        container.lattice_from = container.num_parts_by_tensor[0] \
            if hivemind_codecs.extra_code(container.compression) == LATTICE_CODE else None
        # Peers banned in earlier rounds: failed from the start (their parts never count).
        self.excluded_peers = [peer for peer in self.ordered_peer_ids
                               if peer != self.peer_id and ban_list.is_banned(str(peer))]
        for peer in self.excluded_peers:
            if peer in self.sender_peer_ids:
                self.banned_senders.add(peer)
                self.tensor_part_reducer.on_sender_failed(self.sender_peer_ids.index(peer))
        if self.excluded_peers:
            logger.info(f"group {self.group_id.hex()[:8]}: excluding banned peers "
                        f"{', '.join(map(str, self.excluded_peers))}")

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id in self.excluded_peers:  # a banned reducer: its share is missing from our result
            self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(peer_id))
            return
        try:
            await super()._communicate_with_peer(peer_id)
        except Exception as e:
            # hivemind logs this at debug level only, and its "received N% results" names no one.
            logger.warning(f"group {self.group_id.hex()[:8]}: reducer {peer_id} failed ({e!r}): our result misses "
                           "its share, so this round's average is not applied")
            absent = f"sent {averaging_pb2.MessageCode.Name(averaging_pb2.BAD_GROUP_ID)}" in str(e)
            # Judged when the all-reduce ends (strike_failed_reducers). A member that runs no such
            # group is there on the word of the leader that sent it to us, and the leader answers
            # for it: a hostile leader listed an honest peer it had turned away, to have it struck.
            self.failed_reducers.append(self.leader if absent and self.leader is not None else peer_id)
            if absent:
                await self._drop_absent_sender(peer_id)
            raise

    def strike_failed_reducers(self, *, round: int | None = None) -> list[str]:
        """Strike the reducers whose stream failed, unless most of the others failed for us too
        (``robust.struck_reducers``), and ban those at the strike limit; returns the peers struck.
        Call once, after the all-reduce; ``round`` is the ban list's round when its step began."""
        if self.strikes is None or not self.failed_reducers:
            return []
        reducers = [str(peer) for peer, parts in zip(self.ordered_peer_ids, self.tensor_part_container.num_parts_by_peer)
                    if parts > 0 and peer != self.peer_id and peer not in self.excluded_peers]
        struck = robust.struck_reducers(reducers, [str(peer) for peer in self.failed_reducers])
        if not struck:
            logger.info(f"group {self.group_id.hex()[:8]}: {len(set(self.failed_reducers))} of {len(reducers)} "
                        "reducers failed for us; nobody is struck (our own link is the likelier fault)")
            return []
        round = self.ban_list.round if round is None else round
        struck = [peer for peer in struck if not self.ban_list.is_banned(peer)]
        for peer in struck:
            if self.strikes.strike(peer, round):
                ban(self.ban_list, peer, f"its stream failed as a reducer in {self.strikes.limit} of the last "
                    f"{self.strikes.window_rounds} rounds", self.counters)
            else:
                logger.info(f"group {self.group_id.hex()[:8]}: strike {self.strikes.count(peer, round)} of "
                            f"{self.strikes.limit} for reducer {peer}")
        return struck

    async def _drop_absent_sender(self, peer_id: PeerID) -> None:
        """A peer that answers BAD_GROUP_ID does not run this group and will never send us parts:
        fail it as a sender now rather than after the sender timeout."""
        if peer_id in self.sender_peer_ids and peer_id not in self.banned_senders:
            logger.warning(f"group {self.group_id.hex()[:8]}: {peer_id} does not run this group; its parts are not "
                           "waited for")
            await self._ban_sender(peer_id)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """As a reducer, one sender's parts in and our answers out (``_reduce_parts``), with a
        warning that says why when the sender's stream stopped short (hivemind logs nothing)."""
        answered, why, hung_up = 0, "", False
        started = asyncio.get_running_loop().time()
        if self.counters is not None:
            RobustCounters._add(self.counters._answering)

        async def watched():
            nonlocal hung_up
            async for message in stream:
                yield message
            hung_up = True

        try:
            async for answer in self._reduce_parts(watched(), sender_index):
                answered += 1
                yield answer
            why = "its stream ended (the sender hung up)" if hung_up else \
                "it was failed as a sender meanwhile (refused, banned, or its parts timed out here)"
        except TimeoutError:
            why = f"its next part did not come within the sender timeout ({self.sender_timeout:.1f}s)"
            raise
        except GeneratorExit:
            why = ""  # our own answer stream was closed: the all-reduce ended or was cancelled
            raise
        except asyncio.CancelledError:
            # hivemind's stream handler cancels us when its reader hits the end of the sender's
            # connection (or the all-reduce is cancelled): our remaining answers are never sent.
            why = "our handler was cancelled (the connection to the sender closed, or the all-reduce was cancelled)"
            raise
        except Exception as e:
            why = f"{e!r}"
            raise
        finally:
            if self.counters is not None:
                RobustCounters._add(self.counters._answering, -1)
            sender = self.sender_peer_ids[sender_index]
            if why and answered != self.tensor_part_reducer.num_parts and sender not in self.excluded_peers:
                logger.warning(f"group {self.group_id.hex()[:8]}: as a reducer, got {answered} of "
                               f"{self.tensor_part_reducer.num_parts} parts from {sender} after "
                               f"{asyncio.get_running_loop().time() - started:.1f}s: {why}; its result misses our share")

    async def _reduce_parts(self, stream, sender_index: int):
        """hivemind's reducer loop for one sender; with int8/int4 returns each answer is the part's
        average as its reducer quantized it once (``RobustPartReducer.returns``), the same bytes
        for every member, instead of the sender's delta re-encoded."""
        if self.return_code is None:
            async for answer in super()._accumulate_parts_streaming(stream, sender_index):
                yield answer
            return
        reducer = self.tensor_part_reducer
        received = 0
        try:
            async for tensor_part, weight in amap_in_executor(
                    lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight), stream,
                    max_prefetch=self.tensor_part_container.prefetch):
                try:
                    average = await reducer.accumulate_part(sender_index, received, tensor_part, weight=weight)
                except BannedException:
                    logger.debug(f"sender {sender_index} is banned: its stream is dropped")
                    break
                data = reducer.returns[received]
                received += 1
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART,
                    tensor_part=hivemind_codecs.message(data, average, self._answer_types[received - 1]))
        finally:
            if received != reducer.num_parts:  # as hivemind: a sender that stopped short is failed
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _refuse_sender(self, sender_index: int, reason: str) -> None:
        """Fail a sender now and ban it. Synchronous, with no await between the check and the
        update, so it is atomic on the event loop like hivemind's ``_ban_sender``."""
        peer = self.sender_peer_ids[sender_index]
        logger.warning(f"group {self.group_id.hex()[:8]}: refused sender {peer}: {reason}")
        self._record(peer, f"sent {reason}", "_refused_parts")
        if peer not in self.banned_senders:
            self.banned_senders.add(peer)
            self.tensor_part_reducer.on_sender_failed(sender_index)

    def _refuse_reducer(self, peer_index: int, reason: str) -> None:
        peer = self.ordered_peer_ids[peer_index]
        logger.warning(f"group {self.group_id.hex()[:8]}: ignoring what reducer {peer} returned "
                       f"(our local values kept): {reason}")
        self._record(peer, f"returned {reason}", "_refused_returns")

    def _record(self, peer: PeerID, reason: str, counter: str) -> None:
        if self.counters is not None:
            RobustCounters._add(getattr(self.counters, counter))
        ban(self.ban_list, str(peer), reason, self.counters)

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None):
        clipped = getattr(self.tensor_part_reducer, "clipped", None)
        if clipped and not self._future.done():
            if self.counters is not None:
                RobustCounters._add(self.counters._clipped, sum(clipped.values()))
            summary = ", ".join(f"{self.sender_peer_ids[s]} ({n} parts)" for s, n in clipped.most_common())
            logger.info(f"group {self.group_id.hex()[:8]}: clipped outlying parts of {summary}")
        edge = getattr(self.tensor_part_reducer, "edge_values", 0)
        if edge and not self._future.done():
            if self.counters is not None:
                RobustCounters._add(self.counters._lattice_edges, edge)
            logger.warning(f"group {self.group_id.hex()[:8]}: {edge} lattice values unwrapped near the edge of "
                           "their range (the group's anchors may lie farther apart than its grid covers)")
        super().finalize(cancel=cancel, exception=exception)


# -- the group a leader sends (issue item 4) -------------------------------------------------------

class GroupRefused(ValueError):
    """The group a leader assembled is not one we take part in."""


class ForgedGroup(GroupRefused):
    """A group only its leader could have got wrong: it misstates a member's entry (our own, or a
    claim its member did not sign). The leader is banned and the round folds (never a re-sync)."""


def gathered_proof(serializer, raw: bytes) -> bytes | None:
    """The admission proof in a peer's matchmaking metadata (``[bandwidth, mode, user data]``, as a
    join request or a group entry carries it; our user data is our claim plus ``admit``)."""
    try:
        _, _, user_data = serializer.loads(raw)
    except Exception:  # noqa: BLE001 - undecodable: no proof
        return None
    return _proof_in(serializer, user_data)


def gathered_signature_problem(serializer, raw: bytes, *, peer_id: str, prefix: str) -> str | None:
    """Why a peer's matchmaking metadata (its join request's ``gather``) does not carry a claim it
    signed (``protocols.signed_claims``), or None: a leader checks each follower's as it arrives."""
    try:
        _, declared_mode, user_data = serializer.loads(raw)
        declared_mode = AveragingMode(declared_mode)
    except Exception as e:  # noqa: BLE001 - undecodable
        return f"undecodable metadata ({type(e).__name__})"
    return signature_problem(gathered_claim(serializer, user_data), peer_id=peer_id, prefix=prefix,
                             mode=declared_mode.value)


def gathered_claim(serializer, user_data: object) -> object:
    """A member's user data (bytes of its gathered object: its claim) decoded, or None."""
    try:
        return serializer.loads(user_data) if isinstance(user_data, bytes) else None
    except Exception:  # noqa: BLE001 - undecodable: no claim
        return None


def _proof_in(serializer, user_data: object) -> bytes | None:
    data = gathered_claim(serializer, user_data)
    proof = data.get("admit") if isinstance(data, dict) else None
    return proof if isinstance(proof, bytes) else None


def vet_group(group_info: GroupInfo, *, peer_id: PeerID, bandwidth: float | None, mode: AveragingMode,
              max_group_size: int, serializer, admission: bytes | None = None,
              signed_prefix: str | None = None) -> GroupInfo:
    """The group to run, with every declared bandwidth replaced by None; raises ``GroupRefused``.

    hivemind takes the leader's (unsigned) metadata as sent and splits the vector by the declared
    bandwidths, so a leader could make one peer reduce everything; shoal declares none, so dropping
    them gives every reducer an equal share. Each peer refuses a group that misstates its own entry;
    with ``signed_prefix`` every member's claim must be signed by it (``ForgedGroup``), and with
    ``admission`` carry its proof of the swarm key."""
    peers, gathered = group_info.peer_ids, group_info.gathered
    if len(peers) > max_group_size:
        raise GroupRefused(f"group of {len(peers)} peers, over the cap of {max_group_size}")
    if len(set(peers)) != len(peers) or len(gathered) != len(peers) or peer_id not in peers:
        raise ForgedGroup("malformed group (duplicate peers, metadata count, or we are not in it)")
    rewritten = []
    for peer, raw in zip(peers, gathered):
        try:
            entry = serializer.loads(raw)
            declared_bandwidth, declared_mode, user_data = entry
            declared_mode = AveragingMode(declared_mode)
        except Exception as e:  # noqa: BLE001 - anything undecodable refuses the group
            raise ForgedGroup(f"undecodable metadata for {peer}: {type(e).__name__}") from None
        if declared_bandwidth is not None and not (isinstance(declared_bandwidth, (int, float))
                                                   and math.isfinite(declared_bandwidth) and declared_bandwidth >= 0):
            raise GroupRefused(f"bandwidth {declared_bandwidth!r:.20} for {peer}")
        if admission is not None and not admitted(admission, str(peer), _proof_in(serializer, user_data)):
            raise GroupRefused(f"{peer} did not prove the swarm key")
        if peer == peer_id and (declared_mode != mode or declared_bandwidth != bandwidth):
            raise ForgedGroup(f"the leader misstated our own entry (mode {declared_mode.name}, "
                              f"bandwidth {declared_bandwidth!r:.20})")
        if signed_prefix is not None:
            problem = signature_problem(gathered_claim(serializer, user_data), peer_id=str(peer), prefix=signed_prefix,
                                        mode=declared_mode.value)
            if problem is not None:
                raise ForgedGroup(f"the entry of {peer}: {problem}")
        rewritten.append(serializer.dumps([None, declared_mode.value, user_data]))
    return GroupInfo(group_info.group_id, tuple(peers), tuple(rewritten))
