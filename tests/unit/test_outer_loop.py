"""OuterLoop: three peers on threads over one LocalHub, each with its own tiny model, outer state and
sync worker, driven by fake inner steps. Overlap rounds on the wall clock, blocking rounds in lockstep,
the weighting, the merge of an update into a model that kept training, and a failed round folded
into the next contribution."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from averaging.backend import AverageOutcome
from averaging.diloco import OuterConfig, OuterState
from averaging.flat import FlatLayout
from averaging.local_backend import LocalBackend, LocalHub
from averaging.outer import outer_step_
from averaging.outer_loop import LoopConfig, OuterLoop, RoundStats
from averaging.sync import SyncWorker
from protocols.schedule import RoundSchedule

pytestmark = pytest.mark.timeout(60)  # a deadlock fails the test instead of hanging the suite

PEERS = ("peer-a", "peer-b", "peer-c")
TOKENS = {"peer-a": 100, "peer-b": 300, "peer-c": 700}  # per inner step: the weights differ
OUTER = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
STEP_SIZE = 0.01
WAIT = 20.0  # generous bound on anything one peer waits for; the happy paths take milliseconds
# Manual driving: rounds never end on the clock, and each round is prepared as soon as it begins,
# so the test decides when a round ends by calling begin_sync itself.
MANUAL = dict(mode="overlap", matchmaking_seconds=0.1, prepare_lead=1e6)
MANUAL_ROUND_SECONDS = 1e3


class FaultyBackend(LocalBackend):
    """A LocalBackend that records what it sends, and misses the rounds in ``fail_rounds`` (it never
    joins their group, as after failed matchmaking), so the others average without it."""

    def __init__(self, hub: LocalHub, peer_id: str, state_provider, fail_rounds=()):
        super().__init__(hub, peer_id, state_provider)
        self.fail_rounds = set(fail_rounds)
        self.sent: dict[int, tuple[torch.Tensor, float]] = {}  # round -> (pseudo-gradient, weight)
        self._round: int | None = None

    def prepare(self, *, round: int, **kwargs) -> None:
        self._round = round
        if round not in self.fail_rounds:
            super().prepare(round=round, **kwargs)

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float) -> AverageOutcome:
        round, self._round = self._round, None
        self.sent[round] = (vector.clone(), weight)
        if round in self.fail_rounds:
            return AverageOutcome(ok=False, error="injected")
        return super().average(vector, weight=weight, timeout=timeout)


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
    outer: OuterState
    backend: FaultyBackend
    worker: SyncWorker
    loop: OuterLoop
    tokens: int
    loss: float
    generator: torch.Generator
    work: torch.Tensor  # the sum of every fake inner step's change, flat: what merges must preserve
    stats: list[RoundStats] = field(default_factory=list)
    rounds: dict[int, Snapshot] = field(default_factory=dict)

    def flat_params(self) -> torch.Tensor:
        return self.layout.pack(dict(self.model.named_parameters()), self.layout.new_buffer())

    @torch.no_grad()
    def inner_step(self, sleep: float) -> float:
        started = time.perf_counter()
        delta = torch.randn(self.layout.numel, generator=self.generator) * -STEP_SIZE
        params = dict(self.model.named_parameters())
        for name, view in self.layout.views(delta).items():
            params[name].add_(view)
        self.work += delta
        time.sleep(sleep)  # the step takes time, as a real one would
        return time.perf_counter() - started

    def train_step(self, sleep: float = 0.0) -> None:
        seconds = self.inner_step(sleep)
        self.stats += self.loop.after_step(tokens=self.tokens, seconds=seconds, loss=self.loss)

    def stats_of(self, round: int) -> RoundStats:
        [stats] = [s for s in self.stats if s.round == round]
        return stats


@pytest.fixture
def make_swarm():
    workers: list[SyncWorker] = []

    def make(config: LoopConfig, *, round_seconds: float, start_in: float = 0.0, hub: LocalHub | None = None,
             fail_at: dict[str, set[int]] | None = None) -> list[Peer]:
        hub = hub or LocalHub()
        schedule = RoundSchedule(start_time=time.time() + start_in, round_seconds=round_seconds)
        peers = []
        for index, peer_id in enumerate(PEERS):
            with torch.random.fork_rng():
                torch.manual_seed(0)  # the same init everywhere, as after a joint start
                model = torch.nn.Linear(8, 4)
            layout = FlatLayout.of(model.named_parameters())
            outer = OuterState(layout, layout.pack(dict(model.named_parameters()), layout.new_buffer()), OUTER)
            backend = FaultyBackend(hub, peer_id, outer.shared_state, (fail_at or {}).get(peer_id, ()))
            worker = SyncWorker(backend, allreduce_timeout=5.0, matchmaking_grace=1.0)
            workers.append(worker)
            loop = OuterLoop(outer=outer, worker=worker, layout=layout,
                             params=lambda model=model: dict(model.named_parameters()),
                             schedule=lambda: schedule, config=config, peer_id=peer_id,
                             alone=lambda: False, device=torch.device("cpu"))
            peers.append(Peer(peer_id, model, layout, outer, backend, worker, loop, TOKENS[peer_id],
                              loss=2.0 + index, generator=torch.Generator().manual_seed(100 + index),
                              work=layout.new_buffer()))
        assert all(torch.equal(p.outer.anchor, peers[0].outer.anchor) for p in peers)
        return peers

    yield make
    for worker in workers:
        worker.close()


def on_threads(peers: list[Peer], train) -> list:
    """Run ``train(peer)`` for every peer on its own thread; re-raise the first failure."""
    with ThreadPoolExecutor(len(peers)) as pool:
        futures = [pool.submit(train, peer) for peer in peers]
        return [future.result(timeout=3 * WAIT) for future in futures]


def run_on_the_clock(peers: list[Peer], *, last_round: int, sleeps: dict[str, float]) -> dict[str, int]:
    """Train until every peer has ended ``last_round``; returns, per peer, how many steps ran while
    a sync was in flight."""
    barrier = threading.Barrier(len(peers), timeout=WAIT)

    def train(peer: Peer) -> int:
        barrier.wait()
        peer.loop.start()
        overlapped = 0
        while peer.loop.round <= last_round:
            overlapped += peer.loop.syncing
            peer.train_step(sleeps[peer.id])
        peer.stats += peer.loop.finish()
        return overlapped

    return dict(zip([p.id for p in peers], on_threads(peers, train)))


def run_by_hand(peers: list[Peer], *, rounds: int, steps_before: int = 3, steps_after: int = 2) -> None:
    """Each round: ``steps_before`` steps, begin_sync, ``steps_after`` steps while it is in flight,
    then try_merge(wait=True); ``peer.rounds`` records what the test needs around each."""
    barrier = threading.Barrier(len(peers), timeout=WAIT)

    def train(peer: Peer) -> None:
        peer.loop.start()
        for round in range(1, rounds + 1):
            for _ in range(steps_before):
                peer.train_step()
            # Our own matchmaking for this round is done once the worker has run every job before
            # this one; the barrier then makes sure nobody averages before the group is known.
            peer.worker.submit(lambda: None).result(timeout=WAIT)
            barrier.wait()
            assert peer.loop.round == round and not peer.loop.syncing
            record = Snapshot(peer.outer.anchor.clone(), peer.flat_params(), peer.work.clone())
            peer.stats += peer.loop.begin_sync()
            for _ in range(steps_after):
                peer.train_step()
            peer.stats += peer.loop.try_merge(wait=True)
            assert not peer.loop.syncing
            record.anchor_after, record.params_after = peer.outer.anchor.clone(), peer.flat_params()
            record.work_after = peer.work.clone()
            peer.rounds[round] = record

    on_threads(peers, train)


def weighted_mean(sent: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    total = sum(weight for _, weight in sent)
    return sum(vector.double() * (weight / total) for vector, weight in sent).float()


def replay(init: torch.Tensor, peers: list[Peer], groups: dict[int, list[str]]) -> torch.Tensor:
    """The anchor after the outer steps on the weighted means of what each round's group sent."""
    anchor, momentum = init.clone(), torch.zeros_like(init)
    by_id = {p.id: p for p in peers}
    for round in sorted(groups):
        mean = weighted_mean([by_id[member].backend.sent[round] for member in groups[round]])
        outer_step_(anchor, mean, momentum, lr=OUTER.lr, mu=OUTER.momentum, nesterov=OUTER.nesterov)
    return anchor


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    assert torch.allclose(actual, expected, rtol=0, atol=atol), (actual - expected).abs().max().item()


