"""Error feedback for quantized pseudo-gradients, and part sizes that keep it exact.

Each round a peer sends ``q = Q(g + r)`` (``g`` its pseudo-gradient, ``r`` its residual) and keeps
``r' = g + r - q``: what quantization dropped re-enters the next round instead of being lost, so
over ``T`` rounds the group receives ``sum g_t + r_0 - r_T``, off by one residual (at most half a
quantization step per element for int8/int4) however long the run, where plain quantization
errors add up (``T`` independent steps).

Where the residual lives: on its peer, a flat fp32 buffer laid out like the pseudo-gradient (CPU,
next to the averager's buffer). It is never sent: it describes what *this* peer has not yet
delivered, so it is meaningful only to it and needs no agreement. Commit ``r'`` only when the
round's all-reduce succeeded; after a failed round keep ``r`` (nothing reached the group). A peer
that joins or restarts starts from zero, losing at most one round's quantization error.

Exactness needs what the peer quantizes to be exactly what goes on the wire: ``q`` is on the
codec's grid and the codec is idempotent, so hivemind's re-encoding of each part returns ``q``
bit-exactly *if every part starts on a block boundary* (blocks then coincide). hivemind cuts a
tensor into parts of a fixed number of values from its start, so the part size must be a multiple
of the block size: ``balanced_part_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from averaging.math.codecs import quantize

HIVEMIND_PART_BYTES = 2**19  # hivemind's default part size (512 KiB after compression)


@dataclass(frozen=True, slots=True)
class Feedback:
    to_send: torch.Tensor  # on the codec's grid: re-encoding it is lossless
    residual: torch.Tensor  # what quantization dropped; commit it once the round succeeded


@torch.no_grad()
def compensate(pseudo_grad: torch.Tensor, residual: torch.Tensor, code: str, *,
               block_size: int | None = None) -> Feedback:
    """What to send this round and the residual to keep; pure (neither input is modified).

    Blocks run from the start of the flat vector, like the codec's blocks within hivemind's
    parts (``balanced_part_size``). Raises ValueError if the sum is not finite: a NaN residual
    would otherwise be sent again every round."""
    assert pseudo_grad.shape == residual.shape, (pseudo_grad.shape, residual.shape)
    corrected = pseudo_grad.float() + residual
    if not bool(torch.isfinite(corrected).all()):
        raise ValueError("pseudo-gradient + residual is not finite; refusing to send or keep it")
    to_send = quantize(corrected, code, block_size=block_size)
    return Feedback(to_send=to_send, residual=corrected.sub_(to_send))


def balanced_part_size(numel: int, group_size: int, block_size: int, *, bytes_per_value: float,
                       max_part_bytes: int = HIVEMIND_PART_BYTES) -> int:
    """Values per hivemind part: a multiple of ``block_size``, at most ``max_part_bytes`` once encoded,
    and cutting the vector into a multiple of ``group_size`` near-equal parts.

    hivemind fills parts of ``max_part_bytes`` and hands them out by fractions: a vector of a few
    parts lands unevenly (4 peers can get 1, 1, 0, 2 parts), and a 4x smaller codec packs a small
    vector into one part, turning the butterfly into a star through one reducer. The part size is
    fixed before the group is known, so pass the target group size; a smaller group still gets
    block-aligned parts, less evenly spread."""
    if numel < 0 or group_size < 1 or block_size < 1 or bytes_per_value <= 0:
        raise ValueError(f"bad arguments: numel={numel} group_size={group_size} block_size={block_size} "
                         f"bytes_per_value={bytes_per_value}")
    max_values = max(block_size, int(max_part_bytes / bytes_per_value) // block_size * block_size)
    parts_per_peer = max(1, -(-numel // (group_size * max_values)))
    per_part = -(-numel // (group_size * parts_per_peer))
    return min(max_values, max(block_size, -(-per_part // block_size) * block_size))
