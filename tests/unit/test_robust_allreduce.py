"""The hivemind wiring of robust aggregation without a network: ``RobustPartReducer`` on an event
loop, the returned-delta check, group vetting, and the check that hivemind's patched code is the
code that was reviewed."""

from __future__ import annotations

import asyncio
import functools
import types

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.averaging.partition import BannedException, TensorPartContainer
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from averaging.math import codecs, robust
from averaging.math.robust import BanList, RobustConfig, Strikes
from averaging.network.hivemind import matchmaking, pins
from averaging.network.hivemind.allreduce import (
    CheckedPartContainer,
    GroupRefused,
    RobustAllReduceRunner,
    RobustCounters,
    RobustPartReducer,
    gathered_proof,
    vet_group,
)
from averaging.network.hivemind.averager import ShoalAverager
from protocols.admission import admission_key, make_proof

SHAPES = (torch.Size([64]), torch.Size([64]))


def test_the_hivemind_code_we_override_is_the_reviewed_code():
    assert pins.changes() == []
    pins.check()


def test_the_self_check_notices_a_change(monkeypatch):
    monkeypatch.setitem(pins.REVIEWED, "AllReduceRunner._ban_sender", "0" * 64)
    assert pins.changes() == ["AllReduceRunner._ban_sender (its code)"]
    with pytest.raises(pins.HivemindChanged, match="AllReduceRunner._ban_sender"):
        pins.check()


def make_reducer(senders: int, refused: list, return_code: str | None = None, **extra) -> RobustPartReducer:
    """Build inside the event loop that uses it (the reducer creates asyncio futures)."""
    def refuse(index, reason):  # what the runner does: record, then fail the sender
        refused.append((index, reason))
        reducer.on_sender_failed(index)

    reducer = RobustPartReducer(SHAPES, senders, config=RobustConfig(), local_sender_index=0, refuse=refuse,
                                return_code=return_code, **extra)
    return reducer


def run_senders(senders, refused, parts_by_sender, weights, return_code=None, reducers=None, **extra):
    reducer = None

    async def sender(index):
        results = []
        try:
            for part_index, part in enumerate(parts_by_sender[index]):
                results.append(await reducer.accumulate_part(index, part_index, part, weight=weights[index]))
        except BannedException:
            results.append("banned")
        return results

    async def main():
        nonlocal reducer
        reducer = make_reducer(senders, refused, return_code, **extra)
        if reducers is not None:
            reducers.append(reducer)
        return await asyncio.wait_for(asyncio.gather(*(sender(i) for i in range(len(parts_by_sender)))), 5)

    return asyncio.run(main())


def honest(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.ones(64) + 0.1 * torch.randn(64, generator=generator) for _ in SHAPES]


@pytest.mark.parametrize("bad_part", [torch.zeros(1), torch.full((64,), float("nan")), torch.zeros(64).double()])
def test_a_bad_part_fails_its_sender_at_once_and_the_others_finish(bad_part):
    refused = []
    parts = [honest(0), honest(1), [bad_part, bad_part]]
    results = run_senders(3, refused, parts, [1.0, 1.0, 1.0])  # no timeout: nobody waits for sender 2
    assert results[2] == ["banned"]
    assert [index for index, _ in refused] == [2]
    for part_index in range(2):
        expected = (parts[0][part_index] + parts[1][part_index]) / 2
        assert torch.allclose(results[0][part_index], expected)
        assert torch.equal(results[0][part_index], results[1][part_index])


def test_a_weight_that_changes_within_the_round_fails_the_sender():
    refused = []

    async def main():
        reducer = make_reducer(2, refused)
        first = asyncio.gather(reducer.accumulate_part(0, 0, honest(0)[0], weight=1.0),
                               reducer.accumulate_part(1, 0, honest(1)[0], weight=1.0))
        await asyncio.wait_for(first, 5)
        with pytest.raises(BannedException):
            await reducer.accumulate_part(1, 1, honest(1)[1], weight=1e30)
        return await asyncio.wait_for(reducer.accumulate_part(0, 1, honest(0)[1], weight=1.0), 5)

    result = asyncio.run(main())
    assert torch.allclose(result, honest(0)[1])  # only our own part was left for part 1
    assert "weight changed" in refused[0][1]


