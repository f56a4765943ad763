"""Fixtures for real swarms: a fresh run id, a temp dir, and a guarantee that no process
(node, DHT, averager, p2pd) outlives the test."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from examples.swarm_launcher import kill_process_group, session_members
from tests.integration.swarm import REPO, fresh_swarm, shoal_command


@pytest.fixture
def swarm():
    with fresh_swarm() as swarm:
        yield swarm


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
