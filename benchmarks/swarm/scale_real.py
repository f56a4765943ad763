"""Real many-peer runs on this machine: N ``shoal run`` peers on loopback (issue 32).

    .venv/bin/python -m benchmarks.swarm.scale_real [--peers 4,8,12,16] [--rounds 12] [--round-seconds 10] \\
        [--demand 0.8] [--throttle-clock wall|cpu] [--churn K] [--bootstraps K] [--group-size G] [--compression CODE] [--state-compression lat8] [--append]
    .venv/bin/python -m benchmarks.swarm.scale_real --report-only [--findings FILE]

The results file holds 4, 8, 12 and 16 peers at the defaults; the same at ``--demand 0.4
--throttle-clock cpu``; 4 and 16 peers at that with ``--churn 3``; and 16 peers at ``--demand 0.4``
(the md lists the exact commands, run one after the other with ``--append``). After the start-up
fixes of issue 32, ``scale_real_fixed.{md,json}``: 16, 8 and 4 peers at ``--demand 0.4
--throttle-clock cpu``, 16 peers given two entry peers (``--bootstraps 2``: does a swarm started
with one bootstrap list stay one swarm, and what does each entry peer carry), and 16 peers with
``--churn 3``.

Per N, alone on the machine (it waits while a ``pytest tests`` run is going): a ``shoal bootstrap``
entry peer, then peer-0 (it organises the run), then the other N-1 peers all at once, every one
with ``examples/configs/tiny.toml`` (one torch thread: ``train.torch_threads = 1``; OMP/MKL at 1
too), ``--round-seconds`` rounds and ``--throttle N / demand``: the swarm's training then needs
``--demand`` of one core (0.8 of this machine's 2 by default), whatever N, so that the run measures
the swarm and not CPU starvation. The CPU the peers (and their DHT, averager and p2pd processes
apart) and the whole machine really used is measured: the network processes come on top of the
training demand, and from 12 peers on they starve this machine at 0.8 (results file).

``--throttle-clock cpu`` throttles by the step's CPU time instead (``benchmarks.swarm.scale_peer`` wraps
the inner step: it sleeps ``(throttle - 1) x`` the thread CPU time the step took; the peer runs
unthrottled otherwise, and counts the sleep as compute as ``--throttle`` does). ``shoal run
--throttle`` stretches a step by its wall-clock time, so on this oversubscribed machine a step
slowed by waiting for a core (every peer's all-reduce, eval and DHT traffic land just after each
deadline) is stretched by the whole throttle factor: at throttle 15-20 a 0.5 s wait becomes a
7-10 s step that straddles a deadline. The CPU clock keeps each peer's demand at 1/throttle of a
core without multiplying the waits; it is the closer stand-in for N machines.

Warm-up ends at the round by which every first peer has averaged once; then ``--rounds`` rounds are
measured, and every peer gets Ctrl+C just after the last one's deadline (it lets that round's sync
land and writes its checkpoint). With ``--churn K``, from the end of warm-up every K rounds one
peer (the oldest but the organiser) is SIGKILLed with its whole process group in the middle of a
round, and a new peer joins through the entry peer at once.

Measured, from the peers' own metrics files and logs (``docs/metrics.md``) and from sampling
their processes:

- join time: from a peer's process start to its ``start`` record (booted: DHT up, model built),
  to its ``state_download`` record (a joiner of a running swarm), and to the record of the first
  round it averaged in (written when that round's sync has landed);
- matchmaking: hivemind's matchmaking log (its logger, and the all-reduce's, at DEBUG in the peers:
  ``benchmarks.swarm.scale_peer`` runs them, ``shoal run`` otherwise unchanged) says when each peer's
  group was assembled; the figure is that time after the round's deadline (the group's all-reduce
  starts then);
- per peer, the window's rounds by outcome (averaged, alone, folded, stayed out, absent: no
  record), its share of rounds averaged, group sizes, all-reduce time (``allreduce_s``),
  re-syncs (``resync`` events) and catch-ups (``caught_up``), in the window and in the whole run;
- DHT traffic: hivemind exposes no per-peer byte counter, and loopback bytes cannot be told apart
  per process. What is measured: the chars the peer's DHT process read and wrote
  (``/proc/<pid>/io`` rchar/wchar: its RPCs through p2pd's unix socket, and the node's requests
  over its pipe), and the same for its p2pd (every byte of DHT and averaging, counted on the unix
  socket side and again on the TCP side); the all-reduce payload from the round records beside it;
- memory: RSS summed over the peer's session (node, DHT, averager, p2pd; pages they share are
  counted in each) and PSS (``smaps_rollup``: shared pages split), sampled every 3 s;
- anchor spread: each remaining peer's final checkpoint (``load_latest_valid``), at the round most
  of them ended on: the largest pairwise RMS difference relative to the mean anchor's RMS;
- eval loss: the peers' own eval of the shared model in the last round (median, range).

Targets (issue 32, for 16 peers): every peer averages in >= 90% of rounds after warm-up, no re-sync
in a fault-free run, join time within 2x of a 4-peer swarm's (the median to the first averaged
round of the peers that join the organiser).

Writes ``benchmarks/results/scale_real.{md,json}`` after every run (``--append`` keeps the runs of
other N / modes already there); ``--report-only`` redraws the table, with ``--findings FILE`` (a
markdown text) stored as the findings section. Every peer's workdir (log.txt, metrics.jsonl,
checkpoints) is kept under the printed work directory for diagnosis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
import torch

from benchmarks.common import cpu_throttle
from benchmarks.common.results import REPO, command_line, provenance, write_results
from benchmarks.common.results import RESULTS as RESULTS_DIR
from benchmarks.common.swarm import BusyTimeline, CpuMeter, start_entry_peer
from benchmarks.swarm import scale_peer
from examples.swarm_launcher import LocalPeer, LocalSwarm, kill_process_group
from node.library.checkpoint import load_latest_valid
from node.observe.metrics import read_metrics

RESULTS = RESULTS_DIR / "scale_real"
CONFIG = REPO / "examples" / "configs" / "tiny.toml"
SAMPLE_S = 3.0
TARGET_SHARE = 0.9
TARGET_JOIN_RATIO = 2.0
LOG_CHARS = 240  # of each log line kept as an incident's evidence (a re-sync's names every donor)
DEFAULT_DEMAND = 0.8  # cores of training for the whole swarm (issue 32's suggestion)
MIN_ROUNDS = 3  # a peer's share of rounds averaged counts in the run's figures once it had this many
LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) (\w+) (\S+): (.*)$")
ASSEMBLED = re.compile(r"(?:assembled group of (\d+) peers|follower assembled group with leader)")


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def quantile(values, q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def wait_for_pytest() -> None:
    """Never share the cores with a full test suite: wait until none runs."""
    told = False
    while subprocess.run(["pgrep", "-f", "pytest tests"], capture_output=True).returncode == 0:
        if not told:
            print(f"a pytest run is going: waiting for it ({time.strftime('%H:%M:%S')})", file=sys.stderr,
                  flush=True)
            told = True
        time.sleep(10)


# -- one swarm --------------------------------------------------------------------------------------
@dataclass
class Member:
    """One peer process of the run (a joiner is a member of its own)."""

    peer: LocalPeer
    launched: float
    initial: bool  # one of the N started at the beginning
    killed_at: float | None = None
    exit_code: int | None = None
    roles: dict[str, int] | None = None  # the start record's processes: dht, averager, p2pd pids
    samples: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.peer.name

    def records(self) -> list[dict]:
        return read_metrics(self.peer.metrics_path) if self.peer.metrics_path.exists() else []


class Sampler:
    """Every ``period`` seconds, per member: RSS and CPU seconds summed over its session (the peer
    leads its own), and the I/O chars of its DHT, averager and p2pd processes."""

    def __init__(self, period: float = SAMPLE_S):
        self.period = period
        self.members: list[Member] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed sample is a gap, not the end of the run
                traceback.print_exc()

    def sample(self) -> None:
        now = time.time()
        live = {m.peer.proc.pid: m for m in list(self.members) if m.peer.proc.poll() is None}
        for member in live.values():
            if member.roles is None:
                start = next((r for r in member.records() if r.get("event") == "start"), None)
                member.roles = start.get("processes") if start else None
        sessions: dict[int, list[psutil.Process]] = {}
        for proc in psutil.process_iter():
            try:
                sid = os.getsid(proc.pid)
            except OSError:
                continue
            if sid in live:
                sessions.setdefault(sid, []).append(proc)
        for sid, procs in sessions.items():
            rss = pss = cpu = 0.0
            for proc in procs:
                try:
                    with proc.oneshot():
                        rss += proc.memory_info().rss
                        times = proc.cpu_times()
                        cpu += times.user + times.system
                    pss += proportional_set_size(proc.pid)
                except (psutil.Error, OSError):
                    continue
            io = {}
            for role, pid in (live[sid].roles or {}).items():
                try:
                    proc = psutil.Process(pid)
                    counters, times = proc.io_counters(), proc.cpu_times()
                    io[role] = [counters.read_chars, counters.write_chars, times.user + times.system]
                except (psutil.Error, AttributeError):
                    continue
            live[sid].samples.append({"t": now, "rss_mib": rss / 2**20, "pss_mib": pss / 2**20, "cpu_s": cpu,
                                      "processes": len(procs), "io": io})


def proportional_set_size(pid: int) -> int:
    """Bytes of ``pid``'s PSS (pages shared with the peer's other processes, or with other peers,
    counted once over all of them), from the kernel's one-line sum (``smaps_rollup``)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


