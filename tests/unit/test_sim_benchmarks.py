"""The simulators that drive the engine's round through ``benchmarks.sim.swarm``: ``lr_sweep.run_diloco``
and ``codec_learning.run_variant`` on a tiny model, two rounds each."""

import dataclasses
import math

import pytest

from averaging.math.wire import WireFormat
from benchmarks.common.results import CONFIGS
from benchmarks.sim import codec_learning, lr_sweep
from benchmarks.sim import peers as sim
from node.process.config import load_config
from node.training.data import eval_batches, load_corpus, split_corpus

TINY = {"model.d_model": 16, "model.n_layer": 1, "model.seq_len": 16, "data.batch_size": 4,
        "data.max_corpus_bytes": 200_000, "train.eval_batches": 2}
ROUNDS = 2


@pytest.fixture(scope="module")
def tiny_data():
    """``sim.DATA`` for the tiny model (restored afterwards: it is the module's per-process state)."""
    saved = dict(sim.DATA)
    sim.setup(str(CONFIGS / "learning.toml"), ROUNDS, TINY)
    yield sim.DATA
    sim.DATA.clear()
    sim.DATA.update(saved)


def _diloco(outer_lr: float, delay: int | None) -> dict:
    return lr_sweep.run_diloco(seed=0, peers=2, rounds=ROUNDS, inner_steps=2, lr=0.006, outer_lr=outer_lr, mu=0.5,
                               delay=delay)


def test_lr_sweep_runs_the_outer_step_it_is_given(tiny_data):
    blocking = _diloco(1.0, None)
    assert [r for r, _ in blocking["curve"]] == [ROUNDS] and math.isfinite(blocking["final_eval"])
    assert _diloco(0.5, None)["final_eval"] != blocking["final_eval"]
    overlap = _diloco(1.0, 1)  # the merge lands one step into the next round
    assert math.isfinite(overlap["final_eval"]) and overlap["final_eval"] != blocking["final_eval"]


def _variant(name: str, outer_lr: float = 1.0) -> dict:
    config = load_config(CONFIGS / "bench.toml", TINY)
    config = dataclasses.replace(config, inner=dataclasses.replace(config.inner, total_rounds=float(ROUNDS)),
                                 outer=dataclasses.replace(config.outer, lr=outer_lr))
    split = split_corpus(load_corpus(config.data), config.data.eval_fraction, config.data.max_eval_bytes,
                         block_bytes=config.data.eval_block_bytes)
    evals = eval_batches(split.eval, config.model.seq_len, config.data.batch_size, config.train.eval_batches)
    (code, feedback, returns), = [v[1:] for v in codec_learning.VARIANTS if v[0] == name]
    wire = WireFormat.of(code, return_compression=returns, error_feedback=feedback)
    return codec_learning.run_variant(config, split, evals, wire, seed=0, peers=2, rounds=ROUNDS, inner_steps=2)


def test_codec_learning_runs_each_wire_format():
    fp16 = _variant("fp16")
    assert math.isfinite(fp16["final_eval"]) and fp16["anchor_moved"] > 0
    assert _variant("fp16", outer_lr=0.5)["final_eval"] != fp16["final_eval"]
    int4 = _variant("int4+EF+ret4")
    assert math.isfinite(int4["final_eval"]) and int4["final_eval"] != fp16["final_eval"]
    assert int4["anchor_drift"] == 0.0  # int4 returns: every member steps with the same quantized average