def test_a_huge_part_is_refused_at_aggregation_and_left_out():
    refused = []
    parts = [honest(0), honest(1), [1000 * honest(2)[0], 1000 * honest(2)[1]]]
    results = run_senders(3, refused, parts, [1.0, 1.0, 1.0])
    assert refused and refused[0][0] == 2 and "norm" in refused[0][1]
    expected = (parts[0][0] + parts[1][0]) / 2
    assert torch.allclose(results[0][0], expected)


@pytest.mark.parametrize("senders", [2, 3])
def test_a_weight_no_peer_could_have_earned_is_refused_and_left_out(senders):
    """The weight attack (issue 11): a declared 1e30 was only clipped to 3x the median, so its
    sender kept half the weight of every group it was in and was never banned. Now it is refused,
    even with two senders (the reference is our own weight or the lower median)."""
    refused = []
    parts = [honest(i) for i in range(senders - 1)] + [[-honest(9)[0], -honest(9)[1]]]
    results = run_senders(senders, refused, parts, [1.0] * (senders - 1) + [1e30])
    assert [index for index, _ in refused] == [senders - 1] and "declared weight" in refused[0][1]
    expected = sum(parts[i][0] for i in range(senders - 1)) / (senders - 1)
    assert torch.allclose(results[0][0], expected)


def test_an_honest_spread_of_weights_is_clipped_not_refused():
    refused = []
    parts = [honest(0), honest(1), honest(2)]
    results = run_senders(3, refused, parts, [1.0, 1.0, 50.0])  # a far faster peer: clipped to 3x
    assert refused == []
    expected = (parts[0][0] + parts[1][0] + 3 * parts[2][0]) / 5
    assert torch.allclose(results[0][0], expected, atol=1e-6)


@pytest.mark.parametrize("code", ["int8", "int4"])
def test_with_quantized_returns_every_sender_gets_the_same_quantized_average(code):
    refused, reducers = [], []
    parts = [honest(0), honest(1), honest(2)]
    results = run_senders(3, refused, parts, [1.0, 2.0, 1.0], return_code=code, reducers=reducers)
    assert refused == []
    for part_index in range(2):
        mean = (parts[0][part_index] + 2 * parts[1][part_index] + parts[2][part_index]) / 4
        expected = codecs.quantize(mean, code)
        assert not torch.equal(expected, mean)
        for sender in range(3):  # bit for bit, for every member (the reducer's own part too)
            assert torch.equal(results[sender][part_index], expected)
        # ...and the bytes every member receives decode to exactly those values
        assert torch.equal(codecs.decode(reducers[0].returns[part_index], max_numel=64), expected)


def test_an_extra_tensors_part_is_judged_without_work_and_returned_in_its_own_code():
    """Part 0 is a pseudo-gradient's (int4 average returns; CenteredClip gives the sender with 3x
    the work a 3x wider radius), part 1 an extra tensor's (a moment: no work scaling, bf16 returns)."""
    refused, reducers = [], []
    parts = [honest(0), honest(1), honest(2)]
    for part in parts[2]:
        part += 1.5  # the peer that did 3x the others' work sent parts far from theirs
    weights = [1.0, 1.0, 3.0]
    results = run_senders(3, refused, parts, weights, return_code="int4", reducers=reducers,
                          extra_parts=[False, True], extra_code="bf16")
    assert refused == []
    config = RobustConfig()
    bounded = robust.bound_weights(weights, max_ratio=config.max_weight_ratio, max_weight=config.max_weight)
    for index, (work_scaled, code) in enumerate(((True, "int4"), (False, "bf16"))):
        expected = robust.aggregate([p[index] for p in parts], bounded, config, work_scaled=work_scaled).value
        assert torch.equal(results[0][index], codecs.quantize(expected, code))
        assert codecs.decode(reducers[0].returns[index], max_numel=64).equal(results[1][index])
    unscaled = robust.aggregate([p[0] for p in parts], bounded, config, work_scaled=False).value
    assert not torch.allclose(unscaled, robust.aggregate([p[0] for p in parts], bounded, config).value)


