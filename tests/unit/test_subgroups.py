"""Sub-group rounds in the round engine (``averaging.engine.subgroups``): four peers on threads over one
LocalHub, split each round into two groups of two that change every round. Each group averages its
members' anchors and momenta with the pseudo-gradient: every member ends the round with the same
state, the exact outer step of the group's means, and no verdict, catch-up or re-sync runs although
the peers' anchors differ across groups. Plus the pure helpers (donors of one group, the group's
step count)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from averaging.engine.config import LoopConfig
from averaging.engine.loop import RoundEngine
from averaging.engine.subgroups import (
    Mixing,
    claims_by_peer,
    group_rounds_done,
    left_out,
    one_group,
    state_numel,
    state_problem,
)
from averaging.engine.worker import SyncWorker
from averaging.math.fingerprints import AnchorClaim, claim_of, far_members, fingerprint
from averaging.math.flat import FlatLayout
from averaging.math.group_view import group_view
from averaging.math.groups import members
from averaging.math.outer_step import OuterConfig, kept_step, outer_step_
from averaging.math.wire import LATTICE_CODE, MIX_CODE
from averaging.network.interface import AverageOutcome
from averaging.network.local import LocalBackend, LocalHub
from averaging.state.shared_state import SharedState
from protocols.schedule import RoundSchedule
from tests.unit.fake_clock import WALL_START, FakeClock

pytestmark = pytest.mark.timeout(60)

PEERS = ("a", "b", "c", "d")
TOKENS = {"a": 100, "b": 300, "c": 200, "d": 50}
OUTER = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
WAIT = 20.0
# Odd rounds pair a-b and c-d, even rounds a-c and b-d: after two rounds every anchor holds a share
# of every other (a butterfly), as hashed groups do over log(N) rounds.
GROUPS = {1: {"a": 0, "b": 0, "c": 1, "d": 1}, 0: {"a": 0, "c": 0, "b": 1, "d": 1}}


class Recording(LocalBackend):
    """Keeps what each round sent (pseudo-gradient, extra vector, weight) and the group it joined."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.keys: dict[int, str] = {}

    def prepare(self, *, round: int, key_bits: str | None = None, **kwargs) -> None:
        self.keys[round] = key_bits
        super().prepare(round=round, key_bits=key_bits, **kwargs)

    def average(self, vector, *, weight, timeout, round=None, extra=None, keep_partial=False) -> AverageOutcome:
        assert keep_partial  # sub-groups keep a partial result (HivemindBackend's; never partial here)
        self.sent[round] = (vector.clone(), extra.clone(), weight)
        return super().average(vector, weight=weight, timeout=timeout, round=round, extra=extra,
                               keep_partial=keep_partial)



def far_claims(by_peer, *, self_id: str, lattice_coded: bool = False) -> list[bool]:
    """Whom a member's check leaves out: the group view's far members (as its reducers find them)."""
    return left_out(by_peer, group_view(by_peer, lattice_coded=lattice_coded).far, self_id=self_id)

def make_peers(workers: list[SyncWorker], *, plan=None, code: str = MIX_CODE, stale_d: bool = True) -> list[dict]:
    """The four peers; ``plan(round, peer_id)`` (default: ``GROUPS``), ``code`` the state's code,
    ``stale_d``: d starts from other weights and a one step ahead."""
    hub = LocalHub()
    schedule = RoundSchedule(start_time=WALL_START, round_seconds=1e3)
    peers = []
    for index, peer_id in enumerate(PEERS):
        with torch.random.fork_rng():
            torch.manual_seed(1 if peer_id == "d" and stale_d else 0)  # d starts elsewhere: a stale joiner
            model = torch.nn.Linear(8, 4)
        layout = FlatLayout.of(model.named_parameters())
        state = SharedState(layout, layout.pack(dict(model.named_parameters()), layout.new_buffer()), OUTER)
        # a step ahead (a count within the schedule): its groups take it
        state.rounds_done = 1 if peer_id == "a" and stale_d else 0
        clock = FakeClock(WALL_START)
        backend = Recording(hub, peer_id, state.shared_state, far_state_numel=layout.numel,
                            lattice=code == LATTICE_CODE)
        worker = SyncWorker(backend, allreduce_timeout=5.0, matchmaking_grace=1.0)
        workers.append(worker)
        groups = (lambda round, peer_id=peer_id: (GROUPS[round % 2][peer_id], 2)) if plan is None else (  # noqa: E731
            lambda round, peer_id=peer_id: plan(round, peer_id))
        loop = RoundEngine(state=state, worker=worker, layout=layout,
                           params=lambda model=model: dict(model.named_parameters()),
                           schedule=lambda: schedule,
                           config=LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=1e6),
                           peer_id=peer_id, alone=lambda: False, device=torch.device("cpu"), clock=clock,
                           mixing=Mixing(plan=groups, code=code))
        peers.append(dict(id=peer_id, model=model, layout=layout, state=state, backend=backend, worker=worker,
                          loop=loop, generator=torch.Generator().manual_seed(10 + index), stats=[], rounds={}))
    return peers


