"""Leaving no hivemind process or socket behind, even when hivemind's own shutdown does not.

Processes: hivemind ends a DHT that misses its shutdown grace period with SIGTERM, which leaves
that DHT's p2pd daemon running (p2pd only stops on a clean shutdown; docs/hivemind.md), orphaned
to init. So before shutting down we note hivemind's processes and their descendants (p2pd
included), and afterwards kill whichever of them is still alive. Only those: a library user's
other child processes are never touched.

Sockets: hivemind creates unix sockets under /tmp and does not always remove them (a clean
shutdown leaves the averager's client socket, a killed peer all of them). We remove the ones
nobody listens on any more (connecting is refused), so that repeated runs and test suites leave
/tmp as they found it, without touching a live peer's socket.

``close_hivemind`` is the one shutdown path every owner of hivemind processes uses (the library
swarm, the bootstrap peer, ``shoal status``).
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

logger = logging.getLogger(__name__)

SOCKET_GLOB = "/tmp/hivemind-*.sock"


def process_trees(pids: list[int | None]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants that are alive now."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.Error:
            continue
    return list(found.values())


def reap(procs: list[psutil.Process], *, grace: float = 3.0) -> list[int]:
    """Wait up to ``grace`` seconds for ``procs`` to exit, then SIGKILL the rest; returns their pids."""
    deadline = time.monotonic() + grace
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    if alive:
        logger.debug(f"killed hivemind processes left after shutdown: {[p.pid for p in alive]}")
    return [p.pid for p in alive]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

SOCKET_GLOB = "/tmp/hivemind-*.sock"


def hivemind_sockets() -> set[str]:
    return set(glob.glob(SOCKET_GLOB))


def is_stale(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
        return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False  # unsure (timeout, permissions): leave it
    finally:
        probe.close()


def remove_stale(paths: set[str]) -> int:
    """Remove the sockets among ``paths`` that no process listens on; returns how many."""
    removed = 0
    for path in paths:
        if os.path.exists(path) and is_stale(path):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed


def close_hivemind(steps: Iterable[Callable[[], Any]], pids: list[int | None], sockets_before: set[str]) -> None:
    """Run hivemind shutdown ``steps`` (each best-effort, failures logged), then kill whatever of
    the ``pids`` process trees is still alive and remove the sockets that appeared since
    ``sockets_before`` and nobody listens on. The trees are noted first: a DHT terminated by its
    own shutdown would otherwise orphan its p2pd where we can no longer find it."""
    procs = process_trees(pids)
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - leaving goes on
            logger.warning(f"shutdown step {getattr(step, '__qualname__', step)} failed: {e!r}")
    reap(procs)
    remove_stale(hivemind_sockets() - sockets_before)