class Run:
    """One swarm of ``n`` peers: its members, the round clock, the churn."""

    def __init__(self, n: int, args, root: Path):
        self.n, self.args, self.root = n, args, root
        self.throttle = n / args.demand
        self.key = (f"n{n}" + (f"-churn{args.churn}" if args.churn else "")
                    + (f"-d{args.demand:g}" if args.demand != DEFAULT_DEMAND else "")
                    + ("-cpuclock" if args.throttle_clock == "cpu" else "")
                    + (f"-boot{args.bootstraps}" if args.bootstraps > 1 else "")
                    + (f"-g{args.group_size}" if args.group_size else "")
                    + (f"-{args.compression}" if args.compression else "")
                    + (f"-state-{args.state_compression}" if args.state_compression else ""))
        run_id = f"scale-{self.key.replace('.', 'p')}-{uuid.uuid4().hex[:6]}"  # a run id has no dots
        self.swarm = LocalSwarm(root / self.key, run_id=run_id, cwd=REPO,
                                env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        self.config = CONFIG
        if args.group_size or args.compression:  # tiny.toml with sub-groups and/or another codec
            text = CONFIG.read_text()
            if args.group_size:
                text = text.replace("[averaging]\n", f"[averaging]\ntarget_group_size = {args.group_size}\n", 1)
            if args.state_compression:
                text = text.replace("[averaging]\n", f'[averaging]\nstate_compression = "{args.state_compression}"\n', 1)
            if args.compression:
                text, found = re.subn(r'(?m)^compression = "[a-z0-9]+"', f'compression = "{args.compression}"', text)
                assert found == 1, "tiny.toml's averaging.compression line moved"
            self.config = root / f"{self.key}.toml"
            self.config.parent.mkdir(parents=True, exist_ok=True)
            self.config.write_text(text)
        self.members: list[Member] = []
        self.sampler = Sampler()
        self.address: list[str] = []
        self.events: list[dict] = []  # what the benchmark did: kills, joins, warm-up end
        self.schedule_start: float | None = None
        self.bootstrap_load: list[dict] = []  # per entry peer: its processes' CPU and I/O over its life

    def launch(self, initial: bool) -> Member:
        name = f"peer-{len(self.members)}"
        launched = time.time()
        cpu = self.args.throttle_clock == "cpu"
        throttle = () if cpu else ("--throttle", f"{self.throttle:g}")
        peer = self.swarm.start(name, *throttle, "--round-seconds", f"{self.args.round_seconds:g}",
                                config=self.config, initial=self.address, program=scale_peer.PROGRAM,
                                env={cpu_throttle.ENV: f"{self.throttle:g}"} if cpu else None)
        member = Member(peer, launched, initial)
        self.members.append(member)
        self.sampler.members.append(member)
        return member

    def deadline(self, round: int) -> float:
        return self.schedule_start + round * self.args.round_seconds

    def round_now(self) -> int:
        return 1 + math.floor((time.time() - self.schedule_start) / self.args.round_seconds)

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.killed_at is None and m.peer.proc.poll() is None]

    def check_exits(self) -> None:
        for m in self.members:
            if m.killed_at is None and m.exit_code is None and m.peer.proc.poll() is not None:
                m.exit_code = m.peer.proc.returncode
                print(f"{m.name} exited with {m.exit_code}:\n{m.peer.log()[-1500:]}", file=sys.stderr,
                      flush=True)
                self.events.append({"event": "exited", "peer": m.name, "code": m.exit_code,
                                    "time": time.time()})

    def first_averaged(self, member: Member) -> int | None:
        return next((r["round"] for r in member.records()
                     if r.get("event") == "round" and r["applied"] == "averaged"), None)

    def warm_up(self) -> int:
        """The round by which every first peer has averaged once (or, after the timeout, the round now)."""
        deadline = time.time() + self.args.warmup_timeout
        while time.time() < deadline:
            self.check_exits()
            firsts = [self.first_averaged(m) for m in self.members if m.initial and m.exit_code is None]
            if firsts and None not in firsts:
                return max(firsts)
            time.sleep(1.0)
        missing = [m.name for m in self.members if m.initial and self.first_averaged(m) is None]
        self.events.append({"event": "warmup_timeout", "never_averaged": missing, "time": time.time()})
        return self.round_now()

    def execute(self) -> dict:
        entries: list = []
        try:
            with CpuMeter() as cpu, BusyTimeline(period=1.0) as busy, self.sampler:
                # Every peer is given every entry peer's address (hivemind's DHT pings them all and
                # starts once one answers); with several, the load each carries is measured.
                for i in range(self.args.bootstraps):
                    entry, address = start_entry_peer(self.root / self.key / f"bootstrap-{i}", None)
                    entries.append((entry, time.time()))
                    self.address += address
                organiser = self.launch(initial=True)
                organiser.peer.wait_for_address(timeout=180)
                for _ in range(self.n - 1):
                    self.launch(initial=True)
                for m in self.members:
                    m.peer.wait_for_address(timeout=300)
                start = next(r for r in organiser.records() if r.get("event") == "start")
                self.schedule_start = start["schedule_start"]
                warm = self.warm_up()
                last = warm + self.args.rounds
                self.events.append({"event": "warmup_end", "round": warm, "time": time.time()})
                print(f"{self.key}: warm-up ended in round {warm}; measuring rounds {warm + 1}-{last}",
                      file=sys.stderr, flush=True)
                self.churn_until(warm, last)
                for m in self.alive():
                    m.peer.interrupt()
                for m in self.members:
                    if m.killed_at is None:
                        try:
                            timeout = max(5.0, self.deadline(last) + 150 - time.time())
                            m.exit_code = m.peer.proc.wait(timeout=timeout)
                        except subprocess.TimeoutExpired:
                            self.events.append({"event": "no_clean_exit", "peer": m.name,
                                                "time": time.time()})
                window = (self.deadline(warm), self.deadline(last))
                machine_in_window = busy.cores_between(*window)
                self.bootstrap_load = [bootstrap_load(entry.proc.pid, since) for entry, since in entries]
        finally:
            self.swarm.kill_all()
            for entry, _ in entries:
                kill_process_group(entry.proc)
        measured = measure(self, warm=warm, last=last, cpu=cpu.summary(), machine_in_window=machine_in_window)
        measured["bootstraps"] = self.bootstrap_load
        return measured

    def churn_until(self, warm: int, last: int) -> None:
        """Until ``last``'s deadline (+1 s): every ``--churn`` rounds one SIGKILL and one joiner."""
        kill_round = warm + self.args.churn if self.args.churn else None
        end = self.deadline(last) + 1.0
        while time.time() < end:
            self.check_exits()
            if kill_round is not None and kill_round + 3 <= last and \
                    time.time() >= self.deadline(kill_round) - self.args.round_seconds / 2:
                victims = [m for m in self.alive() if m.name != "peer-0"]
                if victims:
                    victim = min(victims, key=lambda m: m.launched)
                    victim.killed_at = time.time()
                    kill_process_group(victim.peer.proc)
                    joiner = self.launch(initial=False)
                    self.events.append({"event": "churn", "round": kill_round, "killed": victim.name,
                                        "joined": joiner.name, "time": victim.killed_at})
                    print(f"{self.key}: round {kill_round}: killed {victim.name}, {joiner.name} joins",
                          file=sys.stderr, flush=True)
                kill_round += self.args.churn
            time.sleep(0.25)


