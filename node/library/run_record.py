"""Where a run's peers find each other: its manifests (schedule + shared config) and progress records.

Every peer of a run publishes its manifest under the run's key and its progress record (heartbeat
and progress in one) under the run's peers key; both expire on their own, so a crashed peer drops
out by itself. ``RunDirectory`` is that seam: ``DhtDirectory`` is hivemind's DHT (real runs),
``node.library.local_network.LocalDirectory`` an in-process one for fast tests of the library and
the process. Everything read back is validated (``protocols.manifest``, ``protocols.progress``)
and malformed entries are counted and ignored.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from hivemind import DHT
from hivemind.utils import get_dht_time

from protocols import manifest, progress
from protocols.keys import peers_key, run_key
from protocols.manifest import RunManifest
from protocols.messages import MessageError
from protocols.progress import ProgressRecord

logger = logging.getLogger(__name__)

MANIFEST_TTL = 600.0  # a run nobody serves any more is forgotten after this


class RunDirectory(Protocol):
    """One run's shared records, as one peer sees them. Used from one thread at a time."""

    run_id: str

    def now(self) -> float:
        """The directory's clock (DHT time), which records' ``time`` and expiry use."""

    def publish_manifest(self, ours: RunManifest, *, ttl: float) -> None: ...

    def manifests(self) -> tuple[list[RunManifest], int]:
        """The valid manifests published for the run and how many malformed ones were ignored."""

    def publish_progress(self, record: ProgressRecord, *, ttl: float) -> None: ...

    def progress(self) -> tuple[dict[str, ProgressRecord], int]:
        """The live peers' valid progress records by peer id, and how many were ignored."""


def decode_manifests(values: list[Any]) -> tuple[list[RunManifest], int]:
    manifests, malformed = [], 0
    for value in values:
        try:
            manifests.append(manifest.decode(value))
        except MessageError as e:
            malformed += 1
            logger.debug(f"ignored a malformed manifest: {e}")
    return manifests, malformed


class DhtDirectory:
    """The run's records in hivemind's DHT, one subkey per peer (its peer id)."""

    def __init__(self, dht: DHT, run_id: str):
        self.dht, self.run_id = dht, run_id

    def now(self) -> float:
        return get_dht_time()

    def publish_manifest(self, ours: RunManifest, *, ttl: float) -> None:
        self.dht.store(run_key(self.run_id), subkey=self.dht.peer_id.to_bytes(), value=ours.encode(),
                       expiration_time=get_dht_time() + ttl)

    def manifests(self) -> tuple[list[RunManifest], int]:
        found = self.dht.get(run_key(self.run_id), latest=True)
        if found is None or not isinstance(found.value, dict):
            return [], 0
        return decode_manifests([getattr(item, "value", None) for item in found.value.values()])

    def publish_progress(self, record: ProgressRecord, *, ttl: float) -> None:
        self.dht.store(peers_key(self.run_id), subkey=self.dht.peer_id.to_bytes(), value=progress.encode(record),
                       expiration_time=get_dht_time() + ttl)

    def progress(self) -> tuple[dict[str, ProgressRecord], int]:
        found = self.dht.get(peers_key(self.run_id), latest=True)
        return progress.read_records(found.value if found is not None else None, get_dht_time())


def join_run(directory: RunDirectory, ours: RunManifest, *, record_ttl: float) -> RunManifest:
    """Adopt the run's schedule (earliest published start) or start the run; refuse a run whose
    manifest differs from ours (``ConfigError`` naming the field) before averaging anything."""
    theirs, _ = directory.manifests()
    for other in theirs:
        manifest.check_compatible(ours, other)
    start_time = min((m.start_time for m in theirs), default=directory.now())
    joined = ours.with_start(start_time)
    directory.publish_manifest(joined, ttl=record_ttl)
    return joined
