"""Where a run's peers find each other: its manifests (schedule + shared config) and progress records.

Every peer of a run publishes its manifest under the run's key and its progress record (heartbeat
and progress in one) under the run's peers key; both expire on their own, so a crashed peer drops
out by itself. ``RunDirectory`` is that seam: ``DhtDirectory`` is hivemind's DHT (real runs),
``node.library.local_network.LocalDirectory`` an in-process one for fast tests of the library and
the process. Everything read back is validated (``protocols.manifest``, ``protocols.progress``)
and malformed entries are counted and ignored; in the DHT, ``protocols.records`` has already
refused what is not signed by its owner.

Whose schedule to follow (``RunTrust``): only manifests signed by the run's organiser key count.
A peer pinned to a key (``--run-key``, or a key it trusted on first use and saved) ignores every
other manifest; an unpinned joiner trusts the one organiser it finds (and saves the key), and
refuses to guess when several organisers publish the run. A peer that finds no manifest
organises the run itself, with a new key.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from hivemind import DHT
from hivemind.p2p import PeerID

from node.library import rediscovery, swarm_clock
from node.library.atomic import write_atomically
from protocols import manifest, progress, records, swarm_time
from protocols.errors import ConfigError, NetworkError
from protocols.identity import RunKey, format_run_key, peer_id_of
from protocols.keys import (
    AUTO_SHARDS,
    READ_CEILING,
    auto_progress_shards,
    peers_key,
    progress_shard,
    run_key,
    shards_to_read,
    validate_shards_setting,
)
from protocols.manifest import RunManifest
from protocols.messages import MessageError
from protocols.progress import ProgressRecord
from protocols.swarm_time import ClockSample

logger = logging.getLogger(__name__)

MANIFEST_TTL = records.MANIFEST_TTL  # a run nobody serves any more is forgotten after this
ORGANISE_PAUSE_S = 3.0  # at most this long a peer that finds no manifest looks again before organising
SETTLE_S = 10.0  # how long a joiner waits for several organisers of a run to converge to one
ADOPT_PERIOD_S = 60.0  # a new organiser may still switch to another organiser's schedule this long...
ADOPT_WINDOW_S = 60.0  # ...if it starts within this many seconds of its own (peers started at once)


@dataclass(kw_only=True, slots=True)
class RunTrust:
    """Which organiser's manifests this peer believes, and where it keeps what it decided."""

    pinned: bytes | None = None  # --run-key, or a key trusted on first use
    explicit: bool = False  # pinned by the user (never changes) rather than on first use
    pin_file: Path | None = None  # where a key trusted on first use is saved and read back
    organiser_file: Path | None = None  # where our own organiser key is kept, if we organise
    organised_at: float | None = None  # when we organised the run ourselves (directory time)
    organiser_key: RunKey | None = field(default=None, repr=False)
    # Told (key, open_until) whenever the pin changes: our DHT node's validator, which then stores
    # only that organiser's manifests (``DhtDirectory.follow_organiser``); set by ``join_run``.
    # Runs on the thread that pins (join_run's, then the monitor's): the one that calls the DHT.
    on_pin: Callable[[bytes, float | None], None] | None = field(default=None, repr=False)
    started_with: bytes | None = field(default=None, init=False)  # ``pinned`` at start: the one key we may switch to
    rivals_told: set[bytes] = field(default_factory=set, init=False, repr=False)  # other organisers we warned of

    def __post_init__(self):
        if self.pinned is None and self.pin_file is not None and self.pin_file.exists():
            self.pinned = self.pin_file.read_bytes()[:32] or None
        self.started_with = self.pinned

    def may_adopt(self, key: bytes) -> bool:
        """Whether ``converge`` may switch to a manifest ``key`` signed: only to the key this peer was
        started with (``--run-key`` or the saved pin), which its operator chose; never to one met in
        the swarm, which anybody can make."""
        return self.started_with is not None and key == self.started_with

    def pin(self, key: bytes) -> None:
        if self.pinned != key:
            logger.info(f"trusting run key {format_run_key(key)} from now on")
        self.pinned = key
        if self.pin_file is not None:
            self.pin_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.pin_file, key)
        if self.on_pin is not None:
            self.on_pin(key, self.open_until())

    def open_until(self) -> float | None:
        """Until when (directory time) our DHT node still stores other organisers' manifests: while
        ``converge`` may still switch a new organiser to one of them. None: never (a joiner)."""
        return self.organised_at + ADOPT_PERIOD_S if self.organised_at is not None else None

    def our_key(self) -> RunKey:
        """Our organiser key: read back from ``organiser_file``, or made (and saved there)."""
        if self.organiser_key is None:
            path = self.organiser_file
            if path is not None and path.exists():
                self.organiser_key = RunKey.from_bytes(path.read_bytes())
            else:
                self.organiser_key = RunKey.generate()
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_atomically(path, self.organiser_key.to_bytes())
                    path.chmod(0o600)
        return self.organiser_key


