"""Round rules only the simulation runs (``benchmarks.sim.speedup``'s ``eager``, ``+norm`` and
``+lattice``): candidates measured against shoal's own rules, not shipped. Pure functions on tensors,
beside the product's in ``averaging.math``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from averaging.math.lattice import Lattice
from averaging.math.outer_step import outer_step_
from averaging.math.robust import work_radii


# -- eager overlap (arXiv 2502.12996) ---------------------------------------------------------------
def stand_in(own: torch.Tensor, previous_average: torch.Tensor | None, share: float) -> torch.Tensor:
    """Eager overlap's guess at this round's average before it lands: our own fresh pseudo-gradient
    for our weight ``share`` of the group and the last average that landed for the rest (the others'
    work, one round stale). Alone, or with no average yet: our own."""
    if previous_average is None or share >= 1:
        return own
    return own.mul(share).add_(previous_average, alpha=1 - share)


def eager_jump(old_anchor: torch.Tensor, guess: torch.Tensor, accounted: torch.Tensor, momentum: torch.Tensor, *,
               lr: float, mu: float, nesterov: bool = True) -> torch.Tensor:
    """Eager overlap: what to add to the parameters at the snapshot so that they train on from the
    anchor that ``guess`` (``stand_in``) at the group's average would give, while the real one is
    on its way. The parameters sit at ``old_anchor - accounted`` (minus any residual); adding the
    jump puts them at ``outer_step(old_anchor, guess)`` (minus the same residual). The shared state
    is untouched: ``momentum`` is read, not updated. Undo or correct it with ``landing_correction``."""
    speculative = old_anchor.clone()
    outer_step_(speculative, guess, momentum.clone(), lr=lr, mu=mu, nesterov=nesterov)
    return speculative.sub_(old_anchor).add_(accounted)


def landing_correction(correction: torch.Tensor, jump: torch.Tensor) -> torch.Tensor:
    """Eager overlap: what to add when the round lands, given the plain merge's ``correction``
    (``averaging.math.merge.merge_correction``) and the ``jump`` already added at the snapshot. Zero
    when the average equals what this peer sent; a folded round takes the jump back along with
    everything else."""
    return correction.sub(jump)


# -- the average at its members' length (+norm) -------------------------------------------------------
def keep_norm(value: torch.Tensor, parts: Sequence[torch.Tensor], weights: Sequence[float], *,
              clip_ratio: float = 2.0) -> tuple[torch.Tensor, float]:
    """The aggregate's direction at the members' length: ``value`` rescaled to the weighted mean of
    the parts' norms; (rescaled value, the factor). Averaging M displacements cancels their noise,
    so the mean is shorter than any member's (an M-th of the noise's length): DiLoCo with model
    averaging then steps less far the more peers it has, the opposite of what DDP's larger batch
    does (Decoupled DiLoCo merges norms and directions separately for this reason). Bounded for a
    public swarm: each norm counts at most ``clip_ratio`` x its ``work_radii`` x the median norm,
    and the factor is at most sqrt(len(parts)) (pure noise) and at least 1."""
    norms = torch.tensor([float(part.double().norm()) for part in parts], dtype=torch.float64)
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if not bool((w > 0).any()):
        w = torch.ones_like(w)
    cap = clip_ratio * work_radii(w) * float(norms.median())
    target = float((w * torch.minimum(norms, cap)).sum() / w.sum())
    have = float(value.double().norm())
    if not have > 0:
        return value, 1.0
    factor = min(max(target / have, 1.0), math.sqrt(len(parts)))
    return value * factor, factor


# -- a group's state as the lattice code carries it (+lattice) ------------------------------------------
def on_grid(values: torch.Tensor, lattice: Lattice) -> torch.Tensor:
    """``values`` (flat ``[anchor | momentum]``) rounded to the group's grid: what a member's state
    contributes to the mean."""
    out = values.clone()
    for start, stop, step in lattice.spans():
        out[start:stop] = ((values[start:stop].double() / step).round_() * step).float()
    return out
