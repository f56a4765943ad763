"""DHT record validation: what every shoal DHT node refuses to store or to believe.

hivemind 1.1.12 runs a node's ``record_validators`` (one ``CompositeValidator``) in its DHT
process, on three paths (``dht/protocol.py``, ``dht/node.py``):

- ``rpc_store``: a record another node asks us to store; refused records are not stored and the
  storer gets ``store_ok=False``. A whole dictionary is refused if any subkey is.
- ``DHTNode.store_many``: our own stores are signed (``sign_value``) and validated before we keep
  them ourselves.
- ``call_find``: every record another node returns to our ``get``; one refused subkey drops that
  node's whole answer, the search goes on with the others. ``strip_value`` then removes the
  signatures before the application sees the value.

The validator sees ``DHTRecord(key, subkey, value, expiration_time)`` where ``key`` is the DHTID
of the key (a hash: a node can only recognise keys it can compute, i.e. runs it knows the id
of), ``subkey`` the msgpack bytes of the subkey (``DHTProtocol.IS_REGULAR_VALUE`` for a plain
value), ``value`` the bytes as stored. It does not see who sent the record: ``install`` wraps
``rpc_store`` to keep the sender in a context variable, so refusals name the peer that tried.

Rules (``ShoalRecordValidator``), for the run keys of the runs this node knows:

- a subkey is required (a plain value under a subkeyed key blocks every later subkey store);
- the subkey is the storer's libp2p public key and the value is signed by that identity, over
  key, subkey, value and expiration: nobody can write or extend another peer's record;
- the expiration is at most now + the key's TTL + ``EXPIRATION_SLACK`` (no frozen records);
- the value is at most ``MAX_VALUE_BYTES`` and decodes as a valid progress record / signed
  manifest (with a sane schedule, signed by the pinned organiser key if this node has one).

For every other key (hivemind's matchmaking and state keys, runs this node does not know):
only the expiration cap ``MAX_ANY_TTL``. ``SwarmKeyValidator`` adds private-swarm admission on
top: every record carries an HMAC with the swarm key, records without a valid one are refused.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import hmac
import inspect
import logging
import time
from collections.abc import Callable, Iterable

import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2

from protocols import manifest, progress, swarm_time
from protocols.identity import PeerKey, peer_id_of, verify_peer_signature
from protocols.keys import peers_key, run_key
from protocols.messages import MessageError

logger = logging.getLogger(__name__)

MAX_VALUE_BYTES = 16 * 1024  # a signed progress record is ~600 bytes, a manifest ~6 KiB at most
EXPIRATION_SLACK = 60.0  # clock skew between honest nodes (hivemind tolerates 30 s of DHT time skew)
MANIFEST_TTL = 600.0  # a run nobody serves any more is forgotten after this
MAX_PROGRESS_TTL = 120.0  # heartbeats: 3 x the monitor period (at most 5 s) with a wide margin
MAX_ANY_TTL = 3600.0  # any other key: hivemind's averager stores for seconds to a minute
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
        sender = STORE_SENDER.get() or "a peer answering our get"
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
        self._pinned = pinned_run_key
        self._clock = clock or swarm_time.now  # in the DHT's process: swarm time, as the expirations
        self._kinds: dict[bytes, tuple[str, float]] = {}
        for run_id in run_ids:
            self._kinds[DHTID.generate(source=run_key(run_id)).to_bytes()] = ("manifest", MANIFEST_TTL)
            self._kinds[DHTID.generate(source=peers_key(run_id)).to_bytes()] = ("progress", MAX_PROGRESS_TTL)
        self.refuse = _Refusals()

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
        if self._pinned is not None and theirs.organiser != self._pinned:
            raise MessageError(f"manifest stored by peer {owner_id} is not signed by this run's --run-key")


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


# -- naming the sender of a refused store ---------------------------------------------------------
# sha256 of hivemind 1.1.12's ``DHTProtocol.rpc_store`` as reviewed: the wrapper below only sets a
# context variable around it; an upgrade that changes it must be re-read.
REVIEWED_RPC_STORE = "1be6960bd046f8f7872bee193066041268de7aef6e828a1464fe5d8852c3b8e0"
_ORIGINAL_RPC_STORE = DHTProtocol.rpc_store
_installed = False


def rpc_store_digest() -> str:
    return hashlib.sha256(inspect.getsource(_ORIGINAL_RPC_STORE).encode()).hexdigest()


async def _rpc_store_naming_sender(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
    token = STORE_SENDER.set(str(context.remote_id))
    try:
        return await _ORIGINAL_RPC_STORE(self, request, context)
    finally:
        STORE_SENDER.reset(token)


def install() -> None:
    """Name the sender in refusals (before the DHT forks). hivemind registers RPC handlers from the
    class's ``rpc_*`` functions and their annotations, which the wrapper repeats. Idempotent."""
    global _installed
    if _installed:
        return
    if rpc_store_digest() != REVIEWED_RPC_STORE:
        raise RuntimeError("hivemind changed DHTProtocol.rpc_store since protocols/records.py was written; "
                           "re-check it before running")
    DHTProtocol.rpc_store = _rpc_store_naming_sender
    _installed = True
