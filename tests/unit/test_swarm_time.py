"""Swarm time: the offset estimate on samples alone, the rebinding of hivemind's clock in every
process, hivemind's bootstrap refusal read, and the offset in progress records and views."""

import multiprocessing
import sys
import time
import types

import pytest

from protocols import progress, swarm_time
from protocols.swarm_time import ClockSample, describe_offset, estimate_offset


def sample(peer: str, offset: float, rtt: float = 0.01, at: float = 1.7e9) -> ClockSample:
    return ClockSample(peer=peer, sent=at, remote=at + rtt / 2 + offset, received=at + rtt)


def test_cristian_offset_and_error():
    s = ClockSample(peer="a", sent=100.0, remote=105.2, received=100.4)
    assert s.offset == pytest.approx(5.0) and s.error == pytest.approx(0.2)


def test_one_fast_clock_moves_only_itself():
    # Peers b, c, d agree; a's clock is 1 s fast. a sees the others 1 s behind it, they see a ahead.
    # Before its first fix a jumps to them; settled, it walks there MAX_STEP_S a probe.
    assert estimate_offset([sample(p, -1.0) for p in "bcd"], current=0.0, settled=False) == pytest.approx(-1.0)
    assert estimate_offset([sample(p, -1.0) for p in "bcd"], current=0.0) == pytest.approx(-swarm_time.MAX_STEP_S)
    assert estimate_offset([sample("a", +1.0), sample("c", 0.0), sample("d", 0.0)], current=0.0) == 0.0


def test_two_peers_meet_halfway_and_then_stay():
    first = estimate_offset([sample("b", 0.4)], current=0.0)
    assert first == pytest.approx(0.2)
    # b moved by -0.2 (halfway from its side): its swarm time is ours now (our raw clock + 0.2), and
    # nothing moves any more.
    assert estimate_offset([sample("b", first)], current=first) == first


def test_a_few_liars_cannot_move_an_honest_peer_far():
    honest = [sample(p, 0.0) for p in "bcde"]
    liars = [sample("x", 500.0), sample("y", 900.0)]
    assert abs(estimate_offset(honest + liars, current=0.0)) < swarm_time.DEADBAND_S
    # Many samples from one liar count once.
    assert estimate_offset(honest[:2] + [sample("x", 500.0, at=1.7e9 + k) for k in range(20)], current=0.0) == 0.0


def test_peers_that_disagree_move_nobody_and_a_settled_offset_moves_slowly():
    """The audit's attack, on the estimate alone: liars answering +3000 s that are half the peers
    measured (no majority agrees) move nothing, before the first fix or after; a majority of liars
    (only peers that averaged with us are measured, so they paid for it) moves a settled peer
    MAX_STEP_S a probe, not an hour."""
    split = [sample("b", 0.0), sample("c", 0.0), sample("x", 3000.0), sample("y", 3000.0)]
    assert estimate_offset(split, current=0.0, settled=False) is None
    assert estimate_offset(split, current=0.0) is None
    spread = [sample("x", 3000.0), sample("y", -3000.0), sample("z", 5.0)]  # a different lie to each
    assert estimate_offset(spread, current=0.0) is None
    majority = [sample("b", 0.0), sample("x", 3000.0), sample("y", 3000.0)]
    assert estimate_offset(majority, current=0.0) == pytest.approx(swarm_time.MAX_STEP_S)
    assert estimate_offset([], current=0.3) is None


def test_the_most_precise_ping_of_a_peer_wins_and_bad_ones_are_dropped():
    noisy = [sample("b", 3.0, rtt=1.5), sample("b", 2.0, rtt=0.02)]  # the 20 ms one is believed
    assert estimate_offset(noisy + [sample("c", 2.0)], current=0.0, settled=False) == pytest.approx(2.0)
    slow = ClockSample(peer="b", sent=0.0, remote=50.0, received=5.0)  # a 5 s round trip
    backwards = ClockSample(peer="c", sent=10.0, remote=50.0, received=9.0)
    nan = ClockSample(peer="d", sent=0.0, remote=float("nan"), received=0.01)
    assert estimate_offset([slow, backwards, nan], current=0.3) is None


