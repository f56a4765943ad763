"""What goes on the wire each round: the codec settings of a run, the pseudo-gradient made ready
for them (error feedback), and what one all-reduce costs in bytes.

``WireFormat`` is what every peer of a run shares about the all-reduce payload (``averaging.compression``,
its block size and return code; ``node.library.config.sync_shared_fields`` puts them in the run
manifest) plus one per-peer switch, ``error_feedback``.

Error feedback (docs/codecs.md): the residual ``r = g - Q(g)`` lives in the live parameters, not in
a buffer. When a round is averaged the merge leaves the parameters at ``new_anchor - r`` (plus new
work), so the next pseudo-gradient carries it; a folded round keeps all of ``g``, a re-sync keeps
the offset, and checkpoints and downloads hold the shared state only, identical on every peer.

Hazard: exactness needs re-encoding a part to return ``Q(g)`` bit-exactly, which holds only if
every part starts on a block boundary (``averaging.network.hivemind.parts.balanced_part_size``).
fp16 and fp32 keep hivemind's own codecs, without error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from averaging.math import codecs

FLOAT_CODES = ("fp32", "fp16")
QUANTIZED_CODES = ("int8", "int4", "int2")
# fp16 returns deltas; int8/int4 return the quantized average, the same for every member; int2 is
# too coarse for an average nobody can error-feed (docs/codecs.md, Return path).
RETURN_CODES = ("fp16", "int8", "int4")
AVERAGE_RETURN_CODES = ("int8", "int4")
# ``averaging.return_compression = "auto"``: returns as fine as the sends, int4 at the coarsest.
AUTO_RETURN = {"int8": "int8", "int4": "int4", "int2": "int4"}
COMPRESSIONS = (*FLOAT_CODES, *QUANTIZED_CODES)  # ``averaging.compression`` values
STATE_BYTES_PER_VALUE = 4  # the shared state is stored and downloaded as fp32
# An extra vector averaged beside the pseudo-gradient (the inner optimizer's moments) goes both ways
# in bf16: fp32's range (an Adam second moment spans tens of binades, which fp16 flushes to zero).
EXTRA_CODE = "bf16"
# Codes of a sub-group round's anchors and momenta (``mix_code``; why: docs/scale.md, "Sub-groups"):
# the lattice code by default, fp16 on request, fp32 where reducers return deltas or moments ride.
MIX_CODE = "fp16"
MIX_CODE_EXACT = "fp32"
LATTICE_CODE = "lat8"
STATE_COMPRESSIONS = ("auto", "fp16", "fp32", LATTICE_CODE)


@dataclass(frozen=True, slots=True)
class WireFormat:
    """The all-reduce payload's codec: sends in ``code``, returns from reducers in ``return_code``."""

    code: str = "fp16"  # fp32 | fp16 | int8 | int4 | int2
    return_code: str = "fp16"  # quantized codes: fp16 | int8 | int4; float codes return in their own code
    block_size: int = 0  # values per scale (quantized codes); 0 for float codes
    error_feedback: bool = True  # quantized codes: what a round drops re-enters the next one (per peer)

    def __post_init__(self):
        if self.code not in FLOAT_CODES + QUANTIZED_CODES:
            raise ValueError(f"unknown code {self.code!r}")
        if self.quantized:
            if self.return_code not in RETURN_CODES:
                raise ValueError(f"return code {self.return_code!r}: use one of {RETURN_CODES}")
            if not 1 <= self.block_size <= codecs.MAX_BLOCK_SIZE:
                raise ValueError(f"block size {self.block_size} out of range")
        elif self.return_code != self.code or self.block_size:
            raise ValueError(f"{self.code} returns in {self.code} and has no block size")

    @classmethod
    def of(cls, compression: str, *, return_compression: str = "auto", block_size: int = 0,
           error_feedback: bool = True) -> WireFormat:
        """From the config's spelling (block size 0 = the code's default; return ``auto`` = ``AUTO_RETURN``)."""
        if compression not in QUANTIZED_CODES:  # a float code, or an unknown one (refused by __post_init__)
            return cls(code=compression, return_code=compression, block_size=0, error_feedback=False)
        if return_compression == "auto":
            return_compression = AUTO_RETURN[compression]
        return cls(code=compression, return_code=return_compression, error_feedback=error_feedback,
                   block_size=block_size or codecs.get_code(compression).default_block_size)

    @property
    def quantized(self) -> bool:
        return self.code in QUANTIZED_CODES

    def send_bytes_per_value(self) -> float:
        return codecs.bytes_per_value(self.code, self.block_size or None)

    def return_bytes_per_value(self) -> float:
        return codecs.bytes_per_value(self.return_code)


    @torch.no_grad()
    def to_send(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """What this peer hands the all-reduce: ``Q(g)`` on the codec's grid, or ``g`` for float codes."""
        if not self.quantized:
            return pseudo_grad
        return codecs.quantize(pseudo_grad, self.code, block_size=self.block_size)


def accounted_for(pseudo_grad: torch.Tensor, sent: torch.Tensor, *, averaged: bool, local: bool,
                  error_feedback: bool) -> torch.Tensor | None:
    """How much of the snapshot's pseudo-gradient the new anchor accounts for (``merge_correction``'s
    ``snapshot_pseudo_grad``), or None for a folded round. With error feedback only what was sent,
    so the parameters keep the residual (module docstring)."""
    if averaged:
        return sent if error_feedback else pseudo_grad
    if local:
        return pseudo_grad
    return None


def returned(average: torch.Tensor, own: torch.Tensor, return_code: str) -> torch.Tensor:
    """What a member ends with when reducers return in ``return_code`` (for the in-process backend):
    ``own + R(average - own)`` for fp16, ``R(average)`` for int8/int4."""
    if return_code == "fp32":
        return average.clone()
    if return_code in AVERAGE_RETURN_CODES:
        return codecs.quantize(average, return_code)
    return own + codecs.quantize(average - own, return_code)


def round_payload(numel: int, group_size: int, *, send_bytes_per_value: float, return_bytes_per_value: float,
                  client_mode: bool = False) -> tuple[int, int]:
    """(sent, received) bytes of one member's all-reduce payload, headers not counted: a full member
    sends (n-1)/n of its vector and returns its 1/n share to the n-1 others; a client sends all of
    it and receives all of the average."""
    if group_size <= 1:
        return 0, 0
    if client_mode:
        return round(numel * send_bytes_per_value), round(numel * return_bytes_per_value)
    each_way = round((group_size - 1) * numel * (send_bytes_per_value + return_bytes_per_value) / group_size)
    return each_way, each_way


def mix_code(wire: WireFormat, *, with_inner_state: bool, requested: str = "auto") -> str:
    """The code of a sub-group round's extra vector: the lattice code or fp16 as ``requested`` where
    reducers return the mean itself and no moments ride, else ``MIX_CODE_EXACT``."""
    compact = wire.return_code in AVERAGE_RETURN_CODES and not with_inner_state
    if not compact or requested == MIX_CODE_EXACT:
        return MIX_CODE_EXACT
    return MIX_CODE if requested == MIX_CODE else LATTICE_CODE


def state_compression_problem(wire: WireFormat, *, with_inner_state: bool, requested: str) -> str | None:
    """Why ``averaging.state_compression = requested`` cannot be honoured, or None."""
    if requested not in STATE_COMPRESSIONS:
        return f"must be one of: {', '.join(STATE_COMPRESSIONS)}"
    if requested in (LATTICE_CODE, MIX_CODE) and mix_code(wire, with_inner_state=with_inner_state,
                                                          requested=requested) != requested:
        return (f"{requested!r} needs reducers that return the average (averaging.compression int8/int4 with "
                "return_compression auto, int8 or int4) and average_inner_state = false; use \"auto\"")
    return None
