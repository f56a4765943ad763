"""Attacks on a training swarm, end to end: three honest ``shoal run`` peers and one hostile peer
(``tests/integration/hostile_node.py``: a whole node whose all-reduce corrupts its parts or its
returned averages), against a clean run of the same length, all in one run.

    .venv/bin/python benchmarks/attacks.py [--rounds 12] [--round-seconds 5] [--throttle 4] [--only clean,flip]

For each scenario the honest peers must stay alive (exit 0), stay on schedule (train every round,
average in most), never adopt the attacker's state (their final anchors agree with each other and
the eval loss stays near the clean run's), and name the attacker in their logs. Scenarios:

- ``clean``: four honest peers, robust aggregation (``centered_clip``, the default): the reference.
- ``clean-mean``: the same with ``averaging.aggregation = "mean"`` (hivemind's weighted mean, with
  shoal's part checks): what robust aggregation costs a clean run, in all-reduce time and eval loss.
- ``three-honest``: the three honest peers alone: what is left when the attacker is shut out.
- one per attack of ``hostile_peer.ATTACKS`` (scale, flip, noise, nan, shape, weight, lie), and
  ``hijack`` (hostile_node: a consistent liar about its anchor, in its claims and its state).

Loopback, no link caps (the attacks are about content, not bandwidth); every peer throttled so
that the swarm's training needs about one of the machine's cores. The final eval loss is each
honest peer's final checkpoint on the config's held-out batches, computed here after the swarm
has exited. Writes ``benchmarks/results/attacks.md`` and ``.json`` (rewritten after each run;
``--report-only`` redraws the table from it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from harness import CpuMeter, start_entry_peer  # noqa: E402
from learning import Evaluator, write_config  # noqa: E402

from examples.swarm_launcher import LocalSwarm, kill_process_group  # noqa: E402
from node.library.checkpoint import load_latest_valid  # noqa: E402
from node.observe.metrics import read_metrics  # noqa: E402
from tests.integration.hostile_peer import ATTACKS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "attacks"
HONEST = 3
CLEAN = ("clean", "clean-mean", "three-honest")
# What each attack does (hostile_peer's docstring) and what it did before shoal's defences (issue 11).
WHAT = {
    "scale": ("its parts x1000", "its part became the average"),
    "flip": ("its parts x-50", "accepted: it passed the only check (finite, RMS <= 100x ours)"),
    "noise": ("its parts + 99x noise", "accepted, same check"),
    "nan": ("a NaN in each part", "the round folded for everyone, every round: the run stalled"),
    "shape": ("parts of shape [1]", "hivemind broadcast them; honest senders waited out the timeout"),
    "weight": ("sign-flipped parts, weight 1e30", "its part became the average"),
    "lie": ("as a reducer, returns average + 1e4", "honest peers applied it"),
    "hijack": ("claims a poisoned anchor one step ahead and serves it as its state (items 5, 6)",
               "a claimed step count won every tie; a re-sync or joiner could adopt its state"),
}
HOSTILE = (*ATTACKS, "hijack")  # what tests/integration/hostile_node.py can do


def base(name: str) -> str:
    """A scenario's kind: ``clean#2`` is a second clean run (the spread between clean runs is the
    noise the attacks' differences must be read against)."""
    return name.split("#")[0]


