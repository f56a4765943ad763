"""The progress record every peer publishes to the DHT (its heartbeat), and how others read it.

Each live peer stores one ``ProgressRecord`` under ``protocols.keys.peers_key(run_id)`` with its
peer id bytes as the subkey and a short expiration, so the records of a peer that vanished
drop out by themselves. ``shoal status``, the live view and the metrics exporter read them.

A record comes from another machine, possibly a broken or hostile one: ``decode`` checks every
field (types, bounds, finiteness, string lengths, printable text — a device name is drawn on
other people's terminals) and raises ``MessageError``; ``read_records`` turns a whole DHT answer
into valid records and a count of the malformed ones, and never raises.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import PeerID

from protocols.addresses import _peer_id_problem, parse_peer_multiaddr, peer_id_of
from protocols.errors import AddressError
from protocols.keys import MAX_PROGRESS_SHARDS
from protocols.messages import MAX_ROUND, MessageError, bounded_int

PROGRESS_VERSION = 1
MODES = ("full", "client", "relay")
MAX_TEXT = 64  # characters in device / version / phase
MAX_COUNT = 2**62  # bytes and tokens: far beyond any real run, well inside msgpack's int64
MAX_RATE = 1e12  # tokens/s: a million times a large GPU
MAX_LOSS = 1e6
MAX_TIME = 2.0**40  # unix seconds, ~36 800 years
MAX_SUBKEY_BYTES = 64
MAX_SHARDS = 2**16
ROUND_BYTES = ("round_bytes_sent", "round_bytes_received")
MAX_LATENESS = 86400.0  # seconds a sync may end after its deadline (a round is at most a day)
MAX_CLOCK_OFFSET = 3600.0  # protocols.swarm_time.MAX_OFFSET_S: no peer corrects its clock further
MAX_ADDRS = 8  # addresses a record may list (a peer announces a few: one per interface and transport)
MAX_ADDR_CHARS = 256
MAX_GROUPS = 1024  # averaging sub-groups a round may have (averaging.math.groups: a power of two)


@dataclass(frozen=True, slots=True)
class ProgressRecord:
    """One peer's view of itself, as published to the DHT."""

    peer_id: str  # base58; not encoded: it is the DHT subkey
    round: int  # the round the peer is training in
    tokens_per_s: float
    loss: float | None  # recent mean inner training loss
    eval_loss: float | None  # held-out loss of the shared model, if evaluated
    device: str  # e.g. "cuda:0 (RTX 4090)", "cpu"
    utilization: float  # share of wall time spent computing, 0..1
    bytes_sent: int  # cumulative, this process
    bytes_received: int
    mode: str  # full | client | relay
    version: str  # shoal version
    tokens: int  # tokens this peer has contributed to the run
    time: float  # DHT time at which the record was published
    phase: str  # training | averaging | joining | leaving | ...
    shard: int | None = None  # the data shard it trains on (None: not claimed, e.g. an older peer)
    # The last finished round's all-reduce payload (0: none ran); None in records of older peers.
    round_bytes_sent: int | None = None
    round_bytes_received: int | None = None
    # How long after their round's deadline this peer's syncs end (EMA, seconds); None: not measured.
    sync_late_s: float | None = None
    # Outer steps applied to the peer's shared model (0: still the run's initial weights, which
    # every peer builds from the run's seed); None in records of older peers.
    rounds_done: int | None = None
    # Seconds this peer's clock is behind the swarm's (negative: ahead), as it measured
    # (``protocols.swarm_time``); None: not measured yet, or an older peer.
    clock_offset_s: float | None = None
    # Where the peer can be dialled (its visible multiaddrs, each ending in its own /p2p/ id), so
    # that others can find it again after an outage (``node.library.rediscovery``); None: not
    # dialable (client mode) or an older peer.
    addrs: tuple[str, ...] | None = None
    # How many averaging sub-groups this peer split its last round into (``averaging.math.groups``:
    # the next round's count follows what most peers used); None: one group of everybody, or an older peer.
    group_count: int | None = None
    # How many DHT keys this peer's record is spread over in an ``averaging.progress_shards = "auto"``
    # run (``protocols.keys.auto_progress_shards``): readers read every key below the highest count
    # published; None: a fixed count (the manifest's), or an older peer.
    progress_shards: int | None = None


