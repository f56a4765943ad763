"""Progress records: round trip, every malformed variant refused, DHT answers read safely."""

from __future__ import annotations

import dataclasses
import math

import base58
import msgpack
import pytest
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

from protocols.messages import MAX_ROUND, MessageError
from protocols.progress import (
    MAX_RATE,
    MAX_TEXT,
    PROGRESS_VERSION,
    ProgressRecord,
    SwarmSummary,
    SwarmThroughput,
    decode,
    encode,
    peer_id_from_subkey,
    read_records,
)

ED25519_ID = "12D3KooWNSgyp7Jk9sKE6bQqBHmCKDCX6ayX3cFHpLdcFWUy56Sd"
RSA_ID = "QmTXBvkP4c7dTFVHy1zWMn2p2GvS6hUgSjtFQyJSTJwmv6"
NOW = 1_700_000_000.0


def record(peer_id: str = ED25519_ID, **changes) -> ProgressRecord:
    base = ProgressRecord(
        peer_id=peer_id, round=12, tokens_per_s=5120.5, loss=3.25, eval_loss=3.5, device="cuda:0 (RTX 4090)",
        utilization=0.93, bytes_sent=10_000_000, bytes_received=9_000_000, mode="full", version="0.1.0",
        tokens=1_234_567, time=NOW - 1.0, phase="training",
    )
    return dataclasses.replace(base, **changes)


def encoded(**changes) -> dict:
    value = encode(record())
    value.update(changes)
    return value


def subkey(peer_id: str) -> bytes:
    return PeerID.from_base58(peer_id).to_bytes()


def test_round_trip_through_msgpack():
    original = record()
    value = encode(original)
    assert "peer_id" not in value and value["v"] == PROGRESS_VERSION
    assert len(msgpack.packb(value)) < 300  # small: every peer stores one every few seconds
    assert decode(ED25519_ID, msgpack.unpackb(msgpack.packb(value))) == original


def test_optional_losses_and_bounds_are_inclusive():
    extreme = record(loss=None, eval_loss=None, round=MAX_ROUND, utilization=1.0, tokens_per_s=0.0,
                     tokens=0, bytes_sent=0, device="x" * MAX_TEXT, mode="relay")
    assert decode(ED25519_ID, encode(extreme)) == extreme


def test_an_int_where_a_float_is_expected_is_accepted():
    # msgpack keeps 0.0 a float, but another implementation may send 0 for a rate.
    assert decode(ED25519_ID, encoded(tokens_per_s=7, utilization=1)).tokens_per_s == 7.0


def test_the_shard_claim_round_trips_and_is_optional():
    assert decode(ED25519_ID, encode(record(shard=5))).shard == 5
    assert "shard" not in encode(record()) and decode(ED25519_ID, encode(record())).shard is None  # older peers
    for bad in (-1, 2**16, "3", 2.5, True):
        with pytest.raises(MessageError, match="shard"):
            decode(ED25519_ID, encoded(shard=bad))


def test_unknown_keys_are_ignored():
    assert decode(ED25519_ID, encoded(gpu_temp=71)) == record()


