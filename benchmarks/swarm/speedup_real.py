"""Real: does joining pay? Four ``shoal run`` peers with a speed spread on capped links against
their fastest member training alone, at equal wall-clock and at twice it.

    .venv/bin/python -m benchmarks.swarm.speedup_real [--rounds 15] [--round-seconds 10] [--seeds 2] \\
        [--throttle 2.5] [--spread 1:1.5:2:3] [--mbit 10] [--outer 0.7:0.9,1.0:0.5] [--set inner.optimizer=muon] \
        [--variant "round.sync_mode=blocking;averaging.average_inner_state=true"]

(as root for the capped links; without root the peers run on loopback with no cap, and the report
says so). The simulated half of the question is ``speedup.py``.

Per seed, each run alone on the machine:

- ``swarm lr:mu``, one per ``--outer`` setting: 4 peers in network namespaces (``netns.py``: a
  ``tc tbf`` cap of ``--mbit`` on each link), joined through a ``shoal bootstrap`` entry peer, all
  launched at once, ``--rounds`` wall-clock rounds (``--max-rounds``) with shoal's defaults for
  everything a user does not set: overlap mode, int4 sends, robust aggregation, token weights.
  The fastest peer runs at ``--throttle``, the others at that times the spread (throttle 3 = a
  GPU three times slower). The inner lr schedule spans the rounds. The shared model is the
  fastest peer's final anchor, evaluated here.
- ``alone R`` / ``alone 2R``: the fastest member alone, plain AdamW (``ddp_baseline.py
  --no-sync``: the stronger baseline; a lone ``shoal run`` would also take outer steps alone,
  which ``speedup.py`` finds costs it), at the same throttle, for the swarm's wall-clock and
  twice it, each with its schedule spanning its own length; the two run side by side.

``--throttle-clock`` is how a throttle stretches a step, the same rule for the swarm's peers and the
lone runs: ``wall`` (the default) by the step's wall time, as ``shoal run --throttle`` does; ``cpu``
by its thread CPU time (``cpu_throttle.py``), so a step slowed by waiting for one of this machine's
two cores, which four peers, their daemons and two lone runs share, is not stretched by the whole
factor: the closer stand-in for peers on machines of their own. (Files before the flag stretched the
lone runs by a fixed calibration of forward and backward, ~8% faster than a lone ``shoal run`` at
throttle 2.5: their reports say so.)

``--set section.field=value`` (repeatable) changes the config of every run, swarm and alone alike
(e.g. ``inner.optimizer=muon``: the lone peer then trains with Muon too). ``--variant`` (repeatable,
``;`` between settings) adds a swarm run per outer setting with those changes to the swarm alone,
against the same lone runs and beside the unchanged swarm: an A/B of a swarm setting in one run.

Wall-clock is the user's: the swarm's rounds are counted from the first peer's schedule start,
so the rounds lost while the others start are lost to the swarm (the report lists each peer's
first round); the lone runs' budget is training time. The target (issue 33): the swarm after R
rounds ends below its fastest member alone after 2R. "Like x times the fastest" interpolates
the swarm's loss between the two lone runs in log time (> 2x or < 1x past the ends).

The training CPU demand is sum(1 / throttle) of one core (1.0 at the defaults), below this
machine's two cores with room for the p2pd daemons, averaging and eval.

Writes ``benchmarks/results/speedup_real.{md,json}`` (the json after every run: an interrupted
benchmark keeps what completed; ``--report-only`` redraws the table).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import netns
from benchmarks.common.results import CONFIGS, REPO, RESULTS, command_line, setting, spread, write_results
from benchmarks.common.swarm import (
    CpuMeter,
    Evaluator,
    interrupted,
    run_ddp_ranks,
    start_entry_peer,
    start_shoal_peers,
    write_config,
)
from examples.swarm_launcher import LocalSwarm, kill_process_group
from node.library.checkpoint import load_latest_valid
from node.library.config import AveragingConfig
from node.observe.metrics import read_metrics
from node.training.model import count_parameters

# Names of our own: another benchmark may hold netns.py's or learning.py's on this machine.
DEFAULTS = AveragingConfig()
netns.BRIDGE, netns.PREFIX, netns.SUBNET = "shoalsbr0", "shoals", "10.215.0"


def outer_settings(text: str) -> list[tuple[float, float]]:
    return [(float(lr), float(mu)) for lr, mu in (item.split(":") for item in text.split(",") if item)]


def variant_settings(text: str) -> dict[str, object]:
    """``a.b=v;c.d=w``: the settings of one ``--variant``."""
    return dict(setting(item) for item in text.split(";") if item)


def variant_label(variant: dict[str, object]) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in variant.items())


def run_swarm(seed: int, outer: tuple[float, float], args, hosts, root: Path, evaluator: Evaluator,
              variant: dict[str, object] | None = None) -> dict:
    """4 peers, ``args.rounds`` rounds; the final shared model and what each peer did per round."""
    lr, mu = outer
    variant = variant or {}
    tag = hashlib.sha256(variant_label(variant).encode()).hexdigest()[:6] if variant else "base"
    name = f"swarm-{lr:g}-{mu:g}-{tag}-s{seed}".replace(".", "p")
    overrides = {"inner.total_rounds": float(args.rounds), "inner.warmup_rounds": 0.1 * args.rounds,
                 "round.seconds": args.round_seconds, "round.sync_mode": "overlap", "train.seed": seed,
                 "outer.lr": lr, "outer.momentum": mu,
                 # what a user gets: the node's defaults, not learning.toml's fp16 and LAN timings
                 "averaging.compression": DEFAULTS.compression,
                 "averaging.matchmaking_seconds": DEFAULTS.matchmaking_seconds,
                 "averaging.request_timeout": DEFAULTS.request_timeout, **dict(args.set), **variant}
    evaluating = write_config(args.config, root / f"{name}.toml", overrides)
    silent = write_config(args.config, root / f"{name}-quiet.toml", {**overrides, "train.eval_every_rounds": 10**6})
    throttles = [args.throttle * s for s in args.spread]
    swarm = LocalSwarm(root / name, run_id=f"speedup-{name}-{uuid.uuid4().hex[:6]}", cwd=REPO)
    entry = None
    try:
        with CpuMeter() as cpu:
            entry, address = start_entry_peer(root / name, hosts[0] if hosts else None)
            # The fastest peer organises the run first (it prints its address once it has); the others
            # then start at once. All four started at once can both organise (two run keys: the one
            # that finds both refuses to guess, and exits), as seed 1 of the 5 s rounds run did.
            extra = ("--max-rounds", str(args.rounds))
            cpu_clock = args.throttle_clock == "cpu"
            peers = start_shoal_peers(swarm, [evaluating], throttles[:1], hosts, extra=extra, initial=address,
                                      cpu_clock=cpu_clock)
            peers += start_shoal_peers(swarm, [silent] * (len(throttles) - 1), throttles[1:], hosts, extra=extra,
                                       initial=address, first=1, cpu_clock=cpu_clock)
            codes = [p.wait(timeout=args.rounds * args.round_seconds + 240) for p in peers]
    finally:
        swarm.kill_all()
        if entry is not None:
            kill_process_group(entry.proc)
    rounds = {p.name: {r["round"]: r for r in read_metrics(p.metrics_path) if r.get("event") == "round"} for p in peers}
    checkpoint = load_latest_valid(peers[0].checkpoint_dir)
    per_peer = {n: {"throttle": t, "first_round": min(per, default=None), "rounds": len(per),
                    "inner_steps_per_round": statistics.fmean(r["inner_steps"] for r in per.values()) if per else 0,
                    "tokens": sum(r["tokens"] for r in per.values()),
                    "applied": dict(Counter(r["applied"] for r in per.values()))}
                for (n, per), t in zip(rounds.items(), throttles, strict=True)}
    curve = [(k, r["eval_loss"]) for k, r in sorted(rounds["peer-0"].items()) if r.get("eval_loss") is not None]
    return {"kind": "swarm", "outer": [lr, mu], "variant": variant_label(variant), "seed": seed,
            "exit_codes": codes, "peers": per_peer,
            "final_eval": evaluator.evaluate(checkpoint.params) if checkpoint is not None else None,
            "last_round": checkpoint.round if checkpoint is not None else None, "curve": curve,
            "group_sizes": {k: [rounds[n].get(k, {}).get("group_size") for n in sorted(rounds)] for k in sorted(rounds["peer-0"])},
            "cpu": cpu.summary()}


def run_alone(seed: int, args, root: Path) -> dict[str, dict]:
    """The fastest member alone for R and 2R rounds' wall-clock, side by side."""
    results: dict[str, dict] = {}

    def one(rounds: int, key: str) -> None:
        name = f"alone-{rounds}-s{seed}"
        config = write_config(args.config, root / f"{name}.toml", {
            "inner.total_rounds": float(rounds), "inner.warmup_rounds": 0.1 * rounds,
            "round.seconds": args.round_seconds, "train.seed": seed, **dict(args.set)})
        recs = run_ddp_ranks(config, [args.throttle], None, root, name, budget=["--budget", str(rounds * args.round_seconds)],
                             no_sync=True, port=29700 + rounds + seed, timeout=rounds * args.round_seconds * 3 + 300,
                             throttle_clock=args.throttle_clock)
        points = [r for r in recs.get("peer-0", []) if r.get("event") == "round"]
        results[key] = {"kind": key, "seed": seed, "rounds": rounds, "tokens": points[-1]["tokens"] if points else 0,
                        "final_eval": points[-1]["eval_loss"] if points else None,
                        "curve": [(r["elapsed"], r["eval_loss"]) for r in points if r.get("eval_loss") is not None]}

    with CpuMeter() as cpu:
        threads = [threading.Thread(target=one, args=(k * args.rounds, key)) for k, key in ((1, "alone R"), (2, "alone 2R"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for run in results.values():
        run["cpu"] = cpu.summary()
    return results


def times_fastest(loss: float | None, alone_r: float | None, alone_2r: float | None) -> str:
    """The swarm's loss as a multiple of the fastest member's time alone (log-interpolated)."""
    if None in (loss, alone_r, alone_2r):
        return "-"
    if loss >= alone_r:
        return "< 1x"
    if loss <= alone_2r:
        return "> 2x"
    return f"{2 ** ((alone_r - loss) / (alone_r - alone_2r)):.2f}x"


# How a run's throttle stretched a step (``--throttle-clock``; files before it: ``calibrated``).
THROTTLE_CLOCKS = {
    "calibrated": "each swarm step stretched by its wall time (shoal run --throttle), a lone step by a fixed "
                  "calibration of forward and backward (ddp_baseline.py's rule then: ~8% more steps)",
    "wall": "every step, swarm and alone, stretched by its own wall time (shoal run --throttle's rule)",
    "cpu": "every step, swarm and alone, stretched by its thread CPU time (cpu_throttle.py: a wait for a core "
           "is not multiplied)",
}


def report(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    link = (f"links capped at {meta['mbit']:g} Mbit/s (tc tbf, network namespaces)" if meta["capped"]
            else "loopback, NO bandwidth cap (not root)")
    lines = [
        "# Real swarm: does joining pay? (4 peers with a speed spread vs their fastest member alone)", "",
        f"Command: `{meta['command']}` ({meta['started']} to {meta.get('ended', 'unfinished')}).", "",
        f"Model: {meta['parameters']:,} parameters ({meta['config']}); {link}; throttles "
        f"{', '.join(f'{t:g}' for t in meta['throttles'])} (speeds 1 : {' : '.join(f'{s:g}' for s in meta['spread'][1:])} slower), "
        f"one torch thread each, {THROTTLE_CLOCKS[meta.get('throttle_clock', 'calibrated')]}; {meta['rounds']} rounds of {meta['round_seconds']:g} s (R); overlap mode, "
        f"int4, the node's default averaging{' (unless a row names a variant)' if meta.get('variants') else ''}; "
        f"seeds {meta['seeds']}"
        + (f"; every run with {', '.join(f'{k} = {v}' for k, v in meta['set'].items())}" if meta.get("set") else "")
        + ". Real processes, real DHT and all-reduce: not simulated.",
        "", "| run | eval loss (mean ± half-range) | per seed | like x times the fastest alone |", "|---|---|---|---|"]
    by_seed: dict[int, dict[str, float | None]] = {}
    for run in runs.values():
        key = run["kind"] if run["kind"] != "swarm" else f"swarm outer {run['outer'][0]:g}/{run['outer'][1]:g}" \
            + (f" {run['variant']}" if run.get("variant") else "")
        by_seed.setdefault(run["seed"], {})[key] = run.get("final_eval")
    keys = ["alone R", "alone 2R", *sorted({k for per in by_seed.values() for k in per if k.startswith("swarm")})]
    for key in keys:
        values = [per.get(key) for per in by_seed.values()]
        ratios = [times_fastest(per.get(key), per.get("alone R"), per.get("alone 2R")) for per in by_seed.values()]
        lines.append(f"| {key} | {spread(values)} | {' / '.join('-' if v is None else f'{v:.4f}' for v in values)} | "
                     f"{'-' if key.startswith('alone') else ' / '.join(ratios)} |")
    alone = [f"{key} {run['tokens']:,}" for key, run in runs.items() if run["kind"] != "swarm"]
    lines += ["", "Target: a swarm after R rounds below its fastest member alone after 2R (\"> 2x\").", "",
              f"Tokens trained alone: {'; '.join(alone)}.", "",
              "| swarm run | peer | throttle | first round | inner steps / round | tokens | rounds by outcome |",
              "|---|---|---|---|---|---|---|"]
    for key, run in runs.items():
        if run["kind"] != "swarm":
            continue
        for name, peer in run["peers"].items():
            lines.append(f"| {key} | {name} | {peer['throttle']:g} | {peer['first_round']} | "
                         f"{peer['inner_steps_per_round']:.1f} | {peer['tokens']:,} | "
                         f"{', '.join(f'{a} {n}' for a, n in sorted(peer['applied'].items()))} |")
    failed = {k: r["error"] for k, r in results.get("failed", {}).items()}
    if failed:
        lines += ["", "Failed runs: " + "; ".join(f"{k}: {e}" for k, e in failed.items())]
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path, *, redraw: bool = False) -> None:
    write_results(results, out, report, redraw=redraw)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--round-seconds", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--throttle", type=float, default=2.5, help="the fastest peer's throttle")
    parser.add_argument("--spread", type=lambda s: [float(x) for x in s.split(":")], default=[1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--mbit", type=float, default=10.0)
    parser.add_argument("--throttle-clock", choices=("wall", "cpu"), default="wall",
                        help="stretch every step, swarm and alone alike, by its wall time (shoal run --throttle) "
                             "or its CPU time (cpu_throttle.py: waits for a core are not multiplied)")
    parser.add_argument("--outer", type=outer_settings, default=outer_settings("0.7:0.9,1.0:0.5"),
                        help="outer lr:momentum settings, one swarm run each per seed")
    parser.add_argument("--config", type=Path, default=CONFIGS / "learning.toml")
    parser.add_argument("--out", type=Path, default=RESULTS / "speedup_real")
    parser.add_argument("--set", type=setting, action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a config change for every run (repeatable)")
    parser.add_argument("--variant", type=variant_settings, action="append", default=[],
                        metavar="SECTION.FIELD=VALUE[;...]",
                        help="a swarm run per outer setting with these changes (repeatable), beside the unchanged one")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.report_only:
        write(json.loads(args.out.with_suffix(".json").read_text()), args.out, redraw=True)
        print(args.out.with_suffix(".md").read_text())
        return 0
    if math.fsum(1 / (args.throttle * s) for s in args.spread) > 1.6:
        parser.error("the peers' training would need more than 1.6 of this machine's cores: raise --throttle")
    signal.signal(signal.SIGTERM, interrupted)
    capped = netns.available()
    if not capped:
        print("not root (or no ip/tc): running on loopback WITHOUT bandwidth caps", file=sys.stderr)
    evaluator = Evaluator(args.config, dict(args.set))
    seeds = list(range(args.seeds))
    results = {"meta": {
        "command": command_line(__spec__.name),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "rounds": args.rounds,
        "round_seconds": args.round_seconds, "seeds": seeds, "throttles": [args.throttle * s for s in args.spread],
        "spread": args.spread, "mbit": args.mbit, "capped": capped, "throttle_clock": args.throttle_clock, "config": args.config.name,
        "parameters": count_parameters(evaluator.trainer.model), "outer": args.outer,
        "set": dict(args.set), "variants": [variant_label(v) for v in args.variant]}, "runs": {}, "failed": {}}
    root = Path(tempfile.mkdtemp(prefix="shoal-speedup-"))
    print(f"work in {root}", file=sys.stderr, flush=True)
    try:
        with netns.Network(len(args.spread), mbit=args.mbit) if capped else nullcontext() as net:
            hosts = net.hosts if net else None
            for seed in seeds:
                plan = [("alone", None, {})] + [("swarm", outer, variant) for outer in args.outer
                                                 for variant in [{}, *args.variant]]
                for kind, outer, variant in plan:
                    key = f"{kind}-s{seed}" if outer is None else \
                        f"swarm {outer[0]:g}/{outer[1]:g}{' ' + variant_label(variant) if variant else ''} s{seed}"
                    print(f"== {key} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
                    try:
                        if kind == "alone":
                            for name, run in run_alone(seed, args, root).items():
                                results["runs"][f"{name} s{seed}"] = run
                        else:
                            results["runs"][key] = run_swarm(seed, outer, args, hosts, root, evaluator, variant)
                    except KeyboardInterrupt:
                        raise
                    except Exception as exc:  # noqa: BLE001 - one failed run is reported, the rest go on
                        traceback.print_exc()
                        results["failed"][key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    write(results, args.out)
    except KeyboardInterrupt:
        print("interrupted: the results so far are kept", file=sys.stderr)
    results["meta"]["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    write(results, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
