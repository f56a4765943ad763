import json
import os

import pytest
import torch

from node.library.checkpoint import (
    META_FILE,
    MODEL_FILE,
    OUTER_FILE,
    list_checkpoints,
    load_checkpoint,
    load_latest_valid,
    save_checkpoint,
)
from protocols.errors import CheckpointError
from protocols.version import shoal_version


def make_state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(4, 6, generator=gen)
    params = {
        "layer.weight": weight.t(),  # non-contiguous on purpose
        "layer.bias": torch.randn(4, generator=gen, dtype=torch.float64),
        "embed.weight": torch.randn(3, 2, generator=gen).to(torch.bfloat16),
    }
    outer = {f"momentum.{name}": torch.full_like(t, float(seed)) for name, t in params.items()}
    return params, outer


def save(tmp_path, round, seed=0, keep_last=3, **meta):
    params, outer = make_state(seed)
    return save_checkpoint(
        tmp_path, round=round, params=params, outer_state=outer, meta=meta, keep_last=keep_last
    )


def assert_tensors_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype
        assert actual[name].shape == tensor.shape
        assert torch.equal(actual[name], tensor), name


def test_round_trip_keeps_tensors_meta_and_extras(tmp_path):
    params, outer = make_state(7)
    path = save_checkpoint(
        tmp_path,
        round=12,
        params=params,
        outer_state=outer,
        meta={"run_id": "run-a", "tokens_seen": 1234, "peers": ["a", "b"]},
    )
    assert path == tmp_path / "round-00000012"
    assert sorted(p.name for p in path.iterdir()) == sorted([MODEL_FILE, OUTER_FILE, META_FILE])

    ckpt = load_checkpoint(path)
    assert ckpt.round == 12
    assert_tensors_equal(ckpt.params, params)
    assert_tensors_equal(ckpt.outer_state, outer)
    assert ckpt.meta["run_id"] == "run-a"
    assert ckpt.meta["tokens_seen"] == 1234
    assert ckpt.meta["peers"] == ["a", "b"]
    assert ckpt.meta["shoal_version"] == shoal_version()
    assert isinstance(ckpt.meta["created"], float)
    for name in (MODEL_FILE, OUTER_FILE):
        assert ckpt.meta["files"][name]["size"] == (path / name).stat().st_size
        assert len(ckpt.meta["files"][name]["sha256"]) == 64


def test_tied_weights_are_saved(tmp_path):
    # Tied input/output embeddings share storage; safetensors refuses that unless we copy.
    embed = torch.randn(5, 3)
    params = {"embed.weight": embed, "lm_head.weight": embed, "view": embed[1:3]}
    path = save_checkpoint(tmp_path, round=1, params=params, outer_state={}, meta={})
    ckpt = load_checkpoint(path)
    assert_tensors_equal(ckpt.params, params)
    assert ckpt.outer_state == {}


def test_reserved_meta_keys_are_refused(tmp_path):
    params, outer = make_state(0)
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path, round=1, params=params, outer_state=outer, meta={"files": {}})
    assert list_checkpoints(tmp_path) == []


