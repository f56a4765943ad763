"""A real N-peer swarm on loopback training the tiny model: the loss curve and anchor agreement.

    .venv/bin/python -m benchmarks.swarm.loss_curve [--peers 3] [--rounds 15] [--round-seconds 10]

Writes ``benchmarks/results/loss_curve.md`` (and ``.json``): per round, the group size and eval
loss each peer saw, and at the end the RMS / max difference between the peers' anchors.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from benchmarks.common.results import REPO, RESULTS, write_results
from examples.swarm_launcher import LocalSwarm
from node.library.checkpoint import load_latest_valid
from node.observe.metrics import read_metrics


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--round-seconds", type=float, default=10.0)
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "tiny.toml")
    parser.add_argument("--out", type=Path, default=RESULTS / "loss_curve")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    swarm = LocalSwarm(root, run_id=f"bench-{uuid.uuid4().hex[:6]}", cwd=REPO)
    common = ["--max-rounds", str(args.rounds), "--round-seconds", str(args.round_seconds)]
    started = time.time()
    try:
        first = swarm.start("peer-1", *common, config=args.config)
        address = first.wait_for_address()
        for i in range(2, args.peers + 1):
            swarm.start(f"peer-{i}", *common, config=args.config, initial=address[:1])
        codes = [p.wait(timeout=args.rounds * args.round_seconds + 300) for p in swarm.peers]
    finally:
        swarm.kill_all()

    rounds = {p.name: {r["round"]: r for r in read_metrics(p.metrics_path) if r["event"] == "round"}
              for p in swarm.peers}
    anchors = {p.name: torch.cat([t.flatten() for t in load_latest_valid(p.checkpoint_dir).params.values()])
               for p in swarm.peers}
    pairs = {f"{x}/{y}": {"rms": float((anchors[x] - anchors[y]).square().mean().sqrt()),
                          "max": float((anchors[x] - anchors[y]).abs().max())}
             for x, y in itertools.combinations(anchors, 2)}
    result = {"peers": args.peers, "rounds": args.rounds, "round_seconds": args.round_seconds,
              "exit_codes": codes, "wall_s": time.time() - started, "per_round": rounds, "anchor_diff": pairs}
    names = [p.name for p in swarm.peers]
    lines = [f"# Loss curve: {args.peers} peers, tiny config, {args.round_seconds:g} s rounds, loopback",
             "", f"Command: `.venv/bin/python -m benchmarks.swarm.loss_curve --peers {args.peers} --rounds {args.rounds} "
             f"--round-seconds {args.round_seconds:g}`", "",
             "| round | " + " | ".join(f"{n} group" for n in names) + " | " + " | ".join(f"{n} eval loss" for n in names) + " |",
             "|---" * (2 * len(names) + 1) + "|"]
    for r in range(1, args.rounds + 1):
        groups = [str(rounds[n].get(r, {}).get("group_size", "-")) for n in names]
        evals = [f"{rounds[n][r]['eval_loss']:.4f}" if r in rounds[n] and rounds[n][r]["eval_loss"] is not None else "-"
                 for n in names]
        lines.append(f"| {r} | " + " | ".join(groups) + " | " + " | ".join(evals) + " |")
    lines += ["", "Anchor differences after the last round (fp16 all-reduce):", ""]
    lines += [f"- {pair}: RMS {d['rms']:.2e}, max {d['max']:.2e}" for pair, d in pairs.items()]
    lines += ["", f"Exit codes: {codes}"]
    write_results(result, args.out, lambda _: "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
