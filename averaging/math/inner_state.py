"""Averaging the inner optimizer's moments across peers, landed late without losing the steps since.

Why: averaging the moments raised the simulated speedup on every seed (docs/benchmarks.md, "The
inner state averaged"). In overlap mode the mean lands ``k`` inner steps after its snapshot. Each
moment (AdamW's ``exp_avg``/``exp_avg_sq``, Muon's ``momentum_buffer``) is an exponential moving
average, so after ``k`` steps from a snapshot ``s`` it is ``decay^k s`` plus terms of those steps
alone: ``now + decay^k (a - s)`` is exactly the moment had the steps started from the mean ``a``
(``land``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

# slot -> the hyper-parameter (of the optimizer's param group) that is its per-step decay
_DECAY_OF = {"exp_avg": ("betas", 0), "exp_avg_sq": ("betas", 1), "momentum_buffer": ("momentum", None)}
MOMENT_SLOTS = tuple(_DECAY_OF)  # what may be averaged; AdamW's ``step`` (its bias correction) stays each peer's
NONNEGATIVE = frozenset({"exp_avg_sq"})  # a mean of squares: never below zero, roundoff aside


def slot_of(key: str) -> str:
    """``"<parameter name>.<slot>"`` (``Trainer.inner_state``'s keys) -> the slot."""
    return key.rpartition(".")[2]


def decays(optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, float]:
    """Each averaged slot's per-step decay, read from the optimizers' param groups. Two groups that
    disagree on a slot's decay raise: one swarm-wide landing rule per slot needs one decay."""
    found: dict[str, float] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for slot, (name, index) in _DECAY_OF.items():
                if name not in group:
                    continue
                value = float(group[name] if index is None else group[name][index])
                if found.setdefault(slot, value) != value:
                    raise ValueError(f"the inner optimizers decay {slot} by {found[slot]} and by {value}")
    return found


def weighted_mean(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                  slots: Iterable[str] = MOMENT_SLOTS) -> dict[str, torch.Tensor]:
    """The ``weights``-weighted mean of each key of ``states`` whose slot is in ``slots`` (moments
    only: in float32, returned in the first state's dtype); keys of other slots are left out."""
    wanted = set(slots)
    if not wanted <= set(MOMENT_SLOTS):
        raise ValueError(f"only moments can be averaged ({', '.join(MOMENT_SLOTS)}), not {sorted(wanted - set(MOMENT_SLOTS))}")
    if not states or len(states) != len(weights):
        raise ValueError(f"{len(states)} states and {len(weights)} weights")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"the weights sum to {total}")
    mean = {}
    for key, first in states[0].items():
        if slot_of(key) in wanted:
            acc = sum((w / total) * s[key].float() for s, w in zip(states, weights))
            mean[key] = acc.clamp_min_(0.0).to(first.dtype) if slot_of(key) in NONNEGATIVE else acc.to(first.dtype)
    return mean


def land(now: torch.Tensor, snapshot: torch.Tensor, average: torch.Tensor, *, decay: float, steps: int,
         nonnegative: bool = False) -> torch.Tensor:
    """The moment as if the ``steps`` inner steps since ``snapshot`` had started from ``average``:
    ``now + decay^steps (average - snapshot)`` (module docstring). A new tensor."""
    if steps < 0 or not 0.0 <= decay <= 1.0:
        raise ValueError(f"steps ({steps}) must be >= 0 and decay ({decay}) within [0, 1]")
    landed = now.float() + (decay ** steps) * (average.float() - snapshot.float())
    return (landed.clamp_min_(0.0) if nonnegative else landed).to(now.dtype)


def land_state(now: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor],
               average: Mapping[str, torch.Tensor], decay_of: Mapping[str, float], steps: int) -> dict[str, torch.Tensor]:
    """``now`` with every key of ``average`` landed (``land``); the other keys as they are."""
    landed = dict(now)
    for key, mean in average.items():
        slot = slot_of(key)
        landed[key] = land(now[key], snapshot[key], mean, decay=decay_of[slot], steps=steps,
                           nonnegative=slot in NONNEGATIVE)
    return landed