def test_jitter_under_the_deadband_is_ignored_and_offsets_are_bounded():
    assert estimate_offset([sample("b", 0.02), sample("c", 0.03)], current=0.0) == 0.0
    huge = [sample(p, 1e6) for p in "bcd"]
    assert estimate_offset(huge, current=0.0, settled=False) == swarm_time.MAX_OFFSET_S
    with pytest.raises(ValueError):
        swarm_time.set_offset(float("inf"))


def test_describe_offset_names_the_side_and_the_fix():
    assert describe_offset(0.4, 3) is None
    ahead = describe_offset(-5.04, 3)
    assert "5.0s ahead of the swarm's" in ahead and "NTP" in ahead and "\n" not in ahead
    assert "behind" in describe_offset(2.0, 1)


@pytest.fixture
def offset():
    yield swarm_time.set_offset
    swarm_time.set_offset(0.0)


def test_install_rebinds_get_dht_time_everywhere_and_forked_children_follow(offset):
    import hivemind.averaging.matchmaking as matchmaking
    import hivemind.dht.protocol as dht_protocol
    import hivemind.utils as utils

    fake = types.ModuleType("shoal_test_fake")
    fake.get_dht_time = time.time
    sys.modules[fake.__name__] = fake
    try:
        assert swarm_time.install() >= 1
        for module in (utils, dht_protocol, matchmaking, fake):
            assert module.get_dht_time is swarm_time.now
        assert swarm_time.install() == 0  # idempotent
        offset(30.0)
        assert dht_protocol.get_dht_time() - time.time() == pytest.approx(30.0, abs=0.5)
        # A child forked before an update sees the update (the offset is shared memory).
        ready, seen = multiprocessing.get_context("fork").Event(), multiprocessing.get_context("fork").Queue()
        child = multiprocessing.get_context("fork").Process(
            target=_report_offset, args=(ready, seen), daemon=True)
        child.start()
        offset(-7.5)
        ready.set()
        assert seen.get(timeout=10) == pytest.approx(-7.5, abs=0.5)
        child.join(timeout=10)
    finally:
        del sys.modules[fake.__name__]


def _report_offset(ready, seen) -> None:
    import hivemind.dht.protocol as dht_protocol

    ready.wait(10)
    seen.put(dht_protocol.get_dht_time() - time.time())


def test_hivemind_bootstrap_refusal_gives_the_skew():
    from node.library.dht import bootstrap_skew

    reason = ("ValidationError: local time must be within 3 seconds  of others(local: 1764806400.12500, "
              "peer: 1764806395.00000)")
    assert bootstrap_skew(reason) == pytest.approx(-5.125)
    assert bootstrap_skew("DHTNode bootstrap failed: none of the initial_peers responded to a ping.") is None


def test_the_offset_travels_in_progress_records_and_is_bounded():
    from protocols.messages import MessageError

    record = progress.ProgressRecord(peer_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", round=3,
                                     tokens_per_s=1.0, loss=None, eval_loss=None, device="cpu", utilization=0.5,
                                     bytes_sent=0, bytes_received=0, mode="full", version="1", tokens=0, time=1e9,
                                     phase="training", clock_offset_s=-5.0)
    encoded = progress.encode(record)
    assert progress.decode(record.peer_id, encoded).clock_offset_s == -5.0
    assert progress.decode(record.peer_id, {k: v for k, v in encoded.items() if k != "clock_offset_s"}).clock_offset_s is None
    with pytest.raises(MessageError, match="clock_offset_s"):
        progress.decode(record.peer_id, {**encoded, "clock_offset_s": 1e9})