def params_of(peer: dict) -> torch.Tensor:
    return peer["layout"].pack(dict(peer["model"].named_parameters()), peer["layout"].new_buffer())


@torch.no_grad()
def step(peer: dict) -> torch.Tensor:
    delta = torch.randn(peer["layout"].numel, generator=peer["generator"]) * -0.01
    params = dict(peer["model"].named_parameters())
    for name, view in peer["layout"].views(delta).items():
        params[name].add_(view)
    peer["stats"] += peer["loop"].after_step(tokens=TOKENS[peer["id"]], seconds=0.0, loss=1.0)
    return delta


def run(peers: list[dict], rounds: int) -> None:
    """Each round: 3 steps, every prepare done, begin_sync, 2 steps in flight, merge; records the
    state before and after and the work done after the snapshot."""
    barrier = threading.Barrier(len(peers), timeout=WAIT)

    def train(peer: dict) -> None:
        loop = peer["loop"]
        loop.start()
        for round in range(1, rounds + 1):
            for _ in range(3):
                step(peer)
            peer["worker"].submit(lambda: None).result(timeout=WAIT)
            peer["worker"].submit_prepare(lambda: None).result(timeout=WAIT)
            barrier.wait()
            before = (peer["state"].anchor.clone(), peer["state"].momentum.clone())
            peer["stats"] += loop.begin_sync()
            after_snapshot = step(peer) + step(peer)
            peer["stats"] += loop.try_merge(wait=True)
            assert not loop.syncing
            peer["rounds"][round] = dict(before=before, anchor=peer["state"].anchor.clone(),
                                         momentum=peer["state"].momentum.clone(), params=params_of(peer),
                                         unsynced=after_snapshot, rounds_done=peer["state"].rounds_done)
            barrier.wait()

    with ThreadPoolExecutor(len(peers)) as pool:
        for future in [pool.submit(train, peer) for peer in peers]:
            future.result(timeout=3 * WAIT)


def weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = sum(weights)
    return sum(t.double() * (w / total) for t, w in zip(tensors, weights)).float()


@pytest.fixture
def workers():
    made: list[SyncWorker] = []
    yield made
    for worker in made:
        worker.close()


def test_each_group_averages_its_members_state_and_every_member_ends_with_the_same_anchor(workers):
    peers = make_peers(workers)
    by_id = {p["id"]: p for p in peers}
    numel = peers[0]["layout"].numel
    rounds = 4
    run(peers, rounds)

    for round in range(1, rounds + 1):
        for group in (0, 1):
            ids = sorted(p for p, g in GROUPS[round % 2].items() if g == group)
            sent = [by_id[p]["backend"].sent[round] for p in ids]
            weights = [weight for *_, weight in sent]
            # What each member put in the extra vector: its anchor and momentum before the round.
            for p, (_, extra, _) in zip(ids, sent):
                assert extra.numel() == state_numel(numel)
                assert torch.equal(extra[:numel], by_id[p]["rounds"][round]["before"][0])
                assert torch.equal(extra[numel:], by_id[p]["rounds"][round]["before"][1])
            anchor = weighted_mean([e[:numel] for _, e, _ in sent], weights)
            momentum = weighted_mean([e[numel:] for _, e, _ in sent], weights)
            step = kept_step(weighted_mean([g for g, _, _ in sent], weights)).float()
            outer_step_(anchor, step, momentum, lr=OUTER.lr, mu=OUTER.momentum, nesterov=OUTER.nesterov)
            for p in ids:
                after = by_id[p]["rounds"][round]
                assert torch.allclose(after["anchor"], anchor, rtol=0, atol=1e-6), (round, p)
                assert torch.allclose(after["momentum"], momentum, rtol=0, atol=1e-6), (round, p)
                # the merge keeps the work done since the snapshot on top of the group's anchor
                assert torch.allclose(after["params"] - after["anchor"], after["unsynced"], rtol=0, atol=1e-6)
            first, *others = ids
            for p in others:  # the same bytes for every member: exactly one state per group
                assert torch.equal(by_id[p]["rounds"][round]["anchor"], by_id[first]["rounds"][round]["anchor"])
                assert by_id[p]["rounds"][round]["rounds_done"] == by_id[first]["rounds"][round]["rounds_done"]
        # the groups met apart, each under its own key (the round's bits, then the group's)
        keys = {p["id"]: p["backend"].keys[round] for p in peers}
        assert len(set(keys.values())) == 2 and all(len(k) == 5 for k in keys.values())
    # round 1: a's group takes its count (2), the other group's starts from 0 (1); then all are even
    assert [[by_id[p]["rounds"][r]["rounds_done"] for p in PEERS] for r in (1, 2, 3)] == [
        [2, 2, 1, 1], [3, 3, 3, 3], [4, 4, 4, 4]]
    for peer in peers:
        assert [s.applied for s in peer["stats"]] == ["averaged"] * rounds
        assert all(s.group_size == 2 and not s.resynced and not s.diverged for s in peer["stats"])
        assert peer["loop"].group_count == 2
    # d started elsewhere; the groups' means pulled it in: the spread across the swarm shrinks round by round
    spread = [max(float((by_id[p]["rounds"][r]["anchor"] - by_id["a"]["rounds"][r]["anchor"]).norm())
                  for p in PEERS) for r in range(1, rounds + 1)]
    initial = float((by_id["d"]["rounds"][1]["before"][0] - by_id["a"]["rounds"][1]["before"][0]).norm())
    assert spread[0] < initial and spread[-1] < 0.2 * initial, (initial, spread)


