"""What the real-swarm benchmarks share: starting shoal peers, entry peers and DDP ranks on hosts
(network namespaces with capped links, or loopback), evaluating checkpoints, reading eval curves,
and counting the CPU the benchmark's own processes use.

A host is a ``netns.Host`` or ``None`` (loopback). Every process started here leads its own
session, and every launcher kills its sessions on the way out, also after an error.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import psutil
import torch

from benchmarks.common import cpu_throttle, netns
from benchmarks.common.results import REPO
from examples.swarm_launcher import (
    JOIN_LINE,
    LocalPeer,
    LocalSwarm,
    kill_process_group,
    shoal_command,
    write_toml,
)
from node.observe.metrics import read_metrics
from node.process.config import load_config
from node.training.data import BatchSampler, eval_batches, load_corpus, split_corpus
from node.training.model import build_model
from node.training.trainer import Trainer


def listen_on(host) -> str:
    return f"/ip4/{host.address}/tcp/0" if host else "/ip4/127.0.0.1/tcp/0"


def start_shoal_peers(swarm: LocalSwarm, config: Path | list[Path], throttles: list[float], hosts, *,
                      extra: tuple[str, ...] = (), initial: list[str] | None = None, timeout: float = 180,
                      first: int = 0, cpu_clock: bool = False) -> list[LocalPeer]:
    """One ``shoal run`` per throttle, peer i on ``hosts[i]`` with ``config`` (or ``config[i]``).
    Without ``initial`` (sync_modes) they join one after the other through the first; with it (an
    entry peer's address) they start all at once, so none trains alone while the others boot.
    ``first``: the index of the first of them (names and hosts), when others were started before.
    ``cpu_clock``: throttled by each step's CPU time (``benchmarks.common.cpu_throttle``), not ``--throttle``'s wall time."""
    configs = config if isinstance(config, list) else [config] * len(throttles)
    peers = []
    for i, (throttle, config) in enumerate(zip(throttles, configs, strict=True), start=first):
        host = hosts[i] if hosts else None
        entry = initial
        if entry is None and i > first:
            entry = [m for m in peers[0].maddrs if (host is None or hosts[first].address in m)][:1]
        flags = () if cpu_clock else ("--throttle", str(throttle))
        peer = swarm.start(f"peer-{i}", *flags, *extra, config=config, initial=entry,
                           prefix=host.prefix() if host else None, listen=listen_on(host),
                           program=cpu_throttle.PROGRAM if cpu_clock else None,
                           env={cpu_throttle.ENV: f"{throttle:g}"} if cpu_clock else None)
        if initial is None:
            peer.wait_for_address(timeout=timeout)
        peers.append(peer)
    if initial is not None:
        for peer in peers:
            peer.wait_for_address(timeout=timeout)
    return peers


def start_entry_peer(root: Path, host) -> tuple[LocalPeer, list[str]]:
    """A ``shoal bootstrap`` (DHT only, no model) on ``host``: the address the peers join through."""
    workdir = root / "entry"
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "log.txt"
    cmd = [*(host.prefix() if host else []), *shoal_command(), "bootstrap", "--listen", listen_on(host)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    entry = LocalPeer("entry", proc, workdir, log_path, workdir / "none.jsonl", workdir / "none")
    try:
        maddrs = entry.wait_for_address(timeout=120)
    except BaseException:
        kill_process_group(proc)
        raise
    assert JOIN_LINE.search(entry.log())
    return entry, [m for m in maddrs if host is None or host.address in m][:1]


def run_ddp_ranks(config: Path, throttles: list[float], hosts, out_dir: Path, name: str, *, budget: list[str],
                  no_sync: bool = False, port: int = 29533, timeout: float = 900,
                  throttle_clock: str = "calibrated") -> dict[str, list[dict]]:
    """``benchmarks.swarm.ddp_baseline`` ranks (one per throttle; with ``no_sync`` each trains alone) until the
    ``budget`` flags (``--budget S`` or ``--tokens N``) are spent; their metrics records per rank.
    ``throttle_clock``: its ``--throttle-clock``."""
    master = hosts[0].address if hosts else "127.0.0.1"
    procs, outs = [], []
    try:
        for rank, throttle in enumerate(throttles):
            out = out_dir / f"{name}-{rank}.jsonl"
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(throttles)), "MASTER_ADDR": master,
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   "GLOO_SOCKET_IFNAME": f"{netns.PREFIX}p{rank}" if hosts else "lo"}
            cmd = [*(hosts[rank].prefix() if hosts else []), sys.executable, "-m", "benchmarks.swarm.ddp_baseline",
                   "--config", str(config), *budget, "--throttle", str(throttle), "--out", str(out)]
            cmd += (["--no-sync"] if no_sync else []) + ["--throttle-clock", throttle_clock]
            with open(out.with_suffix(".log"), "wb") as log:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, stdout=log,
                                              stderr=subprocess.STDOUT))
            outs.append(out)
        deadline = time.time() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for proc in procs:
            kill_process_group(proc)
    return {f"peer-{r}": read_metrics(out) if out.exists() else [] for r, out in enumerate(outs)}


def eval_at(curve: list[tuple[float, float, float]], index: int, x: float) -> float | None:
    """Eval loss at ``x`` on axis ``index`` (0: seconds, 1: tokens) of (seconds, tokens, eval) points,
    interpolated linearly; the last value past the end, None before the first point."""
    points = [(p[index], p[2]) for p in curve if p[2] is not None]
    if not points or x < points[0][0]:
        return None
    before = [p for p in points if p[0] <= x]
    after = [p for p in points if p[0] >= x]
    if not after:
        return before[-1][1]
    (x0, y0), (x1, y1) = before[-1], after[0]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


class BusyTimeline:
    """The whole machine's busy CPU sampled every ``period`` seconds over a ``with`` block, to read
    how many cores were busy in given windows (an all-reduce's, say: averaged over a whole run, the
    idle time between windows hides whether they were CPU-bound)."""

    def __init__(self, period: float = 0.2):
        self.period = period
        self.samples: list[tuple[float, float]] = []  # (time.time(), busy CPU seconds since boot)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), _machine_busy()[0]))
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> BusyTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def cores_between(self, start: float, end: float) -> float | None:
        """Busy cores between the samples nearest inside [start, end]; None if fewer than two."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


class CpuMeter:
    """CPU used by this process's descendants (peers, their DHT/averager children, p2pd, DDP
    ranks) and by the whole machine, over a ``with`` block; sampled every ``period`` seconds (a
    process that exits loses at most its last period)."""

    def __init__(self, period: float = 1.0):
        self.period = period
        self._seen: dict[tuple[int, float], float] = {}  # (pid, create_time) -> CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for child in psutil.Process().children(recursive=True):
            try:
                times = child.cpu_times()
                self._seen[(child.pid, child.create_time())] = times.user + times.system
            except psutil.Error:
                continue

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._sample()
        self._before = dict(self._seen)
        self._machine0, self._wall0 = _machine_busy(), time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        machine1, self.wall_s = _machine_busy(), time.time() - self._wall0
        own = sum(v - self._before.get(k, 0.0) for k, v in self._seen.items())
        self.own_cores = own / self.wall_s
        self.machine_cores = (machine1[0] - self._machine0[0]) / self.wall_s
        self.machine_total_cores = (machine1[1] - self._machine0[1]) / self.wall_s

    def summary(self) -> dict:
        return {"own_cores": self.own_cores, "machine_busy_cores": self.machine_cores,
                "cores": psutil.cpu_count(), "wall_s": self.wall_s}


def write_config(base: Path, path: Path, overrides: dict[str, object]) -> Path:
    """``base`` with ``section.key`` overrides, as a TOML file the processes read."""
    data = tomllib.loads(base.read_text())
    for key, value in overrides.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    return write_toml(data, path)


class Evaluator:
    """The eval loss shoal peers report (``Trainer.evaluate_anchor`` on the config's eval batches),
    here for final checkpoints; and the unthrottled step time that sizes the runs."""

    def __init__(self, config_path: Path, overrides: dict | None = None):
        torch.set_num_threads(1)
        # The runs' own settings (speedup_real --set): eval batches follow data.batch_size and the model.
        self.config = load_config(config_path, overrides)
        c = self.config
        self.split = split_corpus(load_corpus(c.data), c.data.eval_fraction, c.data.max_eval_bytes,
                                  block_bytes=c.data.eval_block_bytes)
        self.batches = eval_batches(self.split.eval, c.model.seq_len, c.data.batch_size, c.train.eval_batches)
        self.trainer = Trainer(build_model(c.model, seed=0), c.inner, c.train, torch.device("cpu"))

    def evaluate(self, params: dict[str, torch.Tensor]) -> float:
        return self.trainer.evaluate_anchor(params, self.batches)

    def step_seconds(self, steps: int = 30) -> float:
        c = self.config
        sampler = BatchSampler(self.split.tokens, c.model.seq_len, c.data.batch_size, seed=0, held_out=self.split.held_out)
        times = []
        for _ in range(steps):
            x, y = sampler.next_batch()
            t0 = time.perf_counter()
            self.trainer.inner_step(x, y, 1e-4)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[5:])


def interrupted(*_) -> None:
    """A SIGTERM handler: stop as Ctrl+C does, so the results so far are written."""
    raise KeyboardInterrupt
