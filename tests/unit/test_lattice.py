"""The lattice code of a sub-group's state (``averaging.math.lattice``) on tensors alone: the lat8
bytes, the grid a group derives from its claims, and a whole group's round (residues out, a
reducer's unwrap and mean, the mean's residue back, every member's decode) without a network; then
``RobustPartReducer`` unwrapping real lattice parts, and the round engine's far member."""

from __future__ import annotations

import asyncio

import pytest
import torch

from averaging.math import codecs, lattice
from averaging.math.fingerprints import AnchorClaim, chunk_length, fingerprint, rms_difference
from averaging.math.robust import RobustConfig
from averaging.math.wire import LATTICE_CODE, WireFormat, mix_code, state_compression_problem
from averaging.network.hivemind import codecs as hivemind_codecs
from averaging.network.hivemind.allreduce import RobustPartReducer
from protocols.messages import MessageError

NUMEL = 3 * 4093 + 100  # a short last chunk


def test_lat8_bytes_hold_residues_and_any_byte_decodes():
    values = torch.tensor([0.0, 1.4, 255.0, 256.0, -1.0, 300.6, -257.0])
    data = codecs.encode(values, "lat8")
    assert len(data) == codecs.HEADER.size + values.numel() and codecs.bytes_per_value("lat8") == 1.0
    assert codecs.decode(data, max_numel=10).tolist() == [0.0, 1.0, 255.0, 0.0, 255.0, 45.0, 255.0]
    assert torch.equal(codecs.quantize(values, "lat8"), codecs.decode(data, max_numel=10))
    every = codecs.encode(torch.arange(256.0), "lat8")
    assert codecs.decode(every, max_numel=256).tolist() == list(range(256))
    forged = bytearray(data)
    forged[12:16] = (3).to_bytes(4, "little", signed=True)  # an exponent: lat8 has none
    with pytest.raises(MessageError, match="exponent"):
        codecs.decode(bytes(forged), max_numel=10)
    with pytest.raises(ValueError, match="NaN"):
        codecs.encode(torch.tensor([float("nan")]), "lat8")
    assert hivemind_codecs.wire_type("lat8", "lat8") == 7918


def test_the_lattice_code_is_chosen_only_where_the_mean_comes_back_the_same_for_everyone():
    int4, fp16 = WireFormat.of("int4"), WireFormat.of("fp16")
    assert mix_code(int4, with_inner_state=False, requested=LATTICE_CODE) == LATTICE_CODE
    assert mix_code(int4, with_inner_state=False) == LATTICE_CODE  # the default ("auto")
    assert state_compression_problem(int4, with_inner_state=False, requested=LATTICE_CODE) is None
    assert "int8/int4" in state_compression_problem(fp16, with_inner_state=False, requested=LATTICE_CODE)
    assert "average_inner_state" in state_compression_problem(int4, with_inner_state=True, requested=LATTICE_CODE)
    assert "one of" in state_compression_problem(int4, with_inner_state=False, requested="int4")