def test_a_far_members_state_gets_weight_0_and_its_pseudo_gradient_still_counts():
    """Sub-groups: a member whose claimed anchor is far from the rest (``far_senders``) adds nothing
    to the extra tensor's parts (the anchors, momenta) but its pseudo-gradient part is averaged as
    anyone's; a reducer whose every sender is far keeps them all (nobody would be left)."""
    refused, reducers = [], []
    parts = [honest(0), honest(1), honest(2)]
    parts[2][1] += 4.0  # its anchor (the extra part), far from the others'
    results = run_senders(3, refused, parts, [1.0, 1.0, 1.0], return_code="int4", reducers=reducers,
                          extra_parts=[False, True], extra_code="fp16", far_senders=frozenset({2}))
    assert refused == []
    config = RobustConfig()
    main = robust.aggregate([p[0] for p in parts], [1.0] * 3, config).value
    state = robust.aggregate([p[1] for p in parts[:2]], [1.0] * 2, config, work_scaled=False).value
    for sender in range(3):  # the far member takes the others' state like everyone
        assert torch.equal(results[sender][0], codecs.quantize(main, "int4"))
        assert torch.equal(results[sender][1], codecs.quantize(state, "fp16"))
    assert float(results[0][1].mean()) < 1.5  # its anchor pulled nothing (with it: about 2.3)
    alone = run_senders(2, [], parts[:2], [1.0, 1.0], return_code="int4", extra_parts=[False, True],
                        extra_code="fp16", far_senders=frozenset({0, 1}))
    both = robust.aggregate([p[1] for p in parts[:2]], [1.0] * 2, config, work_scaled=False).value
    assert torch.equal(alone[0][1], codecs.quantize(both, "fp16"))


def checked_container(tensor: torch.Tensor, peers: int,
                      returns_average: frozenset[int] = frozenset()) -> tuple[CheckedPartContainer, list]:
    """Build inside the event loop that uses it (the container creates asyncio events)."""
    bad = []
    container = TensorPartContainer([tensor], [1.0] * peers, part_size_bytes=4 * 16)
    container.__class__ = CheckedPartContainer
    container.max_norm_ratio, container.on_bad_return, container.distrusted = 30.0, lambda i, r: bad.append(i), set()
    container.returns_average = returns_average
    return container, bad


def test_a_lying_reducer_spoils_only_its_own_parts_which_we_then_keep_local():
    async def collect():
        container, bad = checked_container(torch.ones(64), 2)
        assert container.num_parts_by_peer == (2, 2)
        container.register_processed_part(0, 0, torch.full((16,), 0.5))  # honest reducer
        container.register_processed_part(0, 1, torch.full((16,), 0.5))
        container.register_processed_part(1, 0, torch.full((16,), 1e5))  # a lie: refused ...
        container.register_processed_part(1, 1, torch.full((16,), 2.0))  # ... and its later parts too
        return [t async for t in container.iterate_output_tensors()], bad

    (delta,), bad = asyncio.run(collect())
    assert bad == [1]
    assert torch.equal(delta[:32], torch.full((32,), 0.5))
    assert torch.equal(delta[32:], torch.zeros(32))


def test_a_returned_average_becomes_our_delta_and_a_lying_one_is_still_refused():
    """Reducer 1 returns averages (int4 returns), reducer 0 is ourselves (hivemind hands us our own
    result as a delta). A lying average is refused like a lying delta."""
    async def collect(lie: bool):
        own = torch.arange(64, dtype=torch.float32)
        container, bad = checked_container(own, 2, returns_average=frozenset({1}))
        for part_index in range(2):
            container.register_processed_part(0, part_index, torch.full((16,), 0.5))
            average = own[32 + 16 * part_index:48 + 16 * part_index] + (1e5 if lie else 0.25)
            container.register_processed_part(1, part_index, average)
        return [t async for t in container.iterate_output_tensors()], bad

    (delta,), bad = asyncio.run(collect(lie=False))
    assert bad == [] and torch.equal(delta[:32], torch.full((32,), 0.5))
    assert torch.equal(delta[32:], torch.full((32,), 0.25))  # average - own
    (delta,), bad = asyncio.run(collect(lie=True))
    assert bad == [1] and torch.equal(delta[32:], torch.zeros(32))


