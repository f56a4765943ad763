"""Do the peers of a group still hold the same anchor? A compact, tolerance-aware check.

An exact checksum would flag every round: a failed reducer leaves each peer's part at its local
value, and fp16 returns leave every peer slightly different. A fingerprint is, per chunk of the flat
anchor, ``K`` random-sign projections ``s_k · x`` (float64, a fixed sign table of prime period):
``E[(s·a - s·b)^2] = ||a - b||^2``, so fingerprints estimate each chunk's RMS difference.

Peers agree when every chunk's difference is below ``rel_tol`` x the RMS of the last averaged
pseudo-gradient (plus ``abs_tol``). fp16 drift moves an anchor at most ``lr / (1 - mu) * 2**-11`` of
a pseudo-gradient per round (2 x 2**-11 at the default outer lr 1.0, momentum 0.5), thousands of
rounds below it; a failed part (about one pseudo-gradient) crosses it at once.
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
    """Whether ``values`` (whole chunks of an anchor from ``first_chunk`` on) match ``claim`` on those
    chunks, with ``agree``'s tolerance: a download checks each slice as it arrives, so a bad donor
    is known before the state is assembled."""
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


# The far rule (``far_members``): beyond FAR_FACTOR x the typical distance plus FAR_STEPS claimed
# steps on some chunk, and beyond FAR_RELATIVE of the anchors' RMS overall (why: docs/scale.md).
FAR_FACTOR = 4.0
FAR_STEPS = 16.0
FAR_RELATIVE = 0.5


def far_members(claims: list[AnchorClaim], *, within_steps: float | None = None) -> list[bool]:
    """Which members of a sub-group hold an anchor far from the rest (FAR_*), by the signed claims
    alone, so every member and reducer agrees; a far member gets weight 0 in the group's mean state.
    A member's distance is the median over the others, per chunk; below 3 members nobody is far.
    ``within_steps`` (the lattice code's range): beyond it a member could not decode, so is far."""
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
    # The relative test pools the chunks: one chunk's 4-projection estimate scatters several-fold.
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
    """Who holds the reference anchor, as every member computes it; ``contested``: the reference
    won a tie, not a majority."""

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
    ``tie_rank`` (``salt``: the round). Deterministic, so every member reaches the same verdict
    without another message; nothing self-claimed decides a tie (docs/incidents.md)."""
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
    """Which members keep holding an anchor the group does not: an honest one is off for one group,
    so one that stays off fails to re-sync or lies, and the operator should see it. Only a peer
    holding the majority's anchor judges (in a contested verdict we may be the odd one)."""

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
