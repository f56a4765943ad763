"""shoal's codecs (``averaging.math.codecs``) inside hivemind's butterfly all-reduce.

What hivemind 1.1.12 does with a compression, which we rely on (``check_registry`` verifies it;
docs/codecs.md, "What we rely on in hivemind 1.1.12"): a part carries its compression as an int in
an open proto3 enum; a receiver decodes through a fixed registry keyed by the enum's ``Name``; a
reducer re-encodes each delta with the *sender's* value; and parts are cut by
``estimate_compression_ratio``, so every peer must cut alike (the codec is part of the protocol).

Registration (``register``, at import; hazard: the averager is a forked process and inherits it,
so import this module before creating the averager) adds an enum value per (send, return) pair of
codes, ``7000 + 100 * send_bits + return_bits`` (an extra tensor's ``7900 +`` its header id), each
mapped to a ``ReturnCodec`` that decodes any shoal code, hostile-input safe. A peer without the
registration rejects these parts instead of misreading them.

Returns: fp16 returns deltas, as hivemind does; int8 and int4 return the *average itself*, quantized
once by its reducer, so every member ends with the same values (docs/codecs.md, "Return path").
That needs shoal's runner (``allreduce``); ``ReturnCodec.compress`` refuses them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionBase, CompressionInfo, PerTensorCompression, serialization
from hivemind.proto import runtime_pb2

from averaging.math import codecs
from averaging.math.wire import AVERAGE_RETURN_CODES, QUANTIZED_CODES, RETURN_CODES  # noqa: F401 - re-exported
from averaging.network.hivemind import pins
from averaging.network.hivemind.pins import HivemindChanged
from protocols.messages import MessageError

SEND_CODES = QUANTIZED_CODES
DEFAULT_RETURN_CODE = "fp16"
# The codes of an extra averaged tensor (``PayloadCompression``), each sent and returned in itself.
EXTRA_CODES = ("bf16", "fp16", "fp32", "lat8")
MAX_PART_NUMEL = 1 << 24  # what a receiver decodes at most per part: 64 MiB of fp32
WIRE_TYPE_BASE = 7000
EXTRA_WIRE_TYPE_BASE = 7900  # + the code's header id (bf16: 7917, fp16: 7916, fp32: 7932, lat8: 7918), clear of the pairs above (<= 7808)


def wire_type(send: str, ret: str = DEFAULT_RETURN_CODE) -> int:
    """The ``CompressionType`` value for sends in ``send`` and returns in ``ret``."""
    if send in EXTRA_CODES and ret == send:
        return EXTRA_WIRE_TYPE_BASE + codecs.get_code(send).wire_id
    if send not in SEND_CODES or ret not in RETURN_CODES:
        raise ValueError(f"unsupported codec pair {send}/{ret}: send one of {SEND_CODES}, return one of {RETURN_CODES}"
                         f" (or one of {EXTRA_CODES} both ways)")
    return WIRE_TYPE_BASE + 100 * codecs.get_code(send).bits + codecs.get_code(ret).bits


def wire_name(send: str, ret: str = DEFAULT_RETURN_CODE) -> str:
    wire_type(send, ret)  # validates
    return f"SHOAL_{send.upper()}_RET_{ret.upper()}"


WIRE_TYPES: dict[int, tuple[str, str]] = {
    **{wire_type(s, r): (s, r) for s in SEND_CODES for r in RETURN_CODES},
    **{wire_type(c, c): (c, c) for c in EXTRA_CODES},
}
WIRE_NAMES: dict[int, str] = {number: wire_name(*pair) for number, pair in WIRE_TYPES.items()}


def message(data: bytes, tensor: torch.Tensor, compression_type: int) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(compression=compression_type, buffer=data, size=tensor.shape, dtype="float32",
                              requires_grad=False)


def extract(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode a part or a returned delta; anything malformed raises ``MessageError`` (hivemind then
    bans that sender, or keeps our local values for that reducer's parts)."""
    values = codecs.decode(serialized.buffer, max_numel=MAX_PART_NUMEL)
    shape = tuple(serialized.size)
    if math.prod(shape) != values.numel():
        raise MessageError(f"quantized tensor: shape {list(shape)[:4]} does not hold {values.numel()} values")
    return values.view(shape)


