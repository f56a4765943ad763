"""RoundEngine: three peers on threads over one LocalHub, each with its own tiny model, shared state,
sync worker and fake clock, driven by fake inner steps. Overlap rounds on the clock (and a stall when
a sync outlasts a round), blocking rounds in lockstep, the weighting, the merge of an update into a
model that kept training, and a failed round folded into the next contribution.

Time is fake (``tests.unit.fake_clock``): an inner step advances its peer's clock, so every figure
the engine reports is exact and no test sleeps. What stays real is the concurrency: each peer's
training thread and sync worker, and the peers meeting in the hub."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from averaging.engine.config import LoopConfig
from averaging.engine.loop import RoundEngine
from averaging.engine.stats import RoundStats
from averaging.engine.worker import SyncWorker
from averaging.math.flat import FlatLayout
from averaging.math.outer_step import OuterConfig, kept_step, outer_step_
from averaging.network.interface import AverageOutcome
from averaging.network.local import LocalBackend, LocalHub
from averaging.state.served import AppliedUpdate
from averaging.state.shared_state import SharedState
from averaging.state.verdict import Resync
from protocols.schedule import RoundSchedule
from tests.unit.fake_clock import WALL_START, FakeClock

pytestmark = pytest.mark.timeout(60)  # a deadlock fails the test instead of hanging the suite

PEERS = ("peer-a", "peer-b", "peer-c")
TOKENS = {"peer-a": 100, "peer-b": 300, "peer-c": 700}  # per inner step: the weights differ
OUTER = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
STEP_SIZE = 0.01
WAIT = 20.0  # generous bound (real seconds) on anything one peer waits for; the happy paths take milliseconds
EXACT = 1e-6  # the resolution of a unix time (the fake clock's now()) is ~2e-7 s
# Manual driving: rounds never end on the clock, and each round is prepared as soon as it begins,
# so the test decides when a round ends by calling begin_sync itself.
MANUAL = dict(mode="overlap", matchmaking_seconds=0.1, prepare_lead=1e6)
MANUAL_ROUND_SECONDS = 1e3


class FaultyBackend(LocalBackend):
    """A LocalBackend that records what it sends, and misses the rounds in ``fail_rounds`` (it never
    joins their group, as after failed matchmaking), so the others average without it.

    With ``allreduce_seconds`` set it takes time on its peer's clock like hivemind's averager: the
    all-reduce starts at the round's scheduled time and ends ``allreduce_seconds`` later. Without,
    it averages as soon as the group is there, in no time."""

    def __init__(self, hub: LocalHub, peer_id: str, state_provider, fail_rounds=(), *,
                 clock: FakeClock, allreduce_seconds: float | None = None, partial_rounds=()):
        super().__init__(hub, peer_id, state_provider)
        self.fail_rounds = set(fail_rounds)
        # Rounds whose average reaches the group with our contribution but comes back to us partial
        # (a reducer failed on our side): reported as HivemindBackend does, vector untouched.
        self.partial_rounds = set(partial_rounds)
        self.clock, self.allreduce_seconds = clock, allreduce_seconds
        self.sent: dict[int, tuple[torch.Tensor, float]] = {}  # round -> (pseudo-gradient, weight)
        self.refusals_per_sync = 0  # robust aggregation's counters grow by this much per sync
        self.prepared_at: dict[int, float] = {}  # round -> when matchmaking began, on the peer's clock
        self._scheduled: dict[int, float] = {}  # prepared round -> its scheduled time

    def prepare(self, *, round: int, scheduled_time: float, **kwargs) -> None:
        self._scheduled[round] = scheduled_time
        self.prepared_at[round] = self.clock.now()
        if round not in self.fail_rounds:
            super().prepare(round=round, scheduled_time=scheduled_time, **kwargs)

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float,
                round: int | None = None) -> AverageOutcome:
        scheduled_time = self._scheduled.pop(round)
        if self.allreduce_seconds is not None:
            # One sleep to a fixed instant: when it ends does not depend on when the worker got here.
            self.clock.sleep_until(scheduled_time + self.allreduce_seconds)
        self.sent[round] = (vector.clone(), weight)
        if round in self.fail_rounds:
            return AverageOutcome(ok=False, error="injected")
        if round in self.partial_rounds:
            outcome = super().average(vector.clone(), weight=weight, timeout=timeout, round=round)
            return AverageOutcome(ok=False, group=outcome.group, partial=0.25, error="partial all-reduce: injected")
        return super().average(vector, weight=weight, timeout=timeout, round=round)

    def robustness(self) -> dict[str, int]:
        # Cumulative, like HivemindBackend's: grows with every sync that asked.
        return {"refused_parts": self.refusals_per_sync * len(self.sent), "bans": 0}


class FullGroupHub(LocalHub):
    """Every round waits for the whole swarm, as hivemind does with min_group_size = swarm size
    (blocking mode's setting). The plain hub forms a group of whoever prepared when the first
    member arrives: blocking mode prepares right before averaging, so its fastest peer would
    average alone, and in overlap mode a peer stalled past the prepare lead would miss the round."""

    def __init__(self, peers):
        super().__init__()
        self.peers = tuple(peers)

    def prepare(self, peer: str, round: int) -> None:
        for member in self.peers:
            super().prepare(member, round)


@dataclass
class Snapshot:
    """One peer's view of one round, taken by the test around begin_sync and the merge."""

    anchor_before: torch.Tensor
    params_at_snapshot: torch.Tensor
    work_at_snapshot: torch.Tensor
    anchor_after: torch.Tensor | None = None
    params_after: torch.Tensor | None = None
    work_after: torch.Tensor | None = None


@dataclass
class Peer:
    id: str
    model: torch.nn.Module
    layout: FlatLayout
    state: SharedState
    backend: FaultyBackend
    worker: SyncWorker
    clock: FakeClock
    loop: RoundEngine
    tokens: int
    loss: float
    generator: torch.Generator
    work: torch.Tensor  # the sum of every fake inner step's change, flat: what merges must preserve
    schedule: RoundSchedule
    stats: list[RoundStats] = field(default_factory=list)
    rounds: dict[int, Snapshot] = field(default_factory=dict)

    def flat_params(self) -> torch.Tensor:
        return self.layout.pack(dict(self.model.named_parameters()), self.layout.new_buffer())

    @torch.no_grad()
    def inner_step(self, step_seconds: float) -> float:
        started = self.clock.monotonic()
        delta = torch.randn(self.layout.numel, generator=self.generator) * -STEP_SIZE
        params = dict(self.model.named_parameters())
        for name, view in self.layout.views(delta).items():
            params[name].add_(view)
        self.work += delta
        self.clock.advance(step_seconds)  # the step takes time, as a real one would
        return self.clock.monotonic() - started

    def keep_real_time(self) -> None:
        """Fake time passes only on this thread: once it is past the end of an all-reduce, let the
        sync that ran it finish (in real time) before the next step, as it would have by then. The
        worker's own sleeps (a re-sync's retry pause) pass in fake time meanwhile (``clock.wait``)."""
        if self.backend.allreduce_seconds is None:
            return
        for round, job in self.loop.outstanding():
            if self.schedule.round_end(round) + self.backend.allreduce_seconds <= self.clock.now():
                self.clock.wait(job)

    def train_step(self, step_seconds: float = 0.0) -> None:
        self.keep_real_time()
        seconds = self.inner_step(step_seconds)
        self.stats += self.loop.after_step(tokens=self.tokens, seconds=seconds, loss=self.loss)

    def stats_of(self, round: int) -> RoundStats:
        [stats] = [s for s in self.stats if s.round == round]
        return stats


@pytest.fixture
def make_swarm():
    workers: list[SyncWorker] = []

    def make(config: LoopConfig, *, round_seconds: float, hub: LocalHub | None = None,
             fail_at: dict[str, set[int]] | None = None, allreduce_seconds: float | None = None,
             partial_at: dict[str, set[int]] | None = None) -> list[Peer]:
        hub = hub or LocalHub()
        # Every peer's clock starts at the schedule's start: round 1 begins as the peers start.
        schedule = RoundSchedule(start_time=WALL_START, round_seconds=round_seconds)
        peers = []
        for index, peer_id in enumerate(PEERS):
            with torch.random.fork_rng():
                torch.manual_seed(0)  # the same init everywhere, as after a joint start
                model = torch.nn.Linear(8, 4)
            layout = FlatLayout.of(model.named_parameters())
            state = SharedState(layout, layout.pack(dict(model.named_parameters()), layout.new_buffer()), OUTER)
            clock = FakeClock(WALL_START)
            backend = FaultyBackend(hub, peer_id, state.shared_state, (fail_at or {}).get(peer_id, ()),
                                    clock=clock, allreduce_seconds=allreduce_seconds,
                                    partial_rounds=(partial_at or {}).get(peer_id, ()))
            hub.update_providers[peer_id] = state.update_after
            worker = SyncWorker(backend, allreduce_timeout=5.0, matchmaking_grace=1.0)
            workers.append(worker)
            loop = RoundEngine(state=state, worker=worker, layout=layout,
                             params=lambda model=model: dict(model.named_parameters()),
                             schedule=lambda: schedule, config=config, peer_id=peer_id,
                             alone=lambda: False, device=torch.device("cpu"), clock=clock)
            peers.append(Peer(peer_id, model, layout, state, backend, worker, clock, loop, TOKENS[peer_id],
                              loss=2.0 + index, generator=torch.Generator().manual_seed(100 + index),
                              work=layout.new_buffer(), schedule=schedule))
        return peers

    yield make
    for worker in workers:
        worker.close()


def on_threads(peers: list[Peer], train) -> list:
    """Run ``train(peer)`` for every peer on its own thread; re-raise the first failure."""
    with ThreadPoolExecutor(len(peers)) as pool:
        futures = [pool.submit(train, peer) for peer in peers]
        return [future.result(timeout=3 * WAIT) for future in futures]


def run_on_the_clock(peers: list[Peer], *, last_round: int, step_seconds: dict[str, float]) -> dict[str, int]:
    """Train until every peer has ended ``last_round``; returns, per peer, how many steps ran while
    a sync was in flight."""

    def train(peer: Peer) -> int:
        peer.loop.start()
        overlapped = 0
        while peer.loop.round <= last_round:
            overlapped += peer.loop.syncing
            peer.train_step(step_seconds[peer.id])
        if isinstance(peer.backend.hub, DecidedHub):
            # Our last decision is in (in fake time: a prepare decided early sleeps until its prepare time).
            peer.clock.wait(peer.worker.submit_prepare(lambda: None))
            peer.backend.hub.leave(peer.id)
        peer.stats += peer.loop.finish()
        return overlapped

    return dict(zip([p.id for p in peers], on_threads(peers, train)))


def run_by_hand(peers: list[Peer], *, rounds: int, steps_before: int = 3, steps_after: int = 2,
                step_seconds: float = 0.0) -> None:
    """Each round: ``steps_before`` steps, begin_sync, ``steps_after`` steps while it is in flight,
    then try_merge(wait=True); ``peer.rounds`` records what the test needs around each."""
    barrier = threading.Barrier(len(peers), timeout=WAIT)

    def train(peer: Peer) -> None:
        peer.loop.start()
        for round in range(1, rounds + 1):
            for _ in range(steps_before):
                peer.train_step(step_seconds)
            # Our own matchmaking for this round is done once the worker's two lanes have run every
            # job before these; the barrier then makes sure nobody averages before the group is known.
            peer.worker.submit(lambda: None).result(timeout=WAIT)
            peer.worker.submit_prepare(lambda: None).result(timeout=WAIT)
            barrier.wait()
            assert peer.loop.round == round and not peer.loop.syncing
            record = Snapshot(peer.state.anchor.clone(), peer.flat_params(), peer.work.clone())
            peer.stats += peer.loop.begin_sync()
            for _ in range(steps_after):
                peer.train_step(step_seconds)
            peer.stats += peer.loop.try_merge(wait=True)
            assert not peer.loop.syncing
            record.anchor_after, record.params_after = peer.state.anchor.clone(), peer.flat_params()
            record.work_after = peer.work.clone()
            peer.rounds[round] = record

    on_threads(peers, train)


def weighted_mean(sent: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    total = sum(weight for _, weight in sent)
    return sum(vector.double() * (weight / total) for vector, weight in sent).float()


def replay(init: torch.Tensor, peers: list[Peer], groups: dict[int, list[str]]) -> torch.Tensor:
    """The anchor after the outer steps (as kept: fp16) on the weighted means of what each round's
    group sent."""
    anchor, momentum = init.clone(), torch.zeros_like(init)
    by_id = {p.id: p for p in peers}
    for round in sorted(groups):
        mean = weighted_mean([by_id[member].backend.sent[round] for member in groups[round]])
        outer_step_(anchor, kept_step(mean).float(), momentum, lr=OUTER.lr, mu=OUTER.momentum, nesterov=OUTER.nesterov)
    return anchor


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    assert torch.allclose(actual, expected, rtol=0, atol=atol), (actual - expected).abs().max().item()


def assert_overlap_timeline(peer: Peer, *, round_seconds: float, step_seconds: float,
                            allreduce_seconds: float) -> None:
    """Overlap mode to the exact figure: a round is its inner steps, which end at the last step
    boundary before its deadline, plus a stall if the previous round's sync was still in flight
    then (it ends ``allreduce_seconds`` after that round's deadline); the next round starts there."""
    schedule = RoundSchedule(start_time=WALL_START, round_seconds=round_seconds)
    started = WALL_START
    for s in peer.stats:
        deadline = schedule.round_end(s.round)
        assert s.compute_s == pytest.approx(s.inner_steps * step_seconds, abs=EXACT), s
        steps_ended = started + s.compute_s
        assert deadline - step_seconds < steps_ended <= deadline, s
        previous_sync_ends = schedule.round_end(s.round - 1) + allreduce_seconds if s.round > 1 else WALL_START
        assert s.wait_s == pytest.approx(max(0.0, previous_sync_ends - steps_ended), abs=EXACT), s
        assert s.wall_s == pytest.approx(s.compute_s + s.wait_s, abs=EXACT), s
        started = steps_ended + s.wait_s


# -- overlap mode on the clock -------------------------------------------------------------------
OVERLAP_STEPS = {"peer-a": 0.037, "peer-b": 0.041, "peer-c": 0.053}  # no step boundary falls on a deadline


def test_overlap_rounds_average_in_the_background_while_training_goes_on(make_swarm):
    # A healthy swarm where every round's group is all three peers, and each all-reduce takes 0.1 s
    # after the round's deadline, a fifth of a round. The full-group hub, because the plain one (a group
    # of whoever prepared when the first member arrives) depends on which worker thread prepares first,
    # in real time: a loaded 2-core box once left a peer out of a round.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2)
    peers = make_swarm(config, round_seconds=0.5, hub=FullGroupHub(PEERS), allreduce_seconds=0.1)
    init = peers[0].state.anchor.clone()
    last_round = 4
    overlapped = run_on_the_clock(peers, last_round=last_round, step_seconds=OVERLAP_STEPS)

    rounds = list(range(1, last_round + 1))
    for peer in peers:
        assert [s.round for s in peer.stats] == rounds
        assert [s.rounds_done for s in peer.stats] == rounds
        for s in peer.stats:
            assert (s.applied, s.group_size, s.group, s.error) == ("averaged", 3, list(PEERS), None), s
            assert (s.diverged, s.bad_reports, s.resynced) == ([], 0, False), s
            assert s.wait_s == 0.0, s  # the training loop did not wait for the network
            assert s.inner_steps >= 9, s
            assert s.tokens == s.inner_steps * peer.tokens and s.loss == pytest.approx(peer.loss)
        # Each round is its inner steps, back to back, ending at the last step boundary before the deadline.
        assert_overlap_timeline(peer, round_seconds=0.5, step_seconds=OVERLAP_STEPS[peer.id], allreduce_seconds=0.1)
        # The loop went on training while each round but the last (merged by finish) was in flight:
        # at least the two steps (of 0.053 s at most) that the 0.1 s all-reduce outlasts.
        assert overlapped[peer.id] >= 2 * (last_round - 1)
        assert peer.state.rounds_done == peer.state.last_round == last_round
        # Syncs that land within their round never need the second snapshot/correction buffers.
        assert peer.loop._host_params[1] is None and peer.loop._host_correction[1] is None
    # LocalBackend averages exactly: every anchor is bit-identical, and it moved.
    anchor = peers[0].state.anchor
    assert all(torch.equal(p.state.anchor, anchor) for p in peers)
    assert not torch.allclose(anchor, init, atol=STEP_SIZE)
    # ... to where the outer steps on the token-weighted means of what was sent take it.
    assert_close(anchor, replay(init, peers, dict.fromkeys(rounds, list(PEERS))))
    # The loop stops right after its last snapshot and finish() merges it: the live parameters are
    # the shared anchor, nothing of the last round's work is counted twice.
    for peer in peers:
        assert_close(peer.flat_params(), anchor)


# -- weighting and merging, one round at a time --------------------------------------------------
def test_the_outer_step_uses_the_token_weighted_mean_of_the_pseudo_gradients(make_swarm):
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS)
    init = peers[0].state.anchor.clone()
    run_by_hand(peers, rounds=1, steps_before=3)

    pseudo_grads, weights = {}, {}
    for peer in peers:
        record = peer.rounds[1]
        assert torch.equal(record.anchor_before, init)
        pseudo_grads[peer.id] = init - record.params_at_snapshot
        assert_close(pseudo_grads[peer.id], -record.work_at_snapshot)  # three fake steps, nothing else
        weights[peer.id] = 3 * peer.tokens
        sent_vector, sent_weight = peer.backend.sent[1]
        assert sent_weight == weights[peer.id]
        assert_close(sent_vector, pseudo_grads[peer.id])
    mean = kept_step(sum(pseudo_grads[p] * weights[p] for p in PEERS) / sum(weights.values())).float()
    # First Nesterov step from zero momentum: anchor - lr * (g + mu * g), g the step as kept (fp16).
    expected = init - OUTER.lr * (1 + OUTER.momentum) * mean
    unweighted = init - OUTER.lr * (1 + OUTER.momentum) * kept_step(sum(pseudo_grads.values()) / 3).float()
    assert not torch.allclose(expected, unweighted, atol=1e-4)  # the weights matter here
    for peer in peers:
        assert_close(peer.rounds[1].anchor_after, expected)
        assert peer.stats_of(1).tokens == weights[peer.id] and peer.stats_of(1).inner_steps == 3
        assert peer.stats_of(1).applied == "averaged" and peer.stats_of(1).group_size == 3


def test_a_merge_keeps_the_progress_made_since_the_snapshot(make_swarm):
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS)
    init = peers[0].state.anchor.clone()
    step_seconds = 0.25
    run_by_hand(peers, rounds=2, steps_before=3, steps_after=4, step_seconds=step_seconds)

    for round in (1, 2):
        anchor = peers[0].rounds[round].anchor_after
        assert all(torch.equal(p.rounds[round].anchor_after, anchor) for p in peers)
        for peer in peers:
            record = peer.rounds[round]
            progress = record.work_after - record.work_at_snapshot  # the four steps after begin_sync
            assert progress.abs().max() > STEP_SIZE / 10
            # params = new anchor + progress since the snapshot: the pre-snapshot work went into the
            # anchor through the average and is not counted twice; the later work is kept.
            assert_close(record.params_after, anchor + progress, atol=1e-5)
            assert peer.stats_of(round).applied == "averaged"
        # The next round's pseudo-gradient carries those four steps plus the round's own three.
        for peer in peers:
            if round == 1:
                sent_vector, _ = peer.backend.sent[2]
                assert_close(sent_vector, anchor - peer.rounds[2].params_at_snapshot)
                assert_close(sent_vector, -(peer.rounds[2].work_at_snapshot - peer.rounds[1].work_at_snapshot),
                             atol=1e-5)
    # Windows after the first hold the steps after the previous snapshot too (4 + 3), and their time:
    # a window runs from one snapshot to the next. The syncs took no time, so nothing else did.
    for peer in peers:
        assert [s.inner_steps for s in peer.stats] == [3, 7]
        assert [s.compute_s for s in peer.stats] == pytest.approx([3 * step_seconds, 7 * step_seconds], abs=EXACT)
        assert [s.wall_s for s in peer.stats] == pytest.approx([3 * step_seconds, 7 * step_seconds], abs=EXACT)
        assert [s.wait_s for s in peer.stats] == [0.0, 0.0]
    assert_close(peers[0].rounds[2].anchor_after, replay(init, peers, {1: list(PEERS), 2: list(PEERS)}))


