"""How rounds end: the sync mode and the engine's timing settings."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from protocols.errors import ConfigError


class SyncMode(StrEnum):
    """How a round's sync relates to training (``round.sync_mode``)."""

    OVERLAP = "overlap"  # wall-clock rounds; average in the background while training
    BLOCKING = "blocking"  # H inner steps, then wait for the all-reduce: the OpenDiLoCo baseline


SYNC_MODES = tuple(mode.value for mode in SyncMode)


def validate_sync(mode: str, inner_steps: int) -> SyncMode:
    """The checks ``[round]`` and ``LoopConfig`` share; messages name the config keys."""
    if mode not in SYNC_MODES:
        raise ConfigError(f"round.sync_mode ({mode!r}) must be one of: {', '.join(SYNC_MODES)}")
    if inner_steps < 1:
        raise ConfigError(f"round.inner_steps ({inner_steps}) must be >= 1")
    return SyncMode(mode)


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """How rounds end and how long the network may take."""

    mode: SyncMode = SyncMode.OVERLAP
    inner_steps: int = 100  # blocking mode: inner steps per round
    matchmaking_seconds: float = 3.0
    prepare_lead: float = 4.5  # overlap mode: start matchmaking this long before the round's deadline
    download_timeout: float = 60.0

    def __post_init__(self):
        self.mode = validate_sync(self.mode, self.inner_steps)
