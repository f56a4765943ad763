"""What the swarm's bookkeeping costs each peer as the swarm grows: the DHT traffic of the
heartbeat (``node.library.monitor``), with and without the limits issue 32 added.

Each peer here is what a ``shoal run`` peer runs for its bookkeeping and nothing else: a real
hivemind DHT node started as the node starts it (``start_dht``: shoal's record validators, its
own libp2p key, a p2pd), the run joined through ``join_run`` (peer 0 organises), and a real
``PeerMonitor`` publishing a progress record of a real peer's size (two dialable addresses) and
reading everyone's. No training and no averager: the figures are the heartbeat's alone, so many
peers fit on this 2-core machine (each is 2 processes).

Two policies, side by side in one run, on the same swarm sizes:

- ``before``: every heartbeat publishes the progress record *and the manifest*, reads *all
  manifests* and all progress records, at a fixed period, and hivemind caches values (every
  lookup then collects a copy from each node it visits);
- ``after`` (today's defaults): no value cache (``node.library.dht.CACHE_VALUES``), the heartbeat
  slows past 16 live peers (``heartbeat_period``), the manifest is republished about once a heartbeat
  by the swarm as a whole, and read only while a new organiser may still converge (its first minute);
- ``idle``: the same DHT nodes with no heartbeat at all (hivemind's own upkeep).

Per peer: the DHT process's and its p2pd's I/O (``/proc/<pid>/io`` rchar + wchar: the DHT's RPCs
through p2pd's unix socket, p2pd's loopback TCP to the other peers) and CPU, over a window after
warm-up; the heartbeat period reached; the records read per second. The hotspot: the busiest
peer's DHT I/O against the median (the nodes nearest the run's keys serve every read).

    .venv/bin/python -m benchmarks.swarm.dht_load --peers 4,8,16,32 --seconds 45 --warmup 15
    .venv/bin/python -m benchmarks.swarm.dht_load --peers 8,16,32 --policies after --bootstraps 2 --append
    .venv/bin/python -m benchmarks.swarm.dht_load --peers 32 --policies after --shards 1,4 --out benchmarks/results/dht_shards
    .venv/bin/python -m benchmarks.swarm.dht_load --peers 48,32 --policies after --seconds 45 --warmup 45 \
        --shards 1,4,auto --out benchmarks/results/dht_shards_auto

Results: ``benchmarks/results/dht_load.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.common.results import RESULTS as RESULTS_DIR
from benchmarks.common.results import out_flag, provenance, write_results

RESULTS = RESULTS_DIR / "dht_load"
RUN_ID = "dhtload"
BASE_PERIOD_S = 10.0 / 3  # the heartbeat of 10 s rounds (node.library.swarm: a third of a round, 1-5 s)
POLICIES = {
    "idle": None,  # DHT nodes that joined the run and publish nothing after: hivemind's own upkeep
    "before": {"heartbeat_peers": None, "manifest_publishers": None, "read_manifests": True},
    "after": {},  # PeerMonitor's defaults
}
CACHES_VALUES = {"before": True}  # hivemind's value cache (node.library.dht.CACHE_VALUES): off after
ADDRS = 2  # dialable addresses in a record, as a peer on two interfaces publishes


@dataclass
class Counted:
    """A ``DhtDirectory`` that counts what the monitor reads."""

    inner: object
    progress_reads: int = 0
    records_read: int = 0
    manifest_reads: int = 0
    manifest_writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def progress(self):
        found = self.inner.progress()
        with self.lock:
            self.progress_reads += 1
            self.records_read += len(found[0])
        return found

    def manifests(self):
        with self.lock:
            self.manifest_reads += 1
        return self.inner.manifests()

    def publish_manifest(self, ours, *, ttl):
        with self.lock:
            self.manifest_writes += 1
        self.inner.publish_manifest(ours, ttl=ttl)


def _processes(dht) -> list[psutil.Process]:
    """The DHT's process and its p2pd (its child)."""
    root = psutil.Process(dht.pid)
    return [root, *root.children(recursive=True)]


def _sample(dhts) -> list[dict]:
    out = []
    for dht in dhts:
        io = cpu = 0.0
        dht_io = 0.0
        for i, proc in enumerate(_processes(dht)):
            try:
                counters, times = proc.io_counters(), proc.cpu_times()
            except psutil.Error:
                continue
            chars = counters.read_chars + counters.write_chars
            io += chars
            dht_io += chars if i == 0 else 0.0
            cpu += times.user + times.system
        out.append({"io": io, "dht_io": dht_io, "cpu": cpu})
    return out


def _start_all(count: int, initial: list[str], *, rules, cache: bool) -> list:
    """``count`` DHT nodes started at once (threads), as peers launched together would be."""
    from node.library.dht import start_dht

    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(start_dht, initial_peers=initial, listen=["/ip4/127.0.0.1/tcp/0"], announce=[],
                               timeout=60, rules=rules, cache_values=cache) for _ in range(count)]
        return [future.result() for future in futures]