# -- blocking mode -------------------------------------------------------------------------------
@pytest.mark.parametrize("full_group", [True, False], ids=["full-group-hub", "min-group-hub"])
def test_blocking_rounds_are_lockstep_with_a_fixed_number_of_inner_steps(make_swarm, full_group):
    inner_steps, last_round, round_seconds = 5, 3, 0.5
    # The all-reduce starts at the round's deadline (and takes no time here).
    peers = make_swarm(LoopConfig(mode="blocking", inner_steps=inner_steps, matchmaking_seconds=0.1),
                       round_seconds=round_seconds, allreduce_seconds=0.0,
                       hub=FullGroupHub(PEERS) if full_group else LocalHub(min_group_size=len(PEERS)))
    init = peers[0].state.anchor.clone()
    # Different speeds: the fast peers must wait for the slow one at every round.
    step_seconds = {"peer-a": 0.011, "peer-b": 0.023, "peer-c": 0.067}
    overlapped = run_on_the_clock(peers, last_round=last_round, step_seconds=step_seconds)

    rounds = list(range(1, last_round + 1))
    for peer in peers:
        assert [s.round for s in peer.stats] == rounds  # the same rounds for everybody
        assert [s.inner_steps for s in peer.stats] == [inner_steps] * last_round
        assert [s.tokens for s in peer.stats] == [inner_steps * peer.tokens] * last_round
        assert [s.rounds_done for s in peer.stats] == rounds
        assert all(s.applied == "averaged" and s.group_size == 3 for s in peer.stats), peer.stats
        assert all(peer.backend.sent[r][1] == inner_steps * peer.tokens for r in rounds)
        assert overlapped[peer.id] == 0  # after_step never returns with a sync in flight
        # After its steps the loop waits, idle, exactly until the deadline, where the all-reduce
        # starts: every round lasts exactly round_seconds, the wait and the sync the rest of it.
        compute_s = inner_steps * step_seconds[peer.id]
        for s in peer.stats:
            assert s.compute_s == pytest.approx(compute_s, abs=EXACT), s
            assert s.wait_s == pytest.approx(round_seconds - compute_s, abs=EXACT), s
            assert s.sync_s == pytest.approx(round_seconds - compute_s, abs=EXACT), s
            assert s.wall_s == pytest.approx(round_seconds, abs=EXACT), s
    anchor = peers[0].state.anchor
    assert all(torch.equal(p.state.anchor, anchor) for p in peers)
    assert not torch.allclose(anchor, init, atol=STEP_SIZE)
    assert_close(anchor, replay(init, peers, dict.fromkeys(rounds, list(PEERS))))
    for peer in peers:
        assert_close(peer.flat_params(), anchor)  # no step happens between the snapshot and the merge


