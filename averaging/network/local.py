"""An in-process ``AveragingBackend`` for unit tests: threads meet in a ``LocalHub``.

It averages exactly (weighted mean) and gathers every member's report, like a healthy all-reduce
without compression, so engine tests run in milliseconds; with ``return_code`` each member gets
``averaging.math.wire.returned`` instead. A sub-group's extra vectors go as the real reducers take
them, from the group's view: far members left out, the lattice code's residues on its grid.
Integration tests always use the real hivemind backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from averaging.math import lattice
from averaging.math.group_view import GroupView, decode_claims, group_view
from averaging.math.wire import returned
from averaging.network.interface import AverageOutcome, Progress
from averaging.state.served import AppliedUpdate, CheckSlice, DownloadedState
from protocols.messages import MAX_ROUND

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class HubResult:
    """A group's round in the hub: what ``LocalHub.average`` hands each member with its own result."""

    mean: torch.Tensor
    gathered: dict[str, Any]
    extras: dict[str, torch.Tensor] | None  # each member's extra vector back (None: not every member sent one)
    view: GroupView | None  # sub-groups: the group's view


class LocalHub:
    """Where local peers meet: a round completes when every peer that prepared it has arrived.
    ``key`` (the matchmaking bits of a sub-group) splits a round into groups that meet apart."""

    def __init__(self, min_group_size: int = 1, matchmaking_s: float | None = None, return_code: str | None = None):
        self.return_code = return_code  # None: exact results, the same on every member
        self.min_group_size = min_group_size  # like hivemind's: a smaller group keeps waiting...
        # ...until matchmaking gives up (hivemind's min_matchmaking_time): a lone peer then fails
        # fast instead of waiting out the all-reduce timeout. None: wait for the whole timeout.
        self.matchmaking_s = matchmaking_s
        self._cond = threading.Condition()
        # By (round, key): who prepared, who arrived with what, and the results.
        self._prepared: dict[tuple[int, str], set[str]] = {}
        self._arrived: dict[tuple[int, str], dict[str, tuple[torch.Tensor, float, Any]]] = {}
        self._own: dict[tuple[tuple[int, str], str], torch.Tensor] = {}  # what each member sent, for its return error
        self._extras: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # each member's extra vector
        self._results: dict[tuple[int, str], HubResult | None] = {}  # None: a failed round
        self.state_providers: dict[str, Callable[[], tuple[dict, list[torch.Tensor]]]] = {}
        self.update_providers: dict[str, Callable[[int], AppliedUpdate | None]] = {}

    def prepare(self, peer: str, round: int, key: str = "") -> None:
        with self._cond:
            self._prepared.setdefault((round, key), set()).add(peer)

    def average(self, peer: str, round: int, vector: torch.Tensor, weight: float, gather: Any, timeout: float,
                extra: torch.Tensor | None = None, key: str = "", far_state_numel: int = 0,
                lattice_coded: bool = False) -> tuple[torch.Tensor, HubResult] | None:
        """(our result, the group's) or None. ``far_state_numel``: a sub-group's (``LocalBackend``)."""
        round = (round, key)  # (below, "round" is the group's slot: the round and its key)
        deadline = time.monotonic() + timeout
        with self._cond:
            if round in self._results:
                # The round ended without us: its result is not ours (nor is a failure's).
                result = self._results[round]
                return (result.mean, result) if result is not None and peer in result.gathered else None
            if extra is not None:
                self._extras.setdefault(round, {})[peer] = extra.clone()
            self._arrived.setdefault(round, {})[peer] = (vector.clone(), weight, gather)
            if self.return_code is not None:
                self._own[round, peer] = self._arrived[round][peer][0]
            arrived = self._arrived[round]
            if set(arrived) >= self._prepared.get(round, set()) and len(arrived) >= self.min_group_size:
                self._results[round] = self._reduce(arrived, self._extras.pop(round, {}), far_state_numel,
                                                    lattice_coded)
                self._cond.notify_all()
            if self.matchmaking_s is not None:
                deadline = min(deadline, time.monotonic() + self.matchmaking_s) if len(
                    self._prepared.get(round, ())) < self.min_group_size else deadline
            while round not in self._results:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    # Like a real all-reduce, a round somebody gave up on fails for everyone.
                    self._results.setdefault(round, None)
                    self._cond.notify_all()
                    return None
            result = self._results[round]
            own = self._own.pop((round, peer), None)
            if result is None:
                return None
            return (returned(result.mean, own, self.return_code) if own is not None else result.mean), result

    def _reduce(self, arrived: dict[str, tuple[torch.Tensor, float, Any]], extras: dict[str, torch.Tensor],
                far_state_numel: int, lattice_coded: bool) -> HubResult:
        """The group's result: the exact weighted mean, and each member's extra vector as the
        reducers return it (the return code applies to the main vector only)."""
        weights = {p: w for p, (_, w, _) in arrived.items()}
        total = sum(weights.values())
        mean = sum(v * (weights[p] / total) for p, (v, _, _) in arrived.items())
        gathered = {p: g for p, (_, _, g) in arrived.items()}
        view = group_view(decode_claims(gathered, numel=far_state_numel), lattice_coded=lattice_coded) \
            if far_state_numel else None
        back = self.extras_back(extras, weights, view) if extras and set(extras) >= set(arrived) else None
        return HubResult(mean, gathered, back, view)

    def extras_back(self, extras: dict[str, torch.Tensor], weights: dict[str, float],
                    view: GroupView | None) -> dict[str, torch.Tensor]:
        """Each member's extra vector after the all-reduce, as hivemind's reducers return it: the weighted
        mean of the members the group's view does not find far (of all, if none is near); in a
        lattice-coded group, through the members' residues on its grid, which a far member cannot
        decode: it keeps its own values."""
        far = view.far if view is not None else frozenset()
        members = [p for p in extras if p not in far] or list(extras)
        total = sum(weights[p] for p in members)
        if view is None or view.lattice is None:
            mean = sum(extras[p] * (weights[p] / total) for p in members)
            return dict.fromkeys(extras, mean)
        residues = {}
        for p in members:
            residues[p] = extras[p].clone()
            lattice.to_residues_(residues[p], view.lattice)
        sent_back = lattice.returned_residues([residues[p] for p in members], [weights[p] for p in members])
        back = {}
        for p, own in extras.items():
            back[p] = own.clone() if p in far else sent_back.clone()
            if p not in far:
                lattice.from_residues_(back[p], own, view.lattice)
        return back


