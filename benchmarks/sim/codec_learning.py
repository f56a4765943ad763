"""What each codec costs in learning, with the network taken out: eval loss at equal tokens.

    .venv/bin/python -m benchmarks.sim.codec_learning [--peers 3] [--rounds 30] [--inner-steps 20] [--seeds 2]
        [--variants fp16,int4+EF+ret4] [--add]

``compression.py`` measures bytes and all-reduce time on capped links, but its eval losses differ
by ±10% between variants that are all "fp16-like": a few rounds each, a different number of
inner steps per peer every run, machine noise. This benchmark asks only the learning question.
``--peers`` peers are simulated in one process, each with its own model copy, inner AdamW, data
shard and batch order (the same in every variant); each round every peer takes ``--inner-steps``
steps, then runs the round engine's own round (``benchmarks.sim.swarm``: a ``RoundRunner`` per peer,
sends in the variant's ``WireFormat`` with or without error feedback, the reducers' plain weighted
mean returned in its return code, the Nesterov outer step) and adds its merge correction.

So a variant differs from fp16 only by its codec, and the spread over ``--seeds`` (model init
and data order) says how much of a difference is noise. What it leaves out: failures, stragglers
and overlap (the real swarm benchmarks cover those), and hivemind's fp16 cast of float sends and
per-part exponents (the simulated reducers see fp16 sends as sent and return with one exponent).

Writes ``benchmarks/results/codec_learning.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from averaging.math import robust
from averaging.math.flat import FlatLayout
from averaging.math.merge import apply_correction_
from averaging.math.outer_step import OuterConfig
from averaging.math.wire import WireFormat
from benchmarks.common.results import CONFIGS, RESULTS, write_results
from benchmarks.sim.swarm import SimSwarm, aggregate
from node.process.config import load_config
from node.training.data import BatchSampler, eval_batches, load_corpus, shard_ranges, split_corpus
from node.training.model import build_model
from node.training.trainer import Trainer, inner_lr

# (name, compression, error feedback, return code): the names compression.py uses. fp32 is the
# noise reference: no codec error worth the name, so its distance from fp16 is what a negligible
# perturbation does to a run's eval loss.
VARIANTS = (("fp16", "fp16", False, "fp16"), ("fp32", "fp32", False, "fp32"), ("int8+EF", "int8", True, "fp16"), ("int4+EF", "int4", True, "fp16"),
            ("int4", "int4", False, "fp16"), ("int2+EF", "int2", True, "fp16"), ("int2", "int2", False, "fp16"),
            ("int8", "int8", False, "fp16"), ("int8+EF+ret8", "int8", True, "int8"), ("int4+EF+ret4", "int4", True, "int4"),
            ("int2+EF+ret4", "int2", True, "int4"))


def run_variant(config, split, evals, wire: WireFormat, *, seed: int, peers: int, rounds: int,
                inner_steps: int) -> dict:
    torch.manual_seed(seed)
    trainers, samplers = [], []
    for index in range(peers):
        trainers.append(Trainer(build_model(config.model, seed=seed), config.inner, config.train, torch.device("cpu")))
        samplers.append(BatchSampler(split.tokens, config.model.seq_len, config.data.batch_size, seed=[seed, index],
                                     held_out=split.held_out,
                                     ranges=shard_ranges(len(split.tokens), config.data.num_shards,
                                                         index % config.data.num_shards, config.data.shard_stripe_bytes)))
    layout = FlatLayout.of(trainers[0].model.named_parameters())
    pack = lambda t: layout.pack(dict(t.model.named_parameters()), layout.new_buffer())  # noqa: E731
    init = pack(trainers[0])
    reduce = partial(aggregate, config=robust.RobustConfig(aggregation="mean"), work_scaled=True, norm=False)
    swarm = SimSwarm(peers=peers, layout=layout, anchor=init, wire=wire, reduce=reduce,
                     outer=OuterConfig(lr=config.outer.lr, momentum=config.outer.momentum, nesterov=config.outer.nesterov))
    batch_tokens = config.data.batch_size * config.model.seq_len
    curve = []
    for round in range(rounds):
        for trainer, sampler in zip(trainers, samplers):
            for step in range(inner_steps):
                trainer.inner_step(*sampler.next_batch(), inner_lr(config.inner, round + step / inner_steps))
        results = swarm.run_round(round + 1, [pack(t) for t in trainers], [inner_steps * batch_tokens] * peers)
        for trainer, result in zip(trainers, results):  # blocking: every peer merges at once
            views = layout.views(result.correction)
            params = dict(trainer.model.named_parameters())
            apply_correction_([params[name] for name in views], list(views.values()))
        anchor = swarm.peers[0].state.anchor
        curve.append(((round + 1) * peers * inner_steps * batch_tokens,
                      trainers[0].evaluate_anchor(layout.views(anchor), evals)))
    anchors = [p.state.anchor for p in swarm.peers]
    swarm.close()
    drift = max(float((a - anchors[0]).square().mean().sqrt()) for a in anchors)
    moved = float((anchors[0] - init).square().mean().sqrt())
    return {"curve": curve, "final_eval": curve[-1][1], "anchor_drift": drift, "anchor_moved": moved}


def command(args) -> str:
    return (f".venv/bin/python -m benchmarks.sim.codec_learning --peers {args.peers} --rounds {args.rounds} "
            f"--inner-steps {args.inner_steps} --seeds {args.seeds} --variants {','.join(args.variants)}"
            + (" --add" if args.add else ""))


def report(results: dict, args, numel: int, minutes: float, commands: list[str], reproduced: str) -> str:
    names = list(results)
    base = results["fp16"]
    lines = [
        f"# Codecs and learning: {args.peers} simulated peers, {args.rounds} rounds of {args.inner_steps} inner steps, "
        f"{args.seeds} seeds", "",
        "Commands: " + "; then ".join(f"`{c}`" for c in commands) + f"; model {numel:,} parameters "
        f"({args.config.name}); {minutes:.0f} min in all. Every variant trains on the same batches in the same "
        "order from the same init (per seed); only the codec differs." + reproduced, "",
        "| variant | eval loss at the end (mean over seeds) | vs fp16 | per seed | vs fp16 per seed | "
        "anchor drift between peers (rel. to movement) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        finals = [r["final_eval"] for r in results[name]]
        base_finals = [r["final_eval"] for r in base]
        mean, base_mean = statistics.mean(finals), statistics.mean(base_finals)
        per_seed = " / ".join(f"{f:.4f}" for f in finals)
        per_seed_ratio = " / ".join(f"{f / b - 1:+.2%}" for f, b in zip(finals, base_finals))
        drift = max(r["anchor_drift"] / r["anchor_moved"] for r in results[name])
        lines.append(f"| {name} | {mean:.4f} | {mean / base_mean - 1:+.2%} | {per_seed} | {per_seed_ratio} | {drift:.1e} |")
    tokens = results["fp16"][0]["curve"][-1][0]
    lines += ["", f"Equal tokens: every variant trained {tokens:,} tokens over the swarm. Eval loss: peer 0's anchor "
              "(the shared model) on the fixed held-out batches after the last round. Drift: the largest RMS "
              "difference between a peer's anchor and peer 0's at the end, over the anchor's RMS movement from "
              "its init (fp16 returns: per-member rounding; int8/int4 returns: 0, the same average for all).", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=[v[0] for v in VARIANTS])
    parser.add_argument("--config", type=Path, default=CONFIGS / "bench.toml")
    parser.add_argument("--out", type=Path, default=RESULTS / "codec_learning")
    parser.add_argument("--add", action="store_true",
                        help="add these variants to the results in --out's .json (same settings); fp16 runs "
                             "again and must reproduce the stored fp16 numbers")
    args = parser.parse_args()
    stored: dict = {}
    if args.add:
        stored = json.loads(args.out.with_suffix(".json").read_text())
        for key in ("peers", "rounds", "inner_steps", "seeds", "config"):
            if stored["args"][key] != str(getattr(args, key)):
                raise SystemExit(f"--add: the stored results used {key} = {stored['args'][key]}, not {getattr(args, key)}")
    if "fp16" not in args.variants:
        args.variants = ["fp16", *args.variants]  # the reference
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    config = dataclasses.replace(config, inner=dataclasses.replace(config.inner, total_rounds=float(args.rounds)))
    split = split_corpus(load_corpus(config.data), config.data.eval_fraction, config.data.max_eval_bytes,
                         block_bytes=config.data.eval_block_bytes)
    evals = eval_batches(split.eval, config.model.seq_len, config.data.batch_size, config.train.eval_batches)
    numel = FlatLayout.of(build_model(config.model, seed=0).named_parameters()).numel
    started = time.time()
    results: dict[str, list[dict]] = {}
    for name, code, feedback, returns in VARIANTS:
        if name not in args.variants:
            continue
        wire = WireFormat.of(code, return_compression=returns, error_feedback=feedback)
        results[name] = []
        for seed in range(args.seeds):
            t0 = time.time()
            results[name].append(run_variant(config, split, evals, wire, seed=seed, peers=args.peers,
                                             rounds=args.rounds, inner_steps=args.inner_steps))
            print(f"{name} seed {seed}: eval {results[name][-1]['final_eval']:.4f} ({time.time() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    minutes = (time.time() - started) / 60 + stored.get("minutes", 0.0)
    commands = [*stored.get("commands", []), command(args)]
    reproduced = ""
    if stored:
        same = [new["final_eval"] == old["final_eval"] for new, old in zip(results["fp16"], stored["results"]["fp16"])]
        reproduced = (" The second command's fp16 runs reproduced the first's eval losses bit for bit: the runs are "
                      "deterministic." if all(same) else " The second command's fp16 runs did NOT reproduce the "
                      f"first's eval losses exactly ({sum(same)} of {len(same)} seeds did).")
        results = {name: results.get(name) or stored["results"][name]
                   for name, *_ in VARIANTS if name in results or name in stored["results"]}
    text = report(results, args, numel, minutes, commands, reproduced)
    write_results({"numel": numel, "args": {k: str(v) for k, v in vars(args).items()}, "minutes": minutes,
                   "commands": commands, "results": results}, args.out, lambda _: text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
