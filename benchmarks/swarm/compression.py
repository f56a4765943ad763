"""fp16 vs int8 / int4 / int2 pseudo-gradients, each with and without error feedback, side by side.

    sudo .venv/bin/python -m benchmarks.swarm.compression [--peers 3] [--mbit 20] [--budget 110] [--throttle 2]
        [--variants fp16,int4+EF,int4+EF+ret4]

Each variant is a real swarm of ``shoal run`` processes, one per network namespace, every link
capped with ``tc ... tbf`` (``benchmarks.common.netns``; without root: loopback, no cap, and it says
so), training the same ~3.2M-parameter model (13 MB of fp32 per all-reduce vector) on the same
data for the same wall-clock budget, one after the other in one run. One torch thread per peer,
steps stretched by ``--throttle`` so training leaves CPU headroom (measured and reported).

Per variant: bytes per round (from the round records: sends and returns each in their code),
median all-reduce time, eval loss of the shared model at equal swarm tokens and at equal
wall-clock, anchor drift between peers at the end (RMS difference of their final checkpoints
relative to how far the anchor moved from its init; and rounds the consistency check flagged).

Writes ``benchmarks/results/compression.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import tomllib
import uuid
from contextlib import nullcontext
from pathlib import Path

import psutil
import torch

from benchmarks.common import netns
from benchmarks.common.results import CONFIGS, REPO, RESULTS, write_results
from benchmarks.common.swarm import eval_at
from examples.swarm_launcher import LocalSwarm, write_toml
from node.library.checkpoint import load_latest_valid
from node.observe.metrics import read_metrics

# (name, compression, error feedback, return code); fp16 has no error feedback (its rounding is
# ~2**-11 relative). Returns are fp16 deltas unless the name says "+retN": reducers then return the
# average itself in intN (the same bytes for every member, docs/codecs.md).
VARIANTS = (("fp16", "fp16", False, "fp16"), ("int8+EF", "int8", True, "fp16"), ("int8", "int8", False, "fp16"),
            ("int4+EF", "int4", True, "fp16"), ("int4", "int4", False, "fp16"), ("int2+EF", "int2", True, "fp16"),
            ("int2", "int2", False, "fp16"), ("int8+EF+ret8", "int8", True, "int8"),
            ("int4+EF+ret4", "int4", True, "int4"), ("int2+EF+ret4", "int2", True, "int4"))
MODEL = {"d_model": 256, "n_layer": 4, "n_head": 4, "seq_len": 64}


def variant_config(base: Path, compression: str, feedback: bool, returns: str, root: Path, name: str,
                   round_seconds: float) -> Path:
    data = tomllib.loads(base.read_text())
    data["model"].update(MODEL)
    # A re-sync downloads anchor + momentum (26 MB: ~11 s at 20 Mbit/s); in a shorter round the peer
    # misses the next round while downloading, lags one outer step, diverges again: a re-sync loop.
    data["round"]["seconds"] = round_seconds
    data["data"]["batch_size"] = 8
    averaging = data.setdefault("averaging", {})
    averaging["compression"] = compression
    if compression != "fp16":
        averaging["error_feedback"] = feedback
        averaging["return_compression"] = returns
    return write_toml(data, root / f"{name.replace('+', '-')}.toml")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their descendants (p2pd, averager, DHT)."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def run_variant(name: str, config: Path, args, hosts, root: Path) -> dict:
    swarm = LocalSwarm(root / name, run_id=f"bench-{uuid.uuid4().hex[:6]}", cwd=REPO)
    try:
        peers = []
        for i in range(args.peers):
            host = hosts[i] if hosts else None
            listen = f"/ip4/{host.address}/tcp/0" if host else "/ip4/127.0.0.1/tcp/0"
            initial = [m for m in peers[0].maddrs if host is None or hosts[0].address in m][:1] if i else None
            peer = swarm.start(f"peer-{i}", "--throttle", str(args.throttle), config=config, initial=initial,
                               prefix=host.prefix() if host else None, listen=listen)
            peer.wait_for_address(timeout=180)
            peers.append(peer)
        pids = [p.proc.pid for p in peers]
        cpu_before, started = cpu_seconds(pids), time.time()
        time.sleep(args.budget)
        cpu_used, ended = cpu_seconds(pids) - cpu_before, time.time()
        swarm.interrupt_all()
        for peer in peers:
            peer.wait(timeout=120)
        records = {p.name: read_metrics(p.metrics_path) for p in peers}
        anchors = {}
        for peer in peers:
            checkpoint = load_latest_valid(peer.checkpoint_dir)
            if checkpoint is not None:
                anchors[peer.name] = (checkpoint.round, torch.cat([t.flatten() for t in checkpoint.params.values()]))
        return summarize(records, anchors, started, ended, cpu_used, args)
    finally:
        swarm.kill_all()


def summarize(records: dict[str, list[dict]], anchors: dict, started: float, ended: float, cpu_used: float,
              args) -> dict:
    rounds = {name: [r for r in recs if r.get("event") == "round" and started <= r["time"] <= ended + 1]
              for name, recs in records.items()}
    full = [r for recs in rounds.values() for r in recs if r["group_size"] == args.peers and r["applied"] == "averaged"]
    # Cumulative swarm tokens at each of peer-0's rounds, against the shared model's eval loss.
    ends = sorted((r["time"], r["tokens"]) for recs in rounds.values() for r in recs)
    curve = [(r["time"] - started, sum(t for when, t in ends if when <= r["time"]), r["eval_loss"])
             for r in rounds.get("peer-0", [])]
    drift = None
    same_round = [a for _, a in anchors.values()] if len({r for r, _ in anchors.values()}) == 1 else []
    if len(same_round) >= 2:
        pairs = [float((x - y).square().mean().sqrt()) for x, y in itertools.combinations(same_round, 2)]
        drift = max(pairs)
    return {
        "rounds": {name: len(recs) for name, recs in rounds.items()},
        "full_group_rounds": len(full) // max(args.peers, 1),
        "bytes_sent_per_round": statistics.median(r["bytes_sent"] for r in full) if full else None,
        "bytes_received_per_round": statistics.median(r["bytes_received"] for r in full) if full else None,
        "allreduce_median_s": statistics.median(r["allreduce_s"] for r in full) if full else None,
        "tokens_per_s": sum(r["tokens"] for recs in rounds.values() for r in recs) / (ended - started),
        "diverged_rounds": sum(1 for recs in rounds.values() for r in recs if r["diverged"]),
        "resyncs": sum(1 for recs in rounds.values() for r in recs if r["resynced"]),
        "anchor_rms_diff": drift,
        "anchor_rms": float(same_round[0].square().mean().sqrt()) if same_round else None,
        "cpu_cores_used": cpu_used / (ended - started),
        "curve": curve,
    }


def report(results: dict, args, capped: bool, numel: int, load: tuple[float, float, float]) -> str:
    curves = [r["curve"] for r in results.values() if r["curve"]]
    equal_tokens = min((max(p[1] for p in c) for c in curves), default=0.0)
    equal_wall = min((max(p[0] for p in c if p[2] is not None) for c in curves if any(p[2] for p in c)), default=0.0)
    base = results.get("fp16", {})
    lines = [
        f"# Compression: {args.peers} peers, "
        + (f"links capped at {args.mbit:g} Mbit/s (tc tbf, network namespaces)" if capped else "loopback, NO cap (not root)"),
        "", f"Command: `sudo .venv/bin/python -m benchmarks.swarm.compression --peers {args.peers} --mbit {args.mbit:g} "
        f"--budget {args.budget:g} --throttle {args.throttle:g} --round-seconds {args.round_seconds:g}`; model {numel:,} parameters ({numel * 4 / 1e6:.1f} MB "
        f"fp32); {args.budget:g} s of overlap-mode training per variant, all variants in one run; returns are fp16 "
        "deltas, or with +retN the average itself in intN. "
        f"Load average at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (2 cores, shared with other work).", "",
        "| variant | bytes sent / round | received / round | vs fp16 | median all-reduce (s) | vs fp16 | "
        "eval loss at equal tokens | vs fp16 | at equal wall-clock | anchor RMS diff (rel. to anchor RMS) | "
        "diverged / resyncs | full rounds | CPU cores used |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_tokens = eval_at(base["curve"], 1, equal_tokens) if base.get("curve") else None
    for name, r in results.items():
        at_tokens = eval_at(r["curve"], 1, equal_tokens) if r["curve"] else None
        at_wall = eval_at(r["curve"], 0, equal_wall) if r["curve"] else None
        sent, received, allreduce = r["bytes_sent_per_round"], r["bytes_received_per_round"], r["allreduce_median_s"]
        bytes_ratio = f"{base['bytes_sent_per_round'] / sent:.2f}x less" if sent and base.get("bytes_sent_per_round") else "-"
        time_ratio = (f"{base['allreduce_median_s'] / allreduce:.2f}x faster"
                      if allreduce and base.get("allreduce_median_s") else "-")
        loss_ratio = f"{(at_tokens / base_tokens - 1):+.2%}" if at_tokens and base_tokens else "-"
        drift = (f"{r['anchor_rms_diff']:.2e} ({r['anchor_rms_diff'] / r['anchor_rms']:.1e})"
                 if r["anchor_rms_diff"] is not None and r["anchor_rms"] else "-")
        lines.append(
            f"| {name} | {sent / 1e6 if sent else 0:.2f} MB | {received / 1e6 if received else 0:.2f} MB | {bytes_ratio} | "
            f"{'-' if allreduce is None else f'{allreduce:.2f}'} | {time_ratio} | "
            f"{'-' if at_tokens is None else f'{at_tokens:.4f}'} | {loss_ratio} | "
            f"{'-' if at_wall is None else f'{at_wall:.4f}'} | {drift} | {r['diverged_rounds']} / {r['resyncs']} | "
            f"{r['full_group_rounds']} | {r['cpu_cores_used']:.2f} of 2 |")
    lines += ["", "Summary (the table in docs/benchmarks.md):", "", *summary_table(lines)]
    lines += ["", f"Equal tokens: {equal_tokens:,.0f} swarm tokens (the fewest any variant reached); equal "
              f"wall-clock: {equal_wall:.0f} s after the last peer started. Eval loss is peer-0's held-out loss of the "
              "shared model (linear interpolation between rounds).",
              "Bytes are this peer's all-reduce payload per full-group round as the round records count them "
              "(`averaging.math.wire.round_payload`: sends in the codec, returns in the return code, headers excluded).",
              "CPU cores used: all peer processes with their DHT, averager and p2pd, over the training window.", ""]
    return "\n".join(lines)


def summary_table(lines: list[str]) -> list[str]:
    """The full table's rows, cut to the columns the README shows."""
    out = ["| variant | bytes sent / round | median all-reduce (s) | eval loss at equal tokens | at equal wall-clock "
           "| flagged / resyncs |", "|---|---|---|---|---|---|"]
    for line in lines:
        if line.startswith("| ") and not line.startswith("| variant"):
            c = [cell.strip() for cell in line.strip("|").split("|")]
            out.append(f"| {c[0]} | {c[1]} ({c[3]}) | {c[4]} ({c[5]}) | {c[6]} ({c[7]}) | {c[8]} | {c[10]} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--mbit", type=float, default=20.0)
    parser.add_argument("--budget", type=float, default=110.0)
    parser.add_argument("--throttle", type=float, default=2.0)
    parser.add_argument("--round-seconds", type=float, default=24.0)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=[v[0] for v in VARIANTS])
    parser.add_argument("--config", type=Path, default=CONFIGS / "bench.toml")
    parser.add_argument("--out", type=Path, default=RESULTS / "compression")
    args = parser.parse_args()
    capped = netns.available()
    if not capped:
        print("not root (or no ip/tc): running on loopback WITHOUT bandwidth caps", file=sys.stderr)
    from node.process.config import load_config
    from node.training.model import build_model, count_parameters

    root = Path(tempfile.mkdtemp(prefix="shoal-compression-"))
    os.environ.setdefault("SHOAL_CACHE_DIR", str(root / "cache"))
    chosen = [v for v in VARIANTS if v[0] in args.variants]
    configs = {name: variant_config(args.config, code, feedback, returns, root, name, args.round_seconds)
               for name, code, feedback, returns in chosen}
    numel = count_parameters(build_model(load_config(next(iter(configs.values()))).model, seed=0))
    results = {}
    with netns.Network(args.peers, mbit=args.mbit) if capped else nullcontext() as net:
        hosts = net.hosts if net else None
        for name in configs:
            print(f"== {name}", file=sys.stderr, flush=True)
            results[name] = run_variant(name, configs[name], args, hosts, root)
            print(json.dumps({k: v for k, v in results[name].items() if k != "curve"}), file=sys.stderr, flush=True)
    text = report(results, args, capped, numel, os.getloadavg())
    write_results({"numel": numel, "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, args.out,
                  lambda _: text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
