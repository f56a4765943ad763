"""All-reduce time against its bandwidth bound for 1, 10 and 50 MB vectors, CPU idle (issue 12).

Each peer is a process in its own network namespace (``benchmarks.common.netns``: a bridge, links
capped with ``tc tbf`` both ways) running a DHT and a ``HivemindBackend`` exactly as shoal runs it
(fp16 on the wire, balanced parts, robust aggregation); nothing trains. Every round all peers
prepare the same scheduled time and average one vector; the figure is the backend's
``allreduce_s`` (from the scheduled start, or the trigger if later, to the result), against the
bound of a butterfly all-reduce, 2(N-1)/N·S/B for S bytes on links of B bytes/s.

Beside each size it reports how full the links were during the all-reduces (sysfs byte counters,
``netns.LinkTimeline``), the bytes each peer sent against the payload, the drops at the caps, and
a plain TCP all-to-all of the same bytes between the same namespaces (``netns.tcp_all_to_all``:
one flow per ordered pair, all at once, no hivemind or p2pd): the transport's own baseline, so a
gap to the bound can be told apart into what the all-reduce adds and what TCP on these links costs.

    sudo .venv/bin/python -m benchmarks.swarm.allreduce_sizes            # 4 peers, 100 Mbit/s, 1/10/50 MB
    sudo .venv/bin/python -m benchmarks.swarm.allreduce_sizes --mbit 50 --sizes 1,10 --rounds 5

Writes ``benchmarks/results/allreduce_sizes.{json,md}``. Needs root (namespaces); without it,
says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks.common import netns
from benchmarks.common.results import REPO, RESULTS, out_flag, write_results
from benchmarks.common.swarm import BusyTimeline

BYTES_PER_VALUE = 2  # fp16 on the wire (WireFormat's default codec)
# Issue 12's targets, as (smallest, largest MB, at most this many times the bound).
TARGETS = ((1.0, 3.0, 1.5), (10.0, float("inf"), 1.2))
DEFAULT_OUT = RESULTS / "allreduce_sizes"


def target_for(size_mb: float) -> float | None:
    return next((ratio for low, high, ratio in TARGETS if low <= size_mb <= high), None)


def allreduce_bound(size_bytes: int, peers: int, mbit: float) -> float:
    """Seconds for a butterfly all-reduce of ``size_bytes`` over ``peers`` links of ``mbit``."""
    return 2 * (peers - 1) / peers * size_bytes / (mbit * 1e6 / 8)


# -- one peer (runs inside its namespace) -----------------------------------------------------------
def worker(args) -> int:
    import hivemind
    import torch

    from averaging.network.hivemind.backend import HivemindBackend

    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.address}/tcp/0"],
                       initial_peers=[args.initial] if args.initial else [])
    if not args.initial:
        print(next(str(a) for a in dht.get_visible_maddrs()), flush=True)
    timeout = max(30.0, 6 * args.bound)
    backend = HivemindBackend(dht, numel=args.numel, prefix=args.prefix, state_provider=lambda: ({}, [torch.zeros(1)]),
                              target_group_size=args.peers, min_group_size=args.peers, min_matchmaking_time=3.0,
                              request_timeout=1.5, allreduce_timeout=timeout)
    vector = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.index))
    results = []
    try:
        for k in range(args.rounds):
            scheduled = args.start + k * args.period
            time.sleep(max(0.0, scheduled - 4.5 - time.time()))
            backend.prepare(round=k + 1, scheduled_time=scheduled, gather={"i": args.index}, timeout=8.0)
            time.sleep(max(0.0, scheduled - time.time()))
            result = vector.clone()
            outcome = backend.average(result, weight=1.0, timeout=timeout + 10, round=k + 1)
            results.append({"round": k + 1, "ok": outcome.ok, "group": len(outcome.group),
                            "allreduce_s": round(outcome.allreduce_s, 3), "error": outcome.error})
    finally:
        backend.shutdown()
        dht.shutdown()
    Path(args.out).write_text(json.dumps(results))
    return 0


# -- the driver ---------------------------------------------------------------------------------------
def measure(size_mb: float, args, net: netns.Network, root: Path) -> dict:
    size_bytes = int(size_mb * 1e6)
    numel = size_bytes // BYTES_PER_VALUE
    bound = allreduce_bound(size_bytes, args.peers, args.mbit)
    period = 8.0 + 3 * bound  # room for the all-reduce and the next matchmaking
    start = time.time() + 25.0  # the peers' start-up (DHT, averager fork)
    prefix = f"sizes-{uuid.uuid4().hex[:6]}"
    procs, outs = [], []
    try:
        initial = ""
        for i, host in enumerate(net.hosts):
            out = root / f"{size_mb:g}mb-{i}.json"
            outs.append(out)
            command = [*host.prefix(), sys.executable, "-m", __spec__.name, "--worker", "--index", str(i), "--address",
                       host.address, "--peers", str(args.peers), "--numel", str(numel), "--rounds", str(args.rounds),
                       "--start", str(start), "--period", str(period), "--prefix", prefix, "--bound", str(bound),
                       "--out", str(out)] + (["--initial", initial] if initial else [])
            proc = subprocess.Popen(command, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL, text=True,
                                    cwd=REPO)
            procs.append(proc)
            if i == 0:
                initial = proc.stdout.readline().strip()
                if not initial:
                    raise RuntimeError("the first peer printed no address")
        deadline = start + args.rounds * period + 120
        with BusyTimeline() as busy, netns.LinkTimeline(net) as links:
            drops_before = links.drops()
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            drops = [after - before for before, after in zip(drops_before, links.drops())]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    per_peer = [json.loads(out.read_text()) if out.exists() else [] for out in outs]
    times = [r["allreduce_s"] for rounds in per_peer for r in rounds if r["ok"] and r["group"] == args.peers]
    failed = sum(not r["ok"] for rounds in per_peer for r in rounds)
    median = statistics.median(times) if times else None
    # Busy cores while the all-reduces ran (each round from its scheduled start, for its median
    # length): near the machine's cores, the figure measures CPU, not the network.
    windows = [busy.cores_between(start + k * period, start + k * period + median) for k in range(args.rounds)] \
        if median else []
    windows = [w for w in windows if w is not None]
    # How full the links were in the same windows: below the cap on idle CPU, the time went to the
    # transport (TCP recovering from drops at the cap), not to the all-reduce's payload.
    use = [links.between(start + k * period, start + k * period + median) for k in range(args.rounds)] \
        if median else []
    use = [u for u in use if u is not None]
    # The same bytes as plain TCP flows between the same namespaces (no hivemind, no p2pd): what
    # the links and the kernel's TCP allow an all-to-all of this size.
    tcp = [netns.tcp_all_to_all(net, 2 * size_bytes // args.peers, sys.executable) for _ in range(args.tcp_runs)]
    return {"size_mb": size_mb, "numel": numel, "bound_s": round(bound, 3), "median_s": median,
            "ratio": round(median / bound, 2) if median else None, "min_s": min(times, default=None),
            "max_s": max(times, default=None), "samples": len(times), "failed": failed,
            "busy_cores": round(statistics.mean(windows), 2) if windows else None, "cores": os.cpu_count(),
            "upload_use": round(statistics.mean(u["upload_use"] for u in use), 3) if use else None,
            "download_use": round(statistics.mean(u["download_use"] for u in use), 3) if use else None,
            "upload_drops": round(drops[0] / args.rounds), "download_drops": round(drops[1] / args.rounds),
            "tcp_s": round(statistics.median(tcp), 3) if tcp else None,
            "upload_mb": round(statistics.mean(u["upload_bytes"] for u in use) / 1e6 / args.peers, 2) if use else None,
            # Upload use per host through the last round (start-up excluded): where the links idled.
            "trace": links.rates(start + (args.rounds - 1) * period - 1, start + (args.rounds - 1) * period + 1.3 * median)
            if median else []}


def busy_cell(result: dict) -> str:
    if result.get("busy_cores") is None:
        return "-"
    return f"{result['busy_cores']:.2f} of {result['cores']}"


def tcp_cells(result: dict) -> str:
    """The plain TCP all-to-all's time and the all-reduce against it."""
    tcp, median = result.get("tcp_s"), result.get("median_s")
    if not tcp:
        return "- | -"
    return f"{tcp:.2f} ({tcp / result['bound_s']:.2f}x) | " + (f"{median / tcp:.2f}x" if median else "-")


