"""What goes on the wire each round: the codec settings of a run, the pseudo-gradient made ready
for them (error feedback), and what one all-reduce costs in bytes.

``WireFormat`` is what every peer of a run shares about the all-reduce payload (``averaging.compression``,
its block size and return code; ``node.library.config.sync_shared_fields`` puts them in the run
manifest) plus one per-peer switch, ``error_feedback``.

Error feedback. A quantized send drops up to half a quantization step per element; fed back, what
a round drops re-enters the next one instead of being lost, so over ``T`` rounds the group receives
``sum g_t - r_T``, off by one residual however long the run, where plain quantization errors add up.

Where the residual lives: in the live parameters, not in a buffer. A peer sends ``q = Q(g)`` of its
pseudo-gradient ``g = anchor - params``; when that round is really averaged, the merge moves the
parameters to ``new_anchor - (g - q)`` plus the work done since the snapshot (``accounted_for``
returns ``q`` instead of ``g`` for ``merge_correction``), so the next pseudo-gradient is
``(g - q) + new work``: the residual ``r = g - q`` rides along. Every case is then exact with no
state of its own:

- a **folded** round (failed, or averaged without us) accounts for nothing: the parameters keep
  all of ``g``, the residual of earlier rounds included, for the next contribution;
- a **local** round (alone in the swarm) applies the full ``g`` to the anchor: nothing was sent,
  nothing is left over;
- a **re-sync** replaces the anchor; the parameters keep their offset from it, residual included,
  as they keep any local progress;
- a **checkpoint** holds the shared state only (anchor, momentum), byte-identical on every peer
  and independent of the codec. Like the progress made since the last round, the residual is this
  peer's unsent work and is not in it;
- the residual is per peer and never sent: a state download carries anchor and momentum only.

A buffer would need each of these as a code path of its own (commit on success only, kept through
a re-sync, saved in checkpoints, which would then differ between peers). The cost: the inner
optimizer trains from ``new_anchor - r`` instead of ``new_anchor``, an offset of at most half a
quantization step, which the next round sends anyway.

Exactness needs what the peer quantizes to be exactly what goes on the wire: ``q`` is on the
codec's grid and the codec is idempotent (``averaging.math.codecs``), so re-encoding a part returns
``q`` bit-exactly *if every part starts on a block boundary*; the network seam cuts parts that way
(``averaging.network.hivemind.parts.balanced_part_size``).

fp16 and fp32 keep hivemind's own codecs (no error feedback: fp16's rounding is ~2**-11 relative).
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
# With sub-groups (``averaging.engine.subgroups``) the anchors and outer momenta ride the all-reduce too
# (``mix_code`` picks their code). In fp16, 4 bytes a parameter each way: 11 significant bits under a
# power-of-two scale per part (values down to 2**-28 of a part's largest keep them all), so a
# member's anchor lands within about 2**-11 of its own size of the group's mean, a few thousandths of
# the change an outer step makes to a typical weight, and every member takes the same bytes where
# reducers return the mean itself (int8/int4 returns: the default). bf16 (8 bits) would snap anchors
# to 2**-9 of their size, coarser than an outer step's change to many of them. The default is the
# 1-byte lattice code (``LATTICE_CODE``) where fp16 would do; fp16 stays selectable.
MIX_CODE = "fp16"
# Where fp16 would not do: reducers that return deltas (fp16/fp32 payloads) leave each member its own
# rounding of what it sent (members of a group 2**-12 of a weight apart), and the inner optimizer's
# moments (``averaging.average_inner_state``) span more binades than fp16 keeps.
MIX_CODE_EXACT = "fp32"
# ``averaging.state_compression = "auto"`` (the default) or "lat8": 1 byte a value, residues on a grid
# the group's claims set (``averaging.math.lattice``), where fp16 would do (reducers return the mean,
# no moments ride). Measured against fp16: the same learning (simulated, 16 peers in groups of 4:
# eval 1.6073 against 1.6057), 0.56x the all-reduce payload on 8 real peers (docs/scale.md).
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
        """What this peer hands the all-reduce: ``Q(g)`` on the codec's grid (hivemind's re-encoding
        of block-aligned parts then returns it bit-exactly), or ``g`` itself for float codes.
        With error feedback ``g`` already carries the last residual (it lives in the parameters)."""
        if not self.quantized:
            return pseudo_grad
        return codecs.quantize(pseudo_grad, self.code, block_size=self.block_size)


def accounted_for(pseudo_grad: torch.Tensor, sent: torch.Tensor, *, averaged: bool, local: bool,
                  error_feedback: bool) -> torch.Tensor | None:
    """How much of the snapshot's pseudo-gradient the new anchor accounts for (``merge_correction``'s
    ``snapshot_pseudo_grad``), or None if nothing (a folded round: the parameters keep it all).

    Averaged with error feedback: only what was sent, so the parameters keep the residual ``g - q``
    for the next round (see the module docstring). Averaged without it: all of ``g`` (the residual
    is dropped). Local (alone): the anchor took the full ``g``."""
    if averaged:
        return sent if error_feedback else pseudo_grad
    if local:
        return pseudo_grad
    return None


def returned(average: torch.Tensor, own: torch.Tensor, return_code: str) -> torch.Tensor:
    """What a member ends with when its reducers return in ``return_code``: ``own + R(average - own)``
    for fp16 (hivemind's deltas: an error that differs per member), ``R(average)`` for int8/int4
    (the quantized average, the same for every member). For the in-process backend."""
    if return_code == "fp32":
        return average.clone()
    if return_code in AVERAGE_RETURN_CODES:
        return codecs.quantize(average, return_code)
    return own + codecs.quantize(average - own, return_code)


def round_payload(numel: int, group_size: int, *, send_bytes_per_value: float, return_bytes_per_value: float,
                  client_mode: bool = False) -> tuple[int, int]:
    """(sent, received) bytes of one member's all-reduce payload, sends and returns each in their code.

    A full member reduces 1/n of the vector: it sends the other (n-1)/n to their reducers in the send
    code and returns the averaged deltas of its 1/n to the n-1 others in the return code; it
    receives the same amounts. A client (it reduces nothing) sends its whole vector in the send code
    and receives the whole average back in the return code. Message headers (24 bytes a part for
    shoal's codecs) are not counted."""
    if group_size <= 1:
        return 0, 0
    if client_mode:
        return round(numel * send_bytes_per_value), round(numel * return_bytes_per_value)
    each_way = round((group_size - 1) * numel * (send_bytes_per_value + return_bytes_per_value) / group_size)
    return each_way, each_way


def mix_code(wire: WireFormat, *, with_inner_state: bool, requested: str = "auto") -> str:
    """The code of a sub-group round's extra vector (anchor, momentum and, with ``with_inner_state``,
    the inner optimizer's moments): where reducers return the mean itself and no moments ride, the
    lattice code (``requested`` "auto" or "lat8") or fp16 ("fp16"); else ``MIX_CODE_EXACT``, fp32
    (``state_compression_problem`` says where a compact request is refused)."""
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
