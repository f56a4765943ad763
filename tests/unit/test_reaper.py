"""The safety net after hivemind's shutdown: noted processes (and descendants) that outlive it die."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from node.library.cleanup import process_trees, reap

# A child that starts a grandchild (like a DHT process and its p2pd), then both sleep.
TREE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"


def test_a_process_tree_that_outlives_its_shutdown_is_killed():
    child = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        deadline = time.monotonic() + 20
        while len(psutil.Process(child.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_trees([child.pid, None, 999_999_999])  # None and dead pids are skipped
        assert len(tree) == 2
        grandchild = next(p for p in tree if p.pid != child.pid)
        killed = reap(tree, grace=0.2)
        assert sorted(killed) == sorted(p.pid for p in tree)
        child.wait(timeout=10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(grandchild.pid) and grandchild.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the grandchild survived"
            time.sleep(0.05)
    finally:
        if child.poll() is None:
            child.kill()


def test_processes_that_exit_in_time_are_left_alone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    tree = process_trees([child.pid])
    assert reap(tree, grace=20) == []
    child.wait(timeout=5)
