"""The sliced state download (averaging.network.slices) against fake donors, a donor's limits
(averaging.network.hivemind.serving) against fake joiners, and what a joiner keeps of a hostile
donor's answer (averaging.network.hivemind.fetching): no network, no processes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import msgpack
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import STREAMING_CHUNK_SIZE_BYTES, split_for_streaming

from averaging.network.hivemind import serving
from averaging.network.hivemind.averager import ShoalAverager
from averaging.network.hivemind.fetching import UPDATE_VERSION, StateFetching
from averaging.network.slices import (
    MIN_DONOR_BYTES_PER_S,
    choose_round,
    choose_state,
    default_slice_count,
    download_slices,
    flat_slice,
    slice_bounds,
    slice_units,
)
from protocols.admission import admission_key, admitted, make_proof
from protocols.messages import MessageError
from protocols.state_slices import (
    MAX_SLICES,
    decode_slice_request,
    decode_update_request,
    encode_slice_request,
    encode_update_request,
)

LENGTHS = [600, 600]  # anchor and momentum
TOTAL = sum(LENGTHS)

Serve = Callable[[int, int, int], tuple]  # (index, count, nth call to this donor) -> (metadata, slice)


def state_of(round: int) -> torch.Tensor:
    """The flat state every donor at ``round`` holds (distinct per round)."""
    return torch.randn(TOTAL, generator=torch.Generator().manual_seed(round))


def healthy(round: int = 5) -> Serve:
    def serve(index: int, count: int, nth: int) -> tuple:
        start, stop = slice_bounds(TOTAL, index, count)
        return {"round": round, "v": 1}, state_of(round)[start:stop].clone()
    return serve


def advancing(first: int, then: int, after: int = 1) -> Serve:
    """A donor whose state moves from round ``first`` to ``then`` after ``after`` calls."""
    def serve(index: int, count: int, nth: int) -> tuple:
        return healthy(first if nth < after else then)(index, count, nth)
    return serve


def failing(after: int = 0) -> Serve:
    """A donor that dies after serving ``after`` slices."""
    def serve(index: int, count: int, nth: int) -> tuple:
        if nth >= after:
            raise ConnectionError("connection refused")
        return healthy()(index, count, nth)
    return serve


def corrupt(mutate: Callable[[dict, torch.Tensor], tuple]) -> Serve:
    def serve(index: int, count: int, nth: int) -> tuple:
        return mutate(*healthy()(index, count, nth))
    return serve


def hanging(release: threading.Event) -> Serve:
    def serve(index: int, count: int, nth: int) -> tuple:
        release.wait(10)
        return healthy()(index, count, nth)
    return serve


class FakeSwarm:
    """Routes fetches to fake donors, recording calls and how many ran at once."""

    def __init__(self, donors: dict[str, Serve], delay: float = 0.0, slow: dict[str, float] | None = None):
        self.donors, self.delay, self.slow = donors, delay, slow or {}
        self.calls: Counter[str] = Counter()
        self.active: Counter[str] = Counter()
        self.peak_per_donor: Counter[str] = Counter()
        self.peak_total = 0
        self._lock = threading.Lock()

    def fetch(self, donor: str, index: int, count: int) -> tuple:
        with self._lock:
            nth = self.calls[donor]
            self.calls[donor] += 1
            self.active[donor] += 1
            self.peak_per_donor[donor] = max(self.peak_per_donor[donor], self.active[donor])
            self.peak_total = max(self.peak_total, sum(self.active.values()))
        try:
            time.sleep(self.slow.get(donor, self.delay))
            return self.donors[donor](index, count, nth)
        finally:
            with self._lock:
                self.active[donor] -= 1

    def download(self, count: int, **kwargs):
        return download_slices(list(self.donors), lengths=LENGTHS, count=count, fetch=self.fetch, **kwargs)


def assert_state(result, round: int) -> None:
    assert result is not None
    assert result.metadata["round"] == round
    assert [t.shape for t in result.tensors] == [(n,) for n in LENGTHS]
    assert torch.equal(torch.cat(result.tensors), state_of(round))


# -- slices on the wire and on the donor ------------------------------------------------------
@pytest.mark.parametrize("count", [1, 3, 7, 1024])
def test_slices_tile_the_state_with_sizes_one_apart(count):
    bounds = [slice_bounds(TOTAL, i, count) for i in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == TOTAL
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(bounds, bounds[1:]))
    sizes = {stop - start for start, stop in bounds}
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("count", "align"), [(1, 7), (3, 7), (7, 100), (12, 100), (5, 1200)])
def test_aligned_slices_tile_the_state_cutting_only_at_multiples_of_align(count, align):
    count = min(count, slice_units(TOTAL, align))
    bounds = [slice_bounds(TOTAL, i, count, align) for i in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == TOTAL
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(bounds, bounds[1:]))
    assert all(start % align == 0 and start < stop for start, stop in bounds)  # none empty
    sizes = [stop - start for start, stop in bounds[:-1]]
    assert not sizes or max(sizes) - min(sizes) <= align


def test_flat_slice_reads_across_tensor_boundaries_without_the_whole_concatenation():
    tensors = [torch.arange(5.0), torch.arange(5.0, 12.0).reshape(7, 1), torch.arange(12.0, 20.0)]
    flat = torch.arange(20.0)
    for start, stop in [(0, 20), (3, 6), (5, 12), (4, 13), (12, 20), (7, 7)]:
        assert torch.equal(flat_slice(tensors, start, stop), flat[start:stop]), (start, stop)
    with pytest.raises(ValueError, match="outside"):
        flat_slice(tensors, 10, 21)


def test_flat_slice_refuses_other_dtypes_rather_than_casting():
    with pytest.raises(ValueError, match="float32"):
        flat_slice([torch.zeros(4), torch.zeros(4, dtype=torch.float64)], 0, 8)


def test_slice_request_round_trips():
    assert decode_slice_request(encode_slice_request(3, 8)) == (3, 8, None)
    assert decode_slice_request(encode_slice_request(MAX_SLICES - 1, MAX_SLICES)) == (MAX_SLICES - 1, MAX_SLICES, None)


@pytest.mark.parametrize("blob", [
    msgpack.packb({"slice": 8, "of": 8}),
    msgpack.packb({"slice": -1, "of": 8}),
    msgpack.packb({"slice": 0, "of": MAX_SLICES + 1}),
    msgpack.packb({"slice": 0, "of": 0}),
    msgpack.packb({"slice": True, "of": 8}),
    msgpack.packb({"slice": 1.0, "of": 8}),
    msgpack.packb({"slice": 1, "of": 8, "x": 0}),
    msgpack.packb({"slice": 1}),
    msgpack.packb([1, 8]),
    msgpack.packb({"slice": 1, "of": 8}) + b"\x00",
    b"\xc1",
    b"",
    b"\x80" * 100,
])
def test_a_donor_refuses_malformed_slice_requests(blob):
    with pytest.raises(MessageError):
        decode_slice_request(blob)


def test_choose_round_takes_the_majority_and_breaks_ties_upwards():
    assert choose_round([4, 5, 5]) == 5
    assert choose_round([6, 5, 5]) == 5
    assert choose_round([4, 5]) == 5
    assert choose_round([7]) == 7
    assert choose_round([]) is None


def test_default_slice_count():
    assert default_slice_count(3, TOTAL) == 6
    assert default_slice_count(1000, TOTAL) == MAX_SLICES
    assert default_slice_count(3, 4) == 4  # never an empty slice
    assert default_slice_count(10, TOTAL, align=500) == 3  # 1200 values cut at multiples of 500


# -- the scheduler ----------------------------------------------------------------------------
def test_three_healthy_donors_share_the_load_one_slice_each_at_a_time():
    swarm = FakeSwarm({name: healthy() for name in "abc"}, delay=0.02)
    result = swarm.download(count=12)
    assert_state(result, 5)
    assert set(swarm.peak_per_donor.values()) == {1}  # never two fetches in flight at one donor
    assert swarm.peak_total == 3  # but all three donors at once
    assert sum(swarm.calls.values()) == 12
    assert all(3 <= result.served[name] <= 5 for name in "abc"), result.served


def test_progress_is_monotone_and_ends_at_the_total():
    reports: list[tuple[int, int]] = []
    swarm = FakeSwarm({name: healthy() for name in "abc"})
    assert_state(swarm.download(count=8, progress=lambda done, total: reports.append((done, total))), 5)
    done = [d for d, _ in reports]
    assert {t for _, t in reports} == {4 * TOTAL}
    assert done == sorted(done) and done[0] == 0 and done[-1] == 4 * TOTAL
    assert len(reports) == 1 + 8  # the start, then each slice


def test_a_failing_progress_callback_does_not_fail_the_download():
    def broken(done: int, total: int) -> None:
        raise RuntimeError("terminal went away")
    assert_state(FakeSwarm({"a": healthy(), "b": healthy()}).download(count=4, progress=broken), 5)


def test_a_failed_donor_is_dropped_and_its_slice_goes_to_another():
    swarm = FakeSwarm({"dead": failing(), "a": healthy(), "b": healthy()})
    result = swarm.download(count=6)
    assert_state(result, 5)
    assert swarm.calls["dead"] == 1 and "dead" not in result.served


def test_a_donor_dying_halfway_keeps_the_slices_it_served():
    swarm = FakeSwarm({"dies": failing(after=2), "a": healthy()}, delay=0.01)
    result = swarm.download(count=8)
    assert_state(result, 5)
    assert swarm.calls["dies"] == 3
    assert result.served.get("dies") == 2 and result.served["a"] == 6


def test_no_donor_left_means_no_state():
    swarm = FakeSwarm({"x": failing(), "y": failing(after=1)})
    assert swarm.download(count=4) is None
    assert swarm.calls == {"x": 1, "y": 2}


def test_no_donors_means_no_state():
    assert download_slices([], lengths=LENGTHS, count=4, fetch=lambda *a: pytest.fail("fetched")) is None


def test_a_stalled_donor_times_out_without_holding_the_download():
    release = threading.Event()
    try:
        swarm = FakeSwarm({"stuck": hanging(release), "a": healthy(), "b": healthy()})
        started = time.monotonic()
        result = swarm.download(count=6, slice_timeout=0.3)
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert_state(result, 5)
    assert "stuck" not in result.served and swarm.calls["stuck"] == 1
    assert elapsed < 2.0


def _wrong_length(metadata, tensor, delta):
    return metadata, torch.cat([tensor, torch.zeros(delta)]) if delta > 0 else tensor[:delta]


def _with_nan(metadata, tensor):
    tensor[len(tensor) // 2] = float("nan")
    return metadata, tensor


def _with_inf(metadata, tensor):
    tensor[0] = float("inf")
    return metadata, tensor


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda m, t: _wrong_length(m, t, -1), id="short"),
    pytest.param(lambda m, t: _wrong_length(m, t, 1), id="oversized"),
    pytest.param(lambda m, t: _wrong_length(m, t, 10 * TOTAL), id="much-oversized"),
    pytest.param(_with_nan, id="nan"),
    pytest.param(_with_inf, id="inf"),
    pytest.param(lambda m, t: (m, t.double()), id="float64"),
    pytest.param(lambda m, t: (m, t.reshape(1, -1)), id="2d"),
    pytest.param(lambda m, t: ({"v": 1}, t), id="no-round"),
    pytest.param(lambda m, t: ({"round": True}, t), id="bool-round"),
    pytest.param(lambda m, t: ({"round": -1}, t), id="negative-round"),
    pytest.param(lambda m, t: ([5], t), id="metadata-not-a-dict"),
    pytest.param(lambda m, t: (m, t.numpy()), id="not-a-tensor"),
    pytest.param(lambda m, t: (m, t, t), id="not-a-pair"),
])
def test_an_invalid_slice_drops_its_donor(mutate):
    swarm = FakeSwarm({"bad": corrupt(mutate), "good": healthy()})
    result = swarm.download(count=4)
    assert_state(result, 5)
    assert swarm.calls["bad"] == 1 and "bad" not in result.served


def test_slices_come_from_the_round_most_donors_serve():
    # "behind" answers last, when the others' round is known.
    swarm = FakeSwarm({"behind": healthy(4), "a": healthy(5), "b": healthy(5)}, delay=0.01, slow={"behind": 0.1})
    result = swarm.download(count=12)
    assert_state(result, 5)
    assert "behind" not in result.served
    assert swarm.calls["behind"] == 1  # once its round is known, it is not asked again


def test_a_tie_between_rounds_goes_to_the_newer_state():
    swarm = FakeSwarm({"old": healthy(4), "new": healthy(5)}, delay=0.01)
    assert_state(swarm.download(count=4), 5)


def test_a_donor_running_ahead_of_the_majority_is_outvoted():
    swarm = FakeSwarm({"ahead": advancing(5, 6), "a": healthy(5), "b": healthy(5)}, delay=0.01,
                      slow={"ahead": 0.03})
    result = swarm.download(count=30)
    assert_state(result, 5)
    assert swarm.calls["ahead"] == 2  # its round-6 slice was discarded and it was left idle


def test_when_the_swarm_moves_on_a_round_everything_is_refetched_at_the_new_round():
    reports: list[int] = []
    swarm = FakeSwarm({name: advancing(5, 6) for name in "abc"}, delay=0.01)
    result = swarm.download(count=6, progress=lambda done, total: reports.append(done))
    assert_state(result, 6)
    assert sum(swarm.calls.values()) > 6  # the round-5 slices were fetched again
    assert reports == sorted(reports) and reports[-1] == 4 * TOTAL


def test_donors_that_keep_disagreeing_exhaust_the_fetch_budget():
    swarm = FakeSwarm({"a": healthy(5), "b": healthy(5)})
    assert swarm.download(count=4, max_fetches=3) is None
    assert sum(swarm.calls.values()) == 3


def test_a_donor_listed_twice_still_gets_one_fetch_at_a_time():
    swarm = FakeSwarm({"a": healthy(), "b": healthy()}, delay=0.01)
    result = download_slices(["a", "a", "b"], lengths=LENGTHS, count=6, fetch=swarm.fetch)
    assert_state(result, 5)
    assert swarm.peak_per_donor == {"a": 1, "b": 1}


@pytest.mark.parametrize(("lengths", "count"), [(LENGTHS, 0), ([3, 2], 6), ([5000], MAX_SLICES + 1)])
def test_an_impossible_slice_count_is_a_caller_error(lengths, count):
    with pytest.raises(ValueError, match="slices"):
        download_slices(["a"], lengths=lengths, count=count, fetch=lambda *a: pytest.fail("fetched"))


def diverged(round: int = 5) -> Serve:
    """A donor at the same round as the others whose state is not theirs (it missed a step)."""
    def serve(index: int, count: int, nth: int) -> tuple:
        start, stop = slice_bounds(TOTAL, index, count)
        return {"round": round, "v": 1, "lineage": "other"}, state_of(round + 100)[start:stop].clone()
    return serve


def same_lineage(a: dict, b: dict) -> bool:
    return a.get("lineage") == b.get("lineage")


def test_donors_whose_states_differ_are_never_mixed_into_one_state():
    swarm = FakeSwarm({"a": healthy(), "odd": diverged(), "b": healthy()}, delay=0.01, slow={"odd": 0.03})
    result = swarm.download(count=6, same_state=same_lineage)
    assert_state(result, 5)
    assert "odd" not in result.served and swarm.calls["odd"] == 1  # dropped at its first slice
    # Without the check the odd donor's slice would be assembled with the others'.
    mixed = FakeSwarm({"a": healthy(), "odd": diverged(), "b": healthy()}, delay=0.01, slow={"odd": 0.03})
    assert "odd" in mixed.download(count=6).served


def test_a_majority_of_donors_outvotes_a_first_donor_whose_state_differs():
    """State download poisoning (issue 11): the first donor to answer decided which state the
    others' slices must match, so one fast liar dropped every honest donor. Now the donors vote."""
    swarm = FakeSwarm({"odd": diverged(), "a": healthy(), "b": healthy()}, delay=0.01, slow={"a": 0.05, "b": 0.05})
    result = swarm.download(count=6, same_state=same_lineage)
    assert_state(result, 5)
    assert "odd" not in result.served  # its slices, fetched while it was the only voter, were replaced


