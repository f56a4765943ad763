"""The outer step and pseudo-gradient against torch's own Nesterov SGD."""

import pytest
import torch

from averaging.math.flat import FlatLayout
from averaging.math.outer_step import FP16_MAX, anchor_before_step, kept_step, outer_step_, pseudo_gradient


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_sgd(nesterov):
    gen = torch.Generator().manual_seed(0)
    anchor = torch.randn(1000, generator=gen)
    reference = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=nesterov)
    momentum = torch.zeros_like(anchor)
    for _ in range(5):
        params = anchor - 0.01 * torch.randn(1000, generator=gen)  # where local inner steps ended
        grad = pseudo_gradient(anchor, params)
        reference.grad = grad.clone()
        sgd.step()
        outer_step_(anchor, grad, momentum, lr=0.7, mu=0.9, nesterov=nesterov)
        torch.testing.assert_close(anchor, reference.detach(), rtol=0, atol=1e-6)


def test_outer_step_returns_the_applied_update():
    anchor = torch.ones(4)
    before = anchor.clone()
    update = outer_step_(anchor, torch.full((4,), 0.5), torch.zeros(4), lr=1.0, mu=0.0)
    torch.testing.assert_close(before - anchor, update)
    torch.testing.assert_close(anchor, torch.full((4,), 0.5))


@pytest.mark.parametrize("nesterov", [True, False])
def test_anchor_before_step_inverts_the_outer_step(nesterov):
    generator = torch.Generator().manual_seed(5)
    anchor, grad = torch.randn(1000, generator=generator, dtype=torch.float64), torch.randn(1000, generator=generator, dtype=torch.float64)
    momentum = torch.randn(1000, generator=generator, dtype=torch.float64)
    after, momentum_after = anchor.clone(), momentum.clone()
    outer_step_(after, grad, momentum_after, lr=0.7, mu=0.9, nesterov=nesterov)
    before = anchor_before_step(after, grad, momentum_after, lr=0.7, mu=0.9, nesterov=nesterov)
    assert torch.allclose(before, anchor, rtol=0, atol=1e-12)
    assert not torch.allclose(after, anchor, rtol=0, atol=1e-3)  # the step did move it


def test_a_kept_step_is_fp16_clamped_to_its_range():
    kept = kept_step(torch.tensor([1e6, -1e6, 7e4, -torch.inf, 0.25]))
    assert kept.dtype == torch.float16 and bool(torch.isfinite(kept).all())  # 7e4 alone would be inf in fp16
    assert kept.float().tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX, -FP16_MAX, 0.25]


def test_a_replay_of_the_kept_step_lands_on_the_same_anchor_bit_for_bit():
    generator = torch.Generator().manual_seed(7)
    anchor, momentum = torch.randn(4096, generator=generator), 1e-3 * torch.randn(4096, generator=generator)
    pseudo_grad = 1e-3 * torch.randn(4096, generator=generator)
    applied, applied_momentum = anchor.clone(), momentum.clone()  # the peer that took the step
    kept = kept_step(pseudo_grad)
    outer_step_(applied, kept.float(), applied_momentum, lr=0.7, mu=0.9)
    served = torch.frombuffer(bytearray(kept.numpy().tobytes()), dtype=torch.float16)  # as sent to a peer
    replayed, replayed_momentum = anchor.clone(), momentum.clone()
    outer_step_(replayed, served.float(), replayed_momentum, lr=0.7, mu=0.9)
    assert torch.equal(replayed, applied) and torch.equal(replayed_momentum, applied_momentum)
    raw = anchor.clone()
    outer_step_(raw, pseudo_grad, momentum.clone(), lr=0.7, mu=0.9)
    assert not torch.equal(raw, applied)  # the fp32 step itself would not replay exactly


def test_pseudo_gradient_is_anchor_minus_params():
    anchor, params = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    torch.testing.assert_close(pseudo_gradient(anchor, params), torch.tensor([0.5, -1.0]))


def test_an_error_in_one_pseudo_gradient_moves_the_anchor_by_lr_over_1_minus_mu():
    # The bound the consistency tolerance is derived from (averaging/math/fingerprints.py).
    a, b = torch.zeros(1), torch.zeros(1)
    ma, mb = torch.zeros(1), torch.zeros(1)
    for step in range(400):
        g = torch.ones(1) * 0.1
        outer_step_(a, g, ma, lr=0.7, mu=0.9)
        outer_step_(b, g + (1.0 if step == 0 else 0.0), mb, lr=0.7, mu=0.9)
    assert float(a - b) == pytest.approx(0.7 / (1 - 0.9), rel=1e-4)


def test_flat_layout_views_write_through():
    named = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4))]
    layout = FlatLayout.of(named)
    flat = layout.new_buffer()
    layout.pack({"a": torch.ones(2, 3), "b": torch.full((4,), 2.0)}, flat)
    assert flat.tolist() == [1.0] * 6 + [2.0] * 4
    layout.views(flat)["b"].zero_()
    assert flat[6:].abs().sum() == 0