def members(seed: int, count: int, *, spread: float, far: int | None = None, far_by: float = 0.0):
    """Anchors around weights of 0.05, ``spread`` (RMS) from them, one member ``far_by``; momenta of
    a step; each member's claimed step 1e-3 on every chunk."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=generator) * 0.05
    states = []
    for i in range(count):
        anchor = base + torch.randn(NUMEL, generator=generator) * (far_by if i == far else spread)
        states.append(torch.cat([anchor, torch.randn(NUMEL, generator=generator) * 1e-3]))
    chunks = -(-NUMEL // chunk_length(NUMEL))
    claims = [AnchorClaim(fingerprint(s[:NUMEL]), torch.full((chunks,), 1e-3, dtype=torch.float64), 1) for s in states]
    momenta = [fingerprint(s[NUMEL:]) for s in states]
    return states, claims, momenta


def group_round(states: list[torch.Tensor], grid: lattice.Lattice, *, reducer: int = 0,
                far: frozenset[int] = frozenset()) -> list[torch.Tensor]:
    """A whole group's round on tensors: residues out, one reducer's unwrap and mean (its own part as
    the reference, or a near member's if it is far), the mean's lat8 bytes back, every member's decode."""
    sent = [s.clone() for s in states]
    for s in sent:
        lattice.to_residues_(s, grid)
    parts = dict(enumerate(sent))
    reference = lattice.reference_part(parts, own=reducer, far=far)
    near = [lattice.unwrap(p, reference) for i, p in parts.items() if i not in far]
    back = codecs.decode(codecs.encode(torch.stack(near).mean(0), "lat8"), max_numel=2 * NUMEL)
    outs = []
    for own, residues in zip(states, sent):
        out = residues + lattice.wrap(back - residues)  # the member's container: its delta, wrapped
        lattice.from_residues_(out, own, grid)
        outs.append(out)
    return outs


def test_a_group_ends_with_the_same_bytes_within_a_grid_step_of_its_mean():
    states, claims, momenta = members(1, 4, spread=3e-3)  # anchors ~3 steps apart
    grid = lattice.group_lattice(claims, momenta, [False] * 4)
    # half the range: the larger of 32 claimed steps and 8x the largest estimated distance
    distance = max(float(rms_difference(a.fingerprint, b.fingerprint).max()) for a in claims for b in claims)
    assert float(grid.anchor_steps.max()) * lattice.HALF == pytest.approx(max(32e-3, 8 * distance))
    assert float(grid.momentum_steps.max()) * lattice.HALF == pytest.approx(32e-3)  # momenta ~1.4 steps apart
    for reducer in (0, 3):
        outs = group_round(states, grid, reducer=reducer)
        assert all(torch.equal(out, outs[0]) for out in outs)  # one state for the whole group
        mean = torch.stack(states).double().mean(0)
        # each member's value rounded to the grid (half a step), the mean's residue rounded (half a step)
        assert bool(((outs[0].double() - mean).abs() <= grid.steps() * (1 + 1e-6)).all())
    assert lattice.edge_values(torch.zeros(3), torch.tensor([0.0, 97.0, -50.0])) == 1


def test_a_far_member_widens_nothing_and_a_far_reducer_unwraps_against_a_near_member():
    states, claims, momenta = members(2, 4, spread=1e-3, far=3, far_by=0.1)  # 100 steps off
    far = [False, False, False, True]
    grid = lattice.group_lattice(claims, momenta, far)
    assert float(grid.anchor_steps.max()) * lattice.HALF == pytest.approx(32e-3)  # the near members' range
    everyone = lattice.group_lattice(claims, momenta, [False] * 4)
    # counted in, it would widen the grid to the cap: 8x coarser for everyone
    assert float(everyone.anchor_steps.max()) == pytest.approx(lattice.RANGE_CAP_STEPS * 1e-3 / lattice.HALF)
    outs = group_round(states, grid, reducer=3, far=frozenset({3}))
    near_mean = torch.stack(states[:3]).double().mean(0)
    for out in outs[:3]:
        assert torch.equal(out, outs[0])
        assert bool(((out.double() - near_mean).abs() <= grid.steps() * (1 + 1e-6)).all())
    # the far member's decode is wrong by whole ranges: it must not take it (it downloads instead)
    assert float((outs[3].double() - near_mean).abs().max()) > 0.1


def test_the_reducer_unwraps_lattice_parts_before_judging_them():
    shapes = (torch.Size([64]), torch.Size([64]))
    generator = torch.Generator().manual_seed(4)
    values = [200.0 + torch.randn(64, generator=generator) * 20 for _ in range(3)]  # near 200: wraps past 255
    residues = [torch.remainder(v.round(), 256) for v in values]
    parts = [[torch.zeros(64), r] for r in residues]  # part 0: the pseudo-gradient's, part 1: the state's

    async def main():
        reducer = RobustPartReducer(shapes, 3, config=RobustConfig(), local_sender_index=0, refuse=lambda *a: None,
                                    return_code="int4", extra_parts=[False, True], extra_code="lat8")
        results = await asyncio.gather(*(reducer.accumulate_part(s, p, parts[s][p], weight=1.0)
                                         for s in range(3) for p in range(2)))
        return reducer, results

    reducer, results = asyncio.run(main())
    expected = torch.remainder(torch.stack([v.round() for v in values]).mean(0).round(), 256)
    assert torch.equal(results[1], expected)  # the mean's residue, not the mean of residues
    assert torch.equal(codecs.decode(reducer.returns[1], max_numel=64), expected)
    naive = torch.remainder(torch.stack(residues).mean(0).round(), 256)
    assert not torch.equal(naive, expected)  # (the residues did wrap)
    assert reducer.edge_values == 0 and not reducer.clipped
    # a sender 110 grid steps from the reducer on 5 values: overflow suspects (beyond 3/4 of half the range)
    values[2][:5] = values[0][:5] + 110
    parts[2][1] = torch.remainder(values[2].round(), 256)
    reducer, _ = asyncio.run(main())
    assert reducer.edge_values == 5


STATE_NUMEL, STATE_ROUND = 4093 * 4, 5


def state_setup(seed: int):
    """For ``subgroups.conclude`` on real shared states: a generator, weights of 0.05, an outer step
    of 1e-3, the layout and the outer optimizer."""
    from averaging.math.flat import FlatLayout
    from averaging.math.outer_step import OuterConfig

    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(STATE_NUMEL, generator=generator) * 0.05
    step = torch.randn(STATE_NUMEL, generator=generator) * 1e-3
    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(STATE_NUMEL)))])
    return generator, base, step, layout, OuterConfig(lr=0.7, momentum=0.9, nesterov=True)


