"""Overlap vs blocking DiLoCo vs DDP on heterogeneous peers over capped links, side by side.

    sudo .venv/bin/python -m benchmarks.swarm.sync_modes [--peers 4] [--throttles 2,3,4,6] [--mbit 10] [--budget 120]
    sudo .venv/bin/python -m benchmarks.swarm.sync_modes --regimes 0.5,1.5 --modes overlap,blocking,ceiling

``--regimes`` runs the modes once per regime, each with its own link cap, chosen so that a blocking
all-reduce (its bandwidth bound) costs that fraction of a round: 0.5 and 1.5 are the two regimes of
"never idle on slow links". Each regime's table adds, per peer, the rounds it contributed to, the
rounds it stayed out of, its catch-ups and full re-syncs, and its wait in ``begin_sync``.

Each peer runs in its own network namespace (a bridge joins them; every link is capped with
``tc ... tbf``); without root it falls back to loopback with no cap and says so. Four runs on
the same config, data, throttles and wall-clock budget:

- ``overlap``: shoal's default (wall-clock rounds, background all-reduce);
- ``blocking``: H inner steps, then wait for the all-reduce, in lockstep (OpenDiLoCo);
- ``ddp``: torch DDP over gloo, gradients all-reduced every step (fp16 hook);
- ``ceiling``: the same processes, throttles and data training alone, no communication at all.

Writes ``benchmarks/results/sync_modes.md`` (table), ``.json`` (raw) and ``.png`` (eval loss vs
wall-clock; utilization per peer), the PNG if matplotlib is installed (``pip install -e '.[bench]'``);
``--report-only`` (with the run's other flags) redraws them from the ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import tomllib
import uuid
from contextlib import nullcontext
from pathlib import Path

from benchmarks.common import netns
from benchmarks.common.results import CONFIGS, REPO, RESULTS, out_flag, write_results
from benchmarks.common.swarm import eval_at, run_ddp_ranks, start_entry_peer, start_shoal_peers
from examples.swarm_launcher import LocalSwarm, kill_process_group, write_toml
from node.observe.metrics import read_metrics

MODES = ("overlap", "blocking", "ddp", "ceiling")


def mode_config(base: Path, mode: str, peers: int, root: Path) -> Path:
    data = tomllib.loads(base.read_text())
    data.setdefault("round", {})["sync_mode"] = "blocking" if mode == "blocking" else "overlap"
    if mode == "blocking":  # lockstep: nobody averages without the slowest peer
        data.setdefault("averaging", {})["min_group_size"] = peers
    return write_toml(data, root / f"{mode}.toml")


def run_shoal(mode: str, args, hosts, root: Path) -> tuple[dict[str, list[dict]], float, float]:
    config = mode_config(args.config, mode, args.peers, root)
    swarm = LocalSwarm(root / mode, run_id=f"bench-{mode}-{uuid.uuid4().hex[:6]}", cwd=REPO)
    entry = None
    try:
        # All peers start at once through a DHT-only entry peer, as learning.py's do: joining one
        # after the other, a later peer found a step applied and spent its first minutes of the
        # budget downloading the state (116 s at 1.1 Mbit/s), which measured its join, not the
        # sync design. A joiner's download cost is real, and described in the README.
        entry, address = start_entry_peer(root / mode, hosts[0] if hosts else None)
        peers = start_shoal_peers(swarm, config, args.throttles, hosts, initial=address)
        started = time.time()
        time.sleep(args.budget)
        ended = time.time()
        swarm.interrupt_all()
        for peer in peers:
            peer.wait(timeout=120)
        return {p.name: read_metrics(p.metrics_path) for p in peers}, started, ended
    finally:
        swarm.kill_all()
        if entry is not None:
            kill_process_group(entry.proc)


def run_ddp(args, hosts, root: Path, *, no_sync: bool = False) -> tuple[dict[str, list[dict]], float, float]:
    started = time.time()
    records = run_ddp_ranks(args.config, args.throttles, hosts, root, "ceiling" if no_sync else "ddp",
                            budget=["--budget", str(args.budget)], no_sync=no_sync, timeout=args.budget + 300)
    first = min((recs[0]["time"] - recs[0]["elapsed"] for recs in records.values() if recs), default=started)
    return records, first, first + args.budget


def summarize(mode: str, records: dict[str, list[dict]], started: float, ended: float, args, numel: int) -> dict:
    """Per-peer utilization, swarm tokens/s, sync times, and the eval curve of the shared model."""
    window = ended - started
    per_peer, tokens_total, syncs, curve = {}, 0, [], []
    for name, recs in sorted(records.items()):
        rounds = [r for r in recs if r.get("event") == "round" and started <= r["time"] <= ended + 1]
        if mode in ("ddp", "ceiling"):
            last = rounds[-1] if rounds else {"tokens": 0, "compute_s": 0.0, "wall_s": 1.0}
            per_peer[name] = {"utilization": last["compute_s"] / max(last["wall_s"], 1e-9), "tokens": last["tokens"]}
            tokens_total += last["tokens"]
            if name == "peer-0" and mode == "ddp":
                curve = [(r["time"] - started, r["tokens"] * args.peers, r["eval_loss"]) for r in rounds]
            continue
        compute = sum(r["compute_s"] for r in rounds)
        wall = sum(r["wall_s"] for r in rounds)
        tokens = sum(r["tokens"] for r in rounds)
        per_peer[name] = {"utilization": compute / wall if wall else 0.0, "tokens": tokens,
                          "wait_s": sum(r["wait_s"] for r in rounds), "rounds": len(rounds),
                          "contributed": sum(r["applied"] == "averaged" for r in rounds),
                          "skipped": sum(bool(r.get("skipped")) for r in rounds),
                          "catch_ups": sum(r.get("caught_up", 0) > 0 for r in rounds),
                          "resyncs": sum(bool(r["resynced"]) for r in rounds)}
        tokens_total += tokens
        syncs += [r["allreduce_s"] for r in rounds if r["group_size"] == args.peers and r["applied"] == "averaged"]
    if mode in ("overlap", "blocking"):
        # Cumulative swarm tokens at each of peer-0's rounds, against the shared model's eval loss.
        ends = sorted((r["time"], r["tokens"]) for recs in records.values() for r in recs
                      if r.get("event") == "round" and started <= r["time"] <= ended + 1)
        for r in (r for r in records["peer-0"] if r.get("event") == "round" and started <= r["time"] <= ended + 1):
            done = sum(t for when, t in ends if when <= r["time"])
            curve.append((r["time"] - started, done, r["eval_loss"]))
    bound = allreduce_bound(numel, args.peers, args.mbit) if args.mbit else None
    return {"per_peer": per_peer, "tokens_per_s": tokens_total / window, "sync_median_s": statistics.median(syncs) if syncs else None,
            "allreduce_bound_s": bound, "curve": curve, "window_s": window}


def allreduce_bound(numel: int, peers: int, mbit: float) -> float:
    """Seconds a butterfly all-reduce of ``numel`` fp16 values needs at ``mbit`` per link: 2(N-1)/N·S/B."""
    return 2 * (peers - 1) / peers * numel * 2 / (mbit * 1e6 / 8)


def mbit_for(fraction: float, numel: int, peers: int, round_seconds: float) -> float:
    """The link cap at which the all-reduce's bandwidth bound is ``fraction`` of a round."""
    return allreduce_bound(numel, peers, 1.0) / (fraction * round_seconds)


