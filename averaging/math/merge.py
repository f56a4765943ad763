"""Merging an averaged update into a model that kept training (the overlap mode's core math).

At the end of round r the loop snapshots ``pseudo_grad = anchor_r - params_snapshot`` and goes
on training; the all-reduce and the outer step run in the background and produce
``anchor_{r+1}``. When that arrives, k inner steps later, the parameters are

    params = params_snapshot + local_progress           (local_progress: the k new steps)

and become ``anchor_{r+1} + local_progress``. This is the one-outer-step-delay scheme (Streaming
DiLoCo, arXiv 2501.18512, tau = 1), chosen over eager updates because it needs no extra outer state
and a failed round degrades to "nothing happened".

If our pseudo-gradient did *not* make it into the average, the parameters move by
``anchor_{r+1} - anchor_r`` only, so the work before the snapshot is folded into the next
contribution.
"""

from __future__ import annotations

import torch


def merge_correction(new_anchor: torch.Tensor, old_anchor: torch.Tensor, snapshot_pseudo_grad: torch.Tensor | None,
                     *, contributed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """What to add to the live parameters: ``new_anchor - params_snapshot`` if our pseudo-gradient
    went into the new anchor, else ``new_anchor - old_anchor`` (folded); with error feedback
    ``snapshot_pseudo_grad`` is what was sent (``averaging.math.wire.accounted_for``)."""
    correction = torch.sub(new_anchor, old_anchor, out=out)
    if contributed:
        assert snapshot_pseudo_grad is not None
        correction += snapshot_pseudo_grad
    return correction


@torch.no_grad()
def apply_correction_(params: list[torch.Tensor], corrections: list[torch.Tensor]) -> None:
    """``params += corrections`` as one fused multi-tensor op on the parameters' device."""
    torch._foreach_add_(params, corrections)
