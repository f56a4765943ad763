"""A home machine's faults: what each costs a swarm, and a soak (do memory, threads and files stay flat?).

    .venv/bin/python -m benchmarks.swarm.faults --minutes 60 [--peers 4] [--round-seconds 10] [--throttle 6]
    .venv/bin/python -m benchmarks.swarm.faults --faults split:30,split:180,bootstrap:30,averager:30,skew:5 [--append]

``--faults``: each fault in a fresh 4-peer swarm (``benchmarks.swarm.fault_runs`` says what is injected
and measured): rounds lost and the time to one swarm again. Without it, the soak:

A public run's peers stay up for days: a leak of a few MB an hour, a thread per round or a socket
per re-dial ends in an out-of-memory kill or "too many open files" long after any test has
finished. Every ``--sample-seconds`` this samples each peer's whole process tree (the node, its DHT
and averager processes, their p2pd): resident memory (RSS), threads and open file descriptors; the
peers' own round records say whether they kept averaging. Growth is measured after a warm-up
(``--warmup-minutes``: allocator pools, caches and the first checkpoints settle) from the median
of the first three samples after it to the median of the last three (robust to a sample taken
during a checkpoint or an all-reduce). Target (issue 31): RSS grows < 5% after warm-up.

Loopback, the tiny config, every peer throttled so that the swarm's training needs about one of
the machine's two cores (a soak measures leaks, not starvation). Writes
``benchmarks/results/faults.md`` and ``.json`` (rewritten after every sample, so a run cut short
still reports).

Both modes write ``benchmarks/results/faults.md`` and ``.json``; each keeps the other's last results.
Clock skew is not a fault run here: tests/integration/test_churn.py checks that peers 1 s and
5 s off average in every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import psutil

from benchmarks.common import netns
from benchmarks.common.results import REPO, command_line, provenance, write_results
from benchmarks.common.results import RESULTS as RESULTS_DIR
from benchmarks.common.swarm import CpuMeter, start_entry_peer
from benchmarks.swarm.fault_runs import FAKETIME, Fault, report_lines, run_fault
from examples.swarm_launcher import LocalSwarm, kill_process_group
from node.observe.metrics import read_metrics

RESULTS = RESULTS_DIR / "faults"
TARGET_RSS_GROWTH = 0.05


def tree_usage(pid: int) -> dict[str, float] | None:
    """RSS (MiB), threads and open fds of ``pid`` and its descendants; None once it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    rss = threads = fds = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                threads += proc.num_threads()
                fds += proc.num_fds()
        except psutil.Error:
            continue  # a child that just exited
    return {"rss_mib": rss / 2**20, "threads": threads, "fds": fds, "processes": len(procs)}


def growth(samples: list[dict], key: str, after_s: float) -> dict | None:
    """Median of the first three samples after ``after_s`` against the median of the last three."""
    settled = [s for s in samples if s["t"] >= after_s]
    if len(settled) < 6:
        return None
    first = statistics.median(s[key] for s in settled[:3])
    last = statistics.median(s[key] for s in settled[-3:])
    return {"after_warmup": first, "end": last, "growth": (last - first) / first if first else None}


def averaged_share(metrics: Path, after_round: int) -> tuple[int, int]:
    rounds = [r for r in read_metrics(metrics) if r.get("event") == "round" and r["round"] > after_round]
    return sum(r.get("applied") == "averaged" for r in rounds), len(rounds)


def report(results: dict) -> str:
    """Both sections: the faults' costs and the soak."""
    lines = ["# Faults and soak", ""]
    faults = results.get("faults")
    if faults:
        commands = faults.get("commands") or [{"command": faults["command"], "started": faults["started"],
                                               "ended": faults["ended"]}]
        lines += [f"## Faults: {len(faults['runs'])} runs", "",
                  "Commands: " + "; ".join(f"`{c['command']}` ({c['started']} to {c['ended']} UTC)" for c in commands)
                  + ".", "", "Each fault in a fresh swarm of 4 peers (`tiny.toml`, rounds of "
                  f"{faults['round_seconds']:g} s, throttle {faults['throttle']:g} each), injected once all four averaged "
                  "in one group; measured from the peers' round records up to the first round in which all four "
                  "averaged in one group again (the reunion). Rounds: a peer's rounds from the fault to the reunion, "
                  "*averaged* in a group, *folded* (its work carried into its next contribution: not lost), *absent* "
                  "(no record: the peer was down, its work in those rounds lost). Outer steps merged: its side's "
                  "steps apart, merged into the kept side's anchor through its next contribution when it re-synced at "
                  "the reunion (by the tokens each side trained apart); dropped: the same, where nothing could be "
                  "merged (the `reunion` event; design.md). "
                  "Spread: the "
                  "largest relative distance of a peer's anchor from peer-0's after the round after the reunion. A skew "
                  "run has no fault to end: the clocks are wrong from the start, and it counts the rounds each peer "
                  "averaged in once all four first averaged together.", "",
                  *report_lines(faults["runs"]), ""]
    soak = results.get("soak")
    if soak:
        lines += soak_lines(soak)
    return "\n".join(lines).rstrip("\n") + "\n"


