"""What a peer accepts from others into its shared state, and why it refuses the rest.

Everything here judges something received (an averaged pseudo-gradient, a replayed outer step, a
donor's claim, a downloaded slice or state) against what this peer already holds: its anchor's
scale, its last step, the run's initial weights, the group's reference claim. A refusal is a
reason (a string) or a ``MessageError``; nothing here changes the state (``SharedState`` does, once
a check passed). How the bounds were learned: docs/incidents.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from averaging.math.fingerprints import AnchorClaim, Fingerprint, agree, chunks_agree, claim_of, fingerprint
from averaging.math.outer_step import anchor_before_step
from averaging.state.served import STATE_VERSION, AppliedUpdate, CheckSlice, DownloadedState
from protocols.messages import MAX_ROUND, MessageError, bounded_int, floats

if TYPE_CHECKING:
    from averaging.state.shared_state import SharedState

# An averaged pseudo-gradient this many times larger (RMS) than our own is refused as hostile or
# broken: a weighted mean of honest peers cannot be far outside the spread of its inputs.
MAX_AVERAGE_TO_LOCAL_RATIO = 100.0
# A claimed scale widens the tolerance of every comparison with that peer; at most this many times ours.
MAX_CLAIMED_SCALE_RATIO = 2.0
# A replayed outer step may be at most this many times larger (RMS) than the larger of our last step
# and our own pseudo-gradient this round: a claimed fingerprint can be reached by a crafted step (our
# state is public), so this bounds how far one such step moves us.
MAX_CATCH_UP_TO_LAST_RATIO = 10.0


# A donor's momentum may be at most this many times its claimed last step's RMS over (1 - mu):
# honest momentum is a geometric sum of recent steps, and it is not fingerprinted, so this loose
# bound is what stops a donor with the true anchor from injecting a poisoned momentum.
MAX_MOMENTUM_TO_STEP_RATIO = 1000.0


class StateTooFarAhead(MessageError):
    """A donor's state is two or more outer steps past the reference it must be checked against.
    Donors only move further ahead, so downloading again against the same reference cannot help."""


def rms(t: torch.Tensor) -> float:
    return float(t.double().square().mean().sqrt())


def claims_agree(ours: AnchorClaim, reference: AnchorClaim, rel_tol: float, abs_tol: float) -> bool:
    """Same outer step and fingerprints within the tolerance of both claims' scales."""
    a, b = ours.fingerprint, reference.fingerprint
    return (ours.rounds_done == reference.rounds_done and (a.numel, a.chunk_len) == (b.numel, b.chunk_len)
            and agree(a, b, ours.scale, reference.scale, rel_tol=rel_tol, abs_tol=abs_tol))


# -- the round's average and replayed steps -------------------------------------------------------
def check_average(averaged: torch.Tensor, local: torch.Tensor, reference_rms: float = 0.0) -> str | None:
    """Why an averaged pseudo-gradient from the network must not be applied, or None if it may.
    Its size is compared with our own pseudo-gradient, else with the last one we applied."""
    if not torch.isfinite(averaged).all():
        return "the averaged pseudo-gradient has NaN/inf values; it was not applied"
    reference = max(rms(local), reference_rms)
    averaged_rms = rms(averaged)
    if reference > 0 and averaged_rms > MAX_AVERAGE_TO_LOCAL_RATIO * reference:
        return (f"the averaged pseudo-gradient is {averaged_rms / reference:.3g}x larger "
                "than ours; it was not applied")
    return None


def replay_problem(update: AppliedUpdate, rounds_done: int, numel: int, reference_rms: float) -> str | None:
    """Why a fetched outer step cannot be replayed on a state at ``rounds_done`` steps, or None."""
    if update.rounds_done != rounds_done + 1 or update.update.shape != (numel,):
        return "it does not follow our last step"
    if update.round < update.rounds_done:  # at most one step a round: a false round
        return f"it claims {update.rounds_done} outer steps by round {update.round}"
    size = rms(update.update)
    if reference_rms > 0 and size > MAX_CATCH_UP_TO_LAST_RATIO * reference_rms:
        return (f"{size / reference_rms:.3g}x larger than the larger of our last applied step and our own "
                "work this round")
    return None


