"""What peers tell each other inside an all-reduce round, and its validation.

Every group member attaches a ``ClaimMessage`` to its averaging step (hivemind's ``gather``
carries it to all members). Nothing received is trusted: ``ClaimMessage.decode`` checks types,
sizes, bounds and finiteness and raises ``MessageError`` so a malformed or hostile peer is
ignored, never crashes the receiver.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from protocols.version import PROTOCOL_VERSION

MAX_FINGERPRINT_VALUES = 1 << 16


class MessageError(ValueError):
    """A peer sent something malformed; the message says what."""


MAX_ROUND = 2**40


def floats(blob: Any, count: int, what: str) -> tuple[float, ...]:
    """``count`` finite little-endian float64 values packed in ``blob``, or MessageError."""
    if not isinstance(blob, bytes) or len(blob) != 8 * count:
        raise MessageError(f"{what}: expected {count} float64 values")
    values = struct.unpack(f"<{count}d", blob)
    if not all(math.isfinite(v) for v in values):
        raise MessageError(f"{what}: non-finite value")
    return values


def bounded_int(obj: dict, key: str, low: int, high: int) -> int:
    """``obj[key]`` as an int within [low, high] (bools refused), or MessageError."""
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MessageError(f"{key}: expected an int in [{low}, {high}], got {value!r:.40}")
    return value


@dataclass(frozen=True, slots=True)
class ClaimMessage:
    """One member's claim about its anchor as it crosses the network (in hivemind's ``gather``), fixed
    when matchmaking starts: its round, its outer-step count and a fingerprint of its anchor."""

    round: int
    rounds_done: int
    numel: int
    chunk_len: int
    num_projections: int
    projections: tuple[float, ...]  # row-major [num_chunks, num_projections]
    scale: tuple[float, ...]  # [num_chunks]
    # Sub-groups only: the same fingerprint of the outer momentum, which rides their all-reduce and
    # which the group's mean is checked against (``averaging.engine.subgroups.state_problem``).
    momentum: tuple[float, ...] | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.scale)

    def encode(self) -> dict:
        return {
            "v": PROTOCOL_VERSION,
            "round": self.round,
            "rounds_done": self.rounds_done,
            "numel": self.numel,
            "chunk_len": self.chunk_len,
            "k": self.num_projections,
            "proj": struct.pack(f"<{len(self.projections)}d", *self.projections),
            "scale": struct.pack(f"<{len(self.scale)}d", *self.scale),
            # an added key: peers that do not read it ignore it
            **({"mproj": struct.pack(f"<{len(self.momentum)}d", *self.momentum)} if self.momentum is not None else {}),
        }

    @classmethod
    def decode(cls, obj: Any, *, numel: int, chunk_len: int, num_projections: int) -> ClaimMessage:
        """Validate a received claim against the layout this peer expects."""
        if not isinstance(obj, dict):
            raise MessageError("claim is not a map")
        if obj.get("v") != PROTOCOL_VERSION:
            raise MessageError(f"protocol version {obj.get('v')!r:.20}, expected {PROTOCOL_VERSION}")
        if (obj.get("numel"), obj.get("chunk_len"), obj.get("k")) != (numel, chunk_len, num_projections):
            raise MessageError("fingerprint layout differs from ours (different model?)")
        num_chunks = -(-numel // chunk_len)
        if num_chunks * num_projections > MAX_FINGERPRINT_VALUES:
            raise MessageError("fingerprint too large")
        return cls(
            round=bounded_int(obj, "round", 0, MAX_ROUND),
            rounds_done=bounded_int(obj, "rounds_done", 0, MAX_ROUND),
            numel=numel,
            chunk_len=chunk_len,
            num_projections=num_projections,
            projections=floats(obj.get("proj"), num_chunks * num_projections, "proj"),
            scale=floats(obj.get("scale"), num_chunks, "scale"),
            momentum=floats(obj["mproj"], num_chunks * num_projections, "mproj")
            if obj.get("mproj") is not None else None,
        )