class RunDirectory(Protocol):
    """One run's shared records, as one peer sees them. Used from one thread at a time."""

    run_id: str

    def now(self) -> float:
        """The directory's clock (DHT time), which records' ``time`` and expiry use."""

    def publish_manifest(self, ours: RunManifest, *, ttl: float) -> None:
        """Publish a signed manifest (ours or the organiser's we follow) under our own subkey."""

    def manifests(self) -> tuple[list[RunManifest], int]:
        """The valid signed manifests published for the run and how many malformed ones were ignored."""

    def publish_progress(self, record: ProgressRecord, *, ttl: float) -> None: ...

    def clock_samples(self, peer_ids: list[str]) -> list[ClockSample]:
        """Clock readings of these peers (``node.library.swarm_clock``), [] where time is shared."""

    def reconnect(self, targets: list[tuple[str, tuple[str, ...]]]) -> Future:
        """Dial these (peer id, addresses) and refresh routing, in the background
        (``node.library.rediscovery``): a future of the peers reached."""

    def progress(self) -> tuple[dict[str, ProgressRecord], int]:
        """The live peers' valid progress records by peer id, and how many were ignored."""

    def use_progress_shards(self, shards: int | str) -> None:
        """Write and read the progress records under the run's ``shards`` keys (its manifest's
        ``averaging.progress_shards``: a count, or ``"auto"``), from now on."""

    def refusal(self) -> str | None:
        """Why the swarm refuses this peer (e.g. a private swarm and no swarm key), or None."""

    # Optional (``join_run`` looks it up): a directory whose records pass a validator of ours has
    # ``follow_organiser(key, open_until)``, telling it whose manifests to store from now on.


def decode_manifests(values: list[Any], now: float | None = None) -> tuple[list[RunManifest], int]:
    """Signed manifests; with ``now``, also those whose schedule cannot be real are dropped."""
    manifests, malformed = [], 0
    for value in values:
        try:
            theirs = manifest.decode_signed(value)
            if now is not None:
                manifest.check_schedule(theirs, now)
            manifests.append(theirs)
        except MessageError as e:
            malformed += 1
            logger.debug(f"ignored a malformed manifest: {e}")
    return manifests, malformed


