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

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hivemind import DHT
from hivemind.p2p import PeerID

from node.library import rediscovery, swarm_clock
from node.library.atomic import write_atomically
from protocols import manifest, progress, records, swarm_time
from protocols.errors import ConfigError, NetworkError
from protocols.identity import RunKey, format_run_key, peer_id_of
from protocols.keys import peers_key, run_key
from protocols.manifest import RunManifest
from protocols.messages import MessageError
from protocols.progress import ProgressRecord
from protocols.swarm_time import ClockSample

logger = logging.getLogger(__name__)

MANIFEST_TTL = records.MANIFEST_TTL  # a run nobody serves any more is forgotten after this
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

    def __post_init__(self):
        if self.pinned is None and self.pin_file is not None and self.pin_file.exists():
            self.pinned = self.pin_file.read_bytes()[:32] or None

    def pin(self, key: bytes) -> None:
        if self.pinned != key:
            logger.info(f"trusting run key {format_run_key(key)} from now on")
        self.pinned = key
        if self.pin_file is not None:
            self.pin_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.pin_file, key)

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

    def refusal(self) -> str | None:
        """Why the swarm refuses this peer (e.g. a private swarm and no swarm key), or None."""


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
    ``protocols.records`` checks signed the record. ``owner`` None: read-only (``shoal status``)."""

    def __init__(self, dht: DHT, run_id: str, owner: bytes | None = None):
        self.dht, self.run_id, self.owner = dht, run_id, owner

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
        self.dht.store(peers_key(self.run_id), subkey=self.owner, value=progress.encode(record),
                       expiration_time=swarm_time.now() + ttl)

    def progress(self) -> tuple[dict[str, ProgressRecord], int]:
        found = self.dht.get(peers_key(self.run_id), latest=True)
        value = found.value if found is not None else None
        by_peer: dict[bytes, Any] = {}
        bad_subkeys = 0
        for subkey, item in (value.items() if isinstance(value, dict) else ()):
            try:
                by_peer[PeerID.from_base58(peer_id_of(subkey)).to_bytes()] = item
            except MessageError:
                bad_subkeys += 1
        records, malformed = progress.read_records(by_peer if isinstance(value, dict) else value, swarm_time.now())
        return records, malformed + bad_subkeys

    def refusal(self) -> str | None:
        return private_swarm_refusal(self.dht)

    def clock_samples(self, peer_ids: list[str]) -> list[ClockSample]:
        return swarm_clock.probe(self.dht, peer_ids)

    def reconnect(self, targets: list[tuple[str, tuple[str, ...]]]) -> Future:
        return rediscovery.reconnect(self.dht, targets)


def private_swarm_refusal(dht: DHT) -> str | None:
    """One line if our DHT met records sealed with a swarm key it does not have (ours differs or
    we have none), i.e. we are not admitted to this swarm."""
    seen = dht.run_coroutine(_sealed_seen)
    if not seen:
        return None
    return ("this swarm is private and refused this peer: its records are sealed with a swarm key this peer "
            "does not have; pass --swarm-key FILE with the swarm's key file (ask the run's organiser)")


async def _sealed_seen(_dht: DHT, node) -> int:
    validators = getattr(node.protocol.record_validator, "_validators", [])
    return sum(v.sealed_seen for v in validators if isinstance(v, records.SwarmKeyValidator))


def _organisers(manifests: list[RunManifest]) -> list[bytes]:
    return sorted({m.organiser for m in manifests})


def join_run(directory: RunDirectory, ours: RunManifest, *, record_ttl: float, trust: RunTrust | None = None,
             settle_s: float = SETTLE_S, sleep: Callable[[float], None] = time.sleep) -> RunManifest:
    """Follow the trusted organiser's schedule, or organise the run; refuse a run whose manifest
    differs from ours (``ConfigError`` naming the field) before averaging anything."""
    trust = trust if trust is not None else RunTrust()
    deadline = time.monotonic() + settle_s
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
    directory.publish_manifest(joined, ttl=record_ttl)
    return joined


def converge(current: RunManifest, found: list[RunManifest], trust: RunTrust, now: float) -> RunManifest:
    """Peers that organised the same run at the same moment settle on one schedule: a new
    organiser (not pinned by the user, within ``ADOPT_PERIOD_S`` of organising) switches to another
    organiser's manifest of the same config starting within ``ADOPT_WINDOW_S`` of its own, if that
    one sorts first (earlier start, then key). Anything else never moves the schedule: a stranger
    can shift a brand-new organiser by at most the window, and nobody else at all."""
    if trust.explicit or trust.organised_at is None or now > trust.organised_at + ADOPT_PERIOD_S:
        return current
    rivals = [m for m in found if m.organiser != current.organiser and m.config_hash == current.config_hash
              and abs(m.start_time - current.start_time) <= ADOPT_WINDOW_S
              and (m.start_time, m.organiser) < (current.start_time, current.organiser)]
    if not rivals:
        return current
    chosen = min(rivals, key=lambda m: (m.start_time, m.organiser))
    logger.info(f"run '{chosen.run_id}': following organiser {format_run_key(chosen.organiser)}, who started it "
                f"{current.start_time - chosen.start_time:.1f}s earlier")
    trust.pin(chosen.organiser)
    return chosen
