"""Who sets a peer's clock (issue 54, item 1): the real ``PeerMonitor.tick`` and ``ClockKeeper`` on an
in-process directory whose pings answer with each peer's chosen time. The audit's attack: five
records whose ids sorted first, answering true time + 3000 s, moved honest peers by an hour. Now
only peers we averaged with are measured (a random sample), a majority must agree, a settled offset
walks, a newcomer's first fix comes from the peers its user named, and a step of this machine's own
clock is followed."""

from __future__ import annotations

import time

import pytest

from node.library import swarm_clock
from node.library.local_network import LocalDirectory, LocalSwarmHub, local_peer_id
from node.library.monitor import CLOCK_EVERY_TICKS, CLOCK_FIRST_TICKS, PeerMonitor
from node.library.swarm_clock import ClockKeeper
from protocols import progress, swarm_time
from protocols.identity import RunKey
from protocols.manifest import RunManifest
from protocols.swarm_time import ClockSample
from tests.unit.test_monitor import Clock, record

RUN = "clocked"
LIE_S = 3000.0


class PingedDirectory(LocalDirectory):
    """Each ping answered with ``answers[peer]`` seconds off our clock (no answer: unreachable);
    every probe's peers are kept in ``pinged``."""

    def __init__(self, *args, answers: dict[str, float]):
        super().__init__(*args)
        self.answers, self.pinged = answers, []

    def clock_samples(self, peer_ids: list[str]) -> list[ClockSample]:
        self.pinged.append(list(peer_ids))
        sent = time.time()
        return [ClockSample(peer=p, sent=sent, remote=sent + 0.005 + self.answers[p],
                            received=sent + 0.01) for p in peer_ids if p in self.answers]


@pytest.fixture(autouse=True)
def offset_zero():
    swarm_time.set_offset(0.0)
    yield
    swarm_time.set_offset(0.0)


def monitor_with(answers: dict[str, float], *, records: list[str], met: set[str], trusted: tuple[str, ...] = ()):
    clock = Clock()
    hub = LocalSwarmHub(clock=clock)
    for peer in records:
        hub.store(RUN, "progress", peer, progress.encode(record(peer, clock.now)), ttl=10_000)
    me = local_peer_id("me")
    directory = PingedDirectory(hub, RUN, me, answers=answers)
    manifest = RunManifest.create(RUN, {"model.d_model": 64}, start_time=clock.now, round_seconds=10.0) \
        .signed_by(RunKey.generate())
    monitor = PeerMonitor(directory, manifest, peer_id=me, period=3.0, status=lambda: record(me, clock.now),
                          on_change=lambda joined, left: None, voices=lambda others: [p for p in others if p in met],
                          clock=ClockKeeper(trusted=trusted))
    return monitor, directory, clock


def probes(monitor: PeerMonitor, clock: Clock, count: int) -> None:
    """Heartbeats until ``count`` clock probes ran."""
    ticks = CLOCK_FIRST_TICKS + (count - CLOCK_FIRST_TICKS) * CLOCK_EVERY_TICKS if count > CLOCK_FIRST_TICKS else count
    for _ in range(ticks):
        monitor.tick()
        clock.now += monitor.period


def test_records_that_never_averaged_with_us_are_never_asked_the_time():
    sybils = sorted(local_peer_id(f"sybil-{i}") for i in range(5))
    honest = [local_peer_id("honest-a"), local_peer_id("honest-b")]
    answers = {**{s: LIE_S for s in sybils}, **{h: 0.0 for h in honest}}
    monitor, directory, clock = monitor_with(answers, records=sybils + honest, met=set(honest))
    probes(monitor, clock, 8)
    assert swarm_time.offset() == 0.0
    assert directory.pinged and all(set(peers) <= set(honest) for peers in directory.pinged), directory.pinged


def test_liars_we_averaged_with_move_a_settled_peer_a_step_a_probe_and_a_split_moves_nothing():
    liars = [local_peer_id(f"liar-{i}") for i in range(2)]
    honest = local_peer_id("honest")
    monitor, _, clock = monitor_with({honest: 0.0, liars[0]: LIE_S, liars[1]: -LIE_S},
                                     records=[*liars, honest], met={honest, *liars})
    probes(monitor, clock, 6)  # a different lie to each: no majority
    assert swarm_time.offset() == 0.0
    monitor, directory, clock = monitor_with({honest: 0.0, **{liar: LIE_S for liar in liars}},
                                             records=[*liars, honest], met={honest, *liars})
    monitor.clock.settled = True
    probes(monitor, clock, 6)
    assert 0 < swarm_time.offset() <= 6 * swarm_time.MAX_STEP_S + 1e-9, swarm_time.offset()


def test_a_newcomer_takes_its_first_fix_from_the_peers_its_user_named_then_only_from_those_it_met():
    named, stranger = local_peer_id("bootstrap"), local_peer_id("stranger")
    monitor, directory, clock = monitor_with({named: 2.0, stranger: LIE_S}, records=[stranger], met=set(),
                                             trusted=(named,))
    probes(monitor, clock, 1)
    assert swarm_time.offset() == pytest.approx(2.0, abs=0.01) and monitor.clock.settled
    probes(monitor, clock, 4)
    assert directory.pinged[0] == [named] and not any(directory.pinged[1:]), directory.pinged
    # A lone peer (nobody named, nobody met) keeps its own clock.
    swarm_time.set_offset(0.0)
    monitor, directory, clock = monitor_with({stranger: LIE_S}, records=[stranger], met=set())
    probes(monitor, clock, 5)
    assert swarm_time.offset() == 0.0 and not directory.pinged and not monitor.clock.settled


def test_a_step_of_our_own_clock_is_followed_so_swarm_time_runs_on(monkeypatch):
    keeper = ClockKeeper()
    before = swarm_time.now()
    real = time.time
    monkeypatch.setattr(swarm_clock.time, "time", lambda: real() + 5.0)  # NTP stepped us 5 s forward
    monkeypatch.setattr(swarm_time.time, "time", lambda: real() + 5.0)
    assert keeper.follow_steps() == pytest.approx(5.0, abs=0.01)
    assert swarm_time.offset() == pytest.approx(-5.0, abs=0.01)
    assert swarm_time.now() - before == pytest.approx(0.0, abs=0.05)
    assert keeper.follow_steps() == 0.0  # once
