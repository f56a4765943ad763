"""SyncWorker (one thread, jobs in order) and LocalBackend over the in-process LocalHub: three
peers on threads, no network."""

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from averaging.engine.worker import SyncWorker
from averaging.network.interface import AverageOutcome
from averaging.network.local import LocalBackend, LocalHub

pytestmark = pytest.mark.timeout(60)  # a deadlock fails the test instead of hanging the suite

PEERS = ("peer-a", "peer-b", "peer-c")
NUMEL = 1000
WAIT = 10.0  # generous bound on any future; the happy paths take milliseconds


def state_of(peer: str):
    return lambda: ({"peer": peer, "round": 4}, [torch.full((3,), float(len(peer)))])


@pytest.fixture
def make_workers():
    created: list[SyncWorker] = []

    def make(peers=PEERS) -> dict[str, SyncWorker]:
        hub = LocalHub()
        workers = {p: SyncWorker(LocalBackend(hub, p, state_of(p)), allreduce_timeout=5.0, matchmaking_grace=1.0)
                   for p in peers}
        created.extend(workers.values())
        return workers

    yield make
    for worker in created:
        worker.close()


def vector(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def prepare(worker: SyncWorker, round: int) -> Future:
    return worker.submit(worker.backend.prepare, round=round, scheduled_time=time.time() + 1,
                         gather={"from": worker.peer_id, "round": round}, timeout=1.0)


def prepare_all(workers: dict[str, SyncWorker], round: int) -> None:
    for future in [prepare(w, round) for w in workers.values()]:
        future.result(timeout=WAIT)


def average(worker: SyncWorker, vec: torch.Tensor, *, weight: float = 1.0, timeout: float = 5.0) -> Future:
    return worker.submit(worker.backend.average, vec, weight=weight, timeout=timeout)


def sync_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shoal-sync")]


# -- the worker: one thread, jobs in order -------------------------------------------------------
class RecordingBackend:
    peer_id = "peer-x"

    def __init__(self):
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def test_jobs_run_in_order_on_one_thread_and_see_each_others_effects():
    worker = SyncWorker(RecordingBackend(), allreduce_timeout=1.0, matchmaking_grace=0.1)
    seen: list[tuple[str, str]] = []
    state = {"value": 0}

    def slow_write(value: int) -> int:
        time.sleep(0.05)  # a later job must still wait for this one
        state["value"] = value
        seen.append(("write", threading.current_thread().name))
        return value

    def read() -> int:
        seen.append(("read", threading.current_thread().name))
        return state["value"]

    try:
        futures = [worker.submit(slow_write, 1), worker.submit(read), worker.submit(slow_write, 2), worker.submit(read)]
        assert [f.result(timeout=WAIT) for f in futures] == [1, 1, 2, 2]
        assert [kind for kind, _ in seen] == ["write", "read", "write", "read"]
        threads = {name for _, name in seen}
        assert len(threads) == 1 and threads != {threading.current_thread().name}
        assert threads.pop().startswith("shoal-sync")
    finally:
        worker.close()


def test_a_failing_job_reports_through_its_future_and_the_worker_goes_on():
    worker = SyncWorker(RecordingBackend(), allreduce_timeout=1.0, matchmaking_grace=0.1)

    def boom():
        raise RuntimeError("injected")

    try:
        failed = worker.submit(boom)
        after = worker.submit(lambda x, *, y: x + y, 1, y=2)  # args and kwargs reach the job
        assert isinstance(failed.exception(timeout=WAIT), RuntimeError)
        assert after.result(timeout=WAIT) == 3
    finally:
        worker.close()


def test_the_thread_starts_on_the_first_submit_not_before():
    before = len(sync_threads())
    worker = SyncWorker(RecordingBackend(), allreduce_timeout=1.0, matchmaking_grace=0.1)
    try:
        assert len(sync_threads()) == before  # hivemind forks after construction (docs/hivemind.md)
        worker.submit(lambda: None).result(timeout=WAIT)
        worker.submit(lambda: None).result(timeout=WAIT)
        assert len(sync_threads()) == before + 1
    finally:
        worker.close()
    assert len(sync_threads()) == before


def test_close_lets_the_running_job_finish_cancels_queued_ones_and_shuts_the_backend_down():
    backend = RecordingBackend()
    worker = SyncWorker(backend, allreduce_timeout=1.0, matchmaking_grace=0.1)
    release, started = threading.Event(), threading.Event()

    def running():
        started.set()
        release.wait(WAIT)
        return "done"

    first = worker.submit(running)
    queued = worker.submit(lambda: "never")
    assert started.wait(WAIT)
    closer = threading.Thread(target=worker.close)
    closer.start()
    deadline = time.monotonic() + WAIT
    while not queued.cancelled() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert queued.cancelled()
    assert not backend.shut_down  # close waits for the running job before shutting the backend down
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert first.result(timeout=0) == "done"
    assert backend.shut_down


def test_peer_id_is_the_backends(make_workers):
    workers = make_workers()
    assert [w.peer_id for w in workers.values()] == list(PEERS)


# -- LocalBackend through the worker ------------------------------------------------------------
def test_three_peers_get_the_weighted_mean_in_their_own_vectors(make_workers):
    workers = make_workers()
    prepare_all(workers, round=5)
    grads = {p: vector(i) for i, p in enumerate(PEERS)}
    originals = {p: g.clone() for p, g in grads.items()}
    weights = {"peer-a": 1.0, "peer-b": 3.0, "peer-c": 6.0}
    futures = {p: average(w, grads[p], weight=weights[p]) for p, w in workers.items()}
    outcomes: dict[str, AverageOutcome] = {p: f.result(timeout=WAIT) for p, f in futures.items()}

    expected = sum(originals[p].double() * weights[p] for p in PEERS) / sum(weights.values())
    assert not torch.allclose(expected, originals["peer-a"].double(), atol=1e-3)  # the check below can fail
    for peer, outcome in outcomes.items():
        assert outcome.ok and outcome.error is None
        assert outcome.group == PEERS
        assert outcome.gathered == {p: {"from": p, "round": 5} for p in PEERS}
        assert outcome.sync_s >= 0
        # The backend writes the average into the caller's vector, in place, keeping its dtype.
        assert grads[peer].dtype == torch.float32 and grads[peer].shape == (NUMEL,)
        assert torch.allclose(grads[peer].double(), expected, rtol=0, atol=1e-6)
    # Every peer holds bit-identical results, as after a healthy uncompressed all-reduce.
    assert torch.equal(grads["peer-a"], grads["peer-b"])
    assert torch.equal(grads["peer-a"], grads["peer-c"])
    # The hub kept copies: what one caller does with its vector afterwards is no one else's business.
    grads["peer-a"].zero_()
    assert torch.allclose(grads["peer-b"].double(), expected, rtol=0, atol=1e-6)


def test_consecutive_rounds_are_averaged_separately(make_workers):
    workers = make_workers(PEERS[:2])
    for round in (1, 2):
        prepare_all(workers, round=round)
        vecs = [torch.full((4,), float(10 * round + i)) for i in range(2)]
        futures = [average(w, v) for w, v in zip(workers.values(), vecs)]
        for future, vec in zip(futures, vecs):
            assert future.result(timeout=WAIT).ok
            assert vec.tolist() == [10 * round + 0.5] * 4


def test_a_prepare_is_good_for_one_average(make_workers):
    workers = make_workers(PEERS[:1])
    worker = workers["peer-a"]
    prepare_all(workers, round=1)
    assert average(worker, vector(0)).result(timeout=WAIT).ok
    vec = vector(1)
    outcome = average(worker, vec).result(timeout=WAIT)
    assert not outcome.ok and "prepared" in outcome.error
    assert torch.equal(vec, vector(1))


def test_a_peer_that_never_submits_makes_the_others_time_out(make_workers):
    workers = make_workers()
    prepare_all(workers, round=1)
    started = time.perf_counter()
    vecs = {p: vector(i) for i, p in enumerate(PEERS[:2])}  # peer-c prepared but never submits
    futures = {p: average(workers[p], vecs[p], timeout=0.25) for p in vecs}
    outcomes = {p: f.result(timeout=WAIT) for p, f in futures.items()}
    elapsed = time.perf_counter() - started
    for i, (peer, outcome) in enumerate(outcomes.items()):
        assert not outcome.ok
        assert outcome.error == "timed out"
        assert outcome.group == () and outcome.gathered == {}
        # Waited for the timeout, not less (give or take the lock's timer, which may end a hair early).
        assert outcome.sync_s >= 0.2
        assert torch.equal(vecs[peer], vector(i))  # a failed round leaves the caller's vector untouched
    assert elapsed < 5.0


def test_a_late_peer_does_not_complete_a_round_the_others_gave_up_on(make_workers):
    workers = make_workers()
    prepare_all(workers, round=1)
    early = [average(workers[p], vector(i), timeout=0.1) for i, p in enumerate(PEERS[:2])]
    for future in early:
        assert not future.result(timeout=WAIT).ok  # they kept their own pseudo-gradients
    vec = vector(2)
    late = average(workers["peer-c"], vec, timeout=1.0).result(timeout=WAIT)
    assert not late.ok  # else peer-c applies an "average" nobody else applied
    assert torch.equal(vec, vector(2))


def test_a_peer_that_arrives_after_the_round_completed_without_it_is_not_told_it_took_part(make_workers):
    workers = make_workers()
    prepare_all({p: workers[p] for p in PEERS[:2]}, round=1)
    early = [average(workers[p], vector(i)) for i, p in enumerate(PEERS[:2])]
    for future in early:
        assert future.result(timeout=WAIT).group == PEERS[:2]  # the round completed without peer-c
    prepare(workers["peer-c"], round=1).result(timeout=WAIT)
    vec = vector(2)
    late = average(workers["peer-c"], vec, timeout=0.2).result(timeout=WAIT)
    assert not late.ok or "peer-c" in late.group
    assert late.ok or torch.equal(vec, vector(2))


def test_average_without_prepare_fails_without_blocking(make_workers):
    workers = make_workers(PEERS[:1])
    vec = vector(0)
    started = time.perf_counter()
    outcome = average(workers["peer-a"], vec, timeout=5.0).result(timeout=WAIT)
    assert time.perf_counter() - started < 2.0
    assert not outcome.ok and "prepared" in outcome.error
    assert torch.equal(vec, vector(0))


def test_a_single_prepared_peer_averages_with_itself(make_workers):
    workers = make_workers(PEERS[:1])
    prepare_all(workers, round=3)
    vec = vector(0)
    outcome = average(workers["peer-a"], vec, weight=2.0).result(timeout=WAIT)
    assert outcome.ok and outcome.group == ("peer-a",)
    assert torch.allclose(vec, vector(0), rtol=0, atol=1e-6)


def test_download_state_returns_another_peers_state(make_workers):
    workers = make_workers()
    worker = workers["peer-a"]

    def download(peers):
        return worker.submit(worker.backend.download_state, peers, timeout=1.0).result(timeout=WAIT)

    state = download(["peer-a", "peer-c", "peer-b"])
    assert state.peer == "peer-c"  # the first of the list that is not us
    assert state.metadata == {"peer": "peer-c", "round": 4}
    assert torch.equal(state.tensors[0], torch.full((3,), 6.0))
    assert download(["peer-a"]) is None
    assert download(["stranger"]) is None
