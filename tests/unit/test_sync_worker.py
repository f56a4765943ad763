"""SyncWorker over the in-process LocalHub: three peers on threads, no network."""

import time

import pytest
import torch

from averaging.local_backend import LocalBackend, LocalHub
from averaging.sync import SyncResult, SyncWorker

PEERS = ("peer-a", "peer-b", "peer-c")
NUMEL = 1000
WAIT = 10.0  # generous bound on any future; the happy paths take milliseconds


def state_of(peer: str):
    return lambda: ({"peer": peer, "round": 4}, [torch.full((3,), float(len(peer)))])


@pytest.fixture
def make_workers():
    created: list[SyncWorker] = []

    def make(peers=PEERS, *, allreduce_timeout=5.0, matchmaking_grace=1.0) -> dict[str, SyncWorker]:
        hub = LocalHub()
        workers = {p: SyncWorker(LocalBackend(hub, p, state_of(p)), allreduce_timeout=allreduce_timeout,
                                 matchmaking_grace=matchmaking_grace) for p in peers}
        created.extend(workers.values())
        return workers

    yield make
    for worker in created:
        worker.close()


def vector(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def prepare_all(workers: dict[str, SyncWorker], round: int) -> None:
    futures = [w.prepare(round=round, scheduled_time=time.time() + 1, gather={"from": p, "round": round})
               for p, w in workers.items()]
    for future in futures:
        future.result(timeout=WAIT)


def test_three_peers_get_the_weighted_mean(make_workers):
    workers = make_workers()
    prepare_all(workers, round=5)
    grads = {p: vector(i) for i, p in enumerate(PEERS)}
    originals = {p: g.clone() for p, g in grads.items()}
    weights = {"peer-a": 1.0, "peer-b": 3.0, "peer-c": 6.0}
    futures = {p: w.begin_sync(round=5, pseudo_grad=grads[p], weight=weights[p]) for p, w in workers.items()}
    results: dict[str, SyncResult] = {p: f.result(timeout=WAIT) for p, f in futures.items()}

    expected = sum(grads[p].double() * weights[p] for p in PEERS) / sum(weights.values())
    for peer, result in results.items():
        assert result.round == 5
        assert result.outcome.ok and result.outcome.error is None
        assert result.outcome.group == PEERS
        assert result.outcome.gathered == {p: {"from": p, "round": 5} for p in PEERS}
        assert result.averaged is not None and result.averaged.dtype == torch.float32
        assert torch.allclose(result.averaged.double(), expected, rtol=0, atol=1e-6)
        assert result.started <= result.finished
        # The caller's snapshot is its fallback: averaging works on a copy.
        assert torch.equal(grads[peer], originals[peer])
        assert result.averaged.data_ptr() != grads[peer].data_ptr()
    # Every peer applies bit-identical results, as after a healthy uncompressed all-reduce.
    assert torch.equal(results["peer-a"].averaged, results["peer-b"].averaged)
    assert torch.equal(results["peer-a"].averaged, results["peer-c"].averaged)


def test_consecutive_rounds_are_averaged_separately(make_workers):
    workers = make_workers(PEERS[:2])
    for round in (1, 2):
        prepare_all(workers, round=round)
        futures = [w.begin_sync(round=round, pseudo_grad=torch.full((4,), float(10 * round + i)), weight=1.0)
                   for i, w in enumerate(workers.values())]
        for future in futures:
            assert future.result(timeout=WAIT).averaged.tolist() == [10 * round + 0.5] * 4


def test_a_peer_that_never_submits_makes_the_others_time_out(make_workers):
    workers = make_workers(allreduce_timeout=0.2, matchmaking_grace=0.1)
    prepare_all(workers, round=1)
    started = time.perf_counter()
    futures = {p: workers[p].begin_sync(round=1, pseudo_grad=vector(i), weight=1.0)
               for i, p in enumerate(PEERS[:2])}  # peer-c prepared but never submits
    results = {p: f.result(timeout=WAIT) for p, f in futures.items()}
    elapsed = time.perf_counter() - started
    for result in results.values():
        assert not result.outcome.ok
        assert result.averaged is None
        assert result.outcome.error == "timed out"
        assert result.outcome.group == () and result.outcome.gathered == {}
        assert result.outcome.sync_s >= 0.25  # waited for grace + allreduce timeout, not less
    assert elapsed < 5.0


def test_a_late_peer_does_not_complete_a_round_the_others_gave_up_on(make_workers):
    workers = make_workers(allreduce_timeout=0.1, matchmaking_grace=0.05)
    prepare_all(workers, round=1)
    early = [workers[p].begin_sync(round=1, pseudo_grad=vector(i), weight=1.0) for i, p in enumerate(PEERS[:2])]
    for future in early:
        assert not future.result(timeout=WAIT).outcome.ok  # they applied their local updates
    late = workers["peer-c"].begin_sync(round=1, pseudo_grad=vector(2), weight=1.0).result(timeout=WAIT)
    assert not late.outcome.ok  # else peer-c applies an "average" nobody else applied


def test_begin_sync_without_prepare_fails_without_blocking(make_workers):
    workers = make_workers(PEERS[:1])
    result = workers["peer-a"].begin_sync(round=1, pseudo_grad=vector(0), weight=1.0).result(timeout=WAIT)
    assert not result.outcome.ok and result.averaged is None
    assert "prepared" in result.outcome.error


def test_a_single_prepared_peer_averages_with_itself(make_workers):
    workers = make_workers(PEERS[:1])
    prepare_all(workers, round=3)
    grad = vector(0)
    result = workers["peer-a"].begin_sync(round=3, pseudo_grad=grad, weight=2.0).result(timeout=WAIT)
    assert result.outcome.ok and result.outcome.group == ("peer-a",)
    assert torch.allclose(result.averaged, grad, rtol=0, atol=1e-6)


def test_download_state_returns_another_peers_state(make_workers):
    workers = make_workers()
    state = workers["peer-a"].download_state(["peer-a", "peer-c", "peer-b"], timeout=1.0)
    assert state.peer == "peer-c"  # the first of the list that is not us
    assert state.metadata == {"peer": "peer-c", "round": 4}
    assert torch.equal(state.tensors[0], torch.full((3,), 6.0))
    assert workers["peer-a"].download_state(["peer-a"], timeout=1.0) is None
    assert workers["peer-a"].download_state(["stranger"], timeout=1.0) is None


def test_peer_id_is_the_backends(make_workers):
    workers = make_workers()
    assert [w.peer_id for w in workers.values()] == list(PEERS)
