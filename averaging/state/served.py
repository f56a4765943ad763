"""What a peer's shared state hands to others and takes from them, as values.

An ``AppliedUpdate`` is one outer step as a donor serves it to a peer that missed it; a
``DownloadedState`` is a state as it arrives, before ``SharedState.adopt`` validates it; a
``CheckSlice`` is the state's test of one slice of a download while it arrives. The network seam
(``averaging.network``) carries them; it never looks inside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

STATE_VERSION = 1  # of a served state's metadata (``SharedState.shared_state``)

# check(start, stop, metadata, values): why a valid-looking slice of values [start, stop) of a
# downloaded state must not be used (it does not match the claim it should:
# ``averaging.state.accept.slice_check``), or None.
CheckSlice = Callable[[int, int, Any, torch.Tensor], "str | None"]


@dataclass(frozen=True, slots=True)
class AppliedUpdate:
    """One outer step as applied: what a peer that missed it needs to replay it."""

    round: int  # the global round it ended
    rounds_done: int  # the peer's outer-step count after it
    update: torch.Tensor  # the pseudo-gradient the step used, fp16 (flat, CPU)


@dataclass(slots=True)
class DownloadedState:
    """State fetched from other peers, not yet validated."""

    peer: str  # the donors, comma-joined (for log lines)
    metadata: Any
    tensors: list[torch.Tensor]
    donors: tuple[str, ...] = ()  # every peer that served part of this state