# -- claims -----------------------------------------------------------------------------------------
def capped(state: SharedState, claim: AnchorClaim) -> AnchorClaim:
    """``claim`` with its scale capped at ``MAX_CLAIMED_SCALE_RATIO`` x ours: a claimed scale widens
    the tolerance of every comparison with that peer."""
    if claim.scale.shape != state.scale.shape:
        return claim  # another layout: the fingerprints will not compare either
    return AnchorClaim(claim.fingerprint, torch.minimum(claim.scale, MAX_CLAIMED_SCALE_RATIO * state.scale),
                       claim.rounds_done)


def state_claim(state: SharedState, metadata: Any) -> AnchorClaim:
    """The claim a donor's state metadata carries, validated against our layout (MessageError)."""
    if not isinstance(metadata, dict) or "claim" not in metadata:
        raise MessageError("no fingerprint of its anchor")
    claim = claim_of(state.decode_message(metadata["claim"]))
    if claim.rounds_done != metadata.get("rounds_done"):
        raise MessageError("its fingerprint describes another outer step than its state")
    # At most one outer step a round (``replay_problem`` keeps this true of replayed steps too).
    round = metadata.get("round")
    if not isinstance(round, int) or claim.rounds_done > round:
        raise MessageError(f"it claims {claim.rounds_done} outer steps in a state of round {round}")
    return claim


def matches(state: SharedState, fp: Fingerprint, claim: AnchorClaim) -> bool:
    """Whether a fingerprint we computed is the anchor ``claim`` describes, within the claim's
    own tolerance (its scale on both sides)."""
    a = claim.fingerprint
    return (fp.numel, fp.chunk_len) == (a.numel, a.chunk_len) and agree(
        fp, a, claim.scale, claim.scale, rel_tol=state.rel_tol, abs_tol=state.abs_tol)


def scales_agree(a: torch.Tensor, b: torch.Tensor, max_ratio: float = MAX_CLAIMED_SCALE_RATIO) -> bool:
    """Whether two claimed scales are the same step's, chunk by chunk, within ``max_ratio`` (honest
    peers at one outer step applied the same averaged pseudo-gradient)."""
    if a.shape != b.shape:
        return False
    low, high = torch.minimum(a, b), torch.maximum(a, b)
    return bool((high <= max_ratio * low + 1e-30).all())


def same_state(state: SharedState, a: Any, b: Any) -> bool:
    """Whether two donors' state metadata describe the same anchor, so their slices may be
    assembled together. Their scales must agree too: a huge claimed scale would otherwise widen the
    tolerance until it "agrees" with every state."""
    try:
        ours, theirs = state_claim(state, a), state_claim(state, b)
    except MessageError:
        return False
    return scales_agree(ours.scale, theirs.scale) and claims_agree(ours, theirs, state.rel_tol, state.abs_tol)


def momentum_problem(state: SharedState, momentum: torch.Tensor, claim: AnchorClaim) -> str | None:
    """Why a donor's momentum is not one that honest steps of the claimed size could have built
    (``MAX_MOMENTUM_TO_STEP_RATIO``), or None. ``claim``: the state's, its scale capped by ours if
    we have one."""
    sizes = claim.fingerprint.chunk_sizes()
    step_rms = float((claim.scale.square() * sizes).sum().div(sizes.sum()).sqrt()) if len(claim.scale) else 0.0
    bound = MAX_MOMENTUM_TO_STEP_RATIO * step_rms / max(1.0 - state.config.momentum, 1e-3)
    size = rms(momentum)
    if size > bound:
        return (f"its momentum (RMS {size:.3g}) is larger than steps of its claimed size (RMS {step_rms:.3g}) "
                f"could have built (at most {bound:.3g})")
    return None


# -- a download, slice by slice and whole -----------------------------------------------------------
def slice_check(state: SharedState, reference: AnchorClaim | None = None) -> CheckSlice:
    """A state download's per-slice check (``download_slices(check=...)``): a slice's anchor values
    must match the group's ``reference`` claim when the donor is at its step, else the donor's own
    claim; the momentum is checked with the whole state (``check_state``). A state of no outer step
    must be the run's initial weights, which we built ourselves."""
    numel = state.layout.numel

    def check(start: int, stop: int, metadata: Any, values: torch.Tensor) -> str | None:
        try:
            claim = state_claim(state, metadata)
        except MessageError as e:
            return f"bad claim ({e})"
        initial = claim.rounds_done == 0
        if initial and stop > numel and values[max(numel - start, 0):].any():
            return "the momentum of a state of no outer step is not zero"
        if start >= numel:
            return None
        by_group = reference is not None and claim.rounds_done == reference.rounds_done
        against = state.initial if initial else reference if by_group else claim
        if state.scale.any() and not initial:
            against = capped(state, against)
        chunk_len = against.fingerprint.chunk_len
        if start % chunk_len:
            return f"slice starts at {start}, inside a fingerprint chunk of {chunk_len} values"
        end = min(stop, numel)
        if not chunks_agree(values[: end - start], start // chunk_len, against, rel_tol=state.rel_tol,
                            abs_tol=state.abs_tol):
            whose = ("the run's initial weights (a state of no outer step)" if initial
                     else "the anchor its group agreed on" if by_group else "the fingerprint it claims")
            return f"values {start}..{end} of its anchor do not match {whose}"
        return None

    return check