def run_swarm(n: int, policy: str, *, warmup_s: float, seconds: float, bootstraps: int = 0,
              shards: int | str = 1) -> dict:
    """One swarm of ``n`` peers under ``policy``: the window's figures per peer. ``bootstraps``: 0,
    peer 0 is everyone's initial peer (started first); K > 0, K entry nodes started apart (none
    knows another: the worst case of hivemind issue #624) and all ``n`` peers started at once with
    all K addresses; their load is measured too. ``shards``: the run's ``averaging.progress_shards``
    (a count, or "auto": each peer's count follows the swarm's size)."""
    from hivemind.utils import get_dht_time

    from node.library.dht import RecordRules, shutdown_dht, start_dht
    from node.library.monitor import PeerMonitor
    from node.library.run_record import DhtDirectory, RunTrust, join_run
    from protocols.manifest import RunManifest, progress_shards
    from protocols.progress import ProgressRecord

    rules = RecordRules(run_ids=(RUN_ID,))
    cache = CACHES_VALUES.get(policy, False)
    dhts, monitors, directories, entries = [], [], [], []
    try:
        started = time.monotonic()
        if bootstraps:
            entries += _start_all(bootstraps, [], rules=rules, cache=cache)  # each alone: nobody told them of each other
            dhts += _start_all(n, [str(m) for e in entries for m in e.get_visible_maddrs()], rules=rules, cache=cache)
        else:
            first = start_dht(initial_peers=[], listen=["/ip4/127.0.0.1/tcp/0"], announce=[], timeout=60, rules=rules,
                          cache_values=cache)
            dhts.append(first)
            bootstrap = [str(m) for m in first.get_visible_maddrs()]
            for _ in range(n - 1):
                dhts.append(start_dht(initial_peers=bootstrap, listen=["/ip4/127.0.0.1/tcp/0"], announce=[],
                                      timeout=60, rules=rules, cache_values=cache))
        fields = {"model.d_model": 64, **({"averaging.progress_shards": shards} if shards != 1 else {})}
        ours = RunManifest.create(RUN_ID, fields, start_time=get_dht_time(), round_seconds=10.0)
        boot_s = time.monotonic() - started
        for i, dht in enumerate(dhts):
            peer_id = str(dht.peer_id)
            directory = Counted(DhtDirectory(dht, RUN_ID, owner=dht.shoal_key.public))
            trust = RunTrust()
            manifest = join_run(directory, ours, record_ttl=600, trust=trust, alone=i == 0 and not bootstraps,
                                settle_s=30)
            directory.use_progress_shards(progress_shards(manifest))  # as DiLoCoSwarm does after joining
            addrs = tuple(f"/ip4/127.0.0.{k + 1}/tcp/{40000 + i}/p2p/{peer_id}" for k in range(ADDRS))

            def status(peer_id=peer_id, addrs=addrs, directory=directory):
                return ProgressRecord(
                    peer_id=peer_id, round=7, tokens_per_s=1234.5, loss=2.5, eval_loss=2.6, device="cpu",
                    utilization=0.9, bytes_sent=10**7, bytes_received=10**7, mode="full", version="0.1.0",
                    tokens=10**6, time=directory.now(), phase="training", shard=3, round_bytes_sent=10**5,
                    round_bytes_received=10**5, sync_late_s=0.5, rounds_done=6, clock_offset_s=0.01, addrs=addrs)

            monitor = PeerMonitor(directory, manifest, peer_id=peer_id, period=BASE_PERIOD_S, status=status,
                                  on_change=lambda joined, left: None, trust=trust, **(POLICIES[policy] or {}))
            if POLICIES[policy] is not None:
                monitor.start()
            monitors.append(monitor)
            directories.append(directory)
        time.sleep(warmup_s)
        before, entries_before, t0 = _sample(dhts), _sample(entries), time.monotonic()
        counts0 = [(d.progress_reads, d.records_read, d.manifest_reads, d.manifest_writes) for d in directories]
        time.sleep(seconds)
        after, entries_after, t1 = _sample(dhts), _sample(entries), time.monotonic()
        counts1 = [(d.progress_reads, d.records_read, d.manifest_reads, d.manifest_writes) for d in directories]
        elapsed = t1 - t0
        peers = []
        for i in range(n):
            c0, c1 = counts0[i], counts1[i]
            peers.append({
                "io_kib_s": (after[i]["io"] - before[i]["io"]) / elapsed / 1024,
                "dht_io_kib_s": (after[i]["dht_io"] - before[i]["dht_io"]) / elapsed / 1024,
                "cpu_cores": (after[i]["cpu"] - before[i]["cpu"]) / elapsed,
                "period_s": monitors[i].period, "seen": len(monitors[i].peers),
                "progress_reads_s": (c1[0] - c0[0]) / elapsed, "records_read_s": (c1[1] - c0[1]) / elapsed,
                "manifest_reads_s": (c1[2] - c0[2]) / elapsed, "manifest_writes_s": (c1[3] - c0[3]) / elapsed,
                "keys_written": directories[i].shards, "keys_read": directories[i].read_shards,
            })
        entry_load = [{"io_kib_s": (b["io"] - a["io"]) / elapsed / 1024, "cpu_cores": (b["cpu"] - a["cpu"]) / elapsed}
                      for a, b in zip(entries_before, entries_after)]
        organisers = len({m.manifest.organiser for m in monitors})
        label = policy if shards == 1 else f"{policy}, {shards} shards" if shards != "auto" else f"{policy}, auto shards"
        return {"peers": n, "policy": label, "shards": shards, "bootstraps": bootstraps, "boot_s": boot_s,
                "window_s": elapsed,
                "per_peer": peers, "entries": entry_load, "organisers": organisers}
    finally:
        for monitor in monitors:
            monitor.stop()
        for dht in dhts + entries:
            shutdown_dht(dht)


