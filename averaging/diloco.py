"""The shared DiLoCo state of one peer (anchor + outer momentum) and how a round ends.

``OuterState`` is what every peer of a run must agree on. It lives on the CPU in flat fp32
buffers, apart from the model on the device, and is touched by two threads: the training loop
(``conclude`` / ``adopt``) and hivemind's state-fetcher thread (``shared_state``, when a peer
downloads it); a lock makes each of those atomic.
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from averaging.backend import AverageOutcome, DownloadedState
from averaging.consistency import (
    DEFAULT_ABS_TOL,
    DEFAULT_REL_TOL,
    NUM_PROJECTIONS,
    AnchorClaim,
    Verdict,
    chunk_rms,
    claim_from_gather,
    claim_to_gather,
    consensus,
    fingerprint,
)
from averaging.flat import FlatLayout
from averaging.outer import outer_step_
from protocols.errors import ConfigError
from protocols.messages import MAX_ROUND, MessageError, RoundGather, bounded_int, floats

logger = logging.getLogger(__name__)

STATE_VERSION = 1
# An averaged pseudo-gradient this many times larger (RMS) than our own is refused as hostile or
# broken: a weighted mean of honest peers cannot be far outside the spread of its inputs.
MAX_AVERAGE_TO_LOCAL_RATIO = 100.0


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """Outer optimizer: Nesterov SGD on pseudo-gradients (DiLoCo's defaults)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self):
        if not 0 < self.lr <= 10:
            raise ConfigError(f"outer.lr ({self.lr}) must be in (0, 10]; DiLoCo uses 0.7")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum ({self.momentum}) must be in [0, 1); DiLoCo uses 0.9")


class Applied(StrEnum):
    """What a round did to the anchor (the ``applied`` field of a round record)."""

    AVERAGED = "averaged"  # the group's average was applied
    LOCAL = "local"  # alone in the swarm: our own pseudo-gradient was applied
    FOLDED = "folded"  # nothing applied: the work is folded into our next contribution


@dataclass(slots=True)
class RoundConclusion:
    """What happened at the end of a round, for metrics and the loop."""

    applied: Applied
    group_size: int
    bad_reports: int = 0
    verdict: Verdict | None = None
    donors: list[str] = field(default_factory=list)  # non-empty: our anchor diverged, re-sync from these
    error: str | None = None


class OuterState:
    """Anchor and outer momentum of one peer, plus what it tells its group about them."""

    def __init__(self, layout: FlatLayout, anchor: torch.Tensor, config: OuterConfig,
                 *, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL):
        assert anchor.dtype == torch.float32 and anchor.numel() == layout.numel and anchor.device.type == "cpu"
        self.layout = layout
        self.config = config
        self.rel_tol, self.abs_tol = rel_tol, abs_tol
        self.anchor = anchor.clone()
        self.momentum = torch.zeros_like(self.anchor)
        self.rounds_done = 0  # outer steps applied to this anchor, since the run began
        self.last_round = 0  # global round of the last outer step
        self._lock = threading.Lock()
        self._claim: AnchorClaim | None = None
        self._scale = torch.zeros(fingerprint(self.anchor).num_chunks, dtype=torch.float64)
        self._last_rms = 0.0  # RMS of the last applied pseudo-gradient

    # -- what we tell the group ------------------------------------------------------------
    def claim(self) -> AnchorClaim:
        """Fingerprint of the current anchor (cached: the anchor only changes in outer steps)."""
        with self._lock:
            if self._claim is None:
                self._claim = AnchorClaim(fingerprint(self.anchor), self._scale.clone(), self.rounds_done)
            return self._claim

    def round_report(self, *, round: int) -> RoundGather:
        return claim_to_gather(self.claim(), round=round)

    def decode_report(self, raw: Any) -> RoundGather:
        fp = self.claim().fingerprint
        return RoundGather.decode(raw, numel=fp.numel, chunk_len=fp.chunk_len, num_projections=NUM_PROJECTIONS)

    # -- ending a round --------------------------------------------------------------------
    def conclude(self, outcome: AverageOutcome, local_pseudo_grad: torch.Tensor, *, round: int,
                 averaged: torch.Tensor | None = None, self_id: str = "", alone: bool = False) -> RoundConclusion:
        """End a round: apply the outer step with the group's average if the round succeeded and
        the average is usable; otherwise apply our own pseudo-gradient if we are alone in the
        swarm (we then define the shared model), or leave the anchor as it is so that the work is
        folded into our next contribution (it must not move away from the group's). Then check
        our anchor against the group's."""
        conclusion = RoundConclusion(applied=Applied.FOLDED, group_size=1, error=outcome.error)
        if outcome.ok and averaged is not None:
            conclusion.group_size = len(outcome.group)
            problem = check_average(averaged, local_pseudo_grad, reference_rms=self._last_rms)
            if problem is None:
                self.apply(averaged, round=round)
                conclusion.applied = Applied.AVERAGED
            else:
                conclusion.error = problem
            conclusion.verdict, conclusion.bad_reports = self._judge(outcome.gathered, round)
            if conclusion.verdict is not None and self_id in conclusion.verdict.diverged:
                conclusion.donors = sorted(conclusion.verdict.agreeing)
        if conclusion.applied != Applied.AVERAGED and alone:
            self.apply(local_pseudo_grad, round=round)
            conclusion.applied = Applied.LOCAL
        return conclusion

    def _judge(self, gathered: dict[str, Any], round: int) -> tuple[Verdict | None, int]:
        claims: dict[str, AnchorClaim] = {}
        bad = 0
        for peer, raw in gathered.items():
            try:
                report = self.decode_report(raw)
                if report.round != round:
                    raise MessageError(f"report for round {report.round}, expected {round}")
                claims[peer] = claim_from_gather(report)
            except MessageError as e:
                bad += 1
                logger.warning(f"round {round}: ignoring the report of {peer}: {e}")
        if len(claims) < 2:
            return None, bad
        return consensus(claims, rel_tol=self.rel_tol, abs_tol=self.abs_tol), bad

    def apply(self, pseudo_grad: torch.Tensor, *, round: int) -> None:
        with self._lock:
            outer_step_(self.anchor, pseudo_grad, self.momentum,
                        lr=self.config.lr, mu=self.config.momentum, nesterov=self.config.nesterov)
            self.rounds_done += 1
            self.last_round = round
            fp = fingerprint(self.anchor)
            self._scale = chunk_rms(pseudo_grad, fp.chunk_len)
            self._last_rms = float(pseudo_grad.double().square().mean().sqrt())
            self._claim = AnchorClaim(fp, self._scale.clone(), self.rounds_done)

    # -- sharing and adopting the state ----------------------------------------------------
    def anchor_copy(self) -> torch.Tensor:
        """A consistent copy of the anchor (the sync worker may be applying an outer step)."""
        with self._lock:
            return self.anchor.clone()

    def shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """A consistent copy for a peer that downloads our state (hivemind's fetcher thread)."""
        with self._lock:
            metadata = {
                "v": STATE_VERSION,
                "numel": self.layout.numel,
                "round": self.last_round,
                "rounds_done": self.rounds_done,
                "scale": struct.pack(f"<{len(self._scale)}d", *self._scale.tolist()),
            }
            return metadata, [self.anchor.clone(), self.momentum.clone()]

    def adopt(self, state: DownloadedState) -> int:
        """Replace our anchor and momentum with a downloaded state after validating it; returns
        the global round of that state. Raises MessageError (and changes nothing) if invalid."""
        metadata, tensors = state.metadata, state.tensors
        if not isinstance(metadata, dict) or metadata.get("v") != STATE_VERSION:
            raise MessageError(f"state from {state.peer}: unknown state version")
        if metadata.get("numel") != self.layout.numel or len(tensors) != 2:
            raise MessageError(f"state from {state.peer}: layout differs from ours")
        for tensor in tensors:
            if tensor.shape != (self.layout.numel,) or tensor.dtype != torch.float32:
                raise MessageError(f"state from {state.peer}: tensor of shape {tuple(tensor.shape)} {tensor.dtype}")
            if not torch.isfinite(tensor).all():
                raise MessageError(f"state from {state.peer}: non-finite values")
        try:
            rounds = [bounded_int(metadata, key, 0, MAX_ROUND) for key in ("round", "rounds_done")]
        except MessageError as e:
            raise MessageError(f"state from {state.peer}: bad round counters ({e})") from None
        try:
            scale = floats(metadata.get("scale"), len(self._scale), "scale")
        except MessageError as e:
            raise MessageError(f"state from {state.peer}: bad scale ({e})") from None
        with self._lock:
            self.anchor.copy_(tensors[0])
            self.momentum.copy_(tensors[1])
            self.last_round, self.rounds_done = rounds
            self._scale = torch.tensor(scale, dtype=torch.float64)
            self._claim = None
        return self.last_round


def check_average(averaged: torch.Tensor, local: torch.Tensor, reference_rms: float = 0.0) -> str | None:
    """Why an averaged pseudo-gradient from the network must not be applied, or None if it may.

    The size check compares with our own pseudo-gradient, or with the last one we applied when
    ours is zero (a peer that joined at the deadline and made no step); with neither, only
    finiteness is checked.
    """
    if not torch.isfinite(averaged).all():
        return "the averaged pseudo-gradient has NaN/inf values; it was not applied"
    reference = max(float(local.double().square().mean().sqrt()), reference_rms)
    averaged_rms = float(averaged.double().square().mean().sqrt())
    if reference > 0 and averaged_rms > MAX_AVERAGE_TO_LOCAL_RATIO * reference:
        return (f"the averaged pseudo-gradient is {averaged_rms / reference:.3g}x larger "
                "than ours; it was not applied")
    return None
