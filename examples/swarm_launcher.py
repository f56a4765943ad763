"""Several ``shoal run`` processes on one machine: the demo's and the tests' launcher.

Each peer runs in its own session (process group) so that ending a peer also ends the DHT and
averager processes and the p2pd daemon it started, even after a crash or ``kill -9`` (which
leaves hivemind's children running otherwise).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

JOIN_LINE = re.compile(r"to join: shoal run (.*)")


def shoal_command() -> list[str]:
    """The ``shoal`` entry point of this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "node.cli"]


@dataclass
class LocalPeer:
    name: str
    proc: subprocess.Popen
    workdir: Path
    log_path: Path | None
    metrics_path: Path
    checkpoint_dir: Path
    maddrs: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def wait_for_address(self, timeout: float = 90.0) -> list[str]:
        """The multiaddrs the peer printed in its ``to join:`` line."""
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

    def leftovers(self) -> list[int]:
        """Processes still alive in the peer's session (a clean exit leaves none: no p2pd)."""
        return session_members(self.proc.pid)

    def interrupt(self) -> None:
        """Ctrl+C for this peer alone: a clean leave."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)


class LocalSwarm:
    """Starts peers on loopback and guarantees that none of their processes outlives it."""

    def __init__(self, root: Path, run_id: str, *, cwd: Path, env: dict[str, str] | None = None):
        self.root, self.run_id, self.cwd = root, run_id, cwd
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.peers: list[LocalPeer] = []

    def start(self, name: str, *args: str, initial: list[str] | None = None, config: Path | None = None,
              ui: bool = False, env: dict[str, str] | None = None, prefix: list[str] | None = None,
              listen: str = "/ip4/127.0.0.1/tcp/0", program: list[str] | None = None) -> LocalPeer:
        """Start one peer; with ``ui`` it draws its live view on our terminal, else it logs to a file.
        ``prefix`` runs it inside something (e.g. ``ip netns exec <host>``); ``program`` replaces
        ``shoal run`` with a command that takes the same options (a benchmark's test-only peer)."""
        workdir = self.root / name
        workdir.mkdir(parents=True, exist_ok=True)
        metrics, checkpoints = workdir / "metrics.jsonl", workdir / "checkpoints"
        cmd = [*(prefix or []), *(program or [*shoal_command(), "run"]), "--run-id", self.run_id, "--listen", listen,
               "--metrics-file", str(metrics), "--checkpoint-dir", str(checkpoints)]
        if config is not None:
            cmd += ["--config", str(config)]
        if not ui:
            cmd.append("--no-ui")
        for maddr in initial or []:
            cmd += ["--initial-peer", maddr]
        cmd += list(args)
        log_path = None if ui else workdir / "log.txt"
        out: IO | None = None if ui else open(log_path, "wb")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=out, stderr=None if ui else subprocess.STDOUT,
                                    env={**self.env, **(env or {})}, start_new_session=True)
        finally:
            if out is not None:
                out.close()
        peer = LocalPeer(name, proc, workdir, log_path, metrics, checkpoints)
        self.peers.append(peer)
        return peer

    def interrupt_all(self) -> None:
        for peer in self.peers:
            peer.interrupt()

    def kill_all(self) -> None:
        for peer in self.peers:
            kill_process_group(peer.proc)


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL a peer's whole session: the node, its DHT/averager children and p2pd."""
    pgid = proc.pid  # start_new_session: the peer leads its own group
    members = [p for p in psutil.process_iter() if _pgid(p.pid) == pgid]
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for member in members:  # in case one changed its group
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


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a peer started with start_new_session leads its own)."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def write_toml(data: dict, path: Path) -> Path:
    """A run config for the peers: a flat two-level TOML writer (tomllib only reads)."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
