"""Cost of robust aggregation on a clean run: time per all-reduce and error against the exact
weighted mean, for hivemind's plain reducer and shoal's robust one (mean / centered_clip /
trimmed_mean), on one loopback group of real averager processes, in one run.

    .venv/bin/python -m benchmarks.micro.robust_aggregation [--peers 4] [--numel 4194304] [--rounds 5]

Writes ``benchmarks/results/robust_aggregation.{md,json}``. All peers are honest: this measures what a
public run pays for the protection when nobody attacks.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import torch

from averaging.math.robust import RobustConfig
from averaging.network.hivemind.backend import HivemindBackend
from benchmarks.common.results import RESULTS, write_results

OUT = RESULTS / "robust_aggregation"
VARIANTS: dict[str, RobustConfig | None] = {
    "hivemind (plain)": None,
    "robust: mean": RobustConfig(aggregation="mean"),
    "robust: centered_clip": RobustConfig(aggregation="centered_clip"),
    "robust: trimmed_mean": RobustConfig(aggregation="trimmed_mean"),
}


def no_state():
    return {}, [torch.zeros(1)]


def measure(dhts, name: str, robust: RobustConfig | None, *, numel: int, rounds: int,
            vectors: list[torch.Tensor], weights: list[float]) -> tuple[list[float], list[float]]:
    """Seconds per all-reduce (trigger to result, slowest peer) and relative error vs the exact mean."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    backends = [HivemindBackend(dht, numel=numel, prefix=prefix, state_provider=no_state, wire=None,
                                target_group_size=len(dhts), min_group_size=len(dhts), min_matchmaking_time=2.0,
                                request_timeout=1.0, allreduce_timeout=60.0, robust=robust) for dht in dhts]
    exact = sum(w * v.double() for w, v in zip(weights, vectors)) / sum(weights)
    times, errors = [], []
    try:
        with ThreadPoolExecutor(len(dhts)) as pool:
            for round in range(1, rounds + 1):
                scheduled = time.time() + 3.0
                for backend in backends:
                    backend.prepare(round=round, scheduled_time=scheduled, gather={}, timeout=30)
                # Trigger once the group has surely formed, so sync_s is the all-reduce alone.
                time.sleep(max(0.0, scheduled + 1.0 - time.time()))
                results = [v.clone() for v in vectors]
                outcomes = list(pool.map(lambda args: args[0].average(args[1], weight=args[2], timeout=90),
                                         zip(backends, results, weights)))
                if not all(o.ok for o in outcomes):
                    print(f"{name}: round {round} failed: {[o.error for o in outcomes]}", flush=True)
                    continue
                times.append(max(o.sync_s for o in outcomes))
                errors.append(max(float((r.double() - exact).norm() / exact.norm()) for r in results))
                print(f"{name}: round {round}: {times[-1]:.2f}s, error {errors[-1]:.2e}", flush=True)
    finally:
        for backend in backends:
            backend.shutdown()
    return times, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(args.numel, generator=generator)
    vectors = [common + 0.5 * torch.randn(args.numel, generator=generator) for _ in range(args.peers)]
    weights = [1.0 + i for i in range(args.peers)]
    sigint = signal.getsignal(signal.SIGINT)
    dhts = []
    try:
        for _ in range(args.peers):
            initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
        rows = []
        for name, robust in VARIANTS.items():
            times, errors = measure(dhts, name, robust, numel=args.numel, rounds=args.rounds, vectors=vectors,
                                    weights=weights)
            rows.append((name, times, errors))
    finally:
        for dht in dhts:
            dht.shutdown()
        signal.signal(signal.SIGINT, sigint)

    results = {"peers": args.peers, "numel": args.numel, "rounds": args.rounds, "weights": weights,
               "rows": [{"reducer": name, "times": times, "errors": errors} for name, times, errors in rows]}
    write_results(results, OUT, report)
    print(OUT.with_suffix(".md").read_text())


def report(results: dict) -> str:
    numel = results["numel"]
    lines = [
        "# Robust aggregation on a clean run",
        "",
        f"{results['peers']} honest peers on loopback, one group, {numel:,} fp32 values ({numel * 4 / 2**20:.0f} MiB) "
        f"sent as fp16, weights {results['weights']}, {results['rounds']} rounds per variant, all in one run "
        f"(`python -m benchmarks.micro.robust_aggregation`). Time: trigger (after the group formed) to result, slowest "
        "peer; error: the worst peer's relative L2 distance to the exact weighted mean (fp16 wire included).",
        "",
        "| reducer | median s / all-reduce | min s | max s | median error |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        name, times, errors = row["reducer"], row["times"], row["errors"]
        if times:
            lines.append(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} "
                         f"| {statistics.median(errors):.2e} |")
        else:
            lines.append(f"| {name} | failed | | | |")
    lines += ["", "Machine: shared 2-core CPU VM (other jobs running), so times are noisy; compare rows, not runs."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
