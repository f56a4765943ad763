"""The cumulative byte counter the swarm updates from two threads."""

from __future__ import annotations

import threading

from averaging.engine.stats import Traffic


def test_traffic_counts_from_several_threads():
    traffic = Traffic()
    threads = [threading.Thread(target=lambda: [traffic.add(sent=1, received=2) for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (traffic.sent, traffic.received) == (4000, 8000)
