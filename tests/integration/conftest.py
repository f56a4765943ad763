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
    proc = start_bootstrap(tmp_path, address_file)
    try:
        yield proc, address_file
    finally:
        stop_bootstrap(proc)


def start_bootstrap(tmp_path, address_file, listen: str = "/ip4/127.0.0.1/tcp/0",
                    log_name: str = "bootstrap.log") -> subprocess.Popen:
    """`shoal bootstrap` with the identity ``tmp_path/bootstrap.key`` (the same peer id on a restart)."""
    log = open(tmp_path / log_name, "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen([*shoal_command(), "bootstrap", "--listen", listen, "--identity",
                             str(tmp_path / "bootstrap.key"), "--address-file", str(address_file)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    return proc


def stop_bootstrap(proc: subprocess.Popen) -> None:
    """Ctrl+C, as a terminal would: a clean stop that leaves no p2pd behind; anything left is killed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            assert proc.wait(timeout=30) == 0
            assert not session_members(proc.pid), "the bootstrap peer left processes behind"
        finally:
            kill_process_group(proc)
