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


def _eager_setup(seed: int):
    gen = torch.Generator().manual_seed(seed)
    anchor, momentum = torch.randn(64, generator=gen), 0.1 * torch.randn(64, generator=gen)
    sent = 0.05 * torch.randn(64, generator=gen)
    residual = 0.001 * torch.randn(64, generator=gen)  # error feedback's: stays in the parameters
    return gen, anchor, momentum, sent, residual


def test_eager_jump_trains_on_from_the_anchor_our_own_pseudo_gradient_gives():
    from averaging.math.merge import eager_jump

    _, anchor, momentum, sent, residual = _eager_setup(2)
    params = anchor - sent - residual
    kept = momentum.clone()
    params += eager_jump(anchor, sent, sent, momentum, lr=0.7, mu=0.9)
    speculative = anchor.clone()
    outer_step_(speculative, sent, momentum.clone(), lr=0.7, mu=0.9)
    torch.testing.assert_close(params, speculative - residual)
    torch.testing.assert_close(momentum, kept)  # the shared state is read, never moved


def test_eager_landing_is_exact_when_the_average_equals_our_own_and_else_lands_on_the_new_anchor():
    from averaging.math.merge import eager_jump, landing_correction

    gen, anchor, momentum, sent, residual = _eager_setup(3)
    progress = 0.01 * torch.randn(64, generator=gen)
    for average, moved in ((sent, False), (sent + 0.02 * torch.randn(64, generator=gen), True)):
        params = anchor - sent - residual
        jump = eager_jump(anchor, sent, sent, momentum, lr=0.7, mu=0.9)
        params += jump
        params += progress  # trained on while the average was on its way
        new_anchor, m = anchor.clone(), momentum.clone()
        outer_step_(new_anchor, average, m, lr=0.7, mu=0.9)
        correction = landing_correction(merge_correction(new_anchor, anchor, sent, contributed=True), jump)
        assert bool(correction.abs().max() > 1e-4) == moved
        params += correction
        # The same place the delayed merge gives: the new anchor, the residual, the work since.
        torch.testing.assert_close(params, new_anchor - residual + progress)


def test_eager_folded_round_takes_the_jump_back():
    from averaging.math.merge import eager_jump, landing_correction

    gen, anchor, momentum, sent, residual = _eager_setup(4)
    params = anchor - sent - residual
    jump = eager_jump(anchor, sent, sent, momentum, lr=0.7, mu=0.9)
    params += jump
    new_anchor = anchor + 0.01 * torch.randn(64, generator=gen)  # the others' step, without us
    params += landing_correction(merge_correction(new_anchor, anchor, None, contributed=False), jump)
    torch.testing.assert_close(params, new_anchor - sent - residual)  # all our work kept for the next


def test_stand_in_weighs_our_fresh_work_by_our_share_and_the_last_average_for_the_rest():
    from averaging.math.merge import stand_in

    own, previous = torch.full((8,), 4.0), torch.full((8,), 1.0)
    torch.testing.assert_close(stand_in(own, previous, 0.25), torch.full((8,), 1.75))
    assert stand_in(own, None, 0.25) is own and stand_in(own, previous, 1.0) is own  # first round; alone
    assert torch.equal(own, torch.full((8,), 4.0))  # not modified
