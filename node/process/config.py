"""The run config: one TOML file that fully defines a run, loaded into validated dataclasses.

Sections mirror the dataclasses below (``[model]``, ``[data]``, ``[inner]``, ``[outer]``,
``[round]``, ``[averaging]``, ``[train]``). CLI flags and ``SHOAL_*`` environment variables
override the file (``load_config(path, overrides)``). Everything in ``shared_fields`` must be identical on
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
from enum import StrEnum
from pathlib import Path
from typing import Any

from averaging.math.outer_step import OuterConfig
from node.library.config import AveragingConfig, RoundConfig, sync_shared_fields
from node.training.config import InnerConfig, TrainConfig
from node.training.data import DataConfig
from node.training.model import ModelConfig
from protocols.errors import ConfigError
from protocols.keys import validate_run_id


def examples_dir(checkout: Path = Path(__file__).resolve().parents[2], prefix: str = sys.prefix) -> Path:
    """The example configs: in a source checkout ``examples/configs``; in an installed wheel
    (pip, the Docker images) the copy installed under ``<prefix>/share/shoal/configs``."""
    in_checkout = checkout / "examples" / "configs"
    installed = Path(prefix) / "share" / "shoal" / "configs"
    return in_checkout if in_checkout.is_dir() or not installed.is_dir() else installed


EXAMPLES_DIR = examples_dir()
DEFAULT_CONFIG = EXAMPLES_DIR / "tiny.toml"


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


def shared_fields(config: RunConfig, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The flat ``section.field -> value`` map peers of a ``shoal run`` compare before they train together.
    ``vocab_size``: the tokenizer's, which an hf model's resolved config depends on."""
    return {
        **model_fields(config.model, vocab_size=vocab_size),
        **{f"inner.{f.name}": getattr(config.inner, f.name) for f in dataclasses.fields(config.inner)},
        "data.batch_size": config.data.batch_size, "data.num_shards": config.data.num_shards,
        "data.shard_stripe_bytes": config.data.shard_stripe_bytes, "data.heterogeneous": config.data.heterogeneous,
        "train.seed": config.train.seed,
        **sync_shared_fields(outer=config.outer, rounds=config.round, averaging=config.averaging),
    }


# Paths name files on one machine: what peers compare is their content (an hf model's resolved config
# below; ``model.init_sha256`` for the init weights, which the process adds once it has loaded them).
_LOCAL_MODEL_FIELDS = ("config", "init", "hf")
_MAX_SHARED_VALUE = 256  # protocols.manifest's MAX_VALUE_CHARS


def model_fields(model: ModelConfig, *, vocab_size: int | None = None) -> dict[str, Any]:
    """``model.*`` manifest fields. The byte GPT: its config fields. An hf model: its kind,
    architecture and seq_len, and every field of its resolved transformers config as
    ``model.hf.<name>`` (a nested value as canonical JSON, hashed past 256 characters), so two peers
    with the same shapes from a config.json and from ``[model.hf]`` agree, and peers that differ
    in any field are refused naming it."""
    fields = {f"model.{f.name}": getattr(model, f.name) for f in dataclasses.fields(model)
              if f.name not in _LOCAL_MODEL_FIELDS}
    if model.kind != "hf":
        return fields
    from node.training.hf_model import config_fields  # transformers loads only for hf runs

    fields = {key: fields[key] for key in ("model.kind", "model.architecture", "model.seq_len")}
    for name, value in sorted(config_fields(model, vocab_size=vocab_size).items()):
        if isinstance(value, dict | list | tuple) and not (
                isinstance(value, list | tuple) and all(v is None or isinstance(v, bool | int | float | str) for v in value)):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        if isinstance(value, str) and len(value) > _MAX_SHARED_VALUE:
            value = "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:32]
        fields[f"model.hf.{name}"[:64]] = list(value) if isinstance(value, tuple) else value
    return fields


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
    if origin is dict and isinstance(value, dict):
        # A free-form table (``[model.hf]``: a transformers config's own fields), passed through
        # as TOML parsed it; its dataclass validates what it needs.
        return dict(value)
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
    if isinstance(hint, type) and issubclass(hint, StrEnum) and isinstance(value, str):
        return value  # the dataclass validates it, naming the choices
    if isinstance(hint, type) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    expected = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"'{key}' must be {expected}, got {value!r}")