class DhtDirectory:
    """The run's records in hivemind's DHT, one subkey per peer: its libp2p public key, which
    ``protocols.records`` checks signed the record. ``owner`` None: read-only (``shoal status``).

    Progress records live under one key, or under ``shards`` keys (``use_progress_shards``): each
    peer writes to the one its id hashes to (``protocols.keys.progress_shard``) and reads them all,
    at once. Why: every lookup collects the key's records from the nodes nearest it, so with one key
    its 5 replicas serve every peer's read of all N records; with S keys each replica serves N / S.
    In an ``"auto"`` run the count we write under follows the live peers we read
    (``protocols.keys.auto_progress_shards``) and rides our record, and we read every key below the
    highest count published (``shards_to_read``)."""

    def __init__(self, dht: DHT, run_id: str, owner: bytes | None = None):
        self.dht, self.run_id, self.owner = dht, run_id, owner
        self.shards = 1  # the keys we write under
        self.read_shards = 1  # the keys our next read covers
        self.auto = False

    def use_progress_shards(self, shards: int | str) -> None:
        """The run's ``averaging.progress_shards``: a fixed count, or ``"auto"`` (from one key up)."""
        setting = validate_shards_setting(shards)
        self.auto = setting == AUTO_SHARDS
        if not self.auto:
            self.shards = self.read_shards = setting
        else:
            # The next read looks at READ_CEILING keys at least: it learns the counts from the records
            # it finds, and in a small sharded swarm key 0 alone may hold nobody's (4 writers at 4
            # keys all miss it a third of the time). Reads after it follow the counts
            # (``shards_to_read``). So also for a peer that read key 0 alone while it joined.
            self.read_shards = max(self.read_shards, READ_CEILING)

    def now(self) -> float:
        return swarm_time.now()

    def publish_manifest(self, ours: RunManifest, *, ttl: float) -> None:
        assert self.owner is not None, "a read-only directory publishes nothing"
        self.dht.store(run_key(self.run_id), subkey=self.owner, value=ours.signed_value(),
                       expiration_time=swarm_time.now() + ttl)

    def manifests(self) -> tuple[list[RunManifest], int]:
        found = self.dht.get(run_key(self.run_id), latest=True)
        if found is None or not isinstance(found.value, dict):
            return [], 0
        return decode_manifests([getattr(item, "value", None) for item in found.value.values()], swarm_time.now())

    def publish_progress(self, record: ProgressRecord, *, ttl: float) -> None:
        assert self.owner is not None, "a read-only directory publishes nothing"
        shards = self.shards  # one read of it: a heartbeat's read may change it meanwhile
        if self.auto:
            record = dataclasses.replace(record, progress_shards=shards)
        shard = progress_shard(str(self.dht.peer_id), shards)  # 0 (the one key) when unsharded
        self.dht.store(peers_key(self.run_id, shard), subkey=self.owner, value=progress.encode(record),
                       expiration_time=swarm_time.now() + ttl)

    def progress(self) -> tuple[dict[str, ProgressRecord], int]:
        records: dict[str, ProgressRecord] = {}
        ignored, read, wanted = 0, 0, self.read_shards
        while read < wanted:  # auto: again with the keys the records name, until they name no more
            found, malformed = self._read_keys(range(read, wanted))
            ignored += malformed
            _keep_newest(records, found)
            read = wanted
            if self.auto:
                wanted = shards_to_read(self.shards, (r.progress_shards for r in records.values()), len(records))
        if self.auto:
            self.shards = auto_progress_shards(len(records), self.shards)
            self.read_shards = shards_to_read(self.shards, (r.progress_shards for r in records.values()), len(records))
        return records, ignored

    def _read_keys(self, shards: range) -> tuple[dict[str, ProgressRecord], int]:
        # Every shard's lookup at once: a heartbeat waits for the slowest one, not for their sum.
        futures = [self.dht.get(peers_key(self.run_id, shard), latest=True, return_future=True) for shard in shards]
        records: dict[str, ProgressRecord] = {}
        ignored = 0
        for future in futures:
            found = future.result()
            value = found.value if found is not None else None
            if isinstance(value, dict):
                by_peer: dict[bytes, Any] = {}
                for subkey, item in value.items():
                    try:
                        by_peer[PeerID.from_base58(peer_id_of(subkey)).to_bytes()] = item
                    except MessageError:
                        ignored += 1
                value = by_peer
            shard_records, malformed = progress.read_records(value, swarm_time.now())
            _keep_newest(records, shard_records)
            ignored += malformed
        return records, ignored

    def refusal(self) -> str | None:
        return private_swarm_refusal(self.dht)

    def follow_organiser(self, key: bytes, open_until: float | None) -> None:
        """Our DHT node stores manifests of this run signed by ``key`` only (by any key until
        ``open_until``, swarm time): its validator runs in the DHT process, built before we knew."""
        self.dht.run_coroutine(partial(follow_organiser_in_dht, run_id=self.run_id, key=key, open_until=open_until))

    def clock_samples(self, peer_ids: list[str]) -> list[ClockSample]:
        return swarm_clock.probe(self.dht, peer_ids)

    def reconnect(self, targets: list[tuple[str, tuple[str, ...]]]) -> Future:
        return rediscovery.reconnect(self.dht, targets)