def test_choose_state_takes_the_majority_then_the_newest_round_then_the_first_lineage():
    assert choose_state([(5, 1), (5, 1), (5, 0)]) == (5, 1)
    assert choose_state([(5, 0), (6, 1)]) == (6, 1)
    assert choose_state([(5, 1), (5, 0)]) == (5, 0)
    assert choose_state([]) is None


def test_the_first_donor_held_decides_the_state_when_donors_differ():
    # Two donors, two lineages: a tie, which goes to the lineage seen first.
    swarm = FakeSwarm({"odd": diverged(), "a": healthy()}, delay=0.01, slow={"a": 0.05})
    result = swarm.download(count=4, same_state=same_lineage)
    assert result is not None and result.served == {"odd": 4}
    assert torch.equal(torch.cat(result.tensors), state_of(105))


def test_a_round_past_the_schedule_never_wins_the_vote():
    # Sybils claiming a far-future round would outvote the honest donors (ties go to the newer).
    swarm = FakeSwarm({"liar1": healthy(2**40), "liar2": healthy(2**40), "honest": healthy(5)}, delay=0.01)
    result = swarm.download(count=4, max_round=9)
    assert_state(result, 5)
    assert set(result.served) == {"honest"} and swarm.calls["liar1"] == swarm.calls["liar2"] == 1


