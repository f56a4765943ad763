"""Fixtures for real swarms: a fresh run id, a temp dir, and a guarantee that no process
(node, DHT, averager, p2pd) outlives the test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from examples.swarm_launcher import kill_process_group, session_members
from node.library.cleanup import hivemind_sockets, remove_stale
from tests.integration.swarm import REPO, Swarm, shoal_command


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
        if os.environ.get("SHOAL_KEEP_SWARM"):  # to read the peers' logs after a failure
            print(f"swarm kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        assert not leaked, f"processes left behind by peers that exited: {leaked}"


@pytest.fixture
def bootstrap(tmp_path):
    """A real `shoal bootstrap` entry peer writing its address file; stopped with Ctrl+C, which must
    leave no process behind."""
    address_file = tmp_path / "bootstrap.maddr"
    log = open(tmp_path / "bootstrap.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen([*shoal_command(), "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity",
                             str(tmp_path / "bootstrap.key"), "--address-file", str(address_file)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    try:
        yield proc, address_file
    finally:
        if proc.poll() is None:  # a clean stop first: it must leave no p2pd behind
            os.killpg(proc.pid, signal.SIGINT)
            try:
                assert proc.wait(timeout=30) == 0
                assert not session_members(proc.pid), "the bootstrap peer left processes behind"
            finally:
                kill_process_group(proc)