# -- overlap mode on the wall clock --------------------------------------------------------------
def test_overlap_rounds_average_in_the_background_while_training_goes_on(make_swarm):
    # A healthy swarm where every round's group is all three peers. With the plain hub (a group of
    # whoever prepared when the first member arrives) a thread stalled for prepare_lead misses the
    # round, which happened on a loaded 2-core box; with the full-group hub such a stall only delays
    # the others' sync threads, never their training. Round 1 starts 0.1 s in the future so that
    # every peer starts in it.
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=0.2)
    peers = make_swarm(config, round_seconds=0.5, start_in=0.1, hub=FullGroupHub(PEERS))
    init = peers[0].outer.anchor.clone()
    last_round = 4
    overlapped = run_on_the_clock(peers, last_round=last_round, sleeps=dict.fromkeys(PEERS, 0.004))

    rounds = list(range(1, last_round + 1))
    for peer in peers:
        assert [s.round for s in peer.stats] == rounds
        assert [s.rounds_done for s in peer.stats] == rounds
        for s in peer.stats:
            assert (s.applied, s.group_size, s.group, s.error) == ("averaged", 3, list(PEERS), None), s
            assert (s.diverged, s.bad_reports, s.resynced) == ([], 0, False), s
            assert s.wait_s < 0.2, s  # the training loop did not wait for the network
            assert s.inner_steps >= 5 and s.compute_s > 0, s
            assert s.tokens == s.inner_steps * peer.tokens and s.loss == pytest.approx(peer.loss)
        # The loop went on training while each round but the last (merged by finish) was in flight.
        assert overlapped[peer.id] >= last_round - 1
        assert peer.outer.rounds_done == peer.outer.last_round == last_round
    # LocalBackend averages exactly: every anchor is bit-identical, and it moved.
    anchor = peers[0].outer.anchor
    assert all(torch.equal(p.outer.anchor, anchor) for p in peers)
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
    init = peers[0].outer.anchor.clone()
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
    mean = sum(pseudo_grads[p] * weights[p] for p in PEERS) / sum(weights.values())
    # First Nesterov step from zero momentum: anchor - lr * (g + mu * g).
    expected = init - OUTER.lr * (1 + OUTER.momentum) * mean
    unweighted = init - OUTER.lr * (1 + OUTER.momentum) * sum(pseudo_grads.values()) / 3
    assert not torch.allclose(expected, unweighted, atol=1e-4)  # the weights matter here
    for peer in peers:
        assert_close(peer.rounds[1].anchor_after, expected)
        assert peer.stats_of(1).tokens == weights[peer.id] and peer.stats_of(1).inner_steps == 3
        assert peer.stats_of(1).applied == "averaged" and peer.stats_of(1).group_size == 3