class LocalBackend:
    def __init__(self, hub: LocalHub, peer_id: str, state_provider: Callable[[], tuple[dict, list[torch.Tensor]]],
                 update_provider: Callable[[int], AppliedUpdate | None] | None = None, *,
                 far_state_numel: int = 0, lattice: bool = False):
        """``far_state_numel``: sub-groups, whose members' claims describe anchors of that many values
        and whose extra vector leads with them; ``lattice``: that state rides the lattice code (as
        ``HivemindBackend``'s ``mixing`` and ``extra_code``)."""
        self.hub, self.peer_id = hub, peer_id
        self._far_state_numel, self._lattice = far_state_numel, lattice
        self._state_provider = state_provider
        hub.state_providers[peer_id] = state_provider
        if update_provider is not None:
            hub.update_providers[peer_id] = update_provider
        self._prepared: dict[int, tuple[dict, dict]] = {}  # round -> (gather, key); prepare runs on another thread
        self._lock = threading.Lock()

    def prepare(self, *, round: int, scheduled_time: float, gather: dict, timeout: float,
                key_bits: str | None = None) -> None:
        key = {"key": key_bits} if key_bits else {}  # (one group: the hub's plain call, as tests' hubs override it)
        self.hub.prepare(self.peer_id, round, **key)
        with self._lock:
            self._prepared = {r: g for r, g in self._prepared.items() if r >= round - 1}
            self._prepared[round] = (gather, key)

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float,
                round: int | None = None, extra: torch.Tensor | None = None,
                keep_partial: bool = False) -> AverageOutcome:
        # (in-process averaging is never partial)
        with self._lock:
            if round is None and self._prepared:
                round = max(self._prepared)
            prepared = self._prepared.pop(round, None)
        if prepared is None:
            return AverageOutcome(ok=False, error="no averaging step was prepared")
        gather, key = prepared
        started = time.perf_counter()
        result = self.hub.average(self.peer_id, round, vector, weight, gather, timeout, extra=extra,
                                  far_state_numel=self._far_state_numel, lattice_coded=self._lattice, **key)
        if result is None:
            return AverageOutcome(ok=False, sync_s=time.perf_counter() - started, error="timed out")
        mean, group = result
        extra_back = group.extras.get(self.peer_id) if group.extras is not None else None
        if extra is not None and (extra_back is None or extra_back.shape != extra.shape):
            return AverageOutcome(ok=False, sync_s=time.perf_counter() - started,
                                  error="the group's members did not all send an extra vector")
        vector.copy_(mean)
        if extra is not None:
            extra.copy_(extra_back)
        return AverageOutcome(ok=True, group=tuple(sorted(group.gathered)), gathered=group.gathered,
                              sync_s=time.perf_counter() - started,
                              far=group.view.far if group.view is not None else None)

    def share_state(self, allowed: bool) -> None:
        if allowed:
            self.hub.state_providers[self.peer_id] = self._state_provider
        else:
            self.hub.state_providers.pop(self.peer_id, None)

    def download_state(self, peers: list[str], *, timeout: float, progress: Progress | None = None,
                       same_state: Callable[[Any, Any], bool] | None = None,
                       max_round: int = MAX_ROUND,
                       check: CheckSlice | None = None,
                       ) -> DownloadedState | None:
        # Whole state from the first known peer whose state passes ``check`` as one slice (one
        # donor: nothing to mix, same_state unused; the round is checked by SharedState.adopt);
        # slicing is the hivemind backend's.
        for peer in peers:
            if peer != self.peer_id and peer in self.hub.state_providers:
                metadata, tensors = self.hub.state_providers[peer]()
                if check is not None:
                    flat = torch.cat([t.flatten() for t in tensors])
                    if (problem := check(0, flat.numel(), metadata, flat)) is not None:
                        logger.warning(f"state of {peer}: {problem}")
                        continue
                if progress is not None:
                    total_bytes = sum(t.numel() * t.element_size() for t in tensors)
                    progress(total_bytes, total_bytes)
                return DownloadedState(peer=peer, metadata=metadata, tensors=tensors, donors=(peer,))
        return None

    def fetch_update(self, peers: list[str], *, rounds_done: int, numel: int,
                     timeout: float) -> AppliedUpdate | None:
        for peer in peers:
            provider = self.hub.update_providers.get(peer) if peer != self.peer_id else None
            update = provider(rounds_done) if provider is not None else None
            if update is not None and update.update.shape == (numel,) and update.rounds_done == rounds_done + 1:
                return AppliedUpdate(update.round, update.rounds_done, update.update.clone())
        return None

    def robustness(self) -> dict[str, int]:
        return {}  # exact in-process averaging: nothing to refuse

    def shutdown(self) -> None:
        pass