def test_a_far_member_of_a_lattice_round_takes_the_groups_step_and_re_syncs_from_the_near_members():
    """``subgroups.conclude(lattice=True)``: a member far from its group by the claims cannot decode the
    group's lattice-coded state (its averager kept its own), so it applies the group's step to its
    own state and asks for a re-sync from the near members; a near member takes the group's state
    as with fp16, and without the lattice code the far member takes it too."""
    from averaging.engine.subgroups import conclude as conclude_mixed
    from averaging.math.group_view import decode_claims, group_view
    from averaging.network.interface import AverageOutcome
    from averaging.state.shared_state import SharedState
    from averaging.state.verdict import Applied

    numel, round = STATE_NUMEL, STATE_ROUND
    generator, base, step, layout, outer = state_setup(seed=6)

    def member(spread: float) -> SharedState:
        state = SharedState(layout, base + torch.randn(numel, generator=generator) * spread, outer)
        state.apply(step, round=round - 1)
        return state

    def conclude(i: int, *, lattice_code: bool):
        states = [member(1e-3) for _ in range(3)] + [member(0.1)]
        gathered = {f"m{j}": s.claim_message(round=round, with_momentum=True).encode() for j, s in enumerate(states)}
        view = group_view(decode_claims(gathered, numel=numel), lattice_coded=lattice_code)
        outcome = AverageOutcome(ok=True, group=tuple(gathered), gathered=gathered, far=view.far)
        mixed = torch.cat([torch.stack([s.anchor for s in states[:3]]).mean(0),
                           torch.stack([s.momentum for s in states[:3]]).mean(0)])
        if i == 3 and lattice_code:
            mixed = torch.cat([states[3].anchor, states[3].momentum])  # what its averager kept
        before = states[i].anchor.clone()
        conclusion = conclude_mixed(states[i], outcome, step.clone(), round=round, mu=outer.momentum,
                                    averaged=step.clone(), mixed=mixed, self_id=f"m{i}", lattice=lattice_code)
        return conclusion, states[i], before, mixed

    conclusion, state, before, _ = conclude(3, lattice_code=True)
    assert conclusion.applied == Applied.AVERAGED and conclusion.resync is not None
    assert conclusion.resync.donors == ["m0", "m1", "m2"] and conclusion.resync.reference is None
    assert float((state.anchor - before).abs().max()) < 0.01  # its own anchor, one step on (not the group's)
    for i, lattice_code in ((0, True), (3, False)):
        conclusion, state, before, mixed = conclude(i, lattice_code=lattice_code)
        assert conclusion.applied == Applied.AVERAGED and conclusion.resync is None, conclusion.error
        # the group's state, one step on (a step moves a weight by well under 0.01)
        assert float((state.anchor - mixed[:numel]).abs().max()) < 0.01
    assert float((state.anchor - before).abs().max()) > 0.1  # the far member was pulled in without the code


