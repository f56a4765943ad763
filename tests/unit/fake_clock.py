"""A fake ``averaging.engine.loop.Clock`` for unit tests: time moves only when the test says so.

One ``FakeClock`` per peer (each machine has its own clock; peers share only the schedule), used by
that peer's training thread and its sync worker's thread. Three things move its time, and nothing
else does, so every figure the engine computes from it is exact:

- ``advance(seconds)``: the test, on the training thread ("this inner step took 30 ms").
- ``wait(job)``: the training thread blocks on a worker job. Nobody else advances a peer's time,
  so while it waits, time jumps to the worker's next wake-up (if the worker sleeps); a job that
  never sleeps costs no time. This is how a stall, or blocking mode's wait for the deadline,
  takes exactly as long as the worker's sleep.
- ``sleep``/``sleep_until`` on the worker's thread do not move time themselves: they block, for
  real, until the training thread's ``advance`` or ``wait`` reaches the wake-up. Were a sleep to
  jump the time itself, the jump would land between two of the training thread's reads in an
  order that depends on the OS scheduler.

So a sleeping worker wakes exactly when the training thread's time passes its wake-up. What is
still up to the OS scheduler is when the worker *reads* the clock while the training thread keeps
advancing it (overlap mode): a figure the worker measures from the moment it starts a job (the
engine's ``sync_s``) is only exact when the training thread is blocked meanwhile (blocking mode).

A sleep or wait that no one ends within ``real_timeout`` real seconds raises ``TimeoutError``
rather than hang the test.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

WALL_START = 1_700_000_000.0  # a plausible unix time
MONOTONIC_START = 500.0  # another origin, so that mixing now() and monotonic() shows in the figures


class FakeClock:
    def __init__(self, start: float = WALL_START, *, real_timeout: float = 30.0):
        self._cond = threading.Condition()
        self.start = start
        # Time is kept as seconds since ``start``: sums of small steps stay exact to ~1e-16 s,
        # while now() has a real unix time's resolution (~2e-7 s).
        self._elapsed = 0.0
        self._wakeups: list[float] = []  # the worker's pending wake-ups, as elapsed seconds
        self.real_timeout = real_timeout

    # -- the Clock interface ---------------------------------------------------------------
    def now(self) -> float:
        with self._cond:
            return self.start + self._elapsed

    def monotonic(self) -> float:
        with self._cond:
            return MONOTONIC_START + self._elapsed

    def sleep(self, seconds: float) -> None:
        with self._cond:
            self._sleep_until(self._elapsed + seconds)

    def sleep_until(self, when: float) -> None:
        with self._cond:
            self._sleep_until(when - self.start)  # exact for any ``when`` within decades of ``start``

    def wait(self, job: Future[T]) -> T:
        job.add_done_callback(self._notify)  # runs at once if the job is done already
        deadline = time.monotonic() + self.real_timeout
        with self._cond:
            while not job.done():
                pending = [wakeup for wakeup in self._wakeups if wakeup > self._elapsed]
                if pending:  # the worker sleeps: its time passes while we wait for it
                    self._elapsed = min(pending)
                    self._cond.notify_all()
                    continue
                # Until the job finishes or the worker starts to sleep (both notify).
                self._cond.wait(deadline - time.monotonic())
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"fake clock: a worker job not done after {self.real_timeout} s of real time")
        return job.result()

    # -- the test's side -------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        with self._cond:
            self._elapsed += seconds
            self._cond.notify_all()

    # -- internals (with the lock held) ----------------------------------------------------
    def _sleep_until(self, wakeup: float) -> None:
        if wakeup <= self._elapsed:
            return
        self._wakeups.append(wakeup)
        self._cond.notify_all()  # a training thread in wait() moves the time to our wake-up
        try:
            if not self._cond.wait_for(lambda: self._elapsed >= wakeup, timeout=self.real_timeout):
                raise TimeoutError(f"fake clock: nobody moved the time to start + {wakeup} s (now start + "
                                   f"{self._elapsed} s) within {self.real_timeout} s of real time")
        finally:
            self._wakeups.remove(wakeup)

    def _notify(self, _job: Future) -> None:
        with self._cond:
            self._cond.notify_all()
