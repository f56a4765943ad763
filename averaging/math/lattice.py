"""The 1-byte lattice code of a sub-group's state: anchors and momenta as residues on a shared grid.

Why (docs/scale.md, "The lattice code"): members' anchors lie a few outer steps apart, so a member
sends each value's residue modulo ``q`` on a grid of ``q / 256``, and anyone holding a value within
``q / 2`` of it recovers the rest from its own: a quarter of fp32's bytes, half of fp16's.

The grid (``group_lattice``) is derived per fingerprint chunk from the round's signed claims by every
member and reducer alike, so nobody sends or chooses it (``RANGE_CAP_STEPS`` bounds what a lying
claim can coarsen). A reducer unwraps residues against a near member's part (``reference_part``) and
returns the mean's residue; a far member (``far``) cannot decode and downloads the group's state.
Values unwrapped near the range's edge are counted (``edge_values``): a grid too narrow shows there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from averaging.math.fingerprints import AnchorClaim, Fingerprint, far_members, rms_difference

LEVELS = 256
HALF = LEVELS // 2
RANGE_STEPS = 32.0
RANGE_SPREAD = 8.0
RANGE_CAP_STEPS = 256.0
MIN_HALF_RANGE = 1e-5
EDGE = 0.75 * HALF  # an unwrapped offset beyond this from the reference is counted (``edge_values``)


@dataclass(frozen=True, slots=True)
class Lattice:
    """A group's grid for the extra vector ``[anchor | momentum]``: the grid step of each chunk."""

    numel: int  # values of the anchor (and of the momentum)
    chunk_len: int
    anchor_steps: torch.Tensor  # float64 [chunks]
    momentum_steps: torch.Tensor  # float64 [chunks]

    def spans(self) -> Iterator[tuple[int, int, float]]:
        """(start, stop, grid step) over the extra vector, chunk by chunk: the anchor's, then the momentum's."""
        for offset, steps in ((0, self.anchor_steps), (self.numel, self.momentum_steps)):
            for c, step in enumerate(steps.tolist()):
                start = c * self.chunk_len
                yield offset + start, offset + min(self.numel, start + self.chunk_len), step

    def steps(self) -> torch.Tensor:
        """The grid step of every value of the extra vector (float64 ``[2 * numel]``): what a value's
        rounding is measured in (the tests' bounds, the simulation's overflow count)."""
        out = torch.empty(2 * self.numel, dtype=torch.float64)
        for start, stop, step in self.spans():
            out[start:stop] = step
        return out


def _half_ranges(fingerprints: Sequence[Fingerprint | None], steps: torch.Tensor, far: Sequence[bool]) -> torch.Tensor:
    """Half the range per chunk: the steps' share, the near members' largest pairwise distance's, the
    floor; at most the cap (in steps; never below the floor)."""
    near = [fp for fp, f in zip(fingerprints, far) if fp is not None and not f]
    spread = torch.zeros_like(steps)
    for i, a in enumerate(near):
        for b in near[i + 1:]:
            spread = torch.maximum(spread, rms_difference(a, b))
    half = torch.maximum(RANGE_STEPS * steps, RANGE_SPREAD * spread)
    return torch.minimum(half, RANGE_CAP_STEPS * steps).clamp(min=MIN_HALF_RANGE)


def group_lattice(claims: Sequence[AnchorClaim], momenta: Sequence[Fingerprint | None],
                  far: Sequence[bool]) -> Lattice:
    """The grid every member of a group derives from the group's claims (``claims[i]``, the
    momentum fingerprint ``momenta[i]`` a claim carries, and whether that member is far)."""
    assert claims and len(claims) == len(momenta) == len(far)
    first = claims[0].fingerprint
    # the lower median: in a group of two the smaller claim, which a liar cannot raise
    steps = torch.stack([c.scale for c in claims]).median(dim=0).values.to(torch.float64)
    anchor = _half_ranges([c.fingerprint for c in claims], steps, far)
    momentum = _half_ranges(momenta, steps, far) if any(m is not None for m in momenta) else anchor
    return Lattice(numel=first.numel, chunk_len=first.chunk_len, anchor_steps=anchor / HALF,
                   momentum_steps=momentum / HALF)


