"""Joining the swarm: the DHT, the run record (schedule + shared config) and live peers.

All our DHT calls after start-up happen on the monitor's thread (one owner): hivemind's DHT
talks to its process through a pipe that is not safe to write from several threads at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from protocols.errors import ConfigError, NetworkError
from protocols.keys import peers_key, run_key
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

RUN_RECORD_VERSION = 1


def start_dht(*, initial_peers: list[str], listen: list[str], announce: list[str], timeout: float) -> DHT:
    """Start our DHT node; an unreachable bootstrap peer is a one-line error after ``timeout`` s."""
    dht = DHT(
        initial_peers=initial_peers or None,
        host_maddrs=listen or ["/ip4/0.0.0.0/tcp/0"],
        announce_maddrs=announce or None,
        start=False,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
        return dht
    except BaseException as e:
        _stop(dht)
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if initial_peers:
            raise NetworkError(
                f"could not reach any initial peer ({', '.join(initial_peers)}) within {timeout:.0f}s ({reason[:160]}); "
                "check that the peer is running and that its address and port are reachable from here"
            ) from None
        raise NetworkError(f"could not start the DHT on {', '.join(listen) or 'the default address'}: {reason[:200]}; "
                           "check --listen (is the port free?)") from None


def _stop(dht: DHT) -> None:
    try:
        if dht.is_alive():
            dht.shutdown()
    except Exception:  # noqa: BLE001 - best effort on an already broken start
        pass
    if dht.is_alive():
        dht.terminate()


@dataclass(frozen=True, slots=True)
class RunRecord:
    start_time: float
    round_seconds: float
    shared: dict[str, Any]


def _parse_run_record(value: Any) -> RunRecord | None:
    if not isinstance(value, dict) or value.get("v") != RUN_RECORD_VERSION:
        return None
    start, seconds, shared = value.get("start_time"), value.get("round_seconds"), value.get("shared")
    if not isinstance(start, (int, float)) or not isinstance(seconds, (int, float)) or not isinstance(shared, dict):
        return None
    return RunRecord(float(start), float(seconds), shared)


def read_run_records(dht: DHT, run_id: str) -> list[RunRecord]:
    found = dht.get(run_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    records = (_parse_run_record(item.value) for item in found.value.values() if hasattr(item, "value"))
    return [r for r in records if r is not None]


def describe_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first shared field that differs, as ``field=theirs (this peer: ours)``."""
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return f"{key}={theirs.get(key, '<missing>')!r} (this peer: {ours.get(key, '<missing>')!r})"
    return None


def join_run(dht: DHT, run_id: str, shared: dict[str, Any], round_seconds: float, *,
             record_ttl: float) -> RoundSchedule:
    """Adopt the run's schedule (earliest published start) or start it; refuse a different config."""
    records = read_run_records(dht, run_id)
    for record in records:
        mismatch = describe_mismatch(shared, record.shared)
        if mismatch is not None:
            raise ConfigError(
                f"run '{run_id}' is training with {mismatch}; use the run's config or pick another --run-id"
            )
    start_time = min((r.start_time for r in records), default=get_dht_time())
    schedule = RoundSchedule(start_time=start_time, round_seconds=round_seconds)
    publish_run_record(dht, run_id, schedule, shared, ttl=record_ttl)
    return schedule


def publish_run_record(dht: DHT, run_id: str, schedule: RoundSchedule, shared: dict[str, Any], *, ttl: float) -> None:
    value = {"v": RUN_RECORD_VERSION, "start_time": schedule.start_time,
             "round_seconds": schedule.round_seconds, "shared": shared}
    dht.store(run_key(run_id), subkey=dht.peer_id.to_bytes(), value=value, expiration_time=get_dht_time() + ttl)


def _parse_heartbeat(value: Any) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("round"), int):
        return None
    return value


class PeerMonitor:
    """Publishes our heartbeat and watches who else is alive (records expire on their own)."""

    def __init__(self, dht: DHT, run_id: str, *, schedule: RoundSchedule, shared: dict[str, Any],
                 period: float, status: Callable[[], dict], on_change: Callable[[set[str], set[str]], None]):
        self.dht, self.run_id, self.shared, self.period = dht, run_id, shared, period
        self.schedule = schedule
        self._status, self._on_change = status, on_change
        self.peers: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal-monitor", daemon=True)

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
        ttl = 3 * self.period
        me = self.dht.peer_id
        self.dht.store(peers_key(self.run_id), subkey=me.to_bytes(), value=self._status(),
                       expiration_time=get_dht_time() + ttl)
        publish_run_record(self.dht, self.run_id, self.schedule, self.shared, ttl=max(ttl, 600))
        # A peer that started the run at the same moment as us may have published an earlier
        # start: everybody converges on the earliest one.
        earliest = min((r.start_time for r in read_run_records(self.dht, self.run_id)
                        if r.shared == self.shared), default=self.schedule.start_time)
        if earliest < self.schedule.start_time:
            self.schedule = RoundSchedule(earliest, self.schedule.round_seconds)
        found = self.dht.get(peers_key(self.run_id), latest=True)
        live: dict[str, dict] = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                beat = _parse_heartbeat(getattr(item, "value", None))
                if beat is None or not isinstance(subkey, bytes):
                    continue
                try:
                    live[str(PeerID(subkey))] = beat
                except Exception:  # noqa: BLE001 - a malformed key is ignored
                    continue
        live.setdefault(str(me), self._status())
        joined, left = set(live) - set(self.peers), set(self.peers) - set(live)
        self.peers = live
        if joined or left:
            self._on_change(joined, left)