def _keep_newest(records: dict[str, ProgressRecord], found: dict[str, ProgressRecord]) -> None:
    """Merge ``found`` into ``records``, a peer's newest record winning: a peer whose key count
    changed lingers under its old key until that record expires."""
    for peer, record in found.items():
        if peer not in records or record.time > records[peer].time:
            records[peer] = record


def private_swarm_refusal(dht: DHT) -> str | None:
    """One line if our DHT met records sealed with a swarm key it does not have (ours differs or
    we have none), i.e. we are not admitted to this swarm."""
    seen = dht.run_coroutine(_sealed_seen)
    if not seen:
        return None
    return ("this swarm is private and refused this peer: its records are sealed with a swarm key this peer "
            "does not have; pass --swarm-key FILE with the swarm's key file (ask the run's organiser)")


async def follow_organiser_in_dht(_dht: DHT, node, *, run_id: str, key: bytes, open_until: float | None) -> None:
    for validator in getattr(node.protocol.record_validator, "_validators", []):
        if isinstance(validator, records.ShoalRecordValidator):
            validator.follow_organiser(run_id, key, open_until)


async def _sealed_seen(_dht: DHT, node) -> int:
    validators = getattr(node.protocol.record_validator, "_validators", [])
    return sum(v.sealed_seen for v in validators if isinstance(v, records.SwarmKeyValidator))


def _organisers(manifests: list[RunManifest]) -> list[bytes]:
    return sorted({m.organiser for m in manifests})


def join_run(directory: RunDirectory, ours: RunManifest, *, record_ttl: float, trust: RunTrust | None = None,
             settle_s: float = SETTLE_S, sleep: Callable[[float], None] = time.sleep,
             alone: bool = False) -> RunManifest:
    """Follow the trusted organiser's schedule, or organise the run; refuse a run whose manifest
    differs from ours (``ConfigError`` naming the field) before averaging anything. ``alone``: we
    know no other peer (no initial peers), so nobody can organise beside us: no second look."""
    trust = trust if trust is not None else RunTrust()
    deadline = time.monotonic() + settle_s
    looked_twice = alone
    while True:
        found, _ = directory.manifests()
        # Only after a read: a node notices sealed records when other nodes return them to it.
        if not found and (problem := directory.refusal()) is not None:
            raise ConfigError(problem)
        if trust.pinned is not None:
            ignored = [m for m in found if m.organiser != trust.pinned]
            if ignored:
                logger.warning(f"ignored {len(ignored)} manifest(s) of run '{directory.run_id}' not signed by its run "
                               f"key {format_run_key(trust.pinned)} (organisers: "
                               f"{', '.join(format_run_key(k) for k in _organisers(ignored))})")
            found = [m for m in found if m.organiser == trust.pinned]
        organisers = _organisers(found)
        if not found and not trust.explicit and not looked_twice:
            # About to organise. Two peers started at once would each organise, and an organiser
            # never adopts another key (``converge``): the second would run a run of its own. A
            # random pause and a second look let the later one find the earlier one's manifest.
            looked_twice = True
            pause = getattr(directory, "organise_pause_s", ORGANISE_PAUSE_S)  # an in-process hub sees a store at once
            sleep(random.uniform(pause / 4, pause))
            continue
        if len(organisers) <= 1 and (found or trust.pinned is None or not trust.explicit):
            break
        if time.monotonic() >= deadline:
            if not found:
                raise NetworkError(f"no manifest of run '{directory.run_id}' signed by --run-key "
                                   f"{format_run_key(trust.pinned)} in the swarm after {settle_s:.0f}s; check the "
                                   "key and --run-id against the organiser's join line")
            raise ConfigError(f"run '{directory.run_id}' is published by {len(organisers)} organisers (run keys "
                              f"{', '.join(format_run_key(k) for k in organisers)}); pass --run-key with the key "
                              "from the join line of the run you mean")
        sleep(1.0)
    if found:
        theirs = min(found, key=lambda m: m.start_time)
        manifest.check_compatible(ours, theirs)
        if trust.pinned is None:
            trust.pin(theirs.organiser)
        joined = theirs
    else:  # nobody runs it yet: we organise it
        key = trust.our_key()
        joined = ours.with_start(directory.now()).signed_by(key)
        trust.organised_at = directory.now()
        if not trust.explicit:
            trust.pin(key.public)
        logger.info(f"organising run '{directory.run_id}' with run key {key.text}")
    _follow_in_records(directory, trust)  # before our store: it passes the same validator
    directory.publish_manifest(joined, ttl=record_ttl)
    return joined