@pytest.mark.parametrize("value", [None, [], "record", b"record", 7, [("v", 1)]])
def test_a_non_map_is_refused(value):
    with pytest.raises(MessageError, match="not a map"):
        decode(ED25519_ID, value)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"v": 2}, "version"),
        ({"v": None}, "version"),
        ({"round": -1}, "round"),
        ({"round": MAX_ROUND + 1}, "round"),
        ({"round": 3.0}, "round"),
        ({"round": True}, "round"),
        ({"round": None}, "round"),
        ({"tokens_per_s": -0.5}, "tokens_per_s"),
        ({"tokens_per_s": math.nan}, "tokens_per_s"),
        ({"tokens_per_s": math.inf}, "tokens_per_s"),
        ({"tokens_per_s": 1e13}, "tokens_per_s"),
        ({"tokens_per_s": "fast"}, "tokens_per_s"),
        ({"tokens_per_s": None}, "tokens_per_s"),
        ({"loss": math.nan}, "loss"),
        ({"loss": -1.0}, "loss"),
        ({"loss": "3.2"}, "loss"),
        ({"eval_loss": math.inf}, "eval_loss"),
        ({"eval_loss": False}, "eval_loss"),
        ({"utilization": 1.01}, "utilization"),
        ({"utilization": -0.01}, "utilization"),
        ({"bytes_sent": -1}, "bytes_sent"),
        ({"bytes_sent": 2**63}, "bytes_sent"),
        ({"bytes_received": 1.5}, "bytes_received"),
        ({"tokens": -5}, "tokens"),
        ({"tokens": "many"}, "tokens"),
        ({"time": math.nan}, "time"),
        ({"time": -1.0}, "time"),
        ({"time": None}, "time"),
        ({"device": 7}, "device"),
        ({"device": "x" * (MAX_TEXT + 1)}, "device"),
        ({"device": "\x1b[2J\x1b[31mowned"}, "device"),  # terminal escape sequences
        ({"device": "cpu\nfake line"}, "device"),
        ({"device": None}, "device"),
        ({"version": b"0.1.0"}, "version"),
        ({"phase": "x" * 1000}, "phase"),
        ({"mode": "server"}, "mode"),
        ({"mode": None}, "mode"),
    ],
)
def test_every_malformed_field_is_refused(changes, needle):
    with pytest.raises(MessageError, match=needle):
        decode(ED25519_ID, encoded(**changes))


@pytest.mark.parametrize("missing", sorted(set(encode(record())) - {"loss", "eval_loss"}))
def test_a_missing_required_field_is_refused(missing):
    value = encode(record())
    del value[missing]
    with pytest.raises(MessageError):
        decode(ED25519_ID, value)


def test_subkeys_must_be_peer_ids():
    assert peer_id_from_subkey(subkey(ED25519_ID)) == ED25519_ID
    assert peer_id_from_subkey(subkey(RSA_ID)) == RSA_ID
    for bad in ("12D3KooW", b"", b"\x00\x05hello", b"\x12\x20" + b"x" * 31, b"\x12\x20" + b"x" * 100, 42, None):
        with pytest.raises(MessageError):
            peer_id_from_subkey(bad)


def entry(value, expiration: float = NOW + 10) -> ValueWithExpiration:
    return ValueWithExpiration(value, expiration)


def test_read_records_keeps_valid_drops_expired_and_counts_malformed():
    good_rsa = record(RSA_ID, round=13, device="cpu")
    found = {
        subkey(ED25519_ID): entry(encode(record())),
        subkey(RSA_ID): entry(encode(good_rsa)),
        # a peer that left: expired, so neither kept nor counted as malformed
        b"\x12\x20" + bytes(range(32)): entry(encode(record()), expiration=NOW - 0.001),
        # malformed: each counted once
        b"\x12\x20" + bytes(range(1, 33)): entry(encoded(tokens_per_s=math.nan)),
        b"\x12\x20" + bytes(range(2, 34)): entry({"round": 3, "loss": 2.0}),  # an old-style heartbeat
        b"\x00\x05hello": entry(encode(record())),  # not a peer id
        "12D3KooW-as-text": entry(encode(record())),  # subkey of the wrong type
        b"\x12\x20" + bytes(range(3, 35)): encode(record()),  # not a ValueWithExpiration
        b"\x12\x20" + bytes(range(4, 36)): entry(encode(record()), expiration="later"),
    }
    records, malformed = read_records(found, NOW)
    assert records == {ED25519_ID: record(), RSA_ID: good_rsa}
    assert malformed == 6


def test_read_records_of_nothing_or_a_plain_value():
    assert read_records(None, NOW) == ({}, 0)
    assert read_records({}, NOW) == ({}, 0)
    assert read_records(["not", "subkeyed"], NOW) == ({}, 1)


def test_an_entry_expiring_exactly_now_is_still_live():
    found = {subkey(ED25519_ID): entry(encode(record()), expiration=NOW)}
    assert list(read_records(found, NOW)[0]) == [ED25519_ID]
    assert read_records(found, NOW + 1e-3) == ({}, 0)


