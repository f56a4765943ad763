"""The lattice code of a sub-group's state on real reducers (``averaging.math.lattice``,
``averaging.state_compression = "lat8"``): three real ``HivemindBackend``s on loopback in one group,
int4 pseudo-gradients, anchors and momenta as one-byte residues on the grid the group's signed
claims set. Two members' anchors lie a few steps apart, the third's 100 steps off (far by its
claim): the near two end with the same bytes, within a grid step of their mean on every value; the
far one cannot decode the group's state and keeps its own exactly (its round engine downloads the
group's). The pseudo-gradient is averaged over all three as ever."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch

from averaging.math import lattice
from averaging.math.fingerprints import claim_of, far_members, momentum_of
from averaging.math.flat import FlatLayout
from averaging.math.groups import group_key_bits
from averaging.math.outer_step import OuterConfig
from averaging.math.robust import RobustConfig
from averaging.math.wire import LATTICE_CODE, WireFormat
from averaging.network.hivemind.backend import HivemindBackend
from averaging.state.shared_state import SharedState
from tests.integration.averagers import loopback_averagers

pytestmark = pytest.mark.integration


@pytest.mark.timeout(150)
def test_a_group_averages_its_state_in_one_byte_a_value_and_a_far_member_keeps_its_own():
    wire, numel, peers = WireFormat.of("int4"), 8_000, 3
    prefix = f"lattice-{uuid.uuid4().hex[:6]}"
    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(numel)))])
    generator = torch.Generator().manual_seed(9)
    step = torch.randn(numel, generator=generator) * 1e-3
    base = torch.randn(numel, generator=generator) * 0.05
    states = []
    for i in range(peers):  # two anchors ~2 steps apart, the third ~100 steps off; each one step taken
        off = torch.randn(numel, generator=generator) * (0.1 if i == 2 else 1e-3)
        state = SharedState(layout, base + off, OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
        state.apply(step, round=1)
        states.append(state)

    def make(_: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=numel, prefix=prefix, state_provider=lambda: ({}, []), wire=wire,
                               min_group_size=peers, extra_numel=2 * numel, extra_code=LATTICE_CODE, mixing=True,
                               min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=30.0,
                               robust=RobustConfig(ban_rounds=0))

    grads = [wire.to_send(torch.randn(numel, generator=generator) * 1e-3) for _ in range(peers)]
    extras = [torch.cat([s.anchor, s.momentum]) for s in states]
    with loopback_averagers(peers, make) as backends:
        for round in (2, 3, 4):  # a round whose matchmaking or a reducer failed is replayed (docs/hivemind.md)
            vectors, outs = [g.clone() for g in grads], [e.clone() for e in extras]
            messages = [s.claim_message(round=round, with_momentum=True) for s in states]
            scheduled = time.time() + 3.0
            for i, backend in enumerate(backends):
                backend.prepare(round=round, scheduled_time=scheduled, timeout=20.0, key_bits=group_key_bits(round, 0, 1),
                                gather=messages[i].encode())
            with ThreadPoolExecutor(peers) as pool:
                outcomes = list(pool.map(
                    lambda i, vectors=vectors, outs=outs, round=round: backends[i].average(
                        vectors[i], weight=1.0, timeout=40.0, round=round, extra=outs[i]), range(peers)))
            if all(outcome.ok for outcome in outcomes):
                break
    assert all(outcome.ok and len(outcome.group) == peers for outcome in outcomes), outcomes
    claims = [claim_of(m) for m in messages]
    far = far_members(claims)
    assert far == [False, False, True]
    grid = lattice.group_lattice(claims, [momentum_of(m) for m in messages], far)
    steps = torch.empty(2 * numel, dtype=torch.float64)
    for start, stop, size in grid.spans():
        steps[start:stop] = size
    near = torch.stack(extras[:2]).double().mean(0)
    assert torch.equal(outs[0], outs[1])  # one state for the group's near members: the same bytes
    # each member's value on the grid (half a step), the mean's residue on it (half a step)
    assert bool(((outs[0].double() - near).abs() <= steps * (1 + 1e-5)).all())
    assert float((outs[0].double() - near).abs().max()) > 0  # (it did ride the grid: not an fp32 path)
    assert torch.equal(outs[2], extras[2])  # the far member keeps its own state exactly
    # the pseudo-gradients are averaged over all three, the far member's included
    assert float((vectors[0] - torch.stack(grads).mean(0)).abs().max()) < 0.2 * float(grads[0].abs().max())
    assert torch.equal(vectors[0], vectors[2])
