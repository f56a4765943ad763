"""Robust aggregation of one all-reduce part: the rules a reducer applies to its senders' parts and
a sender to what a reducer returns. Pure functions; the hivemind wiring is
``averaging.network.hivemind.allreduce``. Threat: a public swarm admits strangers, and one sender
could otherwise decide the average (a weight of 1e30, a part x1000) or destroy it (NaN).

Rules, in the order a reducer applies them to a part (docs/design.md, "Robust aggregation"):
``check_part`` on arrival; the weight declared first, refused above ``refuse_weight_ratio`` x the
lower median (``weight_outliers``) and clipped (``bound_weights``); parts over ``max_norm_ratio`` x
max(our own norm, the lower median) refused (``norm_outliers``); then ``aggregate``. CenteredClip
(the default; Karimireddy et al., arXiv 2012.10333) starts at the coordinate-wise median: an
attacker moves the result by at most τ x its weight share, and an honest group gets the weighted
mean exactly. With two senders no rule outvotes anyone.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.errors import ConfigError

logger = logging.getLogger(__name__)

AGGREGATIONS = ("mean", "centered_clip", "trimmed_mean")


@dataclass(kw_only=True, slots=True)
class RobustConfig:
    """How a reducer aggregates its senders' parts and what it refuses (module docstring)."""

    aggregation: str = "centered_clip"  # mean | centered_clip | trimmed_mean
    max_weight_ratio: float = 3.0  # a sender's weight is clipped to this × the median weight of its group
    max_weight: float = 0.0  # absolute weight cap (what a round's length allows); 0 = none
    refuse_weight_ratio: float = 100.0  # a declared weight above this × the reference is refused (weight_outliers)
    clip_ratio: float = 2.0  # CenteredClip radius τ, in median distances of the parts to their median
    clip_iterations: int = 1
    trim_fraction: float = 0.25  # trimmed mean: fraction of senders dropped at each end, per coordinate
    max_norm_ratio: float = 30.0  # a part (or a returned average) larger than this × the reference is refused
    ban_rounds: int = 10  # a peer that sent or returned something refused is excluded for this many rounds
    strike_limit: int = 5  # a reducer whose stream fails in this many rounds (Strikes; 0 = never) ...
    strike_window: int = 20  # ... of the last this many is banned for ban_rounds
    max_group_size: int = 64  # a leader's group larger than this (or than target_group_size) is refused

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"averaging.aggregation ({self.aggregation!r}) must be one of: {', '.join(AGGREGATIONS)}")
        if not self.max_weight_ratio >= 1 or not self.max_weight >= 0:
            raise ConfigError("max_weight_ratio must be >= 1 and max_weight >= 0 (0 = no absolute cap)")
        if not self.refuse_weight_ratio >= self.max_weight_ratio:
            raise ConfigError("refuse_weight_ratio must be >= max_weight_ratio")
        if not self.clip_ratio > 0 or not 1 <= self.clip_iterations <= 100:
            raise ConfigError("clip_ratio must be > 0 and clip_iterations in [1, 100]")
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"trim_fraction ({self.trim_fraction}) must be in [0, 0.5)")
        if not self.max_norm_ratio > 1 or self.ban_rounds < 0 or self.max_group_size < 2:
            raise ConfigError("max_norm_ratio must be > 1, ban_rounds >= 0 and max_group_size >= 2")
        if self.strike_limit < 0 or self.strike_window < max(1, self.strike_limit):
            raise ConfigError(f"strike_limit ({self.strike_limit}) must be >= 0 (0 = never) and strike_window "
                              f"({self.strike_window}) at least the limit and >= 1")


# -- 1. validation ---------------------------------------------------------------------------------

def check_weight(weight: float) -> str | None:
    """Why a declared weight is refused, or None. 0 is legal (hivemind: receive without contributing)."""
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        return f"declared weight {weight!r:.20} (must be finite and >= 0)"
    return None


def check_part(part: torch.Tensor, shape: torch.Size, dtype: torch.dtype = torch.float32) -> str | None:
    """Why a received part is refused before it is counted (shape, dtype, finiteness), or None."""
    if part.shape != shape:
        return f"part of shape {list(part.shape)[:4]}, expected {list(shape)}"
    if part.dtype != dtype:
        return f"part of dtype {part.dtype}, expected {dtype}"
    if not bool(torch.isfinite(part).all()):
        return "part has NaN/inf values"
    return None


