"""What a heartbeat costs as the swarm grows (``node.library.monitor``): the period that slows past
``HEARTBEAT_PEERS`` live peers, the manifest republished about once a heartbeat by the swarm, and manifests
read only while a new organiser may still converge. On an in-process directory with a fake clock."""

from __future__ import annotations

import dataclasses

import pytest

from node.library.local_network import LocalDirectory, LocalSwarmHub, local_peer_id
from node.library.monitor import (
    HEARTBEAT_PEERS,
    MANIFEST_REFRESH_S,
    MAX_HEARTBEAT_S,
    PeerMonitor,
    heartbeat_period,
)
from node.library.run_record import ADOPT_PERIOD_S, RunTrust
from protocols import progress
from protocols.identity import RunKey
from protocols.manifest import RunManifest
from protocols.progress import ProgressRecord

RUN = "monitored"


class Clock:
    def __init__(self, now: float = 50_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingDirectory(LocalDirectory):
    """Counts the monitor's manifest reads and writes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.manifest_reads = self.manifest_writes = 0

    def manifests(self):
        self.manifest_reads += 1
        return super().manifests()

    def publish_manifest(self, ours, *, ttl):
        self.manifest_writes += 1
        super().publish_manifest(ours, ttl=ttl)


def record(peer_id: str, now: float) -> ProgressRecord:
    return ProgressRecord(peer_id=peer_id, round=3, tokens_per_s=100.0, loss=2.0, eval_loss=None, device="cpu",
                          utilization=0.9, bytes_sent=0, bytes_received=0, mode="full", version="0.1.0", tokens=10,
                          time=now, phase="training")


def swarm(others: int, *, organised_at: float | None = None, base: float = 3.0):
    """A monitor of peer "me" on a hub that also holds ``others`` live records (a far longer TTL
    than any test runs: they stay live)."""
    clock = Clock()
    hub = LocalSwarmHub(clock=clock)
    for i in range(others):
        peer = local_peer_id(f"other-{i}")
        hub.store(RUN, "progress", peer, progress.encode(record(peer, clock.now)), ttl=10_000)
    me = local_peer_id("me")
    directory = CountingDirectory(hub, RUN, me)
    manifest = RunManifest.create(RUN, {"model.d_model": 64}, start_time=clock.now, round_seconds=10.0) \
        .signed_by(RunKey.generate())
    trust = RunTrust(pinned=manifest.organiser, organised_at=organised_at)
    monitor = PeerMonitor(directory, manifest, peer_id=me, period=base, status=lambda: record(me, clock.now),
                          on_change=lambda joined, left: None, trust=trust)
    return monitor, directory, clock


def beat(monitor: PeerMonitor, clock: Clock, times: int = 1) -> None:
    """``times`` heartbeats, each a period after the last (as the monitor's thread waits)."""
    for _ in range(times):
        monitor.tick()
        clock.now += monitor.period


def test_the_period_is_the_base_one_up_to_the_reference_size_then_grows_in_proportion():
    assert heartbeat_period(3.0, 1) == heartbeat_period(3.0, HEARTBEAT_PEERS) == 3.0
    assert heartbeat_period(3.0, 2 * HEARTBEAT_PEERS) == pytest.approx(6.0)
    assert heartbeat_period(3.0, 100, reference=10) == pytest.approx(30.0)
    assert heartbeat_period(3.0, 10**6) == MAX_HEARTBEAT_S  # a crashed peer still drops out in minutes
    assert heartbeat_period(90.0, 10**6) == 90.0  # never faster than the base
    with pytest.raises(ValueError):
        heartbeat_period(0.0, 4)


def test_a_large_swarm_slows_the_heartbeat_at_most_twice_per_beat_and_our_record_never_lapses():
    monitor, directory, clock = swarm(others=63)  # 64 live peers: 4x the reference size
    periods, lapsed = [], []
    for _ in range(5):
        published_at = clock.now
        monitor.tick()
        expires = published_at + 3 * (periods[-1] if periods else monitor.base_period)  # the TTL it was published with
        periods.append(monitor.period)
        clock.now += monitor.period
        lapsed.append(clock.now > expires)
    assert periods == pytest.approx([6.0, 12.0, 12.0, 12.0, 12.0])  # 3 s base x 64 / 16, reached by doubling
    assert not any(lapsed)  # the next heartbeat always comes within the TTL of the record before it
    assert len(monitor.peers) == 64


def test_a_small_swarm_keeps_the_base_period():
    monitor, _, clock = swarm(others=5)
    beat(monitor, clock, 3)
    assert monitor.period == monitor.base_period == 3.0


def test_a_joiner_never_reads_manifests_and_republishes_ours_about_once_a_heartbeat_swarm_wide():
    monitor, directory, clock = swarm(others=3)  # 4 live: each of us republishes every 4th heartbeat
    beat(monitor, clock, 9)
    assert directory.manifest_reads == 0  # converge could not act on them: a joiner never moves
    assert directory.manifest_writes == 3
    # Alone (or nearly), every heartbeat republishes it, as before.
    lone, lone_directory, lone_clock = swarm(others=0)
    beat(lone, lone_clock, 4)
    assert lone_directory.manifest_writes == 4


def test_a_changed_manifest_is_republished_at_once_and_the_refresh_never_exceeds_its_cap():
    monitor, directory, clock = swarm(others=11)
    beat(monitor, clock)
    writes = directory.manifest_writes
    monitor.manifest = dataclasses.replace(monitor.manifest, round_seconds=20.0)
    beat(monitor, clock)
    assert directory.manifest_writes == writes + 1
    big, _, big_clock = swarm(others=999)
    beat(big, big_clock, 8)
    assert big.manifest_refresh_s == MANIFEST_REFRESH_S  # 1,000 peers: each every MANIFEST_TTL / 4


def test_a_new_organiser_reads_manifests_for_its_first_minute_only():
    monitor, directory, clock = swarm(others=3, organised_at=Clock().now)
    beat(monitor, clock, 4)
    assert directory.manifest_reads == 4  # still within ADOPT_PERIOD_S: a rival organiser may be met
    clock.now += ADOPT_PERIOD_S
    beat(monitor, clock, 4)
    assert directory.manifest_reads == 4
