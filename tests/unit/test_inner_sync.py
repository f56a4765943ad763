"""``averaging.engine.inner_sync``: the inner optimizer's moments read into one flat vector and the
group's mean of them landed late, on real torch optimizers; then three RoundEngines over one
LocalHub whose moments ride the all-reduce and land at the merge, two inner steps after the snapshot."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from averaging.engine.config import LoopConfig
from averaging.engine.inner_sync import InnerStateSync, check_mean
from averaging.engine.loop import RoundEngine
from averaging.engine.worker import SyncWorker
from averaging.math.flat import FlatLayout
from averaging.math.outer_step import OuterConfig
from averaging.network.local import LocalBackend, LocalHub
from averaging.state.shared_state import SharedState
from protocols.schedule import RoundSchedule
from tests.unit.fake_clock import WALL_START, FakeClock

pytestmark = pytest.mark.timeout(60)

BETAS = (0.9, 0.95)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def step(net: torch.nn.Module, optimizers, grads: list[torch.Tensor]) -> None:
    """One optimizer step on given gradients (moments then depend on the gradients alone)."""
    for p, g in zip(net.parameters(), grads):
        p.grad = g.clone()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def gradients(net: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) * 10 ** (-3 + i % 3) for i, p in enumerate(net.parameters())]


def test_the_layout_follows_the_model_and_which_parameters_muon_trains():
    net = model()
    adam = InnerStateSync(net)
    assert adam.layout.names[:2] == ("0.weight.exp_avg", "0.weight.exp_avg_sq")
    assert adam.numel == 2 * sum(p.numel() for p in net.parameters())
    matrices = [net[0].weight, net[2].weight]
    muon = InnerStateSync(net, muon=matrices)
    assert "0.weight.momentum_buffer" in muon.layout.names and "0.weight.exp_avg" not in muon.layout.names
    assert muon.numel == adam.numel - sum(p.numel() for p in matrices)
    assert adam.describe() != muon.describe() and adam.describe() == InnerStateSync(model()).describe()


def test_binding_refuses_what_it_cannot_average():
    net = model()
    with pytest.raises(ValueError, match="AdamW, Adam and Muon, not SGD"):
        InnerStateSync(net).bind([torch.optim.SGD(net.parameters(), lr=0.1)])
    muon = torch.optim.Muon([net[0].weight], lr=0.01)
    rest = torch.optim.AdamW([p for p in net.parameters() if p is not net[0].weight])
    with pytest.raises(ValueError, match="0.weight.exp_avg: the plan and the optimizer"):
        InnerStateSync(net).bind([muon, rest])  # planned as AdamW's
    with pytest.raises(ValueError, match="no inner optimizer trains"):
        InnerStateSync(net).bind([rest])
    InnerStateSync(net, muon=[net[0].weight]).bind([muon, rest])  # the plan that fits


def test_a_mean_landed_k_steps_late_is_the_state_of_a_peer_that_started_from_it():
    ours, theirs = model(), model()
    opt_ours = [torch.optim.AdamW(ours.parameters(), lr=0.01, betas=BETAS)]
    opt_theirs = [torch.optim.AdamW(theirs.parameters(), lr=0.01, betas=BETAS)]
    sync = InnerStateSync.of(ours, opt_ours)
    before = torch.zeros(sync.numel)
    sync.snapshot(before)
    assert not before.any()  # no step yet: nothing to send
    for seed in range(3):  # both train a while (their own data), so the moments differ
        step(ours, opt_ours, gradients(ours, seed))
        step(theirs, opt_theirs, gradients(theirs, 10 + seed))
    snapshot, other = torch.zeros(sync.numel), torch.zeros(sync.numel)
    sync.snapshot(snapshot)
    InnerStateSync.of(theirs, opt_theirs).snapshot(other)
    mean = 0.25 * snapshot + 0.75 * other  # the group's token-weighted mean

    # A reference peer holding the mean at the snapshot, then the same k = 2 steps as ours.
    reference = model()
    opt_reference = [torch.optim.AdamW(reference.parameters(), lr=0.01, betas=BETAS)]
    step(reference, opt_reference, gradients(reference, 99))  # creates the state
    ref_sync = InnerStateSync.of(reference, opt_reference)
    current = torch.zeros(sync.numel)
    ref_sync.snapshot(current)
    ref_sync.land(mean, current, steps=0)  # k = 0: the moments become the mean itself
    for seed in (20, 21):
        step(ours, opt_ours, gradients(ours, seed))
        step(reference, opt_reference, gradients(reference, seed))
    unlanded = torch.zeros(sync.numel)
    sync.snapshot(unlanded)
    assert sync.land(mean, snapshot, steps=2) is None
    landed, expected = torch.zeros(sync.numel), torch.zeros(sync.numel)
    sync.snapshot(landed)
    ref_sync.snapshot(expected)
    assert torch.allclose(landed, expected, rtol=1e-5, atol=1e-12)
    assert not torch.allclose(unlanded, expected, rtol=1e-3, atol=0)  # (without the landing: far off)


def test_a_mean_no_honest_group_returns_is_refused_and_changes_nothing():
    net = model()
    opts = [torch.optim.AdamW(net.parameters(), betas=BETAS)]
    step(net, opts, gradients(net, 1))
    sync = InnerStateSync.of(net, opts)
    own = torch.zeros(sync.numel)
    sync.snapshot(own)
    for bad, why in ((own * float("nan"), "NaN/inf"), (own * 1000, "1e+03x larger than ours")):
        assert why in sync.land(bad, own, steps=0)
        after = torch.zeros(sync.numel)
        sync.snapshot(after)
        assert torch.equal(after, own)
    assert check_mean(own * 50, own) is None  # large, but within what a group may hold
    negative = own.clone()
    negative[own.numel() // 2:] = -1.0  # a mean of squares below zero (roundoff, or a liar)...
    sync.land(negative, own, steps=0)
    after = torch.zeros(sync.numel)
    sync.snapshot(after)
    squares = [v for k, v in sync.layout.views(after).items() if k.endswith("exp_avg_sq")]
    assert all(bool((v >= 0).all()) for v in squares)  # ...is clamped where it is a second moment


PEERS = {"peer-a": 100, "peer-b": 300, "peer-c": 700}  # tokens a step: the weights


def test_engines_average_their_moments_with_the_round_and_land_them_at_the_merge():
    hub = LocalHub()
    schedule = RoundSchedule(start_time=WALL_START, round_seconds=1e3)
    config = LoopConfig(mode="overlap", matchmaking_seconds=0.1, prepare_lead=1e6)  # rounds end by hand
    peers, workers = [], []
    for index, peer_id in enumerate(PEERS):
        net = model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, betas=BETAS)
        named = [(n, p) for n, p in net.named_parameters()]
        layout = FlatLayout.of(named)
        state = SharedState(layout, layout.pack(dict(named), layout.new_buffer()), OuterConfig(lr=0.7, momentum=0.9))
        worker = SyncWorker(LocalBackend(hub, peer_id, state.shared_state), allreduce_timeout=5.0, matchmaking_grace=1.0)
        workers.append(worker)
        sync = InnerStateSync.of(net, [optimizer])
        engine = RoundEngine(state=state, worker=worker, layout=layout, params=lambda net=net: dict(net.named_parameters()),
                             schedule=lambda: schedule, config=config, peer_id=peer_id, alone=lambda: False,
                             device=torch.device("cpu"), clock=FakeClock(WALL_START), inner_state=sync)
        peers.append((peer_id, net, optimizer, sync, engine, worker, index))
    barrier = threading.Barrier(len(peers), timeout=20)
    records = {}

    def train(peer) -> None:
        peer_id, net, optimizer, sync, engine, worker, index = peer
        engine.start()
        for s in range(3):
            step(net, [optimizer], gradients(net, 100 * index + s))
            engine.after_step(tokens=PEERS[peer_id], seconds=0.0)
        worker.submit(lambda: None).result(timeout=20)
        worker.submit_prepare(lambda: None).result(timeout=20)
        barrier.wait()
        snapshot = torch.zeros(sync.numel)
        sync.snapshot(snapshot)
        stats = engine.begin_sync()
        worker.submit(lambda: None).result(timeout=20)  # the round's sync has run; its merge waits for a step
        step(net, [optimizer], gradients(net, 100 * index + 10))  # training went on meanwhile
        now = torch.zeros(sync.numel)
        sync.snapshot(now)
        stats += engine.after_step(tokens=PEERS[peer_id], seconds=0.0)  # merges: the mean lands one step late
        after = torch.zeros(sync.numel)
        sync.snapshot(after)
        records[peer_id] = (snapshot, now, after, stats)

    try:
        with ThreadPoolExecutor(len(peers)) as pool:
            for future in [pool.submit(train, peer) for peer in peers]:
                future.result(timeout=40)
    finally:
        for worker in workers:
            worker.close()
    total = sum(3 * t for t in PEERS.values())
    mean = sum(records[p][0] * (3 * t / total) for p, t in PEERS.items())
    layout = peers[0][3].layout
    for peer_id, (snapshot, now, after, stats) in records.items():
        assert [s.group_size for s in stats if s.round == 1] == [3]
        expected = now.clone()
        for key, view in layout.views(expected).items():
            decay = BETAS[1] if key.endswith("exp_avg_sq") else BETAS[0]
            view += decay * (layout.views(mean)[key] - layout.views(snapshot)[key])
        assert torch.allclose(after, expected, rtol=1e-5, atol=1e-10), peer_id
        assert not torch.allclose(after, now, rtol=1e-3, atol=0)  # the landing moved them
        assert stats[0].bytes_sent > 0
