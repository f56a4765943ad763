"""A swarm of hundreds, simulated: round-seeded sub-groups vs one group of everyone (issue 32).

    .venv/bin/python -m benchmarks.sim.scale_sim [--rounds 120] [--quick] [--out benchmarks/results/scale_sim]

An event-level model of shoal's round engine and hivemind's matchmaking. No network, no model:
anchors are vectors in R^d and every figure it writes is simulated. Per round (length ``round_s``):

- **Peers** have a speed from a 1/1.5/2/3 mix (tokens per round, the weights) and a symmetric link
  (Mbit/s, lognormal, median 50, clipped to 10-200). Each ready peer's round adds to its pseudo-gradient
  ``k s_r + sqrt(k) * noise * n_i`` (``k`` its work relative to a mean peer's round, ``s_r`` the round's common
  signal, RMS 1, ``n_i`` its own noise, which persists from round to round with correlation ``noise_corr``):
  more steps, more signal and relatively less noise. ``noise`` and ``noise_corr`` are measured on real
  pseudo-gradients (``--measure-noise``).
- **Live count.** Each peer reads the DHT's progress records a little before the deadline (uniform in the
  last heartbeat, 5 s): a joiner's record shows up ``join_visible_s`` after it joins, a leaver's lingers
  ``record_ttl_s`` (shoal: 3 missed heartbeats, 15 s), each record is missed with ``record_miss``. From that
  count every peer derives its own group count (``averaging.math.groups``: ``group_count`` raw,
  ``settled_group_count`` with its own last count, or ``agreed_group_count`` from the counts the records
  published) and its key: ``group_key_bits(round, group, count)``, its group by its rank among the records
  it sees in the round's hash order (``assign balanced``: ``averaging.math.groups.balanced_groups``, what
  the engine does) or by the hash's top bits alone (``assign hashed``: ``group_of``, the first rule).
- **Matchmaking.** Peers with the same key meet. hivemind's leaders assemble as soon as they hold
  ``target_group_size`` peers: the engine gives hivemind no target with sub-groups, so the cap is
  shoal's 64 (``leader_slack`` None); with ``leader_slack`` the cap is ``ceil(G * leader_slack)`` and a key's
  peers split greedily (arrival order random) into groups of the cap and a remainder (the first
  simulation's model: cap G). A peer alone (below min_group_size 2) misses the round. Each peer also misses matchmaking
  with probability ``miss``. A missed or failed round folds: the anchor stays, the pseudo-gradient and weight
  carry into the next contribution.
- **All-reduce.** A group of g takes ``1.12 * 2 * bytes * (g - 1) / g / (slowest member's link)`` (shoal's
  parts are equal shares whatever the bandwidth; 1.12: a 3-peer butterfly all-reduce of 100 MB at 100 Mbit/s took 12.0 s
  against its 10.7 s bandwidth bound, docs/hivemind.md) and must end
  within the round (``round_s - matchmaking_s``). A peer whose own link cannot carry a full group's share in
  that time stays out (``link-bound``, the engine's stay-out policy), so it never spoils a group. A member
  that leaves between matchmaking and the end of its all-reduce spoils the round for its group (shoal
  refuses partial results).
- **Churn.** Leaves at ``churn`` per hour per 100 live peers, joins at the same rate per 100 of the initial
  size (so the swarm hovers around it). A joiner downloads the fp32 anchor and momentum (8 bytes a value)
  at its link, from a random ready donor, starts from the donor's state as it was when the download began,
  trains from the next half round on, and (``catch_up``) replays the donor's changes since, if at most 4
  rounds (the history shoal keeps) and the donor is still there.
- **Sub-groups** (``mode groups``) average, in one all-reduce, the pseudo-gradients, anchors and outer
  momentum (weighted by tokens, as one hivemind step weighs every tensor alike), then apply shoal's outer
  Nesterov step (``averaging.math.outer_step.outer_step_``, lr 1.0 / momentum 0.5: shoal's defaults).
  Anchors travel as an int8 lattice code around each member's own anchor (``anchor_codec lattice8``: 1 byte a
  value, the grid ``2 * lattice_range / 256`` RMS pseudo-gradients, every member decodes the same average;
  a member further than the range cannot and re-syncs) or in fp16 (2 bytes, rounding not modelled).
  A member further than ``outlier_tol`` pseudo-gradients from its group's anchor sends weight 0 for the
  anchor and adopts the group's. ``anchor_slices K`` averages anchor and momentum on 1/K of the values a round.
  A member that folded keeps its anchor weight by default (its anchor, a step behind, and its folded
  pseudo-gradient, a round ahead, offset each other; ``fresh_anchors_only`` measured the other way).
  ``salvage_partial``: a leaver mid-all-reduce costs its group only the leaver's part (those values fold, the
  rest of the round stands) instead of the whole round; ``graceful``: the share of leavers that let a sync in
  flight land before leaving (shoal's Ctrl+C does; a crash or a dropped link does not).
- **One key per round** (today). ``mode one-key-cap``: since commit 587cdb4 the backend gives hivemind a
  target size of at most shoal's group cap of 64 (``leader_group_cap``), so hivemind's leaders split the one
  key into groups of 64 that average only pseudo-gradients, and shoal's consistency check does the rest
  (members further than 0.25 x RMS of the averaged pseudo-gradient from the group's most common anchor catch
  up if that anchor is 1-2 of the winner's steps ahead, else re-sync: a full download). ``mode one-key``:
  before 587cdb4 (``target_group_size`` 0): hivemind's leader took everybody, and every member refused a
  group over 64 (``allreduce.vet_group``), so no round completed past 64 peers.

Measured per round: the share of eligible peers (live, trained since the half round, not link-bound) whose
round completed; all-reduce times; the anchor spread (max over training peers of RMS(anchor_i - swarm mean)
/ RMS(averaged pseudo-gradient); tolerance 0.25); how many group members arrive further than the tolerance
from their group's anchor (today's check would fire). Twin runs (same draws, one with a change: a joiner k
rounds stale, one failed group) measure the rounds until the disagreement the change caused is below the
tolerance. ``--measure-noise`` measures the noise-to-signal of real pseudo-gradients on
``benchmarks.sim.speedup``'s simulated peers (the default ``noise`` comes from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from averaging.math.codecs import bytes_per_value
from averaging.math.groups import (
    agreed_group_count,
    group_among,
    group_count,
    group_key_bits,
    group_of,
    round_hash,
    settled_group_count,
)
from averaging.math.outer_step import outer_step_
from benchmarks.common.results import CONFIGS, RESULTS, command_line, write_results

TOL = 0.25  # shoal's rel_tol: anchors agree within 0.25 x RMS of the last averaged pseudo-gradient
MAX_GROUP = 64  # shoal's RobustConfig.max_group_size: every member refuses a bigger group
MIN_GROUP = 2
HISTORY_ROUNDS = 4  # outer updates a peer keeps for catch-up
SPEEDS = (1.0, 1.5, 2.0, 3.0)
ALLREDUCE_OVER_BOUND = 1.12  # 12.0 s measured vs a 10.7 s bandwidth bound (docs/hivemind.md)


@dataclasses.dataclass(kw_only=True)
class Scenario:
    label: str
    peers: int
    mode: str = "groups"  # groups | one-key | one-key-cap
    group_size: int = 16
    leader_slack: float | None = None  # hivemind target_group_size = ceil(group_size * leader_slack); None: 64
    assign: str = "balanced"  # balanced (ranks in each peer's view of the records) | hashed (group_of)
    count_rule: str = "agreed"  # raw | settled | agreed
    churn: float = 5.0  # leaves (and joins) per hour per 100 peers
    rounds: int = 120
    round_s: float = 300.0
    matchmaking_s: float = 3.0
    params: float = 150e6
    pg_code: str = "int4"
    anchor_codec: str = "lattice8"  # lattice8 | fp16 | none (sub-groups that average pseudo-gradients only)
    lattice_range: float = 32.0  # half-range of the lattice code, in RMS averaged pseudo-gradients
    anchor_slices: int = 1
    avg_momentum: bool = True
    anchor_weights: str = "tokens"  # tokens | equal
    outlier_tol: float = 2.0
    # a member that did not complete its last round sends anchor weight 0 (off: its anchor, one step behind,
    # and its folded pseudo-gradient, one round ahead, offset each other)
    fresh_anchors_only: bool = False
    graceful: float = 0.0  # share of leavers that let a sync in flight land first (Ctrl+C does)
    salvage_partial: bool = False  # a leaver costs its group only its own part of the round (see apply_round)
    catch_up: bool = True
    miss: float = 0.03
    noise: float = 0.75
    noise_corr: float = 0.47  # a peer's own noise persists: n_r = c n_{r-1} + sqrt(1 - c^2) z (measured: main)
    lr: float = 1.0
    mu: float = 0.5
    dim: int = 256
    speeds: tuple[float, ...] = SPEEDS
    link_median: float = 50.0
    link_sigma: float = 0.8
    join_visible_s: float = 10.0
    record_ttl_s: float = 15.0
    heartbeat_s: float = 5.0
    record_miss: float = 0.01
    seed: int = 0
    event: str = ""  # twin runs: "stale1", "stale3", "failgroup" at round event_round (no churn, no misses)
    event_round: int = 8

    @property
    def cap(self) -> int:
        if self.mode == "one-key":
            return 1 << 30
        if self.mode == "one-key-cap" or self.leader_slack is None:
            return MAX_GROUP
        return math.ceil(self.group_size * self.leader_slack)

    def bytes_per_param(self) -> float:
        sent = bytes_per_value(self.pg_code)
        if self.mode == "groups" and self.anchor_codec != "none":
            per_tensor = 1.0 if self.anchor_codec == "lattice8" else bytes_per_value(self.anchor_codec)
            sent += per_tensor * (2 if self.avg_momentum else 1) / self.anchor_slices
        return sent


class Swarm:
    """Every peer's state in arrays indexed by slot (joiners take new slots)."""

    def __init__(self, s: Scenario):
        self.s = s
        self.rng = np.random.default_rng(s.seed)
        # separate streams, so that a twin run with one change draws the same signal, noise and churn
        self.rng_signal, self.rng_noise, self.rng_miss, self.rng_mm = (
            np.random.default_rng([s.seed, k]) for k in range(1, 5))
        cap = s.peers + int(4 * s.churn / 100 * s.peers * s.rounds * s.round_s / 3600) + 16
        self.cap, self.n = cap, s.peers
        self.ids = [f"12D3KooW{s.seed:02d}{i:06d}" for i in range(cap)]
        self.speed = self.rng.choice(s.speeds, size=cap)
        self.link = np.clip(s.link_median * np.exp(s.link_sigma * self.rng.standard_normal(cap)), 10, 200)
        self.join_t = np.full(cap, np.inf)
        self.join_t[: s.peers] = -1e9
        self.leave_t = np.full(cap, np.inf)
        self.ready_t = np.full(cap, np.inf)
        self.ready_t[: s.peers] = -1e9
        self.anchor = np.zeros((cap, s.dim))
        self.momentum = np.zeros((cap, s.dim))
        self.pg = np.zeros((cap, s.dim))
        self.weight = np.zeros(cap)
        self.count = np.zeros(cap, dtype=np.int64)  # the group count a peer used last (published); 0 = none
        # a swarm that grew to its size: every peer used the count of its size (not the raw count of its
        # first, lagging estimate, which at a boundary such as 256 = 16 x 16 could be either)
        self.count[: s.peers] = group_count(s.peers, s.group_size) if s.mode == "groups" else 1
        self.donor = np.full(cap, -1)
        self.snap_round = np.zeros(cap, dtype=np.int64)
        self.pending = np.zeros(cap, dtype=bool)  # joined, not yet in a round (catch-up due)
        self.fresh = np.zeros(cap, dtype=bool)  # completed its last round (or caught up since)
        self.fresh[: s.peers] = True
        self.past = np.zeros((cap, 3, s.dim))  # the anchors entering the last 3 rounds (today's catch-up)
        self.graceful = self.rng.random(cap) < s.graceful
        self.history: list[np.ndarray] = []  # slot 0's anchors (twin events)
        budget = s.round_s - s.matchmaking_s
        group = min(s.cap, s.peers, s.group_size) if s.mode == "groups" and s.group_size else min(s.cap, s.peers)
        share = 2 * s.params * s.bytes_per_param() * 8 * (group - 1) / group
        self.link_bound = ALLREDUCE_OVER_BOUND * share / (self.link * 1e6) > budget
        self.tol_ref = 1.0
        self.noise = self.rng_noise.standard_normal((cap, s.dim))

    def alive(self, t: float) -> np.ndarray:
        return (self.join_t[: self.n] <= t) & (self.leave_t[: self.n] > t)

    def download_s(self, slot: int) -> float:
        return ALLREDUCE_OVER_BOUND * self.s.params * 8 * 8 / (self.link[slot] * 1e6)

    def start_download(self, slot: int, donor: int, t: float, round: int, anchor=None, momentum=None) -> None:
        self.anchor[slot] = self.anchor[donor] if anchor is None else anchor
        self.momentum[slot] = self.momentum[donor] if momentum is None else momentum
        self.count[slot] = self.count[donor]
        self.pg[slot], self.weight[slot] = 0.0, 0.0
        self.donor[slot], self.snap_round[slot], self.pending[slot] = donor, round, True
        self.fresh[slot] = False
        self.ready_t[slot] = t + self.download_s(slot)


