"""The faults of ``benchmarks.swarm.faults --faults``: what each one costs a 4-peer swarm.

A fault is injected once every peer has averaged in one group of four; when it is over (the link
back, the bootstrap restarted, the killed peer started again) the run goes on until every peer has
averaged in a group of four again, one round more, then Ctrl+C for all. From the peers' own
records, per peer: its rounds from the fault to that reunion by outcome (averaged in a group,
folded into the next contribution, absent: no record, the peer was down), the outer steps its
side dropped at a reunion (``reunion`` event: its lineage replaced by the larger one), its
re-syncs; for the swarm: the time from the fault's end to one group of four, in seconds and in
rounds, and the anchors' spread after the last round.

Faults (``kind:seconds``):

- ``split:S``: peers 2-3 cut off from 0-1 for S seconds (network namespaces, a second bridge;
  needs root). Peer 3's only initial peer is peer 2, on its side of the split.
- ``bootstrap:S``: the swarm's ``shoal bootstrap`` (every peer's only initial peer) stopped with
  Ctrl+C and started again S seconds later with its identity and port (loopback).
- ``averager:S``: peer 3's averager process killed (as the out-of-memory killer would); the peer
  leaves with exit code 6 and is started again S seconds later on its checkpoint dir (loopback).
- ``skew:S``: no fault in the network: the peers' clocks are wrong from the start (libfaketime on
  each whole peer process; peer 0's is right, peer 1's S s fast, peer 2's S s slow, peer 3's 1 s
  fast), and once all four averaged in one group the swarm trains ``SKEW_ROUNDS`` more rounds.
  Measured: each peer's share of those rounds averaged, and in a group of all four (issue 31's
  target: >= 90% with S = 5).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import netns
from benchmarks.common.results import REPO
from examples.swarm_launcher import LocalSwarm, kill_process_group, shoal_command
from node.library.checkpoint import load_checkpoint, round_dir_name
from node.observe.metrics import read_metrics
from tests.integration.swarm import FAKETIME, SKEWED_PEER, skewed

PEERS = 4
SKEW_ROUNDS = 20  # rounds measured with wrong clocks, after all four first averaged together


@dataclass(frozen=True)
class Fault:
    kind: str  # split | bootstrap | averager
    seconds: float

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.seconds:g}"

    @staticmethod
    def parse(text: str) -> Fault:
        kind, _, seconds = text.partition(":")
        if kind not in ("split", "bootstrap", "averager", "skew") or not seconds:
            raise ValueError(f"fault {text!r}: expected split:S, bootstrap:S, averager:S or skew:S (S in seconds)")
        return Fault(kind, float(seconds))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(peer, event: str) -> list[dict]:
    return [r for r in read_metrics(peer.metrics_path) if r.get("event") == event] if peer.metrics_path.exists() else []


def _start_of(peer) -> dict:
    return _events(peer, "start")[0]


class _Run:
    """One fault's swarm: its peers (by name, the latest process of each) and the round clock."""

    def __init__(self, fault: Fault, root: Path, config: Path, round_s: float, throttle: float):
        self.fault, self.root, self.config, self.round_s = fault, root, config, round_s
        self.args = ("--round-seconds", f"{round_s:g}", "--throttle", f"{throttle:g}")
        self.swarm = LocalSwarm(root, run_id=f"faults-{fault.kind}-{os.getpid()}-{int(time.time()) % 10**6}", cwd=REPO)
        self.peers: dict[str, object] = {}  # the latest process of each peer (a restarted peer: its second)
        self.first: dict[str, object] = {}  # the first process of each (a restart appends to its metrics)
        self.expected_exits: set[int] = set()  # pids we stopped on purpose
        self.net = None
        self.bootstrap = None

    # -- starting -------------------------------------------------------------------------------
    def clock(self, i: int) -> str | None:
        """Peer ``i``'s clock offset for libfaketime ("+5s"), in a skew run; None: the right time."""
        if self.fault.kind != "skew" or i == 0:
            return None
        return {1: f"+{self.fault.seconds:g}s", 2: f"-{self.fault.seconds:g}s", 3: "+1s"}[i]

    def start_peer(self, i: int, initial: list[str]) -> None:
        name = f"peer-{i}"
        extra = {}
        if self.net is not None:
            extra = {"prefix": self.net.hosts[i].prefix(), "listen": f"/ip4/{self.net.hosts[i].address}/tcp/0"}
        if self.clock(i) is not None:
            extra.update(env=skewed(self.clock(i)), program=SKEWED_PEER)
        peer = self.swarm.start(name, *self.args, "--identity", str(self.root / f"{name}.key"), config=self.config,
                                initial=initial, **extra)
        self.peers[name] = peer
        self.first.setdefault(name, peer)

    def address(self, i: int) -> list[str]:
        maddrs = self.peers[f"peer-{i}"].wait_for_address(timeout=180)
        return [m for m in maddrs if self.net is None or self.net.hosts[i].address in m][:1]

    def start_bootstrap(self) -> None:
        log = open(self.root / "bootstrap.log", "ab")  # noqa: SIM115 - handed to the child
        self.bootstrap = subprocess.Popen(
            [*shoal_command(), "bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{self.bootstrap_port}",
             "--identity", str(self.root / "bootstrap.key"), "--address-file", str(self.root / "bootstrap.addr")],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        deadline = time.monotonic() + 120
        address_file = self.root / "bootstrap.addr"
        while not (address_file.exists() and address_file.read_text().strip()):
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bootstrap did not start:\n" + (self.root / "bootstrap.log").read_text()[-2000:])
            time.sleep(0.2)

    def stop_bootstrap(self) -> None:
        if self.bootstrap is not None and self.bootstrap.poll() is None:
            os.killpg(self.bootstrap.pid, signal.SIGINT)
            try:
                self.bootstrap.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            kill_process_group(self.bootstrap)
        (self.root / "bootstrap.addr").unlink(missing_ok=True)

    # -- the round clock ------------------------------------------------------------------------
    def schedule_start(self) -> float:
        return _start_of(self.first["peer-0"])["schedule_start"]

    def deadline(self, round: int) -> float:
        return self.schedule_start() + round * self.round_s

    def rounds(self, name: str) -> dict[int, dict]:
        """The round records of every process this peer name had (one metrics file), by round."""
        return {r["round"]: r for r in _events(self.peers[name], "round")}

    def whole_after(self, after: float) -> list[int] | None:
        """Per peer, its first round after ``after`` (a deadline) averaged in a group of four; None
        while some peer has none."""
        firsts = []
        for name in self.peers:
            whole = [r for r, rec in self.rounds(name).items() if rec["group_size"] == PEERS
                     and rec["applied"] == "averaged" and self.deadline(r) > after]
            if not whole:
                return None
            firsts.append(min(whole))
        return firsts

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, peer in self.peers.items():
                if peer.proc.poll() is not None and peer.proc.pid not in self.expected_exits:
                    raise RuntimeError(f"{name} exited with {peer.proc.returncode}:\n{peer.log()[-2500:]}")
            result = predicate()
            if result:
                return result
            time.sleep(0.5)
        raise TimeoutError(f"{self.fault.name}: {what}:\n" + "\n".join(
            f"--- {n} rounds {[(r, x['group_size'], x['applied']) for r, x in sorted(self.rounds(n).items())]}"
            for n in self.peers))


def run_fault(fault: Fault, root: Path, config: Path, *, round_s: float, throttle: float) -> dict:
    """Run one fault in a fresh swarm; its measurements (see the module's docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    run = _Run(fault, root, config, round_s, throttle)
    if fault.kind == "skew" and FAKETIME is None:
        raise RuntimeError("skew runs need libfaketime (apt-get install faketime)")
    net = None
    try:
        if fault.kind == "split":
            netns.BRIDGE, netns.PREFIX, netns.SUBNET = "shoalfbr0", "shoalf", "10.219.0"  # ours alone
            net = run.net = netns.Network(PEERS, mbit=200).__enter__()
            run.start_peer(0, [])
            first = run.address(0)
            run.start_peer(1, first)
            run.start_peer(2, first)
            run.start_peer(3, run.address(2))
        else:
            if fault.kind == "bootstrap":
                run.bootstrap_port = _free_port()
                run.start_bootstrap()
                initial = (root / "bootstrap.addr").read_text().split()[:1]
            else:
                run.start_peer(0, [])
                initial = run.address(0)
            for i in range(0 if fault.kind == "bootstrap" else 1, PEERS):  # peer 0 is up already unless a bootstrap is
                run.start_peer(i, initial)
        run.wait(lambda: run.whole_after(0.0), 300, "the four peers never averaged in one group")
        if fault.kind == "skew":
            first = max(run.whole_after(0.0)) + 1
            last = first + SKEW_ROUNDS - 1
            run.wait(lambda: all(last in run.rounds(n) for n in run.peers), SKEW_ROUNDS * round_s + 120,
                     f"not {SKEW_ROUNDS} rounds after the four first averaged")
            return _measure_skew(run, first, last)

        began = time.time()
        if fault.kind == "split":
            net.split([2, 3])
            time.sleep(fault.seconds)
            net.heal()
        elif fault.kind == "bootstrap":
            run.stop_bootstrap()
            time.sleep(fault.seconds)
            run.start_bootstrap()
        else:
            victim = run.peers["peer-3"]
            run.expected_exits.add(victim.proc.pid)
            os.kill(_start_of(victim)["processes"]["averager"], signal.SIGKILL)
            code = victim.proc.wait(timeout=60)
            if code != 6:
                raise RuntimeError(f"peer-3 exited with {code} (expected 6) after its averager was killed")
            time.sleep(max(0.0, began + fault.seconds - time.time()))
            run.start_peer(3, initial)
        ended = time.time()

        firsts = run.wait(lambda: run.whole_after(ended), 360, "not one group of four after the fault")
        reunion_round = max(firsts)
        last = reunion_round + 1
        run.wait(lambda: all(last in run.rounds(n) for n in run.peers), 6 * round_s + 60, "no round after the reunion")
    finally:
        try:
            run.swarm.interrupt_all()
            for peer in run.swarm.peers:
                peer.wait(timeout=60)
        finally:  # a second Ctrl+C while the peers stop still removes them and the namespaces
            run.swarm.kill_all()
            run.stop_bootstrap()
            if net is not None:
                net.__exit__(None, None, None)
    return _measure(run, began=began, ended=ended, reunion_round=reunion_round, last=last)


def _measure(run: _Run, *, began: float, ended: float, reunion_round: int, last: int) -> dict:
    first_round = math.ceil((began - run.schedule_start()) / run.round_s)  # the first deadline after the fault began
    end_round = math.ceil((ended - run.schedule_start()) / run.round_s)
    window = range(first_round, reunion_round + 1)
    whole_at = max(run.rounds(n)[reunion_round]["time"] for n in run.peers)
    per_peer = {}
    for name in run.peers:
        rounds = run.rounds(name)
        outcome = {"averaged": 0, "folded": 0, "absent": 0, "other": 0}
        for r in window:
            record = rounds.get(r)
            key = "absent" if record is None else record["applied"] if record["applied"] in outcome else "other"
            outcome[key] += 1
        reunions = [e for e in _events(run.peers[name], "reunion") if e["round"] >= first_round]
        resyncs = [e for e in _events(run.peers[name], "resync") if e["round"] >= first_round]
        per_peer[name] = {**outcome, "steps_dropped": sum(e["steps_dropped"] for e in reunions),
                          "tokens_dropped": sum(e["tokens_dropped"] for e in reunions),
                          "steps_merged": sum(e.get("steps_merged", 0) for e in reunions),
                          "tokens_merged": sum(e.get("tokens_merged", 0) for e in reunions),
                          "reunion_kept": [e["kept"] for e in reunions], "resyncs": len(resyncs),
                          "group_sizes": [rounds[r]["group_size"] for r in window if r in rounds]}
    anchors = {}
    for name in run.peers:
        checkpoint = load_checkpoint(run.peers[name].checkpoint_dir / round_dir_name(last))
        anchors[name] = torch.cat([t.flatten() for t in checkpoint.params.values()])
    reference = anchors["peer-0"]
    spread = max(float((a - reference).norm() / reference.norm()) for a in anchors.values())
    peer0 = run.rounds("peer-0")
    evals = {r: peer0[r].get("eval_loss") for r in range(reunion_round - 1, last + 1) if r in peer0}
    return {"fault": run.fault.name, "kind": run.fault.kind, "seconds": run.fault.seconds,
            "round_seconds": run.round_s, "rounds_of_fault": end_round - first_round, "eval_around_reunion": evals,
            "rounds_to_whole": reunion_round - end_round + 1, "seconds_to_whole": round(whole_at - ended, 1),
            "window": [window.start, window.stop - 1], "per_peer": per_peer, "anchor_spread": spread}


def _measure_skew(run: _Run, first: int, last: int) -> dict:
    per_peer = {}
    for i, name in enumerate(run.peers):
        rounds = run.rounds(name)
        measured = [rounds.get(r) for r in range(first, last + 1)]
        per_peer[name] = {"clock": run.clock(i) or "+0s",
                          "averaged": sum(1 for rec in measured if rec and rec["applied"] == "averaged"),
                          "with_all": sum(1 for rec in measured if rec and rec["applied"] == "averaged"
                                          and rec["group_size"] == PEERS),
                          "group_sizes": [rec["group_size"] if rec else 0 for rec in measured]}
    return {"fault": run.fault.name, "kind": "skew", "seconds": run.fault.seconds, "round_seconds": run.round_s,
            "window": [first, last], "per_peer": per_peer}


def skew_lines(runs: list[dict]) -> list[str]:
    """The skew runs' table (markdown lines)."""
    lines = ["| run | peer | clock | rounds | averaged | in a group of all four | group sizes |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        first, last = run["window"]
        count = last - first + 1
        for name, p in run["per_peer"].items():
            lines.append(f"| {run['fault']} | {name} | {p['clock']} | {first}-{last} | {p['averaged']} of {count} "
                         f"({p['averaged'] / count:.0%}) | {p['with_all']} ({p['with_all'] / count:.0%}) "
                         f"| {' '.join(map(str, p['group_sizes']))} |")
    return lines


def report_lines(runs: list[dict]) -> list[str]:
    """The faults' table and the per-peer table (markdown lines)."""
    skews = [run for run in runs if run["kind"] == "skew"]
    runs = [run for run in runs if run["kind"] != "skew"]
    if not runs:
        return skew_lines(skews)
    lines = ["| fault | rounds it spanned | one group of four again after it ended | peers' rounds averaged / folded / "
             "absent | outer steps merged / dropped at the reunion | re-syncs | anchors' spread after | peer-0's eval "
             "loss from the round before the reunion on |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        peers = run["per_peer"].values()
        total = {k: sum(p.get(k, 0) for p in peers)
                 for k in ("averaged", "folded", "absent", "steps_merged", "steps_dropped", "resyncs")}
        lines.append(f"| {run['fault']} | {run['rounds_of_fault']} | {run['seconds_to_whole']:.1f} s "
                     f"({run['rounds_to_whole']} round(s)) | {total['averaged']} / {total['folded']} / {total['absent']} "
                     f"| {total['steps_merged']} / {total['steps_dropped']} | {total['resyncs']} "
                     f"| {run['anchor_spread']:.1e} | "
                     + (" -> ".join(f"{v:.3f}" for v in run["eval_around_reunion"].values() if v is not None)
                        if run.get("eval_around_reunion") else "-") + " |")
    lines += ["", "| fault | peer | rounds (fault to reunion) | averaged | folded | absent | group sizes | steps "
              "merged (tokens) | steps dropped (tokens) | re-syncs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        first, last = run["window"]
        for name, p in run["per_peer"].items():
            lines.append(f"| {run['fault']} | {name} | {first}-{last} | {p['averaged']} | {p['folded']} | {p['absent']} "
                         f"| {' '.join(map(str, p['group_sizes']))} | {p.get('steps_merged', 0)} "
                         f"({p.get('tokens_merged', 0):,}) | {p['steps_dropped']} ({p['tokens_dropped']:,}) "
                         f"| {p['resyncs']} |")
    return lines + (["", *skew_lines(skews)] if skews else [])