class ReturnCodec(CompressionBase):
    """What the registry holds for one wire type: decodes any shoal code, encodes returned deltas."""

    def __init__(self, compression_type: int, return_code: str):
        self.compression_type, self.return_code = compression_type, return_code

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if self.return_code in AVERAGE_RETURN_CODES:
            # Only hivemind's own runner gets here (shoal's sends the average's bytes itself):
            # re-encoding a delta in this code would leave every member with other values.
            raise ValueError(f"{self.return_code} returns carry the average: they need shoal's all-reduce "
                             "runner (ShoalAverager with robust aggregation)")
        return message(codecs.encode(tensor, self.return_code), tensor, self.compression_type)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return codecs.bytes_per_value(self.return_code) / info.descriptor.dtype.itemsize


class _PartCodec(CompressionBase):
    """A shoal code inside hivemind, in parts of ``part_values`` values: ``estimate_compression_ratio``
    is how hivemind's part size is set. A subclass sets ``code``, ``block_size``, ``compression_type``,
    ``part_values`` and ``part_size_bytes`` (the averager's)."""

    code: str
    block_size: int | None
    compression_type: int
    part_values: int
    part_size_bytes: int

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return message(codecs.encode(tensor, self.code, block_size=self.block_size), tensor, self.compression_type)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # hivemind cuts int(part_size_bytes / (itemsize * ratio)) values: + 0.5 so float rounding
        # can never floor it to part_values - 1.
        return self.part_size_bytes / (info.descriptor.dtype.itemsize * (self.part_values + 0.5))


class ShoalCodec(_PartCodec):
    """The averager's ``compression``: sends parts in ``code``, asks reducers to return ``return_code``.
    ``part_values`` (a multiple of the block size) sets hivemind's part size through
    ``estimate_compression_ratio``, so part boundaries fall on block boundaries (exact error feedback).
    ``part_size_bytes`` must be the averager's."""

    def __init__(self, code: str = "int4", *, return_code: str = DEFAULT_RETURN_CODE, block_size: int | None = None,
                 part_values: int | None = None, part_size_bytes: int = DEFAULT_PART_SIZE_BYTES):
        register()
        self.compression_type = wire_type(code, return_code)
        self.code, self.return_code = code, return_code
        self.block_size = block_size or codecs.get_code(code).default_block_size
        if part_values is None:
            fitting = int(part_size_bytes / codecs.bytes_per_value(code, self.block_size))
            part_values = max(self.block_size, fitting - fitting % self.block_size)
        if part_values % self.block_size or not 0 < part_values <= MAX_PART_NUMEL:
            raise ValueError(f"part_values {part_values} must be a positive multiple of the block size "
                             f"{self.block_size}, at most {MAX_PART_NUMEL}")
        self.part_values, self.part_size_bytes = part_values, part_size_bytes

    def __repr__(self) -> str:
        return f"ShoalCodec({self.code}, return_code={self.return_code}, part_values={self.part_values})"


class ExtraCodec(_PartCodec):
    """The codec of an extra averaged tensor (``PayloadCompression``'s second): sends and returns in
    ``code`` (bf16: fp32's range, so an Adam second moment keeps its small entries), in parts of
    ``part_values`` values. No error feedback: what it carries is replaced each round, not accumulated."""

    def __init__(self, code: str = "bf16", *, part_values: int, part_size_bytes: int = DEFAULT_PART_SIZE_BYTES):
        register()
        self.compression_type = wire_type(code, code)
        self.code = self.return_code = code
        self.block_size = None  # a float code: no blocks
        if not 0 < part_values <= MAX_PART_NUMEL:
            raise ValueError(f"part_values {part_values} must be in 1..{MAX_PART_NUMEL}")
        self.part_values, self.part_size_bytes = part_values, part_size_bytes

    def __repr__(self) -> str:
        return f"ExtraCodec({self.code}, part_values={self.part_values})"