# -- measuring --------------------------------------------------------------------------------------
def bootstrap_load(pgid: int, since: float) -> dict:
    """An entry peer's load since ``since``: CPU cores and I/O (``/proc/<pid>/io``: rchar + wchar, the
    socket traffic included) summed over its process group (the bootstrap, its DHT, its p2pd)."""
    cpu_s = io = 0.0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
            times = proc.cpu_times()
            cpu_s += times.user + times.system
            counters = proc.io_counters()
            io += counters.read_chars + counters.write_chars
        except (psutil.Error, ProcessLookupError, AttributeError):
            continue
    elapsed = max(1e-9, time.time() - since)
    return {"cpu_cores": cpu_s / elapsed, "io_kib_s": io / elapsed / 1024, "seconds": elapsed}


def log_lines(member: Member) -> list[tuple[float, str, str, str]]:
    """(unix time, level, logger, message) of the peer's log; the log's clock is local time of day."""
    text = member.peer.log()
    day = datetime.fromtimestamp(member.launched)
    midnight = day.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    lines = []
    for line in text.splitlines():
        match = LOG_LINE.match(line)
        if not match:
            continue
        h, m, s, ms, level, name, message = match.groups()
        t = midnight + int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000
        if t < member.launched - 60:
            t += 86400
        lines.append((t, level, name, message))
    return lines