def _median(rows, key):
    return statistics.median(p[key] for p in rows)


def report(results: dict) -> str:
    lines = ["# The heartbeat's DHT cost per peer as the swarm grows (issue 32)", "",
             f"Command: `{results['command']}` ({results['when']}).", "",
             "Real hivemind DHT nodes started as `shoal run` starts them, on loopback, each with a real "
             "`PeerMonitor` (progress records of a real peer's size), no training and no averager: the "
             "heartbeat's cost alone. *before*: every heartbeat publishes the record and the manifest and "
             "reads all manifests and all records, at a fixed period (a third of a 10 s round), with hivemind's "
             "value cache on; *after*: today's defaults (no value cache, the heartbeat slows past 16 live peers, "
             "the swarm republishes the manifest about once a heartbeat, manifests are read only in a new organiser's "
             "first minute); *idle*: the same nodes with no heartbeat. I/O is the DHT "
             "process's and its p2pd's (`/proc/<pid>/io` rchar + wchar: loopback and unix-socket traffic, "
             "each byte counted where it is written and where it is read), medians over peers, in a window "
             f"of {results['seconds']:.0f} s after {results['warmup_s']:.0f} s of warm-up.", "",
             "| peers | policy | DHT + p2pd I/O per peer, KiB/s (median / max) | DHT process I/O, KiB/s (median / max) "
             "| CPU per peer, cores | heartbeat, s | records read per peer per s | manifest reads / writes per peer per s "
             "| peers seen (min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    direct = [r for r in results["runs"] if not r.get("bootstraps")]
    for run in direct:
        rows = run["per_peer"]
        lines.append(
            f"| {run['peers']} | {run['policy']} | {_median(rows, 'io_kib_s'):.1f} / {max(p['io_kib_s'] for p in rows):.1f} "
            f"| {_median(rows, 'dht_io_kib_s'):.1f} / {max(p['dht_io_kib_s'] for p in rows):.1f} "
            f"| {_median(rows, 'cpu_cores'):.3f} | {_median(rows, 'period_s'):.2f} | {_median(rows, 'records_read_s'):.2f} "
            f"| {_median(rows, 'manifest_reads_s'):.2f} / {_median(rows, 'manifest_writes_s'):.3f} "
            f"| {min(p['seen'] for p in rows)} |")
    stalled = [r for r in direct if min(p["seen"] for p in r["per_peer"]) < r["peers"]]
    for run in stalled:
        rows = run["per_peer"]
        lines += ["", f"- **{run['peers']} peers, {run['policy']}: the heartbeat did not keep up.** Peers saw as few "
                      f"as {min(p['seen'] for p in rows)} of the {run['peers']} records (median "
                      f"{_median(rows, 'seen'):.0f}) and read {_median(rows, 'records_read_s'):.2f} records a second: "
                      "each heartbeat's DHT calls took longer than the records' lifetime, so its I/O is that of a "
                      "swarm that no longer sees itself, not a lower cost."]
    lines += ["", "The *max* column is the hotspot: the nodes nearest the run's keys, which serve every read."]
    by = {(r["peers"], r["policy"]): r for r in direct}
    pairs = sorted(n for n, policy in by if policy == "before" and (n, "after") in by)
    if pairs:
        lines += ["", "After against before, at each size (median DHT + p2pd I/O per peer):", ""]
    for n in pairs:
        b, a = _median(by[n, "before"]["per_peer"], "io_kib_s"), _median(by[n, "after"]["per_peer"], "io_kib_s")
        lines.append(f"- {n} peers: {a:.1f} vs {b:.1f} KiB/s ({a / b:.2f}x)")
    sharded = sorted({(r["peers"], r["policy"]) for r in direct if r.get("shards", 1) != 1})
    if sharded:
        lines += ["", "Progress records spread over S keys (`averaging.progress_shards`) against one key, at each "
                      "size (DHT + p2pd I/O per peer, KiB/s, median / max: the max is the hotspot):", ""]
    for n, label in sharded:
        base = by.get((n, label.split(",")[0]))
        if base is not None:
            s_rows, b_rows = by[n, label]["per_peer"], base["per_peer"]
            s_max, b_max = max(p["io_kib_s"] for p in s_rows), max(p["io_kib_s"] for p in b_rows)
            keys = ""
            if "keys_written" in s_rows[0]:  # where each peer's counts ended (auto: its own choice)
                written, read = sorted({p["keys_written"] for p in s_rows}), sorted({p["keys_read"] for p in s_rows})
                keys = f"; keys written {'/'.join(map(str, written))}, read {'/'.join(map(str, read))}"
            lines.append(f"- {n} peers, {label}: {_median(s_rows, 'io_kib_s'):.1f} / {s_max:.1f} against "
                         f"{_median(b_rows, 'io_kib_s'):.1f} / {b_max:.1f} with one key (hotspot {s_max / b_max:.2f}x)"
                         + keys)
    entered = [r for r in results["runs"] if r.get("bootstraps")]
    if entered:
        lines += ["", "## Several entry peers", "",
                  "K entry nodes started apart (none told of another: the worst case of hivemind issue #624, where "
                  "peers started with one bootstrap list split into two DHTs), then all N peers started at the same "
                  "moment, each given every entry's address. *One swarm*: every peer saw all N records and all "
                  "followed one organiser. The entry nodes run no monitor: their load is serving the others.", "",
                  "| peers | entry peers | one swarm? (fewest records a peer saw; organisers) | I/O per peer, KiB/s "
                  "(median) | each entry peer: I/O KiB/s, CPU cores |",
                  "|---|---|---|---|---|"]
        for run in entered:
            rows = run["per_peer"]
            seen = min(p["seen"] for p in rows)
            one = "yes" if seen == run["peers"] and run["organisers"] == 1 else "**no**"
            load = "; ".join(f"{e['io_kib_s']:.0f}, {e['cpu_cores']:.3f}" for e in run["entries"])
            lines.append(f"| {run['peers']} | {run['bootstraps']} | {one} ({seen} of {run['peers']}; "
                         f"{run['organisers']}) | {_median(rows, 'io_kib_s'):.1f} | {load} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--bootstraps", type=int, default=0,
                        help="K entry nodes, started apart, given to all peers started at once (0: peer 0 is the entry)")
    parser.add_argument("--shards", type=lambda s: [x if x == "auto" else int(x) for x in s.split(",")], default=[1],
                        help="the run's averaging.progress_shards, each measured side by side (1: one key; auto)")
    parser.add_argument("--append", action="store_true", help="keep the runs already in the results json")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.report_only:
        results = json.loads(args.out.with_suffix(".json").read_text())
        write_results(results, args.out, report, redraw=True)
        return
    logging.basicConfig(level=logging.WARNING)
    command = (f".venv/bin/python -m benchmarks.swarm.dht_load --peers {','.join(map(str, args.peers))} "
               f"--policies {','.join(args.policies)} --seconds {args.seconds:g} --warmup {args.warmup:g}"
               + (f" --bootstraps {args.bootstraps}" if args.bootstraps else "")
               + (f" --shards {','.join(map(str, args.shards))}" if args.shards != [1] else "")
               + (" --append" if args.append else "") + out_flag(args.out, RESULTS))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {"command": command, "when": when, "seconds": args.seconds, "warmup_s": args.warmup, "runs": []}
    if args.append and args.out.with_suffix(".json").exists():
        results = json.loads(args.out.with_suffix(".json").read_text())
        results["command"] += f"`; `{command}"
        results["when"] += f"; {when}"
    for n in args.peers:
        for policy in args.policies:  # side by side: both policies at each size before the next size
            for shards in args.shards:
                run = run_swarm(n, policy, warmup_s=args.warmup, seconds=args.seconds, bootstraps=args.bootstraps,
                                shards=shards)
                results["runs"].append({**run, "provenance": provenance()})  # --append mixes runs
                print(f"{n} peers, {run['policy']}: {_median(run['per_peer'], 'io_kib_s'):.1f} KiB/s per peer "
                      f"(max {max(p['io_kib_s'] for p in run['per_peer']):.1f}), "
                      f"heartbeat {_median(run['per_peer'], 'period_s'):.2f} s", flush=True)
                write_results(results, args.out, report)


if __name__ == "__main__":
    main()
