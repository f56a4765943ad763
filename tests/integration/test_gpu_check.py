"""``python -m benchmarks.micro.gpu_check --device cpu``: the reduced version of the GPU check, so the script a
GPU machine runs stays alive between the (rare) times one is lent. Real peers, real hivemind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.swarm import REPO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_the_reduced_gpu_check_runs_and_passes_on_cpu(tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.micro.gpu_check", "--device", "cpu", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["environment"]["device"] == "cpu"
    # 1. both loops trained and shoal's had rounds end while it ran
    over = report["overhead"]
    assert over["tokens_per_s"]["bare"] > 0 and over["tokens_per_s"]["shoal"] > 0 and over["rounds_during_shoal"] >= 1
    # 2. two real peers averaged and their anchors agree within the fp16 bound
    (swarm,) = report["swarms"]
    assert swarm["ok"] and all(p["averaged"] >= 1 for p in swarm["peers"].values())
    (pair,) = swarm["anchors"].values()
    assert pair["rms_diff"] <= swarm["relative_bound"] * pair["rms_moved"]
    # 3. the engine's snapshot and merge equal the CPU arithmetic bit for bit
    assert report["bit_identity"]["snapshot_bit_identical"] and report["bit_identity"]["merge_bit_identical"]
    # 3b. the inner optimizer's moments landed through InnerStateSync (on the CPU: the same arithmetic)
    assert report["inner_state"]["ok"] and report["inner_state"]["max_relative_error"] == 0.0
    # 4. transfer timings and the codecs were measured
    assert [t["numel"] for t in report["transfers"]] == [1_000_000, 10_000_000]
    assert report["codecs"]["int4"]["encode"] > 0
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check: cpu")
