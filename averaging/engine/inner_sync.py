"""The training thread's side of averaging the inner optimizer's moments with every round.

With ``averaging.average_inner_state`` the moments ride the pseudo-gradient's all-reduce as its
extra vector (why: ``averaging.math.inner_state``): ``snapshot`` copies them into a flat host vector
at the round's end, and ``land`` applies the group's mean at the merge, ``k`` inner steps later.
Every peer of a run must cut the same vector: the layout depends only on the model and which
parameters Muon trains, and the run's manifest carries its hash (``describe``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from averaging.math import inner_state
from averaging.math.flat import FlatLayout

logger = logging.getLogger(__name__)

ADAM_SLOTS = ("exp_avg", "exp_avg_sq")
MUON_SLOTS = ("momentum_buffer",)
# The mean is refused when it is this much larger (RMS) than our own moments: robust aggregation has
# bounded every sender already, so only a broken or hostile reducer's answer gets here.
MAX_MEAN_TO_OWN_RATIO = 100.0


@dataclass(frozen=True, slots=True)
class _Slot:
    key: str  # "<parameter name>.<slot>", as Trainer.inner_state names it
    param: torch.nn.Parameter
    slot: str


class InnerStateSync:
    """Which inner-optimizer moments ride the all-reduce, and how they are read and landed. Built
    from the model before the optimizers exist (the averager forks before the model moves to its
    device), then ``bind`` the optimizers; or both at once (``of``)."""

    def __init__(self, model: torch.nn.Module, *, muon: Iterable[torch.nn.Parameter] = ()):
        muon_ids = {id(p) for p in muon}
        self._slots = tuple(_Slot(f"{name}.{slot}", p, slot)
                            for name, p in model.named_parameters() if p.requires_grad
                            for slot in (MUON_SLOTS if id(p) in muon_ids else ADAM_SLOTS))
        self.layout = FlatLayout.of((s.key, s.param) for s in self._slots)
        self._owner: dict[int, torch.optim.Optimizer] = {}
        self._decays: dict[str, float] = {}

    @classmethod
    def of(cls, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> InnerStateSync:
        """For your own training loop: the model and its inner optimizers (AdamW/Adam, Muon)."""
        muon = [p for o in optimizers if isinstance(o, torch.optim.Muon) for g in o.param_groups for p in g["params"]]
        sync = cls(model, muon=muon)
        sync.bind(optimizers)
        return sync

    @property
    def numel(self) -> int:
        return self.layout.numel

    def describe(self) -> str:
        """A short hash of the layout, for the run's manifest: peers must cut the same vector."""
        return hashlib.sha256(json.dumps(self.layout.describe()).encode()).hexdigest()[:16]

    def bind(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Attach the optimizers that own the moments; each planned slot must be one of its owner's."""
        owner: dict[int, torch.optim.Optimizer] = {}
        for optimizer in optimizers:
            slots = MUON_SLOTS if isinstance(optimizer, torch.optim.Muon) else \
                ADAM_SLOTS if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) else None
            if slots is None:
                raise ValueError(f"averaging the inner state supports AdamW, Adam and Muon, not "
                                 f"{type(optimizer).__name__}")
            for group in optimizer.param_groups:
                for p in group["params"]:
                    owner[id(p)] = optimizer
        for s in self._slots:
            optimizer = owner.get(id(s.param))
            if optimizer is None:
                raise ValueError(f"{s.key}: no inner optimizer trains this parameter")
            if s.slot not in (MUON_SLOTS if isinstance(optimizer, torch.optim.Muon) else ADAM_SLOTS):
                raise ValueError(f"{s.key}: the plan and the optimizer ({type(optimizer).__name__}) disagree")
        self._owner, self._decays = owner, inner_state.decays(optimizers)

    @torch.no_grad()
    def snapshot(self, out: torch.Tensor) -> None:
        """Copy the moments into ``out`` (a host buffer of ``numel``; zeros where none exists yet)."""
        assert self._owner, "bind the optimizers first"
        for s, view in zip(self._slots, self.layout.views(out).values()):
            value = self._owner[id(s.param)].state.get(s.param, {}).get(s.slot)
            if value is None:
                view.zero_()
            else:
                view.copy_(value, non_blocking=False)

    @torch.no_grad()
    def land(self, mean: torch.Tensor, snapshot: torch.Tensor, *, steps: int) -> str | None:
        """Land the group's ``mean`` of the moments ``steps`` inner steps after ``snapshot`` (our own,
        sent); returns why it was refused (nothing changed) or None."""
        problem = check_mean(mean, snapshot)
        if problem is not None:
            return problem
        means, snaps = self.layout.views(mean), self.layout.views(snapshot)
        for s in self._slots:
            value = self._owner[id(s.param)].state.get(s.param, {}).get(s.slot)
            if value is None:  # the optimizer was reset since (a re-sync): nothing of ours to correct
                continue
            landed = inner_state.land(value, snaps[s.key].to(value.device), means[s.key].to(value.device),
                                      decay=self._decays[s.slot], steps=steps,
                                      nonnegative=s.slot in inner_state.NONNEGATIVE)
            value.copy_(landed)
        return None


def check_mean(mean: torch.Tensor, own: torch.Tensor) -> str | None:
    """Why the group's mean of the moments must not land, or None. Non-negative slots are clamped
    when landed; here only what no honest group could return: NaN/inf, or far larger than ours."""
    if not bool(torch.isfinite(mean).all()):
        return "the group's mean of the inner optimizer's moments has NaN/inf values"
    own_rms, mean_rms = float(own.pow(2).mean().sqrt()), float(mean.pow(2).mean().sqrt())
    if own_rms > 0 and mean_rms > MAX_MEAN_TO_OWN_RATIO * own_rms:
        return f"the group's mean of the inner optimizer's moments is {mean_rms / own_rms:.3g}x larger than ours"
    return None