# A member whose anchor lies farther from the others than the grid can cover (its spread share
# saturates at the cap: RANGE_CAP_STEPS / RANGE_SPREAD = 32 steps) could not decode the group's
# state and would hold its own, out of date for good: with the lattice code it counts as far.
WITHIN_STEPS = RANGE_CAP_STEPS / RANGE_SPREAD


def far(claims: Sequence[AnchorClaim]) -> list[bool]:
    """``fingerprints.far_members`` for a lattice-coded group: far also beyond what the grid covers."""
    return far_members(list(claims), within_steps=WITHIN_STEPS)


def left_out(claims: Sequence[AnchorClaim], *, coded: bool) -> list[bool]:
    """The run's far rule: which members a group's reducers give weight 0 in its mean state
    (``far`` where the state rides the lattice code, ``coded``; else ``far_members``). The
    reducers and every member's check of the mean must use the same rule: a member the mean left
    out must not widen the check's bound (``averaging.engine.subgroups.state_problem``)."""
    return far(claims) if coded else far_members(list(claims))


def wrap(delta: torch.Tensor) -> torch.Tensor:
    """A difference of residues as the offset in [-128, 128) it stands for."""
    return torch.remainder(delta + HALF, LEVELS) - HALF


def unwrap(part: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``part``'s residues as the values nearest ``reference``'s (both in grid units)."""
    return reference + wrap(part - reference)


def reference_part(parts: dict[int, torch.Tensor], *, own: int | None, far: frozenset[int]) -> torch.Tensor | None:
    """What a reducer unwraps a part's residues against: its own part, unless it is far itself (or
    sent none), then the first near sender's; None if every sender is far."""
    if own is not None and own in parts and own not in far:
        return parts[own]
    return next((parts[s] for s in sorted(parts) if s not in far), None)


def edge_values(unwrapped: torch.Tensor, reference: torch.Tensor) -> int:
    """How many values unwrapped beyond ``EDGE`` from the reference (overflow suspects)."""
    return int(((unwrapped - reference).abs() > EDGE).sum())


@torch.no_grad()
def to_residues_(extra: torch.Tensor, lattice: Lattice) -> None:
    """Our state (``extra``, flat ``[anchor | momentum]``) replaced, in place, by its residues: the
    nearest grid point's index modulo 256 (float64 on the way: indices of fine grids exceed fp32's
    exact integers)."""
    for start, stop, step in lattice.spans():
        extra[start:stop] = torch.remainder((extra[start:stop].double() / step).round_(), LEVELS)


@torch.no_grad()
def from_residues_(extra: torch.Tensor, raw: torch.Tensor, lattice: Lattice) -> None:
    """After the all-reduce: ``extra`` holds our residue plus the wrapped offset to the group's mean
    (where a reducer's share never arrived: our residue, offset 0); ``raw`` our state before
    ``to_residues_``. Writes the group's mean on the grid into ``extra``, in place."""
    for start, stop, step in lattice.spans():
        index = (raw[start:stop].double() / step).round_()
        offset = wrap(extra[start:stop].double() - torch.remainder(index, LEVELS))
        extra[start:stop] = (index + offset) * step


def returned_residues(residues: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """What a group's reducers return for the members' residues (``to_residues_``): each unwrapped
    against the first one's, their weighted mean, rounded to the grid and sent as a residue again
    (the lat8 return). A member rebuilds its value from it with ``from_residues_``."""
    total = float(sum(weights))
    mean = sum(unwrap(r, residues[0]) * (w / total) for r, w in zip(residues, weights))
    return torch.remainder(mean.round(), LEVELS)
