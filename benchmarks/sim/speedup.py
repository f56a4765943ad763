""""The swarm trains like N x one peer": simulated peers, no network, shoal's own round.

    .venv/bin/python -m benchmarks.sim.speedup [--peers 1,2,4] [--rounds 150] [--steps 12] [--spread equal,1:1.5:2:3] \\
        [--rules overlap,eager,...] [--lone-lengths 1,2,3,4,6] [--lrs 0.006,0.012] [--seeds 1] [--jobs 2] \\
        [--group-sizes 0,4]

What a contributor asks: does joining pay? Each swarm run ends at an eval loss; a lone peer's curve
(plain AdamW, or the best of ``--lone-opts``, its lr tuned over ``--lrs`` and its cosine schedule spanning its own length, at
``--lone-lengths`` multiples of the fastest member's steps) converts that loss into the steps a lone
peer needs to reach it ("equivalent lone steps", interpolated in log steps). Speedup = that / the
steps of the swarm's fastest member, the peer a user compares against. Equal speeds: every peer
takes ``--steps`` inner steps a round; a spread ``1:1.5:2:3`` gives the fastest ``--steps`` and the
others that ratio of it (as wall-clock rounds do), repeated for 8 peers.

The peers are real ``Trainer`` s on ``configs/learning.toml``'s model and data (as
``lr_sweep.py``); between them each peer runs the round engine's own round (``benchmarks.sim.swarm``:
a ``SharedState`` and a ``RoundRunner`` per peer, quantized sends with error feedback, the verdict, the
Nesterov outer step, the merge correction) over an in-process hub whose reducers aggregate per part,
token-weighted and robust (``averaging.math.robust``), and return in the wire's return code; the
correction is merged with ``averaging.math.merge.apply_correction_``. Rules only simulated live in
``benchmarks.sim.rules``. A rule (``--rules``) is one way of running a round:

- ``blocking``: every peer waits for the average and restarts from the new anchor;
- ``overlap``: shoal's default mode: the average lands ``--delay`` (a fraction of the next round)
  later and is merged as the round engine merges it (new anchor + the work since the snapshot);
- ``eager``: as overlap, but at the snapshot each peer takes the outer step with a stand-in for
  the average (``benchmarks.sim.rules.stand_in``: its own fresh pseudo-gradient for its weight
  share, the last landed average for the others') and trains from there; when the average lands
  the parameters move by the difference (``eager_jump`` / ``landing_correction``); ``eager-own``
  uses its own pseudo-gradient alone as the stand-in;
- ``ddp``: the lockstep baseline, no DiLoCo: one model, each step the mean gradient of one batch per
  peer (as ``lr_sweep.py``'s ``ddp``), so every step waits for the slowest peer: with a speed spread
  the swarm takes the slowest peer's steps a round, with equal speeds it is the ceiling a DiLoCo
  swarm of the same tokens is measured against (``--ddp-lrs``: its lr grid, default the inner lr);
- suffixes on any rule: ``+muon`` trains inner steps with Muon (``inner.optimizer = "muon"``: Muon
  on the Linear weights, AdamW on the rest, the same lr, MuLoCo's recipe); ``+reset`` clears the
  inner optimizer's state at every outer step (fresh moments from the new anchor); ``+avgstate``
  replaces every peer's inner optimizer state by the token-weighted mean of all peers' at every
  outer step (DES-LOC's moment sync at the outer period: twice the traffic of the parameters,
  free here; ``+avgm`` the first moment alone, ``+avgv`` the second alone; with ``+late``, in
  overlap and eager, the mean lands with the average instead, ``delay`` into the next round, through
  ``averaging.math.inner_state.land``: what a real peer that keeps training can do); ``+mwarm`` ramps the
  outer momentum linearly from 0 over the first 10% of rounds;
- ``+norm`` gives each part of the average the token-weighted mean of its senders' norms
  (the average's direction, the members' length: ``benchmarks.sim.rules.keep_norm``, what a
  reducer can do alone); ``+shards`` gives peer i shard i of the node's default 16, in the node's
  default stripes (``data.shard_stripe_bytes``: 4 KiB; 64 KiB before, as speedup_shards.md ran:
  ``+shards65536``), instead of the whole corpus, ``+shardsN`` in stripes of N bytes; ``+nowork``
  judges parts in the centered clip against each other (the
  rule before CenteredClip judged a part by its sender's work); ``+mean`` aggregates with a plain weighted mean.

``--group-sizes G``: round-seeded sub-groups of at most G peers (``averaging.math.groups``) that average
pseudo-gradients, anchors and outer momentum within the group (``run_swarm_groups``: the engine's
sub-group round, ``averaging.engine.subgroups``; issue 32); 0 is one group of everyone. There the anchors and momenta are averaged exactly, or with ``+state16`` as the fp16
code carries them (``averaging.math.wire.MIX_CODE``), or with ``+lattice`` as the lattice code does
(``averaging.math.lattice``: every member's state on the grid its group's claims set, the weighted mean
rounded to it again; values that would unwrap wrongly are counted as ``lattice_overflows``). In every
code the hub's reducers give the group view's far members weight 0 in the mean state, as real ones do.

Everything is simulated: no failures, no network; figures are labelled so. Writes
``benchmarks/results/speedup.{md,json}`` (and ``.png`` when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch

from averaging.math import inner_state, robust
from averaging.math.flat import FlatLayout
from averaging.math.groups import group_count
from averaging.math.merge import apply_correction_
from averaging.math.outer_step import OuterConfig, pseudo_gradient
from averaging.math.wire import LATTICE_CODE, MIX_CODE, MIX_CODE_EXACT, WireFormat, accounted_for
from averaging.state.verdict import Applied
from benchmarks.common.results import CONFIGS, RESULTS, command_line, setting, stored_argv, write_results
from benchmarks.sim import peers as sim
from benchmarks.sim.rules import eager_jump, landing_correction, stand_in
from benchmarks.sim.swarm import SimPeer, SimSwarm, aggregate
from node.training.data import DataConfig
from node.training.trainer import Trainer, inner_lr


def run_lone(seed: int, steps: int, lr: float, optimizer: str = "adamw") -> dict:
    """One peer, plain AdamW (or ``optimizer``), ``steps`` steps (its schedule spans them)."""
    trainer, sampler = sim.trainer(seed, lr, steps, optimizer), sim.samplers(seed, 1, 0)[0]
    for step in range(steps):
        trainer.inner_step(*sampler.next_batch(), inner_lr(trainer.inner, float(step)))
    layout = FlatLayout.of(trainer.model.named_parameters())
    return {"final_eval": sim.evaluate(trainer, layout, layout.pack(dict(trainer.model.named_parameters()), layout.new_buffer()))}


def spread_steps(peers: int, steps: int, spread: str) -> list[int]:
    """Inner steps per round of each peer: all ``steps``, or the fastest ``steps`` and the others in
    ``spread``'s ratio (``1:1.5:2:3``: slowest first), cycled to ``peers``."""
    if spread == "equal":
        return [steps] * peers
    ratio = [float(x) for x in spread.split(":")]
    fastest = max(ratio)
    order = sorted(ratio, reverse=True)
    return [max(1, round(steps * order[i % len(order)] / fastest)) for i in range(peers)]


