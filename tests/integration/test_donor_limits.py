"""Resource exhaustion (issue 11, item 8; issue 29, item 6): a donor serves a bounded number of
requests per peer at once, requests that arrive within a few seconds share one copy of its state
instead of costing its host a full copy each, and a joiner that stops reading holds its slots only
until their deadline. Real averagers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2

from averaging.network import slices
from averaging.network.hivemind import serving
from averaging.network.hivemind.backend import HivemindBackend
from averaging.network.hivemind.serving import MAX_SERVES_PER_PEER, STATE_COPY_REUSE_S
from averaging.network.slices import slice_alignment, slice_bounds
from averaging.state.served import AppliedUpdate
from protocols.state_slices import encode_slice_request
from tests.integration.averagers import loopback_averagers

# A few averagers, mostly waiting on matchmaking: run beside the unit tests (scripts/run-suite.sh).
pytestmark = [pytest.mark.integration, pytest.mark.wall_clock]

NUMEL = 50_000
COUNT = 4
COPY_S = 1.0  # the donor's host takes this long to copy its state: requests overlap


@pytest.mark.timeout(180)
def test_a_donor_bounds_requests_per_peer_and_copies_its_state_once_per_period(tmp_path):
    state = torch.randn(2 * NUMEL, generator=torch.Generator().manual_seed(3))
    copies: list[float] = []
    lock = threading.Lock()

    def donor_state():
        with lock:
            copies.append(time.monotonic())
        time.sleep(COPY_S)
        return {"v": 1, "numel": NUMEL}, [state[:NUMEL].clone(), state[NUMEL:].clone()]

    def no_state():
        return {}, [torch.zeros(1)]

    log_path = tmp_path / "donor.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(message)s"))
    logger = logging.getLogger("averaging.network.hivemind")  # the averager and its backend
    logger.addHandler(handler)  # before the averagers fork: they inherit it
    prefix = f"limits-{uuid.uuid4().hex[:8]}"

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=NUMEL, prefix=prefix, state_provider=donor_state if i == 0 else no_state)

    def fetch(index: int):
        start, stop = slice_bounds(2 * NUMEL, index, COUNT, slice_alignment(NUMEL))
        try:
            metadata, tensor = joiner.fetch_slice(donor, index, COUNT, expected_numel=stop - start,
                                                  stall_timeout=10.0, deadline_s=20.0)
        except RuntimeError as e:
            return str(e)
        assert torch.equal(tensor, state[start:stop])
        return "served"

    try:
        with loopback_averagers(2, make) as backends:
            donor, joiner = backends[0].peer_id, backends[1]._averager
            # 1. Four requests at once from one peer: MAX_SERVES_PER_PEER are served, the rest get
            #    an empty answer at once; the served ones share one copy of the state.
            with ThreadPoolExecutor(COUNT) as pool:
                outcomes = list(pool.map(fetch, range(COUNT)))
            assert outcomes.count("served") == MAX_SERVES_PER_PEER, outcomes
            assert all(o == "served" or "did not share its state" in o for o in outcomes), outcomes
            assert len(copies) == 1, f"{len(copies)} copies for {MAX_SERVES_PER_PEER} overlapping requests"
            # 2. One after the other, within the period: the same copy again.
            assert fetch(2) == "served" and fetch(3) == "served"
            assert len(copies) == 1
            # 3. After the period, a request makes a fresh copy (the copy was released).
            time.sleep(STATE_COPY_REUSE_S + 0.5)
            assert fetch(0) == "served"
            assert len(copies) == 2
    finally:
        logger.removeHandler(handler)
        handler.close()
    log = log_path.read_text()
    assert any("refused a state slice to" in line and joiner.peer_id.to_base58() in line
               for line in log.splitlines()), log[-2000:]


@contextlib.contextmanager
def event_loop_thread():
    """An event loop running in a thread of its own: the hostile joiner lives on it while the test
    thread blocks on the honest joiner's fetches."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


async def stop_reading_after_one_message(p2p: P2P, donor: str, prefix: str):
    """Ask ``donor`` for its whole state, read one message and stop reading (the stream stays open):
    hivemind's drain then blocks the donor's stream (test-only: no shoal code path does this)."""
    _, reader, writer = await p2p.call_binary_stream_handler(
        PeerID.from_base58(donor), f"{prefix}::ShoalAverager.rpc_download_state_slice")
    await P2P.send_protobuf(averaging_pb2.JoinRequest(gather=encode_slice_request(0, 1)), writer)
    await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
    message, error = await P2P.receive_protobuf(averaging_pb2.DownloadData, reader)
    assert error is None and message.metadata
    return reader, writer


async def read_to_the_end(reader, writer) -> int:
    """The tensor bytes a stopped stream still delivers once read again."""
    received = 0
    with contextlib.closing(writer):
        while True:
            try:
                message, _ = await P2P.receive_protobuf(averaging_pb2.DownloadData, reader)
            except asyncio.IncompleteReadError:
                return received
            received += len(message.tensor_part.buffer)