def test_a_far_member_of_a_lattice_run_downloads_its_groups_state(workers):
    """With the lattice code (``averaging.state_compression = "lat8"``) a member far from its group
    cannot decode the group's state: the four average in one group, d's anchor thrown far before the
    first round (a corrupted or long-stale state), so in round 1 it takes the group's step on its own
    state, then downloads the state of a, b and c and ends the round holding theirs; they took the
    group's mean as ever. Its claim for round 2 was made before that download landed (this engine
    prepares the next round's matchmaking at once), so it may download once more; by round 3 it is
    near. The in-process hub runs the lattice code as the reducers do: the near members' residues on
    the group's grid, d left out of the mean and unable to decode it."""
    peers = make_peers(workers, plan=lambda round, peer_id: (0, 1), code=LATTICE_CODE, stale_d=False)
    by_id = {p["id"]: p for p in peers}
    d = by_id["d"]
    d["state"].anchor.add_(torch.randn(d["layout"].numel, generator=d["generator"]))
    run(peers, 3)
    assert d["stats"][0].resynced and not d["stats"][2].resynced
    assert all(s.applied == "averaged" for p in peers for s in p["stats"])
    for p in ("a", "b", "c"):
        assert not any(s.resynced for s in by_id[p]["stats"])
    # Round 1: d holds its donors' state; when it downloaded that before they took the round's mean
    # (the engine's race: it then applies the group's step itself, as any re-sync), it differs from
    # theirs by the fp32 rounding of the hub's mean of their identical anchors (seen: 3e-8). From
    # round 2 the four take one mean: the same bytes.
    for p in PEERS:
        assert torch.allclose(by_id[p]["rounds"][1]["anchor"], by_id["a"]["rounds"][1]["anchor"], rtol=0, atol=1e-6), p
    for round in (2, 3):
        assert all(torch.equal(by_id[p]["rounds"][round]["anchor"], by_id["a"]["rounds"][round]["anchor"])
                   for p in PEERS), round


def test_a_joiner_downloads_from_the_members_of_one_group_of_the_last_round():
    live = [f"peer-{i}" for i in range(16)]
    donors = live[:12][::-1]  # the peers that can serve, most steps first (not every live peer)
    groups = members(live, 7, 4, salt="run")  # the groups as the round cut them: from every live peer
    chosen = one_group(donors, live=live, round=7, groups=4, salt="run")
    most = max(len(set(g) & set(donors)) for g in groups.values())
    assert len(chosen) == most and any(set(chosen) <= set(g) for g in groups.values())
    assert chosen == [d for d in donors if d in chosen]  # the caller's order is kept
    # cut from the donors alone, the groups would differ: a donor's group depends on every live peer
    assert members(donors, 7, 4, salt="run") != {k: [p for p in g if p in donors] for k, g in groups.items()}
    assert one_group(donors, live=live, round=7, groups=1, salt="run") == donors


