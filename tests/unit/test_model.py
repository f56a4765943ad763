"""The built-in byte-level GPT: config checks, deterministic init, causality, learnability."""

import math

import pytest
import torch

from node.training.model import GPT, ModelConfig, build_model, count_parameters

torch.set_num_threads(1)

SMALL = ModelConfig(d_model=32, n_layer=2, n_head=4, seq_len=16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 100, "n_head": 3}, r"model\.d_model \(100\) must be divisible by model\.n_head \(3\)"),
        ({"vocab_size": 0}, r"model\.vocab_size"),
        ({"n_layer": 0}, r"model\.n_layer"),
        ({"seq_len": -1}, r"model\.seq_len"),
        ({"mlp_ratio": 0}, r"model\.mlp_ratio"),
        ({"dropout": 1.0}, r"model\.dropout"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_same_seed_same_weights_different_seed_different_weights() -> None:
    a, b, c = build_model(SMALL, seed=1), build_model(SMALL, seed=1), build_model(SMALL, seed=2)
    assert isinstance(a, GPT)
    for (name, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.numel() > 1 and pa.std() > 0:  # LayerNorm ones and zero biases are seed-independent
            assert not torch.equal(pa, pc), name


def test_build_model_leaves_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(SMALL, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tied_head_is_listed_once() -> None:
    model = build_model(SMALL, seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(set(names))
    assert sum("lm_head" in name for name in names) == 0
    ids = [id(p) for p in model.parameters()]
    assert len(ids) == len(set(ids))
    assert count_parameters(model) == sum(p.numel() for _, p in model.named_parameters())
    # Counted once: untied it would add vocab * d_model more.
    d, v, t, h = SMALL.d_model, SMALL.vocab_size, SMALL.seq_len, SMALL.mlp_ratio * SMALL.d_model
    per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    assert count_parameters(model) == v * d + t * d + SMALL.n_layer * per_block + 2 * d


def test_residual_projections_use_scaled_init() -> None:
    config = ModelConfig(d_model=64, n_layer=8, n_head=4, seq_len=16)
    model = build_model(config, seed=0)
    residual_std = model.blocks[0].attn.proj.weight.std().item()
    plain_std = model.blocks[0].attn.qkv.weight.std().item()
    assert plain_std == pytest.approx(0.02, rel=0.1)
    assert residual_std == pytest.approx(0.02 / math.sqrt(2 * config.n_layer), rel=0.1)


def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    model = build_model(SMALL, seed=0)
    idx, targets = torch.randint(0, 256, (2, 3, SMALL.seq_len), generator=torch.Generator().manual_seed(0))
    # Independent targets: with tied embeddings, targets == idx would score above chance.
    logits, loss = model(idx, targets)
    assert logits.shape == (3, SMALL.seq_len, 256)
    assert loss is not None and loss.dtype == torch.float32
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)
    _, no_loss = model(idx)
    assert no_loss is None


def test_forward_rejects_input_longer_than_context() -> None:
    model = build_model(SMALL, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_changing_a_future_token_does_not_change_earlier_logits() -> None:
    model = build_model(SMALL, seed=0).eval()
    idx = torch.randint(0, 256, (2, SMALL.seq_len), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    pos = 10
    changed[:, pos] = (changed[:, pos] + 1) % 256
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    torch.testing.assert_close(before[:, :pos], after[:, :pos])
    assert not torch.allclose(before[:, pos:], after[:, pos:])


def test_a_few_adamw_steps_reduce_loss_on_a_repeated_batch() -> None:
    model = build_model(SMALL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 256, (4, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(2))
    x, y = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(10):
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_bf16_autocast_forward_on_cpu() -> None:
    model = build_model(SMALL, seed=0)
    idx, targets = torch.randint(0, 256, (2, 2, SMALL.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, targets)
    assert logits.dtype == torch.bfloat16
    assert loss is not None and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(256), abs=0.2)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
