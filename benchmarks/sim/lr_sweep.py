"""Tune shoal the way the learning benchmark tunes DDP: an lr grid at equal tokens, network taken out.

    .venv/bin/python -m benchmarks.sim.lr_sweep [--peers 4] [--rounds 30] [--inner-steps 36] [--seeds 1] \\
        [--inner-lrs 0.003,0.006,0.012] [--outer 0.7:0.9,1.0:0.0] [--ddp-lrs 0.003,0.006,0.012,0.024] [--jobs 2]

``learning.py`` compares shoal with DDP at equal tokens after tuning DDP's lr over a grid; shoal ran
with its config's inner and outer rates, untuned. A fair comparison tunes both, and a grid of real
4-peer swarms costs ~3 min per point on this machine. Here the peers are simulated in one process
(as ``codec_learning.py`` does), so a point costs about a minute and is deterministic:

- ``ddp``: one model, each step the mean gradient of ``--peers`` batches (one per rank, seeded as
  ``ddp_baseline.py`` seeds its ranks), clipped, one AdamW step: what DDP computes, minus the fp16
  rounding of its comm hook. ``rounds x inner-steps`` steps, so the same tokens as the swarm.
- ``blocking`` DiLoCo: every peer takes ``--inner-steps`` steps, then runs the round engine's own
  round (``benchmarks.sim.swarm``: a ``RoundRunner`` per peer, the fp16 wire format, the reducers' plain
  weighted mean, the Nesterov outer step) and adds its merge correction: it restarts from the new anchor.
- ``overlap``: as shoal's overlap mode: the round runs on the snapshot while the peers go on
  training; ``--delay`` of the next round's steps later each peer adds its merge correction (the new
  anchor plus the work since the snapshot).

Every run shares the learning benchmark's schedule (warmup 10% of the rounds, cosine to
``min_lr_ratio`` at the end), model, data and eval batches (``configs/learning.toml``). What it
leaves out: failures, stragglers, unequal step counts; the real swarm runs in ``learning.py`` keep
those. The point of the sweep is which rates to give those runs.

Writes ``benchmarks/results/lr_sweep.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch

from averaging.math import robust
from averaging.math.flat import FlatLayout
from averaging.math.merge import apply_correction_
from averaging.math.outer_step import OuterConfig
from averaging.math.wire import WireFormat
from benchmarks.common.results import CONFIGS, RESULTS, command_line, write_results
from benchmarks.sim import peers as sim
from benchmarks.sim.swarm import SimSwarm, aggregate
from node.process.config import load_config
from node.training.trainer import inner_lr


def run_diloco(seed: int, peers: int, rounds: int, inner_steps: int, lr: float, outer_lr: float, mu: float,
               delay: int | None, stripe_bytes: int = 0) -> dict:
    """Every peer runs the engine's round (``benchmarks.sim.swarm``) in fp16 with a plain mean;
    ``delay`` None: blocking, else the merge lands after that many steps of the next round."""
    trainers, samplers = [sim.trainer(seed, lr) for _ in range(peers)], sim.samplers(seed, peers, stripe_bytes)
    layout = FlatLayout.of(trainers[0].model.named_parameters())
    pack = lambda t: layout.pack(dict(t.model.named_parameters()), layout.new_buffer())  # noqa: E731
    reduce = partial(aggregate, config=robust.RobustConfig(aggregation="mean"), work_scaled=True, norm=False)
    swarm = SimSwarm(peers=peers, layout=layout, anchor=pack(trainers[0]), outer=OuterConfig(lr=outer_lr, momentum=mu),
                     wire=WireFormat.of("fp16"), reduce=reduce)
    pending: list[torch.Tensor] | None = None  # per peer: the correction awaiting the merge

    def merge(corrections: list[torch.Tensor]) -> None:
        for t, correction in zip(trainers, corrections):
            views = layout.views(correction)
            params = dict(t.model.named_parameters())
            apply_correction_([params[name] for name in views], list(views.values()))

    curve = []
    for r in range(rounds):
        for step in range(inner_steps):
            if pending is not None and step == delay:
                merge(pending)
                pending = None
            for t, s in zip(trainers, samplers):
                t.inner_step(*s.next_batch(), inner_lr(t.inner, r + step / inner_steps))
        if pending is not None:  # a delay of a whole round or more: merge before the next snapshot
            merge(pending)
            pending = None
        results = swarm.run_round(r + 1, [pack(t) for t in trainers], [inner_steps] * peers)
        pending = [result.correction.clone() for result in results]
        if delay is None:  # blocking: every peer restarts from the new anchor
            merge(pending)
            pending = None
        if (r + 1) % 5 == 0 or r + 1 == rounds:
            curve.append((r + 1, sim.evaluate(trainers[0], layout, swarm.peers[0].state.anchor)))
    swarm.close()
    return {"curve": curve, "final_eval": curve[-1][1]}


def _point(point: dict) -> dict:
    t0 = time.time()
    kind = point["kind"]
    common = dict(seed=point["seed"], peers=point["peers"], rounds=point["rounds"], inner_steps=point["inner_steps"],
                  lr=point["lr"], stripe_bytes=point.get("stripe_bytes", 0))
    if kind == "ddp":
        result = sim.lockstep_ddp(**common)
    else:
        result = run_diloco(**common, outer_lr=point["outer_lr"], mu=point["mu"],
                            delay=None if kind == "blocking" else point["delay"])
    print(f"{label(point)} seed {point['seed']}: eval {result['final_eval']:.4f} ({time.time() - t0:.0f} s)",
          file=sys.stderr, flush=True)
    return {**point, **result, "seconds": time.time() - t0}


def label(point: dict) -> str:
    if point["kind"] == "ddp":
        return f"ddp lr={point['lr']:g}"
    return f"{point['kind']} inner={point['lr']:g} outer={point['outer_lr']:g}/{point['mu']:g}"


def report(points: list[dict], args, commands: list[str], minutes: float) -> str:
    by_label: dict[str, list[dict]] = {}
    for p in points:
        by_label.setdefault(label(p), []).append(p)
    mean = {k: statistics.fmean(p["final_eval"] for p in v) for k, v in by_label.items()}
    ddp = {k: v for k, v in mean.items() if k.startswith("ddp")}
    best_ddp = min(ddp, key=ddp.get) if ddp else None
    lines = [f"# lr sweep at equal tokens: {args.peers} simulated peers, {args.rounds} rounds of {args.inner_steps} "
             f"inner steps, {args.seeds} seed(s)", "",
             "Commands: " + "; then ".join(f"`{c.strip()}`" for c in commands) + f" ({minutes:.0f} min in all). Model, data, schedule and eval batches of "
             f"{args.config.name}; overlap merges {args.delay} steps into the next round; each peer draws from "
             + (f"its shard of data.num_shards cut in stripes of {args.stripe_bytes:,} bytes" if args.stripe_bytes
                else "the whole corpus") + ". Tokens per run: "
             f"{args.rounds * args.inner_steps * args.peers * points[0]['batch_tokens']:,}.", "",
             "| configuration | eval loss (mean over seeds) | per seed | vs best DDP |", "|---|---|---|---|"]
    for key in sorted(mean, key=lambda k: (k.split()[0] != "ddp", k.split()[0], mean[k])):
        per_seed = " / ".join(f"{p['final_eval']:.4f}" for p in by_label[key])
        versus = f"{mean[key] / ddp[best_ddp] - 1:+.1%}" if best_ddp else "-"
        lines.append(f"| {key}{' **best**' if key == best_ddp else ''} | {mean[key]:.4f} | {per_seed} | {versus} |")
    for kind in ("blocking", "overlap"):
        mine = {k: v for k, v in mean.items() if k.startswith(kind)}
        if mine:
            best = min(mine, key=mine.get)
            lines += ["", f"Best {kind}: {best}, {mine[best]:.4f}" + (
                f" ({mine[best] / ddp[best_ddp] - 1:+.1%} vs {best_ddp})" if best_ddp else "") + "."]
    return "\n".join(lines) + "\n"


def main() -> int:
    floats = lambda s: [float(v) for v in s.split(",") if v]  # noqa: E731
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=36, help="per peer and round (learning.py's overlap runs: ~36)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--inner-lrs", type=floats, default=[0.003, 0.006, 0.012])
    parser.add_argument("--outer", type=lambda s: [tuple(float(x) for x in v.split(":")) for v in s.split(",") if v],
                        default=[(0.7, 0.9), (1.0, 0.0)], help="outer lr:momentum pairs")
    parser.add_argument("--ddp-lrs", type=floats, default=[0.003, 0.006, 0.012, 0.024])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["overlap"], help="blocking and/or overlap")
    parser.add_argument("--delay", type=int, default=12, help="overlap: steps of the next round before the merge")
    parser.add_argument("--stripe-bytes", type=int, default=0,
                        help="0: each peer draws from the whole corpus; else from its shard of data.num_shards cut in "
                        "stripes of this many bytes, as swarm peers do (a value past the corpus: contiguous shards)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes, one torch thread each")
    parser.add_argument("--config", type=Path, default=CONFIGS / "learning.toml")
    parser.add_argument("--out", type=Path, default=RESULTS / "lr_sweep")
    parser.add_argument("--add", action="store_true", help="merge these points into --out's .json (same peers, "
                        "rounds, inner steps, delay and config; a point run again replaces the stored one)")
    args = parser.parse_args()
    stored: dict = {"points": [], "commands": [], "minutes": 0.0}
    if args.add:
        stored = json.loads(args.out.with_suffix(".json").read_text())
        for key in ("peers", "rounds", "inner_steps", "delay", "config", "stripe_bytes"):
            was = stored["args"].get(key, "0")  # sweeps before --stripe-bytes drew from the whole corpus
            if was != str(getattr(args, key)):
                raise SystemExit(f"--add: the stored sweep used {key} = {was}, not {getattr(args, key)}")
    config = load_config(args.config)
    batch_tokens = config.data.batch_size * config.model.seq_len
    base = dict(peers=args.peers, rounds=args.rounds, inner_steps=args.inner_steps, batch_tokens=batch_tokens,
                stripe_bytes=args.stripe_bytes)
    plan = [dict(base, kind="ddp", lr=lr, seed=s) for s in range(args.seeds) for lr in args.ddp_lrs]
    plan += [dict(base, kind=mode, lr=lr, outer_lr=o, mu=m, delay=args.delay, seed=s)
             for s in range(args.seeds) for mode in args.modes for lr in args.inner_lrs for o, m in args.outer]
    started = time.time()
    with ProcessPoolExecutor(args.jobs, initializer=sim.setup, initargs=(str(args.config), args.rounds)) as pool:
        points = list(pool.map(_point, plan))
    minutes = (time.time() - started) / 60 + stored["minutes"]
    commands = [*stored["commands"], command_line(__spec__.name)]
    keys = {(label(p), p["seed"]) for p in points}
    points = [p for p in stored["points"] if (label(p), p["seed"]) not in keys] + points
    text = report(points, args, commands, minutes)
    write_results({"args": {k: str(v) for k, v in vars(args).items()}, "commands": commands, "minutes": minutes,
                   "points": points}, args.out, lambda _: text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
