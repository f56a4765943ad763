"""A public swarm's entry point and its regulars: `shoal bootstrap`, peers that know only its
address, a mismatched joiner refused, Ctrl+C, the bootstrap peer restarted (the swarm teaches the fresh one
its peers again), and a restart that resumes from its checkpoint (after the newest one was
truncated) with the same peer id, finding the swarm through the restarted bootstrap, then catches
up with the swarm.

The regulars run in blocking mode (fixed inner steps, then the loop waits for the all-reduce;
overlap mode is test_swarm's), spread their progress records over two DHT keys
(``averaging.progress_shards``: they find each other through them as through the one key;
test_entry_peers checks the keys themselves) and average the inner AdamW moments with every round
(``averaging.average_inner_state``: in blocking mode they land before the next step, so both peers
save the same moments within bf16's precision, where their own would differ). Beside them from the
start, ``LIARS`` strangers publish records and answer every DHT ping with the time an hour ahead
(``clock_liars.py``): they outnumber the honest peers a peer measured before issue 54, and no honest
clock moves now. One swarm for all of it: each costs the suite a minute."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from examples.swarm_launcher import kill_process_group, shoal_command
from node.library.checkpoint import list_checkpoints, load_checkpoint, load_latest_valid, round_dir_name
from node.observe.metrics import read_metrics
from tests.integration.conftest import start_bootstrap, stop_bootstrap
from tests.integration.start_gate import gated, open_gate
from tests.integration.swarm import PRELOADED_RUN, REPO, TINY, anchor_at, is_partial, wait_until

pytestmark = pytest.mark.integration

ROUND_S = 6.0
# 10 steps in 6 s rounds (tiny has 100 in 10 s): a step takes ~0.05 s on an idle core and ~0.13 s at
# load ~12 on 2 cores, so the 10 fit in a round with seconds to spare even after the wait for the last
# all-reduce (blocking mode waits after the deadline, inside the next round's wall clock), and the
# loop idles until the deadline, which is what the blocking checks are about.
INNER_STEPS = 10
BLOCKING = ("--sync-mode", "blocking")
LIARS, LIE_S = 3, 3000.0


def records(peer, event: str) -> list[dict]:
    if not peer.metrics_path.exists():
        return []
    return [r for r in read_metrics(peer.metrics_path) if r["event"] == event]


@pytest.mark.timeout(400)
def test_bootstrap_join_refuse_interrupt_resume(swarm, bootstrap, tmp_path, request):
    bootstrap_proc, address_file = bootstrap
    config = tmp_path / "every-round.toml"
    text = TINY.read_text().replace("checkpoint_every_rounds = 5", "checkpoint_every_rounds = 1")
    text = text.replace("inner_steps = 100", f"inner_steps = {INNER_STEPS}")
    assert "[averaging]\n" in text and f"inner_steps = {INNER_STEPS}" in text
    config.write_text(text.replace("[averaging]\n", "[averaging]\nprogress_shards = 2\naverage_inner_state = true\n", 1))
    peer_args = ("--round-seconds", str(ROUND_S), *BLOCKING, "--identity", str(tmp_path / "a.key"))
    initial = [f"@{address_file}"]  # both peers know only the bootstrap peer, through its address file
    wait_until(address_file.exists, 90, "the bootstrap peer wrote no address")
    liars_log = tmp_path / "liars.log"
    with open(liars_log, "w") as log:
        liars = subprocess.Popen([sys.executable, "-m", "tests.integration.clock_liars", swarm.run_id,
                                  address_file.read_text().split()[0], str(LIARS), str(LIE_S)],
                                 cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    request.addfinalizer(lambda: kill_process_group(liars))

    # b starts once a has organised the run: an organiser never adopts another organiser's key, so
    # two peers that both organised at once would each run a run of their own.
    # (b's interpreter starts now, its ``shoal run`` at that moment: start_gate.py)
    a = swarm.start("a", *peer_args, initial=initial, config=config)
    b_gate = tmp_path / "b.gate"
    b = swarm.start("b", "--round-seconds", str(ROUND_S), *BLOCKING, initial=initial, config=config, program=PRELOADED_RUN,
                    env=gated(b_gate))
    wait_until(lambda: records(a, "start"), 90, "peer a did not start")
    open_gate(b_gate)

    # A joiner with another round length is refused before it averages anything (it runs while a
    # and b find each other: both take a process start-up on two cores).
    refused = subprocess.Popen([*shoal_command(), "run", "--no-ui", "--run-id", swarm.run_id, "--config", str(config),
                                *BLOCKING, "--round-seconds", "7",
                                "--initial-peer", f"@{address_file}", "--listen", "/ip4/127.0.0.1/tcp/0"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    request.addfinalizer(lambda: kill_process_group(refused))

    # a and b found each other through the bootstrap peer and average together.
    def averaged_together(peer) -> list[int]:
        return [r["round"] for r in records(peer, "round") if r["applied"] == "averaged" and r["group_size"] == 2]

    # ... and the blocking checks below have a round they both averaged with every step (under load a
    # round can end partial, or be skipped when a step ran past its end: the wait is for that event).
    wait_until(lambda: len(averaged_together(a)) >= 2 and full_rounds(a, b), 150,
               "a and b never averaged a full blocking round together")
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
    check_blocking_rounds(a, b)
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
    check_clocks([a2, b], liars, liars_log)
    assert bootstrap_proc.poll() is None, "the bootstrap peer died"
    stop_bootstrap(bootstrap_proc)


def check_clocks(peers, liars: subprocess.Popen, log) -> None:
    """The liars' records were live to the honest peers (counted among their peers), and no honest
    clock moved by a second (every process here shares one true clock)."""
    assert liars.poll() is None and "liars ready" in log.read_text(), log.read_text()[-3000:]
    for peer in peers:
        assert max(r["peers"] for r in records(peer, "round")) >= 2 + LIARS, f"{peer.name} never saw the liars' records"
        moves = [float(m) for m in re.findall(r"swarm time: this clock is ([-+][0-9.]+)s off", peer.log())]
        assert all(abs(m) < 1.0 for m in moves), (peer.name, moves)


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


def check_blocking_rounds(a, b) -> None:
    """Blocking mode, over the rounds both peers recorded before a's Ctrl+C (from the second: the
    first may be partial): a round holds its fixed steps unless the wait for the last all-reduce ate
    it, the loop idles until the deadline and then waits for the all-reduce, and the averaged inner
    moments both saved agree within bf16's precision."""
    rounds = [{r["round"]: r for r in records(peer, "round")} for peer in (a, b)]
    shared = shared_rounds(rounds)
    for r in shared:
        for record in (rounds[0][r], rounds[1][r]):
            # Blocking mode waits after the deadline, inside the next round's wall clock: under load
            # a round held fewer steps only if it had under half its time to train.
            if record["inner_steps"] != INNER_STEPS:
                assert record["inner_steps"] < INNER_STEPS and record["wall_s"] - record["wait_s"] < 0.5 * ROUND_S, \
                    (r, record)
            elif not is_partial(record):
                assert record["group_size"] == 2 and record["applied"] == "averaged", (record["error"], record)
                assert record["wait_s"] > 0.2 * record["wall_s"] and record["wait_s"] >= record["sync_s"] * 0.9, record
    both = full_rounds(a, b)
    assert both, [(r, rounds[0][r]["error"], rounds[1][r]["error"]) for r in shared]
    assert torch.allclose(anchor_at(a, both[-1]), anchor_at(b, both[-1]), atol=1e-3)
    moments = [load_checkpoint(p.checkpoint_dir / round_dir_name(both[-1])).local_state for p in (a, b)]
    squares = [k for k in moments[0] if k.endswith(".exp_avg_sq")]
    assert squares and all(k in moments[1] for k in squares), sorted(moments[0])[:4]
    # fp16 sends take hivemind's path: each member gets its own bf16 delta, avg - own, rounded, so
    # the two differ by a few 2^-8 of their deltas; peers training alone differ by tens of percent. A
    # first moment's mean can cancel to well under the deltas (seen: a bias whose mean's largest value
    # was 1.0e-4, 1.66e-6 apart), so its scale is also the gradient's, the root of the second moment.
    for square in squares:
        first = square.replace("exp_avg_sq", "exp_avg")
        for key, scale in ((square, moments[0][square].abs().max()),
                           (first, torch.maximum(moments[0][first].abs().max(), moments[0][square].sqrt().max()))):
            x, y = moments[0][key], moments[1][key]
            assert float((x - y).abs().max()) <= 2**-6 * float(scale), (key, float((x - y).abs().max()), float(scale))


def shared_rounds(rounds: list[dict[int, dict]]) -> list[int]:
    """The rounds both peers recorded, from the second (the first may be partial)."""
    return sorted(rounds[0].keys() & rounds[1].keys())[1:]


def full_rounds(a, b) -> list[int]:
    """Those of the shared rounds that both averaged with their fixed steps, and that each peer
    averaged a later round after: the save at Ctrl+C goes to the last averaged round's directory,
    with the moments of the steps since, so only such a round's checkpoint holds the landed mean."""
    rounds = [{r["round"]: r for r in records(peer, "round")} for peer in (a, b)]
    last = min(max((r for r, x in per.items() if x["applied"] == "averaged"), default=0) for per in rounds)
    return [r for r in shared_rounds(rounds) if r < last and rounds[0][r]["applied"] == rounds[1][r]["applied"] == "averaged"
            and rounds[0][r]["inner_steps"] == rounds[1][r]["inner_steps"] == INNER_STEPS]
