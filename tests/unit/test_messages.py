"""ClaimMessage validation: everything a peer sends is checked before it is used."""

import math
import struct
from dataclasses import replace

import pytest

from protocols.messages import PROTOCOL_VERSION, ClaimMessage, MessageError

NUMEL, CHUNK_LEN, K = 10_000, 4093, 4
NUM_CHUNKS = 3  # ceil(10_000 / 4093)


def valid_report() -> ClaimMessage:
    return ClaimMessage(
        round=7,
        rounds_done=5,
        numel=NUMEL,
        chunk_len=CHUNK_LEN,
        num_projections=K,
        projections=tuple(float(i) - 5.5 for i in range(NUM_CHUNKS * K)),
        scale=(1e-3, 2e-3, 0.0),
    )


def decode(obj):
    return ClaimMessage.decode(obj, numel=NUMEL, chunk_len=CHUNK_LEN, num_projections=K)


def encoded(**changes) -> dict:
    obj = valid_report().encode()
    obj.update(changes)
    return obj


def pack(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def test_a_valid_report_round_trips():
    report = valid_report()
    obj = report.encode()
    assert obj["v"] == PROTOCOL_VERSION and obj["k"] == K
    assert isinstance(obj["proj"], bytes) and len(obj["proj"]) == 8 * NUM_CHUNKS * K
    decoded = decode(obj)
    assert decoded == report
    assert decoded.num_chunks == NUM_CHUNKS


def test_the_round_bounds_are_inclusive():
    assert decode(encoded(round=0, rounds_done=0)).round == 0
    assert decode(encoded(round=2**40, rounds_done=2**40)).rounds_done == 2**40


@pytest.mark.parametrize("obj", [None, [], "report", b"report", 7, (("v", 1),)])
def test_rejects_a_non_map(obj):
    with pytest.raises(MessageError, match="not a map"):
        decode(obj)


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION), None,
                                     bytes([PROTOCOL_VERSION])])
def test_rejects_another_protocol_version(version):
    with pytest.raises(MessageError, match="protocol version"):
        decode(encoded(v=version))


@pytest.mark.parametrize(
    "changes",
    [{"numel": NUMEL + 1}, {"numel": str(NUMEL)}, {"chunk_len": 2 * CHUNK_LEN}, {"chunk_len": None},
     {"k": K - 1}, {"k": K + 1}],
)
def test_rejects_another_fingerprint_layout(changes):
    with pytest.raises(MessageError, match="layout"):
        decode(encoded(**changes))


def test_rejects_a_fingerprint_larger_than_the_limit():
    # Our own layout is what sizes the buffers, so a huge one is refused before unpacking anything.
    obj = encoded(numel=10**9, chunk_len=1, k=4)
    with pytest.raises(MessageError, match="too large"):
        ClaimMessage.decode(obj, numel=10**9, chunk_len=1, num_projections=4)


@pytest.mark.parametrize(
    ("key", "blob"),
    [
        ("proj", pack(*[0.0] * (NUM_CHUNKS * K - 1))),  # one value short
        ("proj", pack(*[0.0] * (NUM_CHUNKS * K + 1))),  # one too many
        ("proj", pack(*[0.0] * (NUM_CHUNKS * K)) + b"\x00"),  # not a whole number of floats
        ("proj", b""),
        ("scale", pack(0.0, 0.0)),
        ("scale", pack(0.0, 0.0, 0.0, 0.0)),
        ("scale", "not bytes"),
        ("scale", [0.0, 0.0, 0.0]),
        ("proj", list(range(NUM_CHUNKS * K))),
    ],
)
def test_rejects_wrong_sized_or_typed_value_blobs(key, blob):
    with pytest.raises(MessageError, match=f"{key}: expected {NUM_CHUNKS * K if key == 'proj' else NUM_CHUNKS}"):
        decode(encoded(**{key: blob}))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("key", ["proj", "scale"])
def test_rejects_non_finite_values(key, bad):
    count = NUM_CHUNKS * K if key == "proj" else NUM_CHUNKS
    values = [1.0] * count
    values[count - 1] = bad  # the last one, so a check that stops early misses it
    with pytest.raises(MessageError, match=f"{key}: non-finite"):
        decode(encoded(**{key: pack(*values)}))


@pytest.mark.parametrize("key", ["round", "rounds_done"])
@pytest.mark.parametrize("value", [True, False, -1, 2**40 + 1, 2**64, 7.0, "7", None])
def test_rejects_bad_integers(key, value):
    with pytest.raises(MessageError, match=f"^{key}: expected an int"):
        decode(encoded(**{key: value}))


def test_a_huge_value_is_truncated_in_the_message():
    with pytest.raises(MessageError) as raised:
        decode(encoded(round="x" * 10_000))
    assert len(str(raised.value)) < 120


@pytest.mark.parametrize("key", ["v", "round", "rounds_done", "numel", "chunk_len", "k", "proj", "scale"])
def test_rejects_a_missing_key(key):
    obj = encoded()
    del obj[key]
    with pytest.raises(MessageError):
        decode(obj)


def test_message_error_is_a_value_error():
    # Callers that guard a peer's input with `except ValueError` must catch it too.
    assert issubclass(MessageError, ValueError)


def test_a_momentum_fingerprint_round_trips_and_is_optional():
    """Sub-groups add the momentum's fingerprint (``mproj``); claims without it decode to None."""
    with_momentum = replace(valid_report(), momentum=tuple(0.5 * i for i in range(NUM_CHUNKS * K)))
    assert decode(with_momentum.encode()) == with_momentum
    assert "mproj" not in valid_report().encode() and decode(valid_report().encode()).momentum is None
    with pytest.raises(MessageError, match="mproj"):
        decode(encoded(mproj=pack(1.0, 2.0)))  # the wrong size
    with pytest.raises(MessageError, match="mproj"):
        decode(encoded(mproj=pack(*([math.nan] * (NUM_CHUNKS * K)))))
