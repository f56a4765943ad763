"""SharedState and the round's verdict: how a round ends (averaged or local), the group check, and sharing/adopting state."""

import struct

import pytest
import torch

from averaging.engine.recover import Recovery
from averaging.engine.whole_swarm import conclude
from averaging.math.fingerprints import SIGN_PERIOD
from averaging.math.flat import FlatLayout
from averaging.math.outer_step import OuterConfig, kept_step, outer_step_
from averaging.network.interface import AverageOutcome
from averaging.network.slices import slice_alignment, slice_bounds, slice_units
from averaging.state import accept
from averaging.state.accept import check_average
from averaging.state.served import STATE_VERSION, AppliedUpdate, DownloadedState
from averaging.state.shared_state import SharedState
from protocols.messages import MessageError

LAYOUT = FlatLayout.of([("w", torch.zeros(3, SIGN_PERIOD)), ("b", torch.zeros(100))])  # 4 chunks, the last partial
NUMEL = LAYOUT.numel
CONFIG = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
GROUP = ("peer-a", "peer-b", "peer-c")


def randn(seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * std


def new_state(anchor_seed: int = 0) -> SharedState:
    return SharedState(LAYOUT, randn(anchor_seed, std=0.02), CONFIG)


def reference_step(state: SharedState, pseudo_grad: torch.Tensor, momentum: torch.Tensor | None = None):
    """The anchor and momentum after one outer step from ``state``, computed apart from it (the
    step as kept: fp16)."""
    anchor = state.anchor.clone()
    momentum = state.momentum.clone() if momentum is None else momentum
    outer_step_(anchor, kept_step(pseudo_grad).float(), momentum, lr=CONFIG.lr, mu=CONFIG.momentum, nesterov=CONFIG.nesterov)
    return anchor, momentum


def snapshot(state: SharedState):
    claim = state.claim()
    return (state.anchor.clone(), state.momentum.clone(), state.rounds_done, state.last_round,
            claim.fingerprint.projections.clone(), claim.scale.clone(), claim.rounds_done)


def assert_same_snapshot(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


def ok(gathered=None) -> AverageOutcome:
    gathered = gathered or {}
    return AverageOutcome(ok=True, group=tuple(sorted(gathered)) or GROUP, gathered=gathered, sync_s=0.1)


# -- applying the round's update ---------------------------------------------------------------
def test_a_failed_round_of_a_peer_in_a_swarm_folds_its_work():
    state = new_state()
    anchor, momentum = state.anchor.clone(), state.momentum.clone()
    conclusion = conclude(state, AverageOutcome(ok=False, error="timed out"), randn(1, std=1e-3), round=3,
                                averaged=randn(2, std=1e-3), self_id="peer-a")
    assert (conclusion.applied, conclusion.group_size, conclusion.error) == ("folded", 1, "timed out")
    assert torch.equal(state.anchor, anchor) and torch.equal(state.momentum, momentum)
    assert (state.rounds_done, state.last_round) == (0, 0)


def test_a_failed_round_of_a_peer_alone_applies_the_local_pseudo_gradient():
    state = new_state()
    local = randn(1, std=1e-3)
    expected_anchor, expected_momentum = reference_step(state, local)
    conclusion = conclude(state, AverageOutcome(ok=False, error="timed out"), local, round=3,
                                averaged=randn(2, std=1e-3), self_id="peer-a", alone=True)
    assert (conclusion.applied, conclusion.group_size, conclusion.error) == ("local", 1, "timed out")
    assert conclusion.verdict is None and conclusion.resync is None and conclusion.bad_claims == 0
    assert torch.equal(state.anchor, expected_anchor)
    assert torch.equal(state.momentum, expected_momentum)
    assert (state.rounds_done, state.last_round) == (1, 3)


def test_an_ok_round_applies_the_averaged_pseudo_gradient_on_top_of_the_momentum():
    state = new_state()
    state.apply(randn(3, std=1e-3), round=1)  # non-zero momentum, so its use shows
    local, averaged = randn(4, std=1e-3), randn(5, std=1e-3)
    expected_anchor, expected_momentum = reference_step(state, averaged)
    conclusion = conclude(state, ok(), local, round=2, averaged=averaged, self_id="peer-a")
    assert (conclusion.applied, conclusion.group_size, conclusion.error) == ("averaged", 3, None)
    assert torch.equal(state.anchor, expected_anchor)
    assert torch.equal(state.momentum, expected_momentum)
    assert (state.rounds_done, state.last_round) == (2, 2)


def test_an_ok_round_without_an_averaged_vector_applies_the_local_one():
    state = new_state()
    local = randn(6, std=1e-3)
    expected_anchor, _ = reference_step(state, local)
    assert conclude(state, ok(), local, round=1, averaged=None, alone=True).applied == "local"
    assert torch.equal(state.anchor, expected_anchor)


@pytest.mark.parametrize(
    ("make_averaged", "mentions"),
    [
        (lambda local: torch.where(torch.arange(NUMEL) == NUMEL - 1, torch.nan, local), "NaN"),
        (lambda local: torch.where(torch.arange(NUMEL) == 0, torch.inf, local), "NaN/inf"),
        (lambda local: local * 1000, "1e+03x larger"),
    ],
)
def test_an_unusable_average_is_refused_and_the_work_folded(make_averaged, mentions):
    state = new_state()
    local = randn(7, std=1e-3)
    expected_anchor = state.anchor.clone()
    conclusion = conclude(state, ok(), local, round=1, averaged=make_averaged(local))
    assert conclusion.applied == "folded"
    assert mentions in conclusion.error and "not applied" in conclusion.error
    assert torch.equal(state.anchor, expected_anchor)
    assert torch.isfinite(state.anchor).all()


def test_check_average_allows_up_to_the_ratio():
    local = randn(8, std=1e-3)
    assert check_average(local * 50, local) is None
    assert check_average(-local * 99, local) is None
    assert check_average(torch.zeros(NUMEL), local) is None
    assert "101x larger" in check_average(local * 101, local)


# -- the group check at the end of a round -----------------------------------------------------
def three_states() -> dict[str, SharedState]:
    return {peer: new_state(anchor_seed=0) for peer in GROUP}


def end_round(states: dict[str, SharedState], round: int, averaged: torch.Tensor, extra: dict | None = None, *,
              catching_up: bool = False, serve: dict | None = None):
    """Every state reports, then concludes with the same average (as after a healthy all-reduce);
    with ``catching_up``, a state that is behind replays steps from the others' histories (or
    from ``serve[peer]``, ``recovery_from``)."""
    gathered = {peer: state.claim_message(round=round).encode() for peer, state in states.items()}
    gathered.update(extra or {})
    outcome = AverageOutcome(ok=True, group=tuple(sorted(gathered)), gathered=gathered)
    return {peer: conclude(state, outcome, averaged, round=round, averaged=averaged, self_id=peer,
                         recovery=recovery_from(states, peer, (serve or {}).get(peer)) if catching_up else None)
            for peer, state in states.items()}


def test_peers_that_share_an_anchor_need_no_donors():
    states = three_states()
    for round in (1, 2):
        conclusions = end_round(states, round, randn(10 + round, std=1e-3))
        for conclusion in conclusions.values():
            assert conclusion.resync is None and conclusion.bad_claims == 0
            assert conclusion.verdict.consensus.agreeing == frozenset(GROUP) and conclusion.verdict.consensus.diverged == frozenset()


def test_a_peer_whose_anchor_diverged_gets_the_others_as_donors():
    states = three_states()
    end_round(states, 1, randn(11, std=1e-3))
    # Round 2: peer-b's part of the all-reduce failed and it applied its own pseudo-gradient.
    states["peer-b"].apply(randn(12, std=1e-3), round=2)
    for peer in ("peer-a", "peer-c"):
        states[peer].apply(randn(13, std=1e-3), round=2)
    conclusions = end_round(states, 3, randn(14, std=1e-3))
    assert conclusions["peer-b"].resync.donors == ["peer-a", "peer-c"]
    assert conclusions["peer-a"].resync is None and conclusions["peer-c"].resync is None
    for conclusion in conclusions.values():  # every member reaches the same verdict
        assert conclusion.verdict.consensus.diverged == frozenset({"peer-b"})
        assert conclusion.verdict.consensus.reference in ("peer-a", "peer-c")  # equal agreement: the hash picks


class HistoryBackend:
    """The network a catch-up needs: outer steps from the donors' histories (or ``serve``)."""

    def __init__(self, states: dict[str, SharedState], serve=None):
        self.states, self.serve = states, serve

    def fetch_update(self, peers, *, rounds_done, numel, timeout):
        return (self.serve or self.states[peers[0]].update_after)(rounds_done)


def recovery_from(states: dict[str, SharedState], me: str, serve=None) -> Recovery:
    """A ``Recovery`` that fetches the missed steps from the donors' histories (or ``serve``)."""
    return Recovery(state=states[me], backend=HistoryBackend(states, serve), schedule=None, clock=None,
                    download_timeout=1.0)


def test_a_two_peer_tie_between_a_peer_ahead_and_one_behind_ends_in_a_catch_up_whoever_wins_it():
    """The tie is a hash now, so the peer behind may win it: it then replays the step of the peer
    ahead (verified against that peer's claim) instead of leaving both one step apart."""
    behind_won = ahead_won = 0
    for round in range(3, 15):
        states = {"peer-a": new_state(), "peer-b": new_state()}
        end_round(states, 1, randn(11, std=1e-3), catching_up=True)
        states["peer-a"].apply(randn(12, std=1e-3), round=2)  # peer-b folded round 2
        conclusions = end_round(states, round, randn(13, std=1e-3), catching_up=True)
        verdict = conclusions["peer-a"].verdict.consensus
        assert verdict.contested and verdict == conclusions["peer-b"].verdict.consensus
        behind_won += verdict.reference == "peer-b"
        ahead_won += verdict.reference == "peer-a"
        assert conclusions["peer-b"].caught_up == 1 and conclusions["peer-a"].caught_up == 0
        assert conclusions["peer-a"].resync is None and conclusions["peer-b"].resync is None
        assert states["peer-a"].rounds_done == states["peer-b"].rounds_done == 3
        # The replayed step is the step as kept: one anchor, and the next round finds no divergence.
        assert torch.equal(states["peer-a"].anchor, states["peer-b"].anchor)
        assert not end_round(states, round + 1, randn(14, std=1e-3), catching_up=True)["peer-a"].verdict.consensus.diverged
    assert behind_won and ahead_won  # both ways of the tie were exercised


def test_a_majority_that_missed_a_groups_step_replays_it_instead_of_outvoting_it():
    """Peers that joined late stayed out of a round that a smaller group averaged in (16 real
    peers: 6 averaged, 10 stayed out). The next round the 10 win the vote and the 6, a step ahead,
    wait; they used to re-sync a round later, losing their step. Now the majority replays the
    step from the members ahead, verified against their claim, and every peer holds one anchor."""
    names = [f"peer-{c}" for c in "abcde"]
    states = {peer: new_state() for peer in names}
    end_round(states, 1, randn(11, std=1e-3), catching_up=True)
    group_step = randn(12, std=1e-3)
    for peer in names[:2]:  # a and b averaged round 2 together; c, d and e stayed out of it
        states[peer].apply(group_step, round=2)
    conclusions = end_round(states, 3, averaged := randn(13, std=1e-3), catching_up=True)
    assert conclusions["peer-c"].verdict.consensus.diverged == frozenset(names[:2])  # the majority wins the vote
    for peer in names[2:]:
        assert conclusions[peer].caught_up == 1 and conclusions[peer].resync is None
    for peer in names[:2]:
        assert conclusions[peer].resync is None and conclusions[peer].caught_up == 0  # ahead, not apart
    expected = new_state()
    for round, step in ((1, randn(11, std=1e-3)), (2, group_step), (3, averaged)):
        expected.apply(step, round=round)
    for state in states.values():  # the replayed step is the step as kept: exactly
        assert state.rounds_done == 3 and torch.equal(state.anchor, expected.anchor)
    assert not end_round(states, 4, randn(14, std=1e-3), catching_up=True)["peer-a"].verdict.consensus.diverged


def test_a_majority_does_not_replay_a_lone_peers_step():
    """One member a step ahead (it stepped alone, or claims it did) is no group's step: the majority
    does not take it (the one-to-one tie replays only between two peers, by the hash)."""
    names = [f"peer-{c}" for c in "abc"]
    states = {peer: new_state() for peer in names}
    end_round(states, 1, randn(11, std=1e-3), catching_up=True)
    states["peer-a"].apply(randn(12, std=1e-3), round=2)
    conclusions = end_round(states, 3, randn(13, std=1e-3), catching_up=True)
    assert all(conclusions[peer].caught_up == 0 for peer in names)
    assert states["peer-b"].rounds_done == states["peer-c"].rounds_done == 2


def test_a_peer_that_applied_a_step_without_the_one_before_undoes_it_and_replays_both():
    """A joiner whose first round's reports all predated the group's last step (made while it was
    being applied) is judged equal, then applies the next step on an anchor that lacks it. Next
    round it is one step behind, but replaying that one step cannot fix it: it undoes its own step
    and replays both, instead of downloading the whole state."""
    states = {peer: new_state() for peer in GROUP}
    joiner = states["peer-c"]
    for peer in ("peer-a", "peer-b"):
        states[peer].apply(randn(11, std=1e-3), round=2)  # the joiner downloaded the state before this
    for state in states.values():
        state.apply(randn(12, std=1e-3), round=3)  # one average for all three, unjudged (stale reports)
    expected = new_state()
    for step in (randn(11, std=1e-3), randn(12, std=1e-3), averaged := randn(13, std=1e-3)):
        expected.apply(step, round=4)
    conclusions = end_round(states, 4, averaged, catching_up=True)
    assert conclusions["peer-c"].verdict.consensus.diverged == frozenset({"peer-c"})
    assert conclusions["peer-c"].resync is None and conclusions["peer-c"].caught_up == 2
    assert joiner.rounds_done == states["peer-a"].rounds_done == 3
    for state in states.values():  # up to the float rounding of undoing a step (replays are exact)
        assert (state.anchor - expected.anchor).abs().max() < 1e-5
        assert (state.momentum - expected.momentum).abs().max() < 1e-5
    assert not end_round(states, 5, randn(14, std=1e-3), catching_up=True)["peer-a"].verdict.consensus.diverged


def crafted_step(victim: SharedState, size: float) -> tuple[SharedState, torch.Tensor]:
    """An attacker's state one step ahead of ``victim`` by a step of RMS ``size``: it knows the
    victim's anchor (public state), so its claim is exactly where that step leads."""
    attacker = new_state()
    attacker.anchor.copy_(victim.anchor)
    attacker.momentum.copy_(victim.momentum)
    attacker.rounds_done, attacker.scale = victim.rounds_done, victim.scale.clone()
    step = randn(40, std=size)
    attacker.apply(step, round=2)
    return attacker, step


@pytest.mark.parametrize("size", [1.0, 20e-3])
def test_a_stranger_in_a_two_peer_tie_wins_it_only_by_the_hash_and_cannot_make_us_replay_its_steps(size):
    """Consensus hijack (issue 11): a stranger claiming more steps won every tie, and whoever claims
    to be ahead could make us replay any step it crafted. Now the hash decides the tie (the
    stranger wins about half of them, and we then re-sync from it: with two peers nobody can be
    outvoted), and a replayed step may be at most x10 our last one."""
    won = lost = 0
    for round in range(3, 13):
        honest = new_state()
        honest.apply(randn(11, std=1e-3), round=1)
        attacker, step = crafted_step(honest, size)  # x1000 or x20 our last step, claimed as ahead
        expected_anchor, expected_momentum = reference_step(honest, averaged := randn(13, std=1e-3))
        serve = {"honest": lambda rounds_done, s=step: AppliedUpdate(2, rounds_done + 1, s.half())}
        conclusions = end_round({"honest": honest, "attacker": attacker}, round, averaged, catching_up=True, serve=serve)
        verdict = conclusions["honest"].verdict.consensus
        assert verdict.contested
        assert conclusions["honest"].caught_up == 0  # its crafted step was never replayed
        assert honest.rounds_done == 2  # our step and this round's average: nothing replayed
        assert torch.equal(honest.anchor, expected_anchor) and torch.equal(honest.momentum, expected_momentum)
        if verdict.reference == "honest":
            won += 1
            assert conclusions["honest"].resync is None
        else:
            lost += 1
            assert conclusions["honest"].resync.donors == ["attacker"]
            assert conclusions["honest"].resync.reference.rounds_done == 2  # its claim, which the download must match
    assert won and lost


def test_a_tie_is_repaired_by_replaying_the_winners_step():
    """Two honest peers whose last steps differ (equal step counts, no majority): the loser of the
    tie undoes its step and replays the winner's (2 bytes/param) instead of downloading the state,
    whoever the hash picks."""
    for round in range(3, 9):
        states = {"peer-a": new_state(), "peer-b": new_state()}
        end_round(states, 1, randn(11, std=1e-3), catching_up=True)
        states["peer-a"].apply(randn(12, std=1e-3), round=2)
        states["peer-b"].apply(randn(14, std=1e-3), round=2)  # its part kept its local value
        conclusions = end_round(states, round, randn(13, std=1e-3), catching_up=True)
        verdict = conclusions["peer-a"].verdict.consensus
        assert verdict.contested
        loser = next(iter(verdict.diverged))
        assert conclusions[loser].resync is None and conclusions[loser].caught_up == 1
        assert conclusions[verdict.reference].resync is None and conclusions[verdict.reference].caught_up == 0
        assert (states["peer-a"].anchor - states["peer-b"].anchor).abs().max() < 1e-5


def test_after_a_start_up_split_the_pair_with_the_smaller_first_step_replays_the_others():
    """Four peers split into two pairs at start-up: one pair's first step is 11x the other's (its
    peers trained the whole round, the other pair only its end; seen with real peers). When they
    meet, whichever pair loses the tie undoes its step and replays the winners' (2 bytes/param):
    the size bound judges the replayed step against our own work this round too, not only against
    our last step, so the smaller pair is not sent to a full download."""
    lost = {"small": 0, "big": 0}
    for round in range(2, 14):
        states = {peer: new_state() for peer in ("a1", "a2", "b1", "b2")}
        small, big = randn(31, std=1e-4), randn(32, std=11e-4)
        for peer, state in states.items():
            state.apply(small if peer.startswith("a") else big, round=1)
        conclusions = end_round(states, round, randn(33, std=1e-3), catching_up=True)
        verdict = conclusions["a1"].verdict.consensus
        assert verdict.contested and len(verdict.diverged) == 2
        lost["small" if "a1" in verdict.diverged else "big"] += 1
        for peer in verdict.diverged:
            assert conclusions[peer].resync is None and conclusions[peer].caught_up == 1
        anchors = [state.anchor for state in states.values()]
        assert all((anchor - anchors[0]).abs().max() < 1e-5 for anchor in anchors)
    assert lost["small"] and lost["big"]  # both ways of the tie were exercised


def test_a_peer_that_applied_no_step_yet_replays_the_swarms_first_steps_whatever_its_own_work():
    """A joiner that trusted the records (every peer at 0 steps) but trained only a few inner steps
    before its first sync: its tiny work does not bound the swarm's first steps it replays (only a
    step applied before does), or it would refuse them and download the whole state."""
    donor, joiner = new_state(), new_state()
    donor.apply(randn(41, std=1e-3), round=1)
    update = donor.update_after(0)
    assert joiner.catch_up([update], donor.claim(), work_rms=1e-6)
    assert joiner.rounds_done == 1 and (joiner.anchor - donor.anchor).abs().max() < 1e-5


def test_fp16_noise_between_peers_is_not_a_divergence():
    states = three_states()
    end_round(states, 1, randn(15, std=1e-3))
    averaged = randn(16, std=1e-3)
    for i, (_, state) in enumerate(sorted(states.items())):
        local = randn(20 + i, std=1e-3)
        state.apply(local + (averaged - local).half().float(), round=2)
    assert not torch.equal(states["peer-a"].anchor, states["peer-b"].anchor)
    conclusions = end_round(states, 3, randn(17, std=1e-3))
    assert all(c.resync is None and not c.verdict.consensus.diverged for c in conclusions.values())


def test_malformed_and_stale_reports_are_counted_and_ignored():
    states = three_states()
    end_round(states, 1, randn(18, std=1e-3))
    stale = states["peer-a"].claim_message(round=1).encode()
    extra = {"mallory": {"v": 1, "round": 2}, "nan-peer": {**stale, "round": 2, "proj": b"\xff" * len(stale["proj"])},
             "late": stale, "junk": "not a map"}
    conclusions = end_round(states, 2, randn(19, std=1e-3), extra=extra)
    for conclusion in conclusions.values():
        assert conclusion.bad_claims == 4
        assert conclusion.verdict.consensus.agreeing == frozenset(GROUP) and conclusion.verdict.consensus.diverged == frozenset()
        assert conclusion.group_size == 7  # the group as the backend formed it
        assert conclusion.applied == "averaged"


def test_no_verdict_with_fewer_than_two_valid_reports():
    state = new_state()
    gathered = {"me": state.claim_message(round=1).encode(), "mallory": {"v": 2}}
    conclusion = conclude(state, ok(gathered), randn(20, std=1e-3), round=1, averaged=randn(21, std=1e-3), self_id="me")
    assert (conclusion.verdict.consensus, conclusion.bad_claims, conclusion.resync) == (None, 1, None)


def test_the_claim_follows_the_anchor():
    state = new_state()
    before = state.claim()
    assert before is state.claim()  # cached between outer steps
    assert (before.rounds_done, before.scale.tolist()) == (0, [0.0] * 4)
    grad = randn(22, std=1e-3)
    state.apply(grad, round=5)
    after = state.claim()
    assert after.rounds_done == 1
    assert not torch.equal(after.fingerprint.projections, before.fingerprint.projections)
    kept = kept_step(grad).float()
    assert float(after.scale[0]) == pytest.approx(float(kept[:SIGN_PERIOD].double().square().mean().sqrt()), rel=1e-12)
    report = state.claim_message(round=6)
    assert (report.round, report.rounds_done, report.scale) == (6, 1, tuple(after.scale.tolist()))


# -- sharing and adopting the state ------------------------------------------------------------
def donor_state() -> SharedState:
    donor = new_state(anchor_seed=30)
    donor.apply(randn(31, std=1e-3), round=4)
    donor.apply(randn(32, std=1e-3), round=6)
    return donor


def test_adopt_copies_the_donors_state_and_claim():
    donor, receiver = donor_state(), new_state(anchor_seed=40)
    receiver.claim()  # a cached claim of the old anchor must not survive
    metadata, tensors = donor.shared_state()
    assert receiver.adopt(DownloadedState("donor", metadata, tensors)) == 6
    assert torch.equal(receiver.anchor, donor.anchor) and torch.equal(receiver.momentum, donor.momentum)
    assert (receiver.rounds_done, receiver.last_round) == (2, 6)
    mine, theirs = receiver.claim(), donor.claim()
    assert torch.equal(mine.fingerprint.projections, theirs.fingerprint.projections)
    assert torch.equal(mine.scale, theirs.scale)
    assert mine.rounds_done == theirs.rounds_done
    assert receiver.claim_message(round=7) == donor.claim_message(round=7)
    # Both sides hold copies: nothing written later on one side shows on the other.
    tensors[0].add_(1.0)
    donor.apply(randn(33, std=1e-3), round=7)
    assert not torch.equal(receiver.anchor, donor.anchor)
    assert not torch.equal(receiver.anchor, tensors[0])


def valid_download() -> DownloadedState:
    metadata, tensors = donor_state().shared_state()
    return DownloadedState("donor", metadata, tensors)


def with_metadata(**changes) -> DownloadedState:
    state = valid_download()
    state.metadata.update(changes)
    return state


def with_tensor(index: int, make) -> DownloadedState:
    state = valid_download()
    state.tensors[index] = make(state.tensors[index])
    return state


def poisoned(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t[-1] = value
    return t


@pytest.mark.parametrize(
    ("make_state", "match"),
    [
        (lambda: DownloadedState("donor", None, valid_download().tensors), "version"),
        (lambda: DownloadedState("donor", [("v", STATE_VERSION)], valid_download().tensors), "version"),
        (lambda: with_metadata(v=STATE_VERSION + 1), "version"),
        (lambda: with_metadata(numel=NUMEL - 1), "layout"),
        (lambda: DownloadedState("donor", valid_download().metadata, valid_download().tensors[:1]), "layout"),
        (lambda: DownloadedState("donor", valid_download().metadata, valid_download().tensors * 2), "layout"),
        (lambda: with_tensor(0, lambda t: t[:-1]), "shape"),
        (lambda: with_tensor(1, lambda t: t.view(1, -1)), "shape"),
        (lambda: with_tensor(1, lambda t: t.double()), "float64"),
        (lambda: with_tensor(0, lambda t: t.half()), "float16"),
        (lambda: with_tensor(0, lambda t: poisoned(t, float("nan"))), "non-finite"),
        (lambda: with_tensor(1, lambda t: poisoned(t, float("-inf"))), "non-finite"),
        (lambda: with_metadata(round=-1), "round counters"),
        (lambda: with_metadata(rounds_done="2"), "round counters"),
        (lambda: with_metadata(round=6.0), "round counters"),
        (lambda: with_metadata(rounds_done=None), "round counters"),
        (lambda: with_metadata(scale=struct.pack("<3d", 1.0, 1.0, 1.0)), "bad scale"),
        (lambda: with_metadata(scale=[1.0] * 4), "bad scale"),
        (lambda: with_metadata(scale=None), "bad scale"),
    ],
)
def test_adopt_rejects_an_invalid_state_and_changes_nothing(make_state, match):
    receiver = new_state(anchor_seed=40)
    receiver.apply(randn(41, std=1e-3), round=1)
    before = snapshot(receiver)
    with pytest.raises(MessageError, match=match) as raised:
        receiver.adopt(make_state())
    assert "donor" in str(raised.value)
    assert_same_snapshot(snapshot(receiver), before)


def test_a_state_from_the_network_must_match_the_fingerprint_its_donors_claim():
    receiver = new_state(anchor_seed=40)
    receiver.apply(randn(41, std=1e-3), round=1)
    before = snapshot(receiver)
    # Slices of two donors that diverged by one outer step, assembled: neither donor's anchor.
    mixed = valid_download()
    other = donor_state()
    other.apply(randn(34, std=1e-3), round=6)
    mixed.tensors[0][NUMEL // 2:] = other.anchor[NUMEL // 2:]
    with pytest.raises(MessageError, match="does not match its donors' fingerprint"):
        receiver.adopt(mixed, require_claim=True)
    unclaimed = valid_download()
    del unclaimed.metadata["claim"]
    with pytest.raises(MessageError, match="bad claim"):
        receiver.adopt(unclaimed, require_claim=True)
    lying = with_metadata(claim={**valid_download().metadata["claim"], "rounds_done": 1})
    with pytest.raises(MessageError, match="another outer step"):
        receiver.adopt(lying, require_claim=True)
    assert_same_snapshot(snapshot(receiver), before)
    # A checkpoint has no claim; an honest download adopts.
    assert receiver.adopt(unclaimed) == 6
    assert new_state(anchor_seed=40).adopt(valid_download(), require_claim=True) == 6


def test_a_re_sync_adopts_only_the_anchor_the_group_agreed_on():
    """Download poisoning (issue 11): a donor can serve any state with a claim of its own making.
    A re-sync checks the state against the group's reference claim (from the round's gather),
    also when the donor already applied this round's step (undone with its momentum)."""
    group = donor_state()  # the group's anchor when the round's claims were made
    reference = group.claim()
    step = randn(35, std=1e-3)  # this round's average
    ahead = donor_state()
    ahead.apply(step, round=7)  # a donor that already applied it

    def download(state: SharedState) -> DownloadedState:
        metadata, tensors = state.shared_state()
        return DownloadedState("donor-x", metadata, tensors)

    liar = new_state(anchor_seed=50)  # consistent with its own claim, not with the group's
    liar.apply(randn(51, std=1e-3), round=4)
    liar.apply(randn(52, std=1e-3), round=6)
    receiver = new_state(anchor_seed=40)
    receiver.apply(randn(41, std=1e-3), round=1)
    before = snapshot(receiver)
    refusals = [
        (download(liar), step, "not the one the group agreed on"),
        (download(ahead), None, "1 outer step from the group's reference"),  # cannot undo without the step
        (download(ahead), randn(36, std=1e-3), "not the one the group agreed on"),  # another step undone
    ]
    further = donor_state()
    further.apply(step, round=7)
    further.apply(randn(37, std=1e-3), round=8)
    refusals.append((download(further), step, "2 outer steps from the group's reference"))
    for state, undo, match in refusals:
        with pytest.raises(MessageError, match=match):
            receiver.adopt(state, require_claim=True, reference=reference, step=undo)
        assert_same_snapshot(snapshot(receiver), before)
    assert receiver.adopt(download(group), require_claim=True, reference=reference, step=step) == 6
    assert receiver.adopt(download(ahead), require_claim=True, reference=reference, step=step) == 7
    assert torch.equal(receiver.anchor, ahead.anchor) and torch.equal(receiver.momentum, ahead.momentum)


def test_each_slice_of_a_download_is_checked_against_the_claim_it_should_match():
    """Naming a lying donor (issue 11): slices cut at the fingerprint's chunks are checked as they
    arrive, against the donor's own claim or, in a re-sync, the group's reference."""
    donor = donor_state()
    metadata, tensors = donor.shared_state()
    flat = torch.cat(tensors)
    align = slice_alignment(NUMEL)
    count = slice_units(flat.numel(), align)
    bounds = [slice_bounds(flat.numel(), i, count, align) for i in range(count)]
    receiver = new_state(anchor_seed=40)
    receiver.apply(randn(41, std=1e-3), round=1)
    check = accept.slice_check(receiver)
    assert all(check(a, b, metadata, flat[a:b]) is None for a, b in bounds)  # an honest donor
    tampered = flat.clone()
    tampered[SIGN_PERIOD + 5] += 0.1  # one value of the anchor's second chunk
    problems = [check(a, b, metadata, tampered[a:b]) for a, b in bounds]
    refused = [(a, b) for (a, b), problem in zip(bounds, problems) if problem is not None]
    assert len(refused) == 1 and refused[0][0] <= SIGN_PERIOD + 5 < refused[0][1]
    assert "do not match the fingerprint it claims" in next(p for p in problems if p)
    # The momentum half has no fingerprint: it is checked with the whole state (adopt).
    tampered = flat.clone()
    tampered[NUMEL + 5] += 0.1
    assert all(check(a, b, metadata, tampered[a:b]) is None for a, b in bounds)
    # In a re-sync, the group's reference decides: a donor at the reference's step whose claim
    # and values agree with each other but not with the group is refused, slice by slice.
    liar = new_state(anchor_seed=50)
    liar.apply(randn(51, std=1e-3), round=4)
    liar.apply(randn(52, std=1e-3), round=6)
    liar_metadata, liar_tensors = liar.shared_state()
    liar_flat = torch.cat(liar_tensors)
    assert all(check(a, b, liar_metadata, liar_flat[a:b]) is None for a, b in bounds)  # self-consistent
    by_group = accept.slice_check(receiver, donor.claim())
    assert all(by_group(a, b, metadata, flat[a:b]) is None for a, b in bounds)
    problems = [by_group(a, b, liar_metadata, liar_flat[a:b]) for a, b in bounds if a < NUMEL]
    assert all(p is not None and "the anchor its group agreed on" in p for p in problems), problems


def test_a_state_newer_than_the_schedule_is_refused():
    receiver = new_state(anchor_seed=40)
    with pytest.raises(MessageError, match="round counters"):
        receiver.adopt(valid_download(), require_claim=True, max_round=5)  # the donor claims round 6
    assert receiver.adopt(valid_download(), require_claim=True, max_round=6) == 6


def test_same_state_tells_donors_of_one_anchor_from_donors_that_diverged():
    judge, one, same = new_state(anchor_seed=40), donor_state(), donor_state()
    ahead = donor_state()
    ahead.apply(randn(34, std=1e-3), round=7)
    diverged = donor_state()
    diverged.anchor.add_(randn(35, std=1e-2))
    diverged._claim = None  # as if it had applied another step
    assert accept.same_state(judge, one.shared_state()[0], same.shared_state()[0])
    assert not accept.same_state(judge, one.shared_state()[0], ahead.shared_state()[0])
    assert not accept.same_state(judge, one.shared_state()[0], diverged.shared_state()[0])
    assert not accept.same_state(judge, one.shared_state()[0], {"round": 6})  # no claim: never the same


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_adopt_rejects_a_non_finite_scale(bad):
    receiver = new_state(anchor_seed=40)
    before = snapshot(receiver)
    with pytest.raises(MessageError):
        receiver.adopt(with_metadata(scale=struct.pack("<4d", 1e-3, 1e-3, 1e-3, bad)))
    assert_same_snapshot(snapshot(receiver), before)


@pytest.mark.parametrize("changes", [{"rounds_done": True}, {"rounds_done": 2**41}, {"round": 2**70}])
def test_adopt_rejects_round_counters_that_no_peer_would_accept(changes):
    receiver = new_state(anchor_seed=40)
    before = snapshot(receiver)
    with pytest.raises(MessageError):
        receiver.adopt(with_metadata(**changes))
    assert_same_snapshot(snapshot(receiver), before)


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, r"outer\.lr \(0\.0\) must be in \(0, 10\]"),
        ({"lr": -0.7}, r"outer\.lr"),
        ({"lr": 10.5}, r"outer\.lr"),
        ({"momentum": 1.0}, r"outer\.momentum \(1\.0\) must be in \[0, 1\)"),
        ({"momentum": -0.1}, r"outer\.momentum"),
    ],
)
def test_outer_config_rejects_bad_values_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OuterConfig(**kwargs)


def test_outer_config_accepts_the_bounds():
    assert OuterConfig(lr=10.0, momentum=0.0).lr == 10.0
    assert OuterConfig(lr=1e-6, momentum=0.999).momentum == 0.999
    assert (OuterConfig().lr, OuterConfig().momentum, OuterConfig().nesterov) == (1.0, 0.5, True)


def test_a_report_claiming_more_outer_steps_than_rounds_is_refused():
    states = three_states()
    end_round(states, 1, randn(18, std=1e-3))
    boastful = {**states["peer-a"].claim_message(round=2).encode(), "rounds_done": 3}
    conclusions = end_round(states, 2, randn(19, std=1e-3), extra={"mallory": boastful})
    for conclusion in conclusions.values():
        assert conclusion.bad_claims == 1 and "mallory" not in conclusion.verdict.consensus.agreeing


def test_a_claimed_scale_cannot_widen_the_tolerance():
    # mallory's anchor is far off, but it claims a scale large enough to "agree" with everybody: the
    # claim is capped at twice our own scale, so it is seen as diverged, and nobody follows it.
    states = three_states()
    end_round(states, 1, randn(18, std=1e-3))
    report = states["peer-a"].claim_message(round=2)
    far = {**report.encode(), "proj": struct.pack(f"<{len(report.projections)}d",
                                                  *[p + 1.0 for p in report.projections]),
           "scale": struct.pack(f"<{len(report.scale)}d", *[1e6] * len(report.scale))}
    conclusions = end_round(states, 2, randn(19, std=1e-3), extra={"mallory": far})
    for conclusion in conclusions.values():
        assert conclusion.verdict.consensus.diverged == frozenset({"mallory"}), conclusion.verdict
        assert conclusion.resync is None


def test_a_state_of_no_outer_step_must_be_the_runs_initial_weights():
    """Issue 11's hijack at a join: a donor serving its own anchor plus noise as the state of no
    outer step, with a claim of its own making, is refused slice by slice: every peer builds the
    initial weights itself from the run's seed."""
    receiver = new_state(anchor_seed=7)  # our init: the run's
    honest = new_state(anchor_seed=7)
    metadata, tensors = honest.shared_state()
    flat = torch.cat(tensors)
    align = slice_alignment(NUMEL)
    count = slice_units(flat.numel(), align)
    bounds = [slice_bounds(flat.numel(), i, count, align) for i in range(count)]
    receiver.apply(randn(8, std=1e-3), round=1)  # what we did since does not change the run's init
    check = accept.slice_check(receiver)
    assert all(check(a, b, metadata, flat[a:b]) is None for a, b in bounds)

    hijacker = new_state(anchor_seed=7)
    hijacker.anchor.add_(randn(9, std=0.05))  # claims are computed from this anchor: self-consistent
    liar_metadata, liar_tensors = hijacker.shared_state()
    liar_flat = torch.cat(liar_tensors)
    problems = [check(a, b, liar_metadata, liar_flat[a:b]) for a, b in bounds if a < NUMEL]
    assert problems and all(p is not None and "the run's initial weights" in p for p in problems), problems
    # ... also in a re-sync whose group reference is its own (two Sybils outvoting us).
    by_group = accept.slice_check(receiver, hijacker.claim())
    assert all(by_group(a, b, liar_metadata, liar_flat[a:b]) is not None for a, b in bounds if a < NUMEL)

    momentum = flat.clone()
    momentum[NUMEL + 3] = 0.5  # the initial state has no outer momentum yet
    problems = [check(a, b, metadata, momentum[a:b]) for a, b in bounds]
    assert sum(p is not None for p in problems) == 1
    assert "momentum of a state of no outer step" in next(p for p in problems if p)


def test_a_state_claiming_more_outer_steps_than_rounds_is_refused():
    """A peer applies at most one outer step a round: a state of round 1 with 2 steps is a lie
    (the hijacker's "one step ahead" of a state of round 0, issue 11), refused before its claim
    is compared with anything; and a replayed step may not claim such a round either."""
    receiver = new_state(anchor_seed=40)
    before = snapshot(receiver)
    lie = with_metadata(round=1)  # donor_state: 2 outer steps
    with pytest.raises(MessageError, match="claims 2 outer steps in a state of round 1"):
        receiver.adopt(lie, require_claim=True)
    assert_same_snapshot(snapshot(receiver), before)
    assert not accept.same_state(receiver, lie.metadata, lie.metadata)
    assert "claims 2 outer steps" in accept.slice_check(receiver)(0, 16, lie.metadata, lie.tensors[0][:16])

    honest = new_state(anchor_seed=40)
    step = randn(41, std=1e-3)
    target = new_state(anchor_seed=40)
    target.apply(step, round=3)
    assert not honest.catch_up([AppliedUpdate(0, 1, step.half())], target.claim())  # 1 step by round 0
    assert honest.rounds_done == 0
    assert honest.catch_up([AppliedUpdate(3, 1, step.half())], target.claim())
