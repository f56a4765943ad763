"""The round engine's training-thread side: when a round ends, handing it to the worker, the merge.

One ``RoundEngine`` per peer, driven by the training loop with one ``after_step`` call per inner
step; the node and the library API both use it. The training loop never waits on the network
unless it must:

- **overlap** (default): at the last step boundary before the round's deadline the engine
  snapshots the parameters (async on CUDA) and hands the round to the worker (``begin_sync``;
  ``averaging.engine.round``) while training goes on; ``try_merge`` at a later step boundary adds
  the result (``averaging.math.merge``). A sync may outlast its round: the next one is queued
  behind it (double buffers) or the peer stays out of that round (``averaging.engine.policy``).
- **blocking** (the OpenDiLoCo baseline): a fixed number of inner steps, then the loop waits for
  the all-reduce at the round's deadline.

Threads: ``after_step``/``begin_sync``/``try_merge`` run on the training thread; the round's sync
runs on the worker's thread and is the only code that changes the anchor; the two meet through the
jobs' futures. At most two syncs are outstanding (one running, one queued), so two snapshot and two
correction buffers suffice: a job's buffers are reused only after it was merged.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from averaging.engine.clock import SYSTEM_CLOCK, Clock
from averaging.engine.config import LoopConfig, SyncMode
from averaging.engine.inner_sync import InnerStateSync
from averaging.engine.policy import MAX_OUTSTANDING, JoinPolicy, Outstanding
from averaging.engine.recover import Recovery, download_horizon, newest_round
from averaging.engine.round import RoundJob, RoundRunner, SyncResult
from averaging.engine.stats import RoundStats, StepTimer, Window
from averaging.engine.subgroups import Mixing, SubGroups
from averaging.engine.whole_swarm import WholeSwarm
from averaging.engine.worker import SyncWorker
from averaging.math.flat import FlatLayout
from averaging.math.merge import apply_correction_
from averaging.math.outer_step import OuterConfig
from averaging.math.wire import WireFormat
from averaging.network.interface import Progress
from averaging.state import accept
from averaging.state.served import DownloadedState
from averaging.state.shared_state import HISTORY_KEPT, SharedState
from averaging.state.verdict import Applied
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

REPLAY_DONORS = 3  # donors asked for a young run's steps before a joiner downloads the state instead


@dataclass(slots=True)
class _Job:
    window: Window
    future: Future[SyncResult]
    slot: int  # which snapshot/correction buffers it uses
    then: list[RoundStats] = field(default_factory=list)  # rounds we stayed out of, reported after this one
    steps_at_snapshot: int = 0  # our inner steps so far when its snapshot was taken (the moments' landing)


class RoundEngine:
    def __init__(self, *, state: SharedState, worker: SyncWorker, layout: FlatLayout,
                 params: Callable[[], dict[str, torch.Tensor]], schedule: Callable[[], RoundSchedule],
                 config: LoopConfig, peer_id: str, alone: Callable[[], bool], device: torch.device,
                 clock: Clock = SYSTEM_CLOCK, wire: WireFormat | None = None, client_mode: bool = False,
                 swarm_lateness: Callable[[], Sequence[float]] | None = None,
                 inner_state: InnerStateSync | None = None, mixing: Mixing | None = None,
                 outer: OuterConfig | None = None):
        """``inner_state``: average the inner optimizer's moments with every round (the backend was
        built with ``extra_numel`` for them). ``mixing``: sub-group rounds (``averaging.engine.subgroups``),
        else whole-swarm rounds. ``outer``: the outer step's settings (default: the shared state's)."""
        self.state, self.worker, self.layout = state, worker, layout
        self._params, self._schedule, self.config = params, schedule, config
        self.peer_id, self.device = peer_id, device
        self.clock = clock  # read on both threads (see Clock)
        self.policy = JoinPolicy(config, schedule, swarm_lateness)
        wire = wire or WireFormat()
        self._recovery = recovery = Recovery(state=state, backend=worker.backend, schedule=schedule, clock=clock,
                                             download_timeout=config.download_timeout)
        common = dict(state=state, outer=outer or state.config, wire=wire, recovery=recovery, peer_id=peer_id,
                      alone=alone)
        kind = SubGroups(mixing=mixing, **common) if mixing is not None else WholeSwarm(**common)
        self.runner = RoundRunner(kind=kind, state=state, worker=worker, layout=layout, config=config,
                                  schedule=schedule, clock=clock, wire=wire, client_mode=client_mode,
                                  extra_numel=inner_state.numel if inner_state is not None else 0)
        self.inner_state = inner_state
        # Per buffer slot: the moments at the round's end and the group's mean of them.
        self._host_moments: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self._steps = 0  # inner steps taken (the landing's k: steps since a round's snapshot)
        cuda = device.type == "cuda"
        # Pinned host buffers for snapshots and merge corrections, two of each: a sync queued behind
        # a running one must not overwrite the buffers the running one still uses.
        self._pinned = cuda
        self._host_params: list[torch.Tensor | None] = [layout.new_buffer(pin_memory=cuda), None]
        self._host_correction: list[torch.Tensor | None] = [layout.new_buffer(pin_memory=cuda), None]
        self._device_correction = torch.empty(layout.numel, device=device) if cuda else None
        self._timer = StepTimer()
        self._jobs: deque[_Job] = deque()  # submitted, not yet merged (oldest first)
        self._folded_tokens = 0  # tokens of rounds we stayed out of, for our next contribution
        self._decided_round = 0  # the last round we decided about (joined or stayed out)
        self._first_round = 0  # the round start() began in (our first window, nothing carried into it)
        self._prepares: dict[int, Future] = {}  # round -> its matchmaking job (prepare lane)
        self.window: Window | None = None
        self.last_download: DownloadedState | None = None  # the state adopted by initial_sync

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def round(self) -> int:
        return self.window.round if self.window else 0

    @property
    def syncing(self) -> bool:
        """A round's sync is in flight (the loop keeps training meanwhile in overlap mode)."""
        return bool(self._jobs)

    def outstanding(self) -> list[tuple[int, Future]]:
        """The rounds whose sync has not been merged yet, oldest first, with their jobs."""
        return [(job.window.round, job.future) for job in self._jobs]

    @property
    def group_count(self) -> int | None:
        """Sub-groups: the group count of the last round we prepared (our progress record's); else None."""
        return self.runner.kind.group_count

    @property
    def sync_period(self) -> int:
        return self.policy.sync_period

    @property
    def agreed_lateness(self) -> float | None:
        return self.policy.agreed_lateness

    @property
    def sync_lateness(self) -> float | None:
        """How long after its round's deadline a sync typically ends (seconds, EMA), once measured."""
        return self.policy.lateness

    def start(self) -> None:
        now = self.clock.now()
        self.window = Window(max(1, self._schedule().round_at(now)), started=now)
        self._first_round = self.window.round
        self._maybe_prepare(now)

    def initial_sync(self, donors: list[str], *, newer_than: int = -1, progress: Progress | None = None) -> int | None:
        """Adopt the shared state of a running swarm (blocking: before training starts), unless
        it is not newer than ``newer_than`` (a peer resumed from a checkpoint keeps its own).
        ``progress(done_bytes, total_bytes)`` is called on the worker thread."""
        horizon = download_horizon(self._schedule(), self.clock.now(), self.config.download_timeout)
        state = self.clock.wait(self.worker.submit(
            self.worker.backend.download_state, donors, timeout=self.config.download_timeout, progress=progress,
            same_state=lambda a, b: accept.same_state(self.state, a, b), max_round=horizon,
            check=accept.slice_check(self.state)))
        if state is None:
            return None
        offered = state.metadata.get("round") if isinstance(state.metadata, dict) else None
        if isinstance(offered, int) and offered <= newer_than:
            logger.info(f"the swarm's state (round {offered}) is not newer than ours (round {newer_than}): kept ours")
            return None
        # MessageError if invalid: the caller reports it.
        adopted = self.state.adopt(state, require_claim=True, max_round=newest_round(self._schedule(), self.clock.now()))
        self.load_anchor_into_params()
        self.last_download = state
        return adopted

    def join_by_replay(self, donors: Sequence[str], *, at_least: int) -> int | None:
        """Join a young run by replaying its outer steps on the initial weights (2 bytes a parameter
        a step, against a download's 8 through the donors' uplinks; exact: ``SharedState`` keeps the
        steps it took). Each step comes from the first of the first donors that holds it (one may
        not have stepped yet). The steps replayed (0: none has stepped), or None when fewer than
        ``at_least`` came in order (then download)."""
        # (on the worker thread, as every fetch)
        updates = self.clock.wait(self.worker.submit(self._recovery.fetch_steps, list(donors)[:REPLAY_DONORS],
                                                     first=0, count=HISTORY_KEPT))
        newest = newest_round(self._schedule(), self.clock.now())  # a donor's claimed round is its own word
        if (len(updates) < at_least or any(u.round > newest for u in updates)
                or not self.state.catch_up(updates, None)):
            return None
        self.load_anchor_into_params()
        return len(updates)

    def resume(self, state: DownloadedState) -> int:
        """Start from a saved shared state (a checkpoint): validated like a download."""
        adopted = self.state.adopt(state)
        self.load_anchor_into_params()
        return adopted

    def progress(self, now: float | None = None) -> float:
        """Global progress in rounds, for the inner learning-rate schedule."""
        return self._schedule().progress(self.clock.now() if now is None else now)

    def finish(self) -> list[RoundStats]:
        """Leaving: let a sync in flight land (bounded by the all-reduce timeout)."""
        return self.try_merge(wait=True)

    # -- the training thread's side ----------------------------------------------------------
    def after_step(self, *, tokens: int, seconds: float, loss: float | None = None) -> list[RoundStats]:
        """Call after every inner step; returns the rounds that finished (usually none)."""
        window = self.window
        window.steps += 1
        self._steps += 1
        window.tokens += tokens
        window.compute_s += seconds
        if loss is not None:
            window.loss_sum += loss
        self._timer.add(seconds)
        finished = self.try_merge()
        self._maybe_prepare(self.clock.now())
        if self._round_over():
            finished += self.begin_sync()
        return finished

    def _maybe_prepare(self, now: float) -> None:
        """Decide about the round shortly before its deadline. Not earlier: a step prepared long in
        advance sits in hivemind's matchmaking where late peers of the previous round could find it."""
        round = self.window.round
        if self._decided_round < round and now >= self._schedule().round_end(round) - self.config.prepare_lead:
            self._decide(round)

    def _decide(self, round: int, *, not_before: float = 0.0) -> None:
        """Join ``round`` (matchmaking queued on the prepare lane) or stay out of it (``JoinPolicy``);
        once per round, at its prepare time or in ``begin_sync`` if the window ends before that."""
        self._decided_round = round
        decision = self.policy.decide(
            round, window=self.window, first_round=self._first_round, folded_tokens=self._folded_tokens,
            outstanding=[Outstanding(job.window.round, job.future.done()) for job in self._jobs])
        if decision.join:
            previous = self._jobs[-1].future if self._jobs else None
            self._prepares[round] = self.worker.submit_prepare(self.runner.prepare, round, not_before=not_before,
                                                               previous=previous)
            return
        self.window.stay_out = decision.stay_out
        logger.info(f"round {self.window.round}: staying out, {decision.stay_out}; this round's work goes into the "
                    "next contribution")

    def _round_over(self) -> bool:
        if self.config.mode == SyncMode.BLOCKING and self.window.steps >= self.config.inner_steps:
            return True  # then wait, idle, for the all-reduce at the deadline: lockstep
        return not self._timer.fits_before(self._schedule().round_end(self.window.round), self.clock.now())

    def begin_sync(self) -> list[RoundStats]:
        """End the current round: snapshot, hand it to the worker, start the next window. In
        overlap mode this never waits for an earlier sync (``try_merge`` merges what has landed)."""
        blocking = self.config.mode == SyncMode.BLOCKING
        finished = self.try_merge(wait=blocking)
        window, now = self.window, self.clock.now()
        window.ended = now
        next_round = max(window.round + 1, self._schedule().round_at(now))
        if self._decided_round < window.round:  # the window ended before its prepare time
            self._decide(window.round, not_before=self._schedule().round_end(window.round) - self.config.prepare_lead)
        prepared = self._prepares.pop(window.round, None)
        for stale in [r for r in self._prepares if r < window.round]:
            self._prepares.pop(stale)
        self.window = Window(next_round, started=now)
        if prepared is None:  # we stayed out of this round: fold its work into the next one
            self._folded_tokens += window.tokens
            finished += self._report_later(self._stayed_out_stats(window))
            return finished + self._report_jumped(window, next_round)
        assert len(self._jobs) < MAX_OUTSTANDING, "a round was joined with two syncs outstanding"
        # Buffers: the other pair than the sync still in flight (allocated only if one ever is).
        slot = 1 - self._jobs[-1].slot if self._jobs else 0
        if self._host_params[slot] is None:
            self._host_params[slot] = self.layout.new_buffer(pin_memory=self._pinned)
            self._host_correction[slot] = self.layout.new_buffer(pin_memory=self._pinned)
        event = self._snapshot_params(self._host_params[slot])
        moments = self._snapshot_moments(slot)
        # A sync still in flight has a correction this snapshot does not contain yet.
        pending = self._host_correction[self._jobs[-1].slot] if self._jobs else None
        tokens, self._folded_tokens = window.tokens + self._folded_tokens, 0
        job = RoundJob(round=window.round, tokens=tokens, snapshot=self._host_params[slot],
                       correction_out=self._host_correction[slot], event=event, pending_correction=pending,
                       prepared=prepared, moments=moments)
        future = self.worker.submit(self.runner.run, job)
        self._jobs.append(_Job(window, future, slot, steps_at_snapshot=self._steps))
        jumped = self._report_jumped(window, next_round)
        if blocking:
            finished += self.try_merge(wait=True)
            self.window.started = self.clock.now()  # the wait belongs to the round that ended
        return finished + jumped

    def _report_jumped(self, window: Window, next_round: int) -> list[RoundStats]:
        """Rounds that ended while a step ran past the next deadline: each still gets its record
        (one per round: docs/metrics.md), with no work and the reason."""
        reports: list[RoundStats] = []
        for round in range(window.round + 1, next_round):
            empty = Window(round, started=window.ended, ended=window.ended,
                           stay_out=f"a training step ran past the end of round {round}")
            reports += self._report_later(self._stayed_out_stats(empty))
        return reports

    def _report_later(self, stats: RoundStats) -> list[RoundStats]:
        """Keep reports in round order: a round we stayed out of is reported after the syncs before it."""
        if self._jobs:
            self._jobs[-1].then.append(stats)
            return []
        return [stats]

    def _stayed_out_stats(self, window: Window) -> RoundStats:
        reason = window.stay_out or "the previous round's sync was still running"
        return RoundStats(
            round=window.round, inner_steps=window.steps, tokens=window.tokens, compute_s=window.compute_s,
            wait_s=window.wait_s, sync_s=0.0, allreduce_s=0.0, wall_s=window.ended - window.started,
            loss=window.loss, group_size=1, group=[], applied=Applied.FOLDED, error=f"skipped: {reason}",
            diverged=[], bad_reports=0, resynced=False, rounds_done=self.state.rounds_done, skipped=True)

    def try_merge(self, wait: bool = False) -> list[RoundStats]:
        """Merge finished syncs into the live parameters, oldest first (a step boundary); never
        blocks unless ``wait``, which merges every outstanding sync."""
        finished: list[RoundStats] = []
        while self._jobs and (wait or self._jobs[0].future.done()):
            finished += self._merge_job(self._jobs.popleft())
        return finished

    def _merge_job(self, job: _Job) -> list[RoundStats]:
        already_done, waited_from = job.future.done(), self.clock.monotonic()
        result = self.clock.wait(job.future)
        stall_s = 0.0 if already_done else self.clock.monotonic() - waited_from
        self._merge(result.correction)
        if result.inner_state is not None and self.inner_state is not None:
            problem = self.inner_state.land(result.inner_state, self._host_moments[job.slot][0],
                                            steps=self._steps - job.steps_at_snapshot)
            if problem is not None:
                logger.warning(f"round {job.window.round}: {problem}; our own moments were kept")
        self.policy.note_lateness(result.lateness_s)
        # Blocking mode: the wait is the round's own; overlap: charged to the window that waited.
        charged = job.window if self.config.mode == SyncMode.BLOCKING else self.window
        charged.wait_s += stall_s
        conclusion, window = result.conclusion, job.window
        end = self.clock.now() if self.config.mode == SyncMode.BLOCKING else window.ended
        return [RoundStats(
            round=window.round, inner_steps=window.steps, tokens=window.tokens, compute_s=window.compute_s,
            wait_s=window.wait_s, sync_s=result.sync_s, allreduce_s=result.allreduce_s, wall_s=end - window.started,
            loss=window.loss, group_size=conclusion.group_size, group=list(result.group), applied=conclusion.applied,
            error=conclusion.error, diverged=conclusion.verdict.diverged if conclusion.verdict else [],
            bad_reports=conclusion.bad_claims, resynced=result.resynced, rounds_done=result.rounds_done,
            bytes_sent=result.bytes_sent, bytes_received=result.bytes_received, caught_up=conclusion.caught_up,
            robust=result.robust, lineage_merged=result.lineage_merged, lineage_reunion=result.reunion,
        ), *(replace(stayed_out, rounds_done=result.rounds_done) for stayed_out in job.then)]

    def _snapshot_moments(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The moments at the round's end, copied (blocking: the next step changes them) into
        ``slot``'s host buffers, with the buffer for their group mean; None if they do not ride."""
        if self.inner_state is None:
            return None
        if self._host_moments[slot] is None:
            self._host_moments[slot] = (torch.zeros(self.inner_state.numel), torch.zeros(self.inner_state.numel))
        self.inner_state.snapshot(self._host_moments[slot][0])
        return self._host_moments[slot]

    @torch.no_grad()
    def _snapshot_params(self, buffer: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the live parameters to a host buffer; on CUDA asynchronously, with an event
        the worker waits on (the copies are stream-ordered before the next step's kernels)."""
        params = self._params()
        for name, view in self.layout.views(buffer).items():
            view.copy_(params[name].detach(), non_blocking=True)
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @torch.no_grad()
    def _merge(self, correction: torch.Tensor) -> None:
        params = self._params()
        names = self.layout.names
        if self._device_correction is not None:
            # Pinned host buffer → device, stream-ordered before the next step's kernels; the
            # worker rewrites the host buffer only after the next snapshot's event, i.e. later.
            self._device_correction.copy_(correction, non_blocking=True)
            corrections = self.layout.views(self._device_correction)
        else:
            corrections = self.layout.views(correction)
        apply_correction_([params[n].data for n in names], [corrections[n] for n in names])

    @torch.no_grad()
    def load_anchor_into_params(self) -> None:
        params = self._params()
        for name, view in self.layout.views(self.state.anchor).items():
            params[name].data.copy_(view)