def test_swarm_summary():
    other = base58.b58encode(b"\x12\x20" + bytes(32)).decode()
    third = base58.b58encode(b"\x12\x20" + bytes(range(32))).decode()
    records = [
        record(ED25519_ID, round=12, tokens_per_s=1000.0, tokens=10, loss=3.0, eval_loss=None),
        record(other, round=12, tokens_per_s=3000.0, tokens=20, loss=2.0, eval_loss=2.5),
        record(third, round=13, tokens_per_s=0.0, tokens=0, loss=None, eval_loss=3.5),
    ]
    summary = SwarmSummary.of(records)
    assert summary.peers == 3 and summary.tokens_per_s == 4000.0 and summary.tokens == 30
    assert summary.round == 12  # most peers are in 12, one in 13
    assert summary.loss == pytest.approx(2.5) and summary.eval_loss == pytest.approx(3.0)
    # this peer's share, from its record's rate: SwarmThroughput's
    assert SwarmThroughput.of(records, me=ED25519_ID).share == pytest.approx(0.25)
    assert SwarmThroughput.of(records, me="someone-else").share == 0.0  # an outsider adds nothing


def test_swarm_summary_round_ties_go_to_the_latest_and_empty_is_none():
    other = base58.b58encode(b"\x12\x20" + bytes(32)).decode()
    summary = SwarmSummary.of([record(round=4), record(other, round=5)])
    assert summary.round == 5
    empty = SwarmSummary.of([])
    assert (empty.peers, empty.tokens_per_s, empty.round, empty.loss) == (0, 0.0, None, None)
    assert SwarmThroughput.of([], me=ED25519_ID).share is None
    idle = SwarmThroughput.of([record(tokens_per_s=0.0)], me=ED25519_ID)
    assert idle.share is None  # nothing measured yet: no share rather than a division by zero


def test_swarm_throughput_puts_this_peers_live_rate_beside_the_others_records():
    other = base58.b58encode(b"\x12\x20" + bytes(32)).decode()
    records = [record(ED25519_ID, tokens_per_s=1000.0), record(other, tokens_per_s=3000.0),
               record(RSA_ID, tokens_per_s=0.0, phase="joining")]  # a joiner is online, adds nothing yet
    rate = SwarmThroughput.of(records, me=ED25519_ID, mine=1500.0)
    assert (rate.mine, rate.others, rate.other_peers, rate.total) == (1500.0, 3000.0, 2, 4500.0)
    assert rate.share == pytest.approx(1 / 3)
    # without a live figure, our own record's (a heartbeat late); the view of an outsider: all are others
    assert SwarmThroughput.of(records, me=ED25519_ID).total == 4000.0
    assert SwarmThroughput.of(records, me="an-outsider") == SwarmThroughput(mine=0.0, others=4000.0, other_peers=3)
    # alone, or before anything was measured
    assert SwarmThroughput.of([record(ED25519_ID)], me=ED25519_ID, mine=800.0) == \
        SwarmThroughput(mine=800.0, others=0.0, other_peers=0)
    assert SwarmThroughput.of([], me=ED25519_ID, mine=0.0).share is None


def test_swarm_throughput_counts_live_peers_only_and_refuses_what_is_not_a_rate():
    """Expired records drop out; a record without a rate, or with a NaN or absurd one, is
    malformed: counted, left out of the sum, never shown."""
    live = base58.b58encode(b"\x12\x20" + bytes(32)).decode()
    found = {
        subkey(ED25519_ID): entry(encode(record(tokens_per_s=1000.0))),
        subkey(live): entry(encode(record(live, tokens_per_s=3000.0))),
        b"\x12\x20" + bytes(range(32)): entry(encode(record(tokens_per_s=9000.0)), expiration=NOW - 0.001),
        b"\x12\x20" + bytes(range(1, 33)): entry(encoded(tokens_per_s=1e30)),
        b"\x12\x20" + bytes(range(2, 34)): entry(encoded(tokens_per_s=math.nan)),
        b"\x12\x20" + bytes(range(3, 35)): entry(encoded(tokens_per_s=-1.0)),
        b"\x12\x20" + bytes(range(4, 36)): entry({k: v for k, v in encoded().items() if k != "tokens_per_s"}),
    }
    records, malformed = read_records(found, NOW)
    assert sorted(records) == sorted([ED25519_ID, live]) and malformed == 4
    rate = SwarmThroughput.of(records.values(), me=ED25519_ID, mine=1200.0)
    assert (rate.total, rate.other_peers) == (4200.0, 1)
    # the most one stranger's record can add is MAX_RATE
    assert read_records({subkey(live): entry(encoded(tokens_per_s=MAX_RATE))}, NOW)[0][live].tokens_per_s == MAX_RATE
    assert read_records({subkey(live): entry(encoded(tokens_per_s=MAX_RATE * 1.01))}, NOW) == ({}, 1)