def test_the_group_takes_the_most_steps_a_member_claims_within_the_schedule():
    layout = FlatLayout.of(torch.nn.Linear(4, 2).named_parameters())
    state = SharedState(layout, layout.new_buffer(), OUTER)
    state.rounds_done = 3
    ahead = SharedState(layout, layout.new_buffer(), OUTER)
    ahead.rounds_done = 5
    liar = SharedState(layout, layout.new_buffer(), OUTER)
    liar.rounds_done = 50
    gathered = {"ahead": ahead.claim_message(round=6).encode(), "liar": liar.claim_message(round=6).encode(),
                "stale": ahead.claim_message(round=5).encode(), "junk": b"\x00"}
    claims = list(claims_by_peer(state, gathered, round=6).values())  # the stale claim and the junk are left out
    assert group_rounds_done(state, claims, round=6) == 5  # the liar is past round 6: not counted


def test_the_groups_mean_state_is_bounded_by_what_the_members_claims_allow():
    """``subgroups.state_problem``: an honest mean (any convex mix of the members' anchors, CenteredClip's
    included) passes, also for a member whose own anchor is far behind (a stale member widens the
    bound); a reducer's answer that moves one chunk of the anchor, or the momentum, further than
    the members' claims allow is refused, naming the chunk."""
    numel, round = 4093 * 8, 9
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(numel, generator=generator) * 0.05
    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(numel)))])
    pg_rms = 1e-3
    anchors = [base + torch.randn(numel, generator=generator) * pg_rms for _ in range(4)]
    states = []
    for anchor in anchors:
        state = SharedState(layout, anchor, OUTER)
        state.momentum.copy_(torch.randn(numel, generator=generator) * pg_rms)
        states.append(state)
    gathered = {f"m{i}": s.claim_message(round=round, with_momentum=True).encode() for i, s in enumerate(states)}
    ours, pg = states[0], torch.randn(numel, generator=generator) * pg_rms

    def problem(anchor, momentum, state=ours, gathered=gathered):
        return state_problem(anchor, momentum, state, list(claims_by_peer(state, gathered, round=round).values()),
                             members=4, local_pseudo_grad=pg, mu=OUTER.momentum)

    mean_momentum = torch.stack([s.momentum for s in states]).mean(0)
    weights = torch.tensor([1.0, 3.0, 0.5, 2.0])
    assert problem((torch.stack(anchors) * (weights / weights.sum())[:, None]).sum(0), mean_momentum) is None
    median = torch.stack(anchors).median(dim=0).values  # (a corner of the members' box, as CenteredClip may start)
    assert problem(median, mean_momentum) is None
    lied = torch.stack(anchors).mean(0)
    lied[4093 * 5: 4093 * 6] += 30 * pg_rms  # one reducer's share moved by 30 steps
    assert "anchor is" in problem(lied, mean_momentum) and "chunk 5" in problem(lied, mean_momentum)
    # the momenta's fingerprints ride the claims: a lie the size of the anchor's is refused; claims
    # without them (an older peer) leave only how far momenta can honestly lie apart (over 1 - mu,
    # 10x at mu 0.9): loose, only a gross lie is refused
    assert "momentum" in problem(torch.stack(anchors).mean(0), mean_momentum + 30 * pg_rms)
    bare = {f"m{i}": s.claim_message(round=round).encode() for i, s in enumerate(states)}
    assert problem(torch.stack(anchors).mean(0), mean_momentum + 30 * pg_rms, gathered=bare) is None
    assert "momentum" in problem(torch.stack(anchors).mean(0), mean_momentum + 500 * pg_rms, gathered=bare)
    assert "NaN" in problem(torch.full((numel,), float("nan")), mean_momentum)
    # a member far behind (ours: 40 steps off) takes the group's honest mean: its own distance widens the bound
    stale = SharedState(layout, anchors[0] + 40 * pg_rms, OUTER)
    stale_gathered = {**gathered, "m0": stale.claim_message(round=round).encode()}
    assert state_problem(torch.stack([stale.anchor, *anchors[1:]]).mean(0), mean_momentum, stale,
                         list(claims_by_peer(stale, stale_gathered, round=round).values()), members=4,
                         local_pseudo_grad=pg, mu=OUTER.momentum) is None


