"""Who else is training: our progress record out (heartbeat and progress in one), theirs in.

After start-up all calls to the run's directory happen on this monitor's thread (one owner):
hivemind's DHT talks to its process through a pipe that is not safe to write from several threads
at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from node.library.rediscovery import Rediscovery
from node.library.run_record import MANIFEST_TTL, RunDirectory, RunTrust, converge
from node.library.swarm_clock import ClockKeeper
from protocols.manifest import RunManifest
from protocols.progress import ProgressRecord
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

# Clock probes: every tick while the swarm's time is first learnt, then every few ticks (a clock
# drifts by milliseconds a day; a new peer with another clock moves the median a little).
CLOCK_FIRST_TICKS = 5
CLOCK_EVERY_TICKS = 6


class PeerMonitor:
    """Publishes our progress record (each period: heartbeat and progress in one) and watches who
    else is alive: records expire on their own, so a peer that crashed drops out by itself."""

    def __init__(self, directory: RunDirectory, ours: RunManifest, *, peer_id: str, period: float,
                 status: Callable[[], ProgressRecord], on_change: Callable[[set[str], set[str]], None],
                 trust: RunTrust | None = None, rediscovery: Rediscovery | None = None,
                 present: Callable[[list[str]], list[str]] | None = None):
        """``present(others)``: of the other live peers, those that count as members of the swarm
        (``node.library.acquaintances``); None: every record does."""
        self.directory, self.manifest, self.peer_id, self.period = directory, ours, peer_id, period
        self._present = present
        self.trust = trust if trust is not None else RunTrust(pinned=ours.organiser or None)
        self._status, self._on_change = status, on_change
        self.peers: dict[str, ProgressRecord] = {}
        self.malformed = 0  # records ignored at the last read (validation failed)
        self.others_seen_at = -math.inf  # time.time() of the last read that found another peer present
        self.clock = ClockKeeper()
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
        self.directory.publish_manifest(self.manifest, ttl=max(self.ttl, MANIFEST_TTL))
        # A peer that organised the run at the same moment as us may have published an earlier
        # start: new organisers converge on one (``converge`` says who may move, and how far).
        manifests, _ = self.directory.manifests()
        self.manifest = converge(self.manifest, manifests, self.trust, self.directory.now())
        live, self.malformed = self.directory.progress()
        live[self.peer_id] = mine
        others = sorted(set(live) - {self.peer_id})
        if others and (self._present is None or self._present(others)):
            self.others_seen_at = time.time()
        joined, left = set(live) - set(self.peers), set(self.peers) - set(live)
        self.peers = live
        self._ticks += 1
        if others and (self._ticks <= CLOCK_FIRST_TICKS or self._ticks % CLOCK_EVERY_TICKS == 0 or joined):
            self.clock.update(self.directory.clock_samples(others))
        if self.rediscovery is not None:
            self.rediscovery.tick(live, self.directory.reconnect)
        if joined or left:
            self._on_change(joined, left)
