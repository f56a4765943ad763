"""A leaving peer lets its reducer finish the answers it owes before shutting its averager down
(``HivemindBackend._let_answers_out``). On the real capped swarm the slowest peer finished the run's
last round first, left 20 ms later, and the fastest peer's answer stream from it ended a part short:
that member's last round folded. Tested on a stand-in averager whose answer gauge the test drives."""

from __future__ import annotations

import threading
import time
from collections import deque

from averaging.network.hivemind import backend as backend_module
from averaging.network.hivemind.allreduce import RobustCounters
from averaging.network.hivemind.backend import HivemindBackend


class LeavingAverager:
    def __init__(self):
        self.robust_counters = RobustCounters()
        self.shut_down_at: float | None = None

    def is_alive(self) -> bool:
        return self.shut_down_at is None

    def shutdown(self) -> None:
        self.shut_down_at = time.monotonic()


def backend_with(averager: LeavingAverager, recent_allreduce_s=()) -> HivemindBackend:
    backend = HivemindBackend.__new__(HivemindBackend)  # no DHT, no process: only what shutdown uses
    backend._averager, backend._controls, backend._controls_lock = averager, {}, threading.Lock()
    backend._recent_allreduce_s = deque(recent_allreduce_s, maxlen=3)
    return backend


def test_shutdown_waits_for_the_answers_still_streaming_then_lingers_one_all_reduce():
    averager = LeavingAverager()
    RobustCounters._add(averager.robust_counters._answering, 2)  # two senders still being answered
    started = time.monotonic()

    def answered() -> None:
        time.sleep(0.3)
        RobustCounters._add(averager.robust_counters._answering, -1)
        time.sleep(0.2)
        RobustCounters._add(averager.robust_counters._answering, -1)

    threading.Thread(target=answered).start()
    backend_with(averager, recent_allreduce_s=[0.1, 0.25, 0.2]).shutdown()
    # 0.5 s until the last answer is out, then the longest recent all-reduce (0.25 s) for its bytes
    assert averager.shut_down_at - started >= 0.5 + 0.25 - 0.02
    assert averager.shut_down_at - started < 2.0


def test_shutdown_never_waits_past_the_grace(monkeypatch):
    monkeypatch.setattr(backend_module, "LEAVE_GRACE_S", 0.3)
    averager = LeavingAverager()
    RobustCounters._add(averager.robust_counters._answering)  # a stream that never ends
    started = time.monotonic()
    backend_with(averager, recent_allreduce_s=[5.0]).shutdown()
    assert 0.28 <= averager.shut_down_at - started < 1.0


def test_with_nothing_owed_and_no_all_reduce_yet_shutdown_is_immediate():
    averager = LeavingAverager()
    started = time.monotonic()
    backend_with(averager).shutdown()
    assert averager.shut_down_at - started < 0.1
