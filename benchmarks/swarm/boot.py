"""What one peer's start costs: wall and CPU seconds from ``shoal run`` to its ``start`` record.

    .venv/bin/python -m benchmarks.swarm.boot [--runs 5]

Boot CPU is what delays joining when many peers start on one machine (issue 32's join time: 16
peers started at once on 2 cores spent ~60 s booting) and what every test swarm pays per process.
Each run is a fresh organiser of its own run (tiny config, loopback), measured over its whole
process tree (the peer, its DHT and averager processes, p2pd) with psutil until the ``start``
record, then killed. Runs alternate between the default start and ``SHOAL_DEFER_IMPORTS=0`` (hivemind's
``scipy.optimize`` imported eagerly, as before ``node.library.deferred_imports``), side by side on
the same machine. Writes ``benchmarks/results/boot.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common.results import REPO, RESULTS, command_line, write_results
from node.observe.metrics import read_metrics

VARIANTS = {"deferred (default)": {}, "eager (SHOAL_DEFER_IMPORTS=0)": {"SHOAL_DEFER_IMPORTS": "0"}}


def boot_once(env: dict[str, str]) -> dict[str, float]:
    """One peer's start: wall seconds to its ``start`` record and its process tree's CPU seconds."""
    with tempfile.TemporaryDirectory(prefix="shoal-boot-") as work:
        metrics = Path(work) / "metrics.jsonl"
        command = [sys.executable, "-m", "node.cli", "run", "--no-ui", "--metrics-file", str(metrics),
                   "--listen", "/ip4/127.0.0.1/tcp/0", "--max-rounds", "1"]
        started = time.time()
        log = open(Path(work) / "log.txt", "w")  # noqa: SIM115 - closed with the directory
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        cpu: dict[int, float] = {}
        try:
            root = psutil.Process(proc.pid)
            while proc.poll() is None and time.time() - started < 120:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        times = p.cpu_times()
                        cpu[p.pid] = times.user + times.system
                    except psutil.Error:
                        pass
                if metrics.exists() and any(r.get("event") == "start" for r in read_metrics(metrics)):
                    break
                time.sleep(0.05)
            wall = time.time() - started
        finally:
            exited = proc.poll()
            if exited is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()
        if exited is not None:
            tail = (Path(work) / "log.txt").read_text(errors="replace").strip().splitlines()[-1:]
            raise SystemExit(f"shoal run exited ({exited}) before its start record: {' '.join(tail)}")
    return {"wall_s": wall, "cpu_s": sum(cpu.values())}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5, help="starts per variant, alternating")
    parser.add_argument("--out", type=Path, default=RESULTS / "boot")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.runs):
        for name, env in VARIANTS.items():
            runs[name].append(boot_once(env))
            print(f"{name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    command = command_line(__spec__.name)

    def report(results: dict) -> str:
        lines = ["# One peer's start (`shoal run`, tiny config, loopback) to its `start` record", "",
                 f"Command: `{results['command']}`. {args.runs} starts per variant, alternating, on this machine "
                 "(2 cores, shared); CPU is the whole process tree's (peer, DHT, averager, p2pd).", "",
                 "| start | wall s (median; range) | CPU core-s (median; range) |", "|---|---|---|"]
        for name, points in results["runs"].items():
            wall, cpu = [p["wall_s"] for p in points], [p["cpu_s"] for p in points]
            lines.append(f"| {name} | {statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}) | "
                         f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) |")
        return "\n".join(lines) + "\n"

    results = {"command": command, "runs": runs}
    write_results(results, args.out, report)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