def test_a_request_may_carry_an_admission_proof_of_exactly_its_size():
    proof = make_proof(admission_key(b"swarm"), "QmPeer")
    assert decode_slice_request(encode_slice_request(3, 8, proof)) == (3, 8, proof)
    assert decode_update_request(encode_update_request(5, proof)) == (5, proof)
    assert decode_update_request(encode_update_request(5)) == (5, None)
    for bad in (proof[:-1], proof + b"x"):
        with pytest.raises(MessageError):
            decode_slice_request(msgpack.packb({"slice": 1, "of": 8, "admit": bad}))
        with pytest.raises(MessageError):
            encode_update_request(5, bad)


def test_a_proof_binds_the_swarm_key_to_one_peer():
    key = admission_key(b"swarm")
    proof = make_proof(key, "QmAlice")
    assert admitted(key, "QmAlice", proof)
    assert not admitted(key, "QmBob", proof)  # useless to anyone else
    assert not admitted(admission_key(b"another swarm"), "QmAlice", proof)
    assert not admitted(key, "QmAlice", None) and not admitted(key, "QmAlice", "x" * 32)
    assert admitted(None, "QmAnyone", None)  # a public swarm
    assert key != hashlib.sha256(b"shoal swarm key\0" + b"swarm").digest()  # not the DHT records' seal key


