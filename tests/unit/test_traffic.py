from __future__ import annotations

import threading

from averaging.math.traffic import Traffic, allreduce_payload


def test_butterfly_payload_per_member():
    # 4 members, 1000 fp16 values: each sends 3/4 of 2000 bytes twice (parts, then averaged parts)
    assert allreduce_payload(1000, 4, bytes_per_value=2) == 3000
    assert allreduce_payload(1000, 2, bytes_per_value=4) == 4000
    assert allreduce_payload(1000, 1, bytes_per_value=2) == 0  # alone: nothing on the wire
    assert allreduce_payload(1000, 3, bytes_per_value=2, client_mode=True) == 2000


def test_traffic_counts_from_several_threads():
    traffic = Traffic()
    threads = [threading.Thread(target=lambda: [traffic.add(sent=1, received=2) for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (traffic.sent, traffic.received) == (4000, 8000)
