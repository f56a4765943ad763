"""Resume: a checkpoint written from an outer state comes back as the same state, or is refused."""

from __future__ import annotations

import json

import pytest
import torch

from averaging.math.flat import FlatLayout
from averaging.math.outer_step import OuterConfig
from averaging.state.shared_state import SharedState
from node.library.checkpoint import save_checkpoint
from node.library.resume import MOMENTUM_PREFIX, find_resume_point, outer_meta, state_from_checkpoint
from protocols.errors import CheckpointError, ConfigError
from protocols.messages import MessageError

SHAPES = {"w": (4, 3), "b": (3,)}
LAYOUT = FlatLayout.of([(name, torch.zeros(shape)) for name, shape in SHAPES.items()])


def trained_state(seed: int = 0) -> SharedState:
    torch.manual_seed(seed)
    state = SharedState(LAYOUT, torch.randn(LAYOUT.numel), OuterConfig())
    for round in (1, 2, 3):
        state.apply(torch.randn(LAYOUT.numel) * 0.01, round=round)
    return state


def save(state: SharedState, directory, *, run_id="run", config_hash="abc", round=None):
    metadata, (anchor, momentum) = state.shared_state()
    return save_checkpoint(directory, round=metadata["round"] if round is None else round,
                           params=dict(LAYOUT.views(anchor)),
                           outer_state={f"{MOMENTUM_PREFIX}{k}": v for k, v in LAYOUT.views(momentum).items()},
                           meta={"run_id": run_id, "config_hash": config_hash, "outer": outer_meta(metadata)})


def fresh() -> SharedState:
    return SharedState(LAYOUT, torch.zeros(LAYOUT.numel), OuterConfig())


def test_round_trip_restores_anchor_momentum_counters_and_claim(tmp_path):
    original = trained_state()
    save(original, tmp_path)
    checkpoint = find_resume_point(tmp_path, on_invalid=pytest.fail)
    restored = fresh()
    assert restored.adopt(state_from_checkpoint(checkpoint, LAYOUT, run_id="run", config_hash="abc")) == 3
    assert torch.equal(restored.anchor, original.anchor) and torch.equal(restored.momentum, original.momentum)
    assert (restored.last_round, restored.rounds_done) == (3, 3)
    # the consistency claim (fingerprint + scale) is what the group compares: it must match too
    assert restored.claim_message(round=4) == original.claim_message(round=4)


def test_a_truncated_newest_checkpoint_is_named_and_the_older_one_used(tmp_path):
    save(trained_state(), tmp_path, round=2)
    newest = save(trained_state(1), tmp_path, round=3)
    model = newest / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    reported = []
    checkpoint = find_resume_point(tmp_path, on_invalid=reported.append)
    assert checkpoint.round == 2
    assert len(reported) == 1 and str(model) in str(reported[0]) and "truncated" in str(reported[0])


def test_only_broken_checkpoints_is_an_error_not_a_silent_fresh_start(tmp_path):
    newest = save(trained_state(), tmp_path)
    (newest / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="no valid checkpoint in .*delete the broken ones"):
        find_resume_point(tmp_path, on_invalid=lambda e: None)
    assert find_resume_point(tmp_path / "empty", on_invalid=pytest.fail) is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"run_id": "other"}, "belongs to run 'other'"),
    ({"config_hash": "zzz"}, "written with another config"),
])
def test_checkpoints_of_another_run_or_config_are_refused(tmp_path, kwargs, message):
    save(trained_state(), tmp_path, **kwargs)
    checkpoint = find_resume_point(tmp_path, on_invalid=pytest.fail)
    with pytest.raises(ConfigError, match=message):
        state_from_checkpoint(checkpoint, LAYOUT, run_id="run", config_hash="abc")


def test_a_checkpoint_of_another_model_shape_is_refused(tmp_path):
    save(trained_state(), tmp_path)
    checkpoint = find_resume_point(tmp_path, on_invalid=pytest.fail)
    other = FlatLayout.of([("w", torch.zeros(3, 4)), ("b", torch.zeros(3))])  # same numel, other shape
    with pytest.raises(ConfigError, match="tensor w has shape"):
        state_from_checkpoint(checkpoint, other, run_id="run", config_hash="abc")
    bigger = FlatLayout.of([("w", torch.zeros(4, 3)), ("b", torch.zeros(3)), ("c", torch.zeros(2))])
    with pytest.raises(ConfigError, match="missing \\['c'\\]"):
        state_from_checkpoint(checkpoint, bigger, run_id="run", config_hash="abc")


def test_non_finite_values_in_a_verified_checkpoint_are_refused_by_adopt(tmp_path):
    state = trained_state()
    state.anchor[0] = float("nan")  # e.g. a diverged run saved before anyone noticed
    save(state, tmp_path)
    resumed = state_from_checkpoint(find_resume_point(tmp_path, on_invalid=pytest.fail), LAYOUT, run_id="run",
                                    config_hash="abc")
    target = fresh()
    with pytest.raises(MessageError, match="non-finite"):
        target.adopt(resumed)
    assert torch.equal(target.anchor, torch.zeros(LAYOUT.numel))  # nothing half-applied


def test_meta_without_outer_state_cannot_be_resumed(tmp_path):
    path = save(trained_state(), tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    del meta["outer"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="no outer state"):
        state_from_checkpoint(find_resume_point(tmp_path, on_invalid=pytest.fail), LAYOUT, run_id="run",
                              config_hash="abc")