def test_a_merge_keeps_the_progress_made_since_the_snapshot(make_swarm):
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS)
    init = peers[0].outer.anchor.clone()
    run_by_hand(peers, rounds=2, steps_before=3, steps_after=4)

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
    # Windows after the first hold the steps after the previous snapshot too (4 + 3).
    assert [s.inner_steps for s in peers[0].stats] == [3, 7]
    assert_close(peers[0].rounds[2].anchor_after, replay(init, peers, {1: list(PEERS), 2: list(PEERS)}))


# -- blocking mode -------------------------------------------------------------------------------
@pytest.mark.parametrize("full_group", [True, False], ids=["full-group-hub", "min-group-hub"])
def test_blocking_rounds_are_lockstep_with_a_fixed_number_of_inner_steps(make_swarm, full_group):
    inner_steps, last_round = 5, 3
    peers = make_swarm(LoopConfig(mode="blocking", inner_steps=inner_steps, matchmaking_seconds=0.1),
                       round_seconds=0.5, hub=FullGroupHub(PEERS) if full_group else LocalHub(min_group_size=len(PEERS)))
    init = peers[0].outer.anchor.clone()
    # Different speeds: the fast peers must wait for the slow one at every round.
    overlapped = run_on_the_clock(peers, last_round=last_round,
                                  sleeps={"peer-a": 0.0, "peer-b": 0.002, "peer-c": 0.008})

    rounds = list(range(1, last_round + 1))
    for peer in peers:
        assert [s.round for s in peer.stats] == rounds  # the same rounds for everybody
        assert [s.inner_steps for s in peer.stats] == [inner_steps] * last_round
        assert [s.tokens for s in peer.stats] == [inner_steps * peer.tokens] * last_round
        assert [s.rounds_done for s in peer.stats] == rounds
        assert all(s.applied == "averaged" and s.group_size == 3 for s in peer.stats), peer.stats
        assert all(peer.backend.sent[r][1] == inner_steps * peer.tokens for r in rounds)
        assert overlapped[peer.id] == 0  # after_step never returns with a sync in flight
    anchor = peers[0].outer.anchor
    assert all(torch.equal(p.outer.anchor, anchor) for p in peers)
    assert not torch.allclose(anchor, init, atol=STEP_SIZE)
    assert_close(anchor, replay(init, peers, dict.fromkeys(rounds, list(PEERS))))
    for peer in peers:
        assert_close(peer.flat_params(), anchor)  # no step happens between the snapshot and the merge