def soak_lines(results: dict) -> list[str]:
    warm = results["warmup_minutes"] * 60
    lines = [f"## Soak: {results['peers']} peers for {results['elapsed_minutes']:.0f} of {results['minutes']} minutes",
             "", f"Command: `{results['command']}` ({results['started']} to {results['ended']} UTC).", "",
             f"Loopback, `tiny.toml`, rounds of {results['round_seconds']:g} s, every peer throttle "
             f"{results['throttle']:g}; one sample of each peer's process tree (node, DHT, averager, p2pd) every "
             f"{results['sample_seconds']:g} s. Growth: the median of the first three samples after a "
             f"{results['warmup_minutes']:g}-minute warm-up against the median of the last three. Target (issue 31): "
             f"RSS grows < {TARGET_RSS_GROWTH:.0%} after warm-up.", "",
             "| peer | RSS after warm-up (MiB) | RSS at end (MiB) | RSS growth | threads (warm-up -> end) "
             "| open fds (warm-up -> end) | rounds averaged after warm-up | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for name, peer in results["per_peer"].items():
        samples = peer["samples"]
        rss, threads, fds = (growth(samples, key, warm) for key in ("rss_mib", "threads", "fds"))
        if rss is None:
            lines.append(f"| {name} | - | - | - | - | - | - | too few samples after warm-up |")
            continue
        ok = rss["growth"] is not None and rss["growth"] < TARGET_RSS_GROWTH
        averaged, total = peer.get("averaged", (0, 0))
        lines.append(f"| {name} | {rss['after_warmup']:.0f} | {rss['end']:.0f} | {rss['growth']:+.1%} "
                     f"| {threads['after_warmup']:.0f} -> {threads['end']:.0f} | {fds['after_warmup']:.0f} -> "
                     f"{fds['end']:.0f} | {averaged} of {total} | {'met' if ok else '**NOT met**'} |")
    cpu = results.get("cpu")
    if cpu:
        lines += ["", f"CPU: the swarm used {cpu['own_cores']:.2f} of 2 cores, the whole machine "
                  f"{cpu['machine_busy_cores']:.2f} (other work on it counts there)."]
    if results["elapsed_minutes"] < results["minutes"]:
        lines += ["", f"Cut short at {results['elapsed_minutes']:.0f} minutes: {results.get('stopped', 'stopped')}."]
    return lines + [""]


def load(out: Path) -> dict:
    """The results file's two sections (a soak-only file of an earlier version: its soak)."""
    path = out.with_suffix(".json")
    data = json.loads(path.read_text()) if path.exists() else {}
    return {"soak": data} if "per_peer" in data else data


def write(results: dict, out: Path, section: str) -> None:
    """Write ``results`` as ``section`` (soak or faults), keeping the other's last results."""
    write_results({**load(out), section: results}, out, report)


def run_faults(args) -> int:
    faults = [Fault.parse(text) for text in args.faults.split(",")]
    if any(f.kind == "split" for f in faults) and not netns.available():
        print("error: split faults need root, ip and tc (network namespaces)", file=sys.stderr)
        return 2
    if any(f.kind == "skew" for f in faults) and FAKETIME is None:
        print("error: skew runs need libfaketime (apt-get install faketime)", file=sys.stderr)
        return 2
    this = {"command": command_line(__spec__.name), "provenance": provenance(),
            "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "ended": ""}
    results = {"round_seconds": args.round_seconds, "throttle": args.throttle, "runs": [], "commands": [this]}
    kept: list[dict] = []
    if args.append:  # the earlier runs of other faults stay (same round length and throttle only)
        earlier = load(args.out).get("faults")
        if earlier and (earlier["round_seconds"], earlier["throttle"]) == (args.round_seconds, args.throttle):
            names = {f.name for f in faults}
            kept = [run for run in earlier["runs"] if run["fault"] not in names]
            results["commands"] = (earlier.get("commands") or [{k: earlier[k] for k in ("command", "started", "ended")}]
                                   ) + [this]
    config = Path(f"/tmp/shoal-faults-{uuid.uuid4().hex[:6]}.toml")
    text = args.config.read_text()
    config.write_text(text.replace("checkpoint_every_rounds = 5", "checkpoint_every_rounds = 1"))  # anchors per round
    try:
        for fault in faults:
            root = Path(f"/tmp/shoal-fault-{fault.kind}-{uuid.uuid4().hex[:6]}")
            print(f"{fault.name} ...", flush=True)
            done = run_fault(fault, root, config, round_s=args.round_seconds, throttle=args.throttle)
            results["runs"] = [run for run in results["runs"] if run["fault"] != fault.name] + [done]
            this["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
            write({**results, "runs": kept + results["runs"]}, args.out, "faults")
            print("\n".join(report_lines(results["runs"][-1:])), flush=True)
    finally:
        config.unlink(missing_ok=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--warmup-minutes", type=float, default=5.0)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--round-seconds", type=float, default=10.0)
    parser.add_argument("--throttle", type=float, default=6.0, help="every peer's; keep the swarm under the cores")
    parser.add_argument("--sample-seconds", type=float, default=30.0)
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "tiny.toml")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--faults", default="", help="split:S,bootstrap:S,averager:S,skew:S (instead of the soak)")
    parser.add_argument("--append", action="store_true", help="keep the earlier results of faults not run now")
    parser.add_argument("--report-only", action="store_true", help="redraw the tables from the .json")
    args = parser.parse_args()
    if args.report_only:
        write_results(load(args.out), args.out, report, redraw=True)
        return 0
    if args.faults:
        return run_faults(args)
    root = Path(f"/tmp/shoal-soak-{uuid.uuid4().hex[:6]}")
    root.mkdir(parents=True)
    results = {"command": command_line(__spec__.name), "provenance": provenance(), "minutes": args.minutes,
               "warmup_minutes": args.warmup_minutes, "peers": args.peers, "round_seconds": args.round_seconds,
               "throttle": args.throttle, "sample_seconds": args.sample_seconds, "elapsed_minutes": 0.0,
               "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "per_peer": {}}
    swarm = LocalSwarm(root, run_id=f"soak-{uuid.uuid4().hex[:6]}", cwd=REPO)
    entry = None
    try:
        with CpuMeter() as cpu:
            entry, address = start_entry_peer(root, None)
            peers = [swarm.start(f"peer-{i}", "--throttle", str(args.throttle), "--round-seconds",
                                 str(args.round_seconds), config=args.config, initial=address)
                     for i in range(args.peers)]
            for peer in peers:
                peer.wait_for_address(timeout=180)
                results["per_peer"][peer.name] = {"samples": []}
            began = time.monotonic()
            while (elapsed := time.monotonic() - began) < args.minutes * 60:
                for peer in peers:
                    usage = tree_usage(peer.proc.pid)
                    if usage is None or peer.proc.poll() is not None:
                        results["stopped"] = f"{peer.name} exited with {peer.proc.poll()}"
                        raise StopIteration
                    results["per_peer"][peer.name]["samples"].append({"t": elapsed, **usage})
                results["elapsed_minutes"] = elapsed / 60
                results["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
                write(results, args.out, "soak")
                time.sleep(args.sample_seconds)
            results["elapsed_minutes"] = (time.monotonic() - began) / 60
    except (StopIteration, KeyboardInterrupt) as stop:
        results.setdefault("stopped", "interrupted" if isinstance(stop, KeyboardInterrupt) else "a peer exited")
    finally:
        swarm.interrupt_all()
        for peer in swarm.peers:
            peer.wait(timeout=60)
        swarm.kill_all()
        if entry is not None:
            kill_process_group(entry.proc)
    results["cpu"] = cpu.summary()
    warm_round = int(args.warmup_minutes * 60 / args.round_seconds)
    for peer in swarm.peers:
        if peer.name in results["per_peer"] and peer.metrics_path.exists():
            results["per_peer"][peer.name]["averaged"] = averaged_share(peer.metrics_path, warm_round)
    results["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    write(results, args.out, "soak")
    print("\n".join(soak_lines(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