def test_keep_last_prunes_oldest(tmp_path):
    for r in [1, 2, 3, 4, 5]:
        save(tmp_path, r, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00000005", "round-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-00000004", "round-00000005"]


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    for r in [8, 9, 10]:
        save(tmp_path, r, keep_last=3)
    path = save(tmp_path, 5, keep_last=3)  # resumed from an older round
    assert path.exists()
    load_checkpoint(path)


def test_saving_same_round_replaces_it(tmp_path):
    save(tmp_path, 3, seed=1)
    path = save(tmp_path, 3, seed=2)
    _, outer = make_state(2)
    assert_tensors_equal(load_checkpoint(path).outer_state, outer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-00000003"]


def test_list_ignores_tmp_dirs_and_junk_and_sorts_numerically(tmp_path):
    for r in [9, 10, 100]:
        save(tmp_path, r, keep_last=10)
    (tmp_path / ".tmp-round-00000200-abc").mkdir()
    (tmp_path / "round-notanumber").mkdir()
    (tmp_path / "round-00000300").write_text("a file, not a dir")
    (tmp_path / "notes.txt").write_text("hi")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "round-00000100",
        "round-00000010",
        "round-00000009",
    ]
    assert list_checkpoints(tmp_path / "does-not-exist") == []


def test_leftover_tmp_dir_is_ignored_then_cleaned_by_next_save(tmp_path):
    good = save(tmp_path, 1)
    # A crash mid-save leaves a half-written temp dir of a *newer* round.
    crashed = tmp_path / ".tmp-round-00000002-x1y2"
    crashed.mkdir()
    (crashed / MODEL_FILE).write_bytes(b"\x00" * 10)
    assert load_latest_valid(tmp_path).path == good
    save(tmp_path, 3)
    assert not crashed.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_truncated_file_names_the_file(tmp_path):
    path = save(tmp_path, 12)
    model = path / MODEL_FILE
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    message = str(excinfo.value)
    assert str(model) in message and "truncated" in message
    assert "\n" not in message
    assert excinfo.value.exit_code == 5


def test_flipped_byte_is_a_sha256_mismatch(tmp_path):
    path = save(tmp_path, 12)
    outer = path / OUTER_FILE
    data = bytearray(outer.read_bytes())
    data[-1] ^= 0x01  # inside tensor data: safetensors itself would load this happily
    outer.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch") as excinfo:
        load_checkpoint(path)
    assert str(outer) in str(excinfo.value)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: (p / META_FILE).unlink(), "missing"),
        (lambda p: (p / META_FILE).write_text("{not json"), "JSON"),
        (lambda p: (p / META_FILE).write_text("[1, 2]"), "not a JSON object"),
        (lambda p: (p / MODEL_FILE).unlink(), "missing"),
    ],
)
def test_other_damage_is_a_checkpoint_error(tmp_path, damage, expected):
    path = save(tmp_path, 4)
    damage(path)
    with pytest.raises(CheckpointError, match=expected) as excinfo:
        load_checkpoint(path)
    assert str(path) in str(excinfo.value)


def test_meta_without_file_hashes_is_rejected(tmp_path):
    path = save(tmp_path, 4)
    meta = json.loads((path / META_FILE).read_text())
    del meta["files"][OUTER_FILE]
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=OUTER_FILE):
        load_checkpoint(path)


