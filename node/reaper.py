"""Make sure hivemind's processes end when we leave, even when its own shutdown does not.

hivemind ends a DHT that misses its shutdown grace period with SIGTERM, which leaves that DHT's
p2pd daemon running (p2pd only stops on a clean shutdown; HIVEMIND_NOTES.md), orphaned to init.
So before shutting down we note hivemind's processes and their descendants (p2pd included),
and afterwards kill whichever of them is still alive. Only those: a library user's other child
processes are never touched.
"""

from __future__ import annotations

import logging
import time

import psutil

logger = logging.getLogger(__name__)


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