def test_blocking_mode_starts_matchmaking_prepare_lead_before_the_deadline(make_swarm):
    # Five steps end long before the deadline; matchmaking must still not begin before
    # deadline - prepare_lead (a step prepared early waits where the previous round's late peers
    # could find it). The worker waits for that instant while the loop waits for the round.
    inner_steps, round_seconds, prepare_lead = 5, 0.5, 0.2
    peers = make_swarm(LoopConfig(mode="blocking", inner_steps=inner_steps, matchmaking_seconds=0.1,
                                  prepare_lead=prepare_lead),
                       round_seconds=round_seconds, allreduce_seconds=0.0, hub=FullGroupHub(PEERS))
    step_seconds = {"peer-a": 0.011, "peer-b": 0.023, "peer-c": 0.057}  # 5 steps < round - lead
    run_on_the_clock(peers, last_round=2, step_seconds=step_seconds)

    for peer in peers:
        assert all(s.applied == "averaged" and s.group_size == 3 for s in peer.stats), peer.stats
        for r in (1, 2):
            assert peer.backend.prepared_at[r] == pytest.approx(WALL_START + r * round_seconds - prepare_lead,
                                                                abs=EXACT)
        for s in peer.stats:
            assert s.wait_s == pytest.approx(round_seconds - inner_steps * step_seconds[peer.id], abs=EXACT), s
            assert s.wall_s == pytest.approx(round_seconds, abs=EXACT), s