def test_a_failed_reducer_is_named_in_one_warning(monkeypatch, caplog):
    """hivemind logs why a reducer failed at debug level only, and then "received 91.7% results",
    which names nobody; the failure costs us this round's average (a partial one is not applied)."""
    from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner

    async def cut_short(self, peer_id):
        raise AllreduceException(f"peer {peer_id} sent 2 parts, but we expected 3")

    monkeypatch.setattr(AllReduceRunner, "_communicate_with_peer", cut_short)
    runner = RobustAllReduceRunner.__new__(RobustAllReduceRunner)
    runner.excluded_peers, runner.group_id, runner.failed_reducers = [], bytes.fromhex("b783fae9") * 2, []
    runner.leader = None
    with caplog.at_level("WARNING", logger="averaging.network.hivemind.allreduce"), pytest.raises(AllreduceException):
        asyncio.run(runner._communicate_with_peer(PEERS[1]))
    assert f"group b783fae9: reducer {PEERS[1]} failed" in caplog.text
    assert "sent 2 parts, but we expected 3" in caplog.text


@pytest.mark.parametrize("leader", [None, 0], ids=["we-led", "sent-by-a-leader"])
def test_a_peer_that_does_not_run_the_group_is_not_waited_for_as_a_sender(monkeypatch, caplog, leader):
    """A reducer that answers BAD_GROUP_ID gave up on the group: it will not send its parts either,
    so it is failed as a sender at once (hivemind waits for it until the sender timeout). In a
    group a leader sent us, the leader answers for it (issue 54, item 3: a hostile leader listed an
    honest peer it had turned away, and the members struck that peer until they banned it); in one
    we assembled, the peer joined us itself."""
    from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner

    failures = {PEERS[1]: "sent BAD_GROUP_ID", PEERS[2]: "sent 2 parts, but we expected 3"}

    async def refuse(self, peer_id):
        raise AllreduceException(f"{peer_id} {failures[peer_id]}")

    class Reducer:
        failed: list[int] = []

        def on_sender_failed(self, index: int) -> None:
            self.failed.append(index)

    monkeypatch.setattr(AllReduceRunner, "_communicate_with_peer", refuse)
    runner = RobustAllReduceRunner.__new__(RobustAllReduceRunner)
    runner.excluded_peers, runner.group_id, runner.failed_reducers = [], bytes.fromhex("b783fae9") * 2, []
    runner.sender_peer_ids, runner.banned_senders, runner.tensor_part_reducer = list(PEERS), set(), Reducer()
    runner.leader = None if leader is None else PEERS[leader]
    Reducer.failed = []

    async def both() -> None:
        runner.banlock = asyncio.Lock()
        for peer in (PEERS[1], PEERS[2]):
            with pytest.raises(AllreduceException):
                await runner._communicate_with_peer(peer)

    with caplog.at_level("WARNING", logger="averaging.network.hivemind.allreduce"):
        asyncio.run(both())
    assert Reducer.failed == [1] and runner.banned_senders == {PEERS[1]}  # a short stream says nothing of that
    assert f"{PEERS[1]} does not run this group" in caplog.text
    blamed = PEERS[1] if leader is None else PEERS[leader]
    assert runner.failed_reducers == [blamed, PEERS[2]]  # both are judged when the all-reduce ends


