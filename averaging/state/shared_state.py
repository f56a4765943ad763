"""One peer's shared state: the anchor and outer momentum every peer of a run must agree on.

``SharedState`` lives on the CPU in flat fp32 buffers, apart from the model on the device, and
keeps what the others need of it: the claim it makes about its anchor each round, and the last
outer steps it applied (a peer that missed them replays them instead of downloading the state).
Two threads touch it: the sync worker (``apply``, ``catch_up``, ``adopt``) and hivemind's
state-fetcher thread (``shared_state``, ``update_after``, when a peer downloads from us); one lock
makes each of those atomic. What it accepts from others is checked in ``averaging.state.accept``.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import deque
from typing import Any

import torch

from averaging.math.fingerprints import (
    DEFAULT_ABS_TOL,
    DEFAULT_REL_TOL,
    NUM_PROJECTIONS,
    AnchorClaim,
    chunk_rms,
    encode_claim,
    fingerprint,
)
from averaging.math.flat import FlatLayout
from averaging.math.outer_step import OuterConfig, anchor_before_step, kept_step, outer_step_
from averaging.state import accept
from averaging.state.served import STATE_VERSION, AppliedUpdate, DownloadedState
from protocols.messages import MAX_ROUND, ClaimMessage

logger = logging.getLogger(__name__)

# A peer up to this many outer steps behind catches up by replaying them (2 bytes/param each)
# instead of downloading the state (8); every peer keeps two more, as donors may be a step or two
# ahead while a peer asks (docs/incidents.md).
HISTORY_ROUNDS = 2
HISTORY_KEPT = HISTORY_ROUNDS + 2


class SharedState:
    """Anchor and outer momentum of one peer, the claim it makes about them, and their history."""

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
        self.scale = torch.zeros(fingerprint(self.anchor).num_chunks, dtype=torch.float64)
        # The run's initial weights, which every peer builds alike from the run's seed (model.py):
        # the only state of no outer step an honest donor can serve (``accept.slice_check``).
        self.initial = AnchorClaim(fingerprint(self.anchor), self.scale.clone(), 0)
        self.last_rms = 0.0  # RMS of the last applied pseudo-gradient
        self._history: deque[AppliedUpdate] = deque(maxlen=HISTORY_KEPT)
        # Our claims before the last steps, for a group that judges against a stale reference.
        self._past_claims: deque[AnchorClaim] = deque(maxlen=HISTORY_KEPT)

    # -- the claim we make ---------------------------------------------------------------------
    def claim(self) -> AnchorClaim:
        """Fingerprint of the current anchor (cached: the anchor only changes in outer steps)."""
        with self._lock:
            return self._current_claim()

    def _current_claim(self) -> AnchorClaim:
        """``claim()`` for a caller that holds the lock."""
        if self._claim is None:
            self._claim = AnchorClaim(fingerprint(self.anchor), self.scale.clone(), self.rounds_done)
        return self._claim

    def claim_message(self, *, round: int, with_momentum: bool = False) -> ClaimMessage:
        """Our claim as the message attached to ``round``'s all-reduce; ``with_momentum`` (sub-groups,
        whose all-reduce carries the momentum): its fingerprint too (one more pass over it)."""
        with self._lock:
            claim = self._current_claim()
            momentum = fingerprint(self.momentum) if with_momentum else None
        return encode_claim(claim, round=round, momentum=momentum)

    def decode_message(self, raw: Any) -> ClaimMessage:
        """A received claim message, validated against our layout (``MessageError``)."""
        fp = self.claim().fingerprint
        return ClaimMessage.decode(raw, numel=fp.numel, chunk_len=fp.chunk_len, num_projections=NUM_PROJECTIONS)

    def agreed_before(self, reference: AnchorClaim) -> bool:
        """Whether our anchor, before our last steps, agreed with ``reference`` (a claim made by a
        peer whose message predates steps we have applied since)."""
        with self._lock:
            past = next((c for c in self._past_claims if c.rounds_done == reference.rounds_done), None)
            return past is not None and accept.claims_agree(past, reference, self.rel_tol, self.abs_tol)

    # -- outer steps -----------------------------------------------------------------------------
    def apply(self, pseudo_grad: torch.Tensor, *, round: int) -> None:
        """One outer step with ``pseudo_grad`` (the group's average, or ours when alone)."""
        with self._lock:
            self._apply(pseudo_grad, round)

    def _apply(self, pseudo_grad: torch.Tensor, round: int) -> None:
        kept = kept_step(pseudo_grad)  # the step taken is the step kept: a replay is exact
        pseudo_grad = kept.float()
        self._past_claims.append(self._current_claim())
        outer_step_(self.anchor, pseudo_grad, self.momentum,
                    lr=self.config.lr, mu=self.config.momentum, nesterov=self.config.nesterov)
        self.rounds_done += 1
        self.last_round = round
        fp = fingerprint(self.anchor)
        self.scale = chunk_rms(pseudo_grad, fp.chunk_len)
        self.last_rms = accept.rms(pseudo_grad)
        self._claim = AnchorClaim(fp, self.scale.clone(), self.rounds_done)
        self._history.append(AppliedUpdate(round, self.rounds_done, kept))

    def mix(self, anchor: torch.Tensor, momentum: torch.Tensor, pseudo_grad: torch.Tensor, *, round: int,
            rounds_done: int) -> None:
        """A sub-group round: take the group's mean anchor and momentum at the group's step count,
        then apply the group's step, in one change under the lock. Such a step cannot be replayed
        without the mix, so none is served (``update_after``)."""
        with self._lock:
            self.anchor.copy_(anchor)
            self.momentum.copy_(momentum)
            self.rounds_done = max(self.rounds_done, rounds_done)
            self._apply(pseudo_grad, round)  # (records the claim we held before as past, sets the new one)
            self._history.clear()

    def update_after(self, rounds_done: int) -> AppliedUpdate | None:
        """The outer step that took a peer from ``rounds_done`` to ``rounds_done + 1`` steps, if we
        still hold it (served to peers that missed it)."""
        with self._lock:
            return next((u for u in self._history if u.rounds_done == rounds_done + 1), None)

    def catch_up(self, updates: list[AppliedUpdate], reference: AnchorClaim | None, *, rewind: int = 0,
                 work_rms: float = 0.0) -> bool:
        """Replay missed outer steps (in order) and keep them only if our anchor then agrees with
        the reference's claim, else change nothing and return False. ``rewind``: undo our own last
        steps first; ``work_rms`` widens the size bound on replayed steps. No reference: a joiner's
        replay of a young run, checked by its first group's claims instead."""
        with self._lock:
            saved = (self.anchor.clone(), self.momentum.clone(), self.rounds_done, self.last_round,
                     self.scale, self.last_rms, self._claim, list(self._history), list(self._past_claims))
            # Widened by our work, never introduced by it: a peer with no step yet has no size to
            # judge by, and little work in a first round would refuse honest steps.
            reference_rms = max(self.last_rms, work_rms) if self.last_rms > 0 else 0.0
            if (self._undo(rewind) and self._replay(updates, reference_rms)
                    and (reference is None
                         or accept.claims_agree(self._current_claim(), reference, self.rel_tol, self.abs_tol))):
                return True
            (anchor, momentum, self.rounds_done, self.last_round, self.scale, self.last_rms, self._claim,
             history, past_claims) = saved
            self.anchor.copy_(anchor)
            self.momentum.copy_(momentum)
            self._history.clear()
            self._history.extend(history)
            self._past_claims.clear()
            self._past_claims.extend(past_claims)
            return False

    def _undo(self, steps: int) -> bool:
        """Undo our last ``steps`` outer steps (lock held); False if our history lacks one."""
        c = self.config
        for _ in range(steps):
            if not self._history or self._history[-1].rounds_done != self.rounds_done:
                return False
            step = self._history.pop().update.float()
            self.anchor.copy_(anchor_before_step(self.anchor, step, self.momentum, lr=c.lr, mu=c.momentum,
                                                 nesterov=c.nesterov))
            if c.momentum > 0:  # momentum = mu * before + step
                self.momentum.sub_(step).div_(c.momentum)
            else:
                self.momentum.zero_()
            if self._past_claims:
                self._past_claims.pop()
            self.rounds_done -= 1
            self._claim = None
        return True

    def _replay(self, updates: list[AppliedUpdate], reference_rms: float) -> bool:
        """Apply fetched steps in order (lock held); False at the first that does not follow."""
        for update in updates:
            if problem := accept.replay_problem(update, self.rounds_done, self.layout.numel, reference_rms):
                logger.warning(f"refused outer step {update.rounds_done}: {problem}")
                return False
            self._apply(update.update.float(), update.round)
        return True

    # -- sharing and adopting the state ----------------------------------------------------------
    def anchor_copy(self) -> torch.Tensor:
        """A consistent copy of the anchor (the sync worker may be applying an outer step)."""
        with self._lock:
            return self.anchor.clone()

    def shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """A consistent copy for a peer that downloads our state (hivemind's fetcher thread), with
        our claim, so a joiner mixes slices only from donors that agree (``accept.same_state``)."""
        with self._lock:
            metadata = {
                "v": STATE_VERSION,
                "numel": self.layout.numel,
                "round": self.last_round,
                "rounds_done": self.rounds_done,
                "scale": struct.pack(f"<{len(self.scale)}d", *self.scale.tolist()),
                "claim": encode_claim(self._current_claim(), round=self.last_round).encode(),
            }
            return metadata, [self.anchor.clone(), self.momentum.clone()]

    def adopt(self, state: DownloadedState, *, require_claim: bool = False, max_round: int = MAX_ROUND,
              reference: AnchorClaim | None = None, step: torch.Tensor | None = None) -> int:
        """Replace our anchor and momentum with a downloaded state or a checkpoint that
        ``accept.check_state`` accepts (else ``MessageError``); returns its global round."""
        rounds, scale = accept.check_state(self, state, require_claim=require_claim, max_round=max_round,
                                           reference=reference, step=step)
        with self._lock:
            self.anchor.copy_(state.tensors[0])
            self.momentum.copy_(state.tensors[1])
            self.last_round, self.rounds_done = rounds
            self.scale = torch.tensor(scale, dtype=torch.float64)
            self._claim = None
            self._history.clear()  # the steps that led here are not ours to serve
            self._past_claims.clear()
        return self.last_round
