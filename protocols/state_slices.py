"""Small requests a peer makes of a donor: a state slice ("send me slice i of n of your shared
state", a joiner) and an outer update ("send me your update after step n", a peer catching up).

Why its own wire format: the donor must refuse anything but two small ints before it does any
work (copying its state), so each request is tiny, strictly bounded msgpack.
"""

from __future__ import annotations

import msgpack

from protocols.admission import PROOF_BYTES
from protocols.messages import MessageError

MAX_SLICES = 1024  # a request for more is refused: it only multiplies the donor's work per byte
MAX_PROOF_OVERHEAD = PROOF_BYTES + 8  # a private swarm's admission proof ("admit"): key and bin header
MAX_SLICE_REQUEST_BYTES = 64 + MAX_PROOF_OVERHEAD  # {"slice": i, "of": n} packs into ~20 bytes


def check_slice_index(index: int, count: int) -> None:
    """Raise MessageError unless 0 <= index < count <= MAX_SLICES."""
    for name, value in (("slice", index), ("of", count)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise MessageError(f"{name}: expected an int, got {value!r:.40}")
    if not 0 <= index < count <= MAX_SLICES:
        raise MessageError(f"slice {index} of {count}: need 0 <= slice < of <= {MAX_SLICES}")


def encode_slice_request(index: int, count: int, proof: bytes | None = None) -> bytes:
    check_slice_index(index, count)
    return msgpack.packb({"slice": index, "of": count, **_proof(proof)})


def decode_slice_request(blob: bytes) -> tuple[int, int, bytes | None]:
    """``(index, count, admission proof or None)`` from a peer's request, or MessageError: the donor
    refuses anything else."""
    request = _unpack_request(blob, "slice", ("slice", "of"), MAX_SLICE_REQUEST_BYTES)
    index, count = request["slice"], request["of"]
    check_slice_index(index, count)
    return index, count, request.get("admit")


# An update request: "send me the outer update after your n-th step" (a peer catching up → donor).
MAX_UPDATE_REQUEST_BYTES = 32 + MAX_PROOF_OVERHEAD  # {"after": n} packs into ~15 bytes
MAX_STEPS = 2**40  # like protocols.messages.MAX_ROUND


def encode_update_request(rounds_done: int, proof: bytes | None = None) -> bytes:
    _check_steps(rounds_done)
    return msgpack.packb({"after": rounds_done, **_proof(proof)})


def decode_update_request(blob: bytes) -> tuple[int, bytes | None]:
    """``(rounds_done, admission proof or None)``: the step a peer asks the next update of, or MessageError."""
    request = _unpack_request(blob, "update", ("after",), MAX_UPDATE_REQUEST_BYTES)
    _check_steps(request["after"])
    return request["after"], request.get("admit")


def _proof(proof: bytes | None) -> dict:
    if proof is None:
        return {}
    if not isinstance(proof, bytes) or len(proof) != PROOF_BYTES:
        raise MessageError(f"an admission proof is {PROOF_BYTES} bytes")
    return {"admit": proof}


def _check_steps(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_STEPS:
        raise MessageError(f"after: expected an int in [0, 2**40), got {value!r:.40}")


def _unpack_request(blob: bytes, kind: str, keys: tuple[str, ...], max_bytes: int) -> dict:
    """A request's map of exactly ``keys`` (int values, checked by the caller) and perhaps an
    admission proof ("admit"), or MessageError; msgpack is told the bounds first, so nothing larger
    is ever built."""
    if not isinstance(blob, bytes) or not 0 < len(blob) <= max_bytes:
        raise MessageError(f"{kind} request of {len(blob) if isinstance(blob, bytes) else '?'} bytes")
    try:
        request = msgpack.unpackb(blob, max_map_len=len(keys) + 1, max_str_len=8, max_array_len=0,
                                  max_bin_len=PROOF_BYTES)
    except Exception as e:  # msgpack raises several types for malformed input
        raise MessageError(f"{kind} request is not msgpack: {type(e).__name__}") from None
    if not isinstance(request, dict) or set(request) - {"admit"} != set(keys):
        raise MessageError(f"{kind} request must be {{{', '.join(f'{k}: int' for k in keys)}}}")
    if "admit" in request and not (isinstance(request["admit"], bytes) and len(request["admit"]) == PROOF_BYTES):
        raise MessageError(f"{kind} request: an admission proof is {PROOF_BYTES} bytes")
    return request
