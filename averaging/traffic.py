"""Bytes this peer put on the wire for averaging, for the dashboard and the progress records.

hivemind does not count bytes per averager (p2pd carries every stream), so shoal accounts for
the payload it knows it moved: all-reduce parts and downloaded state. Headers and DHT traffic
are not included; the README says so.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# What one value of the pseudo-gradient costs on the wire, per ``averaging.compression``: the one
# definition of it. "none" is fp32, as the shared state is stored and downloaded.
BYTES_PER_VALUE = {"fp16": 2, "none": 4}
STATE_BYTES_PER_VALUE = BYTES_PER_VALUE["none"]


def bytes_per_value(compression: str) -> int:
    return BYTES_PER_VALUE[compression]


def allreduce_payload(numel: int, group_size: int, *, bytes_per_value: int, client_mode: bool = False) -> int:
    """Bytes one member sends (and, symmetrically, receives) in a butterfly all-reduce.

    A full member reduces 1/n of the vector: it sends the other (n-1)/n to their reducers and
    later sends its averaged part to the n-1 others, so 2(n-1)/n of the vector each way. A client
    (it reduces nothing) sends its whole vector once and receives the whole average once."""
    if group_size <= 1:
        return 0
    vector = numel * bytes_per_value
    if client_mode:
        return vector
    return 2 * (group_size - 1) * vector // group_size


@dataclass
class Traffic:
    """Cumulative bytes, updated from the sync worker's and the training thread's side."""

    sent: int = 0
    received: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, *, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
