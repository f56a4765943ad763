"""Real ``HivemindBackend`` averagers in this pytest process, on loopback: for tests of the averaging
layer itself (no shoal process, no training)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import hivemind

from averaging.hivemind_backend import HivemindBackend
from node.library.cleanup import hivemind_sockets, remove_stale


@contextmanager
def loopback_averagers(count: int, make: Callable[[int, hivemind.DHT], HivemindBackend]) -> Iterator[list[HivemindBackend]]:
    """``count`` DHTs on loopback, each bootstrapped from the first, each with the backend
    ``make(i, dht)`` builds. Afterwards everything is shut down, the SIGINT handler restored (every
    averager sets it to ignored in its parent) and the sockets a shut-down averager leaves removed."""
    sigint = signal.getsignal(signal.SIGINT)
    sockets_before = hivemind_sockets()
    dhts: list[hivemind.DHT] = []
    backends: list[HivemindBackend] = []
    try:
        for i in range(count):
            initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
            backends.append(make(i, dhts[-1]))
        yield backends
    finally:
        for backend in backends:
            backend.shutdown()
        for dht in dhts:
            dht.shutdown()
        signal.signal(signal.SIGINT, sigint)
        remove_stale(hivemind_sockets() - sockets_before)
