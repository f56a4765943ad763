"""Bytes this peer put on the wire for averaging, for the dashboard and the progress records.

hivemind does not count bytes per averager (p2pd carries every stream), so shoal accounts for
the payload it knows it moved: all-reduce parts and downloaded state. Headers and DHT traffic
are not included; the README says so.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from averaging.math import codecs
from averaging.math.wire import canonical

STATE_BYTES_PER_VALUE = 4  # the shared state is stored and downloaded as fp32


def bytes_per_value(compression: str) -> float:
    """What one value of the pseudo-gradient costs on the wire, per ``averaging.compression`` (block
    scales included, at the code's default block size): the one definition of it. "none" is fp32."""
    return codecs.bytes_per_value(canonical(compression))


def round_payload(numel: int, group_size: int, *, send_bytes_per_value: float, return_bytes_per_value: float,
                  client_mode: bool = False) -> tuple[int, int]:
    """(sent, received) bytes of one member's all-reduce payload, sends and returns each in their code.

    A full member reduces 1/n of the vector: it sends the other (n-1)/n to their reducers in the send
    code and returns the averaged deltas of its 1/n to the n-1 others in the return code; it
    receives the same amounts. A client (it reduces nothing) sends its whole vector in the send code
    and receives the whole average back in the return code. Message headers (24 bytes a part for
    shoal's codecs) are not counted."""
    if group_size <= 1:
        return 0, 0
    if client_mode:
        return round(numel * send_bytes_per_value), round(numel * return_bytes_per_value)
    each_way = round((group_size - 1) * numel * (send_bytes_per_value + return_bytes_per_value) / group_size)
    return each_way, each_way


def allreduce_payload(numel: int, group_size: int, *, bytes_per_value: float, client_mode: bool = False) -> int:
    """Bytes one member sends (and, symmetrically, receives) in a butterfly all-reduce.

    A full member reduces 1/n of the vector: it sends the other (n-1)/n to their reducers and
    later sends its averaged part to the n-1 others, so 2(n-1)/n of the vector each way. A client
    (it reduces nothing) sends its whole vector once and receives the whole average once."""
    if group_size <= 1:
        return 0
    sent, _ = round_payload(numel, group_size, send_bytes_per_value=bytes_per_value,
                            return_bytes_per_value=bytes_per_value, client_mode=client_mode)
    return sent


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
