"""DHT keys, all namespaced by the run id so that peers of different runs never meet."""

from __future__ import annotations

import hashlib
import re

from protocols.errors import ConfigError

# Past a few hundred peers one progress key is read N times a heartbeat, N records each, from the
# same 5 replicas; ``progress_shards`` spreads the records over that many keys (docs/scale.md).
MAX_PROGRESS_SHARDS = 64

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"run id {run_id!r} is invalid; use 1-64 letters, digits, '_' or '-' (starting with a letter or digit)"
        )
    return run_id


def run_key(run_id: str) -> str:
    """Where peers publish the run record (round schedule and the config they must share)."""
    return f"shoal.{validate_run_id(run_id)}.run"


def peers_key(run_id: str, shard: int = 0) -> str:
    """Where every live peer publishes an expiring heartbeat, keyed by its peer id: shard 0 is the
    run's one key when its records are not sharded (the key every shoal has used)."""
    if not 0 <= shard < MAX_PROGRESS_SHARDS:
        raise ValueError(f"progress shard {shard} is outside [0, {MAX_PROGRESS_SHARDS})")
    suffix = f".{shard}" if shard else ""
    return f"shoal.{validate_run_id(run_id)}.peers{suffix}"


def validate_progress_shards(shards: int) -> int:
    """A power of two in [1, MAX_PROGRESS_SHARDS] (``ConfigError`` naming the fix otherwise)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_PROGRESS_SHARDS \
            or shards & (shards - 1):
        raise ConfigError(f"averaging.progress_shards ({shards!r}) must be a power of two from 1 to "
                          f"{MAX_PROGRESS_SHARDS} (1 below about 48 peers, then about one per 16: docs/scale.md)")
    return shards


def progress_shard(peer_id: str, shards: int) -> int:
    """Which of the run's ``shards`` progress keys ``peer_id`` publishes under: a stable hash, so
    every peer puts its record in one place and the records spread evenly."""
    digest = hashlib.blake2b(peer_id.encode(), digest_size=8, person=b"shoal-progress").digest()
    return int.from_bytes(digest, "big") % validate_progress_shards(shards)


def averager_prefix(run_id: str) -> str:
    """hivemind averager prefix: its matchmaking keys live under it (hivemind forbids '.' here)."""
    return f"shoal-{validate_run_id(run_id)}-outer"
