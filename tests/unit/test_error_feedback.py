"""averaging.math.error_feedback: what is sent adds up to what was meant, and parts are block-aligned and even."""

from __future__ import annotations

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer

from averaging.math import codecs
from averaging.math.error_feedback import balanced_part_size, compensate
from averaging.network.hivemind.codecs import ShoalCodec

ROUNDS = 200


def rounds_of_pseudo_grads(numel: int, seed: int = 0):
    """A persistent drift below int4's resolution in most blocks, plus noise and an outlier per block."""
    generator = torch.Generator().manual_seed(seed)
    drift = torch.full((numel,), 0.02)
    for _ in range(ROUNDS):
        g = drift + 0.01 * torch.randn(numel, generator=generator)
        g[::64] = 1.0  # one large entry per block: int4's step becomes 1/7, the drift rounds to 0
        yield g


@pytest.mark.parametrize("code", ["int8", "int4", "int2"])
def test_feedback_keeps_the_cumulative_error_within_one_residual(code):
    numel = 64 * 40 + 13
    residual = torch.zeros(numel)
    sent_total, true_total, plain_total = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    largest_residual = []
    for g in rounds_of_pseudo_grads(numel):
        feedback = compensate(g, residual, code)
        assert torch.equal(codecs.quantize(feedback.to_send, code), feedback.to_send)  # on the grid
        corrected = g + residual
        assert torch.equal(feedback.residual, corrected - feedback.to_send)
        if code != "int2":  # int codes: the residual is at most half a step (block absmax / L) per element
            padded = torch.nn.functional.pad(corrected.abs(), (0, -numel % 64)).view(-1, 64)
            step = padded.amax(1).repeat_interleave(64)[:numel] / codecs.CODES[code].max_level
            assert bool((feedback.residual.abs() <= (0.5 + 2**-11) * step).all())
        residual = feedback.residual
        sent_total += feedback.to_send
        true_total += g
        plain_total += codecs.quantize(g, code)
        largest_residual.append(residual.abs().max().item())
    with_feedback = (sent_total - true_total).abs()
    without = (plain_total - true_total).abs()
    # The sum of what was sent is off by exactly the last residual, whatever the number of rounds.
    assert torch.allclose(sent_total - true_total, -residual, atol=1e-4)
    # Bounded, not growing: the residual of the last 100 rounds is no larger than of the first 100.
    assert max(largest_residual[100:]) <= 1.2 * max(largest_residual[:100])
    # int2 keeps one magnitude per block: a block's outlier is sent a bit at a time (about 10
    # rounds of it wait in the residual here), where int codes send it at once.
    assert with_feedback.max() < (12.0 if code == "int2" else 1.5)
    # Without feedback the dropped drift piles up: 200 rounds x 0.02 = 4 per element.
    if code != "int8":
        assert without.max() > 3.0
        assert without.norm() > 10 * with_feedback.norm()


def test_feedback_matters_even_for_unbiased_noise():
    numel = 4096
    generator = torch.Generator().manual_seed(1)
    residual = torch.zeros(numel)
    error_with, error_without = torch.zeros(numel), torch.zeros(numel)
    for _ in range(ROUNDS):
        g = torch.randn(numel, generator=generator)
        feedback = compensate(g, residual, "int4")
        residual = feedback.residual
        error_with += feedback.to_send - g
        error_without += codecs.quantize(g, "int4") - g
    # Independent rounding errors random-walk (sqrt(200) ~ 14 steps of 1/sqrt(12)); fed back, one step.
    assert error_without.norm() > 5 * error_with.norm()


def test_compensate_is_pure_and_refuses_non_finite():
    g, r = torch.randn(1000), torch.randn(1000) * 0.01
    g_before, r_before = g.clone(), r.clone()
    compensate(g, r, "int4")
    assert torch.equal(g, g_before) and torch.equal(r, r_before)
    g[3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        compensate(g, r, "int4")


def hivemind_parts_per_peer(numel: int, group_size: int, part_values: int | None) -> tuple[int, ...]:
    codec = ShoalCodec("int4", part_values=part_values) if part_values else ShoalCodec("int4")
    container = TensorPartContainer([torch.zeros(numel)], (1.0,) * group_size, compression=codec)
    return container.num_parts_by_peer


@pytest.mark.parametrize("numel", [1000, 100_000, 1_000_000, 3_000_000, 20_000_000])
@pytest.mark.parametrize("group_size", [2, 3, 4])
def test_balanced_parts_are_whole_blocks_under_the_byte_cap_and_even(numel, group_size):
    bytes_per_value = codecs.bytes_per_value("int4")
    part = balanced_part_size(numel, group_size, 64, bytes_per_value=bytes_per_value)
    assert part % 64 == 0 and part * bytes_per_value <= 2**19
    parts = hivemind_parts_per_peer(numel, group_size, part)
    assert min(parts) >= 1 and max(parts) - min(parts) <= 1, parts


def test_hivemind_default_parts_are_uneven_for_small_vectors():
    """Why balanced_part_size exists: fp16-sized parts spread 3.5 parts over 4 peers as 1,1,0,2;
    int4 parts put a 1M vector in 2 parts, so 2 of 4 peers reduce nothing."""
    fp16_part = 2**19 // 2
    numel = int(3.5 * fp16_part)
    container = TensorPartContainer([torch.zeros(numel)], (1.0,) * 4, part_size_bytes=2**19)
    assert sorted(container.num_parts_by_peer) != [1, 1, 1, 1]
    assert 0 in hivemind_parts_per_peer(1_000_000, 4, None)
    assert hivemind_parts_per_peer(1_000_000, 4, balanced_part_size(
        1_000_000, 4, 64, bytes_per_value=codecs.bytes_per_value("int4"))) == (1, 1, 1, 1)


def test_balanced_part_size_validates():
    with pytest.raises(ValueError):
        balanced_part_size(100, 0, 64, bytes_per_value=0.5)
    assert balanced_part_size(0, 4, 64, bytes_per_value=0.5) == 64
    assert balanced_part_size(10, 4, 64, bytes_per_value=0.5) == 64
