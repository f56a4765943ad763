"""Inner training on the device: AdamW steps on local batches, eval, and the hand-off between
the model on the device and the flat CPU anchor.

The model lives on the device; the anchor and outer momentum never leave the CPU. Each round the
parameters are copied device→host once (into a pinned buffer on CUDA, asynchronously, then one
sync), and after the outer step the new anchor is copied back host→device.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from averaging.flat import FlatLayout
from averaging.outer import pseudo_gradient
from node.config import InnerConfig, TrainConfig
from protocols.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without it is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: this torch build or machine has no CUDA; use --device cpu")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def inner_lr(config: InnerConfig, progress_rounds: float) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``, as a function of global progress."""
    if progress_rounds < config.warmup_rounds:
        return config.lr * max(progress_rounds, 0.01 * config.warmup_rounds) / config.warmup_rounds
    span = config.total_rounds - config.warmup_rounds
    done = min(1.0, (progress_rounds - config.warmup_rounds) / span)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done)))


class Trainer:
    """Owns the model on the device and its inner optimizer; used only from the training loop."""

    def __init__(self, model: torch.nn.Module, layout: FlatLayout, inner: InnerConfig, train: TrainConfig,
                 device: torch.device):
        self.model = model.to(device)
        self.layout = layout
        self.inner = inner
        self.device = device
        self.params = dict(self.model.named_parameters())
        assert tuple(self.params) == layout.names, "layout must follow the model's parameter order"
        use_bf16 = train.precision == "bf16" or (train.precision == "auto" and device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        decay = [p for p in self.params.values() if p.dim() >= 2]
        no_decay = [p for p in self.params.values() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=inner.lr, betas=(inner.beta1, inner.beta2), fused=device.type == "cuda",
        )
        # Host staging buffer for the params: pinned on CUDA so the device→host copies are async.
        self._host_params = layout.new_buffer(pin_memory=device.type == "cuda")

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def inner_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One AdamW step; returns the loss as a device tensor (reading it would force a sync)."""
        self.model.train()
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self._autocast():
            _, loss = self.model(x, y)
        loss.backward()
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            with self._autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss.float()
        return float(total) / len(batches)

    @torch.no_grad()
    def pseudo_gradient(self, anchor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``anchor - params`` into the CPU buffer ``out`` (one device sync)."""
        for name, view in self.layout.views(self._host_params).items():
            view.copy_(self.params[name].detach(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return pseudo_gradient(anchor, self._host_params, out=out)

    @torch.no_grad()
    def load_anchor(self, anchor: torch.Tensor) -> None:
        """Reset the model's parameters to the (new) anchor."""
        for name, view in self.layout.views(anchor).items():
            self.params[name].copy_(view, non_blocking=True)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class StepTimer:
    """An EMA of inner-step time, so the loop stops early enough to meet the round deadline."""

    def __init__(self, alpha: float = 0.2):
        self.alpha, self.mean = alpha, None

    def add(self, seconds: float) -> None:
        self.mean = seconds if self.mean is None else (1 - self.alpha) * self.mean + self.alpha * seconds

    def fits_before(self, deadline: float, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return now + (self.mean or 0.0) <= deadline
