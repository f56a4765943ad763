"""Inner-state averaging's math (``averaging.math.inner_state``) against torch's own optimizers: a
mean landed k steps late equals the state of a peer that started those k steps from the mean."""

from __future__ import annotations

import pytest
import torch

from averaging.math.inner_state import decays, land, land_state, weighted_mean


def _state(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    """``Trainer.inner_state``'s layout: ``<name>.<slot>`` on the CPU."""
    return {f"{names[i]}.{slot}": value.detach().clone()
            for i, slots in optimizer.state_dict()["state"].items() for slot, value in slots.items()
            if torch.is_tensor(value)}


def _load(optimizer: torch.optim.Optimizer, names: list[str], state: dict[str, torch.Tensor]) -> None:
    full = optimizer.state_dict()
    for i, name in enumerate(names):
        for slot in full["state"][i]:
            full["state"][i][slot] = state[f"{name}.{slot}"].clone()
    optimizer.load_state_dict(full)


def _steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_a_mean_landed_late_is_the_state_of_starting_from_the_mean(kind):
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 6), (5, 4)] if kind == "muon" else [(8, 6), (6,)]
    names = [f"w{i}" for i in range(len(shapes))]

    def optimizer_for(params):
        if kind == "muon":
            return torch.optim.Muon(params, lr=0.02, momentum=0.95)
        return torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)

    def grads(count):
        return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(count)]

    # Two peers train a round each; their states at the round's end are the snapshots.
    peers = []
    for _ in range(2):
        params = [torch.randn(s, generator=gen, requires_grad=True) for s in shapes]
        optimizer = optimizer_for(params)
        _steps(optimizer, params, grads(5))
        peers.append((params, optimizer))
    snapshots = [_state(o, names) for _, o in peers]
    mean = weighted_mean(snapshots, [3.0, 1.0])
    assert set(mean) == {k for k in snapshots[0] if not k.endswith(".step")}  # AdamW's step count stays each peer's

    # Peer 0 keeps training 4 steps while the all-reduce runs, then the mean lands.
    params, optimizer = peers[0]
    late = grads(4)
    _steps(optimizer, params, late)
    landed = land_state(_state(optimizer, names), snapshots[0], mean, decays([optimizer]), steps=4)

    # The reference: the same 4 gradients from the mean itself.
    ref_params = [torch.randn(s, generator=gen, requires_grad=True) for s in shapes]
    reference = optimizer_for(ref_params)
    _steps(reference, ref_params, grads(1))  # creates the state, then overwritten by the mean
    _load(reference, names, {**snapshots[0], **mean})
    _steps(reference, ref_params, late)
    expected = _state(reference, names)
    for key in mean:
        torch.testing.assert_close(landed[key], expected[key], rtol=1e-5, atol=1e-7)
    # Without the landing (the mean dropped in as it was) the late steps' share is lost.
    assert any(not torch.allclose(mean[k], expected[k], rtol=1e-3) for k in mean)


def test_decays_come_from_the_param_groups_and_must_agree():
    p = [torch.zeros(3, requires_grad=True)]
    assert decays([torch.optim.AdamW(p, betas=(0.8, 0.99))]) == {"exp_avg": 0.8, "exp_avg_sq": 0.99}
    q = [torch.zeros(3, 3, requires_grad=True)]
    assert decays([torch.optim.AdamW(p, betas=(0.8, 0.99)), torch.optim.Muon(q, momentum=0.9)]) == \
        {"exp_avg": 0.8, "exp_avg_sq": 0.99, "momentum_buffer": 0.9}
    with pytest.raises(ValueError, match="exp_avg by 0.8 and by 0.9"):
        decays([torch.optim.AdamW(p, betas=(0.8, 0.99)), torch.optim.AdamW(p, betas=(0.9, 0.99))])


def test_second_moments_never_land_below_zero_and_bad_input_is_refused():
    v = land(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 2.0]), decay=1.0, steps=3,
             nonnegative=True)
    assert v.tolist() == [0.0, 2.0]  # -1 clamped; exact otherwise
    assert land(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([3.0]), decay=0.5, steps=2).item() == 1.0
    with pytest.raises(ValueError):
        land(torch.zeros(1), torch.zeros(1), torch.zeros(1), decay=1.5, steps=1)
    with pytest.raises(ValueError, match="only moments"):
        weighted_mean([{"a.step": torch.zeros(1)}], [1.0], ["step"])  # the bias correction's count
    with pytest.raises(ValueError):
        weighted_mean([{"a.exp_avg": torch.zeros(1)}], [0.0], ["exp_avg"])
    with pytest.raises(ValueError):
        weighted_mean([{"a.exp_avg": torch.zeros(1)}], [1.0, 1.0], ["exp_avg"])
