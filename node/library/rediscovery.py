"""Finding the swarm again after an outage: known peers re-dialled, and the DHT's routing refreshed.

Why it is needed (hivemind 1.1.12, ``dht/protocol.py`` and ``dht/node.py``): a DHT node drops a
peer from its routing table when an RPC to it fails, and learns peers only from RPCs it receives
and from lookups through peers it already knows; nothing re-dials a dropped peer. So after a
split of a few seconds each half's routing tables hold only that half, every lookup stays inside
it, and the halves never meet again (docs/design.md, "Finding each other again after an outage");
a restarted bootstrap comes back with an empty table. hivemind's bootstrap does what
heals this, once, at start: ping the initial peers (a ping adds each side to the other's table),
then look up our own id (``find_nearest_nodes``) to fill the table. ``reconnect`` repeats those
steps, inside the DHT's process, for the peers we know of:

- the initial peers (``--initial-peer``), pinged every ``SWEEP_TICKS`` heartbeats whatever we
  see: a restarted bootstrap learns us again within that, and joiners find the swarm through it;
- the peers we have averaged with lately (their records list their addresses,
  ``ProgressRecord.addrs``), kept in ``PeerCache`` and in ``<checkpoint-dir>/<run>.peers.json``
  across restarts; dialled while we see fewer peers than we did lately (the most live peers in the
  last ``WINDOW_TICKS``), on a backoff that doubles from one heartbeat to ``MAX_GAP_TICKS``.

A record costs a stranger one DHT store, and withdrawing records makes us "short" at will: so only
the addresses of peers that averaged with us are kept, and a node with a public address of its
own dials only public ones (a loopback or LAN address in a stranger's record would have it dial
into its own network); a node on a local or LAN swarm dials what its peers list.

A peer that left for good keeps us dialling its old address once a ``MAX_GAP_TICKS``, until it is
older than the window: a connect attempt with a timeout, nothing more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from node.library.atomic import write_atomically
from protocols.addresses import is_public, parse_peer_multiaddr, peer_id_of
from protocols.errors import AddressError
from protocols.progress import MAX_ADDRS, ProgressRecord

logger = logging.getLogger(__name__)

WINDOW_TICKS = 120  # heartbeats of peer counts remembered (10 min at the usual 5 s)
MAX_GAP_TICKS = 4  # the longest wait between tries while short of peers (20 s at 5 s: a round or two)
SWEEP_TICKS = 6  # the initial peers are pinged this often in any case (30 s at 5 s)
CACHE_LIMIT = 64  # peers remembered, the most recently seen first
CACHE_MAX_AGE_S = 7 * 86400.0
CONNECT_TIMEOUT_S = 5.0
CACHE_VERSION = 1


@dataclass
class PeerCache:
    """The addresses of peers we have met, newest first; persisted to ``path`` when given."""

    path: Path | None = None
    limit: int = CACHE_LIMIT
    peers: dict[str, tuple[tuple[str, ...], float]] = field(default_factory=dict)  # id -> (addrs, seen)
    _dirty: bool = False

    @classmethod
    def load(cls, path: Path | None, now: float | None = None) -> PeerCache:
        """The cache saved at ``path``; empty (with one warning) if the file is missing or broken."""
        cache = cls(path)
        if path is None or not path.exists():
            return cache
        now = time.time() if now is None else now
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("v") != CACHE_VERSION:
                raise ValueError(f"version {data.get('v')!r}")
            for peer, entry in data["peers"].items():
                addrs = tuple(parse_peer_multiaddr(a, flag="cached address") for a in entry["addrs"][:MAX_ADDRS])
                seen = float(entry["seen"])
                if addrs and all(peer_id_of(a) == peer for a in addrs) and now - seen < CACHE_MAX_AGE_S:
                    cache.peers[peer] = (addrs, seen)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, AddressError) as e:
            logger.warning(f"ignoring the peer cache {path} ({str(e)[:120]}); it is rebuilt as peers are met")
            cache.peers.clear()
        cache._trim()
        return cache

    def remember(self, records: Mapping[str, ProgressRecord], now: float) -> None:
        """Note the addresses of the live peers' records (ours included: harmless, never dialled)."""
        for peer, record in records.items():
            if record.addrs:
                old = self.peers.get(peer)
                self.peers[peer] = (record.addrs, now)
                self._dirty |= old is None or old[0] != record.addrs or now - old[1] > 60.0
        self._trim()

    def _trim(self) -> None:
        if len(self.peers) > self.limit:
            newest = sorted(self.peers.items(), key=lambda item: -item[1][1])[:self.limit]
            self.peers = dict(newest)

    def missing(self, live: set[str], *, since: float) -> list[tuple[str, tuple[str, ...]]]:
        """Peers seen after ``since`` that are not live now, most recently seen first."""
        entries = sorted(self.peers.items(), key=lambda item: -item[1][1])
        return [(peer, addrs) for peer, (addrs, seen) in entries if peer not in live and seen >= since]

    def save(self) -> None:
        """Write the cache if it changed (atomically: a crash leaves the old file or the new one)."""
        if self.path is None or not self._dirty:
            return
        data = {"v": CACHE_VERSION, "peers": {p: {"addrs": list(a), "seen": s} for p, (a, s) in self.peers.items()}}
        try:
            write_atomically(self.path, json.dumps(data, indent=1).encode())
            self._dirty = False
        except OSError as e:  # a full disk costs the cache, never the run
            logger.warning(f"could not save the peer cache {self.path}: {e.strerror or e}")