# -- a failed round is folded into the next, and the missed outer step replayed -----------------


def test_a_peer_that_misses_a_round_folds_its_work_into_the_next_and_catches_up(make_swarm):
    # peer-a misses round 2; peer-b and peer-c average it without peer-a.
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS, fail_at={"peer-a": {2}})
    init = peers[0].state.anchor.clone()
    steps_before, steps_after = 3, 2
    run_by_hand(peers, rounds=4, steps_before=steps_before, steps_after=steps_after)
    a, b, c = peers

    # Round 2: folded at peer-a, averaged by the other two.
    folded = a.stats_of(2)
    assert (folded.applied, folded.group_size, folded.error) == ("folded", 1, "injected")
    assert folded.rounds_done == 1
    for peer in (b, c):
        s = peer.stats_of(2)
        assert (s.applied, s.group_size, s.group) == ("averaged", 2, ["peer-b", "peer-c"])
    anchor_1 = a.rounds[1].anchor_after
    # peer-a's anchor stayed where the group was after round 1, and its parameters kept all the
    # work since the round-1 snapshot (the merge only adds anchor_new - anchor_old = 0).
    assert torch.equal(a.rounds[2].anchor_after, anchor_1)
    assert_close(a.rounds[2].params_after, anchor_1 + (a.rounds[2].work_after - a.rounds[1].work_at_snapshot),
                 atol=1e-5)
    assert not torch.equal(b.rounds[2].anchor_after, anchor_1)

    # Round 3: peer-a's contribution weighs both rounds' tokens and carries both rounds' work,
    # relative to its own (round-1) anchor; the others' carries nothing extra.
    window_tokens = (steps_after + steps_before) * a.tokens
    assert a.stats_of(2).tokens == a.stats_of(3).tokens == window_tokens
    sent_vector, sent_weight = a.backend.sent[3]
    assert sent_weight == a.stats_of(2).tokens + a.stats_of(3).tokens == 2 * window_tokens
    assert_close(sent_vector, anchor_1 - a.rounds[3].params_at_snapshot)
    assert_close(sent_vector, -(a.rounds[3].work_at_snapshot - a.rounds[1].work_at_snapshot), atol=1e-5)
    for peer in (b, c):
        assert peer.backend.sent[3][1] == peer.stats_of(3).tokens == (steps_after + steps_before) * peer.tokens
    # Its anchor was a round behind: the group's check flags it, and it replays the round-2 step it
    # missed (fetched from a peer that applied it) before applying round 3's: no state download.
    for peer in peers:
        s = peer.stats_of(3)
        assert (s.applied, s.group_size, s.diverged, s.resynced) == ("averaged", 3, ["peer-a"], False), s
        assert s.caught_up == (1 if peer is a else 0), s
    anchor_3 = b.rounds[3].anchor_after
    assert torch.equal(c.rounds[3].anchor_after, anchor_3)
    assert torch.equal(a.rounds[3].anchor_after, anchor_3)  # the step as kept: replayed exactly
    assert a.stats_of(3).rounds_done == b.stats_of(3).rounds_done == 3
    # After the catch-up peer-a's parameters are its anchor plus its steps since the snapshot.
    assert_close(a.rounds[3].params_after,
                 a.rounds[3].anchor_after + (a.rounds[3].work_after - a.rounds[3].work_at_snapshot), atol=1e-5)
    # The shared anchor is the outer steps on the weighted means of what each group sent: peer-a's
    # round-2 work reached it in round 3, with the carried weight.
    groups = {1: list(PEERS), 2: ["peer-b", "peer-c"], 3: list(PEERS), 4: list(PEERS)}
    assert_close(anchor_3, replay(init, peers, {r: groups[r] for r in (1, 2, 3)}))

    # Round 4: back to normal: the replayed step left peer-a on the very anchor of the others.
    for peer in peers:
        s = peer.stats_of(4)
        assert (s.applied, s.group_size, s.diverged, s.resynced, s.caught_up) == ("averaged", 3, [], False, 0), s
        assert peer.backend.sent[4][1] == s.tokens == (steps_after + steps_before) * peer.tokens
        assert torch.equal(peer.state.momentum, b.state.momentum)
        assert peer.state.rounds_done == peer.state.last_round == 4
    assert torch.equal(c.state.anchor, b.state.anchor)
    assert torch.equal(a.state.anchor, b.state.anchor)
    assert_close(b.state.anchor, replay(init, peers, groups), atol=1e-5)