def _follow_in_records(directory: RunDirectory, trust: RunTrust) -> None:
    """From now on our DHT node stores only the manifests of the organiser we follow, and learns
    every later change of pin; a pin read from the pin file is told here too, not by ``pin``.
    An in-process directory has no validator of ours to tell."""
    follow = getattr(directory, "follow_organiser", None)
    if follow is None or trust.pinned is None:
        return
    trust.on_pin = follow
    follow(trust.pinned, trust.open_until())


def converging(trust: RunTrust, now: float) -> bool:
    """Whether ``converge`` may still act: we organised the run less than ``ADOPT_PERIOD_S`` ago.
    Otherwise (a joiner, or later) it keeps the manifest we follow whatever others publish, and the
    monitor need not read the run's manifests at all."""
    return trust.organised_at is not None and now <= trust.organised_at + ADOPT_PERIOD_S


def converge(current: RunManifest, found: list[RunManifest], trust: RunTrust, now: float) -> RunManifest:
    """A new organiser (within ``ADOPT_PERIOD_S`` of organising) switches only to a manifest signed by
    the key it was started with (``RunTrust.may_adopt``), of the same config and starting within
    ``ADOPT_WINDOW_S`` of its own: a peer restarted with a saved pin that organised because that
    organiser's manifest had not reached it yet goes back to it, whichever starts first (the key's
    holder never moves, so only we can); the pin it saves is the one it was started with. A key met
    in the swarm is never adopted, not even for this session: the operator of a public run expects
    the node it started to stay its organiser, and a stranger's copy of our manifest moved earlier
    would otherwise take the run over and strand the joiners given our key by the join line. So two
    organisers that start one run id at once with new keys each keep their own run, each told once
    with the fix (unpinned joiners refuse to guess between them, ``join_run``)."""
    if not converging(trust, now):
        return current
    rivals = [m for m in found if m.organiser != current.organiser]
    returning = [m for m in rivals if trust.may_adopt(m.organiser) and m.config_hash == current.config_hash
                 and abs(m.start_time - current.start_time) <= ADOPT_WINDOW_S]
    if returning:
        chosen = min(returning, key=lambda m: m.start_time)
        logger.info(f"run '{chosen.run_id}': following organiser {format_run_key(chosen.organiser)} again, the "
                    f"run key this peer was started with (its start {chosen.start_time - current.start_time:+.1f}s "
                    "from ours)")
        if not trust.explicit:
            trust.pin(chosen.organiser)  # restores the pin it was started with: no new key is saved
        return chosen
    for key in _organisers(rivals):
        if key in trust.rivals_told:
            continue
        trust.rivals_told.add(key)
        theirs = min((m for m in rivals if m.organiser == key), key=lambda m: m.start_time)
        logger.warning(f"run '{current.run_id}' is also organised by run key {format_run_key(key)} (start "
                       f"{theirs.start_time - current.start_time:+.1f}s from ours); this peer keeps run key "
                       f"{format_run_key(current.organiser)} (joiners pass it as --run-key). If both organisers are "
                       f"yours, use another --run-id for one of them, or restart this one with --run-key "
                       f"{format_run_key(key)} to join that run")
    return current