class PayloadCompression(PerTensorCompression):
    """The averager's ``compression`` when it averages two tensors: the pseudo-gradient (tensor 0)
    in its own codec, an extra tensor (tensor 1, e.g. the inner optimizer's moments) in an
    ``ExtraCodec``. hivemind cuts each tensor into parts on its own and compresses every part with
    ``CompressionInfo(key=tensor index)``, which picks the codec here."""

    def __init__(self, main: CompressionBase, extra: ExtraCodec):
        super().__init__([main, extra])
        self.main, self.extra = main, extra

    def __repr__(self) -> str:
        return f"PayloadCompression({self.main!r}, {self.extra!r})"


def average_return_code(compression: CompressionBase) -> str | None:
    """The return code if reducers return the quantized average itself (int8/int4), else None
    (fp16/fp32 and hivemind's codecs: deltas). With a ``PayloadCompression``, the main tensor's;
    its extra tensor then returns its average in its own code."""
    if isinstance(compression, PayloadCompression):
        compression = compression.main
    if isinstance(compression, ShoalCodec) and compression.return_code in AVERAGE_RETURN_CODES:
        return compression.return_code
    return None


def extra_code(compression: CompressionBase) -> str | None:
    """The extra tensor's code (``PayloadCompression``), or None for a payload of one tensor."""
    return compression.extra.code if isinstance(compression, PayloadCompression) else None


def part_types(compression: CompressionBase, parts_by_tensor: Sequence[int]) -> list[int]:
    """For every part of the whole payload (tensor 0's parts, then tensor 1's), the message type a
    reducer's answer to it carries (its tensor's codec's)."""
    codecs_ = [compression.main, compression.extra] if isinstance(compression, PayloadCompression) else [compression]
    return [getattr(codec, "compression_type", 0) for codec, count in zip(codecs_, parts_by_tensor)
            for _ in range(count)]


def encode_average(average: torch.Tensor, return_code: str) -> tuple[bytes, torch.Tensor]:
    """A reducer's return for one part: the bytes every member receives, and the values they decode
    to (which the reducer keeps for its own part: the same values as everyone's)."""
    data = codecs.encode(average, return_code)
    return data, codecs.decode(data, max_numel=max(1, average.numel())).view(average.shape)


# -- registration ----------------------------------------------------------------------------------

def check_registry() -> None:
    """Raise ``HivemindChanged`` if hivemind's code or its compression enum no longer holds what
    registration relies on (module docstring: ``pins.RELIED_ON``; the enum checks here)."""
    pins.check()
    enum = runtime_pb2.CompressionType
    defined = set(getattr(getattr(enum, "_enum_type", None), "values_by_number", {}) or {})
    if not defined or not callable(getattr(enum, "Name", None)):
        raise HivemindChanged("hivemind changed: CompressionType is not a protobuf enum wrapper with Name")
    if clash := sorted(defined & set(WIRE_TYPES)):
        raise HivemindChanged(f"hivemind changed: CompressionType now defines {clash}, which shoal's codecs use")
    probe = runtime_pb2.Tensor(compression=min(WIRE_TYPES))
    if runtime_pb2.Tensor.FromString(probe.SerializeToString()).compression != min(WIRE_TYPES):
        raise HivemindChanged("hivemind changed: Tensor.compression no longer carries values outside the enum")


def _is_registered() -> bool:
    return getattr(runtime_pb2.CompressionType.Name, "_shoal_codecs", False)


def register() -> None:
    """Teach hivemind's registry our wire types (idempotent). Run before the averager forks."""
    if _is_registered():
        return
    check_registry()
    enum = runtime_pb2.CompressionType
    original_name = enum.Name

    def name(number: int) -> str:
        found = WIRE_NAMES.get(number)
        return found if found is not None else original_name(number)

    name._shoal_codecs = True
    for number, (_, ret) in WIRE_TYPES.items():
        serialization._BASE_COMPRESSION_TYPES[WIRE_NAMES[number]] = ReturnCodec(number, ret)
    enum.Name = name  # last: a lookup never finds a name without its registry entry


register()