def peer_details(results: dict) -> list[str]:
    """Per peer of each shoal mode: rounds contributed / skipped, catch-ups, re-syncs, wait."""
    lines = ["| mode | peer | utilization | rounds | contributed | stayed out | catch-ups | full re-syncs | wait in begin_sync (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in (m for m in ("overlap", "blocking") if m in results):
        for name, p in results[mode]["per_peer"].items():
            lines.append(f"| {mode} | {name} | {p['utilization']:.1%} | {p['rounds']} | {p.get('contributed', '-')} | "
                         f"{p.get('skipped', '-')} | {p.get('catch_ups', '-')} | {p.get('resyncs', '-')} | "
                         f"{p['wait_s']:.1f} |")
    return lines


def equal_wall_clock(results: dict, modes: list[str]) -> float | None:
    """The latest time every mode in ``modes`` has evaluated by. A mode's last curve point often
    has no eval (evals run every few rounds): read there, blocking had no value at all."""
    lasts = [max((p[0] for p in results[m]["curve"] if p[2] is not None), default=None) for m in modes]
    return None if not lasts or None in lasts else min(lasts)


def report(results: dict, args, capped: bool, numel: int) -> str:
    ceiling = results["ceiling"]["tokens_per_s"] if "ceiling" in results else None
    synced = [m for m in ("overlap", "blocking", "ddp") if m in results and results[m]["curve"]]
    equal_tokens = min((max(p[1] for p in results[m]["curve"]) for m in synced), default=0.0)
    equal_wall = equal_wall_clock(results, synced)
    lines = [
        f"# Sync modes: {args.peers} peers, throttles {', '.join(map(str, args.throttles))}, "
        + (f"links capped at {args.mbit} Mbit/s (tc tbf, network namespaces)" if capped else "loopback, NO bandwidth cap (not root)"),
        "", f"Command: `sudo .venv/bin/python -m benchmarks.swarm.sync_modes --peers {args.peers} --throttles "
        f"{','.join(map(str, args.throttles))} --mbit {args.mbit} --budget {args.budget:g}`; model: {numel:,} parameters "
        f"({args.config.name}); {args.budget:g} s of training per mode, all modes in one run.", "",
        "| mode | utilization per peer | swarm tokens/s | vs ceiling | median all-reduce (s) | eval loss at equal wall-clock | at equal tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in (m for m in MODES if m in results):
        r = results[mode]
        utils = " / ".join(f"{p['utilization']:.0%}" for p in r["per_peer"].values())
        final = eval_at(r["curve"], 0, equal_wall) if r["curve"] and equal_wall is not None else None
        at_tokens = eval_at(r["curve"], 1, equal_tokens) if r["curve"] else None
        sync = f"{r['sync_median_s']:.2f}" if r.get("sync_median_s") else "-"
        share = f"{r['tokens_per_s'] / ceiling:.0%}" if ceiling else "-"
        lines.append(f"| {mode} | {utils} | {r['tokens_per_s']:,.0f} | {share} | {sync} | "
                     f"{'-' if final is None else f'{final:.4f}'} | {'-' if at_tokens is None else f'{at_tokens:.4f}'} |")
    overlap = results.get("overlap", {})
    bound, measured = overlap.get("allreduce_bound_s"), overlap.get("sync_median_s")
    lines += ["", f"All-reduce bandwidth bound 2(N-1)/N·S/B with S = {numel * 2:,} bytes (fp16): "
              + (f"{bound:.2f} s; overlap's median all-reduce is {measured:.2f} s ({measured / bound:.2f}x)."
                 if capped and bound and measured else "n/a (no cap, or no overlap run)."),
              "Equal wall-clock: " + ("-" if equal_wall is None else f"{equal_wall:.0f} s after the mode's start, the "
                                      "latest time every synced mode has an eval point for (interpolated between them).")
              + f" Equal tokens: {equal_tokens:,.0f} swarm tokens (the fewest any synced mode processed).",
              "Utilization = compute_s / wall_s per peer (DDP: calibrated step compute x steps / wall).",
              f"CPU demand of training alone: sum of 1/throttle = {sum(1 / t for t in args.throttles):.2f} cores of "
              f"{os.cpu_count()} (one torch thread per peer): the rest is headroom for the network and the sync.", "",
              *peer_details(results), ""]
    return "\n".join(lines)


def plot(results: dict, path: Path, throttles: list[float]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in (m for m in ("overlap", "blocking", "ddp") if m in results):
        curve = [(t, e) for t, _, e in results[mode]["curve"] if e is not None]
        if curve:
            left.plot(*zip(*curve), marker="o", label=mode)
    left.set_xlabel("wall-clock (s)")
    left.set_ylabel("eval loss (shared model)")
    left.legend()
    left.grid(alpha=0.3)
    width = 0.2
    for i, mode in enumerate(m for m in MODES if m in results):
        utils = [p["utilization"] for p in results[mode]["per_peer"].values()]
        right.bar([j + i * width for j in range(len(utils))], utils, width, label=mode)
    modes = sum(1 for m in MODES if m in results)
    right.set_xticks([j + width * (modes - 1) / 2 for j in range(len(throttles))],
                     [f"peer {j} (x{t:g})" for j, t in enumerate(throttles)])
    right.set_xlabel("peer (throttle)")
    right.set_ylabel("compute utilization")
    right.set_ylim(0, 1.05)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


SPREAD = (1.0, 1.5, 2.0, 3.0)  # issue 12's speed spread: the fastest peer 3x the slowest
TRAINING_SHARE = 0.625  # of the cores: the rest is headroom for the DHT, the all-reduce and p2pd


def default_throttles(peers: int, cores: int) -> list[float]:
    """The spread (repeated for more peers), scaled so that training alone (one torch thread per
    peer at 1/throttle of a core) needs at most ``TRAINING_SHARE`` of the cores: on 2 cores, 4
    peers get 2, 3, 4, 6 (1.25 cores). Otherwise a swarm benchmark measures CPU starvation."""
    spread = [SPREAD[i % len(SPREAD)] for i in range(peers)]
    scale = max(1.0, sum(1 / t for t in spread) / (TRAINING_SHARE * cores))
    return [round(t * scale, 3) for t in spread]


DEFAULT_OUT = RESULTS / "sync_modes"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--throttles", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="one per peer; default: the speed spread 1,1.5,2,3 scaled so that training alone "
                             f"needs at most {TRAINING_SHARE * 100:.0f}%% of this machine's cores")
    parser.add_argument("--mbit", type=float, default=10.0)
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--config", type=Path, default=CONFIGS / "bench.toml")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--regimes", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="all-reduce bound as fractions of a round, e.g. 0.5,1.5 (sets --mbit per regime)")
    parser.add_argument("--report-only", action="store_true", help="redraw the tables and plots from the .json")
    args = parser.parse_args()
    if args.throttles is None:
        args.throttles = default_throttles(args.peers, os.cpu_count() or 1)
    assert len(args.throttles) == args.peers, "one throttle per peer"
    demand = sum(1 / t for t in args.throttles)
    if demand >= (os.cpu_count() or 1):
        print(f"warning: training alone needs {demand:.2f} cores of {os.cpu_count()}: the figures will measure CPU "
              "starvation, not the design; raise --throttles", file=sys.stderr)
    capped = netns.available()
    if not capped and not args.report_only:
        print("not root (or no ip/tc): running on loopback WITHOUT bandwidth caps", file=sys.stderr)
    from node.process.config import load_config
    from node.training.model import build_model, count_parameters

    numel = count_parameters(build_model(load_config(args.config).model, seed=0))
    root = None if args.report_only else Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    if root is not None:
        os.environ.setdefault("SHOAL_CACHE_DIR", str(root / "cache"))
    previous = signal.getsignal(signal.SIGINT)
    round_seconds = load_config(args.config).round.seconds
    regimes = args.regimes or [None]
    texts, everything = [], {}
    base_out = args.out
    base_out.parent.mkdir(parents=True, exist_ok=True)
    out = base_out.with_name(base_out.name + "_regimes") if args.regimes else base_out
    saved = json.loads(out.with_suffix(".json").read_text()) if args.report_only else None
    for regime in regimes:
        if regime is not None:
            args.mbit = mbit_for(regime, numel, args.peers, round_seconds)
            print(f"== regime {regime:g}: all-reduce bound {regime:g} x {round_seconds:g} s -> {args.mbit:.2f} Mbit/s",
                  file=sys.stderr, flush=True)
        key = f"{regime:g}" if regime is not None else "run"
        if saved is not None:
            results = saved[key] if args.regimes else saved
        else:
            results = run_modes(args, capped, root / (f"regime-{regime:g}" if regime is not None else "run"), numel)
            results["capped"] = capped  # for --report-only: whether the links were capped
        everything[key] = results
        text = report(results, args, results.get("capped", False), numel)
        if regime is not None:
            text = (f"## Regime {regime:g}: a blocking all-reduce's bandwidth bound is {regime:g} x the "
                    f"{round_seconds:g} s round ({args.mbit:.2f} Mbit/s)\n\n" + text)
            # "0p5", not "0.5": with_suffix would take ".5" for the suffix and write "..._regime_0.png".
            args.out = base_out.with_name(f"{base_out.name}_regime_{regime:g}".replace(".", "p"))
        if plot(results, args.out.with_suffix(".png"), args.throttles):
            text += f"\n![eval loss and utilization]({args.out.with_suffix('.png').name})\n"
        texts.append(text)
    signal.signal(signal.SIGINT, previous)
    text = "\n\n".join(texts)
    if args.regimes:
        text = (f"# Never idle on slow links: regimes {', '.join(f'{r:g}' for r in args.regimes)}\n\n"
                f"Command: `sudo .venv/bin/python -m benchmarks.swarm.sync_modes --regimes "
                f"{','.join(f'{r:g}' for r in args.regimes)} --modes {','.join(args.modes)} --throttles "
                f"{','.join(f'{t:g}' for t in args.throttles)} --budget {args.budget:g}{out_flag(base_out, DEFAULT_OUT)}`\n\n"
                + text)
    data = everything if args.regimes else everything["run"]
    if saved is not None and "provenance" in saved:
        data["provenance"] = saved["provenance"]
    write_results(data, out, lambda _: text, redraw=args.report_only)
    print(text)
    return 0


def run_modes(args, capped: bool, root: Path, numel: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)  # one folder per regime
    results = {}
    with netns.Network(args.peers, mbit=args.mbit) if capped else nullcontext() as net:
        hosts = net.hosts if net else None
        for mode in args.modes:
            print(f"== {mode}", file=sys.stderr, flush=True)
            if mode in ("ddp", "ceiling"):
                records, started, ended = run_ddp(args, hosts, root, no_sync=mode == "ceiling")
            else:
                records, started, ended = run_shoal(mode, args, hosts, root)
            results[mode] = summarize(mode, records, started, ended, args, numel)
    return results


if __name__ == "__main__":
    sys.exit(main())
