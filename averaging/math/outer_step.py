"""The DiLoCo outer loop as pure functions on flat CPU tensors.

Every peer keeps an *anchor* (the parameters after the last outer step) and an outer momentum
buffer. Each round it sends the pseudo-gradient ``anchor - params``; the group averages them and
every peer applies the same Nesterov-SGD step to its anchor. Keeping these functions free of
threads and sockets lets the tests check them against ``torch.optim.SGD(nesterov=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocols.errors import ConfigError

FP16_MAX = torch.finfo(torch.float16).max


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """Outer optimizer: Nesterov SGD on pseudo-gradients. The defaults, lr 1.0 and momentum 0.5 (not
    DiLoCo's 0.7 / 0.9, tuned for ~500 inner steps from a pretrained start), did better at tens to
    hundreds of inner steps from scratch (docs/benchmarks.md, "Outer rates")."""

    lr: float = 1.0
    momentum: float = 0.5
    nesterov: bool = True

    def __post_init__(self):
        if not 0 < self.lr <= 10:
            raise ConfigError(f"outer.lr ({self.lr}) must be in (0, 10]; DiLoCo uses 0.7")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum ({self.momentum}) must be in [0, 1); DiLoCo uses 0.9")


def pseudo_gradient(anchor: torch.Tensor, params: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``anchor - params``: the direction the local inner steps moved, as a gradient (descent = minus)."""
    return torch.sub(anchor, params, out=out)


def outer_step_(
    anchor: torch.Tensor,
    averaged_pseudo_grad: torch.Tensor,
    momentum: torch.Tensor,
    *,
    lr: float,
    mu: float,
    nesterov: bool = True,
) -> torch.Tensor:
    """Apply one outer SGD step to ``anchor`` in place; returns the applied update (``anchor_old - anchor_new``).
    The arithmetic of ``torch.optim.SGD(lr, momentum=mu, nesterov=nesterov, dampening=0)``."""
    momentum.mul_(mu).add_(averaged_pseudo_grad)
    update = averaged_pseudo_grad.add(momentum, alpha=mu) if nesterov else momentum.clone()
    update.mul_(lr)
    anchor.sub_(update)
    return update


def kept_step(pseudo_grad: torch.Tensor) -> torch.Tensor:
    """A pseudo-gradient as an outer step is applied, kept and served to peers that missed it: fp16
    (clamped to its range), so a replay of the kept steps lands on the same anchor exactly."""
    return pseudo_grad.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def anchor_before_step(anchor: torch.Tensor, averaged_pseudo_grad: torch.Tensor, momentum: torch.Tensor, *,
                       lr: float, mu: float, nesterov: bool = True) -> torch.Tensor:
    """The anchor before ``outer_step_``, from the anchor and momentum after it and the step's
    pseudo-gradient (a new tensor). A peer re-syncing from donors that already applied this
    round's step checks their state against the group's fingerprint, taken before the step."""
    update = averaged_pseudo_grad.add(momentum, alpha=mu) if nesterov else momentum.clone()
    return anchor.add(update, alpha=lr)
