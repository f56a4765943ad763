"""Joining the swarm: the DHT, the run record (schedule + shared config) and live peers.

All our DHT calls after start-up happen on the monitor's thread (one owner): hivemind's DHT
talks to its process through a pipe that is not safe to write from several threads at once.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hivemind import DHT
from hivemind.utils import get_dht_time

from protocols import manifest, progress
from protocols.errors import ConfigError, NetworkError
from protocols.keys import peers_key, run_key
from protocols.manifest import RunManifest
from protocols.messages import MessageError
from protocols.progress import ProgressRecord
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

MANIFEST_TTL = 600.0  # a run nobody serves any more is forgotten after this

@dataclass(frozen=True, slots=True)
class Reachability:
    """How this peer can be reached (``--client-mode``, ``--use-relay``), told to the user at start."""

    client_mode: bool = False
    use_relay: bool = False

    @property
    def mode(self) -> str:
        return "client" if self.client_mode else "relay" if self.use_relay else "full"

    def describe(self, maddrs: list[str]) -> str:
        if self.client_mode:
            return ("client mode (--client-mode): outgoing connections only; this peer trains and averages "
                    "but nobody can connect to it, so it serves no state to newcomers")
        if self.use_relay:
            return ("relay mode (--use-relay): reachable through other peers' libp2p relays, for a NAT or "
                    "firewall without port forwarding")
        if maddrs and all(_is_private(m) for m in maddrs):
            return ("full peer, but only on private addresses: peers outside this network cannot reach it; "
                    "forward the port and pass --announce /ip4/<public ip>/tcp/<port>, or use --use-relay "
                    "or --client-mode")
        return "full peer: others connect to it directly"


def _is_private(maddr: str) -> bool:
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        address = ipaddress.ip_address(parts[2])
    except ValueError:
        return False
    return address.is_private or address.is_loopback or address.is_link_local


def start_dht(*, initial_peers: list[str], listen: list[str], announce: list[str], timeout: float,
              identity: Path | None = None, reachability: Reachability = Reachability()) -> DHT:
    """Start our DHT node; an unreachable bootstrap peer is a one-line error after ``timeout`` s."""
    if reachability.client_mode and not initial_peers:
        raise ConfigError("--client-mode needs --initial-peer: a peer nobody can connect to cannot start a swarm")
    identity_path = prepare_identity(identity) if identity is not None else None
    dht = DHT(
        initial_peers=initial_peers or None,
        host_maddrs=listen or ["/ip4/0.0.0.0/tcp/0"],
        announce_maddrs=announce or None,
        identity_path=identity_path,
        client_mode=reachability.client_mode,
        use_relay=True,  # hivemind's default: we may dial peers that are reachable only via relays
        use_auto_relay=reachability.use_relay,
        start=False,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
        return dht
    except BaseException as e:
        _stop(dht)
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if identity_path is not None and "already taken" in reason:
            raise ConfigError(f"another peer is already running with the identity in {identity_path}; stop it or "
                              "pass a different --identity") from None
        if identity_path is not None and ("unmarshal" in reason or "proto" in reason.lower()):
            raise ConfigError(f"identity file {identity_path} is not a libp2p private key; delete it to create a "
                              "new one (this peer's id will change)") from None
        if initial_peers:
            raise NetworkError(
                f"could not reach any initial peer ({', '.join(initial_peers)}) within {timeout:.0f}s ({reason[:160]}); "
                "check that the peer is running and that its address and port are reachable from here"
            ) from None
        raise NetworkError(f"could not start the DHT on {', '.join(listen) or 'the default address'}: {reason[:200]}; "
                           "check --listen (is the port free?)") from None


def prepare_identity(path: Path) -> str:
    """The identity file for ``--identity``: hivemind creates it on first use; we make its folder
    and refuse a path that cannot hold a key (a folder, an empty file) with a fix."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"--identity {path} is a directory; pass a file path, e.g. {path / 'identity.key'}")
    if path.exists() and path.stat().st_size == 0:
        raise ConfigError(f"identity file {path} is empty; delete it to create a new one (this peer's id will change)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the folder for --identity {path}: {e.strerror}") from None
    return str(path)


def _stop(dht: DHT) -> None:
    try:
        if dht.is_alive():
            dht.shutdown()
    except Exception:  # noqa: BLE001 - best effort on an already broken start
        pass
    if dht.is_alive():
        dht.terminate()


def read_manifests(dht: DHT, run_id: str) -> tuple[list[RunManifest], int]:
    """The valid manifests published for ``run_id`` and the number of malformed ones (ignored)."""
    found = dht.get(run_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return [], 0
    manifests, malformed = [], 0
    for item in found.value.values():
        try:
            manifests.append(manifest.decode(getattr(item, "value", None)))
        except MessageError as e:
            malformed += 1
            logger.debug(f"ignored a malformed manifest: {e}")
    return manifests, malformed


def join_run(dht: DHT, ours: RunManifest, *, record_ttl: float) -> RunManifest:
    """Adopt the run's schedule (earliest published start) or start the run; refuse a run whose
    manifest differs from ours (``ConfigError`` naming the field) before averaging anything."""
    theirs, _ = read_manifests(dht, ours.run_id)
    for other in theirs:
        manifest.check_compatible(ours, other)
    start_time = min((m.start_time for m in theirs), default=get_dht_time())
    joined = ours.with_start(start_time)
    publish_manifest(dht, joined, ttl=record_ttl)
    return joined


def publish_manifest(dht: DHT, ours: RunManifest, *, ttl: float) -> None:
    dht.store(run_key(ours.run_id), subkey=dht.peer_id.to_bytes(), value=ours.encode(),
              expiration_time=get_dht_time() + ttl)


class PeerMonitor:
    """Publishes our progress record (each period: heartbeat and progress in one) and watches who
    else is alive: records expire on their own, so a peer that crashed drops out by itself."""

    def __init__(self, dht: DHT, ours: RunManifest, *, period: float, status: Callable[[], ProgressRecord],
                 on_change: Callable[[set[str], set[str]], None]):
        self.dht, self.manifest, self.run_id, self.period = dht, ours, ours.run_id, period
        self._status, self._on_change = status, on_change
        self.peers: dict[str, ProgressRecord] = {}
        self.malformed = 0  # records ignored at the last read (validation failed)
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
        me = str(self.dht.peer_id)
        mine = self._status()
        self.dht.store(peers_key(self.run_id), subkey=self.dht.peer_id.to_bytes(), value=progress.encode(mine),
                       expiration_time=get_dht_time() + self.ttl)
        publish_manifest(self.dht, self.manifest, ttl=max(self.ttl, MANIFEST_TTL))
        # A peer that started the run at the same moment as us may have published an earlier
        # start: everybody converges on the earliest one.
        manifests, _ = read_manifests(self.dht, self.run_id)
        earliest = min((m.start_time for m in manifests if m.config_hash == self.manifest.config_hash),
                       default=self.manifest.start_time)
        if earliest < self.manifest.start_time:
            self.manifest = self.manifest.with_start(earliest)
        found = self.dht.get(peers_key(self.run_id), latest=True)
        live, self.malformed = progress.read_records(found.value if found is not None else None, get_dht_time())
        live[me] = mine
        joined, left = set(live) - set(self.peers), set(self.peers) - set(live)
        self.peers = live
        if joined or left:
            self._on_change(joined, left)