def test_a_peer_two_rounds_behind_replays_both_steps(make_swarm):
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS, fail_at={"peer-a": {2, 3}})
    init = peers[0].state.anchor.clone()
    run_by_hand(peers, rounds=5)
    a, b, c = peers
    assert [s.applied for s in a.stats] == ["averaged", "folded", "folded", "averaged", "averaged"]
    assert [s.caught_up for s in a.stats] == [0, 0, 0, 2, 0], a.stats
    assert not any(s.resynced for p in peers for s in p.stats)
    assert a.stats_of(4).rounds_done == b.stats_of(4).rounds_done == 4
    assert b.stats_of(5).diverged == [] and a.stats_of(5).diverged == []
    assert torch.equal(a.state.anchor, b.state.anchor)
    groups = {1: list(PEERS), 2: ["peer-b", "peer-c"], 3: ["peer-b", "peer-c"], 4: list(PEERS), 5: list(PEERS)}
    assert_close(b.state.anchor, replay(init, peers, groups), atol=1e-5)


def test_a_partial_average_is_not_applied_and_its_step_is_replayed_without_counting_our_work_twice(make_swarm):
    # Round 2's all-reduce has all three contributions, but peer-a gets part of the average back
    # (a reducer failed on its side): applying it would put peer-a's anchor where no one's is.
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS, partial_at={"peer-a": {2}})
    init = peers[0].state.anchor.clone()
    run_by_hand(peers, rounds=4)
    a, b, c = peers
    folded = a.stats_of(2)
    assert (folded.applied, folded.error, folded.rounds_done) == ("folded", "partial all-reduce: injected", 1)
    assert folded.group_size == 3 and folded.bytes_sent > 0  # it took part: its work is in the others' step
    assert torch.equal(a.rounds[2].anchor_after, a.rounds[1].anchor_after)
    for peer in (b, c):
        assert (peer.stats_of(2).applied, peer.stats_of(2).group_size) == ("averaged", 3)
    # Its round-2 work is in the others' step: its parameters gave it up, as after an averaged round.
    assert_close(a.rounds[2].params_after,
                 a.rounds[2].anchor_after + (a.rounds[2].work_after - a.rounds[2].work_at_snapshot), atol=1e-5)
    # Round 3: it replays the round-2 step (no download) and contributes its round-3 work alone,
    # with its round-3 weight: nothing is counted twice.
    for peer in peers:
        s = peer.stats_of(3)
        assert (s.applied, s.resynced, s.caught_up) == ("averaged", False, 1 if peer is a else 0), s
    sent_vector, sent_weight = a.backend.sent[3]
    assert sent_weight == a.stats_of(3).tokens
    assert_close(sent_vector, -(a.rounds[3].work_at_snapshot - a.rounds[2].work_at_snapshot), atol=1e-5)
    assert torch.equal(a.state.anchor, b.state.anchor)
    groups = {r: list(PEERS) for r in (1, 2, 3, 4)}
    assert_close(b.state.anchor, replay(init, peers, groups), atol=1e-5)
    assert all(peer.stats_of(4).diverged == [] for peer in peers)


