"""The demo script, reduced. (Ctrl+C in a terminal, SIGINT to a peer's whole process group, is
checked in test_public_swarm and test_examples, with the swarms they start anyway.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from node.observe.metrics import read_metrics
from tests.integration.swarm import REPO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_demo_script_runs_to_completion(tmp_path):
    """`make demo` in reduced form: 2 peers, 2 short rounds, no live view (no terminal here)."""
    result = subprocess.run(
        [sys.executable, "examples/local_swarm.py", "--no-ui", "--peers", "2", "--rounds", "3",
         "--round-seconds", "6", "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "eval_loss" in result.stdout
    rounds = [r for r in read_metrics(tmp_path / "peer-1" / "metrics.jsonl") if r["event"] == "round"]
    assert rounds and rounds[-1]["round"] == 3
