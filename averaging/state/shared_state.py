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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from averaging.math.fingerprints import (
    DEFAULT_ABS_TOL,
    DEFAULT_REL_TOL,
    NUM_PROJECTIONS,
    AnchorClaim,
    Fingerprint,
    Verdict,
    agree,
    chunk_rms,
    chunks_agree,
    claim_from_gather,
    claim_to_gather,
    consensus,
    fingerprint,
)
from averaging.math.flat import FlatLayout
from averaging.math.outer_step import anchor_before_step, outer_step_
from averaging.network.interface import AppliedUpdate, AverageOutcome, CheckSlice, DownloadedState
from protocols.errors import ConfigError
from protocols.messages import MAX_ROUND, MessageError, RoundGather, bounded_int, floats

logger = logging.getLogger(__name__)

STATE_VERSION = 1
# An averaged pseudo-gradient this many times larger (RMS) than our own is refused as hostile or
# broken: a weighted mean of honest peers cannot be far outside the spread of its inputs.
MAX_AVERAGE_TO_LOCAL_RATIO = 100.0
# A peer up to this many outer steps behind catches up by replaying them instead of downloading the
# whole state (8 bytes/param). Every peer keeps two more (fp16, 2 bytes/param each): the donors of
# a catch-up are applying the current round's step while the peer that is behind asks for the older
# ones, and peers with fast links may already have applied the next round's too (a pair that syncs
# every round beside a slow peer that syncs every other round: seen with real peers).
HISTORY_ROUNDS = 2
HISTORY_KEPT = HISTORY_ROUNDS + 2
MAX_CLAIMED_SCALE_RATIO = 2.0
# A replayed outer step may be at most this many times larger (RMS) than the larger of the last one
# we applied and our own pseudo-gradient of the round being concluded (our work: a sample of what an
# honest round's step is). The replay is also checked against the claimed fingerprint, but whoever
# claims a fingerprint can craft a step that reaches it from our anchor (our state is public): this
# bounds what one such step can move us, to the order of what a peer moves the all-reduce's result.
# Honest steps differ from ours by the group's spread and by rounds folded into them: a few times,
# not ten. Our last step alone is not enough: after a start-up split, one pair's first step was 11x
# the other's (its peers had trained a whole round, ours only its end; seen with real peers), and
# the pair that lost the tie could not replay the winner's step.
MAX_CATCH_UP_TO_LAST_RATIO = 10.0


class StateTooFarAhead(MessageError):
    """A donor's state is two or more outer steps past the reference it must be checked against.
    Donors only move further ahead, so downloading again against the same reference cannot help."""


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


# catch_up(donors, steps, reference, rewind, work_rms): bring our anchor to the reference's by
# undoing our own last ``rewind`` outer steps, then replaying ``steps`` steps fetched from
# ``donors``; True if it now agrees. ``work_rms`` is the RMS of our own pseudo-gradient this round
# (a size a replayed step is judged against, ``MAX_CATCH_UP_TO_LAST_RATIO``).
CatchUp = Callable[[list[str], int, AnchorClaim, int, float], bool]


