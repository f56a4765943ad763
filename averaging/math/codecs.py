"""Blockwise int8 / int4 / int2 codecs for pseudo-gradients: pure torch, vectorised, any device.

Why our own: hivemind's 8-bit codecs break on numpy 2, its blockwise one needs bitsandbytes, and
the all-reduce needs *idempotence* (re-quantizing a quantized vector returns it bit-exactly, which
makes error feedback exact, ``averaging.math.wire``) and *hostile-input safety* (``decode`` raises
``MessageError`` and nothing else). The choice of levels and block sizes, with measured errors:
docs/codecs.md.

Format (little-endian), ``HEADER`` then per-block scales then the packed levels::

    magic b"SHQ\\x00" | version u8 | code u8 | reserved u16 = 0 | block_size u32 | exponent i32 | numel u64
    scales: ceil(numel / block_size) x fp16      (blockwise codes only)
    payload: numel values of ``bits`` each, packed low bits first, zero padded to a whole byte

A value decodes to ``level * scale * 2**exponent`` (fp32); the per-tensor power-of-two ``exponent``
puts the largest block scale in [2**14, 2**15], so fp16 scales cover any fp32 magnitude. Levels
are symmetric: int8 and int4 in [-L, L] with scale = block absmax / L; int2 is ternary {-v, 0, +v}
with v the least-squares magnitude of the entries above ``TERNARY_THRESHOLD`` x mean|x|.
Idempotence holds for blocks whose scale stays a normal fp16 (within 2**28 of the largest block).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protocols.messages import MessageError

MAGIC = b"SHQ\x00"
VERSION = 1
HEADER = struct.Struct("<4sBBHIiQ")  # magic, version, code, reserved, block_size, exponent, numel
MAX_BLOCK_SIZE = 1 << 16
# The exponent keeps the largest scale in [2**14, 2**15]; -126 keeps 2**-e and 2**e finite in fp32.
MIN_EXPONENT, MAX_EXPONENT = -126, 113
SCALE_TOP_BINADE = 15
TERNARY_THRESHOLD = 0.8  # of mean|x| per block (docs/codecs.md)
FP32_MAX = torch.finfo(torch.float32).max
FP16_MAX = torch.finfo(torch.float16).max
FP16_MAX_EXPONENT = 112  # the fp16 code's exponent cap: 65504 * 2**112 < FP32_MAX
FP16_NONFINITE_BITS = 0x7C00
LATTICE_LEVELS = 256  # the lat8 code's residues: 0..255


@dataclass(frozen=True, slots=True)
class Code:
    """One wire format: its name, its id in the header, bits per value and largest level."""

    name: str
    wire_id: int
    bits: int
    max_level: int  # 0 for the float codes
    default_block_size: int  # 0 for the float codes

    @property
    def blockwise(self) -> bool:
        return self.max_level > 0

    @property
    def ternary(self) -> bool:
        return self.max_level == 1


CODES: dict[str, Code] = {
    code.name: code
    for code in (
        Code("fp32", 32, 32, 0, 0),
        Code("fp16", 16, 16, 0, 0),
        Code("bf16", 17, 16, 0, 0),  # fp32's range at 8 bits of precision: values spanning many binades
        # Lattice residues (``averaging.math.lattice``): integers 0..255, one byte each, meaningful
        # only against a reference the receiver holds (a sub-group's state).
        Code("lat8", 18, 8, 0, 0),
        Code("int8", 8, 8, 127, 64),
        Code("int4", 4, 4, 7, 64),
        Code("int2", 2, 2, 1, 256),
    )
}
_BY_WIRE_ID = {code.wire_id: code for code in CODES.values()}


def get_code(name: str) -> Code:
    if name not in CODES:
        raise ValueError(f"unknown codec {name!r}: use one of {', '.join(CODES)}")
    return CODES[name]


def _block_size(code: Code, block_size: int | None) -> int:
    if not code.blockwise:
        return 0
    block = code.default_block_size if block_size is None else block_size
    if not 1 <= block <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size {block} out of range: use 1..{MAX_BLOCK_SIZE}")
    return block


def encoded_size(numel: int, code: str, block_size: int | None = None) -> int:
    """Exact bytes of ``encode`` for ``numel`` values: header, scales and packed payload."""
    spec = get_code(code)
    block = _block_size(spec, block_size)
    scales = 2 * -(-numel // block) if spec.blockwise else 0
    return HEADER.size + scales + -(-numel * spec.bits // 8)


def bytes_per_value(code: str, block_size: int | None = None) -> float:
    """Bytes per value on the wire for a long vector (the fixed header excluded): traffic accounting."""
    spec = get_code(code)
    block = _block_size(spec, block_size)
    return spec.bits / 8 + (2 / block if spec.blockwise else 0.0)


# -- quantization (shared by encode and quantize, so both give bit-identical values) ---------------

@dataclass(frozen=True, slots=True)
class _Quantized:
    levels: torch.Tensor  # int8 [num_blocks, block] (padded), or fp16/fp32 [numel] for float codes
    scales: torch.Tensor  # fp16 [num_blocks], or empty for float codes
    exponent: torch.Tensor  # int32 scalar, on the input's device (no host sync)
    step: torch.Tensor  # fp32 [num_blocks, 1]: scale * 2**exponent, what a level is multiplied by
    finite: torch.Tensor  # bool scalar: was the input finite (NaN and inf propagate into a reduction)


def _exponent_for(peak: torch.Tensor, top: int) -> torch.Tensor:
    """Power of two that maps ``peak`` into [2**14, 2**15): fp16 then has 28 binades below it."""
    _, exponent = torch.frexp(peak)
    return (exponent - SCALE_TOP_BINADE).clamp(MIN_EXPONENT, top)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones((), device=exponent.device), exponent)


def _peak(values: torch.Tensor) -> torch.Tensor:
    return values.max() if values.numel() else values.new_zeros(())


def _quantize(tensor: torch.Tensor, spec: Code, block: int) -> _Quantized:
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    no_scales = flat.new_empty(0, dtype=torch.float16)
    if spec.name == "fp32":
        zero = torch.zeros((), dtype=torch.int32, device=flat.device)
        return _Quantized(flat, no_scales, zero, flat.new_ones(()), torch.isfinite(_peak(flat.abs())))
    if spec.name == "lat8":  # residues mod 256 of the nearest integer
        zero = torch.zeros((), dtype=torch.int32, device=flat.device)
        residues = torch.remainder(flat.round(), LATTICE_LEVELS)
        return _Quantized(residues.to(torch.uint8), no_scales, zero, flat.new_ones(()),
                          torch.isfinite(_peak(flat.abs())))
    if spec.name == "bf16":
        zero = torch.zeros((), dtype=torch.int32, device=flat.device)
        brain = flat.to(torch.bfloat16)  # rounds to nearest; fp32's largest values may round to inf
        return _Quantized(brain, no_scales, zero, flat.new_ones(()), torch.isfinite(_peak(brain.abs())))
    if spec.name == "fp16":
        peak = _peak(flat.abs())
        # e <= 112 and saturating at 65504 keep 65504 * 2**e finite in fp32 (2**15 * 2**113 is not).
        exponent = _exponent_for(peak, FP16_MAX_EXPONENT)
        # Scalar factors: ldexp on a whole vector is ~20x slower than a multiply.
        half = (flat * _power_of_two(-exponent)).clamp_(-FP16_MAX, FP16_MAX).to(torch.float16)
        return _Quantized(half, no_scales, exponent, _power_of_two(exponent), torch.isfinite(peak))

    numel = flat.numel()
    pad = -numel % block
    blocks = (F.pad(flat, (0, pad)) if pad else flat).view(-1, block)
    magnitude = blocks.abs()
    if spec.ternary:
        # Sums of a block of magnitudes scaled by 2**-k >= 1/block cannot overflow fp32; the
        # power-of-two scaling is exact, so v (and idempotence) do not change.
        shrink = 2.0 ** -max(0, (block - 1).bit_length())
        magnitude.mul_(shrink)
        counts = torch.full((blocks.shape[0], 1), float(block), device=flat.device)
        if pad:
            counts[-1] = block - pad
        totals = magnitude.sum(dim=1, keepdim=True)
        keep = magnitude > TERNARY_THRESHOLD * totals / counts
        kept = keep.sum(dim=1, keepdim=True)
        raw = magnitude.masked_fill_(~keep, 0.0).sum(dim=1, keepdim=True) / kept.clamp(min=1) / shrink
        finite = torch.isfinite(totals).all()
    else:
        raw = magnitude.amax(dim=1, keepdim=True) / spec.max_level
        finite = torch.isfinite(raw).all()
    del magnitude
    # Below FP32_MAX / L with room for the fp16 rounding of the scale: L * step never overflows.
    raw = raw.clamp_(max=FP32_MAX / spec.max_level / (1 + 2**-10))
    exponent = _exponent_for(_peak(raw), MAX_EXPONENT)
    scales = torch.ldexp(raw, -exponent).to(torch.float16)
    step = torch.ldexp(scales.float(), exponent)  # exact: a power-of-two multiple of an fp16
    if spec.ternary:
        kept_levels = keep.to(torch.int8)
        levels = torch.where(blocks < 0, -kept_levels, kept_levels)
    else:
        # A zero step only occurs for an all-zero block (or one 2**28 below the largest): divide by 1.
        levels = torch.div(blocks, torch.where(step > 0, step, 1.0)).round_().clamp_(-spec.max_level, spec.max_level)
        levels = levels.to(torch.int8)
    return _Quantized(levels, scales.view(-1), exponent, step, finite)


def _dequantize(levels: torch.Tensor, step: torch.Tensor, numel: int) -> torch.Tensor:
    return (levels.to(torch.float32) * step).view(-1)[:numel]


@torch.no_grad()
def quantize(tensor: torch.Tensor, code: str, *, block_size: int | None = None) -> torch.Tensor:
    """``decode(encode(tensor))`` without the bytes: fp32, same shape and device, bit-identical.

    No host sync, so it can run on a CUDA stream. Non-finite input gives an unspecified result
    (``encode`` refuses it)."""
    spec = get_code(code)
    quantized = _quantize(tensor, spec, _block_size(spec, block_size))
    if spec.blockwise:
        values = _dequantize(quantized.levels, quantized.step, tensor.numel())
    else:
        values = quantized.levels.float() * quantized.step
    return values.view(tensor.shape)


# -- bytes -------------------------------------------------------------------------------------------

def _pack(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2**bits, ``8 // bits`` to a byte, the first in the low bits; zero padded."""
    per_byte = 8 // bits
    pad = -indices.numel() % per_byte
    grouped = (F.pad(indices, (0, pad)) if pad else indices).view(-1, per_byte)
    packed = grouped[:, 0].clone()
    for slot in range(1, per_byte):  # at most 3 vectorised ops, not a loop over values
        packed |= grouped[:, slot] << (slot * bits)
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (slot * bits)) & mask for slot in range(per_byte)], dim=1).view(-1)


