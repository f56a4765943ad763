"""The run manifest: what a run is, published in the DHT by its peers, checked by every joiner.

A manifest names the run, the wire protocol version, the round schedule, and every field the
peers of a run must agree on (model architecture, parameter shapes and dtypes, optimizer
hyperparameters, round length...), with a hash of those fields. A joiner whose own fields hash
differently is refused before it averages anything, with one line naming the first differing
field: averaging tensors of a different model or schedule would silently corrupt the run.

Everything here is pure (no DHT): ``node.library.run_record`` stores and fetches the encoded dicts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from protocols.errors import ConfigError
from protocols.identity import RUN_KEY_BYTES, RunKey, verify_run_signature
from protocols.keys import validate_run_id, validate_shards_setting
from protocols.messages import MessageError
from protocols.version import PROTOCOL_VERSION

MANIFEST_VERSION = 2  # the encoding of this record itself

MAX_FIELDS = 256
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 256
MAX_ROUND_SECONDS = 7 * 24 * 3600.0
SIGNED_VERSION = 1  # the envelope that carries a manifest and its organiser's signature
MIN_START_TIME = 1.6e9  # 2020-09-13: no run of this protocol started before it
START_SLACK = 60.0  # seconds a start may lie ahead of the reader's clock (DHT time skew)

def fields_hash(fields: dict[str, Any]) -> str:
    """A stable hash of the agreed fields (canonical JSON: sorted keys, no whitespace)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class RunManifest:
    run_id: str
    protocol: int
    start_time: float  # unix (DHT) time of round 1's start; peers converge on the earliest
    round_seconds: float
    fields: dict[str, Any]  # flat ``section.field -> value``; values are JSON scalars or short lists
    config_hash: str
    # The organiser's public key (Ed25519) that signed it, set by ``decode_signed``; not part of ``encode``.
    organiser: bytes = b""
    signature: bytes = b""  # the organiser's signature over ``encode()``, set by ``signed_by``/``decode_signed``

    @classmethod
    def create(cls, run_id: str, fields: dict[str, Any], *, start_time: float, round_seconds: float) -> RunManifest:
        fields = _checked_fields(fields, error=ConfigError)
        return cls(validate_run_id(run_id), PROTOCOL_VERSION, float(start_time), float(round_seconds), fields,
                   fields_hash(fields))

    def encode(self) -> dict:
        return {"v": MANIFEST_VERSION, "run_id": self.run_id, "protocol": self.protocol,
                "start_time": self.start_time, "round_seconds": self.round_seconds,
                "fields": self.fields, "hash": self.config_hash}

    def with_start(self, start_time: float) -> RunManifest:
        """The same run starting at ``start_time`` (unsigned: its organiser signs it again)."""
        return RunManifest(self.run_id, self.protocol, start_time, self.round_seconds, self.fields, self.config_hash)

    def signed_by(self, key: RunKey) -> RunManifest:
        """This manifest with the organiser's signature over its canonical bytes."""
        return dataclasses.replace(self, organiser=key.public, signature=key.sign(_canonical(self.encode())))

    def signed_value(self) -> dict:
        """The DHT value: the manifest, its organiser's key and signature (any peer may republish it)."""
        assert self.signature, "only a signed manifest is published"
        return {"v": SIGNED_VERSION, "manifest": self.encode(), "run_key": self.organiser, "sig": self.signature}


def _canonical(encoded: dict) -> bytes:
    return json.dumps(encoded, sort_keys=True, separators=(",", ":")).encode()


def decode_signed(value: Any) -> RunManifest:
    """A signed manifest read from the DHT, with ``organiser`` set to the key that signed it;
    ``MessageError`` if the envelope, the manifest or the signature is bad. Which organiser to
    trust is the reader's decision (``node.library.run_record``)."""
    if not isinstance(value, dict) or value.get("v") != SIGNED_VERSION:
        raise MessageError("not a signed manifest")
    public, signature, inner = value.get("run_key"), value.get("sig"), value.get("manifest")
    if not isinstance(public, bytes) or len(public) != RUN_KEY_BYTES or not isinstance(signature, bytes):
        raise MessageError("signed manifest lacks a run key or signature")
    decoded = decode(inner)
    if not verify_run_signature(public, _canonical(decoded.encode()), signature):
        raise MessageError("manifest signature does not match its run key")
    return dataclasses.replace(decoded, organiser=public, signature=signature)


def check_schedule(theirs: RunManifest, now: float) -> None:
    """``MessageError`` if a manifest's schedule cannot be a real run's at ``now``: a start before
    ``MIN_START_TIME`` (e.g. 0, which would put every peer in round ~1.8e8) or in the future."""
    if theirs.start_time < MIN_START_TIME:
        raise MessageError(f"manifest starts at {theirs.start_time:.0f}, before {MIN_START_TIME:.0f}")
    if theirs.start_time > now + START_SLACK:
        raise MessageError(f"manifest starts {theirs.start_time - now:.0f}s in the future")