def test_a_partial_round_that_nobody_applied_gives_its_work_back_for_the_next_contribution(make_swarm):
    # Every member lost a share of round 2 (a reducer crashed): nobody applies it, nobody is ahead.
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS,
                       partial_at={peer: {2} for peer in PEERS})
    init = peers[0].state.anchor.clone()
    run_by_hand(peers, rounds=4)
    for peer in peers:
        assert [s.applied for s in peer.stats] == ["averaged", "folded", "averaged", "averaged"], peer.stats
        assert [s.caught_up for s in peer.stats] == [0, 0, 0, 0] and not any(s.resynced for s in peer.stats)
        # Round 3 found the round-2 step applied by nobody: the round-2 work went back into the
        # parameters and reaches round 4's contribution, with its weight; none of it is lost.
        assert peer.backend.sent[3][1] == peer.stats_of(3).tokens
        assert peer.backend.sent[4][1] == peer.stats_of(2).tokens + peer.stats_of(4).tokens
        work = -(peer.rounds[4].work_at_snapshot - peer.rounds[3].work_at_snapshot
                 + peer.rounds[2].work_at_snapshot - peer.rounds[1].work_at_snapshot)
        assert_close(peer.backend.sent[4][0], work, atol=1e-5)
    assert all(torch.equal(p.state.anchor, peers[0].state.anchor) for p in peers)
    groups = {1: list(PEERS), 3: list(PEERS), 4: list(PEERS)}
    assert_close(peers[0].state.anchor, replay(init, peers, groups), atol=1e-5)


def test_a_peer_further_behind_than_the_history_downloads_the_state(make_swarm):
    # Three missed steps: more than the two every peer keeps, so peer-a re-syncs (a full download).
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS, fail_at={"peer-a": {2, 3, 4}})
    run_by_hand(peers, rounds=6)
    a, b, c = peers
    s = a.stats_of(5)
    assert (s.applied, s.diverged, s.resynced, s.caught_up) == ("averaged", ["peer-a"], True, 0), s
    assert torch.equal(a.state.anchor, b.state.anchor)  # a downloaded state is exact
    assert a.stats_of(6).diverged == [] and not a.stats_of(6).resynced


def test_a_replayed_step_that_does_not_reach_the_groups_anchor_falls_back_to_a_download(make_swarm):
    hub = LocalHub()
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS, fail_at={"peer-a": {2}}, hub=hub)
    a, b, c = peers
    for donor in (b, c):  # the donors serve a corrupted copy of their update
        honest = hub.update_providers[donor.id]
        hub.update_providers[donor.id] = lambda n, honest=honest: (
            None if (u := honest(n)) is None else AppliedUpdate(u.round, u.rounds_done, u.update * 3))
    run_by_hand(peers, rounds=4)
    s = a.stats_of(3)
    assert (s.applied, s.diverged, s.resynced, s.caught_up) == ("averaged", ["peer-a"], True, 0), s
    assert torch.equal(a.state.anchor, b.state.anchor)
    assert a.stats_of(4).diverged == []


# -- a sync longer than a round: never a stall, never a re-sync ---------------------------------
@pytest.mark.parametrize("prepare_lead", [0.2, 0.02], ids=["lead-longer-than-a-step", "steps-longer-than-the-lead"])
def test_a_sync_longer_than_a_round_never_stalls_training_nor_forces_a_resync(make_swarm, prepare_lead):
    # Every all-reduce ends 1.5 rounds after its deadline. The loop never waits: a peer whose
    # previous sync will still run at the next deadline stays out of that round (its work is folded
    # into its next contribution), and the outer step it missed is replayed, not downloaded. With
    # steps longer than prepare_lead a round often ends before its prepare time: the decision is
    # then taken in begin_sync, by the same rules.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=prepare_lead)
    round_seconds, last_round = 0.5, 8
    peers = make_swarm(config, round_seconds=round_seconds, hub=DecidedHub(PEERS),
                       allreduce_seconds=1.5 * round_seconds)
    init = peers[0].state.anchor.clone()
    run_on_the_clock(peers, last_round=last_round, step_seconds=OVERLAP_STEPS)

    for peer in peers:
        assert [s.round for s in peer.stats] == list(range(1, last_round + 1)), peer.stats
        assert all(s.wait_s == 0.0 for s in peer.stats[:-1]), peer.stats  # only finish() waits
        assert not any(s.resynced for s in peer.stats), peer.stats
        joined = [s.round for s in peer.stats if not s.skipped]
        assert all(b - a <= 2 for a, b in zip([0, *joined], joined)), joined  # every other round at least
        assert any(s.skipped for s in peer.stats)
        for s in peer.stats:
            assert s.applied == ("folded" if s.skipped else "averaged"), (s, peer.stats)
            assert s.skipped == (s.error is not None and s.error.startswith("skipped")), s
        # The work of every round reached the anchor or is still in the parameters: the parameters
        # after finish() are the anchor (the last contribution merged) plus nothing else.
        assert_close(peer.flat_params(), peer.state.anchor, atol=1e-5)
        assert peer.loop.sync_lateness == pytest.approx(1.5 * round_seconds, abs=0.06)
        assert peer.loop._host_params[1] is not None  # a sync was queued behind a running one
        # Once measured, a sync takes two rounds: the peer joins the even rounds, as do the others.
        assert peer.loop.sync_period == 2
        assert [r for r in joined if r > 2] == [r for r in range(3, last_round + 1) if r % 2 == 0], joined
    anchor = peers[0].state.anchor
    assert not torch.allclose(anchor, init, atol=STEP_SIZE)
    for peer in peers:
        assert torch.equal(peer.state.anchor, anchor)
        assert peer.state.rounds_done == peers[0].state.rounds_done


