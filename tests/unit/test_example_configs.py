"""Every example config loads, builds the model its header promises, and (for the 4090 config)
carries size estimates that still match the model it builds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from node.process.config import EXAMPLES_DIR, RunConfig, load_config
from node.training.model import build_model, count_parameters

CONFIGS = sorted(EXAMPLES_DIR.glob("*.toml"))
RTX4090 = EXAMPLES_DIR / "rtx4090-125m.toml"
UNITS = {"k": 1e3, "M": 1e6, "B": 1e9}


def parameters(config: RunConfig) -> int:
    # On the meta device: the real architecture and parameter count, without allocating 0.5 GB.
    with torch.device("meta"):
        return count_parameters(build_model(config.model, seed=config.train.seed))


def stated_size(path: Path) -> float:
    """The size a config's header states, e.g. "~25M parameters" or "A ~100k-parameter GPT"."""
    match = re.search(r"~\s*([\d.]+)\s*([kMB])[- ]param", path.read_text())
    assert match, f"{path.name}: the header should state the model size, e.g. '~25M parameters'"
    return float(match.group(1)) * UNITS[match.group(2)]


def test_the_examples_include_the_4090_config():
    assert RTX4090 in CONFIGS and len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_builds_the_stated_size(path):
    config = load_config(path)
    assert config.run_id == path.read_text().split('run_id = "')[1].split('"')[0]
    count = parameters(config)
    stated = stated_size(path)
    # "~" is loose (tiny.toml's ~100k builds 120,576), but not a different model.
    assert 0.8 * stated <= count <= 1.25 * stated, f"{path.name} states ~{stated:,.0f} parameters, builds {count:,}"


def test_4090_config_estimates_match_its_model():
    """The header's numbers are derived from formulas; recompute them from the model the file
    builds, so that editing [model] or batch_size without updating the comments fails here."""
    config = load_config(RTX4090)
    text = RTX4090.read_text()
    params = parameters(config)
    model, batch = config.model, config.data.batch_size
    gb = 1e9
    expected = {
        "exact count": f"{params:,}",
        "GPU states (16 B/param)": f"= {16 * params / gb:.2f} GB",
        "activations (34 x seq x batch x width per block)":
            f"= {34 * model.seq_len * batch * model.d_model * model.n_layer / gb:.2f} GB",
        "bf16 weight copies": f"({2 * params / gb:.2f} GB)",
        "anchor + momentum (8 B/param)": f"= {8 * params / gb:.2f} GB",
        "snapshot": f"({4 * params / gb:.2f} GB)",
        "6N tokens/s at 66 TFLOPS": f"~{round(66e12 / (6 * params) / 1e3)}k tokens/s",
        "with attention FLOPs":
            f"~{round(66e12 / (6 * params + 12 * model.n_layer * model.seq_len * model.d_model) / 1e3)}k tokens/s",
        "fp16 pseudo-gradient": f"{round(2 * params / 1e6)} MB in fp16",
        "bytes per step": f"{batch * model.seq_len:,} bytes per inner step",
    }
    missing = {what: value for what, value in expected.items() if value not in text}
    assert not missing, f"update the estimates in {RTX4090.name}: {missing}"
    assert 115e6 <= params <= 135e6
    assert config.train.precision == "bf16" and config.train.device == "cuda"
    assert config.round.seconds > config.averaging.allreduce_timeout  # the all-reduce fits in a round
