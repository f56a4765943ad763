"""Do the peers of a group still hold the same anchor? A compact, tolerance-aware check.

hivemind can end an all-reduce "successfully" while peers hold different results (a reducer
that died leaves its part at each peer's local value), and fp16 compression makes even a healthy
all-reduce end with slightly different results on every peer: each peer adds
``fp16(average - local)`` to its own local part. So an exact checksum would flag every round,
and the check must measure *how far apart* anchors are.

A fingerprint is, per chunk of the flat anchor, ``K`` random-sign projections ``s_k · x``
(float64). For two peers, ``E[(s·a - s·b)^2] = ||a - b||^2`` (Johnson-Lindenstrauss), so the
fingerprints estimate the RMS difference of every chunk without sending the anchor. The signs are
a fixed table of period ``SIGN_PERIOD`` (a prime, so it does not line up with tensor shapes)
tiled over the chunk: one matmul per chunk, no per-round random numbers.

Tolerance. With fp16 (unit round-off ``u = 2**-11``) a peer's averaged pseudo-gradient is off by
at most ``u * |avg - local|`` per element, and an error ``e`` in one averaged pseudo-gradient moves
the anchor by ``lr / (1 - mu) * e`` over all later Nesterov steps (it enters once as ``(1 + mu) e``,
then decays through the momentum buffer: ``lr * (1 + mu + mu**2 / (1 - mu))``). With
lr 0.7, mu 0.9 that is ``7 u ~ 0.0034`` of one round's pseudo-gradient in the worst case, and in
RMS about ``0.002 * sqrt(rounds)`` of it as errors random-walk. A failed part instead differs by
about ``lr * (1 + mu) * |avg - local|``, i.e. about one pseudo-gradient. Peers therefore agree
when every chunk's estimated RMS difference is below ``rel_tol`` (default 0.25) times the RMS of
the last averaged pseudo-gradient on that chunk, plus ``abs_tol`` for float32 noise: fp16 drift
needs thousands of rounds to reach it (and a resync then resets it), a failed part crosses it at
once.

With shoal's int codecs (``averaging.math.wire``) the same tolerance holds: error-fed sends are on the
codec's grid, so every reducer averages identical values; fp16 returns are the bound above, and
int8/int4 returns carry the quantized average itself, the same for every member (no drift).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

from protocols.messages import ClaimMessage

SIGN_PERIOD = 4093
NUM_PROJECTIONS = 4
MAX_CHUNKS = 64
SIGN_SEED = 0x5EA1  # part of the protocol: every peer must build the same sign table
DEFAULT_REL_TOL = 0.25
DEFAULT_ABS_TOL = 1e-6


@functools.lru_cache(maxsize=1)
def _sign_table() -> torch.Tensor:
    generator = torch.Generator().manual_seed(SIGN_SEED)
    bits = torch.randint(0, 2, (SIGN_PERIOD, NUM_PROJECTIONS), generator=generator)
    return (bits * 2 - 1).to(torch.float64)


def chunk_length(numel: int, max_chunks: int = MAX_CHUNKS) -> int:
    """Elements per chunk: a multiple of the sign period, at most ``max_chunks`` chunks."""
    periods = max(1, math.ceil(numel / (max_chunks * SIGN_PERIOD)))
    return periods * SIGN_PERIOD


def _chunks(flat: torch.Tensor, chunk_len: int):
    for start in range(0, flat.numel(), chunk_len):
        yield flat[start : start + chunk_len]


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Per-chunk random projections of a flat vector: ``projections[c, k] = s_k · chunk_c``."""

    numel: int
    chunk_len: int
    projections: torch.Tensor  # float64 [num_chunks, NUM_PROJECTIONS]

    @property
    def num_chunks(self) -> int:
        return self.projections.shape[0]

    def chunk_sizes(self) -> torch.Tensor:
        sizes = torch.full((self.num_chunks,), self.chunk_len, dtype=torch.float64)
        sizes[-1] = self.numel - self.chunk_len * (self.num_chunks - 1)
        return sizes


def fingerprint(flat: torch.Tensor, max_chunks: int = MAX_CHUNKS) -> Fingerprint:
    """Fingerprint a flat CPU vector (one float64 pass; the temporaries are one chunk large)."""
    assert flat.dim() == 1 and flat.numel() > 0
    chunk_len = chunk_length(flat.numel(), max_chunks)
    return Fingerprint(flat.numel(), chunk_len, chunk_projections(flat, chunk_len))


