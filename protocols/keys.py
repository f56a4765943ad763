"""DHT keys, all namespaced by the run id so that peers of different runs never meet."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

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
                          f"{MAX_PROGRESS_SHARDS}, or \"{AUTO_SHARDS}\" (the count follows the swarm's size: "
                          "docs/scale.md)")
    return shards


def validate_shards_setting(setting: int | str) -> int | str:
    """``averaging.progress_shards`` as a run sets it: a fixed count, or ``"auto"``."""
    return setting if setting == AUTO_SHARDS else validate_progress_shards(setting)


# ``averaging.progress_shards = "auto"``: every peer picks how many keys it writes under from the
# live peers it counts (``auto_progress_shards``) and publishes that count in its record; a reader
# reads every key below the highest count it finds published (``shards_to_read``). Counts are powers
# of two and a peer writes to ``hash % count``, so a writer at any count up to the reader's lands in
# a key the reader reads: peers need not agree on the count, and none is missed while it changes.
AUTO_SHARDS = "auto"
# One key below AUTO_MIN_PEERS; from there about one key per PEERS_PER_SHARD peers: below 48 peers
# sharding costs the median peer more than it saves the busiest node (docs/scale.md).
AUTO_MIN_PEERS = 48
PEERS_PER_SHARD = 12
# A count comes down only once the swarm is this fraction below the size that raised it, so a
# swarm near a boundary does not move every record back and forth with each join and leave.
AUTO_SHRINK_BELOW = 0.75
READ_CEILING = 4  # a reader follows published counts up to this multiple of its own (shards_to_read)


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(x).bit_length() - 1) if x >= 1 else 1


def auto_progress_shards(live_peers: int, current: int = 1) -> int:
    """The count a peer writes under in an ``"auto"`` run, from the live peers it counts and its
    current count: 1 below ``AUTO_MIN_PEERS``, then the power of two at most ``live / PEERS_PER_SHARD``
    (48-95 peers: 4, 96-191: 8, ... 768 and up: 64). It rises at once and falls only once the
    swarm shrank ``AUTO_SHRINK_BELOW`` under the size that gives ``current``. Pure."""
    target = 1 if live_peers < AUTO_MIN_PEERS else min(MAX_PROGRESS_SHARDS, _pow2_floor(live_peers / PEERS_PER_SHARD))
    if target >= current:
        return target
    raised_at = max(AUTO_MIN_PEERS, PEERS_PER_SHARD * current)
    return target if live_peers < AUTO_SHRINK_BELOW * raised_at else current


def shards_to_read(own: int, published: Iterable[int | None], live_peers: int) -> int:
    """How many keys (from 0) a reader of an ``"auto"`` run reads: up to the highest count a record
    publishes, so that it finds every writer. A published count is taken up to ``READ_CEILING`` x
    what the reader's own count of live peers gives (``auto_progress_shards``): a stranger's record
    claiming 64 cannot make every peer of a small swarm look up 64 keys a heartbeat, while an honest
    count, one step above ours (x4 at 48 peers, x2 after), is always followed. A reader that sees
    part of the swarm (a joiner's first read) reads again with what it learnt until the count holds
    (``DhtDirectory.progress``). Pure."""
    ceiling = READ_CEILING * max(own, auto_progress_shards(live_peers, own))
    highest = max((count for count in published if count is not None), default=1)
    return min(MAX_PROGRESS_SHARDS, max(own, min(highest, ceiling)))


def progress_shard(peer_id: str, shards: int) -> int:
    """Which of the run's ``shards`` progress keys ``peer_id`` publishes under: a stable hash, so
    every peer puts its record in one place and the records spread evenly."""
    digest = hashlib.blake2b(peer_id.encode(), digest_size=8, person=b"shoal-progress").digest()
    return int.from_bytes(digest, "big") % validate_progress_shards(shards)


def averager_prefix(run_id: str) -> str:
    """hivemind averager prefix: its matchmaking keys live under it (hivemind forbids '.' here)."""
    return f"shoal-{validate_run_id(run_id)}-outer"