def test_members_claiming_step_0_cannot_make_an_honest_member_re_sync_to_their_state():
    """Issue 54, item 4, the audit's proof on the real functions: two colluders of four claim an honest
    member's anchor with step 0. The group's lower median step is then 0, and the group's rule finds
    the other honest member, two steps away, far; it used to re-sync, taking the state most donors
    served (theirs). Measured in its own step it is near: it keeps its state and takes the step."""
    import dataclasses

    from averaging.engine.subgroups import conclude
    from averaging.math.group_view import decode_claims, group_view
    from averaging.network.interface import AverageOutcome
    from averaging.state.shared_state import SharedState
    from averaging.state.verdict import Applied

    numel, round = STATE_NUMEL, STATE_ROUND
    generator, base, step, layout, outer = state_setup(seed=9)
    first = SharedState(layout, base.clone(), outer)
    first.apply(step, round=round - 1)
    second = SharedState(layout, base + 2 * step, outer)  # two steps away
    second.apply(step, round=round - 1)
    honest = first.claim_message(round=round, with_momentum=True)
    colluder = dataclasses.replace(honest, scale=tuple(0.0 for _ in honest.scale)).encode()
    gathered = {"h1": honest.encode(), "c1": colluder, "c2": colluder,
                "h2": second.claim_message(round=round, with_momentum=True).encode()}
    view = group_view(decode_claims(gathered, numel=numel), lattice_coded=True)
    assert "h2" in view.far  # the group's rule, fooled
    before = second.anchor.clone()
    outcome = AverageOutcome(ok=True, group=tuple(gathered), gathered=gathered, far=view.far)
    conclusion = conclude(second, outcome, step.clone(), round=round, mu=outer.momentum, averaged=step.clone(),
                          mixed=torch.cat([second.anchor, second.momentum]), self_id="h2", lattice=True)
    assert conclusion.applied == Applied.AVERAGED and conclusion.resync is None
    assert float((second.anchor - before).abs().max()) < 0.01  # its own anchor, one step on


def test_a_liar_in_a_pair_cannot_make_the_grid_coarse():
    """In a group of two nobody is far, so the grid takes the pair's claimed distance; a liar that
    claims an anchor far off (and a huge step) gets the grid only as coarse as ``RANGE_CAP_STEPS``
    of the smaller claimed step: two steps, not a grid that rounds its partner's weights to 0."""
    states, claims, momenta = members(5, 2, spread=1e-3)
    liar = AnchorClaim(fingerprint(states[1][:NUMEL] + 1e3), claims[1].scale * 1e6, 1)
    grid = lattice.group_lattice([claims[0], liar], momenta, [False, False])
    assert float(grid.anchor_steps.max()) == pytest.approx(lattice.RANGE_CAP_STEPS * 1e-3 / lattice.HALF)
    outs = group_round(states, grid)
    assert float((outs[0] - states[0]).abs().max()) < 1e-2  # its partner's state moved a few steps at most