def run_scenario(name: str, args, root: Path, evaluator: Evaluator) -> dict:
    attack = base(name) if base(name) in HOSTILE else None
    folder = name.replace("#", "-")
    overrides = {"inner.total_rounds": float(args.rounds), "inner.warmup_rounds": 0.1 * args.rounds,
                 "round.seconds": args.round_seconds, "train.seed": 0, "train.eval_every_rounds": 10**6,
                 "train.checkpoint_every_rounds": 10**6,
                 "averaging.aggregation": "mean" if base(name) == "clean-mean" else "centered_clip"}
    config = write_config(args.config, root / f"{folder}.toml", overrides)
    swarm = LocalSwarm(root / folder, run_id=f"attacks-{folder}-{uuid.uuid4().hex[:6]}", cwd=REPO)
    entry = None
    common = ("--throttle", str(args.throttle), "--max-rounds", str(args.rounds))
    try:
        with CpuMeter() as cpu:
            entry, address = start_entry_peer(root / folder, None)
            peers = [swarm.start(f"honest-{i}", *common, config=config, initial=address) for i in range(HONEST)]
            if base(name) != "three-honest":
                program = [sys.executable, "-m", "tests.integration.hostile_node", attack] if attack else None
                peers.append(swarm.start("attacker" if attack else "honest-3", *common, config=config,
                                         initial=address, program=program))
            for peer in peers:
                peer.wait_for_address(timeout=180)
            codes = {p.name: p.wait(timeout=args.rounds * args.round_seconds + 300) for p in peers}
    finally:
        swarm.kill_all()
        if entry is not None:
            kill_process_group(entry.proc)
    honest = [p for p in peers if p.name.startswith("honest-")][:HONEST]
    attacker = next((p for p in peers if p.name == "attacker"), None)
    attacker_id = _peer_id(attacker.maddrs) if attacker else None
    rounds = {p.name: [r for r in read_metrics(p.metrics_path) if r.get("event") == "round"] for p in honest}
    finals, anchors = {}, {}
    for p in honest:
        checkpoint = load_latest_valid(p.checkpoint_dir)
        if checkpoint is not None:
            finals[p.name] = evaluator.evaluate(checkpoint.params)
            anchors[p.name] = torch.cat([t.flatten().float() for t in checkpoint.params.values()])
    names = sorted(anchors)
    spread = max((float((anchors[a] - anchors[b]).norm() / anchors[a].norm())
                  for a in names for b in names if a < b), default=None)
    allreduce = [r["allreduce_s"] for recs in rounds.values() for r in recs if r.get("applied") == "averaged"]
    robust: dict[str, int] = {}
    for recs in rounds.values():
        for r in recs:
            for kind, n in (r.get("robust") or {}).items():
                robust[kind] = robust.get(kind, 0) + n
    return {
        "scenario": name, "exit_codes": codes, "cpu": cpu.summary(),
        "last_round": {n: max((r["round"] for r in recs), default=0) for n, recs in rounds.items()},
        "rounds_trained": {n: len(recs) for n, recs in rounds.items()},
        "averaged": {n: sum(r.get("applied") == "averaged" for r in recs) for n, recs in rounds.items()},
        "resyncs": {n: sum(bool(r.get("resynced")) for r in recs) for n, recs in rounds.items()},
        "caught_up": {n: sum(r.get("caught_up", 0) for r in recs) for n, recs in rounds.items()},
        "attacker_in_group": {n: sum(attacker_id in (r.get("group") or []) for r in recs)
                              for n, recs in rounds.items()} if attacker_id else {},
        "robust": robust,
        "honest_tokens": sum(r["tokens"] for recs in rounds.values() for r in recs),
        "median_allreduce_s": statistics.median(allreduce) if allreduce else None,
        "final_eval": finals, "anchor_spread": spread,
        "attacker": attacker_id,
        "attacker_named_in": sorted(p.name for p in honest if attacker_id and attacker_id in p.log()),
        # States the honest peers assembled with slices the attacker served (must stay 0).
        "attacker_state_used": sum(1 for p in honest for line in p.log().splitlines()
                                   if attacker_id and "assembled from" in line and attacker_id in line),
        "attacker_exit": codes.get("attacker"),
    }


def _peer_id(maddrs: list[str]) -> str | None:
    match = next((re.search(r"/p2p/(\w+)", m) for m in maddrs), None)
    return match.group(1) if match else None


