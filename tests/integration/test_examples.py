"""The examples run as documented, reduced to a couple of short rounds, and leave no process behind.

Every process a test starts carries a marker in its environment (children and p2pd inherit it), so
the leak check and the clean-up find exactly this test's processes, even those that moved to their
own session, and never another test's swarm running on the same machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from node.observe.metrics import read_metrics
from tests.integration.swarm import REPO

pytestmark = pytest.mark.integration

MARKER_VAR = "SHOAL_EXAMPLE_TEST"


def marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_VAR) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def marker():
    """A marker for this test's processes; whatever still carries it at the end is killed."""
    value = uuid.uuid4().hex
    yield value
    for proc in marked(value):
        try:
            proc.kill()
        except psutil.Error:
            pass


def assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 5  # p2pd may take a moment to notice its parent left
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


def logs(workdir) -> str:
    """The end of every peer's log under a local_swarm.sh work dir, for failure messages."""
    return "".join(f"\n--- {log.parent.name}:\n{log.read_text(errors='replace')[-2000:]}"
                   for log in sorted(workdir.glob("*/log.txt")))


def env_with(marker: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", MARKER_VAR: marker, **extra}


@pytest.mark.timeout(200)
def test_local_swarm_sh_trains_then_ctrl_c_leaves_cleanly(tmp_path, marker):
    """`examples/local_swarm.sh` with 2 peers: they find each other through the bootstrap's address
    file and average; a terminal's Ctrl+C (to the script's process group) makes every peer leave
    with a checkpoint, the script prints its summary and exits 0, and nothing is left running."""
    env = env_with(marker, PEERS="2", ROUNDS="50", ROUND_SECONDS="5", WORKDIR=str(tmp_path),
                   SHOAL=f"{sys.executable} -m node.cli", RUN_ID=f"test-sh-{marker[:8]}")
    # A terminal gives the script SIGINT at its default; this test may itself run with SIGINT
    # ignored (a CI job started in the background), and bash cannot trap a signal ignored on entry.
    script = subprocess.Popen(["bash", "examples/local_swarm.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = [tmp_path / peer / "metrics.jsonl" for peer in ("peer-1", "peer-2")]

    def averaged(path) -> bool:
        return path.exists() and any(r["event"] == "round" and r["group_size"] == 2 for r in read_metrics(path))

    output = ""
    try:
        deadline = time.monotonic() + 120
        while not all(averaged(path) for path in metrics):
            assert time.monotonic() < deadline, "the two peers never averaged together" + logs(tmp_path)
            assert script.poll() is None, script.stdout.read() + logs(tmp_path)
            time.sleep(0.5)
        os.killpg(script.pid, signal.SIGINT)  # what Ctrl+C in the terminal does
        try:
            output, _ = script.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the script did not exit within 60 s of Ctrl+C; peers:\n"
                        + "\n".join(f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in marked(marker)) + logs(tmp_path))
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()
    assert script.returncode == 0, output[-3000:] + logs(tmp_path)
    assert "left processes behind" not in output
    assert re.search(r"peer-1\s+\d+", output), output  # the summary table
    for path in metrics:
        exit_record = read_metrics(path)[-1]
        assert exit_record["event"] == "exit" and exit_record["reason"] == "interrupted", exit_record
        assert list((path.parent / "checkpoints").glob("round-*")), "no checkpoint written at Ctrl+C"
    assert_nothing_left(marker)


@pytest.mark.wall_clock  # two small MLPs waiting on rounds: run beside the unit tests
@pytest.mark.timeout(150)
def test_bring_your_own_model_two_peers(tmp_path, marker):
    """Two copies of the library-API example, the second joining the first: both average and exit 0."""
    env = env_with(marker)
    run_id = f"test-byo-{marker[:8]}"
    # Rounds follow the first peer's schedule: 4 x 6 s leave the second copy time to start and join.
    args = [sys.executable, "examples/bring_your_own_model.py", "--rounds", "4", "--round-seconds", "6",
            "--run-id", run_id]
    logs = [tmp_path / "first.txt", tmp_path / "second.txt"]
    procs: list[subprocess.Popen] = []
    try:
        with open(logs[0], "w") as log:
            procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + 60
        while not (join := re.search(r"to join: (.*)", logs[0].read_text())):
            assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        with open(logs[1], "w") as log:
            procs.append(subprocess.Popen([*args, *join.group(1).split()], cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    for output in outputs:
        assert re.search(r"^round \d+: group of \d+", output, re.M), output[-3000:]
    assert any(re.search(r"group of 2, averaged", output) for output in outputs), "\n---\n".join(outputs)
    assert_nothing_left(marker)