def link_cells(result: dict, peers: int) -> str:
    """Link use, bytes each peer uploaded against the all-reduce's payload, drops (all per
    all-reduce, in its median window); dashes for a run that did not sample its links."""
    if result.get("upload_use") is None:
        return "- | - | -"
    payload = 2 * (peers - 1) / peers * result["size_mb"]
    return (f"{result['upload_use']:.0%} / {result['download_use']:.0%} | {result['upload_mb']:.2f} ({payload:.2f}) "
            f"| {result['upload_drops']:,} / {result.get('download_drops', 0):,}")


def report(results: list[dict], args) -> str:
    sizes = ",".join(f"{r['size_mb']:g}" for r in results)
    lines = [f"# All-reduce vs bandwidth bound: {args.peers} peers, links capped at {args.mbit:g} Mbit/s, CPU idle", "",
             f"Command: `sudo .venv/bin/python -m benchmarks.swarm.allreduce_sizes --peers {args.peers} --mbit {args.mbit:g} "
             f"--sizes {sizes} --rounds {args.rounds}{out_flag(args.out, DEFAULT_OUT)}`; fp16 on the wire, "
             "robust aggregation on (as shipped); bound 2(N-1)/N·S/B.", "",
             "| vector | bound (s) | median all-reduce (s) | min / max (s) | ratio | target | TCP all-to-all (s) "
             "| all-reduce / TCP | samples | failed "
             "| busy cores during the all-reduces | link use up / down | MB sent per peer (payload) "
             "| packets dropped at the caps per round (up / down) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        limit = target_for(r["size_mb"])
        target = "-" if limit is None else f"≤ {limit}x" + ("" if r["ratio"] is None or r["ratio"] <= limit else " (missed)")
        median = f"{r['median_s']:.2f}" if r["median_s"] is not None else "-"
        spread = f"{r['min_s']:.2f} / {r['max_s']:.2f}" if r["samples"] else "-"
        lines.append(f"| {r['size_mb']:g} MB | {r['bound_s']:.2f} | {median} | {spread} | "
                     f"{r['ratio'] if r['ratio'] is not None else '-'}x | {target} | {tcp_cells(r)} | {r['samples']} "
                     f"| {r['failed']} "
                     f"| {busy_cell(r)} | {link_cells(r, args.peers)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 10.0, 50.0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tcp-runs", type=int, default=2, help="plain TCP all-to-alls of each size (0: none)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json of a past run")
    # a peer's own arguments (the driver passes them)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name, kind in (("index", int), ("address", str), ("initial", str), ("numel", int), ("start", float),
                       ("period", float), ("prefix", str), ("bound", float)):
        parser.add_argument(f"--{name}", type=kind, default=None, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        args.out = str(args.out)
        return worker(args)
    if args.report_only:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        args.peers, args.mbit = saved["peers"], saved["mbit"]
        args.rounds = saved.get("rounds", args.rounds)
        write_results(saved, args.out, lambda r: report(r["results"], args), redraw=True, indent=2)
        return 0
    if not netns.available():
        print("allreduce_sizes needs root (network namespaces and tc); run it with sudo", file=sys.stderr)
        return 2
    root = Path("/tmp") / f"shoal-allreduce-sizes-{uuid.uuid4().hex[:6]}"
    root.mkdir(parents=True)
    results = []
    with netns.Network(args.peers, mbit=args.mbit) as net:
        for size in args.sizes:
            results.append(measure(size, args, net, root))
            print(json.dumps(results[-1]), flush=True)
    write_results({"peers": args.peers, "mbit": args.mbit, "rounds": args.rounds, "results": results}, args.out,
                  lambda r: report(r["results"], args), indent=2)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