# Which inner-state slots each averaging flag covers: the first moment (AdamW's ``exp_avg``, Muon's
# ``momentum_buffer``), the second (``exp_avg_sq``), or both.
STATE_SLOTS = {"avgstate": ("exp_avg", "exp_avg_sq", "momentum_buffer"), "avgm": ("exp_avg", "momentum_buffer"),
               "avgv": ("exp_avg_sq",)}


def average_inner_state(trainers: list[Trainer], weights: list[float], slots: tuple[str, ...]) -> None:
    """Every peer's inner optimizer state in ``slots`` := the weighted mean of all peers'
    (``+avgstate``: every slot; ``+avgm``: the first moment; ``+avgv``: the second)."""
    states = [t.inner_state() for t in trainers]
    mean = inner_state.weighted_mean(states, weights, slots)
    for t, s in zip(trainers, states):
        t.load_inner_state({**s, **mean})


def run_ddp(seed: int, steps: list[int], rounds: int, lr: float) -> dict:
    """Lockstep data parallel over ``len(steps)`` peers (``sim.lockstep_ddp``: each step the mean
    gradient of one batch per peer, one AdamW step): a round is the slowest peer's ``min(steps)`` steps."""
    return {"final_eval": sim.lockstep_ddp(seed, len(steps), rounds, min(steps), lr)["final_eval"]}


