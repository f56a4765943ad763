"""The faults of a home machine, on real processes: the disk fills up under the checkpoints."""

from __future__ import annotations

import os
import subprocess

import pytest

from node.library.checkpoint import TMP_PREFIX, list_checkpoints, load_latest_valid
from node.observe.metrics import read_metrics
from tests.integration.swarm import TINY, every_round_checkpoints, rounds_of, wait_until

pytestmark = pytest.mark.integration


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.timeout(240)
def test_a_full_disk_costs_checkpoints_never_the_run(swarm):
    """A tmpfs with room for one checkpoint of the tiny model (~2 MB) under --checkpoint-dir: the
    first is written, the next ones fail with ENOSPC. The peer says so once, keeps the good one
    intact, leaves no staging files and trains every round to --max-rounds, exiting 0."""
    checkpoints = swarm.root / "alone" / "checkpoints"
    if not _mount_tmpfs(checkpoints, "3m"):
        pytest.skip("mounting a small tmpfs needs root (and a kernel that allows it here)")
    try:
        config = every_round_checkpoints(swarm.root / "tiny.toml", TINY)
        peer = swarm.start("alone", "--round-seconds", "4", "--max-rounds", "6", config=config)
        assert peer.wait(timeout=200) == 0, peer.log()[-3000:]
        log = peer.log()
        assert log.count("not written to") == 1, log[-3000:]
        assert "No space left on device" in log and "is kept and training goes on" in log
        kept = list_checkpoints(checkpoints)
        assert len(kept) == 1 and load_latest_valid(checkpoints).round == int(kept[0].name.split("-")[-1])
        assert not [p for p in checkpoints.iterdir() if p.name.startswith(TMP_PREFIX)]
        events = read_metrics(peer.metrics_path)
        failed = [e["round"] for e in events if e["event"] == "checkpoint_failed"]
        assert failed and max(rounds_of(peer)) == 6 and max(rounds_of(peer)) > failed[0]
        wait_until(lambda: peer.proc.poll() is not None, 10, "the peer did not exit")
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], capture_output=True)