@dataclass(slots=True)
class RoundConclusion:
    """What happened at the end of a round, for metrics and the loop."""

    applied: Applied
    group_size: int
    bad_reports: int = 0
    verdict: Verdict | None = None
    donors: list[str] = field(default_factory=list)  # non-empty: our anchor diverged, re-sync from these
    error: str | None = None
    caught_up: int = 0  # outer steps we missed and replayed from the group's history (no re-sync)
    reference: AnchorClaim | None = None  # with donors: the group's claim a downloaded state must match


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
        # The run's initial weights, which every peer builds alike from the run's seed (model.py):
        # the only state of no outer step an honest donor can serve (``slice_check``).
        self._initial = AnchorClaim(fingerprint(self.anchor), self._scale.clone(), 0)
        self._last_rms = 0.0  # RMS of the last applied pseudo-gradient
        self._history: deque[AppliedUpdate] = deque(maxlen=HISTORY_KEPT)
        # Our claims before the last steps: a report made before our last sync landed is stale, and
        # a group may judge against it; we can still tell whether we agree with such a reference.
        self._past_claims: deque[AnchorClaim] = deque(maxlen=HISTORY_KEPT)

    # -- what we tell the group ------------------------------------------------------------
    def claim(self) -> AnchorClaim:
        """Fingerprint of the current anchor (cached: the anchor only changes in outer steps)."""
        with self._lock:
            return self._current_claim()

    def _current_claim(self) -> AnchorClaim:
        """``claim()`` for a caller that holds the lock."""
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
                 averaged: torch.Tensor | None = None, self_id: str = "", alone: bool = False,
                 catch_up: CatchUp | None = None) -> RoundConclusion:
        """End a round: check our anchor against the group's, then apply the outer step with the
        group's average if the round succeeded and the average is usable; otherwise apply our own
        pseudo-gradient if we are alone in the swarm (we then define the shared model), or leave the
        anchor as it is so that the work is folded into our next contribution (it must not move
        away from the group's).

        The check comes first because the claims describe anchors *before* this round's step: a
        peer that missed up to ``HISTORY_ROUNDS`` steps replays them (``catch_up``) before it
        applies this one, so that every peer applies the same steps in the same order; only a peer
        that cannot catch up re-syncs (``donors``)."""
        # (a partial all-reduce had a group, though its result is not ours to apply)
        conclusion = RoundConclusion(applied=Applied.FOLDED, group_size=max(1, len(outcome.group)), error=outcome.error)
        work_rms = _rms(local_pseudo_grad)
        if outcome.ok and averaged is not None:
            conclusion.group_size = len(outcome.group)
            conclusion.verdict, conclusion.bad_reports, claims = self._judge(outcome.gathered, round)
            verdict = conclusion.verdict
            if verdict is not None and self_id in verdict.diverged:
                agreeing = sorted(verdict.agreeing)
                reference = claims[verdict.reference]
                behind = reference.rounds_done - self.rounds_done
                if behind < 0 and self.agreed_before(reference):
                    pass  # the reference's report predates steps we applied since: we are ahead, not apart
                elif catch_up is not None and 0 <= behind <= HISTORY_ROUNDS and catch_up(agreeing, behind, reference, 0, work_rms):
                    conclusion.caught_up = behind
                elif catch_up is not None and 0 <= behind < HISTORY_ROUNDS and catch_up(agreeing, behind + 1, reference, 1, work_rms):
                    # We applied a later step without an earlier one (we joined while the reports of a
                    # round predated a step, so nobody saw we lacked it): undo ours, replay both.
                    conclusion.caught_up = behind + 1
                else:
                    conclusion.donors, conclusion.reference = agreeing, reference
            elif verdict is not None and verdict.contested and self_id in verdict.agreeing and catch_up is not None:
                conclusion.caught_up = self._catch_up_with_ahead(verdict, claims, catch_up, work_rms)
            problem = check_average(averaged, local_pseudo_grad, reference_rms=self._last_rms)
            if problem is None:
                self.apply(averaged, round=round)
                conclusion.applied = Applied.AVERAGED
            else:
                conclusion.error = problem
        if conclusion.applied != Applied.AVERAGED and alone:
            self.apply(local_pseudo_grad, round=round)
            conclusion.applied = Applied.LOCAL
        return conclusion

    def _catch_up_with_ahead(self, verdict: Verdict, claims: dict[str, AnchorClaim], catch_up: CatchUp,
                             work_rms: float) -> int:
        """We won a tie, but a diverged member may simply be ahead of us (we folded a round that it
        averaged): replay its steps, verified against its claim, as it would have replayed ours had
        the tie gone the other way. A false claim costs a small fetch and changes nothing."""
        ahead = sorted(((claims[p].rounds_done - self.rounds_done, p) for p in verdict.diverged
                        if 0 < claims[p].rounds_done - self.rounds_done <= HISTORY_ROUNDS), reverse=True)
        for behind, peer in ahead:  # the furthest ahead first
            if catch_up([peer], behind, claims[peer], 0, work_rms):
                return behind
        return 0

    def _judge(self, gathered: dict[str, Any], round: int) -> tuple[Verdict | None, int, dict[str, AnchorClaim]]:
        claims: dict[str, AnchorClaim] = {}
        bad = 0
        for peer, raw in gathered.items():
            try:
                report = self.decode_report(raw)
                if report.round != round:
                    raise MessageError(f"report for round {report.round}, expected {round}")
                if report.rounds_done > round:  # a self-claimed count, bounded by the schedule
                    raise MessageError(f"claims {report.rounds_done} outer steps by round {round}")
                claims[peer] = self._capped(claim_from_gather(report))
            except MessageError as e:
                bad += 1
                logger.warning(f"round {round}: ignoring the report of {peer}: {e}")
        if len(claims) < 2:
            return None, bad, claims
        return consensus(claims, rel_tol=self.rel_tol, abs_tol=self.abs_tol, salt=str(round)), bad, claims

    def _capped(self, claim: AnchorClaim) -> AnchorClaim:
        """A claimed scale widens the tolerance of every comparison with that peer: it may not
        exceed ``MAX_CLAIMED_SCALE_RATIO`` times ours (the same averaged pseudo-gradient's RMS on
        every honest member, up to the return code's noise)."""
        if claim.scale.shape != self._scale.shape:
            return claim  # another layout: the fingerprints will not compare either
        return AnchorClaim(claim.fingerprint, torch.minimum(claim.scale, MAX_CLAIMED_SCALE_RATIO * self._scale),
                           claim.rounds_done)

    def apply(self, pseudo_grad: torch.Tensor, *, round: int) -> None:
        with self._lock:
            self._apply(pseudo_grad, round)

    def _apply(self, pseudo_grad: torch.Tensor, round: int) -> None:
        self._past_claims.append(self._current_claim())
        outer_step_(self.anchor, pseudo_grad, self.momentum,
                    lr=self.config.lr, mu=self.config.momentum, nesterov=self.config.nesterov)
        self.rounds_done += 1
        self.last_round = round
        fp = fingerprint(self.anchor)
        self._scale = chunk_rms(pseudo_grad, fp.chunk_len)
        self._last_rms = _rms(pseudo_grad)
        self._claim = AnchorClaim(fp, self._scale.clone(), self.rounds_done)
        self._history.append(AppliedUpdate(round, self.rounds_done, pseudo_grad.to(torch.float16)))

    # -- catching up with missed rounds ----------------------------------------------------
    def update_after(self, rounds_done: int) -> AppliedUpdate | None:
        """The outer step that took a peer from ``rounds_done`` to ``rounds_done + 1`` steps, if we
        still hold it (served to peers that missed it)."""
        with self._lock:
            return next((u for u in self._history if u.rounds_done == rounds_done + 1), None)

    def catch_up(self, updates: list[AppliedUpdate], reference: AnchorClaim, *, rewind: int = 0,
                 work_rms: float = 0.0) -> bool:
        """Replay missed outer steps (fetched from peers, in order), then check that our anchor now
        agrees with the reference's claim; if it does not, nothing changes and False is returned
        (the caller falls back to a full download). The check is what makes a donor's word
        unnecessary: an update that does not lead to the reference's anchor is never kept.

        With ``rewind``, our own last ``rewind`` steps are undone first, from our history (fp16:
        off by its rounding, like a replayed step): for a peer that applied a step on an anchor
        that lacked the one before it, which replaying alone cannot fix. ``work_rms`` (the RMS of
        our own pseudo-gradient this round) widens the size bound on replayed steps
        (``MAX_CATCH_UP_TO_LAST_RATIO``)."""
        with self._lock:
            saved = (self.anchor.clone(), self.momentum.clone(), self.rounds_done, self.last_round,
                     self._scale, self._last_rms, self._claim, list(self._history), list(self._past_claims))
            # Widened by our work, never introduced by it: a peer that applied no step yet (a joiner
            # that trusted the records) has no size to judge by, as before; one with little work in
            # its first round would otherwise refuse the swarm's honest first steps.
            reference_rms = max(self._last_rms, work_rms) if self._last_rms > 0 else 0.0
            if (self._undo(rewind) and self._replay(updates, reference_rms)
                    and _claims_agree(self._current_claim(), reference, self.rel_tol, self.abs_tol)):
                return True
            (anchor, momentum, self.rounds_done, self.last_round, self._scale, self._last_rms, self._claim,
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
            if (update.rounds_done != self.rounds_done + 1 or update.update.shape != (self.layout.numel,)
                    or update.round < update.rounds_done):  # at most one step a round: a false round
                return False
            size = _rms(update.update)
            if reference_rms > 0 and size > MAX_CATCH_UP_TO_LAST_RATIO * reference_rms:
                logger.warning(f"refused outer step {update.rounds_done}: {size / reference_rms:.3g}x larger than "
                               "the larger of our last applied step and our own work this round")
                return False
            self._apply(update.update.float(), update.round)
        return True

    def agreed_before(self, reference: AnchorClaim) -> bool:
        """Whether our anchor, before our last steps, agreed with ``reference`` (a claim made by a
        peer whose report predates steps we have applied since)."""
        with self._lock:
            past = next((c for c in self._past_claims if c.rounds_done == reference.rounds_done), None)
            return past is not None and _claims_agree(past, reference, self.rel_tol, self.abs_tol)

    # -- sharing and adopting the state ----------------------------------------------------
    def anchor_copy(self) -> torch.Tensor:
        """A consistent copy of the anchor (the sync worker may be applying an outer step)."""
        with self._lock:
            return self.anchor.clone()

    def shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """A consistent copy for a peer that downloads our state (hivemind's fetcher thread).

        ``claim`` is the fingerprint of this anchor: a joiner assembling slices from several donors
        takes slices only from donors whose claims agree (``same_state``), so that two donors that
        diverged cannot be mixed into a state that neither holds, and checks the assembled anchor
        against it (``adopt``). Checkpoints keep the other fields only (``node.library.resume``)."""
        with self._lock:
            metadata = {
                "v": STATE_VERSION,
                "numel": self.layout.numel,
                "round": self.last_round,
                "rounds_done": self.rounds_done,
                "scale": struct.pack(f"<{len(self._scale)}d", *self._scale.tolist()),
                "claim": claim_to_gather(self._current_claim(), round=self.last_round).encode(),
            }
            return metadata, [self.anchor.clone(), self.momentum.clone()]

    def state_claim(self, metadata: Any) -> AnchorClaim:
        """The claim a donor's state metadata carries, validated against our layout (MessageError)."""
        if not isinstance(metadata, dict) or "claim" not in metadata:
            raise MessageError("no fingerprint of its anchor")
        claim = claim_from_gather(self.decode_report(metadata["claim"]))
        if claim.rounds_done != metadata.get("rounds_done"):
            raise MessageError("its fingerprint describes another outer step than its state")
        # At most one outer step a round (``_replay`` keeps this true of replayed steps too).
        round = metadata.get("round")
        if not isinstance(round, int) or claim.rounds_done > round:
            raise MessageError(f"it claims {claim.rounds_done} outer steps in a state of round {round}")
        return claim

    def _matches(self, fp: Fingerprint, claim: AnchorClaim) -> bool:
        """Whether a fingerprint we computed is the anchor ``claim`` describes, within the claim's
        own tolerance (its scale on both sides)."""
        a = claim.fingerprint
        return (fp.numel, fp.chunk_len) == (a.numel, a.chunk_len) and agree(
            fp, a, claim.scale, claim.scale, rel_tol=self.rel_tol, abs_tol=self.abs_tol)

    def _check_against(self, reference: AnchorClaim, tensors: list[torch.Tensor], rounds_done: int,
                       step: torch.Tensor | None, *, peer: str) -> None:
        """Raise MessageError unless the state's anchor is the reference's (``adopt``)."""
        ahead = rounds_done - reference.rounds_done
        if ahead == 0:
            before = tensors[0]
        elif ahead == 1 and step is not None:
            c = self.config
            before = anchor_before_step(tensors[0], step, tensors[1], lr=c.lr, mu=c.momentum, nesterov=c.nesterov)
        else:
            error = StateTooFarAhead if ahead > 1 else MessageError
            raise error(f"state from {peer}: {_rounds_apart(ahead)} from the group's reference, "
                        "so it cannot be checked against it")
        if not self._matches(fingerprint(before), reference):
            raise MessageError(f"state from {peer}: its anchor is not the one the group agreed on (a donor that "
                               "serves another state than the one it reported to the group)")

    def slice_check(self, reference: AnchorClaim | None = None) -> CheckSlice:
        """A state download's per-slice check (``download_slices(check=...)``): the anchor values
        of a slice must match, chunk by chunk, the group's ``reference`` claim when the donor's
        state is at that claim's step, else the donor's own claim. The donor of a slice that does
        not is dropped and named when its slice arrives; the momentum half is checked with the
        whole state (``adopt``).

        A state of no outer step is the run's initial weights with zero momentum, which we built
        ourselves: checked against those, not against anyone's claim. A donor serving other weights
        as the initial state (issue 11's hijack: its own anchor plus noise) won the vote whenever
        it was the first of two donors to answer, and joiners started from it."""
        numel = self.layout.numel

        def check(start: int, stop: int, metadata: Any, values: torch.Tensor) -> str | None:
            try:
                claim = self.state_claim(metadata)
            except MessageError as e:
                return f"bad claim ({e})"
            initial = claim.rounds_done == 0
            if initial and stop > numel and values[max(numel - start, 0):].any():
                return "the momentum of a state of no outer step is not zero"
            if start >= numel:
                return None
            by_group = reference is not None and claim.rounds_done == reference.rounds_done
            against = self._initial if initial else reference if by_group else claim
            if self._scale.any() and not initial:
                against = self._capped(against)
            chunk_len = against.fingerprint.chunk_len
            if start % chunk_len:
                return f"slice starts at {start}, inside a fingerprint chunk of {chunk_len} values"
            end = min(stop, numel)
            if not chunks_agree(values[: end - start], start // chunk_len, against, rel_tol=self.rel_tol,
                                abs_tol=self.abs_tol):
                whose = ("the run's initial weights (a state of no outer step)" if initial
                         else "the anchor its group agreed on" if by_group else "the fingerprint it claims")
                return f"values {start}..{end} of its anchor do not match {whose}"
            return None

        return check

    def same_state(self, a: Any, b: Any) -> bool:
        """Whether two donors' state metadata describe the same anchor (up to the noise of the
        all-reduce's return codec): the slices of a download must all come from one state."""
        try:
            return _claims_agree(self.state_claim(a), self.state_claim(b), self.rel_tol, self.abs_tol)
        except MessageError:
            return False

    def adopt(self, state: DownloadedState, *, require_claim: bool = False, max_round: int = MAX_ROUND,
              reference: AnchorClaim | None = None, step: torch.Tensor | None = None) -> int:
        """Replace our anchor and momentum with a downloaded state after validating it; returns
        the global round of that state. Raises MessageError (and changes nothing) if invalid.

        A state from the network must carry its donors' claim (``require_claim``) and its anchor
        must match it: slices assembled from donors that held different anchors, or a donor whose
        data is not what it claims, are refused. A checkpoint has no claim (its file is verified).
        A round past ``max_round`` (the schedule's) is refused: it would name our checkpoints.

        A re-sync also passes the group's ``reference`` claim (from the round's gather, the anchor
        the majority agreed on): the donors' own claims are then not enough, since a donor can
        serve a state that matches a claim of its own making. A state one outer step past the
        reference (the donor applied this round's ``step`` already) is checked by undoing that
        step (``anchor_before_step``, which needs its momentum too)."""
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
            rounds = [bounded_int(metadata, key, 0, max_round) for key in ("round", "rounds_done")]
        except MessageError as e:
            raise MessageError(f"state from {state.peer}: bad round counters ({e})") from None
        try:
            scale = floats(metadata.get("scale"), len(self._scale), "scale")
        except MessageError as e:
            raise MessageError(f"state from {state.peer}: bad scale ({e})") from None
        if require_claim or "claim" in metadata:
            try:
                claim = self.state_claim(metadata)
            except MessageError as e:
                raise MessageError(f"state from {state.peer}: bad claim ({e})") from None
            # The tolerance of the claimed scale, capped by ours once we have one (a donor cannot
            # widen it at will); an exact copy of one donor's anchor matches to rounding.
            claim = self._capped(claim) if self._scale.any() else claim
            if not self._matches(fingerprint(tensors[0]), claim):
                raise MessageError(f"state from {state.peer}: the anchor does not match its donors' fingerprint "
                                   "(donors that diverged, or one that sent another state than it claims)")
        if reference is not None:
            self._check_against(reference, tensors, rounds[1], step, peer=state.peer)
        with self._lock:
            self.anchor.copy_(tensors[0])
            self.momentum.copy_(tensors[1])
            self.last_round, self.rounds_done = rounds
            self._scale = torch.tensor(scale, dtype=torch.float64)
            self._claim = None
            self._history.clear()  # the steps that led here are not ours to serve
            self._past_claims.clear()
        return self.last_round


def _rounds_apart(ahead: int) -> str:
    return f"{ahead} outer step{'s' if abs(ahead) != 1 else ''}"


def _claims_agree(ours: AnchorClaim, reference: AnchorClaim, rel_tol: float, abs_tol: float) -> bool:
    a, b = ours.fingerprint, reference.fingerprint
    return (ours.rounds_done == reference.rounds_done and (a.numel, a.chunk_len) == (b.numel, b.chunk_len)
            and agree(a, b, ours.scale, reference.scale, rel_tol=rel_tol, abs_tol=abs_tol))


def _rms(t: torch.Tensor) -> float:
    return float(t.double().square().mean().sqrt())


def check_average(averaged: torch.Tensor, local: torch.Tensor, reference_rms: float = 0.0) -> str | None:
    """Why an averaged pseudo-gradient from the network must not be applied, or None if it may.

    The size check compares with our own pseudo-gradient, or with the last one we applied when
    ours is zero (a peer that joined at the deadline and made no step); with neither, only
    finiteness is checked.
    """
    if not torch.isfinite(averaged).all():
        return "the averaged pseudo-gradient has NaN/inf values; it was not applied"
    reference = max(_rms(local), reference_rms)
    averaged_rms = _rms(averaged)
    if reference > 0 and averaged_rms > MAX_AVERAGE_TO_LOCAL_RATIO * reference:
        return (f"the averaged pseudo-gradient is {averaged_rms / reference:.3g}x larger "
                "than ours; it was not applied")
    return None
