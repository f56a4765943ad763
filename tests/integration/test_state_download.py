"""A joiner downloads the shared state in slices from three real hivemind donors on loopback, all in
this one pytest process; then again after one donor left. Every DHT, averager and p2pd is shut down
at the end, and the test fails if a p2pd outlives it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import hivemind
import msgpack
import psutil
import pytest
import torch
from hivemind.proto import averaging_pb2

from averaging.math.wire import WireFormat
from averaging.network.hivemind.backend import HivemindBackend
from node.library.cleanup import hivemind_sockets, remove_stale
from protocols.messages import MessageError

pytestmark = pytest.mark.integration

NUMEL = 100_000
ROUND = 7
SLICES = 8


def donor_state() -> tuple[dict, list[torch.Tensor]]:
    """What every donor serves (like SharedState.shared_state): anchor and momentum of one round."""
    generator = torch.Generator().manual_seed(2024)
    anchor, momentum = torch.randn(NUMEL, generator=generator), torch.randn(NUMEL, generator=generator)
    return {"v": 1, "numel": NUMEL, "round": ROUND, "rounds_done": ROUND}, [anchor, momentum]


@dataclass
class Peer:
    name: str
    dht: hivemind.DHT
    backend: HivemindBackend
    alive: bool = True

    def shutdown(self) -> None:
        if self.alive:
            self.alive = False
            self.backend.shutdown()
            self.dht.shutdown()


def p2pd_descendants() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True) if _name(child) == "p2pd"}


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def still_running(pids: set[int]) -> set[int]:
    running = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.add(pid)
        except psutil.Error:
            pass
    return running


@pytest.fixture
def swarm() -> Iterator[tuple[list[Peer], Peer, Counter]]:
    """Three donors and a joiner. Yields (donors, joiner, slice requests served per donor name)."""
    served: Counter[str] = Counter()
    lock = threading.Lock()

    def provider(name: str) -> Callable[[], tuple[dict, list[torch.Tensor]]]:
        def state() -> tuple[dict, list[torch.Tensor]]:
            # Runs in this process, in the donor averager's state-fetcher thread: once per request.
            with lock:
                served[name] += 1
            return donor_state()
        return state

    def joiner_state() -> tuple[dict, list[torch.Tensor]]:
        return {"v": 1, "numel": NUMEL, "round": 0, "rounds_done": 0}, [torch.zeros(NUMEL), torch.zeros(NUMEL)]

    peers: list[Peer] = []
    sockets_before = hivemind_sockets()
    sigint = signal.getsignal(signal.SIGINT)  # every averager sets SIGINT to ignored in its parent
    p2pd: set[int] = set()

    def start(name: str, initial_peers: list[str], state) -> Peer:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers)
        try:
            backend = HivemindBackend(dht, numel=NUMEL, prefix="state-download-test", state_provider=state,
                                      wire=WireFormat.of("fp32"))
        except BaseException:
            dht.shutdown()
            raise
        peers.append(Peer(name, dht, backend))
        return peers[-1]

    try:
        first = start("donor-0", [], provider("donor-0"))
        bootstrap = [str(a) for a in first.dht.get_visible_maddrs()]
        donors = [first] + [start(f"donor-{i}", bootstrap, provider(f"donor-{i}")) for i in (1, 2)]
        everyone = [str(a) for donor in donors for a in donor.dht.get_visible_maddrs()]
        joiner = start("joiner", everyone, joiner_state)
        p2pd = p2pd_descendants()
        yield donors, joiner, served
    finally:
        for peer in reversed(peers):
            peer.shutdown()
        signal.signal(signal.SIGINT, sigint)
        deadline = time.monotonic() + 10
        while (leftover := still_running(p2pd | p2pd_descendants())) and time.monotonic() < deadline:
            time.sleep(0.2)
        remove_stale(hivemind_sockets() - sockets_before)  # a clean shutdown leaves the averager's socket
        assert not leftover, f"p2pd processes left running: {sorted(leftover)}"
    assert len(p2pd) >= 4, f"expected a p2pd per DHT, saw {sorted(p2pd)}"  # the check above checked something


def expected_tensors() -> list[torch.Tensor]:
    return donor_state()[1]


@pytest.mark.timeout(120)
def test_a_joiner_downloads_in_slices_from_every_donor_and_survives_one_leaving(swarm):
    donors, joiner, served = swarm
    donor_ids = [donor.backend.peer_id for donor in donors]
    reports: list[tuple[int, int]] = []
    total_bytes = 2 * NUMEL * 4

    # 1. Three donors: the state arrives exact, every donor served part of it.
    started = time.monotonic()
    state = joiner.backend.download_state(donor_ids, timeout=5.0, slices=SLICES,
                                          progress=lambda done, total: reports.append((done, total)))
    first_s = time.monotonic() - started
    assert state is not None
    assert state.metadata["round"] == ROUND
    assert all(torch.equal(got, want) for got, want in zip(state.tensors, expected_tensors(), strict=True))
    assert set(state.donors) == set(donor_ids) and state.peer == ",".join(sorted(donor_ids))
    # Donors served several slices from one copy of their state (requests within
    # STATE_COPY_REUSE_S share it): a copy per request would cost a donor's host 8 bytes/param each.
    assert all(served[donor.name] >= 1 for donor in donors) and sum(served.values()) < SLICES, served
    done = [d for d, _ in reports]
    assert done == sorted(done) and done[-1] == total_bytes and {t for _, t in reports} == {total_bytes}

    # 2. One donor leaves; it is still on the joiner's list, and the other two finish the download.
    donors[0].shutdown()
    served.clear()
    started = time.monotonic()
    state = joiner.backend.download_state(donor_ids, timeout=5.0, slices=SLICES)
    second_s = time.monotonic() - started
    served_before_refusal = served["donor-1"]
    assert state is not None
    assert all(torch.equal(got, want) for got, want in zip(state.tensors, expected_tensors(), strict=True))
    assert set(state.donors) == set(donor_ids[1:])
    assert served["donor-0"] == 0, served  # (the others may serve from the copy they made above)

    # 3. A donor refuses a malformed request before it asks its host process for the state.
    handler = donors[1].backend._averager.rpc_download_state_slice
    bad = averaging_pb2.JoinRequest(gather=msgpack.packb({"slice": SLICES, "of": SLICES}))
    with pytest.raises(MessageError):
        asyncio.run(anext(handler(bad, None)))
    assert served["donor-1"] == served_before_refusal
    print(f"\nsliced download: {first_s:.2f}s from 3 donors, {second_s:.2f}s with one gone")
