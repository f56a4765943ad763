"""The live dashboard as a person sees it: a node runs in a real terminal (tmux) next to a second
peer; the captured pane shows the swarm, the round and the peer table."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from examples.swarm_launcher import session_members, shoal_command
from tests.integration.swarm import REPO, TINY

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


@pytest.mark.timeout(240)
def test_dashboard_in_a_terminal(swarm, tmp_path):
    other = swarm.start("other", "--round-seconds", "6")
    address = other.wait_for_address()[:1]
    session = f"shoal-test-{uuid.uuid4().hex[:8]}"
    command = [*shoal_command(), "run", "--config", str(TINY), "--run-id", swarm.run_id, "--round-seconds", "6",
               "--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peer", address[0], "--max-rounds", "4"]
    log = tmp_path / "node.log"  # stderr only: the panel itself goes to the terminal
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "110", "-y", "45",
                    f"cd {shlex.quote(str(REPO))} && exec {shlex.join(command)} 2>{shlex.quote(str(log))}"], check=True)
    subprocess.run(["tmux", "set-option", "-t", session, "remain-on-exit", "on"], capture_output=True)
    pane_pid = int(subprocess.run(["tmux", "display-message", "-p", "-t", session, "#{pane_pid}"],
                                  capture_output=True, text=True, check=True).stdout)
    try:
        deadline, screen = time.time() + 150, ""
        while time.time() < deadline:
            screen = capture(session)
            if "2 peers online" in screen and "merged" in screen:
                break
            time.sleep(1)
        print(screen)
        assert "2 peers online" in screen, screen + (log.read_text()[-3000:] if log.exists() else "")  # the swarm section: both peers
        assert "round" in screen and "merged" in screen, screen  # a round whose average landed
        assert other.maddrs[0].split("/p2p/")[1][-6:] in screen, screen  # the other peer in the table
    finally:
        try:
            os.killpg(pane_pid, signal.SIGINT)  # Ctrl+C, as the person would (tmux made it a group leader)
        except ProcessLookupError:
            pass
        deadline = time.time() + 40
        while [p for p in session_members(pane_pid) if p != pane_pid] and time.time() < deadline:
            time.sleep(0.5)
        leftovers = [p for p in session_members(pane_pid) if p != pane_pid]  # the pane itself may linger, dead
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not leftovers, "the node left processes behind after Ctrl+C"
