"""A split swarm's reunion (``averaging.engine.lineage``): the two lineages' anchors end averaged by
the tokens each side trained apart, through one ordinary round; a member that merely slipped merges
nothing."""

import pytest
import torch

from averaging.engine.lineage import LineageWatch, lineage_fold
from averaging.math.merge import merge_correction
from averaging.math.outer_step import outer_step_, pseudo_gradient

NUMEL = 64
US, OTHERS = ("p2", "p3"), ("p0", "p1")


def stepped(peers, steps: int = 5) -> dict[str, int]:
    """The other side with the outer steps each claims."""
    return dict.fromkeys(peers, steps)


def vec(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * scale


def weighted_mean(vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    return sum(w * v for v, w in zip(vectors, weights)) / sum(weights)


@pytest.mark.parametrize(("lr", "mu"), [(1.0, 0.5), (0.7, 0.9), (1.0, 0.0)])
@pytest.mark.parametrize(("t_kept", "t_ours"), [(800.0, 800.0), (1200.0, 400.0)])
def test_the_merged_anchor_ends_at_the_lineages_averaged_by_their_tokens_apart(lr, mu, t_kept, t_ours):
    """Two members a side. Ours re-sync and keep the fold in their parameters; theirs add their
    tokens apart to their weight. With no new work, the outer steps from there (the reunion's
    average, then the momentum's tail) take the kept anchor to the token-weighted mean of the two."""
    kept, ours = vec(0), vec(1)
    momentum = vec(2, 0.01)  # the kept side's outer momentum at the reunion: its own tail goes on too
    tail = lr * mu ** 2 / (1 - mu) * momentum  # how far that momentum alone carries the anchor (Nesterov)
    # Our parameters after the re-sync: the kept anchor plus the fold (no local work, for the arithmetic).
    params = kept + merge_correction(kept, kept, None, contributed=False) + lineage_fold(ours, kept, lr=lr, mu=mu)
    sends = [pseudo_gradient(kept, kept)] * 2 + [pseudo_gradient(kept, params)] * 2
    weights = [t_kept / 2] * 2 + [t_ours / 2] * 2
    anchor = kept.clone()
    outer_step_(anchor, weighted_mean(sends, weights), momentum, lr=lr, mu=mu)
    for _ in range(400):  # the momentum's tail, with nothing new averaged
        outer_step_(anchor, torch.zeros(NUMEL), momentum, lr=lr, mu=mu)
    expected = weighted_mean([kept, ours], [t_kept, t_ours]) - tail
    assert torch.allclose(anchor, expected, atol=1e-4), float((anchor - expected).abs().max())


def split_then_apart(watch: LineageWatch, rounds_apart: int) -> int:
    """Two rounds of all four, then our side (p2, p3) steps on its own in pairs; our outer steps."""
    watch.observe(group=OTHERS + US, rounds_done=1, tokens=100)
    watch.observe(group=OTHERS + US, rounds_done=2, tokens=100)
    for k in range(3, 3 + rounds_apart):
        watch.observe(group=US, rounds_done=k, tokens=100)
    return 2 + rounds_apart


def test_a_reunion_weighs_our_tokens_apart_and_counts_our_steps():
    watch = LineageWatch()
    done = split_then_apart(watch, 3)
    assert watch.reunion(group_size=4, others=stepped(OTHERS), rounds_done=done) == 300.0
    assert watch.steps_apart(done) == 3


def test_a_member_that_missed_rounds_and_is_merely_behind_is_no_other_side():
    """p0 missed our last round (a group of three without it), then diverged: it took no step
    since the whole round, so it catches up, and nobody weighs anything in a merge."""
    watch = LineageWatch()
    watch.observe(group=OTHERS + US, rounds_done=1, tokens=100)
    watch.observe(group=("p1",) + US, rounds_done=2, tokens=100)
    assert watch.reunion(group_size=4, others={"p0": 1}, rounds_done=2) is None
    assert watch.reunion(group_size=4, others={"p0": 2}, rounds_done=2) == 100.0  # it stepped apart: a side


def test_a_member_that_slipped_out_of_its_own_group_merges_nothing():
    """The other side are peers we averaged with since the last whole round: a repair, not a
    reunion (merging would count our last steps twice: they are in their anchor too)."""
    watch = LineageWatch()
    done = split_then_apart(watch, 1)
    assert watch.reunion(group_size=4, others=stepped(("p3",)), rounds_done=done) is None
    assert watch.reunion(group_size=4, others=stepped(("p0", "p3")), rounds_done=done) is None


def test_no_reunion_in_a_group_no_larger_than_apart_nor_without_steps_or_anyone_apart():
    watch = LineageWatch()
    done = split_then_apart(watch, 1)
    assert watch.reunion(group_size=2, others=stepped(OTHERS), rounds_done=done) is None
    assert watch.reunion(group_size=4, others=stepped(OTHERS), rounds_done=2) is None  # our anchor did not step apart
    assert watch.reunion(group_size=4, others={}, rounds_done=done) is None
    # Never a whole round: nothing in common with the other side.
    assert LineageWatch().reunion(group_size=4, others=stepped(OTHERS), rounds_done=done) is None


def test_a_whole_round_starts_over_and_a_shrunk_swarm_becomes_whole_in_time():
    watch = LineageWatch(window=3)
    done = split_then_apart(watch, 1)
    watch.observe(group=OTHERS + US, rounds_done=done + 1, tokens=100)  # the reunion round: whole again
    assert watch.reunion(group_size=4, others=stepped(("p9",), 9), rounds_done=done + 1) is None  # no round apart since
    # A peer that left for good: after ``window`` rounds of three, three is whole.
    for k in range(done + 2, done + 5):
        watch.observe(group=("p0", "p1", "p2"), rounds_done=k, tokens=100)
    assert watch.reunion(group_size=4, others=stepped(("p9",), 9), rounds_done=done + 4) is None


def test_tokens_count_only_rounds_whose_work_reached_our_anchor():
    watch = LineageWatch()
    watch.observe(group=OTHERS + US, rounds_done=1, tokens=100)
    watch.observe(group=US, rounds_done=2, tokens=100)
    watch.observe(group=(), rounds_done=2, tokens=0)  # a folded round: its work rides on the next
    assert watch.reunion(group_size=4, others=stepped(OTHERS), rounds_done=2) == 100.0


def test_a_partial_first_meeting_after_a_split_leaves_the_reunion_to_the_next_round():
    """Under load the halves' first group of four can come back partial (no verdict, no re-sync):
    it is no whole round, so the round that re-syncs still merges our side's steps."""
    watch = LineageWatch()
    done = split_then_apart(watch, 2)
    watch.observe(group=OTHERS + US, rounds_done=done, tokens=0, partial=True)
    assert watch.reunion(group_size=4, others=stepped(OTHERS), rounds_done=done) == 200.0
    assert watch.steps_apart(done) == 2