def test_a_peer_that_starts_late_in_a_round_stays_out_of_it_and_brings_that_work_to_the_next(make_swarm):
    # peer-b starts with 60% of round 1 left and joins it; peer-c (joined or resumed) starts with 20%
    # left: its pseudo-gradient would be a sliver next to the others' (which robust aggregation, judging
    # parts against our own, could refuse), so it stays out, sends round 1's work with round 2's and
    # replays the outer step it missed.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2)
    round_seconds, last_round = 0.5, 3
    peers = make_swarm(config, round_seconds=round_seconds, hub=DecidedHub(PEERS), allreduce_seconds=0.1)
    a, b, c = peers
    b.clock.advance(0.4 * round_seconds)
    c.clock.advance(0.8 * round_seconds)
    run_on_the_clock(peers, last_round=last_round, step_seconds=OVERLAP_STEPS)

    assert [s.round for s in c.stats] == [1, 2, 3]
    first = c.stats_of(1)
    assert first.skipped and first.applied == "folded" and first.tokens > 0, first
    assert "started training 0.1s before the deadline" in first.error, first.error
    assert 1 not in c.backend.sent
    assert c.backend.sent[2][1] == first.tokens + c.stats_of(2).tokens  # round 1's work, sent with round 2's
    assert a.stats_of(1).group == b.stats_of(1).group == ["peer-a", "peer-b"]
    for peer in peers:
        for round in (2, 3):
            assert peer.stats_of(round).group == list(PEERS), (peer.id, peer.stats_of(round))
        assert not any(s.resynced for s in peer.stats), peer.stats
        # The outer step of round 1 that c stayed out of: replayed (2 bytes/param), not downloaded.
        assert [s.caught_up for s in peer.stats] == ([0, 1, 0] if peer is c else [0, 0, 0]), peer.stats
        assert_close(peer.flat_params(), peer.state.anchor, atol=1e-5)  # every step's work is in the anchor
    for peer in (b, c):  # one shared model
        assert torch.equal(peer.state.anchor, a.state.anchor)


@pytest.mark.parametrize("c_steps", [1, 5], ids=["sliver", "full-round"])
def test_a_blocking_peer_that_starts_late_stays_out_unless_it_did_its_inner_steps(make_swarm, c_steps):
    # Blocking mode restarts its window after every wait, so only the first window since start() can
    # be late. peer-c starts with 20% of round 1 left: with 1 of its 5 steps done by then it stays out
    # (a sliver next to the others' full rounds) and sends round 1's work with round 2's; when its 5
    # steps fit, that is a full contribution and it joins.
    inner_steps, round_seconds = 5, 0.5
    config = LoopConfig(mode="blocking", inner_steps=inner_steps, matchmaking_seconds=0.1, prepare_lead=0.05)
    peers = make_swarm(config, round_seconds=round_seconds, hub=DecidedHub(PEERS), allreduce_seconds=0.0)
    a, b, c = peers
    c.clock.advance(0.8 * round_seconds)
    # c's steps: 1 or 5 of them before deadline - prepare_lead (0.05 s), when it decides; a's and b's all fit.
    step_seconds = {"peer-a": 0.011, "peer-b": 0.023, "peer-c": 0.009 if c_steps == 5 else 0.03}
    run_on_the_clock(peers, last_round=3, step_seconds=step_seconds)

    first = c.stats_of(1)
    if c_steps == 1:
        assert first.skipped and first.applied == "folded" and "started training 0.1s before" in first.error, first
        assert 1 not in c.backend.sent
        assert c.backend.sent[2][1] == first.tokens + c.stats_of(2).tokens  # round 1's work, with round 2's
        assert a.stats_of(1).group == b.stats_of(1).group == ["peer-a", "peer-b"]
        assert [s.caught_up for s in c.stats] == [0, 1, 0], c.stats  # the missed step replayed
    else:
        assert not first.skipped and first.inner_steps == inner_steps, first
        assert all(p.stats_of(1).group == list(PEERS) for p in peers), [p.stats_of(1) for p in peers]
    for peer in peers:
        assert [s.round for s in peer.stats] == [1, 2, 3], peer.stats
        for round in (2, 3):  # windows after a wait are never late, however the wait ended
            assert peer.stats_of(round).group == list(PEERS), (peer.id, peer.stats_of(round))
        assert not any(s.resynced for s in peer.stats), peer.stats
    for peer in (b, c):
        assert torch.equal(peer.state.anchor, a.state.anchor)


def test_peers_agree_on_the_sync_period_from_everyones_lateness(make_swarm):
    # 12 s rounds, syncs ending 14-34 s late: each peer alone would pick 2 or 3 and meet the
    # others only now and then; from everyone's published lateness they pick one period.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2)
    peers = make_swarm(config, round_seconds=12.0)
    own = dict(zip(PEERS, (14.0, 20.0, 34.0)))
    for peer in peers:
        peer.loop.policy.lateness = own[peer.id]
    assert sorted(p.loop.sync_period for p in peers) == [2, 2, 3]  # alone: out of phase
    for peer in peers:
        peer.loop.policy._swarm_lateness = lambda me=peer.id: [late for other, late in own.items() if other != me]
    assert [p.loop.sync_period for p in peers] == [2, 2, 2] and peers[0].loop.agreed_lateness == 20.0
    joiner = peers[0].loop.policy
    joiner.lateness = None  # not measured yet: it falls into the swarm's phase at once
    assert joiner.sync_period == 3 and joiner.agreed_lateness == 27.0
    joiner._swarm_lateness = lambda: [3.0, 4.0, 1e6]  # one peer claiming anything does not move it
    assert joiner.sync_period == 1
    joiner._swarm_lateness = lambda: []
    assert joiner.agreed_lateness is None and joiner.sync_period == 1


