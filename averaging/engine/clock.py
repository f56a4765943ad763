"""Where the round engine reads time and waits: the real clock, or a test's fake one.

Every clock read and every wait of the engine goes through a ``Clock``: the real one unless a test
passes a fake whose time moves only when the test says so (``tests/unit/fake_clock.py``). The real
one runs on swarm time (``protocols.swarm_time``: this machine's clock corrected by the offset it
measured against its peers), so a peer with a wrong clock keeps the swarm's schedule.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Protocol, TypeVar

from protocols import swarm_time

T = TypeVar("T")


class Clock(Protocol):
    """Where the round engine reads time and waits: ``now``/``monotonic`` on both threads,
    ``sleep``/``sleep_until`` on the worker's, ``wait`` (for a worker job) on the training thread,
    so that a fake clock knows when the loop is idle."""

    def now(self) -> float:
        """Unix seconds: the run's schedule (round deadlines) is in these."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, for durations."""

    def sleep(self, seconds: float) -> None: ...

    def sleep_until(self, when: float) -> None:
        """Return once ``now() >= when`` (at once if it already is)."""

    def wait(self, job: Future[T]) -> T:
        """Block until a worker job is done; its result (or its exception, raised)."""


class SystemClock:
    """The real clock, on swarm time."""

    def now(self) -> float:
        return swarm_time.now()

    def monotonic(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def sleep_until(self, when: float) -> None:
        time.sleep(max(0.0, when - swarm_time.now()))

    def wait(self, job: Future[T]) -> T:
        return job.result()


SYSTEM_CLOCK = SystemClock()