def test_a_member_from_another_earlier_group_is_not_far_when_the_others_share_one_anchor():
    """Three members from one earlier group hold the same anchor (the median member's distance is 0),
    the fourth comes from another group 25 claimed steps away on every chunk but a quarter of the
    weights' RMS: not far (``FAR_RELATIVE``; on the steps alone, 16, it was: real runs flagged such
    honest members). An anchor 10x the others' still is."""
    from averaging.math.fingerprints import FAR_RELATIVE, FAR_STEPS

    numel, round, pg_rms = 4093 * 8, 9, 1e-3
    generator = torch.Generator().manual_seed(12)
    base = torch.randn(numel, generator=generator) * 0.1
    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(numel)))])
    scale = torch.randn(numel, generator=generator) * pg_rms

    def member(anchor: torch.Tensor) -> SharedState:
        state = SharedState(layout, anchor, OUTER)
        state.apply(scale, round=round - 1)  # its claim carries a step's scale
        return state

    shared = base + torch.randn(numel, generator=generator) * pg_rms
    other = shared + torch.randn(numel, generator=generator) * 25 * pg_rms
    assert 25 * pg_rms > FAR_STEPS * pg_rms and 25 * pg_rms < FAR_RELATIVE * 0.1 / 1.8  # (estimates run 1.8x high)
    claims = [member(a).claim() for a in (shared.clone(), shared.clone(), shared.clone(), other)]
    assert far_members(claims) == [False] * 4
    claims[3] = member(shared * 10).claim()
    assert far_members(claims) == [False, False, False, True]


def test_the_relative_far_test_holds_its_bar_on_every_draw():
    """The relative bar (``FAR_RELATIVE``, half the anchors' RMS) is tested over the whole anchor: a
    chunk's size and distance are estimated from 4 projections each, and tested chunk by chunk the
    largest ratio of 64 chunks flagged a member a tenth of the weights' RMS from three that share an
    anchor in about a fifth of draws, 0.13 apart in about half (honest members of real runs lie
    0.05-0.13 apart). Pooled: 0.13 apart is near on every draw, 0.6 far on every draw."""
    from averaging.math.fingerprints import FAR_RELATIVE

    numel, step = 64 * 4093, torch.full((64,), 1e-4, dtype=torch.float64)
    generator = torch.Generator().manual_seed(8)
    assert FAR_RELATIVE == 0.5
    for _ in range(12):
        shared = torch.randn(numel, generator=generator) * 0.05
        noise = torch.randn(numel, generator=generator) * 0.05
        claims = [AnchorClaim(fingerprint(shared), step, 1)] * 3
        assert not far_members(claims + [AnchorClaim(fingerprint(shared + 0.13 * noise), step, 1)])[3]
        assert far_members(claims + [AnchorClaim(fingerprint(shared + 0.6 * noise), step, 1)])[3]


def test_a_member_far_from_its_group_is_found_by_everyone_and_widens_nobodys_bound():
    """``far_members`` flags, from the claims alone, a member whose anchor is far from the rest (a
    stranger's, or one back from an old checkpoint); members a step or two apart, groups of two and a
    fresh run (every anchor the same, no step yet) flag nobody. The others' check (``state_problem``
    with ``far_claims``) then leaves its distance out, so the reducers' mean without it passes and a
    lie its claim would have covered is refused; the far member itself still takes that mean."""
    numel, round, pg_rms = 4093 * 8, 9, 1e-3
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(numel, generator=generator) * 0.05
    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(numel)))])
    scale = torch.randn(numel, generator=generator) * pg_rms

    def member(offset: float) -> SharedState:
        state = SharedState(layout, base + torch.randn(numel, generator=generator) * pg_rms + offset * scale, OUTER)
        state.apply(scale, round=round - 1)  # one step: its claim now carries a step's scale
        return state

    states = [member(0.0) for _ in range(4)] + [member(40.0)]
    claims = {f"m{i}": s.claim_message(round=round).encode() for i, s in enumerate(states)}
    decoded = claims_by_peer(states[0], claims, round=round)
    assert far_members([claim_of(m) for m in decoded.values()]) == [False] * 4 + [True]
    assert far_claims(decoded, self_id="m0") == [False] * 4 + [True]
    assert far_claims(decoded, self_id="m4") == [False] * 5  # the far member's own check leaves nobody out
    assert not any(far_members([claim_of(m) for m in list(decoded.values())[:4]]))
    assert far_members([claim_of(m) for m in list(decoded.values())[3:]]) == [False, False]  # two: undecidable
    fresh = [SharedState(layout, base.clone(), OUTER) for _ in range(3)]
    assert not any(far_members([s.claim() for s in fresh]))
    # What the reducers return: the four close members' mean, the far one left out.
    mean = torch.stack([s.anchor for s in states[:4]]).mean(0)
    momentum = torch.stack([s.momentum for s in states[:4]]).mean(0)
    pg = torch.randn(numel, generator=generator) * pg_rms

    def problem(anchor, ours=states[0], self_id="m0"):
        by_peer = claims_by_peer(ours, claims, round=round)
        return state_problem(anchor, momentum, ours, list(by_peer.values()), members=5, local_pseudo_grad=pg, mu=OUTER.momentum,
                             left_out=far_claims(by_peer, self_id=self_id))

    assert problem(mean) is None
    assert problem(mean, ours=states[4], self_id="m4") is None  # the far member takes it
    lied = mean.clone()
    lied[: 4093] += 20 * pg_rms  # a reducer's share moved 20 steps: within what the far claim allowed
    assert "anchor is" in problem(lied)
    by_peer = claims_by_peer(states[0], claims, round=round)
    assert state_problem(lied, momentum, states[0], list(by_peer.values()), members=5, local_pseudo_grad=pg, mu=OUTER.momentum) is None


