"""Who else is training: our progress record out (heartbeat and progress in one), theirs in.

After start-up all calls to the run's directory happen on this monitor's thread (one owner):
hivemind's DHT talks to its process through a pipe that is not safe to write from several threads
at once.

What a heartbeat costs, and why it is kept flat as the swarm grows (docs/scale.md, "The heartbeat's
DHT cost"; measured by benchmarks.swarm.dht_load): every record lives under one DHT key, so each read
returns every live peer's record, from each of the key's replicas (hivemind stores a value on the
5 nodes nearest its key and a ``latest`` read asks all of them). Reading N records every ``period``
makes each peer's DHT traffic grow with N and the swarm's with N^2. So:

- the heartbeat slows once the swarm is larger than ``HEARTBEAT_PEERS`` (``heartbeat_period``):
  each peer then reads about as many records per second as at that size, and a crashed peer's
  record still expires after three of its own heartbeats;
- the run's manifest is republished by each peer every ``live / MANIFEST_PUBLISHERS`` heartbeats
  (at least every heartbeat, at most every ``MANIFEST_REFRESH_S``), and at once when it changes:
  the swarm as a whole still republishes it about once a heartbeat, so it survives the DHT nodes
  that held it leaving (hivemind never copies a value to the nodes that take over its key: it is
  lost only if all 5 of them leave within a heartbeat), but no longer N times a heartbeat;
- manifests are read only while ``converge`` may still act on them (``converging``: a new
  organiser's first minute); a joiner never does, and read them every heartbeat for nothing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from node.library.rediscovery import Rediscovery
from node.library.run_record import MANIFEST_TTL, RunDirectory, RunTrust, converge, converging
from node.library.swarm_clock import ClockKeeper
from protocols.manifest import RunManifest
from protocols.progress import ProgressRecord
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

# Clock probes: every tick while the swarm's time is first learnt, then every few ticks (a clock
# drifts by milliseconds a day; a new peer with another clock moves the median a little).
CLOCK_FIRST_TICKS = 5
CLOCK_EVERY_TICKS = 6
# Up to this many live peers the heartbeat keeps its base period; beyond, it slows in proportion.
HEARTBEAT_PEERS = 16
MAX_HEARTBEAT_S = 60.0  # and never slower than this: a crashed peer must still drop out in minutes
MANIFEST_PUBLISHERS = 1  # about this many peers republish the manifest each heartbeat
MANIFEST_REFRESH_S = MANIFEST_TTL / 4  # and each at least this often: it outlives three missed refreshes


def heartbeat_period(base: float, live_peers: int, *, reference: int = HEARTBEAT_PEERS,
                     ceiling: float = MAX_HEARTBEAT_S) -> float:
    """Seconds between two heartbeats with ``live_peers`` peers alive (this one included): ``base``
    up to ``reference`` peers, then ``base * live_peers / reference`` (at most ``ceiling``, never
    below ``base``), so the records a peer reads per second stay flat as the swarm grows."""
    if base <= 0 or reference < 1:
        raise ValueError(f"base ({base}) must be > 0 and reference ({reference}) >= 1")
    return max(base, min(ceiling, base * max(1, live_peers) / reference))


class PeerMonitor:
    """Publishes our progress record (each period: heartbeat and progress in one) and watches who
    else is alive: records expire on their own, so a peer that crashed drops out by itself."""

    def __init__(self, directory: RunDirectory, ours: RunManifest, *, peer_id: str, period: float,
                 status: Callable[[], ProgressRecord], on_change: Callable[[set[str], set[str]], None],
                 trust: RunTrust | None = None, rediscovery: Rediscovery | None = None,
                 present: Callable[[list[str]], list[str]] | None = None,
                 voices: Callable[[list[str]], list[str]] | None = None, clock: ClockKeeper | None = None,
                 heartbeat_peers: int | None = HEARTBEAT_PEERS, manifest_publishers: int | None = MANIFEST_PUBLISHERS,
                 read_manifests: bool = False):
        """``period``: the heartbeat's base period (``heartbeat_period`` slows it beyond
        ``heartbeat_peers`` live peers; None: never). ``present(others)``: of the other live peers,
        those that count as members of the swarm (``node.library.acquaintances``); None: every
        record does. ``voices(others)``: those we averaged with lately, whose clocks we measure and
        whom we re-dial (None: nobody; ``clock`` then measures only the peers it trusts).
        ``manifest_publishers`` None (republish every heartbeat), ``heartbeat_peers`` None and ``read_manifests`` (every heartbeat, not only while ``converging``) restore the costs these
        limits replaced, for ``benchmarks.swarm.dht_load``."""
        self.directory, self.manifest, self.peer_id = directory, ours, peer_id
        self.base_period = self.period = period
        self._heartbeat_peers, self._manifest_publishers = heartbeat_peers, manifest_publishers
        self._read_manifests = read_manifests
        self._manifest_published: tuple[RunManifest, float] | None = None  # what we last published, when
        self._present, self._voices = present, voices
        self.trust = trust if trust is not None else RunTrust(pinned=ours.organiser or None)
        self._status, self._on_change = status, on_change
        self.peers: dict[str, ProgressRecord] = {}
        self.malformed = 0  # records ignored at the last read (validation failed)
        self.others_seen_at = -math.inf  # time.time() of the last read that found another peer present
        self.clock = clock if clock is not None else ClockKeeper()
        self.rediscovery = rediscovery  # None: nothing to re-dial (an in-process swarm, a test)
        self._ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal-monitor", daemon=True)

    @property
    def ttl(self) -> float:
        """How long a record outlives its publisher: three missed heartbeats."""
        return 3 * self.period

    @property
    def schedule(self) -> RoundSchedule:
        return RoundSchedule(self.manifest.start_time, self.manifest.round_seconds)

    @property
    def manifest_refresh_s(self) -> float:
        """How often we republish the manifest: the swarm as a whole about ``manifest_publishers``
        times a heartbeat."""
        if self._manifest_publishers is None:
            return 0.0
        share = self.period * max(1, len(self.peers)) / self._manifest_publishers
        return max(self.period, min(MANIFEST_REFRESH_S, share))

    @property
    def peer_count(self) -> int:
        return max(1, len(self.peers))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.period + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - a DHT hiccup must not kill the node
                logger.warning(f"swarm monitor: {e!r}")
            self._stop.wait(self.period)

    def tick(self) -> None:
        mine = self._status()
        self.directory.publish_progress(mine, ttl=self.ttl)
        now = self.directory.now()
        if self._read_manifests or converging(self.trust, now):
            # A peer that organised the run at the same moment as us may have published an earlier
            # start: new organisers converge on one (``converge`` says who may move, and how far).
            manifests, _ = self.directory.manifests()
            self.manifest = converge(self.manifest, manifests, self.trust, now)
        self._publish_manifest(now)
        live, self.malformed = self.directory.progress()
        live[self.peer_id] = mine
        others = sorted(set(live) - {self.peer_id})
        if others and (self._present is None or self._present(others)):
            self.others_seen_at = time.time()
        joined, left = set(live) - set(self.peers), set(self.peers) - set(live)
        self.peers = live
        if self._heartbeat_peers is not None:
            # At most twice as slow per tick: the record just published lives three periods.
            self.period = min(2 * self.period, heartbeat_period(self.base_period, len(live),
                                                                reference=self._heartbeat_peers))
        self._ticks += 1
        voices = self._voices(others) if self._voices is not None and others else []
        self.clock.follow_steps()
        if self._ticks <= CLOCK_FIRST_TICKS or self._ticks % CLOCK_EVERY_TICKS == 0 or joined:
            if measured := self.clock.chosen(voices):
                self.clock.update(self.directory.clock_samples(measured))
        if self.rediscovery is not None:
            self.rediscovery.tick(live, self.directory.reconnect, met=voices)
        if joined or left:
            self._on_change(joined, left)

    def _publish_manifest(self, now: float) -> None:
        """Keep the run findable: republish the manifest we follow when it changed, or when our
        last copy is ``manifest_refresh_s`` old."""
        last = self._manifest_published
        if last is not None and last[0] is self.manifest and now - last[1] < self.manifest_refresh_s:
            return
        self.directory.publish_manifest(self.manifest, ttl=max(self.ttl, MANIFEST_TTL))
        self._manifest_published = (self.manifest, now)