def check_returned(delta: torch.Tensor, own: torch.Tensor, *, max_norm_ratio: float) -> str | None:
    """Why a reducer's returned delta (average - our part) must not be applied, or None. Only our
    own part is trusted, so the average may be at most ``max_norm_ratio`` x its norm."""
    if delta.shape != own.shape or delta.dtype != own.dtype:
        return f"returned {list(delta.shape)[:4]} {delta.dtype}, expected {list(own.shape)} {own.dtype}"
    if not bool(torch.isfinite(delta).all()):
        return "returned NaN/inf values"
    own_norm = float(own.double().norm())
    average_norm = float((own.double() + delta.double()).norm())
    if own_norm > 0 and average_norm > max_norm_ratio * own_norm:
        return f"returned an average {average_norm / own_norm:.3g}x the norm of our part"
    return None


def norms(parts: Sequence[torch.Tensor]) -> list[float]:
    return [float(part.double().norm()) for part in parts]


def norm_outliers(part_norms: Sequence[float], *, own_norm: float, max_norm_ratio: float) -> list[int]:
    """Indices of parts larger than ``max_norm_ratio`` × max(our own part's norm, the lower median norm)."""
    if not part_norms:
        return []
    # The lower median: with two senders the plain median (their mean) would let a x1000 part pass.
    reference = max(own_norm, statistics.median_low(part_norms))
    if reference <= 0:
        return [i for i, n in enumerate(part_norms) if n > 0] if own_norm > 0 else []
    return [i for i, n in enumerate(part_norms) if n > max_norm_ratio * reference]


# -- 2. weights --------------------------------------------------------------------------------

def weight_outliers(weights: Sequence[float], *, own_weight: float, max_ratio: float) -> list[int]:
    """Indices of declared weights above ``max_ratio`` x max(our own weight, the lower median of
    the positive ones): a lie, not work, so refused (and banned) rather than only clipped."""
    positive = [w for w in weights if w > 0]
    if not positive:
        return []
    reference = max(own_weight, statistics.median_low(positive))
    return [i for i, w in enumerate(weights) if w > max_ratio * reference]


def bound_weights(weights: Sequence[float], *, max_ratio: float, max_weight: float = 0.0) -> list[float]:
    """Each (valid) weight clipped to ``max_ratio`` x the lower median of the positive ones (with two
    senders the plain median would let a huge weight raise its own cap) and to ``max_weight``."""
    positive = [w for w in weights if w > 0]
    if not positive:
        return [float(w) for w in weights]
    cap = max_ratio * statistics.median_low(positive)
    if max_weight > 0:
        cap = min(cap, max_weight)
    return [min(float(w), cap) for w in weights]


# -- 3. aggregation ----------------------------------------------------------------------------

@dataclass(slots=True)
class Aggregate:
    value: torch.Tensor
    clipped: list[int]  # indices of parts that did not count in full (clipped or trimmed away)


def coordinate_median(stacked: torch.Tensor) -> torch.Tensor:
    """Median over dim 0; for an even count the mean of the two middle values (``torch.median``
    returns the lower one, which would let one of two senders pick the centre)."""
    n = stacked.shape[0]
    ordered = stacked.sort(dim=0).values
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], config: RobustConfig, *,
              work_scaled: bool = True) -> Aggregate:
    """The aggregate of ``parts`` under ``config.aggregation`` with bounded ``weights`` (all equal if
    none is positive); ``work_scaled``: CenteredClip's radius grows with work (``work_radii``)."""
    assert parts and len(parts) == len(weights)
    dtype = parts[0].dtype
    stacked = torch.stack([part.reshape(-1).double() for part in parts])
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if not bool((w > 0).any()):
        w = torch.ones_like(w)
    if config.aggregation == "mean" or len(parts) == 1:
        value, clipped = (w[:, None] * stacked).sum(0) / w.sum(), []
    elif config.aggregation == "centered_clip":
        value, clipped = _centered_clip(stacked, w, config.clip_ratio, config.clip_iterations,
                                        radii=work_radii(w) if work_scaled else None)
    else:
        value, clipped = _trimmed_mean(stacked, w, config.trim_fraction)
    return Aggregate(value.reshape(parts[0].shape).to(dtype), clipped)


def work_radii(w: torch.Tensor) -> torch.Tensor:
    """Each sender's clipping radius, in units of ``tau``: ``sqrt(max(1, w_i / median(w)))``. A peer
    that did more inner steps moves farther, so without this an honest fast peer looks far; weights
    are bounded first, so a liar gains at most ``sqrt(max_weight_ratio)`` x the radius."""
    reference = float(w.median())
    if not reference > 0:
        return torch.ones_like(w)
    return (w / reference).clamp_min(1.0).sqrt()


