"""A member whose step ended while it awaited its trigger is not waited for.

The leader's group is assembled, so the others send this member their parts; it never registers
the group (its step was cancelled: its round was passed, or its sync gave up). hivemind answers
such a part only when some group registers, ``ShoalAverager`` after its registration wait (0.4 x
allreduce_timeout, for a step that is merely late): the other members' all-reduce stalled that long
(24 s of 6 s rounds in test_slow_sync, then rounds missed). Now the member refuses the part at
once and holds the stream until the sender has read the refusal (closed early, the stream was reset
and the sender saw a broken pipe instead, in half the runs), the others drop it as a sender, and
their round ends (partial: its share of the reduction is missing) in a moment."""

from __future__ import annotations

import time
import uuid

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage

from averaging.math.wire import WireFormat
from averaging.network.hivemind.backend import HivemindBackend
from tests.integration.averagers import loopback_averagers

# A few averagers, mostly waiting on matchmaking: run beside the unit tests (scripts/run-suite.sh).
pytestmark = [pytest.mark.integration, pytest.mark.wall_clock]

NUMEL = 4096
ALLREDUCE_TIMEOUT = 40.0  # registration wait and sender timeout: 16 s


def no_state():
    return {}, [torch.zeros(1)]


@pytest.mark.timeout(120)
def test_a_member_whose_step_was_cancelled_before_its_trigger_is_not_waited_for():
    prefix = f"cancel-{uuid.uuid4().hex[:6]}"

    def make(_i: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=NUMEL, prefix=prefix, state_provider=no_state, wire=WireFormat.of("fp32"),
                               allreduce_timeout=ALLREDUCE_TIMEOUT)

    with loopback_averagers(2, make) as (live, gone):
        scheduled = time.time() + 3.0
        for backend in (live, gone):
            backend.prepare(round=1, scheduled_time=scheduled, gather={"round": 1}, timeout=20.0)
        controls = [backend._controls[1] for backend in (live, gone)]
        deadline = time.time() + 30
        while not all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls) and time.time() < deadline:
            time.sleep(0.05)
        assert all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls), [c.stage for c in controls]
        gone._controls.pop(1).cancel()  # matched, then gave up before its trigger
        time.sleep(0.5)
        vector = torch.ones(NUMEL)
        outcome = live.average(vector, weight=1.0, timeout=ALLREDUCE_TIMEOUT, round=1)
    assert not outcome.ok and outcome.partial > 0, outcome  # the member's share was never reduced
    assert torch.equal(vector, torch.ones(NUMEL))  # a failed round leaves the vector as it was
    assert outcome.sync_s < 0.25 * ALLREDUCE_TIMEOUT, outcome  # not the 16 s registration wait
