"""DHT record validation and storage caps: what every shoal DHT node refuses to store or to believe.

hivemind 1.1.12 runs a node's ``record_validators`` (one ``CompositeValidator``) in its DHT
process, on three paths (``dht/protocol.py``, ``dht/node.py``):

- ``rpc_store``: a record another node asks us to store; refused records are not stored and the
  storer gets ``store_ok=False``. A whole dictionary (hivemind replicates its storage to nodes it
  meets) is refused if any subkey is; ``install`` makes it keep the subkeys that pass.
- ``DHTNode.store_many``: our own stores are signed (``sign_value``) and validated before we keep
  them ourselves.
- ``call_find``: every record another node returns to our ``get``; hivemind drops that node's
  whole answer when one subkey is refused, so one stranger's record under a key would hide every
  honest one that node holds. ``install`` makes it drop only the refused subkeys. ``strip_value``
  then removes the signatures before the application sees the value.

The validator sees ``DHTRecord(key, subkey, value, expiration_time)`` where ``key`` is the DHTID
of the key (a hash: a node can only recognise keys it can compute, i.e. runs it knows the id
of), ``subkey`` the msgpack bytes of the subkey (``DHTProtocol.IS_REGULAR_VALUE`` for a plain
value), ``value`` the bytes as stored. It does not see who sent the record: ``install`` wraps
``rpc_store`` and ``call_find`` to keep the sender in a context variable, so refusals name it.

Rules (``ShoalRecordValidator``), for every key: the expiration is at most now + ``MAX_ANY_TTL``
and the value at most ``MAX_ANY_VALUE_BYTES``. For the run keys of the runs this node knows:

- a subkey is required (a plain value under a subkeyed key blocks every later subkey store);
- the subkey is the storer's libp2p public key in its canonical encoding (one RSA key, one
  subkey: ``protocols.identity``) and the value is signed by that identity, over key, subkey,
  value and expiration: nobody can write or extend another peer's record;
- the expiration is at most now + the key's TTL + ``EXPIRATION_SLACK`` (no frozen records);
- the value is at most ``MAX_VALUE_BYTES`` and decodes as a valid progress record / signed
  manifest with a sane schedule; once this node knows the run's organiser key (``--run-key``, or
  ``follow_organiser`` when it organised or pinned the run), signed by that key.

A node that does not know a run (a bootstrap started without ``--run-id``) cannot compute its
keys: it checks only the rules for every key and the storage caps, and stores whatever else a
stranger signs or sends under them. A bootstrap with ``--run-id`` but no organiser key checks the
schema and signatures but not whose manifest it is. Joiners do not rely on either: their own
validator filters every answer subkey by subkey.

What a node holds is capped where it is stored (``protocols.dht_storage.BoundedStorage``, hivemind's storage and cache):
``MAX_SUBKEYS`` per key, ``MAX_KEY_BYTES`` per key, ``MAX_STORAGE_BYTES`` in all, counting only
entries that have not expired. ``SwarmKeyValidator`` adds private-swarm admission on top: every
record carries an HMAC with the swarm key, records without a valid one are refused.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable

import msgpack
from hivemind.dht import protocol as dht_protocol
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import TimedStorage

from protocols import manifest, progress, swarm_time
from protocols.dht_storage import (  # noqa: F401 - the caps are part of this module's rules, as before
    ENTRY_OVERHEAD_BYTES,
    FULL_LOG_EVERY_S,
    KEY_OVERHEAD_BYTES,
    MAX_KEY_BYTES,
    MAX_STORAGE_BYTES,
    MAX_SUBKEYS,
    REFRESH_HEADROOM,
    BoundedStorage,
)
from protocols.identity import PeerKey, peer_id_of, verify_peer_signature
from protocols.keys import MAX_PROGRESS_SHARDS, peers_key, run_key
from protocols.messages import MessageError
from protocols.pinning import changed_functions

logger = logging.getLogger(__name__)

MAX_VALUE_BYTES = 16 * 1024  # a signed progress record is ~600 bytes, a manifest ~6 KiB at most
EXPIRATION_SLACK = 60.0  # clock skew between honest nodes (hivemind tolerates 30 s of DHT time skew)
MANIFEST_TTL = 600.0  # a run nobody serves any more is forgotten after this
MAX_PROGRESS_TTL = 120.0  # heartbeats: 3 x the monitor period (at most 5 s) with a wide margin
MAX_ANY_TTL = 3600.0  # any other key: hivemind's averager stores for seconds to a minute
# Any key. hivemind's own values are tiny: the averager declares itself under a matchmaking key
# ({prefix}.0b{bits}) and offers its state under {prefix}.all_averagers, one subkey per peer
# (its peer id, 38 bytes) holding a bool or a float; ours are at most MAX_VALUE_BYTES (a real
# manifest is ~1.4 KiB). Generous, and small enough that no single store costs a node memory.
MAX_ANY_VALUE_BYTES = 64 * 1024
SIGNED_TAG = "shoal-signed"
SEALED_TAG = "shoal-sealed"
LOG_EVERY_S = 30.0  # one line per (sender, reason) per this long: an attacker cannot flood the log

STORE_SENDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("shoal_store_sender", default=None)


def _record_bytes(record: DHTRecord) -> bytes:
    return msgpack.packb([record.key, record.subkey, record.value, record.expiration_time])


def _unpack(value: bytes, tag: str) -> list | None:
    """The ``[tag, inner, proof]`` envelope, or None if ``value`` is not one."""
    try:
        unpacked = msgpack.unpackb(value, raw=False, max_bin_len=MAX_VALUE_BYTES, max_str_len=64, max_array_len=3,
                                   max_map_len=0, max_ext_len=0)
    except Exception:  # noqa: BLE001 - whatever a stranger sent, it is not our envelope
        return None
    if (not isinstance(unpacked, list) or len(unpacked) != 3 or unpacked[0] != tag
            or not isinstance(unpacked[1], bytes) or not isinstance(unpacked[2], bytes)):
        return None
    return unpacked


class _Refusals:
    """Logs refused records naming the sender, at most once per (sender, reason) per ``LOG_EVERY_S``."""

    def __init__(self):
        self._last: dict[tuple[str, str], float] = {}
        self.count = 0

    def __call__(self, reason: str, record: DHTRecord) -> bool:
        self.count += 1
        sender = STORE_SENDER.get() or "this node (its own store)"
        now = time.monotonic()
        if now - self._last.get((sender, reason), -LOG_EVERY_S) >= LOG_EVERY_S:
            if len(self._last) > 1024:
                self._last.clear()
            self._last[(sender, reason)] = now
            logger.warning(f"refused a DHT record from {sender}: {reason}")
        return False


class ShoalRecordValidator(RecordValidatorBase):
    """Schema, size, expiration and owner signature of the records of the runs in ``run_ids``."""

    def __init__(self, run_ids: Iterable[str], identity: PeerKey | None, *, pinned_run_key: bytes | None = None,
                 clock: Callable[[], float] | None = None):
        self._identity = identity
        self._own_subkey = msgpack.packb(identity.public) if identity is not None else None
        self._clock = clock or swarm_time.now  # in the DHT's process: swarm time, as the expirations
        self._kinds: dict[bytes, tuple[str, float]] = {}
        # run key id -> (the organiser key whose manifests we store, until when we store any valid one)
        self._organisers: dict[bytes, tuple[bytes, float]] = {}
        for run_id in run_ids:
            self._kinds[DHTID.generate(source=run_key(run_id)).to_bytes()] = ("manifest", MANIFEST_TTL)
            for shard in range(MAX_PROGRESS_SHARDS):  # whatever count the run's manifest names
                self._kinds[DHTID.generate(source=peers_key(run_id, shard)).to_bytes()] = ("progress", MAX_PROGRESS_TTL)
            if pinned_run_key is not None:
                self.follow_organiser(run_id, pinned_run_key)
        self.refuse = _Refusals()

    def follow_organiser(self, run_id: str, key: bytes, open_until: float | None = None) -> None:
        """Refuse manifests of run ``run_id`` signed by any key but ``key`` from now on, or only from
        ``open_until`` (swarm time) for a new organiser that may still switch to another organiser
        (``node.library.run_record.converge``). Called again when the organiser we follow changes;
        manifests stored before stay until they expire."""
        self._organisers[DHTID.generate(source=run_key(run_id)).to_bytes()] = (
            key, -math.inf if open_until is None else open_until)

    @property
    def priority(self) -> int:
        return 10  # signs after (and validates before) nothing else of ours; below the swarm key

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._kinds or record.subkey != self._own_subkey:
            return record.value
        return msgpack.packb([SIGNED_TAG, record.value, self._identity.sign(_record_bytes(record))])

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._kinds:
            return record.value
        unpacked = _unpack(record.value, SIGNED_TAG)
        return unpacked[1] if unpacked is not None else record.value

    def validate(self, record: DHTRecord) -> bool:
        kind = self._kinds.get(record.key)
        max_ttl = kind[1] if kind is not None else MAX_ANY_TTL
        if record.expiration_time > self._clock() + max_ttl + EXPIRATION_SLACK:
            return self.refuse(f"expiration {record.expiration_time - self._clock():.0f}s ahead, more than "
                               f"{max_ttl:.0f}s + {EXPIRATION_SLACK:.0f}s", record)
        if len(record.value) > MAX_ANY_VALUE_BYTES:
            return self.refuse(f"a value of more than {MAX_ANY_VALUE_BYTES} bytes", record)  # one reason: one line
        if kind is None:
            return True
        try:
            self._check(kind[0], record)
        except MessageError as e:
            return self.refuse(f"{kind[0]} record: {e}", record)
        return True

    def _check(self, kind: str, record: DHTRecord) -> None:
        # 1. Shape: a subkey, a bounded signed envelope.
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            raise MessageError("a plain value under a subkeyed key")
        if len(record.value) > MAX_VALUE_BYTES:
            raise MessageError(f"{len(record.value)} bytes, more than {MAX_VALUE_BYTES}")
        unpacked = _unpack(record.value, SIGNED_TAG)
        if unpacked is None:
            raise MessageError("not signed by its owner")
        # 2. Owner: the subkey is a public key that signed key, subkey, value and expiration.
        try:
            owner = msgpack.unpackb(record.subkey, raw=False, max_bin_len=4096, max_str_len=0, max_array_len=0,
                                    max_map_len=0, max_ext_len=0)
        except Exception:  # noqa: BLE001
            raise MessageError("subkey is not a public key") from None
        owner_id = peer_id_of(owner)  # MessageError if it is not an RSA libp2p key
        inner = dataclasses.replace(record, value=unpacked[1])
        if not verify_peer_signature(owner, _record_bytes(inner), unpacked[2]):
            raise MessageError(f"signature does not match its subkey (peer {owner_id})")
        # 3. Schema.
        try:
            value = msgpack.unpackb(unpacked[1], raw=False, max_bin_len=MAX_VALUE_BYTES, max_array_len=1024,
                                    max_map_len=1024, max_ext_len=0)
        except Exception:  # noqa: BLE001
            raise MessageError(f"value of peer {owner_id} is not msgpack") from None
        if kind == "progress":
            progress.decode(owner_id, value)
            return
        theirs = manifest.decode_signed(value)
        manifest.check_schedule(theirs, self._clock())
        followed = self._organisers.get(record.key)
        if followed is not None and theirs.organiser != followed[0] and self._clock() >= followed[1]:
            raise MessageError(f"manifest stored by peer {owner_id} is not signed by this run's --run-key "
                               "(the organiser key this node follows)")


class SwarmKeyValidator(RecordValidatorBase):
    """Private-swarm admission for DHT records: every record is sealed with an HMAC under the
    swarm key; records without a valid seal are refused. Without a key (a public swarm) it only
    counts sealed records it meets, so a peer that lacks the key can say so in one line."""

    def __init__(self, swarm_key: bytes | None):
        self._key = hashlib.sha256(b"shoal swarm key\0" + swarm_key).digest() if swarm_key is not None else None
        self.refuse = _Refusals()
        self.sealed_seen = 0  # sealed records met by a node without a key (or with another key)

    @property
    def priority(self) -> int:
        return 100  # the outermost envelope: sealed last, checked (and opened) first

    def _seal(self, record: DHTRecord) -> bytes:
        return hmac.new(self._key, _record_bytes(record), hashlib.sha256).digest()

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._key is None:
            return record.value
        return msgpack.packb([SEALED_TAG, record.value, self._seal(record)])

    def strip_value(self, record: DHTRecord) -> bytes:
        unpacked = _unpack(record.value, SEALED_TAG) if self._key is not None else None
        return unpacked[1] if unpacked is not None else record.value

    def validate(self, record: DHTRecord) -> bool:
        unpacked = _unpack(record.value, SEALED_TAG)
        if self._key is None:
            if unpacked is not None:
                self.sealed_seen += 1
                return self.refuse("sealed with a swarm key this peer does not have", record)
            return True
        if unpacked is None:
            return self.refuse("not sealed with the swarm key", record)
        if not hmac.compare_digest(unpacked[2], self._seal(dataclasses.replace(record, value=unpacked[1]))):
            self.sealed_seen += 1
            return self.refuse("sealed with a different swarm key", record)
        return True


# -- hivemind's DHT protocol, as shoal runs it -----------------------------------------------------
# sha256 of the source of every hivemind function below wraps, replaces or mirrors, as reviewed
# (hivemind 1.1.12); ``install`` refuses to run on any other. What each is relied on for:
REVIEWED = {
    # only wrapped: the sender is set around it
    "DHTProtocol.rpc_store": "1be6960bd046f8f7872bee193066041268de7aef6e828a1464fe5d8852c3b8e0",
    # only wrapped; it drops a node's whole answer when _validate_dictionary says False
    "DHTProtocol.call_find": "433adef0e520e5266cbc845a7338c8017f45107eb13f0f9c23f8891fc05c7a9d",
    # replaced: validates every subkey, False if any is refused
    "DHTProtocol._validate_dictionary": "64e1927db3e373fb7afe77f6b8f44d52438e977ea77758d38f4e2b4ae88833cc",
    # builds storage and cache as DHTLocalStorage(), named in its module: BoundedStorage once installed
    "DHTProtocol.create": "a5090f84f8c2f94af4741ef75127dcd3872f11a7e45fbfc1714604cf6b006007",
    # the storage rules BoundedStorage counts: a plain value replaces a key's content, a subkey
    # joins a dictionary or replaces a plain value, only a later expiration replaces an entry
    "DHTLocalStorage.store": "e2e09fb8bbae76c5dfe38f3f77cb5167d4ea86dec150a4da5d38af0f150cfddd",
    "DHTLocalStorage.store_subkey": "a03eb0eed2a6512bcc59722d75a6ffbe699aa8ff708d23cf03128c80470d7c6a",
    "TimedStorage.store": "312d87832aaef6ca69bc769cf1be9500e3cd17fd736000ac43e7e1acdcfb805d",
}
_ORIGINALS: dict[str, Callable] = {
    "DHTProtocol.rpc_store": DHTProtocol.rpc_store,
    "DHTProtocol.call_find": DHTProtocol.call_find,
    "DHTProtocol._validate_dictionary": DHTProtocol._validate_dictionary,
    "DHTProtocol.create": DHTProtocol.create,
    "DHTLocalStorage.store": DHTLocalStorage.store,
    "DHTLocalStorage.store_subkey": DHTLocalStorage.store_subkey,
    "TimedStorage.store": TimedStorage.store,
}
_installed = False


def hivemind_changes() -> list[str]:
    """The reviewed hivemind functions whose source differs from what this module was written against."""
    return changed_functions(REVIEWED, _ORIGINALS)


async def _rpc_store_naming_sender(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
    token = STORE_SENDER.set(str(context.remote_id))
    try:
        return await _ORIGINALS["DHTProtocol.rpc_store"](self, request, context)
    finally:
        STORE_SENDER.reset(token)


async def _call_find_naming_sender(self, peer: PeerID, keys: Collection[DHTID]):
    # Each search runs in its own task: the variable is set for this answer only.
    token = STORE_SENDER.set(f"{peer} (answering our get)")
    try:
        return await _ORIGINALS["DHTProtocol.call_find"](self, peer, keys)
    finally:
        STORE_SENDER.reset(token)


def _validate_each_subkey(self, key_bytes: bytes, dictionary: DictionaryDHTValue) -> bool:
    """Drop the refused subkeys of a dictionary another node sent (a get's answer, a replica) and
    keep the rest; False only when every subkey is refused, so that nothing is kept. The answer's
    expiration may still be that of a dropped subkey: hivemind merges dictionaries by subkey, each
    with its own expiration, so it only makes the search treat the answer as fresher."""
    if self.record_validator is None:
        return True
    with dictionary.freeze():  # validate expired entries too, as hivemind does, rather than drop them unseen
        items = list(dictionary.items())
    refused = [subkey for subkey, (value, expiration) in items if not self.record_validator.validate(
        DHTRecord(key_bytes, self.serializer.dumps(subkey), value, expiration))]
    for subkey in refused:
        del dictionary[subkey]
    return len(refused) < len(items) or not items


def install() -> None:
    """Before the DHT forks (its process inherits this): name the sender in refusals, filter
    dictionaries subkey by subkey, and cap the storage. hivemind registers RPC handlers from the
    class's ``rpc_*`` functions and their annotations, which the wrappers repeat. Idempotent."""
    global _installed
    if _installed:
        return
    changed = hivemind_changes()
    if changed:
        raise RuntimeError(f"hivemind changed {', '.join(changed)} since protocols/records.py was written; "
                           "re-check them before running")
    DHTProtocol.rpc_store = _rpc_store_naming_sender
    DHTProtocol.call_find = _call_find_naming_sender
    DHTProtocol._validate_dictionary = _validate_each_subkey
    dht_protocol.DHTLocalStorage = BoundedStorage
    _installed = True