def matchmaking(run: Run, member: Member, lines, mm_s: float) -> dict[int, float]:
    """Per round: when this peer's group was assembled, in seconds after the round's deadline."""
    assembled = {}
    for t, _, name, message in lines:
        if name == "hivemind.averaging.matchmaking" and ASSEMBLED.search(message):
            round = math.floor((t - run.schedule_start + mm_s) / run.args.round_seconds)
            assembled.setdefault(round, t - run.deadline(round))
    return assembled


def io_rate(samples: list[dict], role: str, start: float, end: float) -> float | None:
    """Bytes/s read + written by the process of ``role`` between the samples nearest inside [start, end]."""
    inside = [s for s in samples if start <= s["t"] <= end and role in s["io"]]
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    first, last = inside[0]["io"][role], inside[-1]["io"][role]
    return (last[0] + last[1] - first[0] - first[1]) / (inside[-1]["t"] - inside[0]["t"])


def role_cores(samples: list[dict], start: float, end: float) -> float | None:
    """Cores used by the peer's DHT, averager and p2pd processes together (its network side)."""
    rates = []
    for role in ("dht", "averager", "p2pd"):
        inside = [s for s in samples if start <= s["t"] <= end and len(s["io"].get(role, ())) > 2]
        if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
            return None
        first, last = inside[0], inside[-1]
        rates.append((last["io"][role][2] - first["io"][role][2]) / (last["t"] - first["t"]))
    return sum(rates)


def cpu_cores(samples: list[dict], start: float, end: float) -> float | None:
    inside = [s for s in samples if start <= s["t"] <= end]
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    return max(0.0, inside[-1]["cpu_s"] - inside[0]["cpu_s"]) / (inside[-1]["t"] - inside[0]["t"])


def outcome_of(record: dict | None) -> str:
    if record is None:
        return "absent"
    if record["applied"] == "averaged":
        return "averaged"
    if record["applied"] == "local":
        return "alone"
    return "stayed_out" if record.get("skipped") else "folded"


OUTCOMES = ("averaged", "alone", "folded", "stayed_out", "absent")
INCIDENT_FIELDS = ("group_size", "error", "resynced", "caught_up", "diverged", "skipped", "rounds_done")


def measure(run: Run, *, warm: int, last: int, cpu: dict, machine_in_window: float | None) -> dict:
    """The run's figures, from every member's metrics file, log and samples."""
    mm_s = tomllib.loads(CONFIG.read_text())["averaging"]["matchmaking_seconds"]
    peers, incidents, groups_by_round = {}, [], {}
    for m in run.members:
        records = m.records()
        rounds = {r["round"]: r for r in records if r.get("event") == "round"}
        lines = log_lines(m)
        peers[m.name] = peer_figures(run, m, records, rounds, lines, warm=warm, last=last, mm_s=mm_s)
        incidents += peer_incidents(m, rounds, lines, peers[m.name], last=last)
        for r, rec in rounds.items():
            if rec["applied"] == "averaged" and rec.get("group"):
                groups_by_round.setdefault(r, set()).add(tuple(sorted(rec["group"])))
    return {"peers_n": run.n, "churn": run.args.churn, "throttle": run.throttle,
            "throttle_clock": run.args.throttle_clock, "demand_cores": run.args.demand,
            "round_seconds": run.args.round_seconds, "warmup_end": warm, "last": last, "events": run.events,
            "workdir": str(run.swarm.root), "cpu": cpu, "machine_cores_in_window": machine_in_window,
            "peers": peers,
            "groups_by_round": {str(r): sorted((len(g) for g in gs), reverse=True)
                                for r, gs in sorted(groups_by_round.items())},
            "anchors": anchor_spread([m for m in run.members if m.killed_at is None]),
            "incidents": incidents}