def decode(value: Any) -> RunManifest:
    """Validate a manifest read from the DHT; ``MessageError`` names what is wrong."""
    if not isinstance(value, dict):
        raise MessageError("manifest is not a map")
    if value.get("v") != MANIFEST_VERSION:
        raise MessageError(f"unknown manifest encoding {value.get('v')!r}")
    run_id, protocol, hash_ = value.get("run_id"), value.get("protocol"), value.get("hash")
    start, seconds = value.get("start_time"), value.get("round_seconds")
    if not isinstance(run_id, str) or not isinstance(hash_, str) or len(hash_) != 32:
        raise MessageError("manifest lacks a run id or hash")
    if not isinstance(protocol, int) or isinstance(protocol, bool) or not 0 < protocol < 2**31:
        raise MessageError("manifest has a bad protocol version")
    for name, number in (("start_time", start), ("round_seconds", seconds)):
        if not isinstance(number, (int, float)) or isinstance(number, bool) or not math.isfinite(number):
            raise MessageError(f"manifest has a bad {name}")
    if not 0 < seconds <= MAX_ROUND_SECONDS or start < 0:
        raise MessageError("manifest has an out-of-range schedule")
    fields = _checked_fields(value.get("fields"), error=MessageError)
    if fields_hash(fields) != hash_:
        raise MessageError("manifest hash does not match its fields")
    try:
        validate_run_id(run_id)
    except ConfigError:
        raise MessageError("manifest has an invalid run id") from None
    return RunManifest(run_id, protocol, float(start), float(seconds), fields, hash_)


# Fields whose fix is not "use the run's config": they describe this machine's data, not the file.
FIXES = {
    key: ("this peer's training text differs from the run's; point data.paths at the same files as the run's "
          "peers (and the same data.max_corpus_bytes), or set data.heterogeneous = true on every peer")
    for key in ("data.corpus_bytes", "data.corpus_sha256")
} | {
    key: ("this peer's dataset differs from the run's; point data.paths (or data.dataset) at the same files as the "
          "run's peers (same names, same contents), or set data.heterogeneous = true on every peer")
    for key in ("data.dataset_sha256", "data.dataset_files")
} | {
    key: ("this peer's tokenizer differs from the run's; point data.tokenizer at the run's tokenizer.json "
          "(every peer must map text to the same ids)")
    for key in ("data.tokenizer_sha256", "data.vocab_size")
} | {
    "model.init_sha256": ("this peer's model.init weights differ from the run's; point model.init at the same "
                          "pretrained directory as the run's peers"),
}


# Fields that follow from another (the codec's block size, return code and state code from
# ``averaging.compression`` and its settings): a difference in them is named after the setting's own.
DERIVED = frozenset({"averaging.block_size", "averaging.return_compression", "averaging.state_code"})


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first differing field, as ``field=theirs (this peer: ours)``, or None. Fields both sides
    have come first (one only a side has usually follows from another: an hf model's ``model.hf.*``
    fields from ``model.kind``), then fields that are no ``DERIVED`` one: the cause is the better name."""
    both = set(ours) & set(theirs)
    for key in sorted(set(ours) | set(theirs), key=lambda key: (key not in both, key in DERIVED, key)):
        if ours.get(key) != theirs.get(key):
            return f"{key}={theirs.get(key, '<missing>')!r} (this peer: {ours.get(key, '<missing>')!r})"
    return None


def progress_shards(manifest: RunManifest) -> int | str:
    """How many DHT keys the run's progress records are spread over (``averaging.progress_shards``;
    absent: 1, the one key; ``"auto"``: each peer's count follows the swarm's size,
    ``protocols.keys.auto_progress_shards``); ``MessageError`` if a manifest read from the network
    holds a bad count."""
    shards = manifest.fields.get("averaging.progress_shards", 1)
    try:
        return validate_shards_setting(shards)
    except ConfigError as e:
        raise MessageError(f"manifest: {e}") from None


def check_compatible(ours: RunManifest, theirs: RunManifest) -> None:
    """Raise ``ConfigError`` (one line: the field and the fix) if we must not join ``theirs``."""
    if theirs.run_id != ours.run_id:
        raise ConfigError(f"the swarm's manifest is for run '{theirs.run_id}', not '{ours.run_id}'; pass --run-id "
                          f"{theirs.run_id} to join it")
    if theirs.protocol != ours.protocol:
        newer = "upgrade shoal on this machine" if theirs.protocol > ours.protocol else "the run's peers use an older shoal"
        raise ConfigError(f"run '{ours.run_id}' speaks shoal protocol {theirs.protocol}, this peer speaks "
                          f"{ours.protocol}; {newer} (pip install -U shoal) or pick another --run-id")
    if theirs.config_hash != ours.config_hash:
        difference = first_difference(ours.fields, theirs.fields) or "the config hash"
        fix = FIXES.get(difference.split("=", 1)[0], "use the run's config or pick another --run-id")
        raise ConfigError(f"run '{ours.run_id}' is training with {difference}; {fix}")


def _checked_fields(fields: Any, *, error: type[Exception]) -> dict[str, Any]:
    if not isinstance(fields, dict) or len(fields) > MAX_FIELDS:
        raise error(f"manifest fields must be a map of at most {MAX_FIELDS} entries")
    for key, item in fields.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise error(f"manifest field name {str(key)[:MAX_KEY_CHARS]!r} is invalid")
        values = item if isinstance(item, list) else [item]
        if len(values) > MAX_FIELDS or not all(_scalar_ok(v) for v in values):
            raise error(f"manifest field {key} has an unsupported value")
    return dict(fields)


def _scalar_ok(value: Any) -> bool:
    if value is None or isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= MAX_VALUE_CHARS