def test_per_round_bytes_round_trip_and_older_records_lack_them():
    newer = record(round_bytes_sent=1_500_000, round_bytes_received=1_400_000)
    value = msgpack.unpackb(msgpack.packb(encode(newer)), raw=False)
    assert decode(ED25519_ID, value) == newer
    assert {"bytes_sent", "bytes_received"} <= set(value)  # the cumulative counts keep their names
    older = encode(record())
    assert "round_bytes_sent" not in older  # nothing new is written when unknown
    assert decode(ED25519_ID, older).round_bytes_sent is None


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, True, "12"])
def test_a_malformed_per_round_byte_count_is_refused(bad):
    value = encode(record(round_bytes_sent=1))
    value["round_bytes_sent"] = bad
    with pytest.raises(MessageError, match="round_bytes_sent"):
        decode(ED25519_ID, value)


def test_sync_lateness_round_trips_and_older_records_lack_it():
    newer = record(sync_late_s=14.5)
    assert decode(ED25519_ID, msgpack.unpackb(msgpack.packb(encode(newer)), raw=False)) == newer
    assert "sync_late_s" not in encode(record())
    assert decode(ED25519_ID, encode(record())).sync_late_s is None


@pytest.mark.parametrize("bad", [float("nan"), 1e9, -1e9, "3", True])
def test_a_malformed_sync_lateness_is_refused(bad):
    value = encode(record(sync_late_s=1.0))
    value["sync_late_s"] = bad
    with pytest.raises(MessageError, match="sync_late_s"):
        decode(ED25519_ID, value)


def test_outer_steps_applied_round_trip_and_older_records_lack_them():
    newer = record(rounds_done=7)
    assert decode(ED25519_ID, msgpack.unpackb(msgpack.packb(encode(newer)), raw=False)) == newer
    assert "rounds_done" not in encode(record())
    assert decode(ED25519_ID, encode(record(rounds_done=0))).rounds_done == 0


@pytest.mark.parametrize("bad", [-1, 2**60, 1.5, "3", True])
def test_a_malformed_outer_step_count_is_refused(bad):
    value = encode(record(rounds_done=1))
    value["rounds_done"] = bad
    with pytest.raises(MessageError, match="rounds_done"):
        decode(ED25519_ID, value)


def test_the_sub_group_count_round_trips_and_older_records_lack_it():
    newer = record(group_count=16)
    assert decode(ED25519_ID, msgpack.unpackb(msgpack.packb(encode(newer)), raw=False)) == newer
    assert "group_count" not in encode(record())


@pytest.mark.parametrize("bad", [0, 3, 2048, -2, 1.0, "4", True])
def test_a_group_count_that_is_not_a_power_of_two_up_to_1024_is_refused(bad):
    value = encode(record(group_count=2))
    value["group_count"] = bad
    with pytest.raises(MessageError, match="group_count"):
        decode(ED25519_ID, value)


def test_the_progress_key_count_round_trips_and_a_bad_one_is_refused():
    """An auto-sharded run's record names the key count its writer uses (readers follow it)."""
    newer = record(progress_shards=8)
    assert decode(ED25519_ID, msgpack.unpackb(msgpack.packb(encode(newer)), raw=False)) == newer
    assert "progress_shards" not in encode(record())
    for bad in (0, 3, 128, 1.0, "4", True):
        value = {**encode(newer), "progress_shards": bad}
        with pytest.raises(MessageError, match="progress_shards"):
            decode(ED25519_ID, value)