def run(s: Scenario, keep_anchors: tuple[int, int] | None = None) -> dict:
    """One simulated run; per-round records. ``keep_anchors`` (first, last round): also return the anchors."""
    sw, T = Swarm(s), s.round_s
    rate = s.churn / 100 / 3600  # per peer per second
    budget = T - s.matchmaking_s
    bytes_sent = s.params * s.bytes_per_param()
    rounds, kept = [], {}
    join_rate = 0.0 if s.event else rate * s.peers
    leave_rate = 0.0 if s.event else rate
    miss = 0.0 if s.event else s.miss
    pending_leaves: list[tuple[float, int]] = []
    for r in range(1, s.rounds + 1):
        D = r * T
        rec: dict = {"round": r}
        signal = sw.rng_signal.standard_normal(s.dim)
        sw.noise = s.noise_corr * sw.noise + math.sqrt(1 - s.noise_corr ** 2) * sw.rng_noise.standard_normal(
            (sw.cap, s.dim))
        noise = sw.noise
        missed = sw.rng_miss.random(sw.cap) < miss
        # -- churn: joins in (D - T, D]; leaves for (D, D + T] drawn now (they can spoil this round's all-reduce)
        for t in np.sort(D - T + T * sw.rng.random(sw.rng.poisson(join_rate * T))):
            donors = np.flatnonzero(sw.alive(t) & (sw.ready_t[: sw.n] <= t) & ~sw.link_bound[: sw.n]
                                    & ~sw.pending[: sw.n])
            if sw.n >= sw.cap or len(donors) == 0:
                continue
            slot, sw.n = sw.n, sw.n + 1
            sw.join_t[slot] = t
            sw.start_download(slot, int(sw.rng.choice(donors)), t, r - 1)
        for t, slot in pending_leaves:
            sw.leave_t[slot] = t
        live_now = np.flatnonzero(sw.alive(D) & np.isinf(sw.leave_t[: sw.n]))
        n_leave = min(sw.rng.poisson(leave_rate * len(live_now) * T), len(live_now))
        pending_leaves = [(D + T * sw.rng.random(), int(v)) for v in sw.rng.choice(live_now, n_leave, replace=False)]
        upcoming = {slot: t for t, slot in pending_leaves}

        def leave_at(slot: int, upcoming=upcoming) -> float:
            return min(sw.leave_t[slot], upcoming.get(slot, np.inf))
        # -- work: every ready peer trains until the deadline
        n = sw.n
        training = sw.alive(D) & (sw.ready_t[:n] < D) & ~sw.link_bound[:n]
        frac = np.clip((D - np.maximum(sw.ready_t[:n], D - T)) / T, 0, 1) * training
        k = sw.speed[:n] / np.mean(s.speeds) * frac
        sw.pg[:n] += k[:, None] * signal + np.sqrt(k)[:, None] * s.noise * noise[:n]
        sw.weight[:n] += k
        eligible = np.flatnonzero(sw.alive(D - s.matchmaking_s) & (sw.ready_t[:n] <= D - T / 2) & ~sw.link_bound[:n])
        holding = int((sw.alive(D - s.matchmaking_s) & (sw.ready_t[:n] <= D - s.matchmaking_s)).sum())
        # -- catch-up of joiners before their first round
        for slot in eligible[sw.pending[eligible]]:
            donor = sw.donor[slot]
            stale = r - 1 - sw.snap_round[slot]
            limit = HISTORY_ROUNDS if s.mode == "groups" else 2
            if stale == 0 or (s.catch_up and 0 < stale <= limit and leave_at(donor) > D - T
                              and not sw.pending[donor]):
                sw.anchor[slot], sw.momentum[slot] = sw.anchor[donor], sw.momentum[donor]
                sw.fresh[slot] = True
            sw.pending[slot] = False
        if s.event.startswith("stale") and r == s.event_round:
            lag = int(s.event.removeprefix("stale"))
            sw.anchor[0] = sw.history[-lag][0]
            sw.momentum[0] = sw.history[-lag][1]
        sw.history = (sw.history + [(sw.anchor[0].copy(), sw.momentum[0].copy())])[-HISTORY_ROUNDS:]
        sw.past[:n, 1:] = sw.past[:n, :-1]
        sw.past[:n, 0] = sw.anchor[:n]
        # -- live counts and group counts, each peer from its own view of the records
        groups_of, ranks, views = count_groups(sw, s, eligible, D, rec, r)
        # -- matchmaking
        participants = [int(p) for p in eligible if not missed[p]]
        keys: dict[str, list[int]] = {}
        for p in participants:
            g = groups_of[p]
            group = group_of(sw.ids[p], r, g) if s.assign == "hashed" else ranks[p] * g // views[p]
            keys.setdefault(group_key_bits(r, group, g), []).append(p)
        formed, alone = [], 0
        for members in keys.values():
            order = [members[i] for i in sw.rng_mm.permutation(len(members))]
            for start in range(0, len(order), s.cap):
                chunk = order[start: start + s.cap]
                if len(chunk) < MIN_GROUP:
                    alone += len(chunk)
                else:
                    formed.append(chunk)
        # -- all-reduce and outer step
        done, fails, times, fired, arrived, overflow, completed = 0, Counter(), [], 0, 0, 0, []
        rms_avg = []
        for members in formed:
            g = len(members)
            seconds = ALLREDUCE_OVER_BOUND * 2 * bytes_sent * 8 * (g - 1) / g / (min(sw.link[members]) * 1e6)
            arrived += g
            if s.mode == "one-key" and g > MAX_GROUP:
                fails["refused (group > 64)"] += g
                continue
            if seconds > budget:
                fails["too slow"] += g
                continue
            gone = [i for i, p in enumerate(members) if leave_at(p) <= D + seconds and not sw.graceful[p]]
            lost = None
            if gone and (not s.salvage_partial or g - len(gone) < MIN_GROUP):
                fails["member left"] += g
                continue
            if gone:  # the leavers' parts fold for everyone; the rest of the round stands
                lost = np.isin(np.arange(s.dim) % g, gone)
                fails["member left"] += len(gone)
                members = [p for i, p in enumerate(members) if i not in gone]
                g = len(members)
            if s.event == "failgroup" and r == s.event_round and 0 in members:
                fails["failed (event)"] += g
                continue
            fired_here, over = apply_round(sw, s, members, r, D, lost)
            fired, overflow = fired + fired_here, overflow + over
            times.append(seconds)
            done += g
            completed.extend(members)
            rms_avg.append(float(np.sqrt(np.mean(sw.last_average ** 2))))
        if rms_avg:
            sw.tol_ref = statistics.fmean(rms_avg)
        fails["missed matchmaking"] += int(sum(missed[p] for p in eligible))
        fails["alone in its key"] += alone
        sw.count[eligible] = [groups_of[p] for p in eligible]
        sw.fresh[eligible] = False
        sw.fresh[completed] = ~sw.pending[completed]  # a member that re-syncs is not fresh
        # -- metrics
        alive_end = sw.alive(D)
        holders = np.flatnonzero(alive_end & (sw.ready_t[:n] <= D) & ~sw.link_bound[:n]
                                 & ~(sw.pending[:n] & s.catch_up))
        mean = sw.anchor[holders].mean(axis=0)
        dev = np.sqrt(np.mean((sw.anchor[holders] - mean) ** 2, axis=1)) / sw.tol_ref
        current = np.array(sorted(set(completed) & set(holders.tolist())), dtype=np.int64)
        dev_done = (np.sqrt(np.mean((sw.anchor[current] - sw.anchor[current].mean(axis=0)) ** 2, axis=1))
                    / sw.tol_ref) if len(current) > 1 else np.zeros(1)
        rec.update(live=int(alive_end.sum()), eligible=len(eligible), completed=done,
                   share=done / max(1, len(eligible)),
                   share_of_live=done / max(1, int(alive_end.sum())),
                   share_of_holders=done / max(1, holding),
                   link_bound=int((alive_end & sw.link_bound[:n]).sum()),
                   downloading=int((alive_end & (sw.ready_t[:n] > D)).sum()),
                   groups=len(formed), group_sizes=sorted(len(m) for m in formed),
                   allreduce_s=times, fails=dict(fails), spread=float(dev.max()) if len(dev) else 0.0,
                   spread_done=float(dev_done.max()), off_tol=float((dev > TOL).mean()) if len(dev) else 0.0,
                   check_fires=fired / max(1, arrived), lattice_overflow=overflow, tol_ref=sw.tol_ref)
        rounds.append(rec)
        if keep_anchors and keep_anchors[0] <= r <= keep_anchors[1]:
            kept[r] = (holders.copy(), sw.anchor[holders].copy(), sw.tol_ref)
    return {"scenario": dataclasses.asdict(s), "rounds": rounds, "anchors": kept}


