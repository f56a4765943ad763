""""Average these tensors": the one interface the sync worker needs from the network.

Two implementations: ``HivemindBackend`` (butterfly all-reduce over the DHT, for real runs and
integration tests) and ``LocalBackend`` (threads in one process, for fast unit tests of the
worker and the loop). The backend owns the buffer the network writes into; callers hand it a
vector and get the average back only when the round succeeded, so a failed or half-finished
all-reduce can never leak into the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# progress(done_bytes, total_bytes) of a state download; called in the thread that downloads.
Progress = Callable[[int, int], None]


@dataclass(slots=True)
class AverageOutcome:
    """How one averaging round ended. On failure the caller's vector is left untouched."""

    ok: bool
    group: tuple[str, ...] = ()  # peer ids of the group, this peer included
    gathered: dict[str, Any] = field(default_factory=dict)  # raw round reports by peer id, not yet validated
    sync_s: float = 0.0  # from the trigger to the averaged result
    allreduce_s: float = 0.0  # from the later of the trigger and the scheduled start to the result
    error: str | None = None


@dataclass(slots=True)
class DownloadedState:
    """State fetched from other peers, not yet validated."""

    peer: str  # the donors, comma-joined (for log lines)
    metadata: Any
    tensors: list[torch.Tensor]
    donors: tuple[str, ...] = ()  # every peer that served part of this state


class AveragingBackend(Protocol):
    peer_id: str

    def prepare(self, *, round: int, scheduled_time: float, gather: dict, timeout: float) -> None:
        """Start matchmaking for ``round`` now, so the group is ready when the round ends."""

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float) -> AverageOutcome:
        """Average ``vector`` (flat fp32 CPU) in place with the prepared group, weighted by ``weight``."""

    def download_state(self, peers: list[str], *, timeout: float,
                       progress: Progress | None = None) -> DownloadedState | None:
        """Fetch the shared state from ``peers`` (the hivemind backend spreads it over all of them);
        None if no consistent state could be had. ``progress(done_bytes, total_bytes)`` is called
        in the calling thread, never backwards, ending at total_bytes on success."""

    def shutdown(self) -> None: ...
