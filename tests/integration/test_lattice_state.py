"""The lattice code of a sub-group's state on real reducers (``averaging.math.lattice``,
``averaging.state_compression = "lat8"``): three real ``HivemindBackend``s on loopback in one group,
int4 pseudo-gradients, anchors and momenta as one-byte residues on the grid the group's signed
claims set. Two members' anchors lie a few steps apart, the third's 100 steps off (far by its
claim): the near two end with the same bytes, within a grid step of their mean on every value; the
far one cannot decode the group's state and keeps its own exactly (its round engine downloads the
group's). The pseudo-gradient is averaged over all three as ever."""

from __future__ import annotations

import uuid

import pytest
import torch

from averaging.math import lattice
from averaging.math.fingerprints import claim_of, far_members, momentum_of
from averaging.math.wire import LATTICE_CODE, WireFormat
from tests.integration.averagers import group_backends, group_round, stepped_states

# A few averagers, mostly waiting on matchmaking: run beside the unit tests (scripts/run-suite.sh).
pytestmark = [pytest.mark.integration, pytest.mark.wall_clock]


@pytest.mark.timeout(150)
def test_a_group_averages_its_state_in_one_byte_a_value_and_a_far_member_keeps_its_own():
    wire, numel, peers = WireFormat.of("int4"), 8_000, 3
    generator = torch.Generator().manual_seed(9)
    step = torch.randn(numel, generator=generator) * 1e-3
    base = torch.randn(numel, generator=generator) * 0.05
    # two anchors ~2 steps apart, the third ~100 steps off; each one step taken
    states = stepped_states([base + torch.randn(numel, generator=generator) * (0.1 if i == 2 else 1e-3)
                             for i in range(peers)], step)
    grads = [wire.to_send(torch.randn(numel, generator=generator) * 1e-3) for _ in range(peers)]
    extras = [torch.cat([s.anchor, s.momentum]) for s in states]
    with group_backends(peers, numel=numel, prefix=f"lattice-{uuid.uuid4().hex[:6]}", extra_code=LATTICE_CODE,
                        wire=wire) as backends:
        outcomes, vectors, outs, round = group_round(
            backends, grads, extras, lambda i, round: states[i].claim_message(round=round, with_momentum=True).encode())
    messages = [s.claim_message(round=round, with_momentum=True) for s in states]
    assert all(outcome.ok and len(outcome.group) == peers for outcome in outcomes), outcomes
    claims = [claim_of(m) for m in messages]
    far = far_members(claims)
    assert far == [False, False, True]
    grid = lattice.group_lattice(claims, [momentum_of(m) for m in messages], far)
    steps = grid.steps()
    near = torch.stack(extras[:2]).double().mean(0)
    assert torch.equal(outs[0], outs[1])  # one state for the group's near members: the same bytes
    # each member's value on the grid (half a step), the mean's residue on it (half a step)
    assert bool(((outs[0].double() - near).abs() <= steps * (1 + 1e-5)).all())
    assert float((outs[0].double() - near).abs().max()) > 0  # (it did ride the grid: not an fp32 path)
    assert torch.equal(outs[2], extras[2])  # the far member keeps its own state exactly
    # the pseudo-gradients are averaged over all three, the far member's included
    assert float((vectors[0] - torch.stack(grads).mean(0)).abs().max()) < 0.2 * float(grads[0].abs().max())
    assert torch.equal(vectors[0], vectors[2])