@pytest.mark.parametrize("how, why", [
    ("hang_up", "its stream ended (the sender hung up)"),
    ("timeout", "its next part did not come within the sender timeout (4.0s)"),
    ("failed", "it was failed as a sender meanwhile"),
    ("cancelled", "our handler was cancelled"),
    ("whole", None),
])
def test_a_sender_that_stops_short_is_named_by_its_reducer_with_the_reason(how, why, caplog):
    """hivemind fails a sender whose stream stops short without a word; the sender then reads our
    answer stream ending early ("sent 2 parts, but we expected 3") and nobody logged why. Now the
    reducer says how many parts came and why no more did; a whole stream says nothing."""
    runner = RobustAllReduceRunner.__new__(RobustAllReduceRunner)
    runner.sender_peer_ids, runner.excluded_peers, runner.group_id = list(PEERS), [], bytes.fromhex("b783fae9") * 2
    runner.sender_timeout, runner.tensor_part_reducer = 4.0, types.SimpleNamespace(num_parts=3)
    runner.counters = RobustCounters()
    parts = 3 if how == "whole" else 2
    streaming = []  # the answer gauge while an answer is out: a leaving peer waits for it (HivemindBackend.shutdown)

    async def stream():
        for i in range(parts):
            yield i
        if how == "timeout":
            raise TimeoutError
        if how == "cancelled":
            raise asyncio.CancelledError

    async def reduce_parts(incoming, sender_index):  # hivemind's loop: an answer per part, until it stops
        async for part in incoming:
            yield part
            if how == "failed" and part == 1:
                return  # BannedException: the sender was failed elsewhere, the loop breaks

    runner._reduce_parts = reduce_parts

    async def answers() -> list:
        out = []
        try:
            async for answer in runner._accumulate_parts_streaming(stream(), 1):
                out.append(answer)
                streaming.append(runner.counters.answering)
        except (TimeoutError, asyncio.CancelledError):
            pass
        return out

    with caplog.at_level("WARNING", logger="averaging.network.hivemind.allreduce"):
        got = asyncio.run(answers())
    assert len(got) == parts
    assert streaming == [1] * parts and runner.counters.answering == 0  # back to 0 however it ended
    if why is None:
        assert caplog.text == ""
    else:
        assert f"group b783fae9: as a reducer, got 2 of 3 parts from {PEERS[1]}" in caplog.text
        assert why in caplog.text


GROUP = [PeerID(f"member-{i}".encode()) for i in range(5)]  # GROUP[0] is us


def striking_runner(group: list[PeerID], failed: list[PeerID], strikes: Strikes, ban_list: BanList,
                    counters: RobustCounters | None = None, excluded: tuple[PeerID, ...] = ()) -> RobustAllReduceRunner:
    """The state ``strike_failed_reducers`` reads, after an all-reduce in which ``failed`` failed us."""
    runner = RobustAllReduceRunner.__new__(RobustAllReduceRunner)
    runner.peer_id, runner.ordered_peer_ids, runner.group_id = group[0], tuple(group), b"g" * 8
    runner.tensor_part_container = types.SimpleNamespace(num_parts_by_peer=(1,) * len(group))
    runner.excluded_peers, runner.failed_reducers = list(excluded), list(failed)
    runner.strikes, runner.ban_list, runner.counters = strikes, ban_list, counters
    return runner


def test_a_reducer_failing_us_every_round_is_banned_at_the_strike_limit():
    strikes, ban_list, counters = Strikes(limit=3, window_rounds=10), BanList(rounds=5), RobustCounters()
    for _ in range(3):  # rounds 1 to 3, the reducer GROUP[1] failing us in each
        ban_list.next_round()
        assert not ban_list.is_banned(str(GROUP[1]))
        assert striking_runner(GROUP[:3], [GROUP[1]], strikes, ban_list, counters).strike_failed_reducers() == [str(GROUP[1])]
    assert ban_list.banned == [str(GROUP[1])] and counters.snapshot()["bans"] == 1
    ban_list.next_round()  # banned: excluded from the start of its groups, and never struck there
    assert striking_runner(GROUP[:3], [GROUP[1]], strikes, ban_list, excluded=(GROUP[1],)).strike_failed_reducers() == []


def test_a_failure_is_struck_in_the_round_its_step_began():
    """With the prepare lane, round 2's step (which counts a round) can begin while round 1's
    all-reduce still runs: round 1's failure still counts in round 1, not as a second failure in 2."""
    strikes, ban_list = Strikes(limit=2, window_rounds=10), BanList(rounds=5)
    ban_list.next_round()
    ban_list.next_round()  # round 2's step began
    striking_runner(GROUP[:3], [GROUP[1]], strikes, ban_list).strike_failed_reducers(round=1)
    striking_runner(GROUP[:3], [GROUP[1]], strikes, ban_list).strike_failed_reducers(round=2)
    assert ban_list.banned == [str(GROUP[1])]


