"""A simulated swarm that runs shoal's own round: every peer holds a real ``SharedState`` and a
``RoundRunner`` with the real kind of round (``WholeSwarm``, or ``SubGroups`` with a ``Mixing`` plan),
and the peers meet in an in-process ``LocalHub`` whose reducers aggregate as real ones do
(``SimHub``). Rounds are driven one at a time: every peer prepares, then every peer runs the round
on a thread of its own (the hub's average blocks until the group is in). The inner training, and the
rules only the simulation runs (``benchmarks.sim.rules``), stay with the caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from averaging.engine.config import LoopConfig
from averaging.engine.recover import Recovery
from averaging.engine.round import RoundJob, RoundRunner, SyncResult
from averaging.engine.subgroups import Mixing, SubGroups
from averaging.engine.whole_swarm import WholeSwarm
from averaging.engine.worker import SyncWorker
from averaging.math import codecs, robust
from averaging.math.flat import FlatLayout
from averaging.math.group_view import GroupView
from averaging.math.groups import balanced_groups
from averaging.math.lattice import HALF
from averaging.math.outer_step import OuterConfig
from averaging.math.wire import LATTICE_CODE, WireFormat, returned
from averaging.network.local import LocalBackend, LocalHub
from averaging.state.shared_state import SharedState
from benchmarks.sim.rules import keep_norm, on_grid
from protocols.schedule import RoundSchedule

PARTS = 4  # parts per all-reduce (a group of four's butterfly): robust aggregation runs per part
SCHEDULE = RoundSchedule(start_time=0.0, round_seconds=1.0)  # round r's deadline is r
TIMEOUT_S = 120.0  # how long a member waits for its group (real seconds; a simulated group forms at once)


def aggregate(sends: list[torch.Tensor], weights: list[float], config: robust.RobustConfig, *, work_scaled: bool,
              norm: bool) -> torch.Tensor:
    """The all-reduce: per part, weights bounded and aggregated as a reducer does (``norm``:
    then rescaled to its senders' length, ``rules.keep_norm``)."""
    bounded = robust.bound_weights(weights, max_ratio=config.max_weight_ratio)
    chunks = [s.chunk(PARTS) for s in sends]
    out = []
    for k in range(len(chunks[0])):
        parts = [c[k] for c in chunks]
        value = robust.aggregate(parts, bounded, config, work_scaled=work_scaled).value
        out.append(keep_norm(value, parts, bounded, clip_ratio=config.clip_ratio)[0] if norm else value)
    return torch.cat(out)


def fp16_parts(values: torch.Tensor) -> torch.Tensor:
    """``values`` as the fp16 code carries them, in ``PARTS`` parts with a scale each."""
    return torch.cat([codecs.decode(codecs.encode(part, "fp16"), max_numel=part.numel())
                      for part in values.chunk(PARTS)])


class SimClock:
    """The engine's clock in a simulation: it reads the current round's deadline, and never waits."""

    def __init__(self):
        self.at = 0.0

    def now(self) -> float:
        return self.at

    def monotonic(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        pass

    def sleep_until(self, when: float) -> None:
        pass

    def wait(self, job: Future):
        return job.result()


class SimHub(LocalHub):
    """``LocalHub``'s meeting, with what a real group's reducers return: the pseudo-gradients
    aggregated per part (``aggregate``) and returned in the wire's return code; the extra vector
    (sub-groups: ``[anchor | momentum]``) without the group view's far members (weight 0, as the
    reducers give them) in the state code (``fp32`` exact, ``fp16`` per part, or the lattice grid
    the group's claims set). Returns what each member got last (``last``: eager's stand-in)."""

    def __init__(self, *, reduce: Callable[[list[torch.Tensor], list[float]], torch.Tensor], return_code: str,
                 min_group_size: int, numel: int, state_code: str = "fp32"):
        # (matchmaking gives up at once on a group that cannot reach min_group_size: a lone member folds)
        super().__init__(min_group_size=min_group_size, matchmaking_s=0.0)
        self.reduce, self.code, self.numel, self.state_code = reduce, return_code, numel, state_code
        self._lock = threading.Lock()
        self._sent: dict[tuple[int, str], dict[str, tuple[torch.Tensor, float]]] = {}
        self._reduced: dict[tuple[int, str], torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}
        self.overflows = 0  # lattice-coded state values beyond half the range from the mean (counted, not simulated)

    def average(self, peer: str, round: int, vector: torch.Tensor, weight: float, gather, timeout: float,
                extra: torch.Tensor | None = None, key: str = "", **view):
        own = vector.clone()
        with self._lock:
            self._sent.setdefault((round, key), {})[peer] = (own, weight)
        result = super().average(peer, round, vector, weight, gather, timeout, extra=extra, key=key, **view)
        if result is None:
            return None
        _, group = result
        with self._lock:
            if (round, key) not in self._reduced:
                sent = self._sent.pop((round, key))
                members = sorted(group.gathered)
                self._reduced[round, key] = self.reduce([sent[p][0] for p in members], [sent[p][1] for p in members])
                self._forget_before(round - 1)
            average = self._reduced[round, key]
        self.last[peer] = mine = returned(average, own, self.code)
        return mine, group

    def extras_back(self, extras: dict[str, torch.Tensor], weights: dict[str, float],
                    view: GroupView | None) -> dict[str, torch.Tensor]:
        """The group's state in the run's state code, the same for every member (the hub's meeting
        computes it once per group)."""
        far = view.far if view is not None else frozenset()
        near = [p for p in extras if p not in far] or list(extras)
        total = sum(weights[p] for p in near)
        if self.state_code == LATTICE_CODE and view is not None and view.lattice is not None:
            grid = view.lattice
            state = on_grid(sum(weights[p] / total * on_grid(extras[p], grid) for p in near), grid)
            half = grid.steps() * HALF
            self.overflows += sum(int(((extras[p].double() - state.double()).abs() > half).sum()) for p in near)
        elif self.state_code == "fp16":  # anchor and momentum each in parts with a power-of-two scale
            halves = [(fp16_parts(extras[p][:self.numel]), fp16_parts(extras[p][self.numel:])) for p in near]
            state = torch.cat([fp16_parts(sum(weights[p] / total * h[k] for p, h in zip(near, halves)))
                               for k in range(2)])
        else:
            state = sum(extras[p] * (weights[p] / total) for p in near)
        return dict.fromkeys(extras, state)

    def _forget_before(self, round: int) -> None:
        """Drop the rounds before ``round`` (LocalHub's tables and ours; caller holds ``_lock``): a unit
        test's hub keeps every round, a simulation of hundreds of rounds cannot."""
        with self._cond:
            for table in (self._prepared, self._arrived, self._results, self._extras):
                for slot in [slot for slot in table if slot[0] < round]:
                    del table[slot]
        for table in (self._sent, self._reduced):
            for slot in [slot for slot in table if slot[0] < round]:
                del table[slot]


@dataclass(slots=True)
class SimPeer:
    id: str
    state: SharedState
    runner: RoundRunner
    correction: torch.Tensor  # the round's merge correction (the runner writes it)


class SimSwarm:
    """``len(tokens)`` peers from one ``anchor``, each running the engine's round over one ``SimHub``;
    ``group_size``: sub-groups of at most that many (round-seeded, ``averaging.math.groups``), in
    ``state_code``; 0: one group of everyone."""

    def __init__(self, *, peers: int, layout: FlatLayout, anchor: torch.Tensor, outer: OuterConfig, wire: WireFormat,
                 reduce: Callable[[list[torch.Tensor], list[float]], torch.Tensor], groups: int = 0,
                 state_code: str = "fp32"):
        self.layout, self.clock = layout, SimClock()
        self.hub = SimHub(reduce=reduce, return_code=wire.return_code, min_group_size=2 if groups else 1,
                          numel=layout.numel, state_code=state_code)
        ids = [f"peer-{i}" for i in range(peers)]
        config = LoopConfig(mode="blocking", inner_steps=1)
        self.peers: list[SimPeer] = []
        for peer_id in ids:
            state = SharedState(layout, anchor, outer)
            backend = LocalBackend(self.hub, peer_id, state.shared_state, state.update_after,
                                   far_state_numel=layout.numel if groups else 0,
                                   lattice=bool(groups) and state_code == LATTICE_CODE)
            worker = SyncWorker(backend, allreduce_timeout=TIMEOUT_S, matchmaking_grace=0.0)
            recovery = Recovery(state=state, backend=backend, schedule=lambda: SCHEDULE, clock=self.clock,
                                download_timeout=TIMEOUT_S)
            common = dict(state=state, outer=outer, wire=wire, recovery=recovery, peer_id=peer_id,
                          alone=lambda: peers == 1)
            if groups:
                plan = lambda r, me=peer_id: (balanced_groups(ids, r, groups)[me], groups)  # noqa: E731
                kind = SubGroups(mixing=Mixing(plan=plan, code=state_code), **common)
            else:
                kind = WholeSwarm(**common)
            runner = RoundRunner(kind=kind, state=state, worker=worker, layout=layout, config=config,
                                 schedule=lambda: SCHEDULE, clock=self.clock, wire=wire, client_mode=False)
            self.peers.append(SimPeer(peer_id, state, runner, layout.new_buffer()))
        self._threads = ThreadPoolExecutor(max_workers=peers, thread_name_prefix="sim-peer")

    def run_round(self, round: int, snapshots: Sequence[torch.Tensor], tokens: Sequence[int]) -> list[SyncResult]:
        """Round ``round`` (from 1) with each peer's parameters at its end (``snapshots``, taken by
        the round's pseudo-gradient) and its tokens; each peer's result, its correction to merge."""
        self.clock.at = SCHEDULE.round_end(round)
        for peer in self.peers:  # every member prepares before anyone averages: the hub knows the groups
            peer.runner.prepare(round)
        jobs = [RoundJob(round=round, tokens=n, snapshot=s, correction_out=peer.correction)
                for peer, s, n in zip(self.peers, snapshots, tokens)]
        return list(self._threads.map(lambda pair: pair[0].runner.run(pair[1]), zip(self.peers, jobs)))

    def set_outer(self, outer: OuterConfig) -> None:
        """Change the outer step's settings for the next rounds (``+mwarm``'s momentum ramp)."""
        for peer in self.peers:
            peer.state.config = peer.runner.kind.outer = outer

    def close(self) -> None:
        self._threads.shutdown()
