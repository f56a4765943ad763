"""Leaving: Ctrl+C in a terminal (SIGINT to the whole process group) and the demo script."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from node.library.checkpoint import load_latest_valid
from node.observe.metrics import read_metrics
from tests.integration.swarm import REPO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_ctrl_c_leaves_cleanly_with_a_checkpoint(swarm):
    peer = swarm.start("a", "--round-seconds", "5")
    peer.wait_for_address()
    deadline = time.time() + 90
    while not any(r["event"] == "round" for r in read_metrics(peer.metrics_path)) and time.time() < deadline:
        time.sleep(0.5)
    # A terminal's Ctrl+C reaches the node, its hivemind children and p2pd alike.
    os.killpg(peer.proc.pid, signal.SIGINT)
    assert peer.wait(timeout=60) == 0, peer.log()[-3000:]
    checkpoint = load_latest_valid(peer.checkpoint_dir)
    assert checkpoint is not None and checkpoint.round >= 1
    exit_record = read_metrics(peer.metrics_path)[-1]
    assert exit_record["event"] == "exit" and exit_record["reason"] == "interrupted"
    assert not peer.leftovers()


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
