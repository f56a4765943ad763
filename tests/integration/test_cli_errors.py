"""Bad input gets one clear line and a non-zero exit code, never a traceback or a hang."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import traceback

import pytest
import torch

from examples.swarm_launcher import kill_process_group, session_members
from tests.integration.swarm import REPO, shoal_command

# Short-lived processes, mostly waiting on timeouts: run beside the unit tests (scripts/run-suite.sh).
pytestmark = [pytest.mark.integration, pytest.mark.wall_clock]

VALID_PEER_ID = "12D3KooWNSgyp7Jk9sKE6bQqBHmCKDCX6ayX3cFHpLdcFWUy56Sd"


def shoal(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run ``shoal`` in its own session and check that nothing of it (DHT, averager, p2pd) outlives it."""
    proc = subprocess.Popen([*shoal_command(), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        leftovers = session_members(proc.pid)
        kill_process_group(proc)
    assert not leftovers, f"processes left behind: {leftovers}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def shoal_forked(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the real ``shoal`` CLI in a forked child of this process, in its own session.

    For errors raised before any network process starts (flags, addresses, config): the child
    shares this process's already-imported torch and hivemind, which saves the ~4 s interpreter
    start-up per case on CI's two cores. It is still a separate process with its own exit code,
    stdout and stderr, and it is checked for leftovers like ``shoal``'s."""
    import node.cli

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            os.setsid()
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            try:
                node.cli.app(args=list(args), prog_name="shoal")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - report, never fall back into pytest
            traceback.print_exc()
            code = 70
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    outputs: dict[int, bytes] = {out_r: b"", err_r: b""}
    deadline = time.monotonic() + timeout
    open_fds = [out_r, err_r]
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(open_fds, [], [], 0.5)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                outputs[fd] += chunk
            else:
                open_fds.remove(fd)
                os.close(fd)
    for fd in open_fds:
        os.close(fd)
    timed_out = bool(open_fds)
    if timed_out:
        os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    leftovers = session_members(pid)
    for member in leftovers:
        os.kill(member, signal.SIGKILL)
    assert not timed_out, f"shoal {' '.join(args)} did not exit within {timeout}s"
    assert not leftovers, f"processes left behind: {leftovers}"
    return subprocess.CompletedProcess(["shoal", *args], os.waitstatus_to_exitcode(status),
                                       outputs[out_r].decode(errors="replace"), outputs[err_r].decode(errors="replace"))


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize(
    ("address", "needle"),
    [
        ("/ip4/1.2.3/tcp/31337", "not a valid multiaddr"),
        ("/ip4/127.0.0.1/tcp/31337", "/p2p/"),
        ("127.0.0.1:31337", "127.0.0.1:31337"),
        (f"/ip4/127.0.0.1/tcp/31337/p2p/{VALID_PEER_ID[:-3]}", "peer id"),
    ],
)
def test_bad_initial_peer_is_named(address, needle):
    result = shoal_forked("run", "--no-ui", "--initial-peer", address)
    assert_one_line_error(result, 3, "--initial-peer", needle)


def test_bad_listen_address_is_named():
    assert_one_line_error(shoal_forked("run", "--no-ui", "--listen", "/ip4/127.0.0.1/tcpx/0"), 3, "--listen")


def test_unreachable_bootstrap_peer_fails_fast_and_cleanly(tmp_path):
    started = time.monotonic()
    result = shoal("run", "--no-ui", "--bootstrap-timeout", "10", "--listen", "/ip4/127.0.0.1/tcp/0",
                   "--initial-peer", f"/ip4/127.0.0.1/tcp/9/p2p/{VALID_PEER_ID}",
                   "--metrics-file", str(tmp_path / "m.jsonl"))
    assert time.monotonic() - started < 60
    assert_one_line_error(result, 4, "could not reach", "/ip4/127.0.0.1/tcp/9")


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[round]\nseconds = 0\n", "round.seconds"),
        ("[model]\ndmodel = 64\n", "model.dmodel"),
        ("[model]\nd_model = 'big'\n", "model.d_model"),
        ("[model]\nd_model = 66\nn_head = 4\n", "model.d_model"),
        ("[averaging]\nrequest_timeout = 5.0\nmatchmaking_seconds = 3.0\n", "averaging.request_timeout"),
        ("[data]\npaths = ['/nonexistent/*.txt']\n", "data.paths"),
        ("this is = not toml [", "not valid TOML"),
    ],
)
def test_bad_config_value_is_named(tmp_path, toml, needle):
    config = tmp_path / "bad.toml"
    config.write_text(toml)  # sections left out take their defaults
    result = shoal_forked("run", "--no-ui", "--config", str(config), "--listen", "/ip4/127.0.0.1/tcp/0")
    assert_one_line_error(result, 2, needle)


@pytest.mark.parametrize(("flag", "value", "needle"), [("--round-seconds", "0", "round.seconds"),
                                                        ("--device", "tpu", "train.device"),
                                                        ("--run-id", "bad id!", "run id")])
def test_bad_flag_value_is_named(flag, value, needle):
    assert_one_line_error(shoal_forked("run", "--no-ui", flag, value), 2, needle)


def test_missing_config_file():
    assert_one_line_error(shoal_forked("run", "--no-ui", "--config", "/nonexistent/run.toml"), 2, "/nonexistent/run.toml")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda_cleans_up(tmp_path):
    result = shoal("run", "--no-ui", "--device", "cuda", "--listen", "/ip4/127.0.0.1/tcp/0")
    assert_one_line_error(result, 2, "--device cuda")


def test_bootstrap_peer_that_never_answers_times_out(tmp_path):
    """A port that accepts TCP but never speaks libp2p: a bounded wait, then one line."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(16)], daemon=True).start()
    try:
        started = time.monotonic()
        result = shoal("run", "--no-ui", "--bootstrap-timeout", "4", "--listen", "/ip4/127.0.0.1/tcp/0",
                       "--initial-peer", f"/ip4/127.0.0.1/tcp/{server.getsockname()[1]}/p2p/{VALID_PEER_ID}")
        assert time.monotonic() - started < 45
        assert_one_line_error(result, 4, "could not reach")
    finally:
        server.close()