def count_groups(sw: Swarm, s: Scenario, eligible: np.ndarray, D: float, rec: dict,
                 r: int) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Each eligible peer's group count from its own (lagging) view of the records, its rank among the
    records it sees in round ``r``'s hash order (``balanced_groups``' order), and how many it sees."""
    if s.mode != "groups" or s.group_size == 0:
        return {int(p): 1 for p in eligible}, {int(p): 0 for p in eligible}, {int(p): 1 for p in eligible}
    n = sw.n
    read = D - s.matchmaking_s - s.heartbeat_s * sw.rng_mm.random(len(eligible))
    seen = ((sw.join_t[:n][None, :] + s.join_visible_s <= read[:, None])
            & (sw.leave_t[:n][None, :] + s.record_ttl_s > read[:, None])
            & (sw.rng_mm.random((len(eligible), n)) >= s.record_miss))
    seen[np.arange(len(eligible)), eligible] = True  # a peer always counts itself
    estimates = seen.sum(axis=1)
    out = {}
    if s.count_rule == "agreed":
        values = np.array(sorted({int(c) for c in sw.count[:n] if c > 0}) or [0])
        tallies = seen.astype(np.int64) @ (sw.count[:n][:, None] == values[None, :]).astype(np.int64)
        for i, p in enumerate(eligible):
            if tallies[i].max() == 0:
                out[int(p)] = group_count(int(estimates[i]), s.group_size)
            else:  # agreed_group_count's rule on the tallies (the same function, spot-checked below)
                current = int(values[np.flatnonzero(tallies[i] == tallies[i].max())[0]])
                out[int(p)] = settled_group_count(int(estimates[i]), s.group_size, current)
        if len(eligible):
            i = 0
            published = [int(c) for c in sw.count[:n][seen[i]] if c > 0]
            assert agreed_group_count(published, int(estimates[0]), s.group_size) == out[int(eligible[0])]
    else:
        for i, p in enumerate(eligible):
            if s.count_rule == "raw":
                out[int(p)] = group_count(int(estimates[i]), s.group_size)
            else:
                out[int(p)] = settled_group_count(int(estimates[i]), s.group_size, int(sw.count[p]) or None)
    # ranks: each row's records in the round's hash order (ties by id, as balanced_groups), counted up to the peer
    order = sorted(range(n), key=lambda q: (round_hash(sw.ids[q], r), sw.ids[q]))
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    before = np.cumsum(seen[:, order], axis=1)
    ranks = {int(p): int(before[i, position[p]]) - 1 for i, p in enumerate(eligible)}
    if len(eligible):  # spot-check against the engine's function
        view = [sw.ids[q] for q in np.flatnonzero(seen[0])]
        assert ranks[int(eligible[0])] * 4 // len(view) == group_among(sw.ids[eligible[0]], view, r, 4)
    counts = Counter(out.values())
    top = counts.most_common(1)[0][0] if counts else 1
    rec.update(estimate_min=int(estimates.min()) if len(eligible) else 0,
               estimate_max=int(estimates.max()) if len(eligible) else 0,
               counts=dict(counts), off_plurality=sum(v for c, v in counts.items() if c != top) / max(1, len(out)))
    return out, ranks, {int(p): int(estimates[i]) for i, p in enumerate(eligible)}


def apply_round(sw: Swarm, s: Scenario, members: list[int], r: int, D: float,
                lost: np.ndarray | None = None) -> tuple[int, int]:
    """A group's successful round; returns (members today's check would flag, lattice overflows). ``lost``:
    the values whose reducer left (``salvage_partial``): anchors and momentum stay, pseudo-gradients fold."""
    idx = np.array(members)
    before = (sw.anchor[idx].copy(), sw.momentum[idx].copy(), sw.pg[idx].copy())
    w = sw.weight[idx]
    average = (w[:, None] * sw.pg[idx]).sum(axis=0) / w.sum()
    sw.last_average = average
    anchors, momenta = sw.anchor[idx].copy(), sw.momentum[idx].copy()
    tol = TOL * sw.tol_ref
    resync = np.zeros(len(idx), dtype=bool)
    if s.mode == "groups":
        aw = w.copy() if s.anchor_weights == "tokens" else np.ones(len(idx))
        center = (aw[:, None] * anchors).sum(axis=0) / aw.sum()
        dev = np.sqrt(np.mean((anchors - center) ** 2, axis=1))
        fired = int((dev > tol).sum())
        if s.anchor_codec != "none":
            if s.anchor_codec == "lattice8":  # max |x| over P values vs over d: a member beyond the range re-syncs
                peak = math.sqrt(2 * math.log(s.params)) / math.sqrt(2 * math.log(s.dim))
                resync = np.abs(anchors - center).max(axis=1) * peak > s.lattice_range * sw.tol_ref
            aw[(dev > s.outlier_tol * sw.tol_ref) | resync] = 0.0
            if s.fresh_anchors_only:
                aw[~sw.fresh[idx]] = 0.0
            if aw.sum() == 0:
                aw[:] = 1.0
            part = (np.arange(s.dim) % s.anchor_slices) == (r % s.anchor_slices)
            mean_anchor = ((aw[:, None] * anchors).sum(axis=0) / aw.sum())[part]
            mean_momentum = ((aw[:, None] * momenta).sum(axis=0) / aw.sum())[part]
            if s.anchor_codec == "lattice8":  # the average on the shared grid: every member decodes the same
                step = 2 * s.lattice_range * sw.tol_ref / 256
                mean_anchor, mean_momentum = np.round(mean_anchor / step) * step, np.round(mean_momentum / step) * step
            anchors[:, part] = mean_anchor
            if s.avg_momentum:
                momenta[:, part] = mean_momentum
    else:  # today's check: the most common anchor wins; 1-2 steps behind it catch up, the rest re-sync
        close = np.sqrt(np.mean((anchors[:, None, :] - anchors[None, :, :]) ** 2, axis=2)) <= tol
        winner = int(np.argmax(close.sum(axis=1)))
        losers = ~close[winner]
        fired = int(losers.sum())
        for i in np.flatnonzero(losers):
            behind = np.sqrt(np.mean((sw.past[idx[winner], 1:] - anchors[i]) ** 2, axis=1)) <= tol
            if behind.any():  # catch-up: replay the winner's last steps (fp16 updates, no download)
                anchors[i], momenta[i] = anchors[winner], momenta[winner]
            else:
                resync[i] = True
    anchor_t, momentum_t = torch.from_numpy(anchors), torch.from_numpy(momenta)
    outer_step_(anchor_t, torch.from_numpy(average), momentum_t, lr=s.lr, mu=s.mu)  # shoal's outer step
    sw.anchor[idx], sw.momentum[idx] = anchor_t.numpy(), momentum_t.numpy()
    sw.pg[idx], sw.weight[idx] = 0.0, 0.0
    if lost is not None:
        for array, old in zip((sw.anchor, sw.momentum, sw.pg), before):
            kept = array[idx]
            kept[:, lost] = old[:, lost]
            array[idx] = kept
    for slot in idx[resync]:  # re-sync: download from an agreeing member, absent meanwhile
        donor = int(idx[~resync][0]) if (~resync).any() else int(slot)
        sw.start_download(int(slot), donor, D, r)
    return fired, int(resync.sum()) if s.mode == "groups" else 0


# -- reporting ------------------------------------------------------------------------------------

WARMUP = 5  # rounds left out of the steady-state figures


def summarize(result: dict) -> dict:
    rounds = result["rounds"][WARMUP:]
    share = [r["share"] for r in rounds]
    times = [t for r in rounds for t in r["allreduce_s"]]
    spread = [r["spread"] for r in rounds]
    spread_done = [r["spread_done"] for r in rounds]
    fails = Counter()
    for r in rounds:
        fails.update(r["fails"])
    over, episodes = 0, []
    for value in spread:
        if value > TOL:
            over += 1
        elif over:
            episodes.append(over)
            over = 0
    if over:
        episodes.append(over)
    eligible = sum(r["eligible"] for r in rounds)
    return {
        "share_mean": statistics.fmean(share), "share_min": min(share),
        "share_of_live_mean": statistics.fmean(r["share_of_live"] for r in rounds),
        "live_mean": statistics.fmean(r["live"] for r in rounds),
        "link_bound_mean": statistics.fmean(r["link_bound"] for r in rounds),
        "group_size_mean": statistics.fmean(s for r in rounds for s in r["group_sizes"]) if times else 0.0,
        "allreduce_median_s": statistics.median(times) if times else None,
        "allreduce_p95_s": float(np.percentile(times, 95)) if times else None,
        "spread_median": statistics.median(spread), "spread_p95": float(np.percentile(spread, 95)),
        "spread_done_median": statistics.median(spread_done), "spread_done_p95": float(np.percentile(spread_done, 95)),
        "share_of_holders_mean": statistics.fmean(r["share_of_holders"] for r in rounds),
        "share_of_holders_min": min(r["share_of_holders"] for r in rounds),
        "off_tol_mean": statistics.fmean(r["off_tol"] for r in rounds),
        "spread_max": max(spread), "rounds_within_tol": sum(v <= TOL for v in spread) / len(spread),
        "episode_mean": statistics.fmean(episodes) if episodes else 0.0,
        "episode_max": max(episodes) if episodes else 0,
        "check_fires": statistics.fmean(r["check_fires"] for r in rounds),
        "off_plurality": statistics.fmean(r.get("off_plurality", 0.0) for r in rounds),
        "fail_shares": {k: v / max(1, eligible) for k, v in fails.items()},
        "lattice_overflow": sum(r["lattice_overflow"] for r in rounds),
    }


def twin(s: Scenario) -> dict:
    """Rounds until the disagreement a change caused falls below the tolerance (same draws, with and without)."""
    window = (s.event_round, s.rounds)
    base = run(dataclasses.replace(s, event=s.event, event_round=10 ** 9), keep_anchors=window)["anchors"]
    changed = run(s, keep_anchors=window)["anchors"]
    curve = []
    for r in range(*window):
        (slots_b, a_b, _), (slots_c, a_c, tol_ref) = base[r], changed[r]
        common, ib, ic = np.intersect1d(slots_b, slots_c, return_indices=True)
        diff = a_c[ic] - a_b[ib]
        diff -= diff.mean(axis=0)  # the whole swarm moving together is no disagreement
        curve.append(float(np.sqrt(np.mean(diff ** 2, axis=1)).max() / tol_ref) if len(common) else 0.0)
    above = [i for i, v in enumerate(curve) if v > TOL]
    agreed = (above[-1] + 2 if above else 1) if not above or above[-1] < len(curve) - 1 else None  # stays within
    return {"scenario": dataclasses.asdict(s), "disagreement": curve, "rounds_to_agree": agreed}


def _job(item: tuple[str, Scenario]) -> tuple[str, dict]:
    torch.set_num_threads(1)
    kind, s = item
    started = time.time()
    if kind == "twin":
        out = twin(s)
    elif kind == "crosscheck":
        rounds = run(s)["rounds"]
        out = {"scenario": dataclasses.asdict(s),
               "spread_all_median": statistics.median(r["spread"] for r in rounds[len(rounds) // 2:])}
    else:
        result = run(s)
        out = {"scenario": dataclasses.asdict(s), **summarize(result),
               "per_round": [{k: r[k] for k in ("round", "share", "spread", "spread_done", "live")}
                             for r in result["rounds"]]
               if s.peers == 256 else None}
    print(f"{kind} {s.label}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    return kind, out


MAIN = (("one key, no cap (before 587cdb4)", dict(mode="one-key")),
        ("one key, hivemind cap 64 (today)", dict(mode="one-key-cap")),
        ("sub-groups G=16", dict(group_size=16)), ("sub-groups G=8", dict(group_size=8)),
        ("sub-groups G=16, partial results kept", dict(group_size=16, salvage_partial=True)))
SENSITIVITY = {
    "count rule raw": dict(count_rule="raw"), "count rule settled": dict(count_rule="settled"),
    "hashed groups (the first rule)": dict(assign="hashed"),
    "hashed groups, leader cap G (the first simulation)": dict(assign="hashed", leader_slack=1.0),
    "leader cap G": dict(leader_slack=1.0), "leader cap 1.5 G": dict(leader_slack=1.5), "G=32": dict(group_size=32),
    "anchors fp16 (state_compression fp16)": dict(anchor_codec="fp16"),
    "partial kept + anchors fp16 (state_compression fp16)": dict(salvage_partial=True, anchor_codec="fp16"),
    "anchors fp32 (the engine before fp16; delta-return runs)": dict(anchor_codec="fp32"),
    "partial kept + anchors fp32": dict(salvage_partial=True, anchor_codec="fp32"),
    "anchors on 1/4 of the values a round": dict(anchor_slices=4),
    "no momentum averaging": dict(avg_momentum=False), "anchors weighted equally": dict(anchor_weights="equal"),
    "stale anchors weight 0": dict(fresh_anchors_only=True), "no catch-up": dict(catch_up=False),
    "no anchor averaging": dict(anchor_codec="none"), "noise 0": dict(noise=0.0), "noise 0.5": dict(noise=0.5),
    "noise 1": dict(noise=1.0), "noise 2": dict(noise=2.0), "no churn, no misses": dict(churn=0.0, miss=0.0),
    "miss 0%": dict(miss=0.0), "half the leavers graceful": dict(graceful=0.5),
    "partial results kept": dict(salvage_partial=True),
    "partial kept + anchors on 1/4 a round": dict(salvage_partial=True, anchor_slices=4),
    "rounds 60 s": dict(round_s=60.0), "rounds 600 s": dict(round_s=600.0),
    "partial kept + rounds 600 s": dict(salvage_partial=True, round_s=600.0),
    "record TTL 2 rounds": dict(record_ttl_s=600.0), "params 50M": dict(params=50e6),
    "partial kept + params 50M": dict(salvage_partial=True, params=50e6),
}
TWINS = (("one key (today)", dict(mode="one-key-cap")), ("sub-groups G=16", dict(group_size=16)),
         ("sub-groups G=8", dict(group_size=8)), ("sub-groups G=16, anchors 1/4 a round",
                                                 dict(group_size=16, anchor_slices=4)))


def plan(args) -> list[tuple[str, Scenario]]:
    base = dict(rounds=args.rounds, seed=args.seed, noise=args.noise, noise_corr=args.noise_corr)
    runs = []
    for n in args.peers:
        for churn in (5.0, 20.0):
            for name, change in MAIN:
                runs.append(("main", Scenario(label=f"{name} | N={n} | churn {churn:g}", peers=n, churn=churn,
                                              **{**base, **change})))
    if not args.quick:
        for name, change in SENSITIVITY.items():
            runs.append(("sensitivity", Scenario(label=f"{name} | N=256 | churn 20", peers=256,
                                                 **{**base, "churn": 20.0, **change})))
    for g, noise in itertools.product((4, 8), (args.noise, 2.0)):  # the real model: speedup.py --group-sizes 0,4,8
        runs.append(("crosscheck", Scenario(label=f"N=16, G={g}, equal speeds, noise {noise:g}", peers=16,
                                            group_size=g, leader_slack=4.0, churn=0.0, miss=0.0, speeds=(1.0,),
                                            params=1e6, **{**base, "rounds": 150, "noise": noise})))
    for n in args.peers:
        for event in ("stale1", "stale3", "failgroup"):
            for name, change in TWINS:
                if (change.get("mode") == "one-key-cap" and n > MAX_GROUP) or ("1/4" in name and n != 256):
                    continue
                for seed in range(args.twin_seeds):
                    runs.append(("twin", Scenario(label=f"{event} | {name} | N={n}", peers=n, event=event,
                                                  catch_up=False, **{**base, "rounds": 30, "seed": seed, **change})))
    return runs


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(results: dict, args, command: str, minutes: float) -> str:
    s0 = Scenario(label="", peers=0)
    lines = [
        "# A swarm of hundreds: sub-groups vs one group (SIMULATED: event-level model, no network, no model)", "",
        f"Command: `{command}` ({minutes:.1f} min, {args.jobs} process{'es' if args.jobs > 1 else ''}). "
        "Every figure below is simulated.", "",
        f"Defaults: {s0.params / 1e6:.0f}M parameters; pseudo-gradients in int4 ({bytes_per_value('int4'):.3f} "
        "B/value); sub-groups add the anchor and the outer momentum as an int8 lattice code (1 B/value each, "
        "the engine's default; fp16 on request and fp32 where reducers return deltas: sensitivity rows "
        "below; "
        f"{Scenario(label='', peers=0).bytes_per_param():.2f} B/value in all); rounds of {s0.round_s:.0f} s "
        f"(all-reduce budget {s0.round_s - s0.matchmaking_s:.0f} s); links lognormal, median {s0.link_median:g} "
        f"Mbit/s, sigma {s0.link_sigma}, clipped to 10-200; speeds 1/1.5/2/3; matchmaking miss {s0.miss:.0%} a "
        f"peer; a record visible {s0.join_visible_s:g} s after its peer joins and lingering {s0.record_ttl_s:g} s "
        f"after it leaves, {s0.record_miss:.0%} of records missed per read; group counts by "
        "`agreed_group_count`; groups balanced (each peer's rank among the records it sees, "
        "`balanced_groups`); hivemind's cap 64, as the engine's (the first simulation: hashed groups, cap G); "
        "a leaver mid-all-reduce spoils its group (hivemind's rule; 'partial results kept' rows: the engine's); "
        f"outer lr {s0.lr} / momentum {s0.mu} (shoal's defaults, `OuterConfig`); pseudo-gradient noise-to-signal "
        f"{args.noise} for a mean peer, its round-to-round persistence {args.noise_corr} ({args.noise_source}); "
        f"d = {s0.dim}; {args.rounds} rounds, the first "
        f"{WARMUP} left out; seed {args.seed}.", "",
        "Columns. **eligible / holders**: share of the round's eligible peers (live, state held since the half "
        "round, link not too slow) and of all peers holding state (link-bound ones included) whose round "
        "completed: mean / worst round. **link-bound**: peers (mean) whose link cannot carry a full group's "
        "all-reduce within the round; they stay out. **spread done**: max over the peers that completed the "
        "round of RMS(anchor - their mean) / RMS(averaged pseudo-gradient), median / p95 over rounds; **spread "
        "all**: the same over every peer holding state (those that folded lag a step), median. Tolerance "
        f"{TOL}. **check fires**: share of group members arriving further than the tolerance from their group's "
        "anchor (today's consistency check would re-sync them).", ""]
    header = ["| scenario | live | eligible | holders | link-bound | group | all-reduce s (median / p95) | "
              "spread done | spread all | check fires | losses (share of eligible) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(r: dict) -> str:
        losses = ", ".join(f"{k} {v:.1%}" for k, v in sorted(r["fail_shares"].items(), key=lambda kv: -kv[1])
                           if v >= 0.001) or "-"
        return (f"| {r['scenario']['label']} | {r['live_mean']:.0f} | {r['share_mean']:.1%} / {r['share_min']:.1%} "
                f"| {r['share_of_holders_mean']:.1%} / {r['share_of_holders_min']:.1%} | {r['link_bound_mean']:.0f} | "
                f"{r['group_size_mean']:.1f} | {fmt(r['allreduce_median_s'], '.0f')} / {fmt(r['allreduce_p95_s'], '.0f')}"
                f" | {r['spread_done_median']:.2f} / {r['spread_done_p95']:.2f} | {r['spread_median']:.2f} | "
                f"{r['check_fires']:.0%} | {losses} |")

    lines += header + [row(r) for r in results["main"]]
    if results.get("sensitivity"):
        lines += ["", "## Sensitivity: sub-groups G=16, N=256, churn 20/h/100, one change each from the defaults",
                  "", *header, *[row(r) for r in results["sensitivity"]]]
    lines += ["", "## Rounds until a change is agreed (twin runs)", "",
              "Each change is run twice with the same draws, with and without the change (no churn, no misses, "
              "catch-up off). Disagreement = max over peers of RMS(its anchor's difference between the runs minus "
              f"the swarm's mean difference) / RMS(averaged pseudo-gradient); agreed = the round from which it stays <= "
              f"{TOL} (the round of the change counts as 1; inf: not within the 22 rounds watched). Target: log_16(N) + 2. `stale1`/`stale3`: one peer's anchor "
              "and momentum set back 1/3 rounds (a joiner that adopted a stale state); `failgroup`: the round of the "
              f"group holding that peer fails. {args.twin_seeds} seeds.", "",
              "| change | setting | N | target | rounds to agree (median / max) | disagreement in rounds 1..6 "
              "(seed 0) |", "|---|---|---|---|---|---|"]
    twins: dict[str, list[dict]] = {}
    for r in results["twin"]:
        twins.setdefault(r["scenario"]["label"], []).append(r)
    for label, runs in twins.items():
        event, setting, peers = label.split(" | ")
        n = int(peers.removeprefix("N="))
        agreed = [r["rounds_to_agree"] if r["rounds_to_agree"] is not None else math.inf for r in runs]
        curve = runs[0]["disagreement"][:6]
        lines.append(f"| {event} | {setting} | {n} | {math.log(n, 16) + 2:.2f} | {statistics.median(agreed):g} / "
                     f"{max(agreed):g} | " + " ".join(f"{v:.2f}" for v in curve) + " |")
    real_path = RESULTS / "speedup_groups.json"
    real = {}
    if real_path.exists():
        for p in json.loads(real_path.read_text())["points"]:
            if p.get("group_size"):
                real[p["group_size"]] = p
    lines += ["", "## Cross-check against real pseudo-gradients", "",
              "`python -m benchmarks.sim.speedup --peers 16 --spread equal --rules overlap --group-sizes 0,4,8` runs 16 real "
              "peers (learning.toml's model, 8 inner steps a round, 150 rounds) in sub-groups through the same "
              "functions; its spread is the max over peers of RMS(anchor - mean) / RMS(averaged pseudo-gradient), "
              "median over the second half. The simulation's at the same N and G (equal speeds, no churn, no "
              f"misses, persistence {args.noise_corr}; noise {args.noise} as measured, and 2):", "",
              "| setting | simulated spread | real-model spread | real-model eval loss (peer 0 / mean anchor) |",
              "|---|---|---|---|"]
    for r in results.get("crosscheck", []):
        g = r["scenario"]["group_size"]
        p = real.get(g)
        measured = (f"{p['spread_median']:.2f} | {p['final_eval']:.4f} / {p['mean_anchor_eval']:.4f}" if p
                    else "not run | -")
        lines.append(f"| {r['scenario']['label']} | {r['spread_all_median']:.2f} | {measured} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for r in results["main"]:
        if r["per_round"] is None or "churn 20" not in r["scenario"]["label"]:
            continue
        name = r["scenario"]["label"].split(" | ")[0]
        rounds = [p["round"] for p in r["per_round"]]
        axes[0].plot(rounds, [p["share"] for p in r["per_round"]], label=name, lw=1)
        axes[1].plot(rounds, [p["spread_done"] for p in r["per_round"]], label=name, lw=1)
    axes[0].set(xlabel="round", ylabel="share of eligible peers that completed", ylim=(-0.02, 1.02),
                title="N=256, churn 20/h/100 (simulated)")
    axes[1].axhline(TOL, color="grey", ls=":", label="tolerance 0.25")
    axes[1].set(xlabel="round", ylabel="spread of completed peers' anchors / RMS(avg pg)",
                title="anchor spread, N=256, churn 20 (simulated)")
    for label, runs in {r["scenario"]["label"]: r for r in results["twin"] if r["scenario"]["seed"] == 0}.items():
        if "failgroup" in label and "N=256" in label:
            axes[2].plot(range(1, len(runs["disagreement"]) + 1), runs["disagreement"], marker=".",
                         label=label.split(" | ")[1])
    axes[2].axhline(TOL, color="grey", ls=":")
    axes[2].set(xlabel="rounds after one group's round failed", ylabel="disagreement it caused / RMS(avg pg)",
                title="N=256: a failed group (twin runs, simulated)", xlim=(0.5, 12))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure_noise(rounds: int, steps: int, peers: int) -> dict:
    """Noise-to-signal of real pseudo-gradients: ``benchmarks.sim.speedup``'s simulated peers (learning.toml,
    blocking rounds, shoal's outer step), from the mean pairwise cosine c of the peers' pseudo-gradients
    (pg_i = s + n_i with |n_i| = ns |s|: c = 1 / (1 + ns^2)), and how much of a peer's own part persists
    from one round to the next (the cosine of its residuals ``pg_i - mean`` in consecutive rounds: its own
    inner optimizer state and data order carry over)."""
    from averaging.math.flat import FlatLayout
    from averaging.math.outer_step import pseudo_gradient
    from benchmarks.sim import peers as sim
    from node.training.trainer import inner_lr

    sim.setup(str(CONFIGS / "learning.toml"), rounds)
    trainers = [sim.trainer(1, 0.006, rounds, "adamw") for _ in range(peers)]
    samplers = sim.samplers(1, peers, 0)
    layout = FlatLayout.of(trainers[0].model.named_parameters())
    pack = lambda t: layout.pack(dict(t.model.named_parameters()), layout.new_buffer())  # noqa: E731
    anchor, ratios, persistence, last = pack(trainers[0]), [], [], None
    momentum = torch.zeros_like(anchor)
    for r in range(rounds):
        for t, sampler in zip(trainers, samplers):
            for step in range(steps):
                t.inner_step(*sampler.next_batch(), inner_lr(t.inner, r + step / steps))
        grads = [pseudo_gradient(anchor, pack(t)) for t in trainers]
        cos = statistics.fmean(torch.nn.functional.cosine_similarity(grads[i], grads[j], dim=0).item()
                               for i in range(peers) for j in range(i + 1, peers))
        ratios.append(math.sqrt(max(1 / max(cos, 1e-6) - 1, 0.0)))
        mean = sum(grads) / peers
        residuals = [g - mean for g in grads]  # each peer's own part of its pseudo-gradient
        if last is not None:
            persistence.append(statistics.fmean(torch.nn.functional.cosine_similarity(a, b, dim=0).item()
                                                for a, b in zip(residuals, last)))
        last = residuals
        outer_step_(anchor, sum(grads) / peers, momentum, lr=1.0, mu=0.5)
        for t in trainers:
            with torch.no_grad():
                params = dict(t.model.named_parameters())
                for name, view in layout.views(anchor).items():
                    params[name].copy_(view)
    return {"rounds": rounds, "steps": steps, "peers": peers, "noise_to_signal": ratios,
            "median": statistics.median(ratios), "persistence": persistence,
            "persistence_median": statistics.median(persistence)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--peers", type=lambda v: [int(x) for x in v.split(",")], default=[64, 256, 1024])
    parser.add_argument("--noise", type=float, default=None, help="noise-to-signal (default: --measure-noise's)")
    parser.add_argument("--noise-corr", type=float, default=None,
                        help="round-to-round persistence of a peer's noise (default: --measure-noise's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="main table only (no sensitivity rows)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--twin-seeds", type=int, default=5)
    parser.add_argument("--measure-noise", type=int, default=40, metavar="ROUNDS",
                        help="rounds of the noise measurement (0: skip, use --noise)")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_sim")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    measured = None
    if args.measure_noise:
        measured = measure_noise(args.measure_noise, 8, 4)
        print(f"measured noise-to-signal: median {measured['median']:.2f}, persistence "
              f"{measured['persistence_median']:.2f}", file=sys.stderr)
    if args.noise is None:
        args.noise = round(measured["median"], 2) if measured else 0.75
        args.noise_source = (f"measured: median over {args.measure_noise} rounds of 4 peers x 8 inner steps on "
                             "benchmarks.sim.speedup's model") if measured else "assumed"
    else:
        args.noise_source = "given"
    if args.noise_corr is None:
        args.noise_corr = round(measured["persistence_median"], 2) if measured else 0.47
    results: dict = {"main": [], "sensitivity": [], "twin": [], "crosscheck": []}
    with ProcessPoolExecutor(args.jobs) as pool:
        for kind, out in pool.map(_job, plan(args)):
            results[kind].append(out)
    minutes = (time.time() - started) / 60
    command = command_line(__spec__.name)
    text = report(results, args, command, minutes)
    write_results({"simulated": True, "command": command, "minutes": minutes, "noise_measurement": measured,
                   "args": {k: str(v) for k, v in vars(args).items()}, **results}, args.out, lambda _: text)
    plot(results, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