def test_a_member_beyond_what_the_grid_covers_counts_as_far_in_a_lattice_group():
    """50 claimed steps from three members that share an anchor, yet a tenth of the weights' RMS:
    near by ``far_members`` (it would take the fp16 mean), far for the lattice code, whose grid
    covers 32 steps (``WITHIN_STEPS``): it could not decode the group's state, so it downloads it."""
    from averaging.math.fingerprints import far_members

    generator = torch.Generator().manual_seed(3)
    shared = torch.randn(NUMEL, generator=generator) * 0.05
    step = torch.full((-(-NUMEL // chunk_length(NUMEL)),), 1e-4, dtype=torch.float64)
    other = shared + torch.randn(NUMEL, generator=generator) * 50e-4
    claims = [AnchorClaim(fingerprint(a), step, 1) for a in (shared, shared, shared, other)]
    assert far_members(claims) == [False] * 4  # 0.005 apart: under half the weights' RMS (0.025)
    assert lattice.far(claims) == [False, False, False, True]
    assert lattice.WITHIN_STEPS == 32
    claims[3] = AnchorClaim(fingerprint(shared + torch.randn(NUMEL, generator=generator) * 20e-4), step, 1)
    assert lattice.far(claims) == [False] * 4  # 20 steps: within the grid


def test_the_in_process_hub_runs_the_lattice_code_as_real_reducers_do():
    """tests/integration/test_lattice_state.py's group on ``LocalBackend``s: two anchors a few steps
    apart and one 100 steps off; the near two end with the same bytes, within a grid step of their
    mean (it rode the grid); the far one is left out of the mean, cannot decode it and keeps its own
    state exactly; every outcome names it far, as the group's view found it."""
    import threading

    from averaging.math.fingerprints import claim_of, far_members, momentum_of
    from averaging.math.flat import FlatLayout
    from averaging.math.outer_step import OuterConfig
    from averaging.network.local import LocalBackend, LocalHub
    from averaging.state.shared_state import SharedState

    numel, round = 8_000, 2
    generator = torch.Generator().manual_seed(9)
    step = torch.randn(numel, generator=generator) * 1e-3
    base = torch.randn(numel, generator=generator) * 0.05
    layout = FlatLayout.of([("w", torch.nn.Parameter(torch.zeros(numel)))])
    states = []
    for spread in (1e-3, 1e-3, 0.1):
        states.append(SharedState(layout, base + torch.randn(numel, generator=generator) * spread,
                                  OuterConfig(lr=0.7, momentum=0.9, nesterov=True)))
        states[-1].apply(step, round=1)
    extras = [torch.cat([s.anchor, s.momentum]) for s in states]
    outs = [extra.clone() for extra in extras]
    hub = LocalHub()
    backends = [LocalBackend(hub, f"m{i}", s.shared_state, far_state_numel=numel, lattice=True)
                for i, s in enumerate(states)]
    for i, backend in enumerate(backends):
        backend.prepare(round=round, scheduled_time=0.0, timeout=5.0,
                        gather=states[i].claim_message(round=round, with_momentum=True).encode())
    outcomes = [None] * 3

    def average(i: int) -> None:
        outcomes[i] = backends[i].average(torch.zeros(4), weight=1.0, timeout=5.0, round=round, extra=outs[i])

    threads = [threading.Thread(target=average, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert all(o is not None and o.ok and o.far == {"m2"} for o in outcomes), outcomes
    messages = [s.claim_message(round=round, with_momentum=True) for s in states]
    claims = [claim_of(m) for m in messages]
    assert far_members(claims) == [False, False, True]
    steps = lattice.group_lattice(claims, [momentum_of(m) for m in messages], [False, False, True]).steps()
    near = torch.stack(extras[:2]).double().mean(0)
    assert torch.equal(outs[0], outs[1])
    assert bool(((outs[0].double() - near).abs() <= steps * (1 + 1e-5)).all())
    assert float((outs[0].double() - near).abs().max()) > 0  # it rode the grid: not the exact mean
    assert torch.equal(outs[2], extras[2])  # the far member keeps its own state exactly
