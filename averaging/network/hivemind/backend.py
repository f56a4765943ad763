"""``HivemindBackend``: the ``AveragingBackend`` of real runs, on one ``ShoalAverager``.

It turns a round into a hivemind averaging step (``prepare`` at the prepare time, ``average`` at
the deadline) and a state download or a catch-up into the averager's fetches. Used only from the
sync worker's threads (the sync lane and the prepare lane; ``prepare`` is safe beside the rest).

Hazards (docs/hivemind.md):
- The averager holds the ``get_tensors()`` lock for the whole all-reduce. We write the buffer
  before triggering the all-reduce and read it only after the step's future resolves; nothing
  else touches it (the loop never sees this buffer).
- A "successful" step can leave parts un-averaged; the gather carries anchor claims so the
  next round can detect that (``averaging.math.fingerprints``), and a result the averager knows is
  partial is not applied.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import NoCompression

from averaging.math.robust import RobustConfig
from averaging.math.wire import (
    AVERAGE_RETURN_CODES,
    EXTRA_CODE,
    LATTICE_CODE,
    STATE_BYTES_PER_VALUE,
    WireFormat,
)
from averaging.network.hivemind.averager import GroupResult, ShoalAverager, leader_group_cap
from averaging.network.hivemind.fetching import FETCH_GRACE_S, describe
from averaging.network.hivemind.parts import (
    HIVEMIND_PART_BYTES,
    REDUCER_SHARE,
    SENDER_SHARE,
    averager_compression,
    float_part_bytes,
    part_timeouts,
)
from averaging.network.interface import PARTIAL_ERROR, AverageOutcome, Progress, StateProvider, UpdateProvider
from averaging.network.slices import (
    SameState,
    default_slice_count,
    download_slices,
    slice_alignment,
    slice_bounds,
    slice_deadline_s,
)
from averaging.state.served import AppliedUpdate, CheckSlice, DownloadedState
from protocols import swarm_time
from protocols.identity import PeerKey
from protocols.messages import MAX_ROUND
from protocols.signed_claims import sign_claim

logger = logging.getLogger(__name__)

LOOKING = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
RECENT_ALLREDUCES = 3  # the part timeouts follow the longest of the last few all-reduces
# How long ``prepare`` waits for the averager to confirm a round's group bits: hivemind's own
# ``set_group_bits(wait=True)`` has no timeout, and hangs for good if the averager process died.
GROUP_BITS_WAIT_S = 5.0
# ``average(keep_partial=True)`` keeps a result with at most this share missing (sub-groups): beyond
# it, more of the vector would be our own values than the group's average.
KEEP_PARTIAL_MAX = 0.5
# How long a leaving peer waits at most for the answers its reducer still owes the others.
LEAVE_GRACE_S = 10.0


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
        signer: PeerKey | None = None,
        share_state: bool = True,
        extra_numel: int = 0,
        extra_code: str = EXTRA_CODE,
        mixing: bool = False,
    ):
        """``admission``: a private swarm's key (``protocols.admission``). ``signer``: this peer's
        libp2p identity, which signs our claims (without it, in tests on bare DHTs, claims travel
        unsigned and unchecked). ``share_state``: serve our state from the start.
        ``extra_numel``: a second vector averaged in the same all-reduce (``average(extra=...)``),
        which every member of a run must agree on; ``extra_code`` its codec both ways. ``mixing``:
        it carries anchors (sub-groups), so far members get weight 0 on it."""
        if signer is not None and signer.peer_id != str(dht.peer_id):
            raise ValueError("the signer must be the DHT's own identity")
        # request_timeout < min_matchmaking_time, or matchmaking can deadlock (docs/hivemind.md).
        assert request_timeout < min_matchmaking_time
        wire = wire or WireFormat()
        if robust is None and wire.return_code in AVERAGE_RETURN_CODES:
            raise ValueError(f"{wire.return_code} returns need shoal's all-reduce runner: pass a RobustConfig")
        if extra_code == LATTICE_CODE and not (mixing and robust is not None and wire.return_code in AVERAGE_RETURN_CODES
                                               and extra_numel == 2 * numel):
            raise ValueError("the lattice code carries a sub-group's anchor and momentum alone, in a run whose "
                             "reducers return the average (int8/int4) through shoal's runner")
        part_bytes = {} if wire.quantized else {"part_size_bytes": float_part_bytes(wire, numel)}
        leader_cap = leader_group_cap(target_group_size, robust)
        self.extra_numel = extra_numel
        self._averager = self.averager_class(
            averaged_tensors=[torch.zeros(numel, dtype=torch.float32)]
            + ([torch.zeros(extra_numel, dtype=torch.float32)] if extra_numel else []),
            dht=dht,
            start=True,
            prefix=prefix,
            state_provider=state_provider,
            update_provider=update_provider,
            registration_wait=allreduce_timeout * SENDER_SHARE,
            target_group_size=leader_cap,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            # Until all-reduces are measured (``parts.part_timeouts``); hivemind requires sender < reducer.
            sender_timeout=allreduce_timeout * SENDER_SHARE,
            reducer_timeout=allreduce_timeout * REDUCER_SHARE,
            compression=averager_compression(wire, numel=numel, target_group_size=target_group_size,
                                             extra_numel=extra_numel, extra_code=extra_code,
                                             part_size_bytes=part_bytes.get("part_size_bytes", HIVEMIND_PART_BYTES)),
            state_compression=NoCompression(),  # shared state must arrive exact
            client_mode=client_mode,
            allow_state_sharing=share_state and not client_mode,
            shutdown_timeout=3,
            robust=robust,
            admission=admission,
            signed_claims=signer is not None,
            far_state_numel=numel if mixing and extra_numel else 0,
            lattice=mixing and extra_code == LATTICE_CODE,
            **part_bytes,
        )
        self._signer = signer
        self.peer_id = str(dht.peer_id)
        # What state_provider returns: by default anchor and momentum (SharedState.shared_state).
        self._state_lengths = list(state_lengths) if state_lengths is not None else [numel, numel]
        self._request_timeout = request_timeout
        self._allreduce_timeout = allreduce_timeout
        self._recent_allreduce_s: deque[float] = deque(maxlen=RECENT_ALLREDUCES)
        # Steps by round: prepare (the prepare lane) and average (the sync lane) run on two threads.
        self._controls: dict[int, StepControl] = {}
        self._controls_lock = threading.Lock()

    def prepare(self, *, round: int, scheduled_time: float, gather: dict, timeout: float,
                key_bits: str | None = None) -> None:
        # Older rounds' steps stay (their syncs may still be queued); ``average`` cancels the ones it passed.
        self._settle_matchmaking(before=round)
        with self._averager._command_lock:
            # The round goes into the matchmaking key, so peers of rounds r-1 and r never meet.
            self._set_group_bits(round, key_bits if key_bits is not None else round_bits(round))
            proof = self._averager.proof()
            if self._signer is not None:
                gather = sign_claim(gather, self._signer, prefix=self._averager.prefix, mode=self._averager.mode.value)
            control = self._averager.step(
                gather=gather if proof is None else {**gather, "admit": proof},
                scheduled_time=scheduled_time,
                timeout=max(timeout, scheduled_time - swarm_time.now() + self._request_timeout),
                require_trigger=True,
                wait=False,
            )
        with self._controls_lock:
            self._controls[round] = control

    def _set_group_bits(self, round: int, bits: str) -> None:
        """The round's group bits, confirmed within ``GROUP_BITS_WAIT_S`` or refused if the averager
        is gone (a slow one is fine: the next step goes down the same pipe after the bits)."""
        confirmed = self._averager.set_group_bits(bits, wait=False)
        try:
            confirmed.result(timeout=GROUP_BITS_WAIT_S)
        except TimeoutError:
            if not self._averager.is_alive():
                raise RuntimeError(f"the averager process is gone: round {round}'s matchmaking cannot start") from None
            logger.debug(f"round {round}: the averager took over {GROUP_BITS_WAIT_S:g}s to confirm its group bits")

    def _settle_matchmaking(self, *, before: int, wait_s: float = 5.0) -> None:
        """Let an older round's step find its group before the bits change (they are the averager's,
        not a step's, and would move it into this round's key); cancel it after ``wait_s``."""
        with self._controls_lock:
            older = [c for r, c in self._controls.items() if r < before]
        deadline = time.monotonic() + wait_s
        for control in older:
            while not control.done() and control.stage in LOOKING and time.monotonic() < deadline:
                time.sleep(0.05)
            if not control.done() and control.stage in LOOKING:
                logger.warning("an older round's matchmaking was still running; cancelled it")
                control.cancel()

    def share_state(self, allowed: bool) -> None:
        # While we do not share, a request gets an empty answer and the joiner asks another donor.
        if not self._averager.client_mode:  # a client serves nothing (nobody can connect to it)
            self._averager.allow_state_sharing = allowed

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float,
                round: int | None = None, extra: torch.Tensor | None = None,
                keep_partial: bool = False) -> AverageOutcome:
        if (extra is None) != (self.extra_numel == 0) or (extra is not None and extra.numel() != self.extra_numel):
            raise ValueError(f"this backend averages an extra vector of {self.extra_numel} values with every round")
        with self._controls_lock:
            if round is None and self._controls:
                round = max(self._controls)
            control = self._controls.pop(round, None)
            # Syncs run in round order: an older round's step will never run; cancel it.
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
        with self._averager.get_tensors() as buffers:
            buffers[0].copy_(vector)
            if extra is not None:
                buffers[1].copy_(extra)
        control.weight = float(weight)
        started, started_wall = time.perf_counter(), swarm_time.now()
        control.allow_allreduce()
        # 2. Wait for the group; a failure keeps the caller's vector as it was.
        try:
            result: GroupResult | None = self._result(control, timeout)
        except Exception as e:
            control.cancel()
            return AverageOutcome(ok=False, sync_s=time.perf_counter() - started, error=describe(e))
        sync_s = time.perf_counter() - started
        allreduce_s = swarm_time.now() - max(started_wall, control.scheduled_time)
        if not result or not result.gathered:
            return AverageOutcome(ok=False, sync_s=sync_s, error="averaging returned no group")
        missing, group = result.partial, tuple(sorted(result.gathered))
        # A member our robust aggregation refused speaks no more in this round's consistency check:
        # a peer banned this round must not win a tie.
        gathered_by_peer = {peer: data for peer, data in result.gathered.items() if peer not in result.distrusted}
        if missing and keep_partial and missing <= KEEP_PARTIAL_MAX:
            # Sub-groups: our own values stand for the share that never arrived (hivemind keeps them
            # there); the next rounds' groups mix them like any other difference.
            logger.info(f"round {round}: kept a partial all-reduce: {missing:.1%} of the average never arrived "
                        "(a reducer failed, named in the log); our own values stand in for it")
        elif missing:
            # Our vector stays as it was: the round folds, and the others' step is replayed next round.
            return AverageOutcome(ok=False, group=group, sync_s=sync_s, allreduce_s=allreduce_s, partial=missing,
                                  error=f"{PARTIAL_ERROR}: {missing:.1%} of the average never arrived (a "
                                        "reducer failed, named in the log); this round's work is kept for the next")
        # 3. Read the result only after the step finished (the averager released the lock).
        with self._averager.get_tensors() as buffers:
            vector.copy_(buffers[0])
            if extra is not None:
                extra.copy_(buffers[1])
        if not missing:
            self._note_allreduce(allreduce_s)  # (a partial one lasted as long as the timeout that failed it)
        return AverageOutcome(ok=True, group=group, gathered=gathered_by_peer, sync_s=sync_s, allreduce_s=allreduce_s,
                              partial=missing, far=result.far)

    def _result(self, control: StepControl, timeout: float) -> GroupResult | None:
        """``control.result(timeout)``, given up within a second once the averager process is gone
        (killed, say, by the OOM killer): nothing would ever answer, and the leave that follows
        waited out the whole all-reduce timeout (30 s and more) for this round."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return control.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if not self._averager.is_alive():
                    raise RuntimeError(f"the averager process exited ({self._averager.exitcode})") from None

    def _note_allreduce(self, seconds: float) -> None:
        """A whole all-reduce took ``seconds``: scale the part timeouts to it (a partial one lasted
        as long as the timeout that failed it, so it measures nothing)."""
        self._recent_allreduce_s.append(seconds)
        sender, reducer = part_timeouts(self._recent_allreduce_s, self._allreduce_timeout)
        self._averager.set_part_timeouts(sender, reducer)

    def download_state(self, peers: list[str], *, timeout: float, progress: Progress | None = None,
                       slices: int | None = None, same_state: SameState | None = None,
                       max_round: int = MAX_ROUND, check: CheckSlice | None = None) -> DownloadedState | None:
        """Fetch the shared state from all of ``peers`` at once, in ``slices`` slices (default: two
        per donor); None if it cannot be completed from slices of one round. ``timeout``: how long a
        donor may stay silent. Threads: runs (and calls ``progress``) in the caller's thread; each
        slice is fetched by a pool thread that waits on the averager process."""
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

    @property
    def alive(self) -> bool:
        """Whether the averager process still runs (killed or crashed: the caller cannot average)."""
        return self._averager.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._averager.exitcode

    def fetch_update(self, peers: list[str], *, rounds_done: int, numel: int,
                     timeout: float) -> AppliedUpdate | None:
        """The update after ``rounds_done`` steps from the first of ``peers`` that sends a valid one."""
        for peer in dict.fromkeys(peers):
            if peer == self.peer_id:
                continue
            try:
                return self._averager.fetch_update(peer, rounds_done, numel=numel, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - any failure sends us to the next peer
                logger.info(f"outer step {rounds_done + 1} from {peer}: {describe(e)}")
        return None

    def shutdown(self) -> None:
        with self._controls_lock:
            controls, self._controls = list(self._controls.values()), {}
        for control in controls:
            if not control.done():
                control.cancel()
        if self._averager.is_alive():
            self._let_answers_out()
            self._averager.shutdown()

    def _let_answers_out(self) -> None:
        """Before leaving, let our reducer finish the answers it owes: our own all-reduce ends when
        *our* results are in, and cutting the answers still streaming to the others would leave
        their rounds partial. Bounded by ``LEAVE_GRACE_S``."""
        counters = self._averager.robust_counters
        deadline = time.monotonic() + LEAVE_GRACE_S
        while counters.answering > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        linger = max(self._recent_allreduce_s, default=0.0)
        time.sleep(max(0.0, min(linger, deadline - time.monotonic())))


def round_bits(round: int) -> str:
    """Matchmaking key bits for ``round``: neighbouring rounds always differ."""
    return format(round % 16, "04b")


def _reason(control: StepControl) -> str:
    try:
        control.result(timeout=0)
    except BaseException as e:  # noqa: BLE001 - we only describe it
        return describe(e)
    return "finished without an all-reduce"
