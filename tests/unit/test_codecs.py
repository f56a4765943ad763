"""averaging.math.codecs: error bounds, idempotence, sizes, hostile bytes; and the hivemind registration."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from hivemind.averaging import allreduce
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from averaging.math import codecs
from averaging.math.codecs import CODES, HEADER, MAGIC, decode, encode, encoded_size, quantize
from averaging.network.hivemind import codecs as hivemind_codecs
from averaging.network.hivemind.pins import HivemindChanged
from protocols.messages import MessageError

INT_CODES = ("int8", "int4")
ALL_CODES = tuple(CODES)
VALUE_CODES = tuple(code for code in CODES if code != "lat8")  # lat8 carries residues (test_lattice.py)
LENGTHS = (1, 2, 3, 63, 64, 65, 255, 257, 1000, 4099)


def sample(n: int, seed: int = 0, kind: str = "gauss") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator)
    if kind == "heavy":  # Student-t(3): a normal over the root of a chi-square / 3
        x = x / (torch.randn(n, 3, generator=generator).pow(2).mean(1).sqrt() + 1e-3)
    if kind == "layers":  # magnitude varying over 2**20 along the vector
        x = x * torch.logspace(-10, 10, n, base=2.0)
    return x


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.numel() % block
    blocks = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block)
    return blocks.amax(1).repeat_interleave(block)[: x.numel()]


# -- accuracy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", INT_CODES)
@pytest.mark.parametrize("kind", ["gauss", "heavy", "layers"])
def test_int_codes_error_is_at_most_half_a_step_per_element(code, kind):
    spec = CODES[code]
    for n in LENGTHS:
        x = sample(n, seed=n, kind=kind)
        y = decode(encode(x, code), max_numel=n)
        step = block_absmax(x, spec.default_block_size) / spec.max_level
        assert bool(((x - y).abs() <= (0.5 + 2**-11) * step).all()), (code, n)


@pytest.mark.parametrize("code,gauss,heavy", [("int8", 0.0065, 0.013), ("int4", 0.12, 0.2), ("int2", 0.45, 0.67)])
def test_relative_rms_error_matches_the_documented_numbers(code, gauss, heavy):
    for kind, limit in (("gauss", gauss), ("heavy", heavy)):
        x = sample(1 << 16, kind=kind)
        error = ((x - quantize(x, code)).norm() / x.norm()).item()
        assert error < limit, (code, kind, error)
    assert ((sample(1 << 16) - quantize(sample(1 << 16), code)).norm() / sample(1 << 16).norm()) > gauss / 3


def test_int2_is_ternary_and_contractive_per_block():
    x = sample(4096 + 100, kind="heavy")
    q = quantize(x, "int2")
    block = CODES["int2"].default_block_size
    for xb, qb in zip(x.split(block), q.split(block)):
        assert len(set(qb.abs().unique().tolist()) - {0.0}) <= 1  # one magnitude per block
        assert bool((qb.sign() * xb.sign() >= 0).all())  # never the wrong sign
        assert (xb - qb).pow(2).sum() < xb.pow(2).sum()


def test_fp_codes():
    x = sample(3000, kind="layers")
    assert torch.equal(decode(encode(x, "fp32"), max_numel=3000), x)
    y = decode(encode(x, "fp16"), max_numel=3000)
    # Relative 2**-11, except subnormal fp16 (below 2**-28 of the largest value).
    assert bool(((x - y).abs() <= 2**-11 * x.abs() + 2**-39 * x.abs().max()).all())


def test_bf16_keeps_every_binade():
    """The code for optimizer moments: an Adam second moment spans tens of binades, and fp16 (even
    scaled) flushes its small entries to 0, whose square root then divides a step by eps."""
    x = torch.logspace(-30, 30, 3001) * torch.where(torch.arange(3001) % 2 == 0, 1.0, -1.0)
    y = decode(encode(x, "bf16"), max_numel=3001)
    assert bool(((x - y).abs() <= 2**-8 * x.abs()).all())  # relative 2**-8 (round to nearest of 8 bits)
    assert bool((y != 0).all())
    assert torch.equal(quantize(y, "bf16"), y) and torch.equal(quantize(x, "bf16"), y)
    assert len(encode(x, "bf16")) == encoded_size(3001, "bf16") == HEADER.size + 2 * 3001


def test_an_outlier_only_costs_its_own_block():
    x = sample(640)
    x[100] = 1e4
    y = quantize(x, "int4")
    outside = torch.ones(640, dtype=torch.bool)
    outside[64:128] = False
    assert bool(((x - y).abs()[outside] <= 0.51 * block_absmax(x, 64)[outside] / 7).all())
    assert abs(y[100] - 1e4) <= 1e4 * 2**-11  # the absmax, up to the fp16 rounding of its scale


@pytest.mark.parametrize("code", VALUE_CODES)
def test_zeros_empty_and_extreme_magnitudes(code):
    assert torch.equal(decode(encode(torch.zeros(1000), code), max_numel=1000), torch.zeros(1000))
    empty = decode(encode(torch.zeros(0), code), max_numel=0)
    assert empty.shape == (0,) and empty.dtype == torch.float32
    x = sample(2000)
    reference = ((x - quantize(x, code)).norm() / x.norm()).item()
    for magnitude in (1e-30, 1e30, 3e38):
        scaled = x / x.abs().max() * magnitude
        y = decode(encode(scaled, code), max_numel=2000)
        assert bool(torch.isfinite(y).all())
        error = ((scaled.double() - y.double()).norm() / scaled.double().norm()).item()
        assert error <= reference * 1.2 + 1e-7, (code, magnitude, error, reference)
    # Scaling by a power of two scales the result exactly: the exponent absorbs it.
    for power in (-100, -20, 20, 100):
        assert torch.equal(quantize(x * 2.0**power, code), quantize(x, code) * 2.0**power)


@pytest.mark.parametrize("code", ALL_CODES)
def test_non_finite_input_is_refused(code):
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = sample(300)
        x[17] = bad
        with pytest.raises(ValueError):
            encode(x, code)


# -- idempotence, quantize == decode(encode), sizes ---------------------------------------------------

@pytest.mark.parametrize("code", ALL_CODES)
@pytest.mark.parametrize("kind", ["gauss", "heavy", "layers"])
def test_quantize_is_idempotent_and_equals_the_byte_round_trip(code, kind):
    for n in LENGTHS:
        x = sample(n, seed=n + 1, kind=kind)
        q = quantize(x, code)
        assert torch.equal(decode(encode(x, code), max_numel=n), q)
        assert torch.equal(quantize(q, code), q), (code, kind, n)
        assert torch.equal(decode(encode(q, code), max_numel=n), q)


def test_idempotent_per_part_when_parts_are_whole_blocks():
    """What makes error feedback exact inside hivemind: a quantized vector cut at block boundaries
    and re-encoded part by part comes back bit-exactly; cut elsewhere, it does not."""
    x = sample(64 * 50 + 7, kind="heavy")
    q = quantize(x, "int4")
    aligned = torch.cat([decode(encode(part, "int4"), max_numel=640) for part in q.split(640)])
    assert torch.equal(aligned, q)
    misaligned = torch.cat([decode(encode(part, "int4"), max_numel=640) for part in q.split(600)])
    assert not torch.equal(misaligned, q)


def test_block_size_is_a_parameter():
    x = sample(1000)
    for block in (1, 32, 128, 1000, 5000):
        data = encode(x, "int4", block_size=block)
        assert len(data) == encoded_size(1000, "int4", block)
        assert torch.equal(decode(data, max_numel=1000), quantize(x, "int4", block_size=block))
    with pytest.raises(ValueError):
        encode(x, "int4", block_size=0)
    with pytest.raises(ValueError):
        encode(x, "int3")


def test_bytes_per_value_and_exact_sizes():
    assert codecs.bytes_per_value("fp32") == 4 and codecs.bytes_per_value("fp16") == 2
    assert codecs.bytes_per_value("int8") == 1 + 2 / 64
    assert codecs.bytes_per_value("int4") == 0.5 + 2 / 64
    assert codecs.bytes_per_value("int2") == 0.25 + 2 / 256
    for code in ALL_CODES:
        for n in (0, *LENGTHS):
            assert len(encode(sample(n), code)) == encoded_size(n, code)
    # A long vector costs bytes_per_value, the header aside.
    assert encoded_size(64 * 4096, "int4") - HEADER.size == 64 * 4096 * codecs.bytes_per_value("int4")


# -- hostile bytes ---------------------------------------------------------------------------------

def header(code: str = "int4", *, magic: bytes = MAGIC, version: int = 1, reserved: int = 0,
           block: int | None = None, exponent: int = 0, numel: int = 128) -> bytes:
    spec = CODES[code]
    block = spec.default_block_size if block is None else block
    return HEADER.pack(magic, version, spec.wire_id, reserved, block, exponent, numel)


def body(code: str = "int4", numel: int = 128, *, scale: bytes = struct.pack("<e", 1.0), level: int = 0x77) -> bytes:
    spec = CODES[code]
    blocks = -(-numel // spec.default_block_size) if spec.blockwise else 0
    return scale * blocks + bytes([level]) * (-(-numel * spec.bits // 8))


def rejects(data, max_numel: int = 1 << 20) -> str:
    with pytest.raises(MessageError) as caught:
        decode(data, max_numel=max_numel)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("quantized tensor: ")
    return message


def test_a_hand_built_message_decodes():
    # int4 level index 7 is zero: every value 0 (both nibbles 7).
    assert torch.equal(decode(header() + body(), max_numel=128), torch.zeros(128))
    assert torch.equal(decode(header() + body(level=0x8E), max_numel=128), torch.tensor([7.0, 1.0] * 64))


def test_malformed_messages_raise_message_error_only():
    valid = encode(sample(1000), "int4")
    assert "shorter" in rejects(b"")
    assert "bytes, expected" in rejects(valid[:-1])
    assert "bytes, expected" in rejects(valid + b"\0")
    assert "magic" in rejects(header(magic=b"SHQ\x01") + body())
    assert "version" in rejects(header(version=2) + body())
    assert "unknown code" in rejects(HEADER.pack(MAGIC, 1, 3, 0, 64, 0, 128) + body())
    assert "reserved" in rejects(header(reserved=1) + body())
    assert "block size" in rejects(header(block=0) + body())
    assert "block size" in rejects(header(block=1 << 17) + body())
    assert "exponent" in rejects(header(exponent=200) + body())
    assert "exponent" in rejects(header(exponent=-127) + body())
    assert "more than the 100" in rejects(header() + body(), max_numel=100)
    assert "more than" in rejects(header(numel=2**64 - 1), max_numel=2**40)
    assert "bytes, expected" in rejects(header(numel=256) + body(numel=128))
    assert "non-finite scale" in rejects(header() + body(scale=struct.pack("<e", float("nan"))))
    assert "non-finite scale" in rejects(header() + body(scale=struct.pack("<e", float("inf"))))
    assert "negative scale" in rejects(header() + body(scale=struct.pack("<e", -1.0)))
    assert "overflows" in rejects(header(exponent=113) + body(scale=struct.pack("<e", 65504.0)))
    assert "level index" in rejects(header() + body(level=0xF7))  # int4 nibble 15 = +8
    assert "level index" in rejects(header("int2", numel=256) + body("int2", numel=256, level=0xFF))  # ternary 3
    assert "level below" in rejects(header("int8") + body("int8", level=0x80))  # int8 -128
    assert "padding" in rejects(header(numel=127) + body(numel=127, level=0x77))  # high nibble of the last byte
    assert "non-finite value" in rejects(header("fp16", block=0, numel=4) + struct.pack("<4e", 1, 2, float("inf"), 3))
    assert "non-finite value" in rejects(header("fp32", block=0, numel=2) + struct.pack("<2f", 1, float("nan")))
    assert "fp32 with" in rejects(header("fp32", block=0, exponent=3, numel=1) + struct.pack("<f", 1))
    assert "expected bytes" in rejects("not bytes")
    assert "expected bytes" in rejects([1, 2, 3])
    assert "unreadable" in rejects(memoryview(torch.zeros(8, 8, dtype=torch.uint8).numpy()[:, ::2]))
    # Bytes-like inputs are fine.
    assert torch.equal(decode(bytearray(valid), max_numel=1000), decode(memoryview(valid), max_numel=1000))


def test_fuzz_garbage_and_mutations_raise_message_error_or_decode_within_bounds():
    rng = random.Random(1234)
    valid = {code: encode(sample(300, seed=3, kind="heavy"), code) for code in ALL_CODES}
    cases = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200))) for _ in range(150)]
    cases += [MAGIC + bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 100))) for _ in range(100)]
    for data in valid.values():
        for _ in range(60):  # flip a few bytes anywhere, header included
            mutated = bytearray(data)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
            cases.append(bytes(mutated))
        cases += [data[: rng.randrange(len(data))] for _ in range(10)]
    decoded = 0
    for data in cases:
        try:
            values = decode(data, max_numel=1000)
        except MessageError:
            continue
        decoded += 1
        assert values.dtype == torch.float32 and values.dim() == 1 and values.numel() <= 1000
        assert bool(torch.isfinite(values).all())
    assert 0 < decoded < len(cases)  # payload mutations decode (to other values), the rest are refused


# -- CUDA ------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("code", ALL_CODES)
def test_cuda_matches_cpu(code):
    x = sample(10_000, kind="heavy")
    q = quantize(x.cuda(), code)
    assert q.is_cuda and torch.equal(q.cpu(), quantize(x, code))
    assert encode(x.cuda(), code) == encode(x, code)
    assert torch.equal(decode(encode(x, code), max_numel=10_000, device="cuda").cpu(), quantize(x, code))


# -- hivemind registration -------------------------------------------------------------------------

def test_the_registrations_self_check_passes_on_the_installed_version():
    hivemind_codecs.check_registry()


def test_hivemind_self_check_names_what_changed(monkeypatch):
    async def rewritten(self, stream, sender_index):  # a future hivemind returns every delta in fp16
        for msg in stream:
            tensor_part, _weight, _part_compression = (
                deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression)
            yield serialize_torch_tensor(tensor_part, runtime_pb2.CompressionType.FLOAT16)

    monkeypatch.setattr(allreduce.AllReduceRunner, "_accumulate_parts_streaming", rewritten)
    with pytest.raises(HivemindChanged, match="re-encode deltas with the sender's type"):
        hivemind_codecs.check_registry()


def test_hivemind_self_check_catches_an_enum_that_grew_into_our_numbers(monkeypatch):
    monkeypatch.setitem(hivemind_codecs.WIRE_TYPES, int(runtime_pb2.CompressionType.FLOAT16), ("int4", "fp16"))
    with pytest.raises(HivemindChanged, match="now defines"):
        hivemind_codecs.check_registry()


@pytest.mark.parametrize("send,ret", [(s, r) for s in hivemind_codecs.SEND_CODES for r in hivemind_codecs.RETURN_CODES])
def test_every_wire_type_goes_through_hivemind_serialization(send, ret):
    x = sample(5000, kind="heavy")
    codec = hivemind_codecs.ShoalCodec(send, return_code=ret)
    wire = runtime_pb2.Tensor.FromString(codec.compress(x, None).SerializeToString())
    assert wire.compression == hivemind_codecs.wire_type(send, ret) and wire.buffer[:4] == MAGIC
    assert torch.equal(deserialize_torch_tensor(wire), quantize(x, send))
    if ret in hivemind_codecs.AVERAGE_RETURN_CODES:  # shoal's runner sends the average's own bytes
        data, values = hivemind_codecs.encode_average(x, ret)
        returned = hivemind_codecs.message(data, x, wire.compression)
        assert torch.equal(values, quantize(x, ret))
        with pytest.raises(ValueError, match="shoal's all-reduce runner"):  # hivemind's would re-encode deltas
            serialize_torch_tensor(x, wire.compression)
    else:
        returned = serialize_torch_tensor(x, wire.compression)  # what hivemind's reducer does with a delta
    assert torch.equal(deserialize_torch_tensor(returned), quantize(x, ret))
    assert runtime_pb2.CompressionType.Name(wire.compression) == f"SHOAL_{send.upper()}_RET_{ret.upper()}"


def test_registration_leaves_other_values_alone():
    assert runtime_pb2.CompressionType.Name(2) == "FLOAT16"
    with pytest.raises(ValueError):
        runtime_pb2.CompressionType.Name(7999)
    hivemind_codecs.register()  # idempotent
    assert runtime_pb2.CompressionType.Name(7416) == "SHOAL_INT4_RET_FP16"


def test_extract_refuses_a_shape_that_does_not_match():
    wire = hivemind_codecs.ShoalCodec("int4").compress(sample(100), None)
    wire.size[:] = [3, 33]
    with pytest.raises(MessageError, match="shape"):
        deserialize_torch_tensor(wire)
    wire.size[:] = [2**31, 2**31]
    with pytest.raises(MessageError, match="shape"):
        deserialize_torch_tensor(wire)


def test_part_values_set_hivemind_part_sizes():
    for part_values in (64, 2560, 64 * 999):
        codec = hivemind_codecs.ShoalCodec("int4", part_values=part_values)
        container = TensorPartContainer([torch.zeros(200_003)], (1, 1, 1), compression=codec)
        sizes = [part.numel() for peer in container._input_parts_by_peer for part, _ in peer]
        assert set(sizes[:-1]) == {part_values} and sum(sizes) == 200_003
    default = hivemind_codecs.ShoalCodec("int2")
    assert default.part_values % 256 == 0
    assert default.part_values * codecs.bytes_per_value("int2") <= 2**19
    with pytest.raises(ValueError):
        hivemind_codecs.ShoalCodec("int4", part_values=100)
    with pytest.raises(ValueError):
        hivemind_codecs.ShoalCodec("int4", return_code="int2")