def test_load_latest_valid_falls_back_and_reports(tmp_path):
    older = save(tmp_path, 1, seed=1)
    newest = save(tmp_path, 2, seed=2)
    with open(newest / MODEL_FILE, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    reported: list[CheckpointError] = []
    ckpt = load_latest_valid(tmp_path, on_invalid=reported.append)
    assert ckpt is not None and ckpt.path == older and ckpt.round == 1
    assert len(reported) == 1 and str(newest / MODEL_FILE) in str(reported[0])
    params, _ = make_state(1)
    assert_tensors_equal(ckpt.params, params)


def test_load_latest_valid_none_when_nothing_usable(tmp_path):
    assert load_latest_valid(tmp_path) is None
    path = save(tmp_path, 1)
    (path / META_FILE).write_text("")
    reported = []
    assert load_latest_valid(tmp_path, on_invalid=reported.append) is None
    assert len(reported) == 1


def test_failed_save_leaves_nothing_behind(tmp_path):
    good = save(tmp_path, 1)
    params, outer = make_state(0)
    params["bad"] = "not a tensor"
    with pytest.raises(AttributeError):
        save_checkpoint(tmp_path, round=2, params=params, outer_state=outer, meta={})
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_inner_optimizer_resumes_bit_exactly(tmp_path, optimizer):
    """Train, checkpoint (with the inner AdamW or Muon state), resume into a fresh trainer: the next
    steps of both are identical to the bit, as if the peer had never stopped."""
    from node.training.config import InnerConfig, TrainConfig
    from node.training.model import ModelConfig, build_model
    from node.training.trainer import Trainer

    config = ModelConfig(d_model=32, n_layer=1, n_head=2, seq_len=16)
    batches = [torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    original = Trainer(build_model(config, seed=0), InnerConfig(optimizer=optimizer), TrainConfig(), torch.device("cpu"))
    for batch in batches[:3]:
        original.inner_step(batch[:, :-1], batch[:, 1:], lr=1e-3)
    params = {n: p.detach().clone() for n, p in original.model.named_parameters()}
    path = save_checkpoint(tmp_path, round=1, params=params, outer_state={"momentum.x": torch.zeros(1)},
                           meta={"run_id": "r"}, local_state=original.inner_state())
    resumed = Trainer(build_model(config, seed=1), InnerConfig(optimizer=optimizer), TrainConfig(), torch.device("cpu"))
    checkpoint = load_checkpoint(path)
    with torch.no_grad():
        for name, param in resumed.model.named_parameters():
            param.copy_(checkpoint.params[name])
    resumed.load_inner_state(checkpoint.local_state)
    for batch in batches[3:]:
        original.inner_step(batch[:, :-1], batch[:, 1:], lr=1e-3)
        resumed.inner_step(batch[:, :-1], batch[:, 1:], lr=1e-3)
    for (name, a), (_, b) in zip(original.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    # Without the state, a restarted optimizer would have diverged (the test can fail):
    fresh = Trainer(build_model(config, seed=1), InnerConfig(optimizer=optimizer), TrainConfig(), torch.device("cpu"))
    with torch.no_grad():
        for name, param in fresh.model.named_parameters():
            param.copy_(checkpoint.params[name])
    fresh.inner_step(batches[3][:, :-1], batches[3][:, 1:], lr=1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), resumed.model.parameters()))


def test_an_inner_state_for_another_model_is_refused(tmp_path):
    from node.training.config import InnerConfig, TrainConfig
    from node.training.model import ModelConfig, build_model
    from node.training.trainer import Trainer

    trainer = Trainer(build_model(ModelConfig(d_model=32, n_layer=1, n_head=2, seq_len=16), seed=0), InnerConfig(),
                      TrainConfig(), torch.device("cpu"))
    batch = torch.randint(0, 256, (2, 17))
    trainer.inner_step(batch[:, :-1], batch[:, 1:], lr=1e-3)
    state = trainer.inner_state()
    with pytest.raises(CheckpointError, match="does not belong"):
        trainer.load_inner_state({**state, "nope.exp_avg": torch.zeros(1)})
    name = next(k for k in state if k.endswith("exp_avg"))
    with pytest.raises(CheckpointError, match="has shape"):
        trainer.load_inner_state({**state, name: torch.zeros(3)})
    with pytest.raises(CheckpointError, match="incomplete"):
        trainer.load_inner_state({k: v for k, v in state.items() if not k.endswith(".step")})


def test_an_inner_state_of_another_optimizer_is_refused():
    """A checkpoint written with AdamW resumed under inner.optimizer = "muon" (or back) names the
    mismatch instead of loading moments that mean something else."""
    from node.training.config import InnerConfig, TrainConfig
    from node.training.model import ModelConfig, build_model
    from node.training.trainer import Trainer

    config, batch = ModelConfig(d_model=32, n_layer=1, n_head=2, seq_len=16), torch.randint(0, 256, (2, 17))
    trainers = {}
    for optimizer in ("adamw", "muon"):
        trainers[optimizer] = Trainer(build_model(config, seed=0), InnerConfig(optimizer=optimizer), TrainConfig(),
                                      torch.device("cpu"))
        trainers[optimizer].inner_step(batch[:, :-1], batch[:, 1:], lr=1e-3)
    assert any(k.endswith(".momentum_buffer") for k in trainers["muon"].inner_state())
    with pytest.raises(CheckpointError, match="another inner.optimizer"):
        trainers["muon"].load_inner_state(trainers["adamw"].inner_state())
    with pytest.raises(CheckpointError, match="another inner.optimizer"):
        trainers["adamw"].load_inner_state(trainers["muon"].inner_state())
