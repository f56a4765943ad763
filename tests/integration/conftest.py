"""Fixtures for real swarms: a fresh run id, a temp dir, and a guarantee that no process
(node, DHT, averager, p2pd) outlives the test."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from node.sockets import hivemind_sockets, remove_stale
from tests.integration.swarm import Swarm, p2pd_pids


@pytest.fixture
def swarm():
    root = Path(tempfile.mkdtemp(prefix="shoal-test-"))
    before, sockets_before = p2pd_pids(), hivemind_sockets()
    swarm = Swarm(root, run_id=f"test-{uuid.uuid4().hex[:8]}")
    try:
        yield swarm
    finally:
        swarm.kill_all()
        deadline = time.time() + 10
        while p2pd_pids() - before and time.time() < deadline:
            time.sleep(0.2)
        leaked = p2pd_pids() - before
        remove_stale(hivemind_sockets() - sockets_before)  # peers killed with -9 cannot clean up
        shutil.rmtree(root, ignore_errors=True)
        assert not leaked, f"p2pd processes left behind: {leaked}"