def _at_equal_tokens(runs: dict[str, dict]) -> list[str]:
    """Each attack run's final eval against what attacker-free runs (clean, three-honest,
    clean-mean) reach with as many honest tokens: a least-squares line through them. On a shared
    machine the attacker's process takes CPU from the honest peers, which then train fewer tokens
    in the same rounds; this separates that from what the attack does to the model."""
    free = [(r["honest_tokens"], _mean(r["final_eval"].values())) for n, r in runs.items()
            if base(n) in CLEAN and r.get("honest_tokens") and r["final_eval"]]
    if len(free) < 3:
        return []
    mean_x = sum(x for x, _ in free) / len(free)
    mean_y = sum(y for _, y in free) / len(free)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in free) / sum((x - mean_x) ** 2 for x, _ in free)
    predict = lambda x: mean_y + slope * (x - mean_x)  # noqa: E731
    spread = max(abs(y - predict(x)) / predict(x) for x, y in free)
    lines = ["", "## At equal honest tokens", "",
             f"A line through the {len(free)} attacker-free runs (final eval vs tokens the honest peers trained; "
             f"{slope * 1e5:+.3f} per 100k tokens; those runs lie within ±{spread:.1%} of it) gives what each "
             "run would reach without the attack with as many tokens:", "",
             "| run | honest tokens | final eval | expected | gap |", "|---|---|---|---|---|"]
    for name, run in runs.items():
        final = _mean(run["final_eval"].values())
        if base(name) in HOSTILE and run.get("honest_tokens") and final is not None:
            expected = predict(run["honest_tokens"])
            lines.append(f"| {name} | {run['honest_tokens']:,} | {final:.4f} | {expected:.4f} "
                         f"| {100 * (final - expected) / expected:+.1f}% |")
    return lines