def test_a_slice_the_check_refuses_drops_its_donor_and_is_fetched_from_another(caplog):
    """A donor whose values do not match the fingerprint they should is named when its slice
    arrives (``SharedState.slice_check`` in production), and its slices come from the others."""
    def lying(index: int, count: int, nth: int) -> tuple:
        metadata, values = healthy()(index, count, nth)
        return {**metadata, "liar": True}, values + 1.0

    seen: list[tuple[int, int]] = []

    def check(start: int, stop: int, metadata: dict, values: torch.Tensor) -> str | None:
        seen.append((start, stop))
        return "values do not match the fingerprint it claims" if metadata.get("liar") else None

    swarm = FakeSwarm({"liar": lying, "a": healthy(), "b": healthy()}, delay=0.01, slow={"a": 0.03, "b": 0.03})
    with caplog.at_level("WARNING"):
        result = swarm.download(count=6, check=check, align=100)
    assert_state(result, 5)
    assert "liar" not in result.served and swarm.calls["liar"] == 1
    assert any("liar" in r.message and "do not match" in r.message for r in caplog.records)
    assert all(start % 100 == 0 for start, _ in seen)  # the check sees aligned slices


# -- a donor's limits, against joiners that stop reading or keep asking -----------------------------
class FakeDonor(serving.StateServing):
    """The donor's serving on a fake host (a state of anchor and momentum, ``numel`` values each)."""

    allow_state_sharing = True

    def __init__(self, numel: int):
        self.total_size = numel  # hivemind's: the averaged vector's size
        self.state = torch.randn(2 * numel, generator=torch.Generator().manual_seed(0))
        self._state_copy, self._state_copy_lock = None, None

    def _refused(self, what, proof, context) -> bool:
        return False

    async def _get_current_state_from_host_process(self):
        numel = self.total_size
        return b"\x80", [self.state[:numel], self.state[numel:]], None