@dataclass
class Backoff:
    """When to dial known peers again (pure: ticks in, decisions out). Short of peers (fewer live
    than the most in the last ``window`` ticks): at once, then after 1, 2, 4 ... up to ``max_gap``
    ticks; back to full: the backoff resets."""

    window: int = WINDOW_TICKS
    max_gap: int = MAX_GAP_TICKS
    counts: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW_TICKS))
    gap: int = 1
    next_try: int = 0
    tick: int = 0

    def __post_init__(self) -> None:
        self.counts = deque(self.counts, maxlen=self.window)

    def observe(self, live: int) -> bool:
        """Record this tick's live peer count; whether to dial the missing peers now."""
        self.tick += 1
        short = bool(self.counts) and live < max(self.counts)
        self.counts.append(live)
        if not short:
            self.gap, self.next_try = 1, self.tick
            return False
        if self.tick < self.next_try:
            return False
        self.next_try = self.tick + self.gap
        self.gap = min(self.gap * 2, self.max_gap)
        return True


class Rediscovery:
    """Drives ``reconnect`` from the monitor's heartbeat (the monitor's thread only). A try runs in
    the DHT's process in the background (dialling a peer that is gone takes seconds, and the
    heartbeat must not wait: our own record would expire); one at a time, read at a later tick."""

    def __init__(self, *, initial_peers: list[str], cache: PeerCache, peer_id: str, period: float,
                 local: bool = True):
        """``local``: this node has no public address of its own (a local or LAN swarm), so it
        dials any address its peers list; otherwise only public ones (the initial peers always)."""
        self.initial = [(peer_id_of(a), (a,)) for a in initial_peers]
        self.cache, self.peer_id, self.period, self.local = cache, peer_id, period, local
        self.backoff = Backoff()
        self.tries = 0  # dials of missing peers (not the periodic sweep of the initial peers)
        self.reached = 0  # peers those tries reached
        self._pending: tuple[Future, bool, int, int] | None = None  # (try, short, peers dialled, live then)

    def tick(self, live: Mapping[str, ProgressRecord], reconnect: Callable[[list], Future], *,
             met: Collection[str]) -> list[str]:
        """After a heartbeat's read of the records: remember the addresses of the live peers in
        ``met`` (those we averaged with lately), read the last try's answer, and start the next try
        when it is time (``reconnect(targets)``: a future of the peers it reached). Returns the
        peers the try that finished reached."""
        now = time.time()
        self.cache.remember({peer: record for peer, record in live.items() if peer in met}, now)
        reached = self._collect()
        short = self.backoff.observe(len(live))
        targets: list[tuple[str, tuple[str, ...]]] = []
        if short:
            since = now - self.backoff.window * self.period
            for peer, addrs in self.cache.missing(set(live), since=since):
                dialable = addrs if self.local else tuple(a for a in addrs if is_public(a))
                if peer != self.peer_id and dialable:
                    targets.append((peer, dialable))
        if short or self.backoff.tick % SWEEP_TICKS == 0:
            targets += [t for t in self.initial if t[0] not in live and t[0] != self.peer_id]
        self.cache.save()
        if targets and self._pending is None:
            unique = list(dict(targets).items())
            self._pending = (reconnect(unique), short, len(unique), len(live))
            if short:
                self.tries += 1
        return reached

    def _collect(self) -> list[str]:
        if self._pending is None or not self._pending[0].done():
            return []
        future, short, dialled, live = self._pending
        self._pending = None
        try:
            reached = list(future.result())
        except Exception as e:  # noqa: BLE001 - a failed try is retried on the backoff
            logger.debug(f"rediscovery: {e!r}")
            reached = []
        if short:
            self.reached += len(reached)
            if reached:
                logger.info(f"rediscovery: fewer peers than lately ({live}); reached {len(reached)} of {dialled} "
                            "known peer(s) and refreshed the DHT's routing")
            elif self.tries == 1 or self.tries % 10 == 0:
                logger.info(f"rediscovery: fewer peers than lately ({live}); none of {dialled} known peer(s) "
                            "answered yet (retrying on a backoff)")
        return reached


