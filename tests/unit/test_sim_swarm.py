"""The simulated swarm (``benchmarks.sim.swarm``) runs the engine's own round: every member of a
group ends a round with the same anchor and momentum, the step of the reducers' answer."""

import pytest
import torch

from averaging.math.flat import FlatLayout
from averaging.math.groups import group_count
from averaging.math.merge import apply_correction_
from averaging.math.outer_step import OuterConfig, outer_step_
from averaging.math.wire import LATTICE_CODE, MIX_CODE, MIX_CODE_EXACT, WireFormat, returned
from averaging.state.verdict import Applied
from benchmarks.sim.swarm import SimSwarm

OUTER = OuterConfig(lr=1.0, momentum=0.5)


def _swarm(peers: int, *, groups: int = 0, state_code: str = MIX_CODE_EXACT, wire: WireFormat | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    layout = FlatLayout.of(model.named_parameters())
    anchor = layout.pack(dict(model.named_parameters()), layout.new_buffer())
    mean = lambda sends, weights: sum(s * (w / sum(weights)) for s, w in zip(sends, weights))  # noqa: E731
    swarm = SimSwarm(peers=peers, layout=layout, anchor=anchor, outer=OUTER, wire=wire or WireFormat.of("int4"),
                     reduce=mean, groups=groups, state_code=state_code)
    return swarm, layout


def _params(swarm: SimSwarm, generator: torch.Generator) -> list[torch.Tensor]:
    """Each peer's parameters after some training of its own: its anchor minus its own work."""
    return [p.state.anchor - 0.01 * torch.randn(p.state.anchor.shape, generator=generator) for p in swarm.peers]


def test_a_whole_swarm_round_gives_every_member_the_outer_step_of_the_returned_average():
    swarm, _ = _swarm(3)
    generator = torch.Generator().manual_seed(1)
    before = swarm.peers[0].state.anchor.clone()
    params = _params(swarm, generator)
    tokens = [8, 5, 3]
    results = swarm.run_round(1, [p.clone() for p in params], tokens)
    assert all(r.conclusion.applied == Applied.AVERAGED and len(r.group) == 3 for r in results)
    wire = WireFormat.of("int4")
    sends = [wire.to_send(before - p) for p in params]
    expected, momentum = before.clone(), torch.zeros_like(before)
    average = returned(sum(s * (n / sum(tokens)) for s, n in zip(sends, tokens)), sends[0], wire.return_code)
    outer_step_(expected, average, momentum, lr=OUTER.lr, mu=OUTER.momentum, nesterov=True)
    for peer, result, live, sent in zip(swarm.peers, results, params, sends):
        torch.testing.assert_close(peer.state.anchor, expected)
        # the engine's merge: the new anchor, minus the residual error feedback keeps (what was not sent)
        work = before - live
        apply_correction_([live], [result.correction])
        torch.testing.assert_close(live, expected - (work - sent))
    swarm.close()


@pytest.mark.parametrize("state_code", [MIX_CODE_EXACT, MIX_CODE, LATTICE_CODE])
def test_a_sub_group_round_ends_with_one_anchor_per_group(state_code):
    peers = 4
    swarm, _ = _swarm(peers, groups=group_count(peers, 2), state_code=state_code)
    generator = torch.Generator().manual_seed(2)
    for round in (1, 2, 3):
        results = swarm.run_round(round, _params(swarm, generator), [8, 6, 4, 2])
        assert all(r.conclusion.applied == Applied.AVERAGED for r in results), [r.conclusion for r in results]
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, result in enumerate(results):
            groups.setdefault(result.group, []).append(i)
        assert sorted(len(g) for g in groups.values()) == [2, 2]
        anchors = {group: swarm.peers[idx[0]].state.anchor.clone() for group, idx in groups.items()}
        for group, idx in groups.items():
            for i in idx:
                assert torch.equal(swarm.peers[i].state.anchor, anchors[group])
                assert torch.equal(swarm.peers[i].state.momentum, swarm.peers[idx[0]].state.momentum)
        first, second = anchors.values()
        assert not torch.equal(first, second)  # two groups, two steps: the check above means something
    swarm.close()


def test_a_member_alone_in_its_group_folds():
    swarm, _ = _swarm(3, groups=4)  # four groups for three peers: somebody is alone every round
    generator = torch.Generator().manual_seed(3)
    before = [p.state.anchor.clone() for p in swarm.peers]
    results = swarm.run_round(1, _params(swarm, generator), [4, 4, 4])
    alone = [i for i, r in enumerate(results) if r.conclusion.applied == Applied.FOLDED]
    assert alone
    for i in alone:
        assert torch.equal(swarm.peers[i].state.anchor, before[i])  # the anchor stays
        assert not bool(results[i].correction.any())  # the work stays in the parameters, for the next round
    swarm.close()
