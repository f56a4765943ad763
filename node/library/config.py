"""The library's settings: how rounds end and how pseudo-gradients are averaged.

A library user passes these to ``DiLoCoSwarm``; ``shoal run`` reads them from the ``[round]`` and
``[averaging]`` sections of its TOML file. ``sync_shared_fields`` lists what every peer of a run
must agree on for the sync protocol itself, whatever the model and training loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from averaging.consistency import DEFAULT_ABS_TOL, DEFAULT_REL_TOL
from averaging.diloco import OuterConfig
from averaging.outer_loop import SyncMode, validate_sync
from protocols.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class RoundConfig:
    """Rounds are wall-clock windows on a schedule every peer shares."""

    seconds: float = 10.0  # overlap mode: length of one round on the shared wall-clock schedule
    sync_mode: SyncMode = SyncMode.OVERLAP  # overlap (background sync) | blocking (H steps, then wait: the baseline)
    inner_steps: int = 100  # blocking mode: inner steps per round (H)

    def __post_init__(self):
        if not 1.0 <= self.seconds <= 86400:
            raise ConfigError(f"round.seconds ({self.seconds}) must be in [1, 86400]; use --round-seconds 10 for a CPU test run")
        self.sync_mode = validate_sync(self.sync_mode, self.inner_steps)


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
            raise ConfigError(f"averaging.compression ({self.compression!r}) must be 'fp16' or 'none'")
        if self.target_group_size < 0 or self.min_group_size < 2:
            raise ConfigError("averaging.target_group_size must be >= 0 and averaging.min_group_size >= 2")
        if not 0 < self.request_timeout < self.matchmaking_seconds:
            raise ConfigError(
                f"averaging.request_timeout ({self.request_timeout}) must be below averaging.matchmaking_seconds "
                f"({self.matchmaking_seconds}), or matchmaking can deadlock"
            )
        if self.allreduce_timeout <= 0 or self.rel_tol <= 0 or self.abs_tol < 0:
            raise ConfigError("averaging.allreduce_timeout and averaging.rel_tol must be > 0, averaging.abs_tol >= 0")


def sync_shared_fields(*, outer: OuterConfig, rounds: RoundConfig, averaging: AveragingConfig) -> dict[str, Any]:
    """What the sync protocol itself needs every peer to agree on (any model, any loop)."""
    return {
        **{f"outer.{f.name}": getattr(outer, f.name) for f in dataclasses.fields(outer)},
        **{f"round.{f.name}": _plain(getattr(rounds, f.name)) for f in dataclasses.fields(rounds)},
        # the consistency verdict must be the same on every member of a group
        **{f"averaging.{name}": getattr(averaging, name) for name in ("compression", "rel_tol", "abs_tol")},
    }


def _plain(value: Any) -> Any:
    """Enums travel as their plain value: the manifest holds JSON scalars only."""
    return value.value if isinstance(value, Enum) else value
