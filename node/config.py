"""The run config: one TOML file that fully defines a run, loaded into validated dataclasses.

Sections mirror the dataclasses below (``[model]``, ``[data]``, ``[inner]``, ``[outer]``,
``[round]``, ``[averaging]``, ``[train]``). CLI flags and ``SHOAL_*`` environment variables
override the file (``apply_overrides``). Everything in ``shared_fields`` must be identical on
every peer of a run; the rest is local to one machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from averaging.consistency import DEFAULT_ABS_TOL, DEFAULT_REL_TOL
from averaging.diloco import OuterConfig
from averaging.outer_loop import validate_sync
from node.data import DataConfig
from node.model import ModelConfig
from protocols.errors import ConfigError
from protocols.keys import validate_run_id


def examples_dir(checkout: Path = Path(__file__).resolve().parent.parent, prefix: str = sys.prefix) -> Path:
    """The example configs: in a source checkout ``examples/configs``; in an installed wheel
    (pip, the Docker images) the copy installed under ``<prefix>/share/shoal/configs``."""
    in_checkout = checkout / "examples" / "configs"
    installed = Path(prefix) / "share" / "shoal" / "configs"
    return in_checkout if in_checkout.is_dir() or not installed.is_dir() else installed


EXAMPLES_DIR = examples_dir()
DEFAULT_CONFIG = EXAMPLES_DIR / "tiny.toml"


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

    def __post_init__(self):
        if not 0 < self.lr < 1:
            raise ValueError(f"inner.lr ({self.lr}) must be in (0, 1); try 3e-4 to 3e-3")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"inner.{name} ({getattr(self, name)}) must be in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("inner.weight_decay and inner.grad_clip must be >= 0")
        if self.warmup_rounds < 0 or self.total_rounds <= self.warmup_rounds:
            raise ValueError(f"inner.total_rounds ({self.total_rounds}) must exceed inner.warmup_rounds ({self.warmup_rounds})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"inner.min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")


@dataclass(kw_only=True, slots=True)
class RoundConfig:
    """Rounds are wall-clock windows on a schedule every peer shares."""

    seconds: float = 10.0  # overlap mode: length of one round on the shared wall-clock schedule
    sync_mode: str = "overlap"  # overlap (background sync) | blocking (H steps, then wait: the baseline)
    inner_steps: int = 100  # blocking mode: inner steps per round (H)

    def __post_init__(self):
        if not 1.0 <= self.seconds <= 86400:
            raise ValueError(f"round.seconds ({self.seconds}) must be in [1, 86400]; use --round-seconds 10 for a CPU test run")
        validate_sync(self.sync_mode, self.inner_steps)


@dataclass(kw_only=True, slots=True)
class AveragingConfig:
    """How pseudo-gradients are averaged (hivemind butterfly all-reduce)."""

    compression: str = "fp16"  # fp16 | none
    target_group_size: int = 0  # 0 = everybody; else the maximum group size (Moshpit sub-groups)
    min_group_size: int = 2
    matchmaking_seconds: float = 3.0  # hivemind min_matchmaking_time
    request_timeout: float = 1.5  # must be < matchmaking_seconds
    allreduce_timeout: float = 60.0
    rel_tol: float = DEFAULT_REL_TOL  # anchors agree within rel_tol x RMS of the last pseudo-gradient
    abs_tol: float = DEFAULT_ABS_TOL

    def __post_init__(self):
        if self.compression not in ("fp16", "none"):
            raise ValueError(f"averaging.compression ({self.compression!r}) must be 'fp16' or 'none'")
        if self.target_group_size < 0 or self.min_group_size < 2:
            raise ValueError("averaging.target_group_size must be >= 0 and averaging.min_group_size >= 2")
        if not 0 < self.request_timeout < self.matchmaking_seconds:
            raise ValueError(
                f"averaging.request_timeout ({self.request_timeout}) must be below averaging.matchmaking_seconds "
                f"({self.matchmaking_seconds}), or matchmaking can deadlock"
            )
        if self.allreduce_timeout <= 0 or self.rel_tol <= 0 or self.abs_tol < 0:
            raise ValueError("averaging.allreduce_timeout and averaging.rel_tol must be > 0, averaging.abs_tol >= 0")


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
            raise ValueError(f"train.device ({self.device!r}) must be auto, cpu, cuda or cuda:N")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision ({self.precision!r}) must be auto, fp32 or bf16")
        if not 1.0 <= self.throttle <= 100.0:
            raise ValueError(f"train.throttle ({self.throttle}) must be in [1, 100]; 2 makes this peer behave like a GPU half as fast")
        if self.torch_threads < 0 or self.eval_batches < 1 or self.eval_every_rounds < 1 or self.checkpoint_every_rounds < 1:
            raise ValueError("train.torch_threads must be >= 0; eval_batches, eval_every_rounds, checkpoint_every_rounds >= 1")


def _is_cuda_device(text: str) -> bool:
    return text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Everything that defines a run."""

    run_id: str = "shoal-tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        validate_run_id(self.run_id)


def sync_shared_fields(*, outer: OuterConfig, rounds: RoundConfig, averaging: AveragingConfig) -> dict[str, Any]:
    """What the sync protocol itself needs every peer to agree on (any model, any loop)."""
    return {
        **{f"outer.{f.name}": getattr(outer, f.name) for f in dataclasses.fields(outer)},
        **{f"round.{f.name}": getattr(rounds, f.name) for f in dataclasses.fields(rounds)},
        # the consistency verdict must be the same on every member of a group
        **{f"averaging.{name}": getattr(averaging, name) for name in ("compression", "rel_tol", "abs_tol")},
    }


def shared_fields(config: RunConfig) -> dict[str, Any]:
    """The flat ``section.field -> value`` map peers of a ``shoal run`` compare before they train together."""
    return {
        **{f"{section}.{f.name}": getattr(getattr(config, section), f.name)
           for section in ("model", "inner") for f in dataclasses.fields(getattr(config, section))},
        "data.batch_size": config.data.batch_size, "data.num_shards": config.data.num_shards,
        "train.seed": config.train.seed,
        **sync_shared_fields(outer=config.outer, rounds=config.round, averaging=config.averaging),
    }


def shared_hash(shared: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a TOML run config (the tiny example by default), apply ``section.field`` overrides,
    and validate. Any problem raises ``ConfigError`` with one line naming the key and the fix."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass --config with a path to a .toml file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for key, value in (overrides or {}).items():
        *sections, name = key.split(".")
        target = raw
        for section in sections:
            target = target.setdefault(section, {})
        target[name] = value
    try:
        return _build(RunConfig, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None


def _build(cls: type, raw: Any, prefix: str):
    """Dataclass from a TOML table: unknown keys and wrong types are named, with the known keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}'; known keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (list, tuple) and isinstance(value, list):
        (item,) = typing.get_args(hint)[:1]
        return [_coerce(v, item, key) for v in value]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
    if isinstance(hint, type) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    expected = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"'{key}' must be {expected}, got {value!r}")