def run_swarm(seed: int, steps: list[int], rounds: int, lr: float, outer_lr: float, mu: float, rule: str,
              delay: float, compression: str) -> dict:
    """One simulated swarm, every peer running the engine's round (``benchmarks.sim.swarm``); returns
    peer 0's anchor's final eval loss."""
    mode, *flags = rule.split("+")
    wire = WireFormat.of(compression)
    config = robust.RobustConfig(aggregation="mean" if "mean" in flags else "centered_clip")
    trainers = [sim.trainer(seed, lr, rounds, "muon" if "muon" in flags else "adamw") for _ in steps]
    # every peer draws from the whole corpus, or (+shards[N]) from shard i of the node's default shards
    shards, node = next((f for f in flags if f.startswith("shards")), None), DataConfig()
    stripe = int(shards.removeprefix("shards") or node.shard_stripe_bytes) if shards else 0
    samplers = sim.samplers(seed, len(steps), stripe, num_shards=node.num_shards)
    layout = FlatLayout.of(trainers[0].model.named_parameters())
    pack = lambda t: layout.pack(dict(t.model.named_parameters()), layout.new_buffer())  # noqa: E731
    reduce = partial(aggregate, config=config, work_scaled="nowork" not in flags, norm="norm" in flags)
    swarm = SimSwarm(peers=len(steps), layout=layout, anchor=pack(trainers[0]), outer=OuterConfig(lr=outer_lr, momentum=mu),
                     wire=wire, reduce=reduce)
    pending: list[torch.Tensor | None] = [None] * len(steps)  # per peer: the correction awaiting the merge
    # +late: per peer (its inner state at the round's end, the peers' mean of it), landing with the average
    state_pending: list[tuple[dict, dict]] | None = None
    late_state = "late" in flags and mode != "blocking"
    state_decays = inner_state.decays(trainers[0].optimizers)

    def add(t: Trainer, correction: torch.Tensor) -> None:
        views = layout.views(correction)
        params = dict(t.model.named_parameters())
        apply_correction_([params[name] for name in views], list(views.values()))

    for r in range(rounds):
        for i, (t, s, n) in enumerate(zip(trainers, samplers, steps)):
            lands = max(1, round(delay * n))  # this peer's step after which the average lands
            for step in range(n):
                t.inner_step(*s.next_batch(), inner_lr(t.inner, r + step / n))
                if pending[i] is not None and step + 1 == lands:
                    add(t, pending[i])
                    pending[i] = None
                    if state_pending is not None:  # the mean as of the snapshot, and the steps since kept
                        snapshot, mean = state_pending[i]
                        t.load_inner_state(inner_state.land_state(t.inner_state(), snapshot, mean, state_decays,
                                                                  steps=lands))
        state_pending = None
        snapshots = [pack(t) for t in trainers]
        weights = [float(n) for n in steps]  # tokens: every step is one batch
        if "reset" in flags:
            for t in trainers:
                for optimizer in t.optimizers:
                    optimizer.state.clear()
        for flag in set(flags) & set(STATE_SLOTS):
            if late_state:
                states = [t.inner_state() for t in trainers]
                mean = inner_state.weighted_mean(states, weights, STATE_SLOTS[flag])
                state_pending = [(state, mean) for state in states]
            else:
                average_inner_state(trainers, weights, STATE_SLOTS[flag])
        if "mwarm" in flags:  # the momentum ramps 0 -> mu over the first 10% of rounds
            mu_now = mu * min(1.0, r / max(1.0, 0.1 * rounds))
            swarm.set_outer(OuterConfig(lr=outer_lr, momentum=mu_now))
        else:
            mu_now = mu
        jumps = [None] * len(steps)
        if mode in ("eager", "eager-own"):  # before the round: from the anchor and momentum it starts from
            jumps = [_eager(peer, snapshot, wire, swarm.hub.last.get(peer.id), w / sum(weights), own=mode == "eager-own",
                            lr=outer_lr, mu=mu_now)
                     for peer, snapshot, w in zip(swarm.peers, snapshots, weights)]
        results = swarm.run_round(r + 1, snapshots, steps)
        for i, (t, result, jump) in enumerate(zip(trainers, results, jumps)):
            correction = result.correction if jump is None else landing_correction(result.correction, jump)
            if jump is not None:
                add(t, jump)
            if mode == "blocking":
                add(t, correction)
            else:
                pending[i] = correction.clone()
    swarm.close()
    return {"final_eval": sim.evaluate(trainers[0], layout, swarm.peers[0].state.anchor)}


