"""The entry point behind ``shoal bootstrap``: a light DHT-only peer that serves as a swarm's public entry point.

It holds no model and no GPU, so it can run for months on a small VPS; with ``--identity`` its
peer id (and so its multiaddr) survives restarts, which is what makes it worth publishing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from node.library.atomic import write_atomically
from node.library.cleanup import hivemind_sockets
from node.library.dht import RecordRules, dht_peer_count, shutdown_dht, start_dht
from protocols.addresses import format_join_command, parse_peer_multiaddr
from protocols.errors import ConfigError, NetworkError

logger = logging.getLogger(__name__)

PEER_FILE_POLL_S = 0.5


def write_address_file(path: Path, maddrs: list[str]) -> None:
    """Write our multiaddrs, one per line, atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(f"{m}\n" for m in maddrs).encode())


def expand_initial_peers(values: list[str], *, timeout: float, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """``--initial-peer`` values, where ``@FILE`` stands for the addresses listed in FILE (one per
    line, ``#`` comments allowed), e.g. a bootstrap peer's ``--address-file`` on a shared volume.
    A file that does not exist yet is waited for up to ``timeout`` seconds."""
    peers: list[str] = []
    for value in values:
        if not value.startswith("@"):
            peers.append(parse_peer_multiaddr(value))
            continue
        path = Path(value[1:]).expanduser()
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() >= deadline:
                raise ConfigError(f"--initial-peer {value}: {path} did not appear within {timeout:.0f}s; "
                                  "start the bootstrap peer with --address-file pointing there, or pass the address")
            sleep(PEER_FILE_POLL_S)
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--initial-peer {value}: cannot read {path}: {e}") from None
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ConfigError(f"--initial-peer {value}: {path} lists no address; write one multiaddr per line")
        peers += [parse_peer_multiaddr(line, f"--initial-peer {value}") for line in found]
    return list(dict.fromkeys(peers))


class BootstrapPeer:
    """The DHT node behind ``shoal bootstrap``; ``serve`` blocks until ``stop`` is set."""

    def __init__(self, *, listen: list[str], announce: list[str], identity: Path | None,
                 initial_peers: list[str], timeout: float, rules: RecordRules = RecordRules()):
        self._sockets_before = hivemind_sockets()
        self.dht = start_dht(initial_peers=initial_peers, listen=listen, announce=announce, timeout=timeout,
                             identity=identity, rules=rules)
        self.peer_id = str(self.dht.peer_id)
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        if not self.maddrs:
            self.close()
            raise NetworkError("the bootstrap peer has no address others can dial; pass --listen /ip4/0.0.0.0/tcp/PORT")

    def join_line(self) -> str:
        return format_join_command(self.maddrs)

    def serve(self, stop: threading.Event, *, report_every: float = 60.0,
              on_tick: Callable[[int], None] | None = None, tick: float = 5.0) -> None:
        last_report = time.monotonic()
        while not stop.wait(tick):
            try:
                known = dht_peer_count(self.dht)
            except Exception as e:  # noqa: BLE001 - a DHT hiccup is reported, never fatal
                logger.warning(f"bootstrap: cannot read the routing table: {e!r}")
                continue
            if on_tick is not None:
                on_tick(known)
            if time.monotonic() - last_report >= report_every:
                logger.info(f"bootstrap {self.peer_id}: {known} peers in the routing table")
                last_report = time.monotonic()

    def close(self) -> None:
        shutdown_dht(self.dht, self._sockets_before)