def test_when_most_reducers_fail_us_nobody_is_struck():
    strikes, ban_list = Strikes(limit=1, window_rounds=10), BanList(rounds=5)
    ban_list.next_round()
    assert striking_runner(GROUP[:3], [GROUP[1], GROUP[2]], strikes, ban_list).strike_failed_reducers() == []
    assert striking_runner(GROUP[:2], [GROUP[1]], strikes, ban_list).strike_failed_reducers() == []  # a pair
    assert ban_list.banned == []
    # One of four others failed: struck (limit 1: banned); a peer excluded from the start is no reducer of ours.
    runner = striking_runner(GROUP, [GROUP[2], GROUP[3]], strikes, ban_list, excluded=(GROUP[3],))
    assert runner.strike_failed_reducers() == [str(GROUP[2])] and ban_list.banned == [str(GROUP[2])]


# -- a part for a group we have not registered (ShoalAverager.rpc_aggregate_part) ----------------

class Group:
    """A registered group's runner: answers each part with AVERAGED_PART."""

    async def rpc_aggregate_part(self, stream, context):
        async for _ in stream:
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)


def fake_averager(*, looking: bool, matched: tuple[bytes, ...] = ()) -> types.SimpleNamespace:
    """What ``rpc_aggregate_part`` reads of a ``ShoalAverager``: registered and ended groups, the
    waits (the sender timeout 10 s, request_timeout 0.3 s) and its matchmaking."""
    assembled = asyncio.get_running_loop().create_future()
    return types.SimpleNamespace(
        _running_groups={}, _ended_groups={}, _registration_wait=10.0, _unknown_group_wait=0.3,
        _matchmaking=types.SimpleNamespace(is_looking_for_group=looking, matched={1: list(matched)}, leaders={},
                                           assembled_group=assembled))


async def send_part(averager, group_id: bytes, *, hang: bool = False, register_after: float | None = None):
    """(the codes answered, seconds until the first answer, seconds until the handler returned)."""
    async def parts():
        yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=group_id)
        if hang:  # a sender that never hangs up
            await asyncio.Event().wait()

    async def register():
        await asyncio.sleep(register_after)
        future = asyncio.get_running_loop().create_future()
        future.set_result(Group())
        averager._running_groups[group_id] = future

    if register_after is not None:
        asyncio.create_task(register())
    loop = asyncio.get_running_loop()
    start, codes, first = loop.time(), [], None
    async for message in ShoalAverager.rpc_aggregate_part(averager, parts(), None):
        codes.append(message.code)
        first = loop.time() - start if first is None else first
    return codes, first, loop.time() - start


def test_a_part_for_a_group_we_never_knew_is_answered_at_once():
    async def main():
        return await asyncio.wait_for(send_part(fake_averager(looking=False), b"unknown"), 5)

    codes, first, _ = asyncio.run(main())
    assert codes == [averaging_pb2.BAD_GROUP_ID] and first < 0.2  # it used to wait the sender timeout (10 s)


def test_while_we_look_for_a_group_an_unknown_one_waits_request_timeout_at_most():
    async def main():
        refused = await asyncio.wait_for(send_part(fake_averager(looking=True), b"unknown"), 5)
        # Our leader's message arrives 0.1 s after another member's part: the part runs.
        ran = await asyncio.wait_for(send_part(fake_averager(looking=True), b"ours", register_after=0.1), 5)
        # A stranger that never hangs up is let go a request_timeout after its answer.
        held = await asyncio.wait_for(send_part(fake_averager(looking=False), b"unknown", hang=True), 5)
        return refused, ran, held

    (codes, first, _), (ran, _, _), (held, _, returned) = asyncio.run(main())
    assert codes == [averaging_pb2.BAD_GROUP_ID] and 0.25 < first < 1.0
    assert ran == [averaging_pb2.AVERAGED_PART]
    assert held == [averaging_pb2.BAD_GROUP_ID] and 0.25 < returned < 1.0


def test_a_group_we_matched_waits_for_its_trigger_longer_than_request_timeout():
    """A member triggered before us sends its parts while our step still awaits its trigger: they
    wait for the registration (up to the sender timeout), not request_timeout."""
    async def main():
        return await asyncio.wait_for(send_part(fake_averager(looking=False, matched=(b"ours",)), b"ours",
                                                register_after=0.8), 5)

    codes, first, _ = asyncio.run(main())
    assert codes == [averaging_pb2.AVERAGED_PART] and first > 0.7