def peer_figures(run: Run, m: Member, records: list[dict], rounds: dict[int, dict], lines, *, warm: int,
                 last: int, mm_s: float) -> dict:
    """One member's figures. Its window: the measured rounds it was there for (a joiner from its
    first round record, a killed peer until the round before its kill)."""
    start_s, end_s = run.deadline(warm), run.deadline(last)
    first = {kind: next((r for r in records if r.get("event") == kind), None)
             for kind in ("start", "state_download")}
    start, download = first["start"], first["state_download"]
    resyncs = [r["round"] for r in records if r.get("event") == "resync"]
    first_round = min(rounds, default=None)
    killed_round = (math.floor((m.killed_at - run.schedule_start) / run.args.round_seconds) + 1
                    if m.killed_at else None)
    lo = max(warm + 1, first_round if first_round is not None else last + 1)
    window = range(lo, (min(last, killed_round - 1) if killed_round else last) + 1)
    outcome = Counter(outcome_of(rounds.get(r)) for r in window)
    averaged = [r for r in sorted(rounds) if rounds[r]["applied"] == "averaged"]
    assembled = matchmaking(run, m, lines, mm_s)
    inside = [s for s in m.samples if start_s <= s["t"] <= end_s]
    payload = sum(rounds[r].get("bytes_sent", 0) + rounds[r].get("bytes_received", 0)
                  for r in window if r in rounds)
    return {
        "initial": m.initial, "launched": m.launched - run.schedule_start, "killed_in_round": killed_round,
        "exit_code": m.exit_code, "first_round": first_round,
        "boot_s": start["time"] - m.launched if start else None,
        "download_s": download["time"] - m.launched if download else None,
        "download": {k: download[k] for k in ("adopted_round", "seconds", "bytes")} if download else None,
        "join_s": rounds[averaged[0]]["time"] - m.launched if averaged else None,
        "first_averaged": averaged[0] if averaged else None,
        "window": [window.start, window.stop - 1], "rounds": len(window), **{k: outcome[k] for k in OUTCOMES},
        "share": outcome["averaged"] / len(window) if len(window) else None,
        "resyncs_window": sum(1 for r in resyncs if r in window), "resyncs_run": len(resyncs),
        "resync_rounds": resyncs,
        "caught_up_window": sum(rounds[r].get("caught_up", 0) for r in window if r in rounds),
        "caught_up_run": sum(r.get("caught_up", 0) for r in rounds.values()),
        "reunions": sum(1 for r in records if r.get("event") == "reunion"),
        "group_sizes": [rounds[r]["group_size"] if r in rounds else 0 for r in window],
        "allreduce_s": [rounds[r]["allreduce_s"] for r in window
                        if r in rounds and rounds[r]["applied"] == "averaged"],
        "assembled_after_deadline_s": [assembled.get(r) for r in window],
        "eval_loss": next((rounds[r]["eval_loss"] for r in sorted(rounds, reverse=True)
                           if rounds[r].get("eval_loss") is not None), None),
        "rss_mib": median(s["rss_mib"] for s in inside),
        "rss_mib_max": max((s["rss_mib"] for s in m.samples), default=None),
        "pss_mib": median(s.get("pss_mib") for s in inside),
        "cpu_cores": cpu_cores(m.samples, start_s, end_s),
        "network_cores": role_cores(m.samples, start_s, end_s),
        "dht_io_bps": io_rate(m.samples, "dht", start_s, end_s),
        "p2pd_io_bps": io_rate(m.samples, "p2pd", start_s, end_s),
        "averager_io_bps": io_rate(m.samples, "averager", start_s, end_s),
        "allreduce_payload_bps": payload / max(1e-9, end_s - start_s),
    }


def peer_incidents(m: Member, rounds: dict[int, dict], lines, figures: dict, *, last: int) -> list[dict]:
    """Every round, from the member's first, that it did not simply average in (alone, folded,
    stayed out, absent, or averaged with a re-sync or a catch-up): its record and its own warnings
    about that round."""
    incidents = []
    joined = figures["first_averaged"] or last + 1
    killed = figures["killed_in_round"]
    window = range(figures["window"][0], figures["window"][1] + 1)
    for r in range(figures["first_round"] or last + 1, (killed - 1 if killed else last) + 1):
        rec = rounds.get(r)
        plain = rec is not None and rec["applied"] == "averaged" and not rec.get("resynced")
        if plain and not rec.get("caught_up"):
            continue
        if rec is None and r < joined:
            continue  # a joiner still downloading
        said = [f"{time.strftime('%H:%M:%S', time.localtime(t))} {level} {message}"[:LOG_CHARS]
                for t, level, _, message in lines
                if level.startswith(("WARN", "ERR"))
                and (f"round {r}:" in message or f"round {r} " in message)]
        incidents.append({"peer": m.name, "round": r, "in_window": r in window,
                          "outcome": outcome_of(rec),
                          **({k: rec.get(k) for k in INCIDENT_FIELDS} if rec else {}), "log": said[:8]})
    return incidents


def anchor_spread(members: list[Member]) -> dict:
    """Final anchors at the round most peers' last checkpoint holds: the largest pairwise RMS
    difference relative to the mean anchor's RMS, and each peer's distance from the mean."""
    anchors, rounds = {}, {}
    for m in members:
        checkpoint = load_latest_valid(m.peer.checkpoint_dir)
        if checkpoint is None:
            continue
        anchors[m.name] = torch.cat([t.flatten().float() for t in checkpoint.params.values()])
        rounds[m.name] = checkpoint.round
    if not anchors:
        return {"round": None, "peers": 0, "max_pairwise": None, "from_mean": {}, "rounds": {}}
    common = max(Counter(rounds.values()).items(), key=lambda kv: (kv[1], kv[0]))[0]
    names = [n for n in anchors if rounds[n] == common]
    stack = torch.stack([anchors[n] for n in names])
    mean_anchor = stack.mean(0)
    scale = float(mean_anchor.norm())
    pairwise = max((float((stack[i] - stack[j]).norm()) / scale for i in range(len(names))
                    for j in range(i + 1, len(names))), default=0.0)
    return {"round": common, "peers": len(names), "max_pairwise": pairwise,
            "from_mean": {n: float((anchors[n] - mean_anchor).norm()) / scale for n in names},
            "rounds": rounds}


# -- the report -------------------------------------------------------------------------------------
def fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def kib(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / 1024:.1f}"


