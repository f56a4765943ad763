"""The overlap merge: the new anchor plus the local progress made since the snapshot."""

import torch

from averaging.math.merge import apply_correction_, merge_correction
from averaging.math.outer_step import outer_step_, pseudo_gradient


def test_merge_keeps_progress_made_after_the_snapshot():
    gen = torch.Generator().manual_seed(0)
    anchor = torch.randn(100, generator=gen)
    snapshot = anchor - 0.1 * torch.randn(100, generator=gen)  # where round r's inner steps ended
    pseudo_grad = pseudo_gradient(anchor, snapshot)
    # Several more inner steps happen while the all-reduce runs.
    progress = sum(0.01 * torch.randn(100, generator=gen) for _ in range(7))
    live = snapshot + progress
    new_anchor = anchor.clone()
    outer_step_(new_anchor, 0.5 * pseudo_grad, torch.zeros(100), lr=0.7, mu=0.9)

    live += merge_correction(new_anchor, anchor, pseudo_grad, contributed=True)
    torch.testing.assert_close(live, new_anchor + progress)
    # The next pseudo-gradient carries exactly the work done since the snapshot.
    torch.testing.assert_close(pseudo_gradient(new_anchor, live), -progress)


def test_missed_contribution_is_folded_into_the_next():
    gen = torch.Generator().manual_seed(1)
    anchor = torch.randn(50, generator=gen)
    before_snapshot = -0.1 * torch.randn(50, generator=gen)
    after_snapshot = -0.1 * torch.randn(50, generator=gen)
    snapshot = anchor + before_snapshot
    live = snapshot + after_snapshot
    new_anchor = anchor + 0.3  # the group moved on without us
    live += merge_correction(new_anchor, anchor, pseudo_gradient(anchor, snapshot), contributed=False)
    # Both rounds' work is still there, relative to the new anchor.
    torch.testing.assert_close(live - new_anchor, before_snapshot + after_snapshot)


def test_failed_round_changes_nothing():
    anchor = torch.ones(10)
    correction = merge_correction(anchor.clone(), anchor, torch.full((10,), 0.2), contributed=False)
    assert correction.abs().max() == 0


def test_apply_correction_is_in_place_per_tensor():
    params = [torch.zeros(2, 3), torch.ones(4)]
    apply_correction_(params, [torch.ones(2, 3), torch.full((4,), 2.0)])
    assert params[0].sum() == 6 and params[1].tolist() == [3.0] * 4