def test_a_group_we_just_assembled_counts_as_known():
    async def main():
        averager = fake_averager(looking=True)
        averager._matchmaking.assembled_group.set_result(GroupInfo(b"ours", (PEERS[0],), (b"",)))
        return await asyncio.wait_for(send_part(averager, b"ours", register_after=0.6), 5)

    codes, first, _ = asyncio.run(main())
    assert codes == [averaging_pb2.AVERAGED_PART] and first > 0.5


def gathered(bandwidth, mode: AveragingMode) -> bytes:
    return MSGPackSerializer.dumps([bandwidth, mode.value, MSGPackSerializer.dumps({"r": 1})])


PEERS = [PeerID(f"peer-{i}".encode()) for i in range(3)]


def vet(peers, entries, **kwargs):
    options = dict(peer_id=PEERS[0], bandwidth=None, mode=AveragingMode.NODE, max_group_size=4,
                   serializer=MSGPackSerializer)
    return vet_group(GroupInfo(b"group", tuple(peers), tuple(entries)), **{**options, **kwargs})


def test_vet_group_drops_bandwidths_so_a_leader_cannot_pick_the_reducer():
    entries = [gathered(None, AveragingMode.NODE), gathered(0.0, AveragingMode.NODE), gathered(1e9, AveragingMode.NODE)]
    group = vet(PEERS, entries)
    assert group.peer_ids == tuple(PEERS)
    assert [MSGPackSerializer.loads(raw)[0] for raw in group.gathered] == [None, None, None]
    assert MSGPackSerializer.loads(MSGPackSerializer.loads(group.gathered[1])[2]) == {"r": 1}


@pytest.mark.parametrize("case", ["too big", "duplicate", "our mode forged", "bad bandwidth", "garbage"])
def test_vet_group_refuses(case):
    entries = [gathered(None, AveragingMode.NODE) for _ in PEERS]
    peers = list(PEERS)
    if case == "too big":
        peers, entries = [*peers, PeerID(b"peer-3"), PeerID(b"peer-4")], [*entries, *entries[:2]]
    elif case == "duplicate":
        peers[2] = peers[1]
    elif case == "our mode forged":
        entries[0] = gathered(None, AveragingMode.CLIENT)
    elif case == "bad bandwidth":
        entries[1] = gathered(float("nan"), AveragingMode.NODE)
    else:
        entries[2] = b"\xc1"
    with pytest.raises(GroupRefused):
        vet(peers, entries)


def admitted_entry(key: bytes | None, peer: PeerID) -> bytes:
    user_data = {"r": 1, **({"admit": make_proof(key, str(peer))} if key else {})}
    return MSGPackSerializer.dumps([None, AveragingMode.NODE.value, MSGPackSerializer.dumps(user_data)])


def test_in_a_private_swarm_every_member_of_a_group_must_prove_the_key():
    key = admission_key(b"swarm")
    group = vet(PEERS, [admitted_entry(key, peer) for peer in PEERS], admission=key)
    assert group.peer_ids == tuple(PEERS)
    for entries in ([*[admitted_entry(key, p) for p in PEERS[:2]], admitted_entry(None, PEERS[2])],  # no proof
                    [*[admitted_entry(key, p) for p in PEERS[:2]], admitted_entry(key, PEERS[0])],  # someone else's
                    [*[admitted_entry(key, p) for p in PEERS[:2]], admitted_entry(admission_key(b"x"), PEERS[2])]):
        with pytest.raises(GroupRefused, match="did not prove the swarm key"):
            vet(PEERS, entries, admission=key)
    assert gathered_proof(MSGPackSerializer, admitted_entry(key, PEERS[1])) == make_proof(key, str(PEERS[1]))
    assert gathered_proof(MSGPackSerializer, b"\xc1") is None
    vet(PEERS, [admitted_entry(None, peer) for peer in PEERS])  # a public swarm asks for nothing


# -- matchmaking: a group reaches its followers before they give up ----------------------------------

