"""Real averagers (``HivemindBackend``s or plain hivemind ``DecentralizedAverager``s) in this pytest
process, on loopback: for tests of the averaging layer itself (no shoal process, no training)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Protocol, TypeVar

import hivemind
import torch

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


# -- one sub-group's round on real backends (tests of the state it averages) ---------------------
# A test group's payload is a few hundred KiB (under a second on loopback): a round whose
# matchmaking or a reducer failed (hivemind's races, docs/hivemind.md) gives up after this long and
# is replayed, instead of holding the suite for the usual 30-40 s.
ALLREDUCE_S = 10.0

def stepped_states(anchors: Sequence[torch.Tensor], step: torch.Tensor) -> list:
    """A ``SharedState`` per anchor (one flat tensor ``w``), each with the outer ``step`` taken
    once, so that its claim carries a step's scale."""
    from averaging.math.flat import FlatLayout
    from averaging.math.outer_step import OuterConfig
    from averaging.state.shared_state import SharedState

    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(step.numel())))])
    states = []
    for anchor in anchors:
        state = SharedState(layout, anchor, OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
        state.apply(step, round=1)
        states.append(state)
    return states


@contextmanager
def group_backends(count: int, *, numel: int, prefix: str, extra_code: str, wire) -> Iterator[list]:
    """``count`` real ``HivemindBackend``s that meet as one sub-group (``mixing``) averaging an int
    pseudo-gradient and the anchor and momentum (``2 * numel`` values in ``extra_code``)."""
    from averaging.math.robust import RobustConfig
    from averaging.network.hivemind.backend import HivemindBackend

    def make(_: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=numel, prefix=prefix, state_provider=lambda: ({}, []), wire=wire,
                               min_group_size=count, extra_numel=2 * numel, extra_code=extra_code, mixing=True,
                               min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=ALLREDUCE_S,
                               robust=RobustConfig(ban_rounds=0))

    with loopback_averagers(count, make) as backends:
        yield backends


def group_round(backends: list, grads: Sequence[torch.Tensor], extras: Sequence[torch.Tensor],
                gather: Callable[[int, int], bytes]) -> tuple[list, list[torch.Tensor], list[torch.Tensor], int]:
    """One round of ``backends`` as one group, each averaging its pseudo-gradient and extra vector
    (copies) with ``gather(member, round)`` as its claim; a round whose matchmaking or a reducer
    failed is replayed, up to three (docs/hivemind.md). (outcomes, vectors, extras, round)."""
    from averaging.math.groups import group_key_bits

    count = len(backends)
    for round in (2, 3, 4):
        vectors, outs = [g.clone() for g in grads], [e.clone() for e in extras]
        scheduled = time.time() + 3.0
        for i, backend in enumerate(backends):
            backend.prepare(round=round, scheduled_time=scheduled, timeout=ALLREDUCE_S,
                            key_bits=group_key_bits(round, 0, 1), gather=gather(i, round))
        with ThreadPoolExecutor(count) as pool:
            outcomes = list(pool.map(lambda i, vectors=vectors, outs=outs, round=round: backends[i].average(
                vectors[i], weight=1.0, timeout=ALLREDUCE_S + 5.0, round=round, extra=outs[i]), range(count)))
        if all(outcome.ok for outcome in outcomes):
            break
    return outcomes, vectors, outs, round
