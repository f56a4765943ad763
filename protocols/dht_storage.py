"""What a shoal DHT node holds: hivemind's storage with caps per key and in all.

hivemind 1.1.12's ``DHTLocalStorage`` (a key holds a plain value or a dictionary of subkeys; only
a later expiration replaces an entry) counts nothing and expires entries lazily, so a stranger could
fill a node's memory (four 15 MiB values stored cost +105 MiB RSS) or make every get of a key fail
(an answer over p2pd's 4 MiB message cap fails whole). ``BoundedStorage`` keeps a ledger of the
unexpired entries beside it and refuses a store past ``MAX_SUBKEYS`` or ``MAX_KEY_BYTES`` per key or
``MAX_STORAGE_BYTES`` in all. ``protocols.records.install`` makes hivemind's DHT protocol build its
storage and cache from it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import timed_storage
from hivemind.utils.serializer import MSGPackSerializer

logger = logging.getLogger(__name__)

# Subkeys one key holds: under a run's peers key, one peer record each, plenty for "hundreds of
# peers"; under a matchmaking key, one per averager looking for a group.
MAX_SUBKEYS = 1024
# Bytes one key holds. A get's answer carries a whole key in one message and p2pd refuses messages
# over 4 MiB (hivemind 1.1.12's persistent_conn_max_msg_size), failing the whole answer; 3 MiB
# (+ REFRESH_HEADROOM) leaves room for the framing and the neighbour list. A peers key of 1024
# honest records is ~1.2 MiB (at most ~2.9 MiB with 8 long addresses each).
MAX_KEY_BYTES = 3 * 1024 * 1024
# Bytes all keys hold, in the storage and (again) in the cache: ~10x a run of a thousand peers.
MAX_STORAGE_BYTES = 32 * 1024 * 1024
# Memory an entry and a key cost beyond their bytes (hivemind's dicts and heap entries, and our
# ledger: measured ~580 bytes per subkey and ~1.6 KiB per key with hivemind 1.1.12), so that many
# tiny records count too.
ENTRY_OVERHEAD_BYTES = 640
KEY_OVERHEAD_BYTES = 2048
REFRESH_HEADROOM = 1 / 16  # a refresh of a held entry may grow it past a full cap by this share
FULL_LOG_EVERY_S = 600.0  # a full storage says so once, then at most this often

_PLAIN = object()  # the entry of a key that holds a plain value (no subkeys)


class _Ledger:
    """What a storage holds, counted: bytes and entries per key and in all, of unexpired entries
    only. Kept beside hivemind's storage, which expires entries lazily and counts nothing."""

    def __init__(self):
        self.entries: dict[DHTID, dict[Any, tuple[int, float]]] = {}  # key -> subkey -> (bytes, expiration)
        self.key_bytes: dict[DHTID, int] = {}
        self.total = 0  # every entry's bytes and overhead, every key's overhead
        self._count = 0
        self._expiry: list[tuple[float, int, DHTID, Any]] = []  # (expiration, order, key, subkey)
        self._order = itertools.count()  # ties never compare keys or subkeys

    def expire(self, now: float) -> None:
        # hivemind drops an entry once its expiration is < now; so do we.
        while self._expiry and self._expiry[0][0] < now:
            expiration, _, key, subkey = heapq.heappop(self._expiry)
            held = self.entries.get(key, {}).get(subkey)
            if held is not None and held[1] == expiration:  # else refreshed or replaced since
                self._remove(key, subkey)
        if len(self._expiry) > 2 * self._count + 1024:  # each refresh leaves a stale heap item
            self._expiry = [(expiration, next(self._order), key, subkey) for key, items in self.entries.items()
                            for subkey, (_, expiration) in items.items()]
            heapq.heapify(self._expiry)

    def put(self, key: DHTID, subkey: Any, size: int, expiration: float) -> None:
        if key not in self.entries:
            self.entries[key], self.key_bytes[key] = {}, 0
            self.total += KEY_OVERHEAD_BYTES
        elif subkey in self.entries[key]:
            self._remove(key, subkey, keep_key=True)
        self.entries[key][subkey] = (size, expiration)
        self.key_bytes[key] += size
        self.total += size + ENTRY_OVERHEAD_BYTES
        self._count += 1
        heapq.heappush(self._expiry, (expiration, next(self._order), key, subkey))

    def clear(self, key: DHTID) -> None:
        for subkey in list(self.entries.get(key, ())):
            self._remove(key, subkey)

    def _remove(self, key: DHTID, subkey: Any, keep_key: bool = False) -> None:
        size, _ = self.entries[key].pop(subkey)
        self.key_bytes[key] -= size
        self.total -= size + ENTRY_OVERHEAD_BYTES
        self._count -= 1
        if not self.entries[key] and not keep_key:
            del self.entries[key], self.key_bytes[key]
            self.total -= KEY_OVERHEAD_BYTES


def _entry_bytes(subkey: Any, value: bytes) -> int:
    return len(value) + (0 if subkey is _PLAIN else len(MSGPackSerializer.dumps(subkey)))


