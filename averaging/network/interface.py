""""Average these tensors": the one interface the round engine needs from the network.

Two implementations: ``averaging.network.hivemind.backend.HivemindBackend`` (real runs and
integration tests) and ``averaging.network.local.LocalBackend`` (in-process, for unit tests). The
backend owns the buffer the network writes into, so a failed or half-finished all-reduce never
leaks into the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from averaging.state.served import AppliedUpdate, CheckSlice, DownloadedState
from protocols.messages import MAX_ROUND

# progress(done_bytes, total_bytes) of a state download; called in the thread that downloads.
Progress = Callable[[int, int], None]
# What a donor serves: its shared state (``SharedState.shared_state``) and a past outer step
# (``SharedState.update_after``). Called on the averager's host-side fetcher thread.
StateProvider = Callable[[], tuple[dict, list[torch.Tensor]]]
UpdateProvider = Callable[[int], AppliedUpdate | None]


PARTIAL_ERROR = "partial all-reduce"


@dataclass(slots=True)
class AverageOutcome:
    """How one averaging round ended. On failure the caller's vector is left untouched."""

    ok: bool
    group: tuple[str, ...] = ()  # peer ids of the group, this peer included
    gathered: dict[str, Any] = field(default_factory=dict)  # raw claims by peer id, not yet validated
    sync_s: float = 0.0  # from the trigger to the averaged result
    allreduce_s: float = 0.0  # from the later of the trigger and the scheduled start to the result
    error: str | None = None
    # Fraction of the average that never arrived (a reducer failed): such a result is not ok (its
    # ``error`` starts with PARTIAL_ERROR) unless ``keep_partial`` (sub-groups).
    partial: float = 0.0
    # Sub-groups: the members the group view found far, as its reducers did; None: no view.
    far: frozenset[str] | None = None


class AveragingBackend(Protocol):
    peer_id: str

    def prepare(self, *, round: int, scheduled_time: float, gather: dict, timeout: float,
                key_bits: str | None = None) -> None:
        """Start matchmaking for ``round`` now, so the group is ready when the round ends;
        ``key_bits``: sub-groups' key (``groups.group_key_bits``), default the round's own."""

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float,
                round: int | None = None, extra: torch.Tensor | None = None,
                keep_partial: bool = False) -> AverageOutcome:
        """Average ``vector`` (flat fp32 CPU) in place with the group prepared for ``round`` (default:
        the last one prepared), weighted by ``weight``. ``prepare`` may run concurrently on another
        thread. ``extra``: a second vector averaged in place in the same all-reduce, with its own
        codec and rule. ``keep_partial`` (sub-groups): a result with up to half missing is ok."""

    def download_state(self, peers: list[str], *, timeout: float, progress: Progress | None = None,
                       same_state: Callable[[Any, Any], bool] | None = None,
                       max_round: int = MAX_ROUND,
                       check: CheckSlice | None = None,
                       ) -> DownloadedState | None:
        """Fetch the shared state from ``peers``; None if no consistent state could be had.
        ``progress(done_bytes, total_bytes)`` is called in the calling thread. Parts come only from
        donors that ``same_state`` says serve one state, claim no round past ``max_round`` and whose
        values ``check`` accepts (``averaging.state.accept``)."""

    def fetch_update(self, peers: list[str], *, rounds_done: int, numel: int,
                     timeout: float) -> AppliedUpdate | None:
        """The outer step after ``rounds_done`` steps, from the first of ``peers`` that holds it, or
        None; validated as a message, not yet as a state."""

    def share_state(self, allowed: bool) -> None:
        """Serve our shared state to joiners, or not: a peer still joining holds the initial weights,
        and joiners served by it could outvote the donors of the real state."""

    def robustness(self) -> dict[str, int]:
        """What robust aggregation refused since start, by kind (``refused_parts``,
        ``refused_returns``, ``clipped_parts``, ``bans``); cumulative, never decreasing."""

    def shutdown(self) -> None: ...