def test_after_the_scheduled_time_a_search_ends_a_margin_before_the_deadline():
    """hivemind declares min(max(S, now + 3), deadline): past S that is the deadline itself, when
    followers give up. Ours leaves the margin for the leader's answer, and stops once it is past."""
    expiration = functools.partial(matchmaking.declared_expiration, scheduled_time=100.0,
                                   min_matchmaking_time=3.0, search_end=106.0, margin=2.0)
    assert expiration(90.0) == 100.0  # the first search: hivemind's own expiration, the scheduled time
    assert expiration(98.0) == 101.0  # a late start: now + min_matchmaking_time
    assert expiration(101.0) == 104.0  # a second search after S: hivemind would say 104 too...
    assert expiration(102.5) == 104.0  # ...but here it would say 106, the followers' deadline
    assert expiration(104.0) is None and expiration(105.9) is None  # too late to lead a group
    # Never before the scheduled time, whatever the margin: the first search is hivemind's.
    assert matchmaking.declared_expiration(99.0, scheduled_time=100.0, min_matchmaking_time=3.0,
                                                search_end=101.0, margin=2.0) == 100.0


class RecordingKeys:
    current_key = "prefix.0b0"

    def __init__(self):
        self.declared = []

    async def declare_averager(self, key, peer_id, expiration_time, looking_for_group=True):
        self.declared.append((expiration_time, looking_for_group))
        return True

    async def update_key_on_not_enough_peers(self):
        pass


def test_the_search_declares_our_expiration_and_withdraws_it():
    from hivemind.utils import get_dht_time

    async def declare(scheduled_in: float, deadline_in: float, run_s: float):
        now = get_dht_time()
        leaders = PotentialLeaders(PeerID(b"\x12\x20" + bytes(32)), 3.0, None)
        leaders.__class__ = matchmaking.ShoalPotentialLeaders
        leaders.margin = 2.0
        leaders.search_end_time = now + deadline_in
        leaders.running.set()
        keys = RecordingKeys()
        step = types.SimpleNamespace(scheduled_time=now + scheduled_in)
        task = asyncio.create_task(leaders._declare_averager_periodically(step, keys))
        await asyncio.sleep(run_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return now, keys.declared

    # After the scheduled time: declared to end 2 s before the deadline (hivemind: at it), then withdrawn.
    now, declared = asyncio.run(declare(scheduled_in=-1.0, deadline_in=2.3, run_s=0.6))
    assert declared[0][1] and declared[0][0] == pytest.approx(now + 0.3, abs=0.05)
    assert declared[-1][1] is False and all(e <= now + 0.3 + 1e-6 for e, _ in declared)
    # Too late to lead a group: nothing is declared at all.
    _, declared = asyncio.run(declare(scheduled_in=-1.0, deadline_in=1.5, run_s=0.2))
    assert declared == []


class RefusingLeaders:
    """A DHT that always names the same declared leader, who turns us away: the search of a peer
    the swarm has banned (or of one whose every leader is in another group)."""

    current_key = "prefix.0b0"

    def __init__(self, leader: PeerID, expiration: float):
        self.leader, self.expiration, self.fetches = leader, expiration, 0

    async def get_averagers(self, key, only_active=True):
        self.fetches += 1
        await asyncio.sleep(0)
        return [(self.leader, self.expiration)]


def test_a_search_whose_leaders_all_refused_fetches_them_at_a_paced_rate():
    from hivemind.utils import get_dht_time

    async def search(seconds: float) -> tuple[int, int]:
        now = get_dht_time()
        leaders = PotentialLeaders(PeerID(b"\x12\x20" + bytes(32)), 3.0, None)
        leaders.__class__ = matchmaking.ShoalPotentialLeaders
        leaders.search_end_time = now + seconds
        leaders.running.set()
        dht = RefusingLeaders(PeerID(b"\x12\x20" + bytes([1] * 32)), now + 5.0)
        pops = 0

        async def ask_each_leader():  # hivemind's _request_join_potential_leaders, every answer a no
            nonlocal pops
            while True:
                await leaders.pop_next_leader()
                pops += 1

        tasks = [asyncio.create_task(leaders._update_queue_periodically(dht)), asyncio.create_task(ask_each_leader())]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return dht.fetches, pops

    fetches, pops = asyncio.run(search(1.0))
    # hivemind's loop: ~13,000 fetches in this second (each a DHT get that queries other peers).
    assert pops == 1  # the leader was asked once; its unchanged declaration is not asked again
    assert 2 <= fetches <= 1.0 / matchmaking.REFETCH_S + 2