def chunk_projections(values: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """The fingerprint's rows for ``values``, a run of whole chunks (the last may be partial): a
    slice of an anchor that starts on a chunk boundary gives that anchor's rows for its chunks."""
    signs = _sign_table()
    rows = []
    for chunk in _chunks(values.detach(), chunk_len):
        padded = torch.zeros(chunk_len, dtype=torch.float64)
        padded[: chunk.numel()] = chunk
        rows.append((padded.view(-1, SIGN_PERIOD) @ signs).sum(dim=0))
    return torch.stack(rows)


def chunks_agree(values: torch.Tensor, first_chunk: int, claim: AnchorClaim, *, rel_tol: float = DEFAULT_REL_TOL,
                 abs_tol: float = DEFAULT_ABS_TOL) -> bool:
    """Whether ``values`` (chunks ``first_chunk``, ``first_chunk + 1``, ... of an anchor, the last
    one possibly the anchor's partial last chunk) match ``claim`` on those chunks, with the
    tolerance of ``agree``: a state download checks each slice as it arrives, so that the donor of
    a slice that does not match is known (and dropped) before the state is assembled."""
    fp = claim.fingerprint
    rows = chunk_projections(values, fp.chunk_len)
    last = first_chunk + rows.shape[0]
    if first_chunk < 0 or last > fp.num_chunks:
        return False
    sizes = fp.chunk_sizes()[first_chunk:last]
    if rows.shape[0] and values.numel() - fp.chunk_len * (rows.shape[0] - 1) != int(sizes[-1]):
        return False  # the slice ends inside a chunk: it cannot be compared chunk by chunk
    difference = ((rows - fp.projections[first_chunk:last]).square().mean(dim=1) / sizes).sqrt()
    return bool((difference <= rel_tol * claim.scale[first_chunk:last] + abs_tol).all())


def chunk_rms(flat: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """RMS of each chunk of ``flat`` (float64), the scale the tolerance is relative to."""
    return torch.stack([chunk.double().square().mean().sqrt() for chunk in _chunks(flat.detach(), chunk_len)])


def rms_difference(a: Fingerprint, b: Fingerprint) -> torch.Tensor:
    """Estimated RMS of ``x_a - x_b`` on each chunk."""
    assert (a.numel, a.chunk_len) == (b.numel, b.chunk_len), "fingerprints of different layouts"
    squared = (a.projections - b.projections).square().mean(dim=1)
    return (squared / a.chunk_sizes()).sqrt()


def agree(
    a: Fingerprint,
    b: Fingerprint,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    abs_tol: float = DEFAULT_ABS_TOL,
) -> bool:
    """True when every chunk of the two anchors is within the tolerance (symmetric in a, b)."""
    tolerance = rel_tol * torch.maximum(scale_a, scale_b) + abs_tol
    return bool((rms_difference(a, b) <= tolerance).all())


@dataclass(frozen=True, slots=True)
class AnchorClaim:
    """What one group member says about its anchor, as decoded from the round's gather."""

    fingerprint: Fingerprint
    scale: torch.Tensor  # per-chunk RMS of the peer's last averaged pseudo-gradient (zeros before any)
    rounds_done: int  # outer steps this peer has applied (self-claimed: picks catch-ups, never the reference)


# A sub-group member whose claimed anchor lies this many times farther from the others than the
# group's typical member does, plus this many of the members' claimed steps, is "far": its anchor
# and momentum get weight 0 in the group's mean and it adopts the group's (``far_members``).
# Honest members of a group lie a few steps apart: their last groups' anchors differ (simulated:
# about 1-2 pseudo-gradient RMS, the real model about twice that), and a claim made before the
# member's last sync landed is one outer step (up to lr / (1 - mu) RMS) off. The typical distance
# cannot be relied on for that slack: where most members come from one last group it is 0. A
# chunk's estimate runs up to ~1.8x high at its 1% tail (4 projections). Measured on a real 8-peer
# run in groups of 4 (scale_real_state16, the checkpoints): two members' anchors at most 1.7 outer
# steps apart on any chunk, a claim before the last step landed 2.0 (an outer step is up to about
# twice a pseudo-gradient's RMS, the claimed scale). 4 steps flagged one honest member per group in
# that run's last round; 16 flagged none (a second run).
FAR_FACTOR = 4.0
FAR_STEPS = 16.0
# ...and only beyond this share of the members' anchors' own RMS, over the whole anchor. Why: in a small
# group, members from one earlier group hold the same anchor, so the median member's distance is
# often 0 (groups of 3 drawn from 2 earlier groups always hold such a pair; groups of 4 often), and
# the bar is then the 16 steps alone, which honest members crossed on real runs where a chunk's
# claimed step was small next to how far the earlier groups had drifted apart (an 8-peer run in
# groups of 4: one honest member flagged in each group of the last three rounds, the flagged ones
# taking the others' state, anchors 0.92 relative apart at the end, scale_real_far16.md's fp16
# run; attacks_far_state.md's clean run in groups of 3 likewise). Honest members of real runs lay
# 0.05-0.13 of the weights' RMS apart (scale_real_*.md, max pairwise); a stranger's made-up anchor or
# a peer back from a checkpoint long out of date is far more than half of it away.
FAR_RELATIVE = 0.5


def far_members(claims: list[AnchorClaim], *, within_steps: float | None = None) -> list[bool]:
    """Which members of a sub-group hold an anchor far from the rest, by their claims alone, so
    that every member and every reducer computes the same answer (each sees the same signed claims).

    Member ``i``'s distance is the median over the others of the claims' estimated RMS difference,
    per chunk; it is far where some chunk's exceeds ``FAR_FACTOR`` x the median member's distance
    plus ``FAR_STEPS`` x the median claimed step (``scale``), and its distance over the whole anchor
    exceeds ``FAR_RELATIVE`` x the median member's anchor RMS (``anchor_rms``: a fingerprint
    estimates its own vector's norm too; pooled over the chunks, ``pooled_rms``).
    Why: the group's mean state is checked
    against the farthest claimed distance (``averaging.engine.subgroups.state_problem``), so a member
    claiming a far anchor (a stranger, or a peer back from an old checkpoint) would widen that bound
    for everybody, and its anchor would pull the mean; with weight 0 it pulls nothing and the bound
    is the others'. The medians hold while fewer than half of the others are far; below 3 members
    nobody can be told apart, and nobody is far.

    ``within_steps`` (the lattice code: what its grid can cover, ``averaging.math.lattice``): a
    member beyond ``FAR_FACTOR`` x the median member's distance and that many claimed steps is far
    too, however near relative to the weights: such a member could not decode the group's state."""
    n = len(claims)
    if n < 3:
        return [False] * n
    distances = torch.stack([  # [n, n - 1, chunks]
        torch.stack([rms_difference(a.fingerprint, b.fingerprint) for j, b in enumerate(claims) if j != i])
        for i, a in enumerate(claims)])
    own = distances.median(dim=1).values  # [n, chunks]: the lower median, robust to far others
    typical = own.median(dim=0).values
    step = torch.stack([c.scale for c in claims]).median(dim=0).values
    size = torch.stack([anchor_rms(c.fingerprint) for c in claims]).median(dim=0).values
    # The relative test pools the chunks: a chunk's estimates come from 4 projections each, so the
    # ratio of a chunk's distance to its size scatters several-fold and its largest over 64 chunks
    # flagged honest members a tenth of the weights' RMS apart in a fifth of draws (a quarter of the
    # bar); pooled over every chunk the estimates hold within ~10%.
    weights = claims[0].fingerprint.chunk_sizes()
    relative = pooled_rms(own, weights) / pooled_rms(size, weights).clamp_min(DEFAULT_ABS_TOL)  # [n]
    bound = FAR_FACTOR * typical + FAR_STEPS * step + DEFAULT_ABS_TOL  # (+ float32 noise, as ``agree``)
    far = [bool((own[i] > bound).any()) and float(relative[i]) > FAR_RELATIVE for i in range(n)]
    if within_steps is not None:
        grid = torch.maximum(FAR_FACTOR * typical, within_steps * step) + DEFAULT_ABS_TOL
        far = [f or bool((own[i] > grid).any()) for i, f in enumerate(far)]
    return far


def pooled_rms(per_chunk: torch.Tensor, chunk_sizes: torch.Tensor) -> torch.Tensor:
    """The RMS over a whole vector from its chunks' RMS (the last dimension), each chunk weighted by its size."""
    return ((per_chunk.square() * chunk_sizes).sum(dim=-1) / chunk_sizes.sum()).sqrt()


def anchor_rms(fp: Fingerprint) -> torch.Tensor:
    """The RMS of the fingerprinted vector on each chunk, estimated from its own projections
    (``E[(s . x)^2] = ||x||^2``, as ``rms_difference``)."""
    return (fp.projections.square().mean(dim=1) / fp.chunk_sizes()).sqrt()


@dataclass(frozen=True, slots=True)
class Consensus:
    """The group's view of who holds the reference anchor; every member computes the same one.

    ``contested``: another set of members, as large as the reference's, agrees on another anchor,
    so the reference won a tie (a hash), not a majority."""

    reference: str
    agreeing: frozenset[str]
    diverged: frozenset[str]
    contested: bool = False


def tie_rank(peer: str, salt: str) -> bytes:
    """A peer's rank in a tie: a hash of its id and the round, so that nobody picks it by claiming
    something (a claimed step count is free to inflate) and no peer id wins every round."""
    return hashlib.sha256(f"shoal-tie/{salt}/{peer}".encode()).digest()


def consensus(claims: dict[str, AnchorClaim], *, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL,
              salt: str = "") -> Consensus:
    """Pick the reference anchor: the one most members agree with; a tie goes to the smallest
    ``tie_rank`` (``salt``: the round, the same on every member).

    Deterministic given the same claims and salt, so all members reach the same verdict without
    another message. Members that do not agree with the reference must catch up or re-sync from
    the agreeing ones. Nothing self-claimed decides a tie: a peer claiming more outer steps than
    anyone would otherwise win every tie it is part of (docs/incidents.md).
    """
    assert claims, "consensus of an empty group"
    peers = sorted(claims)
    agrees_with = {
        p: {q for q in peers if q == p or agree(claims[p].fingerprint, claims[q].fingerprint,
                                               claims[p].scale, claims[q].scale, rel_tol=rel_tol, abs_tol=abs_tol)}
        for p in peers
    }
    reference = min(peers, key=lambda p: (-len(agrees_with[p]), tie_rank(p, salt)))
    agreeing = frozenset(agrees_with[reference])
    diverged = frozenset(peers) - agreeing
    contested = any(len(agrees_with[p]) == len(agreeing) for p in diverged)
    return Consensus(reference, agreeing, diverged, contested)


def encode_claim(claim: AnchorClaim, *, round: int, momentum: Fingerprint | None = None) -> ClaimMessage:
    """This peer's claim as the message it attaches to the all-reduce (``momentum``: the outer
    momentum's fingerprint too, with sub-groups)."""
    fp = claim.fingerprint
    return ClaimMessage(
        round=round,
        rounds_done=claim.rounds_done,
        numel=fp.numel,
        chunk_len=fp.chunk_len,
        num_projections=NUM_PROJECTIONS,
        projections=tuple(fp.projections.flatten().tolist()),
        scale=tuple(claim.scale.tolist()),
        momentum=tuple(momentum.projections.flatten().tolist()) if momentum is not None else None,
    )


def _fingerprint_of(message: ClaimMessage, projections: tuple[float, ...]) -> Fingerprint:
    rows = torch.tensor(projections, dtype=torch.float64).view(message.num_chunks, message.num_projections)
    return Fingerprint(message.numel, message.chunk_len, rows)


def momentum_of(message: ClaimMessage) -> Fingerprint | None:
    """The momentum's fingerprint a validated message carries, if any."""
    return _fingerprint_of(message, message.momentum) if message.momentum is not None else None


def claim_of(message: ClaimMessage) -> AnchorClaim:
    """The inverse of ``encode_claim`` for a message that ``ClaimMessage.decode`` validated."""
    return AnchorClaim(
        fingerprint=_fingerprint_of(message, message.projections),
        scale=torch.tensor(message.scale, dtype=torch.float64),
        rounds_done=message.rounds_done,
    )


# A member off the group's anchor this many of our groups in a row is not catching up: warned of.
PERSISTENT_DIVERGENCE = 3
REPEAT_WARNING_EVERY = 10
MAX_WATCHED = 1024  # members remembered (groups are capped; ids beyond this are Sybil churn)


@dataclass
class DivergenceReport:
    peer: str
    streak: int  # our consecutive groups in which it was off the agreed anchor

    @property
    def persistent(self) -> bool:
        return self.streak >= PERSISTENT_DIVERGENCE


class DivergenceWatch:
    """Which members keep holding an anchor the group does not. An honest member off the anchor
    (it folded a round, or lost a part) catches up or re-syncs at once, so it is off for one group;
    one that stays off is failing to re-sync, or lies about its anchor (a peer claiming a poisoned
    anchor one step ahead is harmless to the majority, which keeps its anchor, but the operator
    should see who it is). Only a peer that holds the majority's anchor judges:
    in a contested or lost verdict we may be the odd one ourselves."""

    def __init__(self):
        self._streaks: dict[str, int] = {}

    def observe(self, verdict: Consensus | None, self_id: str) -> list[DivergenceReport]:
        """What to report after this group's verdict: a member's first divergence, when it becomes
        persistent, and every ``REPEAT_WARNING_EVERY`` groups after that."""
        if verdict is None or verdict.contested or self_id not in verdict.agreeing:
            return []
        for peer in verdict.agreeing:
            self._streaks.pop(peer, None)
        reports = []
        for peer in sorted(verdict.diverged):
            streak = self._streaks.pop(peer, 0) + 1
            self._streaks[peer] = streak  # the most recently seen last
            if len(self._streaks) > MAX_WATCHED:
                del self._streaks[next(iter(self._streaks))]
            if streak in (1, PERSISTENT_DIVERGENCE) or (
                    streak > PERSISTENT_DIVERGENCE and (streak - PERSISTENT_DIVERGENCE) % REPEAT_WARNING_EVERY == 0):
                reports.append(DivergenceReport(peer, streak))
        return reports
