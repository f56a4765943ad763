"""A step waiting for its trigger survives a garbage collection in the averager process.

hivemind's command loop drops the task it creates per command, and the futures a step awaits refer
to it only weakly, so a collection while a step awaited its trigger destroyed the step: its group
waited for its parts until their sender timeout, and the peer's sync hung (a slow peer in
test_slow_sync, 1 run in 4). Here two real averagers form a group, each collects its garbage while
its step waits for the trigger, and then they average."""

from __future__ import annotations

import gc
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage

from averaging.math.wire import WireFormat
from averaging.network.hivemind.averager import ShoalAverager
from averaging.network.hivemind.backend import HivemindBackend
from tests.integration.averagers import loopback_averagers

# A few averagers, mostly waiting on matchmaking: run beside the unit tests (scripts/run-suite.sh).
pytestmark = [pytest.mark.integration, pytest.mark.wall_clock]

NUMEL = 4096


class CollectingAverager(ShoalAverager):
    async def _collect_garbage(self) -> None:  # a command, run in the averager process
        gc.collect()


# hivemind names RPC handlers after the servicer's class: keep the honest name, so peers meet.
CollectingAverager.__name__ = CollectingAverager.__qualname__ = ShoalAverager.__name__


class CollectingBackend(HivemindBackend):
    averager_class = CollectingAverager

    def collect_garbage(self) -> None:
        with self._averager._command_lock:
            self._averager._outer_pipe.send(("_collect_garbage", [], {}))


def no_state():
    return {}, [torch.zeros(1)]


@pytest.mark.timeout(120)
def test_a_step_awaiting_its_trigger_survives_a_garbage_collection():
    prefix = f"kept-{uuid.uuid4().hex[:6]}"

    def make(_i: int, dht: hivemind.DHT) -> CollectingBackend:
        return CollectingBackend(dht, numel=NUMEL, prefix=prefix, state_provider=no_state, wire=WireFormat.of("fp32"),
                                 allreduce_timeout=10.0)

    with loopback_averagers(2, make) as backends:
        scheduled = time.time() + 3.0
        for backend in backends:
            backend.prepare(round=1, scheduled_time=scheduled, gather={"round": 1}, timeout=20.0)
        controls = [backend._controls[1] for backend in backends]
        deadline = time.time() + 30
        while not all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls) and time.time() < deadline:
            time.sleep(0.05)
        assert all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls), [c.stage for c in controls]
        for backend in backends:  # while both wait for their trigger
            backend.collect_garbage()
        time.sleep(1.0)
        vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda pair: pair[0].average(pair[1], weight=1.0, timeout=20.0, round=1),
                                     zip(backends, vectors)))
        assert all(outcome.ok for outcome in outcomes), outcomes
        assert all(torch.allclose(vector, torch.full((NUMEL,), 0.5)) for vector in vectors)