def test_a_lattice_groups_check_leaves_out_whom_its_reducers_left_out():
    """In a lattice-coded group a member 50 claimed steps from three others (a fortieth of the
    weights' RMS: near by ``far_members``) is far (``averaging.math.lattice.far``), so its reducers give it
    weight 0; the near members' check must leave it out too (``far_claims(lattice_coded=True)``, the
    run's far rule), or its distance widens their bound by 50 steps and covers a reducer's lie."""
    numel, round, pg_rms = 4093 * 8, 9, 1e-4
    generator = torch.Generator().manual_seed(21)
    shared = torch.randn(numel, generator=generator) * 0.2  # the member 50 steps off: 0.005, a fortieth of it
    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(numel)))])
    scale = torch.randn(numel, generator=generator) * pg_rms

    def member(offset: float) -> SharedState:
        state = SharedState(layout, shared + torch.randn(numel, generator=generator) * offset * pg_rms, OUTER)
        state.apply(scale, round=round - 1)  # its claim carries a step's scale
        return state

    states = [member(0.5) for _ in range(3)] + [member(50.0)]
    claims = {f"m{i}": s.claim_message(round=round).encode() for i, s in enumerate(states)}
    by_peer = claims_by_peer(states[0], claims, round=round)
    assert far_claims(by_peer, self_id="m0") == [False] * 4
    assert far_claims(by_peer, self_id="m0", lattice_coded=True) == [False, False, False, True]
    assert far_claims(by_peer, self_id="m3", lattice_coded=True) == [False] * 4  # its own check: nobody
    mean = torch.stack([s.anchor for s in states[:3]]).mean(0)
    momentum = torch.stack([s.momentum for s in states[:3]]).mean(0)
    pg = torch.randn(numel, generator=generator) * pg_rms

    def problem(anchor, *, lattice_coded: bool):
        return state_problem(anchor, momentum, states[0], list(by_peer.values()), members=4, local_pseudo_grad=pg, mu=OUTER.momentum,
                             left_out=far_claims(by_peer, self_id="m0", lattice_coded=lattice_coded))

    assert problem(mean, lattice_coded=True) is None
    lied = mean.clone()
    lied[: 4093] += 30 * pg_rms  # one reducer's share moved 30 steps
    assert "anchor is" in problem(lied, lattice_coded=True)
    assert problem(lied, lattice_coded=False) is None  # the plain rule's bound: the far member's 50 steps cover it
    # subgroups.conclude applies the run's rule: with the lattice code the lie is refused, without it taken
    from averaging.engine.subgroups import conclude as conclude_mixed
    from averaging.state.verdict import Applied

    before = states[0].anchor.clone()
    for lattice_code, applied in ((True, Applied.FOLDED), (False, Applied.AVERAGED)):
        outcome = AverageOutcome(ok=True, group=tuple(claims), gathered=claims,
                                 far=group_view(by_peer, lattice_coded=lattice_code).far)
        conclusion = conclude_mixed(states[0], outcome, pg.clone(), round=round, mu=OUTER.momentum, averaged=pg.clone(),
                                    mixed=torch.cat([lied, momentum]), self_id="m0", lattice=lattice_code)
        assert conclusion.applied == applied, (lattice_code, conclusion.error)
        assert torch.equal(states[0].anchor, before) == (applied == Applied.FOLDED)
