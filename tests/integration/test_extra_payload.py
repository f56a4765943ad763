"""A second vector rides the pseudo-gradient's all-reduce (``HivemindBackend(extra_numel=...)``):
three real ``HivemindBackend``s on loopback, as nodes run them, average an int4 pseudo-gradient
(int4 returns: shoal's runner) or an fp16 one (hivemind's delta returns) together with an extra
vector shaped like an Adam second moment (positive, spanning 40 binades). The pseudo-gradient ends
as the one-tensor path leaves it (the same average on every member); the extra vector ends at the
weighted mean within bf16's precision, its small entries kept, on every member. And sub-groups
(``averaging.engine.subgroups``): four backends meet as two groups of two under their groups' keys in
one round, each group averaging anchors and momenta in fp16 beside an int4 pseudo-gradient; each
member ends with its own group's mean, the same bytes within a group. In a group of three whose
claims put one member's anchor far from the others', the reducers leave its anchor and momentum out
of the mean (``far_members``) and it takes the others'. A hostile member (tests/integration/
hostile_node.py's ``fake-state`` and ``far-state``: its anchor x 10 in the extra vector) in a group of
four: with an honest claim the reducers' CenteredClip keeps the group's state within (clip_ratio +
1) x the honest members' spread of their mean (the plain mean would move it 16x as far); with a
claim of that anchor it is far and adds nothing; either way every honest member's ``state_problem``
takes the group's state."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch

from averaging.math import codecs, robust
from averaging.math.groups import group_key_bits
from averaging.math.robust import RobustConfig
from averaging.math.wire import MIX_CODE, WireFormat, mix_code
from averaging.network.hivemind.backend import HivemindBackend
from tests.integration.averagers import (
    ALLREDUCE_S,
    group_backends,
    group_round,
    loopback_averagers,
    stepped_states,
)

pytestmark = pytest.mark.integration

NUMEL, EXTRA = 24_000, 40_000
WEIGHTS = (1.0, 2.0, 0.5)


def payloads(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(NUMEL, generator=generator) * (1 + i) for i in range(len(WEIGHTS))]
    binades = torch.linspace(-50, -10, EXTRA).exp2()  # 2**-50 .. 2**-10: gradients of 2**-25 .. 2**-5, squared
    extras = [binades * (1 + torch.rand(EXTRA, generator=generator)) for _ in WEIGHTS]
    return grads, extras


def one_round(backends: list[HivemindBackend], vectors: list[torch.Tensor], extras: list[torch.Tensor], round: int):
    scheduled = time.time() + 3.0
    for backend in backends:  # a failed round fails in ALLREDUCE_S, so a replay costs about that
        backend.prepare(round=round, scheduled_time=scheduled, gather={"round": round}, timeout=ALLREDUCE_S)
    with ThreadPoolExecutor(len(backends)) as pool:
        return list(pool.map(lambda i: backends[i].average(vectors[i], weight=WEIGHTS[i], timeout=2 * ALLREDUCE_S, round=round,
                                                            extra=extras[i]), range(len(backends))))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("code", ["int4", "fp16"])
def test_an_extra_vector_is_averaged_in_bf16_beside_the_pseudo_gradient(code):
    wire = WireFormat.of(code)
    prefix = f"extra-{code}-{uuid.uuid4().hex[:6]}"

    def make(_: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=NUMEL, prefix=prefix, state_provider=lambda: ({}, []), wire=wire,
                               target_group_size=len(WEIGHTS), min_group_size=len(WEIGHTS), extra_numel=EXTRA,
                               min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=30.0,
                               robust=RobustConfig(ban_rounds=0))

    grads, extras = payloads(seed=5)
    sent = [wire.to_send(g) for g in grads]
    with loopback_averagers(len(WEIGHTS), make) as backends:
        for round in (1, 2, 3):  # a round whose matchmaking or a reducer failed is replayed (docs/hivemind.md)
            vectors, outs = [s.clone() for s in sent], [e.clone() for e in extras]
            outcomes = one_round(backends, vectors, outs, round)
            if all(outcome.ok and len(outcome.group) == len(WEIGHTS) for outcome in outcomes):
                break
        assert all(outcome.ok and len(outcome.group) == len(WEIGHTS) for outcome in outcomes), outcomes
        with pytest.raises(ValueError, match="extra vector of 40000 values"):
            backends[0].average(sent[0].clone(), weight=1.0, timeout=1.0, round=9)  # the extra is not optional

    total = sum(WEIGHTS)
    exact = sum(w * s.double() for w, s in zip(WEIGHTS, sent)) / total
    for vector in vectors:  # the pseudo-gradient: its return code's bound, as without an extra
        # int4: half a level of the block's average; fp16: each send's and each delta's fp16 rounding
        bound = (0.5 + 2**-11) / 7 * exact.abs().max() if wire.return_code == "int4" else \
            2**-9 * max(float(s.abs().max()) for s in sent)
        assert float((vector.double() - exact).abs().max()) <= float(bound)
    if wire.return_code == "int4":  # shoal's runner: every member holds the same average
        assert all(float((v - vectors[0]).abs().max()) <= 2**-22 * float(exact.abs().max()) for v in vectors)

    mean = sum(w * e.double() for w, e in zip(WEIGHTS, extras)) / total
    for out in outs:
        relative = ((out.double() - mean).abs() / mean).max()
        # bf16 sends (2**-9 each), a bf16 average (int4 run) or bf16 deltas (fp16 run): a few 2**-9
        assert float(relative) < 3 * 2**-8, float(relative)
        assert bool((out > 0).all())  # no small entry flushed to zero (fp16 would flush these)
    assert bool(codecs.quantize(mean.float(), "fp16").eq(0).any())  # ...as fp16 would, even scaled


@pytest.mark.timeout(150)
def test_sub_groups_meet_apart_and_each_averages_its_members_anchors_in_fp16():
    wire, numel, peers = WireFormat.of("int4"), 6_000, 4
    assert mix_code(wire, with_inner_state=False, requested="fp16") == MIX_CODE == "fp16"
    prefix = f"mix-{uuid.uuid4().hex[:6]}"
    weights = (1.0, 3.0, 2.0, 0.5)
    group = (0, 0, 1, 1)

    def make(_: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=numel, prefix=prefix, state_provider=lambda: ({}, []), wire=wire,
                               min_group_size=2, extra_numel=2 * numel, extra_code=MIX_CODE,
                               min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=30.0,
                               robust=RobustConfig(ban_rounds=0))

    generator = torch.Generator().manual_seed(3)
    grads = [wire.to_send(torch.randn(numel, generator=generator) * 1e-3) for _ in range(peers)]
    # anchors a few pseudo-gradients apart around weights of size 0.05, momenta of a step's size
    base = torch.randn(numel, generator=generator) * 0.05
    states = [torch.cat([base + torch.randn(numel, generator=generator) * 3e-3,
                         torch.randn(numel, generator=generator) * 1e-3]) for _ in range(peers)]
    with loopback_averagers(peers, make) as backends:
        for round in (1, 2, 3):  # a round whose matchmaking or a reducer failed is replayed (docs/hivemind.md)
            vectors, outs = [g.clone() for g in grads], [s.clone() for s in states]
            scheduled = time.time() + 3.0
            for i, backend in enumerate(backends):
                backend.prepare(round=round, scheduled_time=scheduled, gather={"round": round}, timeout=ALLREDUCE_S,
                                key_bits=group_key_bits(round, group[i], 2))
            with ThreadPoolExecutor(peers) as pool:
                outcomes = list(pool.map(
                    lambda i, vectors=vectors, outs=outs, round=round: backends[i].average(
                        vectors[i], weight=weights[i], timeout=2 * ALLREDUCE_S, round=round, extra=outs[i]), range(peers)))
            if all(outcome.ok for outcome in outcomes):
                break
    assert all(outcome.ok and len(outcome.group) == 2 for outcome in outcomes), outcomes
    for g in (0, 1):
        ids = [i for i in range(peers) if group[i] == g]
        assert all(set(outcomes[i].group) == set(outcomes[ids[0]].group) for i in ids)  # the pair met
        # the reducers' rules: weights bounded to 3x the lower one (robust.bound_weights: 2.0 vs 0.5
        # counts 1.5 vs 0.5), then CenteredClip, which is the weighted mean for two honest members
        bounded = robust.bound_weights([weights[i] for i in ids], max_ratio=RobustConfig().max_weight_ratio)
        mean = sum(w * states[i].double() for w, i in zip(bounded, ids)) / sum(bounded)
        for i in ids:
            # fp16 sends and an fp16 mean, each within 2**-11 of its part's largest value (a
            # power-of-two scale per part) ...
            assert float((outs[i].double() - mean).abs().max()) <= 2**-10 * float(mean.abs().max()), i
            # ... and the same bytes for every member: each ends at own + (mean - own), an fp32 rounding
            assert float((outs[i] - outs[ids[0]]).abs().max()) <= 2**-22 * float(mean.abs().max()), i
    assert float((outs[0] - outs[2]).abs().max()) > 1e-4  # the two groups applied different means


@pytest.mark.timeout(150)
def test_a_member_whose_claimed_anchor_is_far_adds_nothing_to_the_groups_state():
    wire, numel, peers = WireFormat.of("int4"), 8_000, 3
    generator = torch.Generator().manual_seed(8)
    step = torch.randn(numel, generator=generator) * 1e-3
    base = torch.randn(numel, generator=generator) * 0.05
    # two anchors a step apart, the third 40 steps off; each one step taken
    states = stepped_states([base + torch.randn(numel, generator=generator) * 1e-3 + (40 * step if i == 2 else 0)
                             for i in range(peers)], step)
    grads = [wire.to_send(torch.randn(numel, generator=generator) * 1e-3) for _ in range(peers)]
    extras = [torch.cat([s.anchor, s.momentum]) for s in states]
    with group_backends(peers, numel=numel, prefix=f"far-{uuid.uuid4().hex[:6]}", extra_code=MIX_CODE,
                        wire=wire) as backends:
        outcomes, vectors, outs, _ = group_round(
            backends, grads, extras, lambda i, round: states[i].claim_message(round=round, with_momentum=True).encode())
    assert all(outcome.ok and len(outcome.group) == 3 for outcome in outcomes), outcomes
    close = torch.stack(extras[:2]).double().mean(0)  # the two close members' mean: the far one left out
    for out in outs:  # every member, the far one too, ends with it (fp16 sends and returns)
        assert float((out.double() - close).abs().max()) <= 2**-10 * float(close.abs().max())
        assert float((out - outs[0]).abs().max()) <= 2**-22 * float(close.abs().max())  # an fp32 rounding apart
    everyone = torch.stack(extras).double().mean(0)
    assert float((everyone - close).abs().max()) > 10 * 2**-10 * float(close.abs().max())  # it would have moved it
    # the pseudo-gradients are averaged over all three, the far member's included
    assert float((vectors[0] - torch.stack(grads).mean(0)).abs().max()) < 0.2 * float(grads[0].abs().max())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["fake-state", "far-state"])
def test_a_member_that_sends_a_poisoned_anchor_moves_the_groups_state_a_bounded_way(mode):
    """hostile_node's ``fake-state`` / ``far-state`` member (its anchor x 10 in the extra vector, its
    claim honest / of that anchor) in a group with three honest members, on real reducers."""
    from averaging.engine.subgroups import claims_by_peer, left_out, state_problem, unpack_state
    from tests.integration.hostile_node import poisoned_claim_message, poisoned_pack_state

    wire, numel, peers, attacker = WireFormat.of("int4"), 8_000, 4, 3
    generator = torch.Generator().manual_seed(11)
    step = torch.randn(numel, generator=generator) * 1e-3
    base = torch.randn(numel, generator=generator) * 0.05
    # four anchors about a step apart (the attacker's true one too), each one step taken
    states = stepped_states([base + torch.randn(numel, generator=generator) * 1e-3 for _ in range(peers)], step)
    extras = [torch.cat([s.anchor, s.momentum]) for s in states]
    poisoned = torch.empty(state_numel := 2 * numel)
    poisoned_pack_state(states[attacker], poisoned)  # what the hostile node packs: its anchor x 10

    def claim(i: int, round: int) -> bytes:
        if i == attacker and mode == "far-state":
            return poisoned_claim_message(states[i], round=round, with_momentum=True).encode()
        return states[i].claim_message(round=round, with_momentum=True).encode()

    grads = [wire.to_send(torch.randn(numel, generator=generator) * 1e-3) for _ in range(peers)]
    sent = [*extras[:attacker], poisoned]
    with group_backends(peers, numel=numel, prefix=f"poison-{uuid.uuid4().hex[:6]}", extra_code=MIX_CODE,
                        wire=wire) as backends:
        outcomes, vectors, outs, round = group_round(backends, grads, sent, claim)
        robust = [backend.robustness() for backend in backends]
        ids = [backend.peer_id for backend in backends]
    assert all(outcome.ok and len(outcome.group) == peers for outcome in outcomes), outcomes
    assert not any(r.get("refused_parts") for r in robust), robust  # no check refused it: 10x is under 30x
    honest = torch.stack(extras[:attacker]).double()
    mean = honest.mean(0)
    scale = float(mean.abs().max())
    if mode == "far-state":
        # its claim is far: weight 0 in every reducer, so the honest members' mean is the group's
        # state (CenteredClip returns the weighted mean of members none of which lies beyond tau)
        # within fp16 sends and an fp16 mean, as in the test above
        for out in outs:
            assert float((out.double() - mean).abs().max()) <= 2**-10 * scale
    else:
        # its claim is honest: no member is far, and each reducer's CenteredClip bounds its part.
        # Per part p, with B_p the diagonal of the honest members' box (coordinate by coordinate,
        # max - min): the coordinate median of four parts, one hostile, lies in that box, so it is
        # within B_p of the honest mean and of each honest part; tau_p (clip_ratio x the median
        # distance to it, the mean of the 2nd and 3rd smallest of four) is at most clip_ratio x B_p;
        # and the result lies within tau_p of the median (robust.py: "every clipped part lies within
        # tau of the centre, so the result does too"). Over all parts: |result - honest mean| <=
        # (clip_ratio + 1) x B. The reducers see fp16 sends, each value within d = 2**-11 of the
        # largest honest value of its own (a power-of-two scale per part), and return an fp16 mean:
        # B moves by 2d a coordinate, the mean by d, the returned result by d.
        box = float((honest.max(0).values - honest.min(0).values).norm())
        spread = RobustConfig().clip_ratio + 1
        rounding = (2 * spread + 2) * 2**-11 * float(honest.abs().max()) * state_numel**0.5
        bound = spread * box + rounding
        for out in outs:
            assert float((out.double() - mean).norm()) <= bound
        assert sum(r.get("clipped_parts", 0) for r in robust) > 0  # (its parts, among others)
        # the plain mean (hivemind's rule) would have moved every member over 10x further than that
        plain = (honest.sum(0) + poisoned.double()) / peers
        assert float((plain - mean).norm()) > 10 * bound
    # and every honest member takes the group's state: it is within what the claims allow (state_problem)
    for i in range(attacker):
        by_peer = claims_by_peer(states[i], outcomes[i].gathered, round=round)
        assert len(by_peer) == peers
        anchor, momentum = unpack_state(outs[i], numel)
        # (the far members as the backend's group view found them, the reducers' own decision)
        assert outcomes[i].far == {ids[attacker]} if mode == "far-state" else not outcomes[i].far
        left = left_out(by_peer, outcomes[i].far, self_id=ids[i])
        assert left == [peer == ids[attacker] and mode == "far-state" for peer in by_peer]
        assert state_problem(anchor, momentum, states[i], list(by_peer.values()), members=peers,
                             local_pseudo_grad=grads[i], mu=states[i].config.momentum, left_out=left) is None