def _centered_clip(stacked: torch.Tensor, w: torch.Tensor, clip_ratio: float, iterations: int,
                   radii: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip; ``radii`` (per sender, default 1): each sender's radius in units of ``tau``."""
    center = coordinate_median(stacked)
    tau = clip_ratio * float(coordinate_median((stacked - center).norm(dim=1)[:, None])[0])
    limit = tau * (radii if radii is not None else torch.ones_like(w))
    scale = torch.ones_like(w)
    for _ in range(iterations):
        offsets = stacked - center
        distance = offsets.norm(dim=1)
        scale = torch.where(distance > limit, limit / distance.clamp_min(1e-300), torch.ones_like(distance))
        center = center + ((w * scale)[:, None] * offsets).sum(0) / w.sum()
    return center, [i for i in range(len(w)) if scale[i] < 1]


def _trimmed_mean(stacked: torch.Tensor, w: torch.Tensor, trim_fraction: float) -> tuple[torch.Tensor, list[int]]:
    n = stacked.shape[0]
    trim = min(math.ceil(trim_fraction * n), (n - 1) // 2)
    if trim == 0:
        return (w[:, None] * stacked).sum(0) / w.sum(), []
    ordered, order = stacked.sort(dim=0)
    kept, kept_order = ordered[trim:n - trim], order[trim:n - trim]
    kept_w = w[kept_order]
    total = kept_w.sum(0)
    # A coordinate whose kept senders all have weight 0: their plain mean.
    value = torch.where(total > 0, (kept_w * kept).sum(0) / total.clamp_min(1e-300), kept.mean(0))
    trimmed_share = 1 - torch.bincount(kept_order.reshape(-1), minlength=n).double() / stacked.shape[1]
    return value, [i for i in range(n) if trimmed_share[i] > 0.5]


# -- 4. bans -----------------------------------------------------------------------------------

class BanList:
    """Peers excluded for ``rounds`` averaging rounds after they sent or returned something refused
    (``next_round`` once per averaging step). Averager process, its event loop only."""

    def __init__(self, rounds: int):
        self.rounds = rounds
        self.round = 0
        self._until: dict[str, int] = {}

    def next_round(self) -> None:
        self.round += 1
        self._until = {peer: until for peer, until in self._until.items() if until > self.round}

    def ban(self, peer: str, reason: str) -> bool:
        """Exclude ``peer`` for the next ``rounds`` rounds; True if it was not banned already."""
        if self.rounds <= 0:
            return False
        fresh = peer not in self._until
        self._until[peer] = self.round + self.rounds + 1  # the rest of this round, then `rounds` more
        if fresh:
            logger.warning(f"banned peer {peer} for {self.rounds} rounds: {reason}")
        return fresh

    def is_banned(self, peer: str) -> bool:
        return peer in self._until

    @property
    def banned(self) -> list[str]:
        return sorted(self._until)


def struck_reducers(reducers: Sequence[str], failed: Sequence[str]) -> list[str]:
    """The failed reducers to strike after one all-reduce: all of ``failed`` if fewer than half of
    the other ``reducers`` (the group's, less us) failed too, else none: then, or in a pair, our
    own link is as likely the fault."""
    failed = [peer for peer in dict.fromkeys(failed) if peer in reducers]
    others = len(set(reducers)) - 1  # the reducers other than one failed reducer (the same for each)
    return failed if failed and 2 * (len(failed) - 1) < others else []


class Strikes:
    """Reducers whose stream failed: ``strike(peer, round)`` is True once a peer has ``limit``
    strikes in the last ``window_rounds`` rounds (the ban list's), then clears its record (the caller
    bans it). Strikes, not a ban at the first failure, because honest reducers fail now and then: at
    the defaults a reducer failing once in 15 rounds starts a ban in at most 0.23% of rounds
    (docs/security.md). Averager process only, not thread-safe."""

    def __init__(self, limit: int, window_rounds: int):
        assert limit >= 0 and window_rounds >= max(1, limit)
        self.limit, self.window_rounds = limit, window_rounds
        self._rounds: dict[str, list[int]] = {}  # peer -> the rounds it was struck in, oldest first

    def strike(self, peer: str, round: int) -> bool:
        """Record a failure of ``peer`` in ``round``; True if that makes ``limit`` in the window."""
        if self.limit == 0:
            return False
        self._expire(round)
        rounds = self._rounds.setdefault(peer, [])
        if round not in rounds:
            rounds.append(round)
        if len(rounds) < self.limit:
            return False
        del self._rounds[peer]
        return True

    def count(self, peer: str, round: int) -> int:
        """``peer``'s strikes in the window that ends at ``round``."""
        return sum(1 for r in self._rounds.get(peer, ()) if r > round - self.window_rounds)

    def _expire(self, round: int) -> None:
        # Every peer's old strikes go, so strangers that failed once do not accumulate.
        oldest = round - self.window_rounds
        for peer in list(self._rounds):
            kept = [r for r in self._rounds[peer] if r > oldest]
            if kept:
                self._rounds[peer] = kept
            else:
                del self._rounds[peer]