@torch.no_grad()
def encode(tensor: torch.Tensor, code: str, *, block_size: int | None = None) -> bytes:
    """``tensor`` (any float dtype, shape, device) as ``code`` bytes; ``decode`` returns it flat, fp32.

    Raises ValueError for non-finite input: nothing non-finite goes on the wire."""
    spec = get_code(code)
    block = _block_size(spec, block_size)
    numel = tensor.numel()
    quantized = _quantize(tensor, spec, block)
    if not bool(quantized.finite):  # the one host sync of encode (with the copies below)
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    if spec.blockwise:
        levels = quantized.levels.view(-1)[:numel]
        if spec.bits < 8:
            offset = 1 if spec.ternary else spec.max_level
            levels = _pack((levels + offset).to(torch.uint8), spec.bits)
        parts = [quantized.scales, levels]
    else:
        parts = [quantized.levels.view(torch.int16) if spec.name == "bf16" else quantized.levels]
    header = HEADER.pack(MAGIC, VERSION, spec.wire_id, 0, block, int(quantized.exponent), numel)
    return b"".join([header, *(part.contiguous().cpu().numpy().tobytes() for part in parts)])


def _fail(reason: str) -> MessageError:
    return MessageError(f"quantized tensor: {reason}")


def decode(data: bytes | bytearray | memoryview, *, max_numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The flat fp32 tensor in ``data``. Hostile-input safe: anything malformed, truncated, longer
    than ``max_numel`` values, inconsistent or non-finite raises ``MessageError``; nothing is
    allocated before the header has been checked against ``max_numel`` and the exact length."""
    view, spec, block, exponent, numel = _checked_header(data, max_numel)
    # Scales and payload, copied once: bytes are read-only, torch wants writable memory.
    body = torch.frombuffer(bytearray(view[HEADER.size:]), dtype=torch.uint8) if len(view) > HEADER.size \
        else torch.empty(0, dtype=torch.uint8)
    body = body.to(device)
    if not spec.blockwise:
        return _decode_float(body, spec, exponent)
    return _decode_blocks(body, spec, block, exponent, numel)


def _checked_header(data: bytes | bytearray | memoryview, max_numel: int):
    """The header's fields, and the exact length they imply, checked before any allocation."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _fail(f"expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:  # a non-contiguous or multi-dimensional view
        raise _fail(f"unreadable buffer ({e})") from None
    if len(view) < HEADER.size:
        raise _fail(f"{len(view)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, wire_id, reserved, block, exponent, numel = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise _fail("bad magic")
    if version != VERSION:
        raise _fail(f"version {version}, expected {VERSION}")
    spec = _BY_WIRE_ID.get(wire_id)
    if spec is None:
        raise _fail(f"unknown code {wire_id}")
    if reserved != 0:
        raise _fail("reserved field is not zero")
    if numel > max_numel:
        raise _fail(f"{numel} values, more than the {max_numel} allowed")
    if spec.blockwise:
        if not 1 <= block <= MAX_BLOCK_SIZE:
            raise _fail(f"block size {block} out of range")
        if not MIN_EXPONENT <= exponent <= MAX_EXPONENT:
            raise _fail(f"exponent {exponent} out of range")
    elif block != 0 or (spec.name in ("fp32", "bf16", "lat8") and exponent != 0):
        raise _fail(f"{spec.name} with block size {block}, exponent {exponent}")
    elif not MIN_EXPONENT <= exponent <= FP16_MAX_EXPONENT:
        raise _fail(f"exponent {exponent} out of range")
    expected = encoded_size(numel, spec.name, block or None)
    if len(view) != expected:
        raise _fail(f"{len(view)} bytes, expected {expected} for {numel} {spec.name} values")
    return view, spec, block, exponent, numel


_FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _decode_float(body: torch.Tensor, spec, exponent: int) -> torch.Tensor:
    if spec.name == "lat8":  # every byte is a valid residue
        return body.float()
    values = body.view(_FLOAT_DTYPES[spec.name])
    # amax propagates NaN and inf, and is much faster than isfinite(values).all().
    if values.numel() and not bool(torch.isfinite(values.abs().amax())):
        raise _fail("non-finite value")
    if spec.name == "fp32":
        return values
    return values.float() if spec.name == "bf16" else values.float().mul_(2.0**exponent)


def _decode_blocks(body: torch.Tensor, spec, block: int, exponent: int, numel: int) -> torch.Tensor:
    """fp16 scales, then packed levels; every scale and level is range-checked before use."""
    num_blocks = -(-numel // block)
    scale_bits = body[: 2 * num_blocks].view(torch.int16)
    if bool(((scale_bits & FP16_NONFINITE_BITS) == FP16_NONFINITE_BITS).any()):
        raise _fail("non-finite scale")
    if bool((scale_bits < 0).any()):
        raise _fail("negative scale")
    scales = scale_bits.view(torch.float16).float()
    if num_blocks and float(scales.max()) * spec.max_level * 2.0**exponent > FP32_MAX:
        raise _fail("scale overflows float32")
    payload = body[2 * num_blocks :]
    if spec.bits < 8:
        indices = _unpack(payload, spec.bits)
        if bool(indices[numel:].any()):
            raise _fail("non-zero padding bits")
        indices = indices[:numel]
        largest = 2 if spec.ternary else 2 * spec.max_level
        if numel and int(indices.max()) > largest:
            raise _fail(f"level index above {largest}")
        levels = indices.to(torch.int8) - (1 if spec.ternary else spec.max_level)
    else:
        levels = payload.view(torch.int8)
        if numel and int(levels.min()) < -spec.max_level:
            raise _fail(f"level below -{spec.max_level}")
    pad = num_blocks * block - numel
    levels = F.pad(levels, (0, pad)) if pad else levels
    step = torch.ldexp(scales, torch.tensor(exponent, device=body.device)).view(-1, 1)
    return _dequantize(levels.view(num_blocks, block), step, numel)
