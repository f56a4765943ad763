"""A slower GPU on an oversubscribed CPU: stretch each inner step by the CPU time it took.

``shoal run --throttle N`` sleeps ``(N - 1) x`` the step's wall-clock time, so on this 2-core
machine a step slowed by waiting for a core (other peers' training, their all-reduces, eval, DHT
traffic) is stretched by the whole factor: peers sharing the machine slow each other down N-fold
more than N separate machines would. Stretching by the step's thread CPU time keeps each peer's
demand at 1/N of a core without multiplying the waits: the closer stand-in for N machines.

    .venv/bin/python -m benchmarks.common.cpu_throttle [shoal run options]   # with SHOAL_CPU_THROTTLE=N in the env

runs ``shoal run`` so throttled (the sleep counts as compute, as ``--throttle``'s does); so does
``benchmarks.swarm.scale_peer`` (``run_shoal``), with hivemind's logs at DEBUG.
``benchmarks.swarm.ddp_baseline --throttle-clock cpu`` applies the same rule to the lone and DDP baselines.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "SHOAL_CPU_THROTTLE"


def patch(throttle: float) -> None:
    """Every ``Trainer.inner_step`` in this process then sleeps ``(throttle - 1) x`` its CPU time."""
    from node.training.trainer import Trainer

    inner_step = Trainer.inner_step

    def throttled_step(self, x, y, lr):
        started = time.thread_time()  # this thread's CPU time: waiting for a core is not counted
        loss = inner_step(self, x, y, lr)
        time.sleep((throttle - 1) * (time.thread_time() - started))
        return loss

    Trainer.inner_step = throttled_step


def run_shoal(args: list[str]) -> None:
    """``shoal run args``, throttled by CPU time when ``ENV`` in our environment says so (> 1)."""
    throttle = float(os.environ.get(ENV) or 0)
    if throttle > 1:
        patch(throttle)
    sys.argv = ["shoal", "run", *args]
    from node.cli import main as shoal_main

    shoal_main()


PROGRAM = [sys.executable, "-m", __spec__.name]  # a ``LocalSwarm.start`` program (run from the repository root)

if __name__ == "__main__":
    run_shoal(sys.argv[1:])
