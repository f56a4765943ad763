"""Real averagers (``HivemindBackend``s or plain hivemind ``DecentralizedAverager``s) in this pytest
process, on loopback: for tests of the averaging layer itself (no shoal process, no training)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import hivemind

from node.library.cleanup import hivemind_sockets, remove_stale


class _Averager(Protocol):
    def shutdown(self) -> None: ...


A = TypeVar("A", bound=_Averager)


@contextmanager
def loopback_averagers(count: int, make: Callable[[int, hivemind.DHT], A]) -> Iterator[list[A]]:
    """``count`` DHTs on loopback, each bootstrapped from the first, each with the averager (a
    ``HivemindBackend`` or a ``DecentralizedAverager``) ``make(i, dht)`` builds. Afterwards
    everything is shut down, the SIGINT handler restored (every averager sets it to ignored in its
    parent) and the sockets a shut-down averager leaves removed."""
    sigint = signal.getsignal(signal.SIGINT)
    sockets_before = hivemind_sockets()
    dhts: list[hivemind.DHT] = []
    averagers: list[A] = []
    try:
        for i in range(count):
            initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
            averagers.append(make(i, dhts[-1]))
        yield averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
        signal.signal(signal.SIGINT, sigint)
        remove_stale(hivemind_sockets() - sockets_before)