def test_a_joiners_download_accepts_the_rounds_its_donors_reach_while_it_runs(make_swarm):
    # The donor moved on while the joiner downloaded (12 s rounds, a minute on a slow link): its
    # state is of round 6 when the joiner's schedule said round 3 at the start. Bounded at the
    # start (round 4), every such donor was refused and the joiner started from the initial weights.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2, download_timeout=60.0)
    joiner, donor, _ = make_swarm(config, round_seconds=12.0)
    for r in range(1, 7):
        donor.state.apply(torch.full_like(donor.state.anchor, 0.01), round=r)
    joiner.clock.advance(2.5 * 12.0)  # in round 3
    plain = joiner.backend.download_state

    def like_hivemind(peers, *, max_round, **kwargs):  # HivemindBackend drops a donor past max_round
        state = plain(peers, max_round=max_round, **kwargs)
        joiner.clock.advance(40.0)  # what the download took
        return None if state is None or state.metadata["round"] > max_round else state

    joiner.backend.download_state = like_hivemind
    assert joiner.loop.initial_sync([donor.id]) == 6
    assert torch.equal(joiner.state.anchor, donor.state.anchor)
    # A claim past what the download's duration allows is still refused (now in round 6: up to 12).
    for r in range(7, 14):
        donor.state.apply(torch.full_like(donor.state.anchor, 0.01), round=r)
    assert joiner.loop.initial_sync([donor.id]) is None


def test_a_resyncs_retry_accepts_the_rounds_its_donor_reached_during_the_failed_attempts(make_swarm):
    # A diverged peer re-syncs in round 3; its first download fails after a minute (a donor
    # vanished mid-slice), and meanwhile the donor applies the group's step in round 10. Bounded
    # once at the first attempt's start (round 9), every retry refused it.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2, download_timeout=60.0)
    peer, donor, _ = make_swarm(config, round_seconds=12.0)
    donor.state.apply(torch.full_like(donor.state.anchor, 0.01), round=1)
    reference = donor.state.claim()  # what the group agreed on in round 3
    step = torch.full_like(donor.state.anchor, 0.02)
    peer.clock.advance(2.5 * 12.0)  # in round 3
    plain, attempts = peer.backend.download_state, []

    def like_hivemind(peers, *, max_round, **kwargs):  # HivemindBackend drops a donor past max_round
        attempts.append(max_round)
        if len(attempts) == 1:
            peer.clock.advance(60.0)  # now in round 8
            donor.state.apply(step, round=10)
            return None
        state = plain(peers, max_round=max_round, **kwargs)
        peer.clock.advance(20.0)  # now in round 10
        return None if state is None or state.metadata["round"] > max_round else state

    peer.backend.download_state = like_hivemind
    assert peer.loop.runner.kind.recovery.resync(3, Resync([donor.id], reference), step)
    assert attempts[:2] == [9, 14]
    assert torch.equal(peer.state.anchor, donor.state.anchor) and peer.state.last_round == 10


def test_a_resync_whose_donor_stepped_twice_during_the_download_stops_instead_of_retrying(make_swarm):
    # On a slow link the download outlasts two of the donor's outer steps: its state can no longer
    # be checked against the group's reference, and every retry would find it further ahead (seen
    # in sync_modes' 0.5 regime: five attempts held the sync lane for a minute, every round
    # skipped). One attempt, then the peer keeps training; the next group's check tells it again.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2, download_timeout=60.0)
    peer, donor, _ = make_swarm(config, round_seconds=12.0)
    reference = donor.state.claim()  # what the group agreed on in round 3
    peer.clock.advance(2.5 * 12.0)  # in round 3
    plain, attempts = peer.backend.download_state, []

    def slow(peers, **kwargs):
        attempts.append(1)
        peer.clock.advance(24.0)  # the download took two rounds (now in round 5)
        for r in (4, 5):  # the donor's steps meanwhile
            donor.state.apply(torch.full_like(donor.state.anchor, 0.01), round=r + 2 * (len(attempts) - 1))
        return plain(peers, **kwargs)

    peer.backend.download_state = slow
    anchor = peer.state.anchor.clone()
    assert not peer.loop.runner.kind.recovery.resync(3, Resync([donor.id], reference), None)
    assert len(attempts) == 1
    assert torch.equal(peer.state.anchor, anchor) and peer.state.rounds_done == 0  # nothing adopted


class DecidedHub(LocalHub):
    """The group of round r is every peer that prepared it, known once each peer has decided about r
    (prepared r or a later round, or left): which thread runs first in real time decides nothing."""

    def __init__(self, peers):
        super().__init__()
        self.peers = tuple(peers)
        self.decided: dict[str, float] = {}

    def prepare(self, peer: str, round: int) -> None:
        super().prepare(peer, round)
        with self._cond:
            self.decided[peer] = max(round, self.decided.get(peer, 0))
            self._cond.notify_all()

    def leave(self, peer: str) -> None:
        with self._cond:
            self.decided[peer] = float("inf")
            self._cond.notify_all()

    def average(self, peer: str, round: int, *args, **kwargs):
        with self._cond:
            self._cond.wait_for(lambda: all(self.decided.get(p, 0) >= round for p in self.peers), timeout=WAIT)
        return super().average(peer, round, *args, **kwargs)


def test_each_round_record_counts_what_robust_aggregation_refused_during_its_sync(make_swarm):
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS)
    peers[0].backend.refusals_per_sync = 2
    run_by_hand(peers, rounds=3)
    # Per round, not cumulative; kinds that did not occur are left out.
    assert [s.robust for s in peers[0].stats] == [{"refused_parts": 2}] * 3
    assert [s.robust for s in peers[1].stats] == [{}] * 3


def test_a_round_that_ends_during_one_long_step_still_gets_its_record(make_swarm):
    # A step that outlasts a whole round (a stalled machine: 16 peers on 2 cores showed 10 s steps in
    # 10 s rounds) moves the loop past that round without a window of its own; its record is one of
    # "one per round" all the same, with no work and the reason.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2)
    round_seconds, last_round = 0.5, 4
    peers = make_swarm(config, round_seconds=round_seconds, allreduce_seconds=0.1)
    steps = {**OVERLAP_STEPS, "peer-c": 1.3 * round_seconds}
    run_on_the_clock(peers, last_round=last_round, step_seconds=steps)
    c = peers[2]
    rounds = [s.round for s in c.stats]
    assert rounds == sorted(rounds) and set(range(1, last_round + 1)) <= set(rounds), rounds
    jumped = [s for s in c.stats if s.inner_steps == 0]
    assert jumped and all(s.skipped and s.applied == "folded" and s.tokens == 0 for s in jumped), c.stats
    assert all("ran past the end of round" in s.error for s in jumped)