def _cost(count: int, size: int) -> int:
    """The memory ``count`` entries of ``size`` bytes in all cost under one key."""
    return size + count * ENTRY_OVERHEAD_BYTES + (KEY_OVERHEAD_BYTES if count else 0)


def _over(cap: int, fresh: bool) -> float:
    """How far a store may fill a cap: to the cap with a new entry, a little past it with a refresh,
    so that a held record whose refresh grows by a few bytes is not lost once a stranger filled it."""
    return cap if fresh else cap * (1 + REFRESH_HEADROOM)


class BoundedStorage(DHTLocalStorage):
    """hivemind's DHT storage (``DHTLocalStorage``: a key holds a plain value or a dictionary of
    subkeys, each entry replaced only by one that expires later) with caps: at most
    ``max_subkeys`` entries and ``max_key_bytes`` per key, ``max_bytes`` in all (with overheads),
    counting unexpired entries only. A store over a cap is refused (``False``, as hivemind answers
    for an outdated one); a refresh of a held entry passes as long as it does not grow past the
    headroom. ``install`` makes ``DHTProtocol.create`` build its storage and cache from this class."""

    def __init__(self, maxsize: int | None = None, *, max_bytes: int = MAX_STORAGE_BYTES,
                 max_key_bytes: int = MAX_KEY_BYTES, max_subkeys: int = MAX_SUBKEYS):
        super().__init__(maxsize)
        self.max_bytes, self.max_key_bytes, self.max_subkeys = max_bytes, max_key_bytes, max_subkeys
        self.ledger = _Ledger()
        self.refused = 0
        self._said: dict[str, float] = {}

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        # A plain value replaces whatever the key held. hivemind's cache also stores a dictionary
        # found by a get this way, whole.
        if isinstance(value, DictionaryDHTValue):
            new = {sub: (_entry_bytes(sub, item.value), item.expiration_time) for sub, item in value.items()}
        else:
            new = {_PLAIN: (_entry_bytes(_PLAIN, value), expiration_time)}
        if not self._fits(key, new, replaces=True) or not super().store(key, value, expiration_time):
            return False
        self.ledger.clear(key)
        for sub, (size, expiration) in new.items():
            self.ledger.put(key, sub, size, expiration)
        return True

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        held = self.get(key)
        into_dictionary = held is not None and isinstance(held.value, DictionaryDHTValue)  # else it replaces
        size = _entry_bytes(subkey, value)
        if (not self._fits(key, {subkey: (size, expiration_time)}, replaces=not into_dictionary)
                or not super().store_subkey(key, subkey, value, expiration_time)):
            return False
        if not into_dictionary:
            self.ledger.clear(key)
        self.ledger.put(key, subkey, size, expiration_time)
        return True

    def _fits(self, key: DHTID, new: dict[Any, tuple[int, float]], *, replaces: bool) -> bool:
        """Whether storing ``new`` under ``key`` keeps every cap. Growth is what is checked: a store
        that adds nothing (the same record refreshed) always fits."""
        ledger = self.ledger
        ledger.expire(timed_storage.get_dht_time())  # looked up at each call: shoal rebinds it (swarm time)
        held = ledger.entries.get(key, {})
        held_bytes = ledger.key_bytes.get(key, 0)
        if replaces:
            kept_bytes, kept_count = 0, 0
        else:
            overwritten = [held[sub][0] for sub in new if sub in held]
            kept_bytes, kept_count = held_bytes - sum(overwritten), len(held) - len(overwritten)
        new_bytes = kept_bytes + sum(size for size, _ in new.values())
        new_count = kept_count + len(new)
        fresh = any(sub not in held for sub in new)
        growth = _cost(new_count, new_bytes) - _cost(len(held), held_bytes)
        if new_count > max(self.max_subkeys, len(held)):
            return self._refuse("key", f"a DHT key holds {self.max_subkeys} subkeys, the most this node stores "
                                       "under one key: new subkeys under it are refused until some expire")
        if new_bytes > max(_over(self.max_key_bytes, fresh), held_bytes):
            return self._refuse("key bytes", f"a DHT key holds {held_bytes / 2**20:.1f} MiB, the most this node "
                                             "stores under one key: new records under it are refused until some "
                                             "expire")
        if growth > 0 and ledger.total + growth > _over(self.max_bytes, fresh):
            return self._refuse("full", f"this node's DHT storage is full ({ledger.total / 2**20:.0f} MiB of "
                                        f"records, the cap is {self.max_bytes / 2**20:.0f} MiB): new records are "
                                        "refused until some expire")
        return True

    def _refuse(self, kind: str, line: str) -> bool:
        self.refused += 1
        now = time.monotonic()
        if now - self._said.get(kind, -math.inf) >= FULL_LOG_EVERY_S:
            self._said[kind] = now
            logger.warning(f"{line} (said at most every {FULL_LOG_EVERY_S / 60:.0f} min; {self.refused} refused "
                           "so far)")
        return False
