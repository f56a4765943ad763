"""Learning you can trust: eval loss of shoal vs one peer alone, tuned DDP and blocking DiLoCo,
at equal tokens and at equal wall-clock, over seeds.

    sudo /work/main/.venv/bin/python -m benchmarks.swarm.learning [--rounds 30] [--round-seconds 5] [--seeds 2] [--lrs 3] \\
        [--throttle 4] [--mbit 10] [--deadline 05:15]

One model, corpus and held-out split (``configs/learning.toml``: the tiny model; every peer draws
i.i.d. windows from the whole training split), one eval set (the same 16 held-out batches
everywhere). A seed sets ``train.seed`` (model init) and the data order (DDP ranks and the lone
peer seed their samplers with it; shoal peers draw theirs from fresh peer ids, new every run).

Runs, in this order (each one alone on the machine; peers in network namespaces whose links are
capped with ``tc tbf`` when root, else loopback without a cap, and the report says so):

1. ``overlap``: 4 ``shoal run`` peers, throttle ``--throttle`` each, ``--rounds`` rounds of
   ``--round-seconds`` s, the inner lr schedule spanning those rounds. They join through a
   ``shoal bootstrap`` entry peer, all at once. The token budget T is what the overlap runs
   trained on (the smaller over seeds): the budget every other configuration gets.
2. ``ddp`` at equal tokens: 4 DDP-over-gloo ranks (``ddp_baseline.py --tokens T``: the schedule
   spans T), for each of ``--lrs`` learning rates around ``inner.lr`` (factors of 2). DDP is
   synchronous, so its loss after T tokens does not depend on the link: these run on loopback,
   throttled to ``--cpu-cores`` of demand. The best lr (mean final eval loss) is the tuned DDP.
3. ``ddp-wall``: tuned DDP over the capped links with a wall-clock budget of rounds x round
   seconds (its schedule spans that time, as the shoal runs' rounds span theirs).
4. ``blocking``: blocking DiLoCo (OpenDiLoCo: H inner steps then wait for the all-reduce, every
   peer in every group), the same rounds as overlap; H is what fits a round with room for the sync.
5. ``single``: one peer alone (``ddp_baseline.py --no-sync``, one rank) on T tokens, the seeds at
   once, throttled to ``--cpu-cores`` of demand; its wall-clock is rescaled to the swarm peers'
   throttle.

Every configuration shares one lr schedule: warmup over the first 10%, cosine decay to the end of
the rounds (shoal, wall-clock DDP) or of T (DDP at equal tokens, the lone peer). Wall-clock is
measured from the launch of the processes, start-up included, for shoal and DDP alike: shoal's
schedule starts when the first peer publishes it, so the rounds that pass while the peers finish
starting are lost to training (the report lists the first round each peer trained).

Writes ``benchmarks/results/learning.md`` (table and verdicts), ``.json`` (everything, rewritten
after each run, so an interrupted run leaves its partial results; ``--report-only`` redraws from
it) and ``.png`` (eval loss vs tokens and vs wall-clock, mean and spread over seeds).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import netns
from benchmarks.common.results import CONFIGS as CONFIG_DIR
from benchmarks.common.results import REPO, RESULTS, command_line, spread, write_results
from benchmarks.common.swarm import (
    CpuMeter,
    Evaluator,
    eval_at,
    interrupted,
    run_ddp_ranks,
    start_entry_peer,
    start_shoal_peers,
    write_config,
)
from examples.swarm_launcher import LocalSwarm, kill_process_group
from node.library.checkpoint import load_latest_valid
from node.observe.metrics import read_metrics
from node.training.model import count_parameters

# Another benchmark may hold netns.py's default names on this machine at the same time: ours differ.
netns.BRIDGE, netns.PREFIX, netns.SUBNET = "shoallbr0", "shoall", "10.214.0"

CONFIGS = ("single", "ddp", "ddp-wall", "blocking", "overlap")


# -- configs and evaluation ---------------------------------------------------------------------
def schedule(args) -> dict[str, float]:
    """The lr schedule every configuration shares: warmup over the first 10%, cosine to the end of
    the rounds (shoal, wall-clock DDP) or of the token budget (DDP and the lone peer, ``--tokens``)."""
    return {"inner.total_rounds": float(args.rounds), "inner.warmup_rounds": 0.1 * args.rounds,
            "round.seconds": args.round_seconds}


# -- the runs -------------------------------------------------------------------------------------
def run_shoal(mode: str, seed: int, args, hosts, root: Path, evaluator: Evaluator, inner_steps: int) -> dict:
    """4 peers for ``args.rounds`` rounds; the curve of the shared model (peer-0 evaluates it each
    round; the final checkpoint is evaluated here), swarm tokens counted through each round."""
    name = f"{mode}-s{seed}"
    overrides = {**schedule(args), "train.seed": seed, "round.sync_mode": mode, "round.inner_steps": inner_steps}
    if mode == "blocking":  # lockstep: nobody averages without the slowest peer
        overrides["averaging.min_group_size"] = args.peers
    evaluating = write_config(args.config, root / f"{name}.toml", overrides)
    # Only peer-0 evaluates (every peer would score the same shared model): 3 evals a round less CPU.
    silent = write_config(args.config, root / f"{name}-quiet.toml", {**overrides, "train.eval_every_rounds": 10**6})
    swarm = LocalSwarm(root / name, run_id=f"learning-{name}-{uuid.uuid4().hex[:6]}", cwd=REPO)
    entry = None
    try:
        with CpuMeter() as cpu:
            entry, address = start_entry_peer(root / name, hosts[0] if hosts else None)
            launched = time.time()
            peers = start_shoal_peers(swarm, [evaluating] + [silent] * (args.peers - 1), [args.throttle] * args.peers,
                                      hosts, extra=("--max-rounds", str(args.rounds)), initial=address)
            codes = [p.wait(timeout=args.rounds * args.round_seconds + 240) for p in peers]
    finally:
        swarm.kill_all()
        if entry is not None:
            kill_process_group(entry.proc)
    records = {p.name: read_metrics(p.metrics_path) for p in peers}
    schedule_start = min(r["schedule_start"] for recs in records.values() for r in recs if r.get("event") == "start")
    rounds = {n: {r["round"]: r for r in recs if r.get("event") == "round"} for n, recs in records.items()}
    tokens_through = lambda k: sum(r["tokens"] for per in rounds.values() for n, r in per.items() if n <= k)  # noqa: E731
    # Time from the launch of the peers, as for DDP: start-up is part of what a user waits for.
    curve = [(r["time"] - launched, tokens_through(k), r["eval_loss"]) for k, r in sorted(rounds["peer-0"].items())]
    first_rounds = [min(per) for per in rounds.values() if per]
    checkpoint = load_latest_valid(peers[0].checkpoint_dir)
    final = evaluator.evaluate(checkpoint.params) if checkpoint is not None else None
    last = max(rounds["peer-0"], default=0)
    if final is not None and curve:
        curve[-1] = (curve[-1][0], curve[-1][1], final)  # the shared model after the last round
    groups = {k: [rounds[n].get(k, {}).get("group_size") for n in sorted(rounds)] for k in sorted(rounds["peer-0"])}
    train_s = args.rounds * args.round_seconds - (min(first_rounds, default=1) - 1) * args.round_seconds
    return {"config": mode, "seed": seed, "curve": curve, "tokens": tokens_through(last), "final_eval": final,
            "last_round": last, "exit_codes": codes, "inner_steps": inner_steps,
            "schedule_start_s": schedule_start - launched, "first_rounds": first_rounds,
            "wall_s": curve[-1][0] if curve else None, "tokens_per_s": tokens_through(last) / train_s,
            "short_groups": {k: g for k, g in groups.items() if any(s != args.peers for s in g)},
            "waited_s": sum(r["wait_s"] for per in rounds.values() for r in per.values()),
            # How long a sync took, hand-over to result: in overlap mode, the delay before its merge.
            "sync_median_s": statistics.median(syncs) if (syncs := [r["sync_s"] for per in rounds.values()
                                                                    for r in per.values() if r.get("sync_s")]) else None,
            "cpu": cpu.summary()}


def ddp_curve(records: dict[str, list[dict]], world: int, launched: float | None = None) -> tuple[list[tuple[float, float, float]], dict]:
    """Rank 0's eval points as (seconds since launch, or since training began without ``launched``,
    swarm tokens, eval loss)."""
    recs = [r for r in records.get("peer-0", []) if r.get("event") == "round"]
    curve = [(r["time"] - launched if launched else r["elapsed"], r["tokens"] * world, r["eval_loss"]) for r in recs]
    return curve, (recs[-1] if recs else {})


def run_ddp(lr: float, seed: int, args, hosts, root: Path, port: int, *, tokens: int | None) -> dict:
    """Tuned-DDP candidates: ``tokens`` (loopback, schedule over T) or the wall-clock budget (capped)."""
    name = f"ddp-lr{lr:g}-s{seed}" + ("" if tokens else "-wall")
    config = write_config(args.config, root / f"{name}.toml", {**schedule(args), "train.seed": seed, "inner.lr": lr})
    budget = ["--tokens", str(tokens)] if tokens else ["--budget", str(args.rounds * args.round_seconds)]
    throttle = args.peers / args.cpu_cores if tokens else args.throttle
    with CpuMeter() as cpu:
        launched = time.time()
        records = run_ddp_ranks(config, [throttle] * args.peers, hosts, root, name, budget=budget, port=port,
                                timeout=args.rounds * args.round_seconds * 6 + 300)
    curve, last = ddp_curve(records, args.peers, launched)
    return {"config": "ddp" if tokens else "ddp-wall", "seed": seed, "lr": lr, "curve": curve, "throttle": throttle,
            "tokens": last.get("tokens", 0) * args.peers, "final_eval": curve[-1][2] if curve else None,
            "wall_s": curve[-1][0] if curve else None, "setup_s": curve[-1][0] - last["elapsed"] if curve else None,
            "tokens_per_s": last.get("tokens", 0) * args.peers / last["elapsed"] if last else None,
            "cpu": cpu.summary(), "link": "capped" if hosts and not tokens else "loopback"}


def run_single(seeds: list[int], tokens: int, args, root: Path) -> list[dict]:
    """One peer alone per seed, the seeds side by side (each process one thread)."""
    throttle = max(1.0, len(seeds) / args.cpu_cores)
    results: dict[int, dict] = {}

    def one(seed: int) -> None:
        name = f"single-s{seed}"
        config = write_config(args.config, root / f"{name}.toml", {**schedule(args), "train.seed": seed})
        results[seed] = run_ddp_ranks(config, [throttle], None, root, name, budget=["--tokens", str(tokens)], no_sync=True,
                                      timeout=args.rounds * args.round_seconds * 12 + 300)

    with CpuMeter() as cpu:
        launched = time.time()
        threads = [threading.Thread(target=one, args=(seed,)) for seed in seeds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    runs = []
    scale = args.throttle / throttle  # its wall-clock as if it ran at a swarm peer's speed
    for seed in seeds:
        recs = [r for r in results.get(seed, {}).get("peer-0", []) if r.get("event") == "round"]
        # seconds since launch: the start-up as it was, the training as at a swarm peer's throttle
        curve = [(r["time"] - r["elapsed"] - launched + r["elapsed"] * scale, r["tokens"], r["eval_loss"]) for r in recs]
        last = recs[-1] if recs else {}
        runs.append({"config": "single", "seed": seed, "curve": curve, "throttle": throttle, "time_scale": scale,
                     "tokens": last.get("tokens", 0), "final_eval": curve[-1][2] if curve else None,
                     "wall_s": curve[-1][0] if curve else None,
                     "tokens_per_s": last["tokens"] / (last["elapsed"] * scale) if last else None, "cpu": cpu.summary()})
    return runs


# -- the report -----------------------------------------------------------------------------------
def mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def groups_of(runs: dict) -> dict[str, list[dict]]:
    """Runs by row: one per configuration, one per DDP learning rate."""
    rows: dict[str, list[dict]] = {}
    for run in runs.values():
        if run.get("skipped"):
            continue
        key = f"ddp lr={run['lr']:g}" if run["config"] == "ddp" else run["config"]
        if run["config"] == "ddp-wall":
            key = f"ddp-wall lr={run['lr']:g}"
        rows.setdefault(key, []).append(run)
    return rows


def equal_wall_clock(rows: dict[str, list[dict]]) -> float | None:
    """The latest time since launch at which every wall-clock run (capped links) has an eval point."""
    ends = [max(p[0] for p in r["curve"]) for k, group in rows.items() for r in group
            if (k in ("overlap", "blocking") or k.startswith("ddp-wall")) and r["curve"]]
    return min(ends) if ends else None


def best_ddp_lr(runs: dict) -> float | None:
    """The grid's lr with the lowest mean final eval loss, over the seeds every lr has run."""
    by_lr: dict[float, dict[int, float]] = {}
    for run in runs.values():
        if run.get("config") == "ddp" and run.get("final_eval") is not None:
            by_lr.setdefault(run["lr"], {})[run["seed"]] = run["final_eval"]
    common = set.intersection(*(set(v) for v in by_lr.values())) if by_lr else set()
    if not common:
        return None
    return min(by_lr, key=lambda lr: statistics.fmean(by_lr[lr][s] for s in common))


