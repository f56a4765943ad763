"""Inner training on the device: AdamW (or Muon) steps on local batches and eval of the shared model.

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
MUON_SLOTS = ("momentum_buffer",)  # torch.optim.Muon's per-parameter state


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


def muon_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What Muon trains: the weight matrices of ``nn.Linear`` layers. Embeddings (and a head tied to
    one), norms and biases stay with AdamW, as MuLoCo and Muon's authors train them: Muon
    orthogonalizes a matrix's update, which means nothing for a lookup table or a vector."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.requires_grad and id(m.weight) not in embedded]


class Trainer:
    """Owns the model on the device and its inner optimizer; used only from the training loop."""

    def __init__(self, model: torch.nn.Module, inner: InnerConfig, train: TrainConfig, device: torch.device):
        self.model = model.to(device)
        self.inner = inner
        self.device = device
        self._eval_model: torch.nn.Module | None = None
        use_bf16 = train.precision == "bf16" or (train.precision == "auto" and device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        muon = muon_params(self.model) if inner.optimizer == "muon" else []
        rest = [p for p in self.model.parameters() if all(p is not q for q in muon)]
        decay = [p for p in rest if p.dim() >= 2]
        no_decay = [p for p in rest if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=inner.lr, betas=(inner.beta1, inner.beta2), fused=device.type == "cuda",
        )
        self.optimizers: list[torch.optim.Optimizer] = [self.optimizer]
        if muon:
            # Moonshot's lr adjustment (0.2 * sqrt(max(A, B))) matches AdamW's update RMS, so
            # inner.lr and its schedule carry over unchanged (torch.optim.Muon's documentation).
            self.optimizers.append(torch.optim.Muon(muon, lr=inner.lr, weight_decay=inner.weight_decay,
                                                    momentum=inner.muon_momentum, adjust_lr_fn="match_rms_adamw"))

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def inner_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One inner step; returns the loss as a device tensor (reading it would force a sync)."""
        self.model.train()
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        with self._autocast():
            _, loss = self.model(x, y)
        loss.backward()
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
        for optimizer in self.optimizers:
            optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return loss.detach()

    # -- the inner optimizer's state, for checkpoints ---------------------------------------------
    def inner_state(self) -> dict[str, torch.Tensor]:
        """The inner optimizers' per-parameter state by parameter name (AdamW's ``<name>.exp_avg``,
        ``.exp_avg_sq``, ``.step``; Muon's ``<name>.momentum_buffer``), on the CPU: saved beside the
        shared state so a resumed peer continues its inner optimizer instead of restarting it (warm
        moments, the bias correction's step)."""
        return {f"{names[index]}.{slot}": value.detach().to("cpu", copy=True)
                for optimizer, names in zip(self.optimizers, self._names_by_index())
                for index, slots in optimizer.state_dict()["state"].items()
                for slot, value in slots.items() if torch.is_tensor(value)}

    def load_inner_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``inner_state()`` through torch's own ``load_state_dict`` (which puts each slot on
        the device and dtype its optimizer uses). A state that does not fit this model or its inner
        optimizer raises ``CheckpointError`` and changes nothing."""
        owners = {name: (k, index) for k, names in enumerate(self._names_by_index()) for index, name in names.items()}
        expected = [INNER_SLOTS, MUON_SLOTS]
        params = dict(self.model.named_parameters())
        slots: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in self.optimizers]
        for key, value in state.items():
            name, _, slot = key.rpartition(".")
            if name not in owners:
                raise CheckpointError(f"inner optimizer state {key!r} does not belong to this model")
            k, index = owners[name]
            if slot not in expected[k]:
                raise CheckpointError(f"inner optimizer state {key!r} is not {self.inner.optimizer}'s "
                                      f"(a checkpoint of another inner.optimizer); start from the shared state alone")
            if slot != "step" and value.shape != params[name].shape:
                raise CheckpointError(f"inner optimizer state {key!r} has shape {tuple(value.shape)}, "
                                      f"the parameter {tuple(params[name].shape)}")
            if not torch.isfinite(value).all():
                raise CheckpointError(f"inner optimizer state {key!r} holds NaN/inf")
            slots[k].setdefault(index, {})[slot] = value
        for k, names in enumerate(self._names_by_index()):
            if len(slots[k]) != len(names) or any(set(v) != set(expected[k]) for v in slots[k].values()):
                raise CheckpointError("inner optimizer state is incomplete: every parameter needs "
                                      f"{', '.join(expected[k])}")
        for optimizer, loaded in zip(self.optimizers, slots):
            optimizer.load_state_dict({**optimizer.state_dict(), "state": loaded})

    def _names_by_index(self) -> list[dict[int, str]]:
        """Per optimizer, torch numbers its parameters in param-group order."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [{index: names[id(p)] for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
                for optimizer in self.optimizers]

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
