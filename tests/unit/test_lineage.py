"""A split swarm's reunion: the re-synced side's work since the split is folded into its next
contribution (``averaging.engine.lineage``), and a member that merely slipped folds nothing."""

import torch

from averaging.engine.lineage import Fold, LineageWatch
from averaging.math.merge import merge_correction
from averaging.math.outer_step import pseudo_gradient

NUMEL = 64
US, OTHERS = ("p2", "p3"), ("p0", "p1")


def vec(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * scale


def split_then_apart(watch: LineageWatch, whole: torch.Tensor, apart_steps: list[torch.Tensor]) -> torch.Tensor:
    """Two rounds of all four, then our side (p2, p3) steps its own anchor in pairs; returns it."""
    anchor = whole.clone()
    watch.observe(group=OTHERS + US, anchor=anchor, rounds_done=1, tokens=100)
    watch.observe(group=OTHERS + US, anchor=anchor, rounds_done=2, tokens=100)
    for k, step in enumerate(apart_steps, start=3):
        anchor = anchor - step
        watch.observe(group=US, anchor=anchor, rounds_done=k, tokens=100)
    return anchor


def test_the_resynced_side_carries_its_work_since_the_split_into_its_next_pseudo_gradient():
    watch = LineageWatch(NUMEL)
    whole = vec(0)
    ours = split_then_apart(watch, whole, [vec(1, 0.01), vec(2, 0.01), vec(3, 0.01)])
    kept = whole - vec(4, 0.01) - vec(5, 0.01)  # the other side's anchor, which the group keeps
    local = vec(6, 0.001)  # our steps since the reunion round's snapshot
    params = ours + local  # (our work up to the snapshot went out as this round's contribution)

    correction = merge_correction(kept, ours, None, contributed=False)  # a re-sync: our anchor replaced
    fold = watch.fold(correction, old_anchor=ours, rounds_done=5, group_size=4, donors=OTHERS)

    assert fold == Fold(steps=3, tokens=300.0)
    params = params + correction
    # The kept anchor stays whole; our side's displacement since the split rides on the next pseudo-gradient.
    # (Up to the fp16 copy of the whole round's anchor: 2^-11 of its largest value.)
    assert torch.allclose(pseudo_gradient(kept, params), (whole - ours) - local, atol=float(whole.abs().max()) * 2 ** -11)
    assert not torch.allclose(pseudo_gradient(kept, params), -local, atol=1e-3)  # without the fold: our work gone


def test_a_member_that_slipped_out_of_its_own_group_folds_nothing():
    """A re-sync from peers we averaged with since the last whole round is a repair, not a reunion:
    folding would count our last steps twice (they are in the donors' anchor too)."""
    watch = LineageWatch(NUMEL)
    ours = split_then_apart(watch, vec(0), [vec(1, 0.01)])
    correction = torch.zeros(NUMEL)
    assert watch.fold(correction, old_anchor=ours, rounds_done=3, group_size=4, donors=("p3",)) is None
    assert watch.fold(correction, old_anchor=ours, rounds_done=3, group_size=4, donors=("p0", "p3")) is None
    assert not correction.any()


def test_no_fold_in_a_group_no_larger_than_apart_nor_without_steps_apart():
    watch = LineageWatch(NUMEL)
    ours = split_then_apart(watch, vec(0), [vec(1, 0.01)])
    correction = torch.zeros(NUMEL)
    assert watch.fold(correction, old_anchor=ours, rounds_done=3, group_size=2, donors=OTHERS) is None
    assert watch.fold(correction, old_anchor=ours, rounds_done=2, group_size=4, donors=OTHERS) is None
    assert not correction.any()
    # Never a whole round: nothing in common to fold against.
    assert LineageWatch(NUMEL).fold(correction, old_anchor=ours, rounds_done=3, group_size=4, donors=OTHERS) is None


def test_a_whole_round_starts_the_lineage_again_and_a_shrunk_swarm_becomes_whole_in_time():
    watch = LineageWatch(NUMEL, window=3)
    ours = split_then_apart(watch, vec(0), [vec(1, 0.01)])
    watch.observe(group=OTHERS + US, anchor=ours, rounds_done=4, tokens=100)  # the reunion round: whole again
    assert watch.fold(torch.zeros(NUMEL), old_anchor=ours - vec(2, 0.01), rounds_done=5, group_size=4,
                      donors=("p9",)) is None  # no round apart since
    # A peer that left for good: after ``window`` rounds of three, three is whole.
    for k in range(5, 8):
        watch.observe(group=("p0", "p1", "p2"), anchor=ours, rounds_done=k, tokens=100)
    assert watch.fold(torch.zeros(NUMEL), old_anchor=ours - vec(3, 0.01), rounds_done=8, group_size=4,
                      donors=("p9",)) is None


def test_tokens_count_only_rounds_whose_work_reached_our_anchor():
    watch = LineageWatch(NUMEL)
    anchor = vec(0)
    watch.observe(group=OTHERS + US, anchor=anchor, rounds_done=1, tokens=100)
    watch.observe(group=US, anchor=anchor - vec(1, 0.01), rounds_done=2, tokens=100)
    watch.observe(group=(), anchor=anchor - vec(1, 0.01), rounds_done=2, tokens=0)  # a folded round
    fold = watch.fold(torch.zeros(NUMEL), old_anchor=anchor - vec(1, 0.01), rounds_done=2, group_size=4,
                      donors=OTHERS)
    assert fold == Fold(steps=1, tokens=100.0)