def encode(record: ProgressRecord) -> dict[str, Any]:
    """The msgpack-able value to store; ``peer_id`` is the subkey, so it is left out.

    ``round`` keeps its name and type: older readers of the heartbeat only look at it.
    """
    return {
        "v": PROGRESS_VERSION,
        "round": record.round,
        "tokens_per_s": record.tokens_per_s,
        "loss": record.loss,
        "eval_loss": record.eval_loss,
        "device": record.device,
        "utilization": record.utilization,
        "bytes_sent": record.bytes_sent,
        "bytes_received": record.bytes_received,
        "mode": record.mode,
        "version": record.version,
        "tokens": record.tokens,
        "time": record.time,
        "phase": record.phase,
        **({"shard": record.shard} if record.shard is not None else {}),
        # New keys, optional: older readers ignore them, and older records lack them.
        **{key: getattr(record, key) for key in ROUND_BYTES if getattr(record, key) is not None},
        **({"sync_late_s": record.sync_late_s} if record.sync_late_s is not None else {}),
        **({"rounds_done": record.rounds_done} if record.rounds_done is not None else {}),
        **({"clock_offset_s": record.clock_offset_s} if record.clock_offset_s is not None else {}),
        **({"addrs": list(record.addrs)} if record.addrs is not None else {}),
        **({"group_count": record.group_count} if record.group_count is not None else {}),
        **({"progress_shards": record.progress_shards} if record.progress_shards is not None else {}),
    }


def _addrs(obj: dict, peer_id: str) -> tuple[str, ...] | None:
    """The record's dialable addresses: each a valid peer multiaddr whose last /p2p/ part is the
    record's own peer id (a record signed by one key cannot send us dialling someone else)."""
    value = obj.get("addrs")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_ADDRS:
        raise MessageError(f"addrs: expected a list of at most {MAX_ADDRS} addresses")
    out = []
    for text in value:
        if not isinstance(text, str) or len(text) > MAX_ADDR_CHARS:
            raise MessageError(f"addrs: expected strings of at most {MAX_ADDR_CHARS} characters")
        try:
            normalized = parse_peer_multiaddr(text, flag="addrs")
        except AddressError as e:
            raise MessageError(str(e)[:160]) from None
        if peer_id_of(normalized) != peer_id:
            raise MessageError("addrs: an address of another peer")
        out.append(normalized)
    return tuple(out)


def _power_of_two(obj: dict, key: str, high: int) -> int | None:
    """An optional power of two up to ``high`` (a sub-group count, a key count), or None."""
    if obj.get(key) is None:
        return None
    count = bounded_int(obj, key, 1, high)
    if count & (count - 1):
        raise MessageError(f"{key}: expected a power of two, got {count}")
    return count