def report(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    budget, wall = meta.get("token_budget"), meta["rounds"] * meta["round_seconds"]
    rows = groups_of(runs)
    wall_rows = [k for k in rows if k in ("overlap", "blocking") or k.startswith("ddp-wall")]
    common = equal_wall_clock(rows)
    best = best_ddp_lr(runs)
    link = (f"links capped at {meta['mbit']:g} Mbit/s (tc tbf, network namespaces)" if meta["capped"]
            else "loopback, NO bandwidth cap (not root)")
    planned = meta.get("planned_runs", 0)
    done = sum(1 for r in runs.values() if not r.get("skipped"))
    lines = [
        f"# Learning: one peer vs tuned DDP vs blocking DiLoCo vs shoal overlap ({meta['peers']} peers)", "",
        ("**PARTIAL RESULTS**: " + f"{done} of {planned} runs completed; the missing ones are listed below.\n")
        if done < planned else "",
        f"Command: `{meta['command']}` ({meta['started']} to {meta.get('ended', 'unfinished')}).", "",
        f"Model: {meta['parameters']:,} parameters ({meta['config']}), batch {meta['batch_tokens']} tokens per peer step; "
        f"{link}; every peer throttle {meta['throttle']:g} on one torch thread (unthrottled step {meta['step_s'] * 1e3:.0f} ms "
        f"measured at start); {meta['rounds']} rounds of {meta['round_seconds']:g} s = {wall:g} s for the wall-clock runs; "
        f"blocking H = {meta['inner_steps']} inner steps per round; seeds {meta['seeds']}.",
        f"Token budget T = {budget:,} tokens (what the overlap runs trained on in their {meta['rounds']} rounds, "
        "the smaller over seeds); DDP and the lone peer train exactly T with the lr schedule spanning T." if budget
        else "Token budget: not set (no overlap run finished).", "",
        "| configuration | eval loss at T tokens | eval loss at equal wall-clock | tokens/s | tokens trained | "
        "wall-clock (s) | CPU cores: ours / machine busy |",
        "|---|---|---|---|---|---|---|",
    ]
    verdict_values: dict[str, float | None] = {}
    order = ["single", *sorted(k for k in rows if k.startswith("ddp lr")),
             *sorted(k for k in rows if k.startswith("ddp-wall")), "blocking", "overlap"]
    for key in (k for k in order if k in rows):
        group = rows[key]
        at_tokens = [eval_at(r["curve"], 1, budget) if budget and r["tokens"] >= budget * 0.999 else None for r in group]
        at_wall = [eval_at(r["curve"], 0, common) if common and (key in wall_rows or key == "single") else None for r in group]
        tokens = statistics.fmean(r["tokens"] for r in group)
        tps = mean([r.get("tokens_per_s") for r in group])
        walls = mean([r.get("wall_s") for r in group])
        cpu = mean([r["cpu"]["own_cores"] for r in group]), mean([r["cpu"]["machine_busy_cores"] for r in group])
        label = key
        if key.startswith("ddp lr"):
            label = key + (" **tuned**" if best is not None and key == f"ddp lr={best:g}" else "") + " (loopback)"
        elif key.startswith("ddp-wall"):
            label = key.replace("ddp-wall", "ddp, tuned") + " (capped; wall-clock budget)"
        elif key == "single":
            label = f"single peer (time x{group[0]['time_scale']:g}: at a swarm peer's speed)"
        tok_cell = spread(at_tokens) if any(v is not None for v in at_tokens) else f"- (trained {tokens:,.0f} < T)"
        wall_cell = spread(at_wall) if any(v is not None for v in at_wall) else "-"
        if key == "single" and wall_cell != "-":
            wall_cell += " (schedule spans T, not the wall-clock)"
        tps_cell = "-" if key.startswith("ddp lr") else (f"{tps:,.0f}" if tps else "-")
        lines.append(f"| {label} | {tok_cell} | {wall_cell} | {tps_cell} | {tokens:,.0f} | "
                     f"{'-' if walls is None else f'{walls:.0f}'} | {cpu[0]:.2f} / {cpu[1]:.2f} of {group[0]['cpu']['cores']} |")
        verdict_values[f"{key}@T"] = mean(at_tokens)
        verdict_values[f"{key}@W"] = mean(at_wall)
    lines += ["", f"Equal wall-clock = {common or 0:.1f} s after the processes were launched (start-up included, for "
              "shoal and DDP alike): the latest time every wall-clock run has an eval point for; values "
              "between eval points are interpolated. Spread = half the range over seeds. Tokens/s = tokens trained / "
              "training time (shoal: the rounds its peers trained in; DDP: from its first step; the lone peer: rescaled to "
              "a swarm peer's throttle); DDP at equal tokens ran on loopback, so its speed is not reported.", ""]
    # -- verdicts
    overlap_t, overlap_w = verdict_values.get("overlap@T"), verdict_values.get("overlap@W")
    ddp_t = verdict_values.get(f"ddp lr={best:g}@T") if best is not None else None
    walls = [k for k in rows if k.startswith("ddp-wall")]
    ddp_w = verdict_values.get(f"{walls[0]}@W") if walls else None
    blocking_w = verdict_values.get("blocking@W")
    lines.append("## Targets (issue 13)")
    lines.append("")
    if overlap_t is not None and ddp_t is not None:
        gap = (overlap_t - ddp_t) / ddp_t
        lines.append(f"- Equal tokens, shoal within 2% of tuned DDP (lr {best:g}): overlap {overlap_t:.4f} vs DDP {ddp_t:.4f}, "
                     f"{gap:+.2%} -> **{'met' if gap <= 0.02 else 'NOT met'}**.")
    else:
        lines.append("- Equal tokens vs tuned DDP: not measured (a run is missing).")
    grid = sorted({r["lr"] for r in runs.values() if r.get("config") == "ddp" and not r.get("skipped")})
    if best is not None and len(grid) > 1 and best in (grid[0], grid[-1]):
        lines.append(f"- Caveat: DDP's best lr ({best:g}) is at the edge of the grid {grid}: a wider grid might tune it further.")
    wall_lr = rows[walls[0]][0]["lr"] if walls else None
    ddp_name = "DDP (capped)" if wall_lr is None else f"DDP (lr {wall_lr:g}, capped)" + (
        "" if wall_lr == best or best is None else f"; the grid's best lr is now {best:g}")
    for name, other in ((ddp_name, ddp_w), ("blocking DiLoCo", blocking_w)):
        if overlap_w is not None and other is not None:
            gap = (overlap_w - other) / other
            lines.append(f"- Equal wall-clock, shoal better than {name}: overlap {overlap_w:.4f} vs {other:.4f}, "
                         f"{gap:+.2%} -> **{'met' if overlap_w < other else 'NOT met'}**.")
        else:
            lines.append(f"- Equal wall-clock vs {name}: not measured (a run is missing).")
    lines += ["", "## Runs", "", "| run | final eval | tokens | wall (s) | notes |", "|---|---|---|---|---|"]
    for key, run in runs.items():
        if run.get("skipped"):
            lines.append(f"| {key} | - | - | - | skipped: {run['skipped']} |")
            continue
        notes = []
        if run.get("short_groups"):
            notes.append("rounds with a group below " + str(meta["peers"]) + ": "
                         + ", ".join(f"{k} {v}" for k, v in list(run["short_groups"].items())[:6])
                         + (" ..." if len(run["short_groups"]) > 6 else ""))
        if run.get("exit_codes") and any(run["exit_codes"]):
            notes.append(f"exit codes {run['exit_codes']}")
        if "waited_s" in run:
            notes.append(f"schedule began {run['schedule_start_s']:.1f} s after launch; first round trained by each "
                         f"peer {run['first_rounds']}; loop stalled {run['waited_s']:.1f} s (all peers)")
        if run.get("sync_median_s") is not None:
            notes.append(f"median sync {run['sync_median_s']:.2f} s (hand-over to result)")
        if run.get("setup_s") is not None:
            notes.append(f"training began {run['setup_s']:.1f} s after launch")
        if "throttle" in run:
            notes.append(f"throttle {run['throttle']:g}")
        final, wall_s = run.get("final_eval"), run.get("wall_s")
        lines.append(f"| {key} | {'-' if final is None else f'{final:.4f}'} | {run['tokens']:,} | "
                     f"{'-' if wall_s is None else f'{wall_s:.0f}'} | {'; '.join(notes)} |")
    headroom = [r["cpu"]["cores"] - r["cpu"]["machine_busy_cores"] for r in runs.values() if "cpu" in r]
    if headroom:
        lines += ["", f"CPU headroom (cores minus machine busy) during the runs: {min(headroom):.2f} to {max(headroom):.2f} cores."]
    lines += ["", "CPU: ours = CPU seconds of this benchmark's processes (peers, their hivemind children, p2pd, DDP ranks) "
              "per wall-clock second; machine busy = the whole machine's (other users' work included), from /proc/stat. "
              "Headroom = cores minus machine busy.", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = groups_of(results["runs"])
    best = best_ddp_lr(results["runs"])
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"single": "tab:gray", "ddp": "tab:blue", "ddp-wall": "tab:cyan", "blocking": "tab:orange", "overlap": "tab:green"}
    for key, group in rows.items():
        config = group[0]["config"]
        tuned = config != "ddp" or (best is not None and group[0]["lr"] == best)
        for axis, index in ((by_tokens, 1), (by_time, 0)):
            if index == 0 and config == "ddp":
                continue  # loopback: its time says nothing about capped links
            grid = sorted({p[index] for r in group for p in r["curve"] if p[2] is not None})
            if not grid:
                continue
            values = [[eval_at(r["curve"], index, x) for r in group] for x in grid]
            keep = [(x, v) for x, v in zip(grid, values) if all(e is not None for e in v)]
            if not keep:
                continue
            xs = [x / 1e6 if index == 1 else x for x, _ in keep]
            axis.plot(xs, [statistics.fmean(v) for _, v in keep], color=colors[config], label=key,
                      alpha=1.0 if tuned else 0.4, linestyle="-" if tuned else "--")
            if len(group) > 1:
                axis.fill_between(xs, [min(v) for _, v in keep], [max(v) for _, v in keep], color=colors[config], alpha=0.15)
    budget = results["meta"].get("token_budget")
    if budget:
        by_tokens.axvline(budget / 1e6, color="black", linewidth=0.8, linestyle=":", label="token budget T")
    common = equal_wall_clock(rows)
    if common:
        by_time.axvline(common, color="black", linewidth=0.8, linestyle=":", label="equal wall-clock")
        by_time.set_xlim(0, common * 1.6)  # the lone peer runs on far to the right
    by_tokens.set_xlabel("tokens trained, all peers (millions)")
    by_time.set_xlabel("wall-clock since the processes were launched (s)")
    for axis in (by_tokens, by_time):
        axis.set_ylabel("held-out eval loss")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    lows = [p[2] for g in rows.values() for r in g for p in r["curve"] if p[2] is not None]
    if lows:
        for axis in (by_tokens, by_time):
            axis.set_ylim(min(lows) - 0.05, min(max(lows), min(lows) + 1.2))
    fig.suptitle("eval loss: mean over seeds, band = min..max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write(results: dict, out: Path, *, redraw: bool = False) -> None:
    def page(results: dict) -> str:
        text = report(results)
        if plot(results, out.with_suffix(".png")):
            text += f"\n![eval loss vs tokens and wall-clock]({out.with_suffix('.png').name})\n"
        return text

    write_results(results, out, page, redraw=redraw)


# -- the run --------------------------------------------------------------------------------------
def lr_grid(base: float, count: int) -> list[float]:
    """``count`` learning rates around ``base``, factors of 2 (1: base; 3: base/2, base, 2 base)."""
    return [base * 2.0 ** (k - (count - 1) / 2) for k in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--round-seconds", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--lrs", type=int, default=3, help="DDP learning rates in the grid, factors of 2 around inner.lr")
    parser.add_argument("--throttle", type=float, default=4.0, help="every swarm peer's throttle (capped runs)")
    parser.add_argument("--cpu-cores", type=float, default=1.6, help="CPU demand of the compute-bound runs (throttled to it)")
    parser.add_argument("--mbit", type=float, default=10.0)
    parser.add_argument("--inner-steps", type=int, default=0, help="blocking H; 0 = what fits 65%% of a round")
    parser.add_argument("--deadline", default="", help="HH:MM UTC: skip runs that would end after it")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(CONFIGS))
    parser.add_argument("--config", type=Path, default=CONFIG_DIR / "learning.toml")
    parser.add_argument("--out", type=Path, default=RESULTS / "learning")
    parser.add_argument("--report-only", action="store_true", help="redraw the table and plot from the .json")
    args = parser.parse_args()
    if args.report_only:
        write(json.loads(args.out.with_suffix(".json").read_text()), args.out, redraw=True)
        print(args.out.with_suffix(".md").read_text())
        return 0
    signal.signal(signal.SIGTERM, interrupted)  # kill: clean up (namespaces, processes) and keep what completed
    capped = netns.available()
    if not capped:
        print("not root (or no ip/tc): running on loopback WITHOUT bandwidth caps", file=sys.stderr)
    evaluator = Evaluator(args.config)
    step_s = evaluator.step_seconds()
    inner_steps = args.inner_steps or max(1, int(0.65 * args.round_seconds / (args.throttle * step_s)))
    seeds, lrs = list(range(args.seeds)), lr_grid(evaluator.config.inner.lr, args.lrs)
    deadline = None
    if args.deadline:
        hh, mm = map(int, args.deadline.split(":"))
        now = datetime.now(UTC)
        deadline = now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()
    c = evaluator.config
    results = {"meta": {
        "command": command_line(__spec__.name, python="sudo /work/main/.venv/bin/python"),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "peers": args.peers, "rounds": args.rounds,
        "round_seconds": args.round_seconds, "seeds": seeds, "lrs": lrs, "throttle": args.throttle, "mbit": args.mbit,
        "capped": capped, "cpu_cores": args.cpu_cores, "config": args.config.name, "step_s": step_s, "inner_steps": inner_steps,
        "parameters": count_parameters(evaluator.trainer.model), "batch_tokens": c.data.batch_size * c.model.seq_len,
        "token_budget": None}, "runs": {}}
    wall = args.rounds * args.round_seconds
    swarm_rate = args.peers * results["meta"]["batch_tokens"] / (args.throttle * step_s)
    swarm_step = args.peers * results["meta"]["batch_tokens"]
    expected = int(swarm_rate * wall * 0.9) // swarm_step * swarm_step  # T if no overlap run finishes
    # Most needed first, so that a deadline drops the least needed: the grid's other lrs on the first
    # seed come before the wall-clock DDP (which takes the best lr so far), their other seeds last.
    center, others = lrs[(len(lrs) - 1) // 2], [lr for lr in lrs if lr != lrs[(len(lrs) - 1) // 2]]
    plan = [("overlap", s, None) for s in seeds] + [("ddp", s, center) for s in seeds] + [("ddp", seeds[0], lr) for lr in others]
    plan += [("ddp-wall", s, None) for s in seeds] + [("blocking", s, None) for s in seeds] + [("single", None, None)]
    plan += [("ddp", s, lr) for lr in others for s in seeds[1:]]
    plan = [p for p in plan if p[0] in args.only]
    results["meta"]["planned_runs"] = sum(len(seeds) if p[0] == "single" else 1 for p in plan)
    root = Path(tempfile.mkdtemp(prefix="shoal-learning-"))
    print(f"step {step_s * 1e3:.0f} ms, blocking H = {inner_steps}, work in {root}", file=sys.stderr, flush=True)

    def estimate(config: str) -> float:
        budget = results["meta"]["token_budget"] or expected
        if config in ("overlap", "blocking"):
            return wall + 45
        if config == "ddp-wall":
            return wall + 25
        per_core = results["meta"]["batch_tokens"] / step_s
        return budget / (per_core * args.cpu_cores) + 20

    try:
        with netns.Network(args.peers, mbit=args.mbit) if capped else nullcontext() as net:
            hosts = net.hosts if net else None
            for port, (config, seed, lr) in enumerate(plan, start=29610):
                key = f"{config}-s{seed}" + (f"-lr{lr:g}" if lr else "") if seed is not None else config
                if deadline and time.time() + estimate(config) > deadline:
                    results["runs"][key] = {"skipped": "would end after the deadline", "config": config}
                    write(results, args.out)
                    continue
                print(f"== {key} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
                try:
                    budget = results["meta"]["token_budget"]
                    if config in ("overlap", "blocking"):
                        results["runs"][key] = run_shoal(config, seed, args, hosts, root, evaluator, inner_steps)
                        overlaps = [r["tokens"] for r in results["runs"].values() if r.get("config") == "overlap" and r.get("tokens")]
                        if config == "overlap" and overlaps:
                            results["meta"]["token_budget"] = min(overlaps) // swarm_step * swarm_step
                    elif config == "ddp":
                        if budget is None:
                            budget = expected  # no overlap run: its expected tokens
                            results["meta"]["token_budget"] = budget
                        results["runs"][key] = run_ddp(lr, seed, args, None, root, port, tokens=budget)
                    elif config == "ddp-wall":
                        tuned = best_ddp_lr(results["runs"]) or c.inner.lr
                        results["runs"][key] = run_ddp(tuned, seed, args, hosts, root, port, tokens=None)
                    else:
                        for run in run_single(seeds, budget or expected, args, root):
                            results["runs"][f"single-s{run['seed']}"] = run
                except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
                    traceback.print_exc()
                    results["runs"][key] = {"skipped": f"failed: {type(e).__name__}: {str(e)[:200]}", "config": config}
                write(results, args.out)
    except KeyboardInterrupt:
        print("interrupted: writing what completed", file=sys.stderr)
    finally:
        results["meta"]["ended"] = datetime.now(UTC).strftime("%H:%M UTC")
        write(results, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