def slice_stream(donor: FakeDonor, peer: str):
    """``peer``'s request for the whole state, as one slice: the donor's answer, unread."""
    return donor.rpc_download_state_slice(averaging_pb2.JoinRequest(gather=encode_slice_request(0, 1)),
                                          SimpleNamespace(remote_id=peer))


async def bytes_served(donor: FakeDonor, peer: str) -> int:
    """What an honest joiner ``peer`` receives of the whole state (0: refused)."""
    return sum([len(m.tensor_part.buffer) async for m in slice_stream(donor, peer)])


def test_downloads_that_stop_reading_hold_a_donors_slots_only_until_their_deadline(monkeypatch):
    """Issue 29 (6): four identities, two downloads each that stop reading after one message
    (hivemind's drain then never returns, so the donor's stream stays suspended at its yield), held
    every slot of a donor for good: an honest joiner got nothing."""
    monkeypatch.setattr(serving, "SERVE_STALL_S", 0.2)
    donor = FakeDonor(numel=4 * STREAMING_CHUNK_SIZE_BYTES)  # a full state: 32 messages
    full = 8 * donor.total_size
    # A stream that stopped after its first message is past its deadline this long after it.
    stuck_for = serving.SERVE_STALL_S + (STREAMING_CHUNK_SIZE_BYTES + 1) / MIN_DONOR_BYTES_PER_S

    async def scenario() -> None:
        stuck = [slice_stream(donor, f"sybil{i // 2}") for i in range(serving.MAX_SERVES)]
        for stream in stuck:
            await anext(stream)
        assert await bytes_served(donor, "honest") == 0  # the limits hold within the deadline
        await asyncio.sleep(stuck_for + 0.1)
        assert await bytes_served(donor, "honest") == full
        with pytest.raises(StopAsyncIteration):  # a stuck stream ends at its next chance
            await anext(stuck[0])
        for stream in stuck:
            await stream.aclose()

    asyncio.run(scenario())


