"""``shoal status --json`` against a real 3-peer swarm on loopback: it sees every peer and the
schedule's round, and a killed peer's progress record drops out once it expires."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from node.local_swarm import kill_process_group
from node.metrics import read_metrics
from protocols.schedule import RoundSchedule
from tests.integration.swarm import REPO, shoal_command

pytestmark = pytest.mark.integration

ROUND_SECONDS = 6.0
# The node's heartbeat (its progress record) is republished every `period` seconds and expires
# 3 periods after it was stored (node/api.py: period = min(5, max(1, round_seconds / 3))).
HEARTBEAT_PERIOD = min(5.0, max(1.0, ROUND_SECONDS / 3))
RECORD_TTL = 3 * HEARTBEAT_PERIOD
CLOCK_SLACK = 1.0


def shoal_status(initial_peer: str, run_id: str) -> dict:
    result = subprocess.run([*shoal_command(), "status", "--initial-peer", initial_peer, "--run-id", run_id, "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def start_record(peer) -> dict:
    deadline = time.time() + 60
    while time.time() < deadline:
        if peer.metrics_path.exists():
            starts = [r for r in read_metrics(peer.metrics_path) if r["event"] == "start"]
            if starts:
                return starts[0]
        time.sleep(0.5)
    raise TimeoutError(f"{peer.name} wrote no start record:\n{peer.log()[-3000:]}")


@pytest.mark.timeout(420)
def test_status_sees_the_swarm_and_a_dead_peer_drops_out(swarm):
    common = ("--round-seconds", str(ROUND_SECONDS))
    first = swarm.start("a", *common)
    address = first.wait_for_address()[0]
    peers = [first, *(swarm.start(name, *common, initial=[address]) for name in ("b", "c"))]
    ids = {peer.name: start_record(peer)["peer"] for peer in peers}
    # The first peer started the run: the schedule every peer converged on is its start.
    schedule = RoundSchedule(start_record(first)["schedule_start"], ROUND_SECONDS)

    # 1. All three peers, the schedule's round, throughput adding up.
    deadline = time.time() + 180
    while True:
        snapshot = shoal_status(address, swarm.run_id)
        if snapshot["peers"] == 3 or time.time() > deadline:
            break
        time.sleep(1)
    assert snapshot["peers"] == 3, snapshot
    assert {p["peer_id"] for p in snapshot["peer_list"]} == set(ids.values())
    assert snapshot["malformed"] == 0, snapshot
    assert snapshot["round"] == schedule.round_at(snapshot["time"]), snapshot
    assert snapshot["round_seconds"] == ROUND_SECONDS
    for record in snapshot["peer_list"]:
        # a record is at most one heartbeat old; a peer still joining may report round 0
        assert record["round"] in (0, snapshot["round"] - 1, snapshot["round"]), record
        assert 0 <= record["last_seen_s"] <= RECORD_TTL + CLOCK_SLACK, record
        assert record["mode"] == "full" and 0 <= record["utilization"] <= 1
    assert snapshot["tokens_per_s"] == pytest.approx(sum(p["tokens_per_s"] for p in snapshot["peer_list"]))

    # 2. Kill one peer (its whole process group: node, DHT, averager, p2pd): no goodbye.
    victim = peers[2]
    kill_process_group(victim.proc)
    killed_at = time.time()
    dead_id = ids[victim.name]
    # Its last record expires at most RECORD_TTL after the kill; no later look may show it.
    while True:
        snapshot = shoal_status(address, swarm.run_id)
        listed = {p["peer_id"] for p in snapshot["peer_list"]}
        if snapshot["time"] > killed_at + RECORD_TTL + CLOCK_SLACK:
            assert dead_id not in listed, (snapshot["time"] - killed_at, snapshot)
            break
        time.sleep(1)
    assert listed == {ids["a"], ids["b"]}, snapshot
    assert snapshot["peers"] == 2