# -- a failed round is folded into the next ------------------------------------------------------
def test_a_peer_that_misses_a_round_folds_its_work_into_the_next_and_resyncs(make_swarm):
    # peer-a misses round 2; peer-b and peer-c average it without peer-a.
    peers = make_swarm(LoopConfig(**MANUAL), round_seconds=MANUAL_ROUND_SECONDS, fail_at={"peer-a": {2}})
    init = peers[0].outer.anchor.clone()
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
    # Its anchor was a round behind: the group's check flags it, and it takes peer-b's state.
    for peer in peers:
        s = peer.stats_of(3)
        assert (s.applied, s.group_size, s.diverged) == ("averaged", 3, ["peer-a"]), s
        assert s.resynced == (peer is a), s
    anchor_3 = b.rounds[3].anchor_after
    assert all(torch.equal(p.rounds[3].anchor_after, anchor_3) for p in peers)
    assert a.stats_of(3).rounds_done == b.stats_of(3).rounds_done == 3
    # After the resync peer-a's parameters are the shared anchor plus its steps since the snapshot.
    assert_close(a.rounds[3].params_after, anchor_3 + (a.rounds[3].work_after - a.rounds[3].work_at_snapshot),
                 atol=1e-5)
    # The shared anchor is the outer steps on the weighted means of what each group sent: peer-a's
    # round-2 work reached it in round 3, with the carried weight.
    groups = {1: list(PEERS), 2: ["peer-b", "peer-c"], 3: list(PEERS), 4: list(PEERS)}
    assert_close(anchor_3, replay(init, peers, {r: groups[r] for r in (1, 2, 3)}))

    # Round 4: back to normal; the carried tokens were spent in round 3.
    for peer in peers:
        s = peer.stats_of(4)
        assert (s.applied, s.group_size, s.diverged, s.resynced) == ("averaged", 3, [], False), s
        assert peer.backend.sent[4][1] == s.tokens == (steps_after + steps_before) * peer.tokens
        assert torch.equal(peer.outer.momentum, b.outer.momentum)
        assert peer.outer.rounds_done == peer.outer.last_round == 4
    assert all(torch.equal(p.outer.anchor, b.outer.anchor) for p in peers)
    assert_close(b.outer.anchor, replay(init, peers, groups))