def _eager(peer: SimPeer, snapshot: torch.Tensor, wire: WireFormat, previous: torch.Tensor | None, share: float, *, own: bool,
           lr: float, mu: float) -> torch.Tensor:
    """Eager overlap's jump at the snapshot (``rules.eager_jump``): the outer step a stand-in for the
    round's average (``rules.stand_in``; ``own``: our own send alone) would take from the peer's anchor."""
    pseudo_grad = pseudo_gradient(peer.state.anchor, snapshot)
    sent = wire.to_send(pseudo_grad)
    accounted = accounted_for(pseudo_grad, sent, averaged=True, local=False, error_feedback=wire.error_feedback)
    guess = sent if own else stand_in(sent, previous, share)
    return eager_jump(peer.state.anchor, guess, accounted, peer.state.momentum, lr=lr, mu=mu)


def run_swarm_groups(seed: int, steps: list[int], rounds: int, lr: float, outer_lr: float, mu: float, rule: str,
                     delay: float, compression: str, group_size: int) -> dict:
    """``run_swarm`` with round-seeded sub-groups (``--group-sizes``, ``averaging.math.groups``): every peer
    runs the engine's sub-group round (``averaging.engine.subgroups``: each group averages its members'
    pseudo-gradients, anchors and outer momentum and applies the outer step; a peer alone in its group
    folds). Peers then hold different anchors: peer 0's is evaluated (what a user holds), the token-free
    mean too. ``blocking`` and ``overlap`` only, no flags but the state's code."""
    mode, *flags = rule.split("+")
    if mode not in ("blocking", "overlap") or set(flags) - {"state16", "lattice"}:
        raise SystemExit(f"--group-sizes: rule {rule} is not supported (blocking, overlap; +state16, +lattice)")
    # The anchors' and momenta's code (``averaging.math.wire.mix_code``): +state16 fp16, +lattice the
    # lattice code, else exact (fp32)
    state_code = LATTICE_CODE if "lattice" in flags else MIX_CODE if "state16" in flags else MIX_CODE_EXACT
    wire = WireFormat.of(compression)
    reduce = partial(aggregate, config=robust.RobustConfig(aggregation="centered_clip"), work_scaled=True, norm=False)
    trainers = [sim.trainer(seed, lr, rounds, "adamw") for _ in steps]
    samplers = sim.samplers(seed, len(steps), 0)
    layout = FlatLayout.of(trainers[0].model.named_parameters())
    pack = lambda t: layout.pack(dict(t.model.named_parameters()), layout.new_buffer())  # noqa: E731
    # one seed: every peer starts from the same weights
    swarm = SimSwarm(peers=len(steps), layout=layout, anchor=pack(trainers[0]), outer=OuterConfig(lr=outer_lr, momentum=mu),
                     wire=wire, reduce=reduce, groups=group_count(len(steps), group_size), state_code=state_code)
    anchors = [peer.state.anchor for peer in swarm.peers]  # (each peer's, moved in place by its rounds)
    pending: list[torch.Tensor | None] = [None] * len(steps)  # per peer: the correction awaiting the merge
    spreads, folds = [], 0

    def land(i: int) -> None:
        views = layout.views(pending[i])
        params = dict(trainers[i].model.named_parameters())
        apply_correction_([params[name] for name in views], list(views.values()))
        pending[i] = None

    for r in range(rounds):
        for i, (t, s, n) in enumerate(zip(trainers, samplers, steps)):
            lands = max(1, round(delay * n))
            for step in range(n):
                t.inner_step(*s.next_batch(), inner_lr(t.inner, r + step / n))
                if pending[i] is not None and step + 1 == lands:
                    land(i)
        results = swarm.run_round(r + 1, [pack(t) for t in trainers], steps)
        averaged = {}  # per group: the RMS of the step it applied
        for i, (peer, result) in enumerate(zip(swarm.peers, results)):
            pending[i] = result.correction.clone()
            if result.conclusion.applied == Applied.FOLDED:
                folds += 1
            else:
                averaged[result.group] = peer.state.last_rms
        mean = sum(anchors) / len(anchors)
        scale = statistics.fmean(averaged.values()) if averaged else 1.0
        spreads.append(max((a - mean).pow(2).mean().sqrt().item() for a in anchors) / scale)
        if mode == "blocking":
            for i in range(len(trainers)):
                land(i)
    swarm.close()
    mean = sum(anchors) / len(anchors)
    late = spreads[len(spreads) // 2:]
    return {"final_eval": sim.evaluate(trainers[0], layout, anchors[0]), "mean_anchor_eval": sim.evaluate(trainers[0], layout, mean),
            "spread_median": statistics.median(late), "spread_max": max(late), "folds": folds,
            **({"lattice_overflows": swarm.hub.overflows} if state_code == LATTICE_CODE else {})}


def _point(point: dict) -> dict:
    t0 = time.time()
    if point["kind"] == "lone":
        result = run_lone(point["seed"], point["lone_steps"], point["lr"], point.get("optimizer", "adamw"))
    elif point["rule"] == "ddp":
        result = run_ddp(point["seed"], point["steps"], point["rounds"], point["lr"])
    elif point.get("group_size"):
        result = run_swarm_groups(point["seed"], point["steps"], point["rounds"], point["lr"], point["outer_lr"],
                                  point["mu"], point["rule"], point["delay"], point["compression"],
                                  point["group_size"])
    else:
        result = run_swarm(point["seed"], point["steps"], point["rounds"], point["lr"], point["outer_lr"],
                           point["mu"], point["rule"], point["delay"], point["compression"])
    print(f"{label(point)} seed {point['seed']}: eval {result['final_eval']:.4f} ({time.time() - t0:.0f} s)",
          file=sys.stderr, flush=True)
    return {**point, **result, "seconds": time.time() - t0}


def label(p: dict) -> str:
    if p["kind"] == "lone":
        return f"lone {p['lone_steps']} steps lr={p['lr']:g}" + ("" if p.get("optimizer", "adamw") == "adamw" else
                                                                   f" {p['optimizer']}")
    if p["rule"] == "ddp":
        return f"ddp N={len(p['steps'])} {p['spread']} lr={p['lr']:g}"
    groups = f" G={p['group_size']}" if p.get("group_size") else ""
    return f"{p['rule']} N={len(p['steps'])} {p['spread']} outer={p['outer_lr']:g}/{p['mu']:g}{groups}"


def equivalent_steps(loss: float, curve: list[tuple[int, float]]) -> tuple[float, str]:
    """Lone steps that reach ``loss`` (log-linear between the curve's points), and '' or '>'/'<'
    when it lies past the curve's ends (then the end is returned)."""
    curve = sorted(curve)
    if loss <= curve[-1][1]:
        return float(curve[-1][0]), ">"
    if loss >= curve[0][1]:
        return float(curve[0][0]), "<"
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= loss <= l0:
            f = (l0 - loss) / (l0 - l1) if l0 != l1 else 0.0
            return math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0))), ""
    return float(curve[-1][0]), ">"