def test_one_peer_is_served_a_few_full_states_per_window(monkeypatch, caplog):
    """Issue 29 (6): one identity could make a donor stream forever, one download after another."""
    monkeypatch.setattr(serving, "DOWNLOAD_WINDOW_S", 1.0)  # the budget refills in a second
    donor = FakeDonor(numel=4096)
    full = 8 * donor.total_size

    async def scenario() -> None:
        served = [await bytes_served(donor, "greedy") for _ in range(serving.DOWNLOAD_BUDGET_STATES + 2)]
        assert served == [full] * serving.DOWNLOAD_BUDGET_STATES + [0, 0]
        assert await bytes_served(donor, "other") == full  # a budget per peer
        await asyncio.sleep(serving.DOWNLOAD_WINDOW_S)
        assert await bytes_served(donor, "greedy") == full

    with caplog.at_level(logging.WARNING, logger=serving.__name__):
        asyncio.run(scenario())
    refusals = [r.message for r in caplog.records if r.message.startswith("refused a state slice to greedy")]
    assert len(refusals) == 1 and "budget" in refusals[0], refusals  # logged once a minute per peer


# -- what a joiner keeps of a hostile donor's answer -----------------------------------------------
DONOR = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class _Sink:
    """The joiner's end of the stream it writes its request to."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class WireDonor:
    """A donor as a joiner's p2p sees it: ``wire`` (hivemind's framing), then the end of the stream."""

    def __init__(self, wire: bytes):
        self.wire = wire

    async def call_binary_stream_handler(self, peer_id, handler_name: str):
        reader = asyncio.StreamReader()
        reader.feed_data(self.wire)
        reader.feed_eof()
        return None, reader, _Sink()


class FakeJoiner(StateFetching):
    serializer = MSGPackSerializer
    prefix = "test"
    _get_handle_name = ShoalAverager._get_handle_name

    def __init__(self, wire: bytes):
        self._p2p = WireDonor(wire)

    def proof(self) -> None:
        return None


def framed(messages: list[averaging_pb2.DownloadData]) -> bytes:
    """``messages`` as hivemind's ``P2P.send_protobuf`` writes them: marker, 8-byte length, message."""
    return b"".join(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data
                    for data in (m.SerializeToString() for m in messages))


