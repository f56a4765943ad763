"""The simulation's own round rules (``benchmarks.sim.rules``): eager overlap's stand-in, jump and
landing, the average kept at its members' length, and a state rounded to the lattice grid."""

import torch

from averaging.math.lattice import Lattice
from averaging.math.merge import merge_correction
from averaging.math.outer_step import outer_step_
from benchmarks.sim.rules import eager_jump, keep_norm, landing_correction, on_grid, stand_in

N = 4096


def weighted_mean(parts, weights) -> torch.Tensor:
    return sum(w * p.double() for w, p in zip(weights, parts)) / sum(weights)


# -- eager overlap ------------------------------------------------------------------------------------
def _eager_setup(seed: int):
    gen = torch.Generator().manual_seed(seed)
    anchor, momentum = torch.randn(64, generator=gen), 0.1 * torch.randn(64, generator=gen)
    sent = 0.05 * torch.randn(64, generator=gen)
    residual = 0.001 * torch.randn(64, generator=gen)  # error feedback's: stays in the parameters
    return gen, anchor, momentum, sent, residual


def test_eager_jump_trains_on_from_the_anchor_our_own_pseudo_gradient_gives():
    _, anchor, momentum, sent, residual = _eager_setup(2)
    params = anchor - sent - residual
    kept = momentum.clone()
    params += eager_jump(anchor, sent, sent, momentum, lr=0.7, mu=0.9)
    speculative = anchor.clone()
    outer_step_(speculative, sent, momentum.clone(), lr=0.7, mu=0.9)
    torch.testing.assert_close(params, speculative - residual)
    torch.testing.assert_close(momentum, kept)  # the shared state is read, never moved


def test_eager_landing_is_exact_when_the_average_equals_our_own_and_else_lands_on_the_new_anchor():
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
    gen, anchor, momentum, sent, residual = _eager_setup(4)
    params = anchor - sent - residual
    jump = eager_jump(anchor, sent, sent, momentum, lr=0.7, mu=0.9)
    params += jump
    new_anchor = anchor + 0.01 * torch.randn(64, generator=gen)  # the others' step, without us
    params += landing_correction(merge_correction(new_anchor, anchor, None, contributed=False), jump)
    torch.testing.assert_close(params, new_anchor - sent - residual)  # all our work kept for the next


def test_stand_in_weighs_our_fresh_work_by_our_share_and_the_last_average_for_the_rest():
    own, previous = torch.full((8,), 4.0), torch.full((8,), 1.0)
    torch.testing.assert_close(stand_in(own, previous, 0.25), torch.full((8,), 1.75))
    assert stand_in(own, None, 0.25) is own and stand_in(own, previous, 1.0) is own  # first round; alone
    assert torch.equal(own, torch.full((8,), 4.0))  # not modified


# -- the average at its members' length -------------------------------------------------------------------
def test_keep_norm_gives_the_average_its_members_length_within_bounds():
    generator = torch.Generator().manual_seed(11)
    signal = torch.randn(N, generator=generator)
    parts = [0.3 * signal + torch.randn(N, generator=generator) for _ in range(4)]  # noise dominates
    mean = weighted_mean(parts, [1.0] * 4).float()
    kept, factor = keep_norm(mean, parts, [1.0] * 4)
    members = sum(float(p.norm()) for p in parts) / 4
    assert 1.5 < factor <= 2.0  # four peers' noise cancels about 2x; sqrt(4) is the cap
    assert abs(float(kept.norm()) - min(members, 2 * float(mean.norm()))) < 1e-3 * members
    torch.testing.assert_close(kept / kept.norm(), mean / mean.norm())  # the direction is the average's
    # Identical parts: nothing cancels, nothing to restore.
    assert keep_norm(parts[0], [parts[0]] * 3, [1.0] * 3)[1] == 1.0
    # A liar's huge part counts at most clip_ratio x the median norm in the target length: in a group
    # whose parts agree (factor ~1), a x1e6 part lengthens the average by at most ~(3 + 2) / 4.
    agreeing = [signal + 0.05 * torch.randn(N, generator=generator) for _ in range(3)]
    honest_mean = weighted_mean(agreeing, [1.0] * 3).float()
    assert keep_norm(honest_mean, agreeing, [1.0] * 3)[1] < 1.01
    _, lied = keep_norm(honest_mean, [*agreeing, 1e6 * agreeing[0]], [1.0] * 4)
    assert 1.1 < lied < 1.26


# -- the lattice grid ------------------------------------------------------------------------------------
def test_on_grid_rounds_each_chunk_to_its_own_step():
    lattice = Lattice(numel=6, chunk_len=4, anchor_steps=torch.tensor([0.5, 0.25], dtype=torch.float64),
                      momentum_steps=torch.tensor([1.0, 0.1], dtype=torch.float64))
    values = torch.tensor([0.3, -0.8, 1.1, 2.6, 0.3, -0.4, 0.4, -1.6, 2.2, 3.9, 0.26, -0.14])
    expected = torch.tensor([0.5, -1.0, 1.0, 2.5, 0.25, -0.5, 0.0, -2.0, 2.0, 4.0, 0.3, -0.1])
    before = values.clone()
    torch.testing.assert_close(on_grid(values, lattice), expected)
    assert torch.equal(values, before)  # a copy: the member's own state is untouched