def summary(run: dict) -> dict:
    """A run's figures over its peers (medians, sums) for the tables."""
    peers = run["peers"].values()
    joiners = [p for p in peers if p["initial"]][1:]  # the organiser has nobody to join at first
    later = [p for p in peers if not p["initial"]]
    measured = [p for p in peers if p["rounds"] >= MIN_ROUNDS]  # a joiner in the last round or two: no share
    remaining = [p for p in peers if p["killed_in_round"] is None]
    assembled = [a for p in peers for a in p["assembled_after_deadline_s"] if a is not None]
    allreduce = [a for p in peers for a in p["allreduce_s"]]
    evals = [p["eval_loss"] for p in remaining if p["eval_loss"] is not None]
    groups = run["groups_by_round"]
    window = range(run["warmup_end"] + 1, run["last"] + 1)
    present = {r: sum(1 for p in peers if p["window"][0] <= r <= p["window"][1]) for r in window}
    network = [p.get("network_cores") for p in remaining]
    return {
        "join_s": median(p["join_s"] for p in joiners),
        "join_s_max": max((p["join_s"] or math.inf for p in joiners), default=None),
        "boot_s": median(p["boot_s"] for p in joiners),
        "after_boot_s": median(p["join_s"] - p["boot_s"] for p in joiners
                               if p["join_s"] is not None and p["boot_s"] is not None),
        "joiner_join_s": median(p["join_s"] for p in later),
        "joiner_download_s": median(p["download_s"] for p in later),
        "share_min": min((p["share"] for p in measured), default=None),
        "share_median": median(p["share"] for p in measured),
        "below_target": sum(1 for p in measured if p["share"] < TARGET_SHARE),
        **{k: sum(p[k] for p in peers) for k in (*OUTCOMES, "rounds", "resyncs_window", "resyncs_run",
                                                 "caught_up_window", "caught_up_run", "reunions")},
        "whole_rounds": sum(1 for r in window if groups.get(str(r)) == [present[r]]),
        "window_rounds": len(window),
        "group_sizes": sorted(Counter(s for p in measured for s in p["group_sizes"]).items()),
        "allreduce_p50": median(allreduce), "allreduce_p90": quantile(allreduce, 0.9),
        "assembled_p50": median(assembled), "assembled_max": max(assembled, default=None),
        "dht_io": median(p["dht_io_bps"] for p in peers), "p2pd_io": median(p["p2pd_io_bps"] for p in peers),
        "payload": median(p["allreduce_payload_bps"] for p in measured),
        "rss": median(p["rss_mib"] for p in peers),
        "rss_max": max((p["rss_mib_max"] or 0 for p in peers), default=None),
        "pss": median(p.get("pss_mib") for p in peers),
        "peer_cores": sum(p["cpu_cores"] or 0 for p in remaining),
        "network_cores": sum(c or 0 for c in network) if any(c is not None for c in network) else None,
        "eval": median(evals), "eval_range": (min(evals), max(evals)) if evals else None,
    }


def _throttle(run: dict, s: dict) -> str:
    clock = " (cpu)" if run.get("throttle_clock") == "cpu" else ""
    return f"{run['throttle']:g}{clock}; {run['demand_cores']:g}"


def _cpu(run: dict, s: dict) -> str:
    machine = run["machine_cores_in_window"]
    others = None if machine is None else max(0.0, machine - s["peer_cores"])
    peers = f"{fmt(s['peer_cores'], '.2f')} ({fmt(s['network_cores'], '.2f')})"
    return f"{peers} / {fmt(others, '.2f')} / {fmt(machine, '.2f')}"


def _eval(run: dict, s: dict) -> str:
    spread = "-" if not s["eval_range"] else f"{s['eval_range'][0]:.3f}-{s['eval_range'][1]:.3f}"
    return f"{fmt(s['eval'], '.3f')} ({spread})"


# (header, cell of a run and its summary): the two per-run tables
AVERAGING_COLUMNS = [
    ("run", lambda run, s: run["key"]),
    ("throttle; training demand, cores", _throttle),
    ("CPU in the window, cores of 2: the peers (their DHT, averager and p2pd processes) / everything else "
     "/ the machine", _cpu),
    ("join, s: boot / first averaged (max) / first averaged after boot; medians of the N-1",
     lambda run, s: f"{fmt(s['boot_s'])} / {fmt(s['join_s'])} ({fmt(s['join_s_max'])}) / "
                    f"{fmt(s['after_boot_s'])}"),
    ("rounds", lambda run, s: f"{run['warmup_end'] + 1}-{run['last']}"),
    ("averaged share: min / median (peers < 90%; peers with 3+ rounds)",
     lambda run, s: f"{fmt(s['share_min'], '.0%')} / {fmt(s['share_median'], '.0%')} ({s['below_target']})"),
    ("peer-rounds averaged / alone / folded / stayed out / absent",
     lambda run, s: " / ".join(str(s[k]) for k in OUTCOMES)),
    ("rounds in one group of all", lambda run, s: f"{s['whole_rounds']} of {s['window_rounds']}"),
    ("group sizes (peer-rounds)", lambda run, s: ", ".join(f"{k}: {v}" for k, v in s["group_sizes"])),
    ("group assembled after deadline, s (p50 / max)",
     lambda run, s: f"{fmt(s['assembled_p50'], '.2f')} / {fmt(s['assembled_max'], '.2f')}"),
    ("all-reduce s (p50 / p90)",
     lambda run, s: f"{fmt(s['allreduce_p50'], '.2f')} / {fmt(s['allreduce_p90'], '.2f')}"),
]
COST_COLUMNS = [
    ("run", lambda run, s: run["key"]),
    ("re-syncs: window / whole run", lambda run, s: f"{s['resyncs_window']} / {s['resyncs_run']}"),
    ("catch-ups (steps): window / whole run",
     lambda run, s: f"{s['caught_up_window']} / {s['caught_up_run']}"),
    ("anchor spread (relative RMS, max pairwise; peers, round)",
     lambda run, s: f"{fmt(run['anchors']['max_pairwise'], '.1e')} "
                    f"({run['anchors']['peers']}, {run['anchors']['round']})"),
    ("eval loss, last round (median; range)", _eval),
    ("DHT process I/O per peer, KiB/s", lambda run, s: kib(s["dht_io"])),
    ("p2pd I/O per peer, KiB/s", lambda run, s: kib(s["p2pd_io"])),
    ("all-reduce payload per peer, KiB/s", lambda run, s: kib(s["payload"])),
    ("memory per peer, MiB: RSS summed (max) / PSS",
     lambda run, s: f"{fmt(s['rss'], '.0f')} ({fmt(s['rss_max'], '.0f')}) / {fmt(s['pss'], '.0f')}"),
    ("joiners: download / first averaged, s",
     lambda run, s: f"{fmt(s['joiner_download_s'])} / {fmt(s['joiner_join_s'])}"),
]
PEER_COLUMNS = [
    ("started (s after schedule start)", lambda p: f"{p['launched']:.0f}"),
    ("boot / download / first averaged, s",
     lambda p: f"{fmt(p['boot_s'])} / {fmt(p['download_s'])} / {fmt(p['join_s'])}"),
    ("rounds", lambda p: f"{p['window'][0]}-{p['window'][1]}" if p["rounds"] else "-"),
    ("averaged / alone / folded / stayed out / absent", lambda p: " / ".join(str(p[k]) for k in OUTCOMES)),
    ("share", lambda p: fmt(p["share"], ".0%")),
    ("re-syncs (rounds)", lambda p: f"{p['resyncs_run']} ({' '.join(map(str, p['resync_rounds'])) or '-'})"),
    ("catch-ups", lambda p: str(p["caught_up_run"])),
    ("group sizes over the window", lambda p: " ".join(map(str, p["group_sizes"]))),
    ("CPU cores", lambda p: fmt(p["cpu_cores"], ".2f")),
    ("RSS MiB", lambda p: fmt(p["rss_mib"], ".0f")),
    ("DHT / p2pd I/O KiB/s", lambda p: f"{kib(p['dht_io_bps'])} / {kib(p['p2pd_io_bps'])}"),
]


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(row) + " |" for row in rows)]