def report(points: list[dict], args, command: str, minutes: float) -> tuple[str, dict]:
    seeds = sorted({p["seed"] for p in points})
    fastest_steps = args.rounds * args.steps
    lone: dict[int, dict[int, float]] = {}  # seed -> steps -> best loss over lrs and optimizers
    for p in points:
        if p["kind"] == "lone":
            best = lone.setdefault(p["seed"], {})
            best[p["lone_steps"]] = min(best.get(p["lone_steps"], math.inf), p["final_eval"])
    rows, summary = [], {}
    by_label: dict[str, list[dict]] = {}
    for p in points:
        if p["kind"] != "lone":
            by_label.setdefault(label(p), []).append(p)
    # The lockstep baseline of the same peers (its best lr): what a swarm's loss is compared with.
    ddp: dict[tuple[int, str], float] = {}
    for runs in by_label.values():
        if runs[0]["rule"] == "ddp":
            where = (len(runs[0]["steps"]), runs[0]["spread"])
            ddp[where] = min(ddp.get(where, math.inf), statistics.fmean(p["final_eval"] for p in runs))
    for key, runs in by_label.items():
        speedups, marks = [], set()
        for p in runs:
            steps, mark = equivalent_steps(p["final_eval"], sorted(lone[p["seed"]].items()))
            speedups.append(steps / fastest_steps)
            marks.add(mark)
        mark = "".join(sorted(marks - {""}))
        loss = statistics.fmean(p["final_eval"] for p in runs)
        speed = statistics.fmean(speedups)
        spread = f" (seeds {min(speedups):.2f}-{max(speedups):.2f})" if len(speedups) > 1 else ""
        summary[key] = {"eval": loss, "speedup": speed, "per_seed": speedups, "bound": mark}
        base = ddp.get((len(runs[0]["steps"]), runs[0]["spread"])) if runs[0]["rule"] != "ddp" else None
        if base:
            summary[key]["vs_ddp"] = loss / base - 1
        versus = f"{summary[key]['vs_ddp']:+.1%}" if base else "-"
        rows.append((runs[0]["rule"], len(runs[0]["steps"]), runs[0]["spread"],
                     f"| {key} | {'+'.join(map(str, runs[0]['steps']))} | {loss:.4f} | {mark}{speed:.2f}x{spread} "
                     f"| {versus} |"))
    lone_rows = [f"| {s:,} ({s / fastest_steps:g}x) | " + " / ".join(f"{lone[seed][s]:.4f}" for seed in seeds) + " |"
                 for s in sorted(next(iter(lone.values())))]
    lines = [f"# The swarm trains like N x one peer (simulated, no network): {args.rounds} rounds, fastest peer "
             f"{args.steps} inner steps a round, {len(seeds)} seed(s)", "",
             f"Command: `{command}` ({minutes:.0f} min). Model, data and eval batches of {args.config.name}"
             f"{' with ' + ', '.join(f'{k} = {x}' for k, x in args.set) if args.set else ''}; "
             f"sends in {args.compression} with error feedback; overlap/eager merge {args.delay:g} of the next round "
             f"in. Speedup = lone steps (best of {'/'.join(args.lone_opts)} and of lr {args.lrs}, schedule per length) "
             "reaching the swarm's eval "
             f"loss / the fastest member's {fastest_steps:,} steps. '>' : better than the longest lone run (a lower "
             "bound); '<': worse than the shortest (an upper bound). Lockstep DDP (rule ddp) of the same peers takes its "
             "slowest peer's steps a round: with a speed spread it trains fewer tokens than the swarm.", "",
             "| lone steps | best eval loss per seed |", "|---|---|", *lone_rows, "",
             "| swarm | inner steps a round | eval loss (mean) | speedup vs its fastest member alone "
             "| loss vs lockstep DDP of the same peers |",
             "|---|---|---|---|---|", *[r[-1] for r in sorted(rows)]]
    grouped = {key: runs for key, runs in by_label.items() if "spread_median" in runs[0]}
    if grouped:  # sub-group runs: how far apart the anchors stayed, and the lattice code's misses
        lines += ["", "Sub-groups: spread of the anchors across groups (RMS of the farthest from their mean, in "
                  "pseudo-gradient RMS, median over the second half of the rounds), rounds a peer was alone "
                  "(folds), and values the lattice code would have unwrapped a range off (overflows).", "",
                  "| swarm | spread (median, mean over seeds) | folds | lattice overflows |", "|---|---|---|---|"]
        for key, runs in grouped.items():
            overflows = [p["lattice_overflows"] for p in runs if "lattice_overflows" in p]
            lines.append(f"| {key} | {statistics.fmean(p['spread_median'] for p in runs):.2f} "
                         f"| {sum(p['folds'] for p in runs)} | {sum(overflows) if overflows else '-'} |")
    return "\n".join(lines) + "\n", summary


