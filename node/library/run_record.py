"""The run record: every peer of a run publishes its manifest (schedule + shared config) under
the run's DHT key; a joiner adopts the earliest start and is refused if its config differs.
"""

from __future__ import annotations

import logging

from hivemind import DHT
from hivemind.utils import get_dht_time

from protocols import manifest
from protocols.keys import run_key
from protocols.manifest import RunManifest
from protocols.messages import MessageError

logger = logging.getLogger(__name__)

MANIFEST_TTL = 600.0  # a run nobody serves any more is forgotten after this


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