def report(results: dict) -> str:
    meta = results["meta"]
    runs = {key: {**run, "key": key} for key, run in sorted(
        results["runs"].items(), key=lambda kv: (kv[1].get("throttle_clock", "wall") == "cpu", kv[1]["churn"],
                                                 -kv[1]["demand_cores"], kv[1]["peers_n"]))}
    summaries = {key: summary(run) for key, run in runs.items()}
    commands = "; ".join(f"`{c['command']}` ({c['started']} to {c.get('ended', 'unfinished')}"
                         f"{', stopped by hand' if c.get('interrupted') else ''})" for c in meta["commands"])
    lines = [
        "# Real many-peer runs on one machine (issue 32)", "", f"Commands: {commands}.", "",
        "Every peer a real `shoal run` process on loopback with `examples/configs/tiny.toml` (one torch "
        f"thread, OMP at 1), rounds of {meta['round_seconds']:g} s, each throttled to N / demand: the "
        f"swarm's training needs that demand (in the table) of this machine's {meta['cores']} cores whatever "
        "N (their DHT, averager and p2pd processes, eval and averaging come on top; *CPU* below is what was "
        "used). "
        "Peer-0 organises the run through a `shoal bootstrap` entry peer, the other N-1 start together once "
        "it is up. Warm-up ends at the round by which every first peer has averaged once; the figures are "
        f"over the {meta['rounds']} rounds after it, unless said otherwise. Real processes, real DHT and "
        "all-reduce. A throttle marked *(cpu)* stretches each step by its CPU time (`--throttle-clock cpu`), "
        "the others by its wall-clock time (`shoal run --throttle`), which multiplies a step's wait for a "
        "core by the whole factor (the module docstring says why both).", ""]
    for columns in (AVERAGING_COLUMNS, COST_COLUMNS):
        lines += [*table([h for h, _ in columns], [[cell(run, summaries[key]) for _, cell in columns]
                                                     for key, run in runs.items()]), ""]
    lines += [*target_lines(runs), ""]
    booted = {key: run["bootstraps"] for key, run in runs.items() if run.get("bootstraps")}
    if booted:
        lines += ["Entry peers (`shoal bootstrap`), each given to every peer; their processes' load over "
                  "their whole life (boot, joins and the run):", "",
                  *table(["run", "entry peer", "CPU cores", "I/O KiB/s", "alive, s"],
                         [[key, str(i), fmt(b["cpu_cores"], ".3f"), fmt(b["io_kib_s"], ".0f"), fmt(b["seconds"], ".0f")]
                          for key, loads in booted.items() for i, b in enumerate(loads)]), ""]
    lines += ["## Per peer", ""]
    rows = []
    for key, run in runs.items():
        for name, p in run["peers"].items():
            note = (" (joiner)" if not p["initial"] else "") + (
                f" (killed in round {p['killed_in_round']})" if p["killed_in_round"] else "")
            rows.append([key, name + note, *(cell(p) for _, cell in PEER_COLUMNS)])
    lines += [*table(["run", "peer", *(h for h, _ in PEER_COLUMNS)], rows), ""]
    lines += ["## Incidents", "", "Every round of the window a peer did not simply average in (once it "
              "had joined), and every re-sync of the run: the peer's round record and its own warnings about "
              "that round. *w*: inside the measured window. The json has the warm-up's too.", ""]
    for key, run in runs.items():
        lines += incident_lines(key, run)
    if results.get("failed"):
        lines += ["Failed runs: " + "; ".join(f"{k}: {e}" for k, e in results["failed"].items()), ""]
    if results.get("findings"):
        lines += ["## Findings", "", results["findings"].strip(), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def incident_lines(key: str, run: dict) -> list[str]:
    """A run's incidents in the window, and its re-syncs (warm-up included); at most 80."""
    shown = [i for i in run["incidents"] if i["in_window"] or i.get("resynced")][:80]
    groups = ", ".join(f"{r}: {'+'.join(map(str, g))}" for r, g in run["groups_by_round"].items())
    lines = [f"**{key}** ({len(run['incidents'])}; groups per round: {groups})", ""]
    for inc in shown:
        said = " / ".join(line[:200] for line in inc["log"][:3])
        where = " w" if inc["in_window"] else ""
        lines.append(f"- {inc['peer']} round {inc['round']}{where}: {inc['outcome']}"
                     + (f", group {inc.get('group_size')}" if "group_size" in inc else "")
                     + (", re-synced" if inc.get("resynced") else "")
                     + (f", caught up {inc['caught_up']}" if inc.get("caught_up") else "")
                     + (f", error: {inc['error']}" if inc.get("error") else "")
                     + (f" — log: {said}" if said else ""))
    if len(run["incidents"]) > len(shown):
        lines.append(f"- ... {len(run['incidents']) - len(shown)} more (warm-up) in the json")
    return [*lines, ""]


def target_lines(runs: dict) -> list[str]:
    """Issue 32's targets for every fault-free 16-peer run, against the 4-peer run of its settings."""
    def settings(run: dict) -> tuple:
        return run["churn"], run["demand_cores"], run.get("throttle_clock", "wall")

    rows = []
    for key, big in runs.items():
        if big["peers_n"] != 16 or big["churn"]:
            continue
        s = summary(big)
        rows.append([key, "every peer averages in >= 90% of rounds after warm-up",
                     f"lowest share {fmt(s['share_min'], '.0%')}, {s['below_target']} peer(s) below",
                     "met" if s["below_target"] == 0 else "missed"])
        rows.append([key, "no re-sync in a fault-free run",
                     f"{s['resyncs_run']} re-sync(s) in the whole run ({s['resyncs_window']} after warm-up)",
                     "met" if s["resyncs_run"] == 0 else "missed"])
        ref = next((r for r in runs.values() if r["peers_n"] == 4 and settings(r) == settings(big)), None)
        if ref is None:
            rows.append([key, "join time within 2x of a 4-peer swarm's", "no 4-peer run with its settings",
                         "-"])
            continue
        r = summary(ref)
        ratio = s["join_s"] / r["join_s"] if s["join_s"] and r["join_s"] else None
        after = s["after_boot_s"] / r["after_boot_s"] if s["after_boot_s"] and r["after_boot_s"] else None
        rows.append([key, "join time within 2x of a 4-peer swarm's",
                     f"{fmt(s['join_s'])} s vs {fmt(r['join_s'])} s (median, process start to first averaged "
                     f"round): {fmt(ratio, '.2f')}x; from the end of boot (`start` record): "
                     f"{fmt(s['after_boot_s'])} s vs {fmt(r['after_boot_s'])} s, {fmt(after, '.2f')}x",
                     "-" if ratio is None else "met" if ratio <= TARGET_JOIN_RATIO else "missed"])
    return table(["run", "target (issue 32)", "figure", "met"],
                 rows or [["-", "(no fault-free 16-peer run)", "-", "-"]])


# -- main -------------------------------------------------------------------------------------------
def interrupted(*_) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 12, 16])
    parser.add_argument("--rounds", type=int, default=12, help="rounds measured after warm-up")
    parser.add_argument("--round-seconds", type=float, default=10.0)
    parser.add_argument("--demand", type=float, default=DEFAULT_DEMAND,
                        help="the swarm's training demand in cores (throttle N/demand)")
    parser.add_argument("--churn", type=int, default=0,
                        help="every K rounds after warm-up: kill one peer, start a joiner")
    parser.add_argument("--throttle-clock", choices=("wall", "cpu"), default="wall",
                        help="wall: shoal run --throttle; cpu: by the step's CPU time (module docstring)")
    parser.add_argument("--bootstraps", type=int, default=1,
                        help="entry peers, each given to every peer (their load is reported)")
    parser.add_argument("--group-size", type=int, default=0,
                        help="averaging.target_group_size: sub-groups of about this size (0: one group)")
    parser.add_argument("--compression", default="",
                        help="averaging.compression instead of tiny.toml's fp16 (int4: shoal's default)")
    parser.add_argument("--state-compression", default="",
                        help="sub-groups: averaging.state_compression (auto/lat8: the lattice code, fp16, fp32; "
                             "the compact codes need --compression int4 or int8)")
    parser.add_argument("--warmup-timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--append", action="store_true", help="keep the runs already in the results json")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--findings", type=Path,
                        help="with --report-only: a markdown file, stored as the findings")
    args = parser.parse_args()
    if args.report_only:
        results = json.loads(args.out.with_suffix(".json").read_text())
        if args.findings is not None:
            results["findings"] = args.findings.read_text()
        write_results(results, args.out, report, redraw=True)
        print(args.out.with_suffix(".md").read_text())
        return 0
    if args.demand > 1.2:
        parser.error("a training demand above 1.2 of the 2 cores measures starvation, not the swarm")
    signal.signal(signal.SIGTERM, interrupted)
    saved = args.out.with_suffix(".json")
    previous = json.loads(saved.read_text()) if args.append and saved.exists() else {}
    command = {"command": command_line(__spec__.name), "provenance": provenance(),
               "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    commands = [*previous.get("meta", {}).get("commands", []), command]
    results = {"meta": {"commands": commands, "rounds": args.rounds, "round_seconds": args.round_seconds,
                        "demand": args.demand, "cores": psutil.cpu_count(),
                        "config": CONFIG.name},
               "runs": previous.get("runs", {}), "failed": previous.get("failed", {})}
    if previous.get("findings"):
        results["findings"] = previous["findings"]
    root = Path(tempfile.mkdtemp(prefix="shoal-scale-"))
    print(f"work in {root}", file=sys.stderr, flush=True)
    try:
        for n in args.peers:
            wait_for_pytest()
            run = Run(n, args, root)
            print(f"== {run.key}: {n} peers, throttle {run.throttle:g} ({time.strftime('%H:%M:%S')})",
                  file=sys.stderr, flush=True)
            try:
                results["runs"][run.key] = run.execute()
                results["failed"].pop(run.key, None)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - one failed run is reported, the rest go on
                traceback.print_exc()
                results["failed"][run.key] = f"{type(exc).__name__}: {exc}"[:300]
            command["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
            write_results(results, args.out, report)
    except KeyboardInterrupt:
        print("interrupted: the results so far are kept", file=sys.stderr)
        command["interrupted"] = True
    command["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    write_results(results, args.out, report)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
