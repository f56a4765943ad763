"""Peers as threads of one process: the in-process ``Network`` for fast tests of the library and
of ``shoal run``'s process.

A ``LocalSwarmHub`` is the "internet": an exact averaging hub (``averaging.network.local``) and a
record store with expiry per run. Records go through the same encoding and validation as over the
DHT (``protocols.progress``, ``protocols.manifest``). Peer ids are real libp2p ids (sha256
multihashes of the peer's name), so everything that validates a peer id accepts them. Integration
tests always use hivemind.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import base58
from hivemind.p2p import PeerID

from averaging.math.wire import LATTICE_CODE
from averaging.network.interface import AveragingBackend, StateProvider, UpdateProvider
from averaging.network.local import LocalBackend, LocalHub
from node.library.config import AveragingConfig
from node.library.run_record import RunDirectory, decode_manifests
from protocols import progress
from protocols.keys import validate_shards_setting
from protocols.manifest import RunManifest
from protocols.progress import ProgressRecord


def local_peer_id(name: str) -> str:
    """A valid libp2p peer id (base58 sha256 multihash) for a local peer called ``name``."""
    return base58.b58encode(b"\x12\x20" + hashlib.sha256(name.encode()).digest()).decode()


@dataclass(frozen=True, slots=True)
class _Stored:
    value: Any
    expiration_time: float


class LocalSwarmHub:
    """Where in-process peers meet. ``clock`` is the shared DHT-time stand-in."""

    def __init__(self, *, min_group_size: int = 2, matchmaking_s: float = 0.5, clock: Callable[[], float] = time.time):
        self.averaging = LocalHub(min_group_size=min_group_size, matchmaking_s=matchmaking_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._tables: dict[tuple[str, str], dict[str, _Stored]] = {}  # (run, kind) -> peer id -> value

    def store(self, run_id: str, kind: str, peer_id: str, value: Any, ttl: float) -> None:
        with self._lock:
            self._tables.setdefault((run_id, kind), {})[peer_id] = _Stored(value, self.clock() + ttl)

    def read(self, run_id: str, kind: str) -> dict[str, _Stored]:
        with self._lock:
            return dict(self._tables.get((run_id, kind), {}))

    def forget(self, peer_id: str) -> None:
        """A peer that crashed: its records vanish (as if they had expired)."""
        with self._lock:
            for table in self._tables.values():
                table.pop(peer_id, None)


class LocalDirectory:
    organise_pause_s = 0.2  # a store is seen at once in-process (run_record.join_run)

    def __init__(self, hub: LocalSwarmHub, run_id: str, peer_id: str):
        self.hub, self.run_id, self.peer_id = hub, run_id, peer_id

    def now(self) -> float:
        return self.hub.clock()

    def publish_manifest(self, ours: RunManifest, *, ttl: float) -> None:
        self.hub.store(self.run_id, "manifest", self.peer_id, ours.signed_value(), ttl)

    def manifests(self) -> tuple[list[RunManifest], int]:
        now = self.now()
        return decode_manifests([item.value for item in self.hub.read(self.run_id, "manifest").values()
                                 if item.expiration_time >= now])

    def refusal(self) -> str | None:
        return None  # an in-process swarm has no swarm key

    def clock_samples(self, peer_ids: list[str]) -> list:
        return []  # peers in one process share its clock

    def reconnect(self, targets: list[tuple[str, tuple[str, ...]]]) -> Future:
        done: Future = Future()
        done.set_result([])  # one in-process hub: nobody is ever cut off
        return done

    def publish_progress(self, record: ProgressRecord, *, ttl: float) -> None:
        self.hub.store(self.run_id, "progress", self.peer_id, progress.encode(record), ttl)

    def progress(self) -> tuple[dict[str, ProgressRecord], int]:
        # Keyed like the DHT (peer id bytes as subkeys), so the same validating reader runs.
        found = {PeerID.from_base58(peer).to_bytes(): item for peer, item in self.hub.read(self.run_id, "progress").items()}
        return progress.read_records(found, self.now())

    def use_progress_shards(self, shards: int | str) -> None:
        """Nothing to spread: one in-process hub serves every read (``DhtDirectory`` shards DHT keys)."""
        validate_shards_setting(shards)


class LocalNetwork:
    """One in-process peer's network (no processes, no sockets)."""

    def __init__(self, hub: LocalSwarmHub, name: str):
        self.hub = hub
        self.peer_id = local_peer_id(name)
        self.maddrs: list[str] = []

    def directory(self, run_id: str) -> RunDirectory:
        return LocalDirectory(self.hub, run_id, self.peer_id)

    def backend(self, *, run_id: str, numel: int, state_provider: StateProvider, averaging: AveragingConfig,
                client_mode: bool, update_provider: UpdateProvider | None = None,
                share_state: bool = True, extra_numel: int = 0, extra_code: str = "bf16") -> AveragingBackend:
        # (the hub averages extra vectors exactly, whatever their code, except as a sub-group's view
        # says: far members left out, the lattice code's residues: averaging.network.local)
        wire = averaging.wire
        if wire.quantized:  # reducers return deltas in the return code: each member ends slightly apart
            self.hub.averaging.return_code = wire.return_code
        mixing = bool(averaging.target_group_size)  # sub-groups: the extra vector leads with the anchors
        backend = LocalBackend(self.hub.averaging, self.peer_id, state_provider, update_provider,
                               far_state_numel=numel if mixing and extra_numel else 0,
                               lattice=mixing and extra_code == LATTICE_CODE)
        backend.share_state(share_state)
        return backend

    def pids(self) -> list[int | None]:
        return []

    def dead(self) -> str | None:
        return None  # no processes of its own

    def close(self) -> None:
        self.hub.forget(self.peer_id)