BIG_NUMEL = 500_000  # a 4 MB state: more than loopback's buffers hold (about 0.75 MiB)


@pytest.mark.timeout(120)
def test_a_joiner_that_stops_reading_holds_a_donors_slots_only_until_their_deadline(monkeypatch):
    """Issue 29 (6): hivemind's send_raw_data drains with no timeout, so downloads that stop reading
    held their slots for good (four identities held all of them). Here one identity holds them all
    (MAX_SERVES lowered to its own limit) until their deadline (shortened: it is SERVE_STALL_S plus
    what a stream handed out at the minimum rate, made fast here); then an honest joiner
    is served, and the stopped streams were ended at their next message, not served to the end."""
    monkeypatch.setattr(serving, "MAX_SERVES", MAX_SERVES_PER_PEER)  # before the averagers fork
    monkeypatch.setattr(serving, "SERVE_STALL_S", 3.0)
    # What a stopped stream handed out before it stopped (loopback's buffers) then adds ~nothing.
    monkeypatch.setattr(slices, "MIN_DONOR_BYTES_PER_S", 2**30)
    state = torch.randn(2 * BIG_NUMEL, generator=torch.Generator().manual_seed(5))
    update = torch.randn(BIG_NUMEL, generator=torch.Generator().manual_seed(6)).half()
    prefix = f"stall-{uuid.uuid4().hex[:8]}"

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=BIG_NUMEL, prefix=prefix,
                               state_provider=lambda: ({"v": 1}, [state[:BIG_NUMEL], state[BIG_NUMEL:]]),
                               update_provider=lambda done: AppliedUpdate(7, 5, update) if done == 4 else None)

    def honest_fetch() -> str:
        try:
            _, tensor = joiner.fetch_slice(donor, 0, 1, expected_numel=2 * BIG_NUMEL, stall_timeout=10.0,
                                           deadline_s=20.0)
        except RuntimeError as e:
            return str(e)
        assert torch.equal(tensor, state)
        return "served"

    with loopback_averagers(2, make) as backends, event_loop_thread() as run:
        donor, joiner = backends[0].peer_id, backends[1]._averager
        maddrs = [str(a) for a in backends[0]._averager.dht.get_visible_maddrs()]
        hostile = run(P2P.create(initial_peers=maddrs))
        try:
            stopped = [run(stop_reading_after_one_message(hostile, donor, prefix)) for _ in range(MAX_SERVES_PER_PEER)]
            started = time.monotonic()
            assert "did not share its state" in honest_fetch()  # every slot held
            time.sleep(max(0.0, started + serving.SERVE_STALL_S + 1.0 - time.monotonic()))
            assert honest_fetch() == "served"
            for reader, writer in stopped:
                assert run(read_to_the_end(reader, writer)) < 8 * BIG_NUMEL // 2  # ended, not served whole
        finally:
            run(hostile.shutdown())
        # The joiner's own reader (fetching._download) takes an honest update too.
        fetched = joiner.fetch_update(donor, 4, numel=BIG_NUMEL, timeout=20.0)
        assert (fetched.round, fetched.rounds_done) == (7, 5) and torch.equal(fetched.update, update)


@pytest.mark.timeout(120)
def test_a_peer_still_joining_serves_no_state_so_joiners_take_the_swarms():
    """Many peers started at once: while they join, the organiser has stepped alone a few rounds.
    A joiner's download assembles the state most donors serve, and the other fresh joiners used to
    serve theirs, the run's initial weights (benchmarks.swarm.scale_real: at 8-16 peers, joiners assembled
    round 0 from one another, and the organiser then re-synced to their majority, losing its
    steps). A peer serves nothing until its own join is done (``share_state``)."""
    numel = 20_000

    def state_of(round: int):
        def provide():
            return {"v": 1, "round": round, "numel": numel}, [torch.full((numel,), float(round)),
                                                              torch.zeros(numel)]
        return provide

    prefix = f"joining-{uuid.uuid4().hex[:8]}"
    providers = [state_of(3), state_of(0), state_of(0), state_of(0)]  # the organiser, then three joiners

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=numel, prefix=prefix, state_provider=providers[i], share_state=i == 0)

    with loopback_averagers(4, make) as backends:
        organiser, joining, joiner = backends[0], backends[1:3], backends[3]
        donors = [b.peer_id for b in backends[:3]]
        got = joiner.download_state(donors, timeout=10.0)
        assert got is not None and got.donors == (organiser.peer_id,), got
        assert float(got.tensors[0][0]) == 3.0 and got.metadata["round"] == 3
        # What it prevents: with the joiners serving, their round-0 majority wins the vote.
        for backend in joining:
            backend.share_state(True)
        outvoted = joiner.download_state(donors, timeout=10.0)
        assert outvoted is not None and outvoted.metadata["round"] == 0, outvoted
