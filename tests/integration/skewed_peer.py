"""``shoal run`` for a peer whose wall clock libfaketime shifts (``swarm.skewed``), with the one
call that libfaketime 0.9.10 breaks replaced.

libfaketime shifts CLOCK_REALTIME, which is what a wrong clock is. Faking CLOCK_MONOTONIC as well
(its default) makes every timed wait of Python's threads (``Event.wait``, ``Condition.wait``, a
lock's timeout: ``sem_clockwait`` on the monotonic clock) block for good: the peer's monitor thread
published two progress records and then never woke again, so the swarm never saw the peer's
records. With ``FAKETIME_DONT_FAKE_MONOTONIC=1`` those waits work, but ``time.sleep``
(``clock_nanosleep`` on the monotonic clock) fails with EINVAL; this wrapper makes ``time.sleep``
a timed wait, before anything imports it, for the peer and the processes it forks. Durations are
on the true monotonic clock; only the wall clock is wrong, as on a real machine. With
``SHOAL_TEST_GATE`` the peer waits behind a start gate (``start_gate.py``) before ``shoal run`` begins.
"""

import sys
import threading
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


time.sleep = _sleep
sys.argv = ["shoal", "run", *sys.argv[1:]]

from start_gate import wait_for_gate  # noqa: E402 - beside this file; after the sleep above

from node.cli import main  # noqa: E402

wait_for_gate()
main()