def reconnect(dht, targets: list[tuple[str, tuple[str, ...]]], *, timeout: float = CONNECT_TIMEOUT_S) -> Future:
    """Dial ``targets`` (peer id, addresses) through our DHT node, ping them into our routing table
    (and us into theirs), then refresh the table by looking up our own id: in the background, a
    future of the peers that answered."""
    return dht.run_coroutine(partial(_reconnect, targets=targets, timeout=timeout), return_future=True)


async def _reconnect(_dht, node, *, targets: list[tuple[str, tuple[str, ...]]], timeout: float) -> list[str]:
    """In the DHT's process: hivemind's bootstrap steps, again (module docstring)."""
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    async def one(peer: str, addrs: tuple[str, ...]) -> str | None:
        try:
            peer_id = PeerID.from_base58(peer)
            if peer_id == node.peer_id:
                return None
            # The daemon dials by address; after an outage it may have forgotten the peer's, so
            # hand them over (without the /p2p/ part, which names the peer, not a place).
            bare = [Multiaddr(a).decapsulate(Multiaddr(f"/p2p/{peer}")) for a in addrs]
            await asyncio.wait_for(node.p2p._client.connect(peer_id, bare), timeout)
        except Exception:  # noqa: BLE001 - unreachable now; the ping below may still find it
            pass
        try:
            answered = await asyncio.wait_for(node.protocol.call_ping(peer_id, validate=False), timeout)
        except Exception:  # noqa: BLE001
            return None
        return peer if answered is not None else None

    reached = [p for p in await asyncio.gather(*(one(p, a) for p, a in targets)) if p is not None]
    if reached:
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), 2 * timeout)
        except Exception:  # noqa: BLE001 - the pings alone have joined the tables
            pass
    return reached


@dataclass
class ReunionWatch:
    """Tells, from the round records alone (pure), when this peer's side of a split meets the
    rest again: a round whose group is larger than every one of the rounds just before it (and as
    large as one before those: we were together), in which anchors differed (we re-synced, or
    members diverged from ours). A round that folded met nobody for good (a partial all-reduce,
    or we stayed out while the last sync ran) and counts neither way. ``observe`` returns the ``reunion`` event's fields then, once per
    meeting; None otherwise. Which side is kept is the consensus's choice (docs/design.md); the
    two lineages are merged by the round engine (``averaging.engine.lineage``)."""

    window: int = 60  # rounds remembered
    rounds: deque[tuple[int, str, int]] = field(default_factory=deque)  # (group size, applied, tokens)

    def observe(self, *, round: int, group_size: int, applied: str, tokens: int, resynced: bool,
                diverged: list[str], folded: int = 0, reunion: bool | None = None) -> dict | None:
        """``folded``: the outer steps our side took apart that the round engine merged into the
        group's anchor through our next contribution at this re-sync (``RoundStats.lineage_merged``):
        then nothing was dropped. ``reunion``: the round engine's judgement
        (``RoundStats.lineage_reunion``: the other side stepped apart too). On the kept side it is
        final: a member that merely missed a round rejoins diverged (it is behind and catches up),
        which the records alone cannot tell from a reunion. None: not known (records only)."""
        # A folded round met nobody for good (a partial all-reduce, or we stayed out of the sync):
        # it neither ends the stretch apart nor starts one. Its work rode on the next round that
        # applied: its tokens count apart when that round was one apart, not when it is this one.
        apart, together_before = [], False
        for size, was_applied, was_tokens in reversed(self.rounds):
            if was_applied == "folded":
                if apart:
                    apart.append((size, was_applied, was_tokens))
                continue
            if size >= group_size:  # together before (a joiner growing the swarm is no reunion)
                together_before = True
                break
            apart.append((size, was_applied, was_tokens))
        self.rounds.append((group_size, str(applied), tokens))
        while len(self.rounds) > self.window:
            self.rounds.popleft()
        if not apart or not together_before or not (resynced or diverged):
            return None
        if not resynced and reunion is False:
            return None
        stepped = [size for size, was_applied, _ in apart if was_applied != "folded"]
        apart_tokens = sum(t for *_, t in apart)
        dropped = resynced and not folded
        return {"round": round, "group_size": group_size, "apart_rounds": len(stepped),
                "apart_group_size": max(stepped), "kept": not resynced,
                "steps_dropped": len(stepped) if dropped else 0, "tokens_dropped": apart_tokens if dropped else 0,
                "rejoined": sorted(diverged), "steps_merged": folded if resynced else 0,
                "tokens_merged": apart_tokens if resynced and folded else 0}
