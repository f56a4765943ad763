"""How hivemind cuts our vector into parts, and how long it waits for one.

Part sizes: hivemind cuts a tensor into fixed-size parts from its start, so a few large parts land
unevenly on the group, and error feedback is exact only if every part starts on a codec block
boundary (``averaging.math.wire``). So parts are balanced for the target group and block-aligned
(``balanced_part_size``), from what peers share only, so every peer cuts the same parts.

Part timeouts: hivemind's are fixed when the averager is built, yet on a slow link one answer can
take most of an all-reduce (docs/incidents.md), so they grow with the all-reduces that succeeded."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hivemind.compression import CompressionBase, Float16Compression, NoCompression

from averaging.math.codecs import bytes_per_value
from averaging.math.wire import EXTRA_CODE, WireFormat
from averaging.network.hivemind.codecs import ExtraCodec, PayloadCompression, ShoalCodec

HIVEMIND_PART_BYTES = 2**19  # hivemind's default part size (512 KiB after compression)
# Parts are balanced for this many members when the group size is open: a multiple of 12 near-equal
# parts splits evenly over groups of 2, 3, 4, 6 and 12.
OPEN_GROUP_PARTS = 12
FLOAT_COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {"fp16": Float16Compression, "fp32": NoCompression}
SENDER_SHARE = 0.4  # of allreduce_timeout, as configured (hivemind requires sender < reducer)
REDUCER_SHARE = 0.5
CEILING_SHARE = 0.9  # no part timeout reaches the whole all-reduce's
HEADROOM = 1.5  # a reducer's answer may take up to a whole all-reduce, and all-reduces vary


def part_timeouts(recent_allreduce_s: Iterable[float], allreduce_timeout: float) -> tuple[float, float]:
    """(sender_timeout, reducer_timeout): the configured shares of ``allreduce_timeout``, or
    ``HEADROOM`` x the longest recent all-reduce if that is longer, capped below the all-reduce
    timeout; the sender's stays shorter than the reducer's in the configured ratio."""
    reducer = REDUCER_SHARE * allreduce_timeout
    longest = max((s for s in recent_allreduce_s if s >= 0), default=0.0)
    reducer = min(CEILING_SHARE * allreduce_timeout, max(reducer, HEADROOM * longest))
    return reducer * SENDER_SHARE / REDUCER_SHARE, reducer


def balanced_part_size(numel: int, group_size: int, block_size: int, *, bytes_per_value: float,
                       max_part_bytes: int = HIVEMIND_PART_BYTES) -> int:
    """Values per hivemind part: a multiple of ``block_size``, at most ``max_part_bytes`` encoded,
    cutting the vector into a multiple of ``group_size`` (the target: fixed before the group) parts."""
    if numel < 0 or group_size < 1 or block_size < 1 or bytes_per_value <= 0:
        raise ValueError(f"bad arguments: numel={numel} group_size={group_size} block_size={block_size} "
                         f"bytes_per_value={bytes_per_value}")
    max_values = max(block_size, int(max_part_bytes / bytes_per_value) // block_size * block_size)
    parts_per_peer = max(1, -(-numel // (group_size * max_values)))
    per_part = -(-numel // (group_size * parts_per_peer))
    return min(max_values, max(block_size, -(-per_part // block_size) * block_size))


def part_values(wire: WireFormat, numel: int, target_group_size: int | None) -> int:
    """Values per part for a quantized code: balanced for the target group and block-aligned."""
    assert wire.quantized
    return balanced_part_size(numel, target_group_size or OPEN_GROUP_PARTS, wire.block_size,
                              bytes_per_value=wire.send_bytes_per_value())


def averager_compression(wire: WireFormat, *, numel: int, target_group_size: int | None, extra_numel: int = 0,
                         extra_code: str = EXTRA_CODE, part_size_bytes: int = HIVEMIND_PART_BYTES) -> CompressionBase:
    """The averager's ``compression``: hivemind's own for fp16/fp32, else shoal's codec with parts
    from ``part_values``; with ``extra_numel`` a second tensor rides the same all-reduce in
    ``extra_code``. Hazard: the codecs are registered at import, so the averager must fork after."""
    if not wire.quantized:
        main: CompressionBase = FLOAT_COMPRESSIONS[wire.code]()
    else:
        main = ShoalCodec(wire.code, return_code=wire.return_code, block_size=wire.block_size,
                          part_values=part_values(wire, numel, target_group_size))
    if not extra_numel:
        return main
    values = balanced_part_size(extra_numel, target_group_size or OPEN_GROUP_PARTS, 1,
                                bytes_per_value=bytes_per_value(extra_code), max_part_bytes=part_size_bytes)
    return PayloadCompression(main, ExtraCodec(extra_code, part_values=values, part_size_bytes=part_size_bytes))


def float_part_bytes(wire: WireFormat, numel: int) -> int:
    """hivemind's ``part_size_bytes`` for fp16/fp32: parts balanced over any usual group size
    (``OPEN_GROUP_PARTS``) instead of fixed 512 KiB parts."""
    bytes_per_value = wire.send_bytes_per_value()
    return int(balanced_part_size(numel, OPEN_GROUP_PARTS, 1, bytes_per_value=bytes_per_value) * bytes_per_value)