def _half_range(values: list[float]) -> float:
    return (max(values) - min(values)) / 2 / (sum(values) / len(values)) if len(values) > 1 else 0.0


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def report(results: dict) -> str:
    runs = {r["scenario"]: r for r in results["runs"]}
    cleans = [c for c in (_mean(r["final_eval"].values()) for n, r in runs.items() if base(n) == "clean")
              if c is not None]
    clean = _mean(cleans)
    lines = [
        "# Attacks on a training swarm: 3 honest peers and 1 hostile peer, against a clean run",
        "",
        f"Command: `{results['command']}` ({results['started']} to {results['ended']} UTC).",
        "",
        f"Each run: {results['rounds']} rounds of {results['round_seconds']} s, `benchmarks/configs/learning.toml` "
        f"(the tiny model), every peer throttle {results['throttle']}, loopback, all peers started at once "
        "through a `shoal bootstrap` entry peer. Honest peers: default robust aggregation (`centered_clip`, "
        "ban 10 rounds). Final eval: each honest peer's final checkpoint on the same held-out batches "
        "(mean over the honest peers); vs clean: against the mean of the `clean` runs "
        f"({', '.join(f'{c:.4f}' for c in cleans) or 'none'}). Anchor spread: the "
        "largest relative L2 distance between two honest peers' final anchors.",
        "",
        "| scenario | attack | before issue 11 | honest alive | rounds trained / averaged (per honest peer) "
        "| re-syncs | refused by robust aggregation | attacker in groups | attacker named in logs "
        "| states assembled with its slices | median all-reduce (s) | final eval | vs clean | anchor spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        what, before = WHAT.get(base(name), ("-", "-"))
        honest_codes = [c for n, c in run["exit_codes"].items() if n.startswith("honest")]
        final = _mean(run["final_eval"].values())
        versus = f"{100 * (final - clean) / clean:+.1f}%" if final is not None and clean else "-"
        trained = " / ".join(f"{run['rounds_trained'][n]}/{run['averaged'][n]}" for n in sorted(run["averaged"]))
        robust = ", ".join(f"{k} {v}" for k, v in sorted(run["robust"].items())) or "none"
        in_groups = " / ".join(str(v) for _, v in sorted(run["attacker_in_group"].items())) or "-"
        named = f"{len(run['attacker_named_in'])} of {HONEST}" if run["attacker"] else "-"
        used = run.get("attacker_state_used", "-") if run["attacker"] else "-"
        median = f"{run['median_allreduce_s']:.2f}" if run["median_allreduce_s"] is not None else "-"
        spread = f"{run['anchor_spread']:.1e}" if run["anchor_spread"] is not None else "-"
        final_text = f"{final:.4f}" if final is not None else "-"
        lines.append(
            f"| {name} | {what} | {before} | {sum(c == 0 for c in honest_codes)} of {len(honest_codes)} | {trained} "
            f"| {sum(run['resyncs'].values())} | {robust} | {in_groups} | {named} | {used} | {median} "
            f"| {final_text} | {versus} | {spread} |")
    lines += ["", "## By scenario (mean over its runs; spread = half the range)", "",
              "| scenario | runs | final eval | spread | vs clean | attacker banned in (honest peers, all runs) | re-syncs per run |",
              "|---|---|---|---|---|---|---|"]
    by_base: dict[str, list[dict]] = {}
    for name, run in runs.items():
        by_base.setdefault(base(name), []).append(run)
    verdicts = []
    for kind, group in by_base.items():
        finals = [f for f in (_mean(r["final_eval"].values()) for r in group) if f is not None]
        if not finals:
            continue
        mean = sum(finals) / len(finals)
        spread = (max(finals) - min(finals)) / 2
        versus = f"{100 * (mean - clean) / clean:+.1f}%" if clean else "-"
        banned = sum(r["robust"].get("bans", 0) for r in group)
        resyncs = sum(sum(r["resyncs"].values()) for r in group) / len(group)
        lines.append(f"| {kind} | {len(finals)} | {mean:.4f} | ±{spread:.4f} | {versus} "
                     f"| {banned if kind in HOSTILE else '-'} | {resyncs:.1f} |")
        if kind in HOSTILE and clean:
            gap = 100 * (mean - clean) / clean
            verdicts.append(f"- {kind}: {mean:.4f} vs clean {clean:.4f}, {gap:+.1f}% -> "
                            f"{'met' if gap <= 5 else '**NOT met**'}")
    lines += ["", "Target (issue 11): the honest peers' final eval loss within 5% of a clean run of the same "
              f"length. The clean runs themselves differ by ±{_half_range(cleans):.1%} of their mean: a gap "
              "smaller than that is noise.", "", *verdicts]
    lines += _at_equal_tokens(runs)
    lines += ["", "CPU (cores used by the swarm / the whole machine, of 2): "
              + "; ".join(f"{r['scenario']} {r['cpu']['own_cores']:.2f} / {r['cpu']['machine_busy_cores']:.2f}"
                          for r in results["runs"] if r.get("cpu")), ""]
    return "\n".join(lines)


def write(results: dict, out: Path = RESULTS) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(report(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--round-seconds", type=float, default=5.0)
    parser.add_argument("--throttle", type=float, default=4.0)
    parser.add_argument("--only", type=lambda s: s.split(","), default=[*CLEAN, *HOSTILE, "clean#2"],
                        help="scenarios in order; NAME#K repeats one (default: every scenario, clean twice)")
    parser.add_argument("--config", type=Path, default=REPO / "benchmarks" / "configs" / "learning.toml")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results path, without .md/.json")
    parser.add_argument("--report-only", action="store_true", help="redraw the table from the .json")
    args = parser.parse_args()
    if args.report_only:
        write(json.loads(args.out.with_suffix(".json").read_text()), args.out)
        return 0
    unknown = {base(n) for n in args.only} - set(CLEAN) - set(HOSTILE)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}: choose from {', '.join([*CLEAN, *HOSTILE])}")
    evaluator = Evaluator(args.config)
    results = {"command": "benchmarks/attacks.py " + " ".join(sys.argv[1:]), "rounds": args.rounds,
               "round_seconds": args.round_seconds, "throttle": args.throttle, "runs": [],
               "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M")}
    root = Path(f"/tmp/shoal-attacks-{uuid.uuid4().hex[:6]}")
    root.mkdir(parents=True)
    for name in args.only:
        print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
        results["runs"].append(run_scenario(name, args, root, evaluator))
        results["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
        write(results, args.out)
        print(json.dumps({k: results["runs"][-1][k] for k in ("exit_codes", "final_eval", "robust", "resyncs")}),
              flush=True)
    print(f"wrote {args.out.with_suffix('.md')} (peers' logs in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