def check_state(state: SharedState, downloaded: DownloadedState, *, require_claim: bool = False,
                max_round: int = MAX_ROUND, reference: AnchorClaim | None = None,
                step: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """Validate a downloaded state (or a checkpoint) before ``SharedState.adopt`` takes it; returns
    its (round, rounds_done) and scale, or raises MessageError.

    A state from the network must match its donors' claim (``require_claim``; a checkpoint has
    none) and claim no round past ``max_round``. A re-sync also checks against the group's
    ``reference`` claim, since a donor can make up a claim that matches its own state; a state one
    step past it is checked by undoing that ``step`` (``anchor_before_step``)."""
    metadata, tensors, peer = downloaded.metadata, downloaded.tensors, downloaded.peer
    numel = state.layout.numel
    if not isinstance(metadata, dict) or metadata.get("v") != STATE_VERSION:
        raise MessageError(f"state from {peer}: unknown state version")
    if metadata.get("numel") != numel or len(tensors) != 2:
        raise MessageError(f"state from {peer}: layout differs from ours")
    for tensor in tensors:
        if tensor.shape != (numel,) or tensor.dtype != torch.float32:
            raise MessageError(f"state from {peer}: tensor of shape {tuple(tensor.shape)} {tensor.dtype}")
        if not torch.isfinite(tensor).all():
            raise MessageError(f"state from {peer}: non-finite values")
    try:
        rounds = [bounded_int(metadata, key, 0, max_round) for key in ("round", "rounds_done")]
    except MessageError as e:
        raise MessageError(f"state from {peer}: bad round counters ({e})") from None
    try:
        scale = floats(metadata.get("scale"), len(state.scale), "scale")
    except MessageError as e:
        raise MessageError(f"state from {peer}: bad scale ({e})") from None
    if require_claim or "claim" in metadata:
        try:
            claim = state_claim(state, metadata)
        except MessageError as e:
            raise MessageError(f"state from {peer}: bad claim ({e})") from None
        # The claimed scale's tolerance, capped by ours once we have one.
        claim = capped(state, claim) if state.scale.any() else claim
        if not matches(state, fingerprint(tensors[0]), claim):
            raise MessageError(f"state from {peer}: the anchor does not match its donors' fingerprint "
                               "(donors that diverged, or one that sent another state than it claims)")
        problem = momentum_problem(state, tensors[1], claim) if claim.rounds_done > 0 else None
        if problem is not None:
            raise MessageError(f"state from {peer}: {problem}")
        scale = claim.scale.tolist()  # the state's scale as capped: a donor cannot widen our tolerance
    if reference is not None:
        _check_against(state, reference, tensors, rounds[1], step, peer=peer)
    return rounds, list(scale)


def _check_against(state: SharedState, reference: AnchorClaim, tensors: list[torch.Tensor], rounds_done: int,
                   step: torch.Tensor | None, *, peer: str) -> None:
    """Raise MessageError unless the state's anchor is the reference's."""
    ahead = rounds_done - reference.rounds_done
    if ahead == 0:
        before = tensors[0]
    elif ahead == 1 and step is not None:
        c = state.config
        before = anchor_before_step(tensors[0], step, tensors[1], lr=c.lr, mu=c.momentum, nesterov=c.nesterov)
    else:
        error = StateTooFarAhead if ahead > 1 else MessageError
        raise error(f"state from {peer}: {_rounds_apart(ahead)} from the group's reference, "
                    "so it cannot be checked against it")
    if not matches(state, fingerprint(before), reference):
        raise MessageError(f"state from {peer}: its anchor is not the one the group agreed on (a donor that "
                           "serves another state than the one it reported to the group)")


def _rounds_apart(ahead: int) -> str:
    return f"{ahead} outer step{'s' if abs(ahead) != 1 else ''}"
