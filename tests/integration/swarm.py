"""Real ``shoal run`` processes on loopback, and the cleanup that tests rely on.

Every peer runs in its own session (process group), so a test can end the peer *and* the
DHT/averager processes and p2pd daemons it started, even after a crash.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "tiny.toml"
JOIN_LINE = re.compile(r"to join: shoal run (.*)")


def shoal_command() -> list[str]:
    return [sys.executable, "-m", "node.cli"]


@dataclass
class Peer:
    name: str
    proc: subprocess.Popen
    workdir: Path
    log_path: Path
    metrics_path: Path
    checkpoint_dir: Path
    maddrs: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_address(self, timeout: float = 60.0) -> list[str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = JOIN_LINE.search(self.log())
            if match:
                self.maddrs = re.findall(r"--initial-peer (\S+)", match.group(1))
                return self.maddrs
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} printed no address in {timeout}s:\n{self.log()[-3000:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout}s:\n{self.log()[-3000:]}") from None


class Swarm:
    """Starts peers, remembers every process group, and kills them all at the end."""

    def __init__(self, root: Path, run_id: str):
        self.root, self.run_id = root, run_id
        self.peers: list[Peer] = []

    def start(self, name: str, *args: str, initial: list[str] | None = None, config: Path = TINY,
              env: dict[str, str] | None = None) -> Peer:
        workdir = self.root / name
        workdir.mkdir(parents=True, exist_ok=True)
        metrics, checkpoints, log = workdir / "metrics.jsonl", workdir / "checkpoints", workdir / "log.txt"
        cmd = [*shoal_command(), "run", "--config", str(config), "--run-id", self.run_id, "--no-ui",
               "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-file", str(metrics),
               "--checkpoint-dir", str(checkpoints)]
        for maddr in initial or []:
            cmd += ["--initial-peer", maddr]
        cmd += list(args)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHOAL_CACHE_DIR": str(self.root / "cache"), **(env or {})}
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)
        peer = Peer(name, proc, workdir, log, metrics, checkpoints)
        self.peers.append(peer)
        return peer

    def kill_all(self) -> None:
        for peer in self.peers:
            kill_process_group(peer.proc)


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the peer's whole session: the node, its DHT/averager children and p2pd."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    members = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == pgid]
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for member in members:
        try:
            member.kill()
        except psutil.Error:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def p2pd_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if any("p2pd" in part for part in (p.info["cmdline"] or [])[:1])}