def _number(obj: dict, key: str, low: float, high: float, *, optional: bool = False) -> float | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MessageError(f"{key}: expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or not low <= value <= high:
        raise MessageError(f"{key}: expected a finite number in [{low:g}, {high:g}], got {value!r:.40}")
    return value


def _text(obj: dict, key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise MessageError(f"{key}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_TEXT:
        raise MessageError(f"{key}: longer than {MAX_TEXT} characters")
    if not value.isprintable():  # no escape sequences or newlines on somebody else's terminal
        raise MessageError(f"{key}: contains control characters")
    return value


def decode(peer_id: str, value: Any) -> ProgressRecord:
    """Validate a received record; ``MessageError`` says what is wrong. Unknown keys are ignored
    (a newer peer may add fields without changing the version)."""
    if not isinstance(value, dict):
        raise MessageError("progress record is not a map")
    if value.get("v") != PROGRESS_VERSION:
        raise MessageError(f"progress record version {value.get('v')!r:.20}, expected {PROGRESS_VERSION}")
    mode = _text(value, "mode")
    if mode not in MODES:
        raise MessageError(f"mode: expected one of {MODES}, got {mode!r}")
    return ProgressRecord(
        peer_id=peer_id,
        round=bounded_int(value, "round", 0, MAX_ROUND),
        tokens_per_s=_number(value, "tokens_per_s", 0.0, MAX_RATE),
        loss=_number(value, "loss", 0.0, MAX_LOSS, optional=True),
        eval_loss=_number(value, "eval_loss", 0.0, MAX_LOSS, optional=True),
        device=_text(value, "device"),
        utilization=_number(value, "utilization", 0.0, 1.0),
        bytes_sent=bounded_int(value, "bytes_sent", 0, MAX_COUNT),
        bytes_received=bounded_int(value, "bytes_received", 0, MAX_COUNT),
        mode=mode,
        version=_text(value, "version"),
        tokens=bounded_int(value, "tokens", 0, MAX_COUNT),
        time=_number(value, "time", 0.0, MAX_TIME),
        phase=_text(value, "phase"),
        shard=bounded_int(value, "shard", 0, MAX_SHARDS - 1) if value.get("shard") is not None else None,
        **{key: bounded_int(value, key, 0, MAX_COUNT) for key in ROUND_BYTES if value.get(key) is not None},
        sync_late_s=_number(value, "sync_late_s", -MAX_LATENESS, MAX_LATENESS, optional=True),
        rounds_done=bounded_int(value, "rounds_done", 0, MAX_ROUND) if value.get("rounds_done") is not None else None,
        clock_offset_s=_number(value, "clock_offset_s", -MAX_CLOCK_OFFSET, MAX_CLOCK_OFFSET, optional=True),
        addrs=_addrs(value, peer_id),
        # what every peer derives its group from; how many keys its writer's records spread over
        group_count=_power_of_two(value, "group_count", MAX_GROUPS),
        progress_shards=_power_of_two(value, "progress_shards", MAX_PROGRESS_SHARDS),
    )


def peer_id_from_subkey(subkey: Any) -> str:
    """The base58 peer id a DHT subkey names, or ``MessageError`` if it is not a libp2p peer id."""
    if not isinstance(subkey, bytes) or not 0 < len(subkey) <= MAX_SUBKEY_BYTES:
        raise MessageError("subkey is not a peer id")
    peer_id = PeerID(subkey).to_base58()
    if (problem := _peer_id_problem(peer_id)) is not None:
        raise MessageError(f"subkey: {problem}")
    return peer_id


def read_records(found: Any, now: float) -> tuple[dict[str, ProgressRecord], int]:
    """Valid, unexpired records by peer id, and how many entries were malformed.

    ``found`` is the ``.value`` of ``dht.get(peers_key(run_id), latest=True)``: a map from subkey
    bytes to ``ValueWithExpiration``. Expired entries are skipped silently (a peer that left);
    anything malformed is counted, never raised. Pure: no DHT, no clock.
    """
    if found is None:
        return {}, 0
    if not isinstance(found, Mapping):
        return {}, 1  # somebody stored a plain value under the subkeyed key
    records: dict[str, ProgressRecord] = {}
    malformed = 0
    for subkey, item in found.items():
        expiration = getattr(item, "expiration_time", None)
        if isinstance(expiration, bool) or not isinstance(expiration, (int, float)) or not hasattr(item, "value"):
            malformed += 1
            continue
        if expiration < now:
            continue
        try:
            peer_id = peer_id_from_subkey(subkey)
            records[peer_id] = decode(peer_id, item.value)
        except MessageError:
            malformed += 1
    return records, malformed


@dataclass(frozen=True, slots=True)
class SwarmSummary:
    """What a set of progress records says about the swarm as a whole."""

    peers: int
    tokens_per_s: float  # sum over peers
    round: int | None  # the round most peers are in (ties: the latest); None without records
    tokens: int  # contributed so far, all peers
    loss: float | None  # mean of the peers' reported training losses
    eval_loss: float | None

    @classmethod
    def of(cls, records: Iterable[ProgressRecord]) -> SwarmSummary:
        """This peer's share of the rate is ``SwarmThroughput``'s (with its live rate)."""
        records = list(records)
        total = sum(r.tokens_per_s for r in records)
        rounds = Counter(r.round for r in records)
        common = max(rounds.items(), key=lambda item: (item[1], item[0]))[0] if rounds else None
        return cls(
            peers=len(records),
            tokens_per_s=total,
            round=common,
            tokens=sum(r.tokens for r in records),
            loss=_mean(r.loss for r in records),
            eval_loss=_mean(r.eval_loss for r in records),
        )


@dataclass(frozen=True, slots=True)
class SwarmThroughput:
    """This peer's tokens/s beside the swarm's: what the other live peers add to it."""

    mine: float  # this peer's rate
    others: float  # sum over the other peers' records
    other_peers: int  # how many records ``others`` sums

    @property
    def total(self) -> float:
        return self.mine + self.others

    @property
    def share(self) -> float | None:
        """This peer's fraction of ``total`` (None: nothing measured yet, rather than a division by zero)."""
        return self.mine / self.total if self.total > 0 else None

    @classmethod
    def of(cls, records: Iterable[ProgressRecord], *, me: str, mine: float | None = None) -> SwarmThroughput:
        """``records``: the live peers', as ``read_records`` returns them (expired entries dropped,
        malformed ones refused, so each rate is finite and at most ``MAX_RATE``). ``mine``: this
        peer's current rate, which its own record repeats a heartbeat late; None: take the record's."""
        records = list(records)
        others = [r.tokens_per_s for r in records if r.peer_id != me]
        if mine is None:
            mine = next((r.tokens_per_s for r in records if r.peer_id == me), 0.0)
        return cls(mine=mine, others=sum(others), other_peers=len(others))


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
