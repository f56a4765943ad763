"""Inner training on the device: AdamW steps on local batches and eval of the shared model.

The model lives on the device; the anchor and outer momentum never leave the CPU (the round
engine, ``averaging.engine.loop``, moves data between the two).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from node.training.config import InnerConfig, TrainConfig
from protocols.errors import CheckpointError, ConfigError

INNER_SLOTS = ("step", "exp_avg", "exp_avg_sq")  # AdamW's per-parameter state


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


def device_label(device: torch.device) -> str:
    """What the dashboard and the swarm see: ``cuda:0 (NVIDIA GeForce RTX 4090)`` or ``cpu``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"[:64]
    return str(device)


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

    def __init__(self, model: torch.nn.Module, inner: InnerConfig, train: TrainConfig, device: torch.device):
        self.model = model.to(device)
        self.inner = inner
        self.device = device
        self._eval_model: torch.nn.Module | None = None
        use_bf16 = train.precision == "bf16" or (train.precision == "auto" and device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=inner.lr, betas=(inner.beta1, inner.beta2), fused=device.type == "cuda",
        )

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

    # -- the inner optimizer's state, for checkpoints ---------------------------------------------
    def inner_state(self) -> dict[str, torch.Tensor]:
        """AdamW's per-parameter state by parameter name (``<name>.exp_avg``, ``.exp_avg_sq``,
        ``.step``), on the CPU: saved beside the shared state so a resumed peer continues its
        inner optimizer instead of restarting it (warm moments, the bias correction's step)."""
        names = self._names_by_index()
        return {f"{names[index]}.{slot}": value.detach().to("cpu", copy=True)
                for index, slots in self.optimizer.state_dict()["state"].items()
                for slot, value in slots.items() if torch.is_tensor(value)}

    def load_inner_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``inner_state()`` through torch's own ``load_state_dict`` (which puts each slot on
        the device and dtype its optimizer uses). A state that does not fit this model raises
        ``CheckpointError`` and changes nothing."""
        index_of = {name: index for index, name in self._names_by_index().items()}
        params = dict(self.model.named_parameters())
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            name, _, slot = key.rpartition(".")
            if name not in index_of or slot not in INNER_SLOTS:
                raise CheckpointError(f"inner optimizer state {key!r} does not belong to this model")
            if slot != "step" and value.shape != params[name].shape:
                raise CheckpointError(f"inner optimizer state {key!r} has shape {tuple(value.shape)}, "
                                      f"the parameter {tuple(params[name].shape)}")
            if not torch.isfinite(value).all():
                raise CheckpointError(f"inner optimizer state {key!r} holds NaN/inf")
            slots.setdefault(index_of[name], {})[slot] = value
        if len(slots) != len(index_of) or any(set(v) != set(INNER_SLOTS) for v in slots.values()):
            raise CheckpointError("inner optimizer state is incomplete: every parameter needs "
                                  f"{', '.join(INNER_SLOTS)}")
        self.optimizer.load_state_dict({**self.optimizer.state_dict(), "state": slots})

    def _names_by_index(self) -> dict[int, str]:
        """torch numbers the optimizer's parameters in param-group order."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        ordered = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {index: names[id(p)] for index, p in enumerate(ordered)}

    @torch.no_grad()
    def _evaluate(self, model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        model.eval()
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            with self._autocast():
                _, loss = model(x.to(self.device), y.to(self.device))
            total += loss.float()
        return float(total) / len(batches)

    @torch.no_grad()
    def evaluate_anchor(self, anchor: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Eval loss of the shared model (the anchor), not of the live parameters, which in
        overlap mode also hold this peer's unsynced progress. Uses a second copy of the model."""
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self.model)
        for name, param in self._eval_model.named_parameters():
            if name in anchor:
                param.copy_(anchor[name], non_blocking=True)
        return self._evaluate(self._eval_model, batches)
