"""Fixtures for real swarms: a fresh run id, a temp dir, and a guarantee that no process
(node, DHT, averager, p2pd) outlives the test."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from node.library.cleanup import hivemind_sockets, remove_stale
from tests.integration.swarm import Swarm


@pytest.fixture
def swarm():
    root = Path(tempfile.mkdtemp(prefix="shoal-test-"))
    sockets_before = hivemind_sockets()
    swarm = Swarm(root, run_id=f"test-{uuid.uuid4().hex[:8]}")
    try:
        yield swarm
    finally:
        # A peer that exited by itself must have taken its DHT, averager and p2pd with it.
        exited = [peer for peer in swarm.peers if peer.proc.poll() is not None]
        time.sleep(0.5 if exited else 0)
        leaked = {peer.name: peer.leftovers() for peer in exited if peer.leftovers()}
        swarm.kill_all()
        remove_stale(hivemind_sockets() - sockets_before)  # peers killed with -9 cannot clean up
        shutil.rmtree(root, ignore_errors=True)
        assert not leaked, f"processes left behind by peers that exited: {leaked}"
