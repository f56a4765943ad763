"""A public swarm's entry point and its regulars: `shoal bootstrap`, peers that know only its
address, a mismatched joiner refused, Ctrl+C, the bootstrap peer restarted (the swarm teaches the fresh one
its peers again), and a restart that resumes from its checkpoint (after the newest one was
truncated) with the same peer id, finding the swarm through the restarted bootstrap, then catches
up with the swarm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from examples.swarm_launcher import kill_process_group, shoal_command
from node.library.checkpoint import list_checkpoints, load_latest_valid
from node.observe.metrics import read_metrics
from tests.integration.conftest import start_bootstrap, stop_bootstrap
from tests.integration.start_gate import gated, open_gate
from tests.integration.swarm import PRELOADED_RUN, REPO, TINY, wait_until

pytestmark = pytest.mark.integration

ROUND_S = 6.0


def records(peer, event: str) -> list[dict]:
    if not peer.metrics_path.exists():
        return []
    return [r for r in read_metrics(peer.metrics_path) if r["event"] == event]


@pytest.mark.timeout(400)
def test_bootstrap_join_refuse_interrupt_resume(swarm, bootstrap, tmp_path, request):
    bootstrap_proc, address_file = bootstrap
    config = tmp_path / "every-round.toml"
    config.write_text(TINY.read_text().replace("checkpoint_every_rounds = 5", "checkpoint_every_rounds = 1"))
    peer_args = ("--round-seconds", str(ROUND_S), "--identity", str(tmp_path / "a.key"))
    initial = [f"@{address_file}"]  # both peers know only the bootstrap peer, through its address file

    # b starts once a has organised the run: an organiser never adopts another organiser's key, so
    # two peers that both organised at once would each run a run of their own.
    # (b's interpreter starts now, its ``shoal run`` at that moment: start_gate.py)
    a = swarm.start("a", *peer_args, initial=initial, config=config)
    b_gate = tmp_path / "b.gate"
    b = swarm.start("b", "--round-seconds", str(ROUND_S), initial=initial, config=config, program=PRELOADED_RUN,
                    env=gated(b_gate))
    wait_until(lambda: records(a, "start"), 90, "peer a did not start")
    open_gate(b_gate)

    # A joiner with another round length is refused before it averages anything (it runs while a
    # and b find each other: both take a process start-up on two cores).
    refused = subprocess.Popen([*shoal_command(), "run", "--no-ui", "--run-id", swarm.run_id, "--round-seconds", "7",
                                "--initial-peer", f"@{address_file}", "--listen", "/ip4/127.0.0.1/tcp/0"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    request.addfinalizer(lambda: kill_process_group(refused))

    # a and b found each other through the bootstrap peer and average together.
    def averaged_together(peer) -> list[int]:
        return [r["round"] for r in records(peer, "round") if r["applied"] == "averaged" and r["group_size"] == 2]

    wait_until(lambda: len(averaged_together(a)) >= 2, 120, "a and b never averaged together")
    try:
        out, err = refused.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_process_group(refused)
        raise
    assert refused.returncode == 2, out[-2000:] + err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "round.seconds=6.0 (this peer: 7.0)" in line, line

    # Ctrl+C (to a's whole process group, as a terminal does): exit 0, checkpoint, nothing left.
    os.killpg(a.proc.pid, signal.SIGINT)
    assert a.wait(timeout=60) == 0, a.log()[-3000:]
    assert not a.leftovers()
    exit_record = read_metrics(a.metrics_path)[-1]
    assert exit_record["event"] == "exit" and exit_record["reason"] == "interrupted", exit_record
    saved = list_checkpoints(a.checkpoint_dir)
    assert len(saved) >= 2, saved
    first_id = records(a, "start")[0]["peer"]
    # The restart below (its interpreter starts now; its ``shoal run`` once the swarm is ready for it).
    a2_gate = tmp_path / "a2.gate"
    a2 = swarm.start("a", *peer_args, initial=initial, config=config, program=PRELOADED_RUN, env=gated(a2_gate))

    # Truncate the newest checkpoint (a torn copy, a full disk): the restart names it and uses the next.
    model_file = saved[0] / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    fallback = load_latest_valid(a.checkpoint_dir)
    assert fallback is not None and fallback.path == saved[1]

    # The bootstrap peer restarts (same identity and port, as a real one with a fixed --listen), with
    # an empty DHT: b's periodic re-dial of its initial peers teaches it the swarm again, and the
    # restarted a below finds the swarm through it alone.
    bootstrap_proc = restart_bootstrap(bootstrap_proc, address_file, tmp_path)
    request.addfinalizer(lambda: kill_process_group(bootstrap_proc))  # the fixture owned the first one only
    b_id = records(b, "start")[0]["peer"]
    wait_until(lambda: b_id in status_peers(address_file, swarm.run_id), 120,
               "the restarted bootstrap peer never learned of b")

    # Restart a with the same identity and checkpoints. The swarm is ahead of the checkpoint it falls
    # back to (b holds at least the newest one's round) and moves on while a starts up.
    restarted_at = time.time()
    open_gate(a2_gate)
    wait_until(lambda: any(r["time"] > restarted_at for r in averaged_records(a2)), 120,
               "the restarted peer never averaged with b")
    log = a2.log()
    assert str(model_file) in log and "truncated" in log, log[-3000:]
    assert f"resumed from {saved[1]}" in log, log[-3000:]
    starts = records(a2, "start")
    assert starts[-1]["peer"] == first_id, "--identity did not keep the peer id"
    resume = [r for r in records(a2, "resume") if r["time"] > restarted_at]
    assert resume and resume[-1]["path"] == str(saved[1])
    # The swarm had moved on: the restarted peer caught up from b, by replaying the outer steps it
    # missed from b's history (when at most HISTORY_ROUNDS behind) or by downloading the state.
    downloads = [r for r in records(a2, "state_download") if r["time"] > restarted_at]
    replayed = [r for r in records(a2, "round") if r["time"] > restarted_at and r["caught_up"]]
    assert replayed or (downloads and downloads[-1]["adopted_round"] > fallback.round), (
        downloads, fallback.round, a2.log()[-3000:])

    swarm.interrupt_all()
    for peer in (a2, b):
        assert peer.wait(timeout=60) == 0, peer.log()[-3000:]
    assert bootstrap_proc.poll() is None, "the bootstrap peer died"
    stop_bootstrap(bootstrap_proc)


def restart_bootstrap(proc: subprocess.Popen, address_file, tmp_path) -> subprocess.Popen:
    """Ctrl+C the bootstrap peer (it must leave nothing behind), then start it again on the same port
    with the same identity; returns once it wrote its address again."""
    address = address_file.read_text().split()[0]
    port = address.split("/tcp/")[1].split("/")[0]
    stop_bootstrap(proc)
    address_file.unlink()
    restarted = start_bootstrap(tmp_path, address_file, listen=f"/ip4/127.0.0.1/tcp/{port}", log_name="bootstrap-2.log")
    try:
        wait_until(address_file.exists, 90, "the restarted bootstrap peer wrote no address")
        assert address_file.read_text().split()[0] == address, "the bootstrap came back at another address"
    except BaseException:
        stop_bootstrap(restarted)
        raise
    return restarted


def status_peers(address_file, run_id: str) -> set[str]:
    """The peers ``shoal status`` sees through the bootstrap peer's address."""
    result = subprocess.run([*shoal_command(), "status", "--initial-peer", f"@{address_file}", "--run-id", run_id,
                             "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        return set()
    return {peer["peer_id"] for peer in json.loads(result.stdout)["peer_list"]}


def averaged_records(peer) -> list[dict]:
    return [r for r in records(peer, "round") if r["applied"] == "averaged" and r["group_size"] == 2]