def answer(tensor: torch.Tensor, metadata: bytes) -> list[averaging_pb2.DownloadData]:
    """What an honest donor sends: the tensor in hivemind's streaming parts, metadata in the first."""
    parts = split_for_streaming(serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE))
    return [averaging_pb2.DownloadData(tensor_part=part, metadata=metadata if i == 0 else b"")
            for i, part in enumerate(parts)]


# Each hostile answer stays within the bytes an honest one may take, but for the last: every refusal
# is its own rule's, not the bound on the whole answer's.
def junk_in_every_message(messages):
    for message in messages[1:]:
        message.metadata = b"\0" * 1024
    return framed(messages)


def huge_metadata(messages):
    metadata = MSGPackSerializer.loads(messages[0].metadata)
    messages[0].metadata = MSGPackSerializer.dumps({**metadata, "pad": "x" * 100 * 1024})
    return framed(messages)


def announcing_a_huge_message(messages):
    return framed(messages[:1]) + P2P.MESSAGE_MARKER + (2**40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


UPDATE_NUMEL = 2**18  # 512 KiB in fp16: 8 messages


def receive_update(wire: bytes):
    return asyncio.run(FakeJoiner(wire)._receive_update(DONOR, 4, UPDATE_NUMEL))


def receive_slice(wire: bytes):
    return asyncio.run(FakeJoiner(wire)._receive_slice(DONOR, 0, 1, UPDATE_NUMEL, stall_timeout=5.0))


def update_answer():
    metadata = MSGPackSerializer.dumps({"v": UPDATE_VERSION, "round": 9, "rounds_done": 5})
    return answer(torch.ones(UPDATE_NUMEL, dtype=torch.float16), metadata)


def slice_answer():
    return answer(torch.ones(UPDATE_NUMEL), MSGPackSerializer.dumps({"round": 9, "v": 1}))


def test_a_joiner_takes_an_honest_answer_read_frame_by_frame():
    update = receive_update(framed(update_answer()))
    assert (update.round, update.rounds_done) == (9, 5) and torch.equal(update.update, torch.ones(UPDATE_NUMEL).half())
    metadata, values = receive_slice(framed(slice_answer()))
    assert metadata == {"round": 9, "v": 1} and torch.equal(values, torch.ones(UPDATE_NUMEL))


def test_a_donors_refusal_reaches_the_joiner_with_its_message():
    error = RPCError(message="MessageError: slice 9 of 8").SerializeToString()
    wire = P2P.ERROR_MARKER + len(error).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + error
    with pytest.raises(P2PHandlerError, match="slice 9 of 8"):
        receive_slice(wire)


@pytest.mark.parametrize(("hostile", "refusal"), [
    pytest.param(junk_in_every_message, "metadata after its first message", id="junk-metadata"),
    pytest.param(huge_metadata, "bytes of metadata", id="huge-metadata"),
    pytest.param(announcing_a_huge_message, "past the", id="huge-message"),
])
@pytest.mark.parametrize("receive", [
    pytest.param((receive_update, update_answer), id="update"),
    pytest.param((receive_slice, slice_answer), id="slice"),
])
def test_a_donor_cannot_make_a_joiner_keep_more_than_the_tensor_it_asked_for(hostile, refusal, receive):
    """Issue 29 (8): a joiner counted only each part's tensor bytes but kept the whole messages: a
    donor padding every message with metadata (or sending one message of any size, which hivemind's
    reader takes whole) made it hold gigabytes within the update's timeout."""
    receive_answer, honest = receive
    with pytest.raises(ValueError, match=refusal):
        receive_answer(hostile(honest()))