def plot(summary: dict, path: Path) -> None:
    """Speedup vs peers, one line per rule and spread (skipped without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    lines: dict[str, list[tuple[int, float]]] = {}
    for key, row in summary.items():
        rule, peers, spread, _ = key.split(" ", 3)
        lines.setdefault(f"{rule} {spread}", []).append((int(peers.removeprefix("N=")), row["speedup"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in sorted(lines.items()):
        values.sort()
        ax.plot([v[0] for v in values], [v[1] for v in values], marker="o", label=name)
    top = max(v[0] for values in lines.values() for v in values)
    ax.plot([1, top], [1, top], color="grey", linestyle=":", label="ideal (N x)")
    ax.set_xlabel("peers")
    ax.set_ylabel("speedup vs the fastest member alone")
    ax.set_title("simulated swarm, no network")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    floats = lambda s: [float(v) for v in s.split(",") if v]  # noqa: E731
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--steps", type=int, default=12, help="inner steps a round of the fastest peer")
    parser.add_argument("--spread", type=lambda s: s.split(","), default=["equal", "1:1.5:2:3"])
    parser.add_argument("--rules", type=lambda s: s.split(","), default=["blocking", "overlap", "eager"])
    parser.add_argument("--outer", type=lambda s: [tuple(float(x) for x in v.split(":")) for v in s.split(",")],
                        default=[(1.0, 0.5)], help="outer lr:momentum pairs")
    parser.add_argument("--inner-lr", type=float, default=0.006)
    parser.add_argument("--ddp-lrs", type=floats, default=[], help="the ddp rule's lrs (default: --inner-lr)")
    parser.add_argument("--delay", type=float, default=0.5, help="fraction of the next round before the merge")
    parser.add_argument("--compression", default="int4")
    parser.add_argument("--lone-lengths", type=floats, default=[1, 2, 3, 4, 6])
    parser.add_argument("--lrs", type=floats, default=[0.006, 0.012])
    parser.add_argument("--lone-opts", type=lambda s: s.split(","), default=["adamw"],
                        help="inner optimizers of the lone peer (adamw, muon): its curve takes the best")
    parser.add_argument("--group-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[0],
                        help="sub-groups of this size (0: one group of everyone; averaging.math.groups)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--config", type=Path, default=CONFIGS / "learning.toml")
    parser.add_argument("--set", type=setting, action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="change the config of every run, lone and swarm alike (model size, batch)")
    parser.add_argument("--out", type=Path, default=RESULTS / "speedup")
    parser.add_argument("--lone-from", type=Path, help="reuse the lone-peer runs of this earlier result's .json "
                        "(same rounds x steps, lrs, lengths and config) instead of running them again")
    parser.add_argument("--report-only", action="store_true",
                        help="redraw --out's .md, .json and .png from its .json (the run's own command line)")
    args = parser.parse_args()
    if args.report_only:
        stored = json.loads(args.out.with_suffix(".json").read_text())
        command, minutes = stored["command"], stored["minutes"]
        args = parser.parse_args([*stored_argv(command), "--out", str(args.out)])
        return finish(stored["points"], args, command, minutes, redrawn=stored)
    fastest = args.rounds * args.steps
    plan = [dict(kind="lone", seed=s, lone_steps=round(k * fastest), lr=lr, optimizer=o)
            for s in range(args.seeds) for k in args.lone_lengths for lr in args.lrs for o in args.lone_opts]
    reused: list[dict] = []
    if args.lone_from:
        stored = json.loads(args.lone_from.with_suffix(".json").read_text())
        # A lone run depends on its steps alone (rounds x steps x length), not on how a swarm cuts them.
        if int(stored["args"]["rounds"]) * int(stored["args"]["steps"]) != fastest:
            raise SystemExit(f"--lone-from: that run's fastest member took {stored['args']['rounds']} x "
                             f"{stored['args']['steps']} steps, not {args.rounds} x {args.steps}")
        if stored["args"]["config"] != str(args.config):
            raise SystemExit(f"--lone-from: that run used config = {stored['args']['config']}, not {args.config}")
        if stored["args"].get("set", "[]") != str(args.set):
            raise SystemExit(f"--lone-from: that run used --set {stored['args'].get('set', '[]')}, not {args.set}")
        same = lambda p, q: all(p.get(k, "adamw") == q.get(k, "adamw") for k in ("seed", "lone_steps", "lr", "optimizer"))  # noqa: E731
        # The runs this one plans and that one ran; a lone point depends on nothing else.
        reused = [q for q in stored["points"] if q["kind"] == "lone" and any(same(p, q) for p in plan)]
        plan = [p for p in plan if not any(same(p, q) for q in reused)]
    for s in range(args.seeds):
        for n in args.peers:
            for spread in args.spread if n > 1 else ["equal"]:
                for rule in args.rules:
                    if rule == "ddp":  # no outer step, no groups: one point per lr
                        plan.extend(dict(kind="swarm", seed=s, steps=spread_steps(n, args.steps, spread), spread=spread,
                                         rounds=args.rounds, lr=lr, rule=rule, outer_lr=0.0, mu=0.0, group_size=0)
                                    for lr in args.ddp_lrs or [args.inner_lr])
                        continue
                    for (o, m), g in itertools.product(args.outer, args.group_sizes):
                        if g and g >= n:
                            continue  # one group of everyone: the plain swarm
                        plan.append(dict(kind="swarm", seed=s, steps=spread_steps(n, args.steps, spread), spread=spread,
                                         rounds=args.rounds, lr=args.inner_lr, outer_lr=o, mu=m, rule=rule,
                                         delay=args.delay, compression=args.compression, group_size=g))
    plan.sort(key=lambda p: -(p.get("lone_steps") or sum(p.get("steps", [0])) * p.get("rounds", 0)))  # longest first
    started = time.time()
    with ProcessPoolExecutor(args.jobs, initializer=sim.setup, initargs=(str(args.config), args.rounds, dict(args.set))) as pool:
        points = reused + list(pool.map(_point, plan))
    command = command_line(__spec__.name)
    return finish(points, args, command, (time.time() - started) / 60)


def finish(points: list[dict], args, command: str, minutes: float, *, redrawn: dict | None = None) -> int:
    """The report of a run's points: .json, .md and .png beside ``--out``, the table on stdout.
    ``redrawn``: the stored results these points come from (``--report-only``), whose provenance stays."""
    text, summary = report(points, args, command, minutes)
    results = {"simulated": True, "command": command, "minutes": minutes,
               "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "points": points}
    if redrawn is not None and "provenance" in redrawn:
        results["provenance"] = redrawn["provenance"]
    write_results(results, args.out, lambda _: text, redraw=redrawn is not None)
    plot(summary, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
