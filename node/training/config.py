"""Local training settings: the inner optimizer and how this machine computes.

``InnerConfig`` is shared by every peer of a run (the learning-rate schedule is a function of the
*global* round); ``TrainConfig`` is this machine's own (device, precision, threads, throttle).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class InnerConfig:
    """Inner AdamW and its schedule; the schedule is a function of the *global* round so that
    late joiners use the same learning rate as everybody else."""

    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_rounds: float = 1.0  # linear warmup, in rounds (fractions allowed)
    total_rounds: float = 200.0  # cosine decay horizon, in rounds
    min_lr_ratio: float = 0.1  # floor of the cosine, as a fraction of lr
    optimizer: str = "adamw"  # adamw | muon (Muon on the Linear weights, AdamW on the rest; the same lr)
    muon_momentum: float = 0.95  # Muon's own momentum (torch's default), used only with optimizer = "muon"

    def __post_init__(self):
        if not 0 < self.lr < 1:
            raise ConfigError(f"inner.lr ({self.lr}) must be in (0, 1); try 3e-4 to 3e-3")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"inner.{name} ({getattr(self, name)}) must be in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("inner.weight_decay and inner.grad_clip must be >= 0")
        if self.warmup_rounds < 0 or self.total_rounds <= self.warmup_rounds:
            raise ConfigError(f"inner.total_rounds ({self.total_rounds}) must exceed inner.warmup_rounds ({self.warmup_rounds})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"inner.min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"inner.optimizer ({self.optimizer!r}) is unknown; use \"adamw\" or \"muon\"")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"inner.muon_momentum ({self.muon_momentum}) must be in [0, 1)")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Local execution: where and how this peer computes."""

    seed: int = 0  # model init; shared, so every peer starts from the same weights
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    torch_threads: int = 0  # 0 = torch's default
    throttle: float = 1.0  # stretch each inner step to this many times its compute time (stand-in for a slower GPU)
    eval_batches: int = 8
    eval_every_rounds: int = 1
    checkpoint_every_rounds: int = 5

    def __post_init__(self):
        if self.device != "auto" and self.device != "cpu" and not _is_cuda_device(self.device):
            raise ConfigError(f"train.device ({self.device!r}) must be auto, cpu, cuda or cuda:N")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"train.precision ({self.precision!r}) must be auto, fp32 or bf16")
        if not 1.0 <= self.throttle <= 100.0:
            raise ConfigError(f"train.throttle ({self.throttle}) must be in [1, 100]; 2 makes this peer behave like a GPU half as fast")
        if self.torch_threads < 0 or self.eval_batches < 1 or self.eval_every_rounds < 1 or self.checkpoint_every_rounds < 1:
            raise ConfigError("train.torch_threads must be >= 0; eval_batches, eval_every_rounds, checkpoint_every_rounds >= 1")


def _is_cuda_device(text: str) -> bool:
    return text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())
