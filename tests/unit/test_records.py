"""DHT record validation on crafted records: every attack of the hostile-swarm issue is refused,
honest records pass, and the signatures are stripped before the application sees a value."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
from hivemind.dht import protocol as dht_protocol
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import timed_storage
from hivemind.utils.serializer import MSGPackSerializer

from node.library import run_record
from node.library.local_network import LocalNetwork, LocalSwarmHub
from node.library.run_record import ADOPT_PERIOD_S, RunTrust, converge, join_run
from protocols import progress, records
from protocols.errors import ConfigError
from protocols.identity import PeerKey, RunKey, format_run_key, parse_run_key, peer_id_of
from protocols.keys import MAX_PROGRESS_SHARDS, peers_key, run_key
from protocols.manifest import RunManifest, decode_signed
from protocols.progress import ProgressRecord

NOW = 1.7e9
RUN = "run-1"
HONEST, ATTACKER = PeerKey.generate(), PeerKey.generate()
ORGANISER, STRANGER = RunKey.generate(), RunKey.generate()
PEERS_ID = DHTID.generate(source=peers_key(RUN)).to_bytes()
RUN_ID = DHTID.generate(source=run_key(RUN)).to_bytes()


def validator(identity: PeerKey = HONEST, **kwargs) -> records.ShoalRecordValidator:
    return records.ShoalRecordValidator([RUN], identity, clock=lambda: NOW, **kwargs)


def beat(**changes) -> dict:
    record = ProgressRecord(peer_id="x", round=3, tokens_per_s=10.0, loss=2.0, eval_loss=None, device="cpu",
                            utilization=0.5, bytes_sent=1, bytes_received=2, mode="full", version="0.1",
                            tokens=100, time=NOW, phase="training")
    return {**progress.encode(record), **changes}


def the_manifest(start: float = NOW - 100, key: RunKey = ORGANISER) -> dict:
    return RunManifest.create(RUN, {"model.d_model": 64}, start_time=start, round_seconds=10.0).signed_by(key).signed_value()


def stored(value, *, by: PeerKey = HONEST, key: bytes = PEERS_ID, subkey_owner: PeerKey | None = None,
           expiration: float = NOW + 15) -> DHTRecord:
    """A record as ``by`` would sign and send it, under ``subkey_owner``'s subkey (default: its own)."""
    owner = subkey_owner or by
    record = DHTRecord(key, MSGPackSerializer.dumps(owner.public), MSGPackSerializer.dumps(value), expiration)
    signer = validator(by)
    if subkey_owner is not None:  # sign as ``by`` although the subkey names somebody else
        signer._own_subkey = record.subkey
    return dataclasses.replace(record, value=signer.sign_value(record))


def test_the_peer_id_of_a_subkey_is_the_one_libp2p_derives_from_the_identity():
    assert peer_id_of(HONEST.public) == PeerID.from_identity(HONEST.identity_bytes()).to_base58()


def test_an_honest_progress_record_passes_and_is_stripped_to_its_value():
    record = stored(beat())
    check = validator(ATTACKER)  # any node, not only the owner
    assert check.validate(record)
    assert MSGPackSerializer.loads(check.strip_value(record)) == beat()


def test_a_record_under_somebody_elses_subkey_is_refused():
    assert not validator().validate(stored(beat(), by=ATTACKER, subkey_owner=HONEST))


def test_an_unsigned_record_is_refused():
    record = DHTRecord(PEERS_ID, MSGPackSerializer.dumps(HONEST.public), MSGPackSerializer.dumps(beat()), NOW + 15)
    assert not validator().validate(record)


def test_a_signature_does_not_carry_over_to_a_later_expiration():
    record = stored(beat())
    assert not validator().validate(dataclasses.replace(record, expiration_time=record.expiration_time + 1))


def test_a_far_future_expiration_is_refused_even_when_signed():
    assert validator().validate(stored(beat(), expiration=NOW + records.MAX_PROGRESS_TTL))
    assert not validator().validate(stored(beat(), expiration=NOW + 10 * 365 * 86400))


def test_a_far_future_expiration_is_refused_on_any_key():
    other = DHTRecord(b"k" * 20, DHTProtocol.IS_REGULAR_VALUE, b"\x01", NOW + 10 * 365 * 86400)
    assert not validator().validate(other)
    assert validator().validate(dataclasses.replace(other, expiration_time=NOW + 30))


def test_a_plain_value_under_a_run_key_is_refused():
    for key in (RUN_ID, PEERS_ID):
        assert not validator().validate(DHTRecord(key, DHTProtocol.IS_REGULAR_VALUE, MSGPackSerializer.dumps(1),
                                                  NOW + 15))


def test_an_oversized_value_is_refused():
    assert not validator().validate(stored(beat(device="x" * 20_000)))


@pytest.mark.parametrize("bad", [{"round": -1}, {"mode": "god"}, {"v": 99}, {"device": "\x1b[2J"}])
def test_a_progress_record_that_breaks_the_schema_is_refused(bad):
    assert not validator().validate(stored(beat(**bad)))


def test_a_subkey_that_is_not_a_public_key_is_refused():
    fake = dataclasses.replace(stored(beat()), subkey=MSGPackSerializer.dumps(b"\x12\x20" + b"\x00" * 32))
    assert not validator().validate(fake)


def test_a_signed_manifest_passes_and_decodes_with_its_organiser():
    record = stored(the_manifest(), key=RUN_ID)
    check = validator()
    assert check.validate(record)
    decoded = decode_signed(MSGPackSerializer.loads(check.strip_value(record)))
    assert decoded.organiser == ORGANISER.public and decoded.start_time == NOW - 100


@pytest.mark.parametrize("start", [0.0, NOW + 3600])
def test_a_manifest_with_an_impossible_start_is_refused(start):
    assert not validator().validate(stored(the_manifest(start=start), key=RUN_ID))


def test_a_rewritten_manifest_fails_its_organiser_signature():
    value = the_manifest()
    value["manifest"] = {**value["manifest"], "start_time": NOW - 5000}
    assert not validator().validate(stored(value, key=RUN_ID))


def test_a_pinned_node_refuses_a_manifest_signed_by_another_key():
    record = stored(the_manifest(key=STRANGER), key=RUN_ID)
    assert validator().validate(record)  # unpinned: a valid manifest of some organiser
    assert not validator(pinned_run_key=ORGANISER.public).validate(record)
    assert validator(pinned_run_key=ORGANISER.public).validate(stored(the_manifest(), key=RUN_ID))


def test_the_swarm_key_seals_every_record_and_refuses_the_rest():
    ours = CompositeValidator([validator(), records.SwarmKeyValidator(b"k" * 32)])
    record = DHTRecord(PEERS_ID, MSGPackSerializer.dumps(HONEST.public), MSGPackSerializer.dumps(beat()), NOW + 15)
    sealed = dataclasses.replace(record, value=ours.sign_value(record))
    assert ours.validate(sealed)
    assert MSGPackSerializer.loads(ours.strip_value(sealed)) == beat()
    unsealed = dataclasses.replace(record, value=validator().sign_value(record))  # a peer without the key
    assert not ours.validate(unsealed)
    other_key = records.SwarmKeyValidator(b"j" * 32)
    assert not CompositeValidator([validator(), other_key]).validate(sealed) and other_key.sealed_seen == 1
    open_node = records.SwarmKeyValidator(None)
    assert not CompositeValidator([validator(), open_node]).validate(sealed) and open_node.sealed_seen == 1


def test_a_refusal_names_the_sender(caplog):
    token = records.STORE_SENDER.set("12D3KooWAttacker")
    try:
        validator().validate(stored(beat(), by=ATTACKER, subkey_owner=HONEST))
    finally:
        records.STORE_SENDER.reset(token)
    assert "refused a DHT record from 12D3KooWAttacker" in caplog.text


def test_the_hivemind_code_records_wraps_or_relies_on_is_the_reviewed_code():
    assert records.hivemind_changes() == []


def test_a_run_key_round_trips_through_its_text_and_bad_text_is_one_line():
    assert parse_run_key(format_run_key(ORGANISER.public)) == ORGANISER.public
    with pytest.raises(ConfigError, match="--run-key"):
        parse_run_key("not-a-key")


# -- whose manifest a peer follows ---------------------------------------------------------------
def local_directory(hub: LocalSwarmHub, name: str):
    return LocalNetwork(hub, name).directory(RUN)


def ours(start: float = 1000.0) -> RunManifest:
    return RunManifest.create(RUN, {"model.d_model": 64}, start_time=start, round_seconds=10.0)


def test_a_pinned_joiner_ignores_another_organisers_manifest_and_follows_its_own():
    hub = LocalSwarmHub(clock=lambda: 2000.0)
    local_directory(hub, "attacker").publish_manifest(ours(1.0).signed_by(STRANGER), ttl=600)
    local_directory(hub, "organiser").publish_manifest(ours(1500.0).signed_by(ORGANISER), ttl=600)
    joined = join_run(local_directory(hub, "joiner"), ours(), record_ttl=600,
                      trust=RunTrust(pinned=ORGANISER.public, explicit=True), settle_s=0)
    assert joined.start_time == 1500.0 and joined.organiser == ORGANISER.public


def test_an_unpinned_joiner_refuses_to_guess_between_organisers():
    hub = LocalSwarmHub(clock=lambda: 2000.0)
    local_directory(hub, "attacker").publish_manifest(ours(1.0).signed_by(STRANGER), ttl=600)
    local_directory(hub, "organiser").publish_manifest(ours(1500.0).signed_by(ORGANISER), ttl=600)
    with pytest.raises(ConfigError, match="2 organisers.*--run-key"):
        join_run(local_directory(hub, "joiner"), ours(), record_ttl=600, trust=RunTrust(), settle_s=0,
                 sleep=lambda s: None)


def test_trust_on_first_use_is_saved_and_refuses_a_later_swap(tmp_path):
    hub = LocalSwarmHub(clock=lambda: 2000.0)
    local_directory(hub, "organiser").publish_manifest(ours(1500.0).signed_by(ORGANISER), ttl=600)
    join_run(local_directory(hub, "joiner"), ours(), record_ttl=600, trust=RunTrust(pin_file=tmp_path / "pin"))
    assert (tmp_path / "pin").read_bytes() == ORGANISER.public
    swapped = LocalSwarmHub(clock=lambda: 2000.0)
    local_directory(swapped, "attacker").publish_manifest(ours(1.0).signed_by(STRANGER), ttl=600)
    joined = join_run(local_directory(swapped, "joiner"), ours(1999.0), record_ttl=600,
                      trust=RunTrust(pin_file=tmp_path / "pin"), settle_s=0, sleep=lambda s: None)
    assert joined.organiser != STRANGER.public  # it organised instead of following the swap...
    assert (tmp_path / "pin").read_bytes() == joined.organiser  # ...and trusts its own key now


def test_a_new_organiser_converges_only_on_the_key_it_was_started_with_and_only_within_the_window():
    mine = ours(1000.0).signed_by(ORGANISER)
    near, far = ours(990.0).signed_by(STRANGER), ours(0.0).signed_by(STRANGER)
    later = ours(1030.0).signed_by(STRANGER)
    other_config = RunManifest.create(RUN, {"model.d_model": 128}, start_time=995.0, round_seconds=10.0)
    started_with_stranger = lambda: RunTrust(pinned=STRANGER.public, organised_at=1000.0)  # noqa: E731
    assert converge(mine, [near], started_with_stranger(), now=1001.0) == near
    assert converge(mine, [later], started_with_stranger(), now=1001.0) == later  # its holder never moves: we do
    assert converge(mine, [far], started_with_stranger(), now=1001.0) == mine  # start_time=0 moves nobody
    assert converge(mine, [other_config.signed_by(STRANGER)], started_with_stranger(), now=1001.0) == mine
    assert converge(mine, [near], started_with_stranger(), now=1000.0 + 61) == mine  # too late
    # A key met in the swarm: neither an organiser holding its own key nor a brand-new one follows it.
    assert converge(mine, [near], RunTrust(pinned=ORGANISER.public, organised_at=1000.0), now=1001.0) == mine
    assert converge(mine, [near], RunTrust(organised_at=1000.0), now=1001.0) == mine
    assert converge(mine, [near], RunTrust(pinned=ORGANISER.public, explicit=True, organised_at=1000.0),
                    now=1001.0) == mine  # --run-key: only manifests that key signed
    assert converge(mine, [near], RunTrust(pinned=STRANGER.public), now=1001.0) == mine  # a joiner never moves


def test_a_copy_moved_earlier_and_signed_by_another_key_never_captures_the_organiser(tmp_path):
    files = dict(pin_file=tmp_path / f"{RUN}.run-key", organiser_file=tmp_path / f"{RUN}.organiser.key")
    trust = RunTrust(**files)
    mine = join_run(local_directory(LocalSwarmHub(clock=lambda: 1000.0), "organiser"), ours(), record_ttl=600,
                    trust=trust)
    copy = mine.with_start(mine.start_time - 59).signed_by(STRANGER)
    assert converge(mine, [mine, copy], trust, now=1001.0) == mine
    assert trust.pinned == mine.organiser
    restarted = RunTrust(**files)  # the next start reads back what this one saved
    assert restarted.pinned == mine.organiser == restarted.our_key().public != STRANGER.public


def test_organisers_that_start_one_run_id_at_once_keep_their_runs_and_are_told_the_fix_once(caplog):
    a, b = RunTrust(), RunTrust()
    a_manifest = join_run(local_directory(LocalSwarmHub(clock=lambda: 1000.0), "a"), ours(), record_ttl=600, trust=a)
    b_manifest = join_run(local_directory(LocalSwarmHub(clock=lambda: 1000.5), "b"), ours(), record_ttl=600, trust=b)
    for _ in range(2):
        assert converge(a_manifest, [a_manifest, b_manifest], a, now=1002.0) == a_manifest
        assert converge(b_manifest, [a_manifest, b_manifest], b, now=1002.0) == b_manifest
    told = [r.getMessage() for r in caplog.records if "is also organised by" in r.getMessage()]
    assert len(told) == 2, told
    assert "another --run-id" in told[0] and f"--run-key {format_run_key(b_manifest.organiser)}" in told[0]


def test_of_two_peers_started_at_once_the_later_looks_again_and_joins_the_earlier():
    # Both find no manifest at their first look; the one whose pause ends later finds the other's.
    hub = LocalSwarmHub(clock=lambda: 1000.0)
    joined: dict[str, object] = {}
    ready = threading.Barrier(2)

    def start(name: str, pause_s: float) -> None:
        directory = local_directory(hub, name)
        ready.wait()
        joined[name] = join_run(directory, ours(), record_ttl=600, trust=RunTrust(),
                                sleep=lambda _: time.sleep(pause_s))

    threads = [threading.Thread(target=start, args=("early", 0.01)), threading.Thread(target=start, args=("late", 0.5))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert joined["early"] == joined["late"]  # before: each organised a run of its own


def test_a_peer_that_organised_goes_back_to_the_key_it_was_started_with(tmp_path):
    pin_file = tmp_path / f"{RUN}.run-key"
    pin_file.write_bytes(ORGANISER.public)  # trusted on first use, an earlier start
    trust = RunTrust(pin_file=pin_file)
    mine = join_run(local_directory(LocalSwarmHub(clock=lambda: 1000.0), "restarted"), ours(), record_ttl=600,
                    trust=trust)  # its organiser's manifest has not reached it yet: it organises
    assert mine.organiser != ORGANISER.public and pin_file.read_bytes() == mine.organiser
    theirs = ours(1004.0).signed_by(ORGANISER)
    assert converge(mine, [mine, theirs], trust, now=1005.0) == theirs
    assert pin_file.read_bytes() == ORGANISER.public


def test_an_envelope_is_small():
    assert len(msgpack.packb(stored(beat()).value)) < 1024


# -- one key, one identity; caps on what a node stores ---------------------------------------------
OTHER_KEY = DHTID.generate(source="shoal-run-1-outer.0b0101").to_bytes()  # a hivemind matchmaking key
STRANGER_PEER = SimpleNamespace(remote_id="12D3KooWStranger")  # the P2PContext of a store request


@pytest.fixture
def dht_time(monkeypatch):
    """hivemind's storages expire entries on ``get_dht_time``: run them on the validators' clock."""
    clock = [NOW]
    monkeypatch.setattr(timed_storage, "get_dht_time", lambda: clock[0])
    return clock


def a_node(check: records.ShoalRecordValidator | None = None) -> DHTProtocol:
    """The parts of a DHT node's protocol that ``rpc_store`` and ``call_find`` use, with the
    storages ``DHTProtocol.create`` builds once ``records.install`` ran."""
    records.install()
    node = object.__new__(DHTProtocol)
    node.storage, node.cache = dht_protocol.DHTLocalStorage(), dht_protocol.DHTLocalStorage()
    node.record_validator = CompositeValidator([check or validator(), records.SwarmKeyValidator(None)])
    node.node_info = dht_pb2.NodeInfo()
    return node


def rpc_store(node: DHTProtocol, *items: DHTRecord) -> list[bool]:
    request = dht_pb2.StoreRequest(keys=[r.key for r in items], subkeys=[r.subkey for r in items],
                                   values=[r.value for r in items], expiration_time=[r.expiration_time for r in items],
                                   in_cache=[False] * len(items))
    return list(asyncio.run(node.rpc_store(request, STRANGER_PEER)).store_ok)


def fill(node: DHTProtocol, key: bytes, count: int, *, size: int = 16, expiration: float = NOW + 60) -> None:
    """Junk subkeys, stored as if they had passed validation (the caps do not trust the validator)."""
    for i in range(count):
        assert node.storage.store_subkey(DHTID.from_bytes(key), f"junk-{i}".encode(), b"j" * size, expiration)


def test_one_rsa_key_gives_one_subkey():
    crafted = ATTACKER.public + b"\x18\x01"  # the same key with an unknown protobuf field: another peer id
    record = DHTRecord(PEERS_ID, MSGPackSerializer.dumps(crafted), MSGPackSerializer.dumps(beat()), NOW + 15)
    signer = validator(ATTACKER)
    signer._own_subkey = record.subkey
    assert not validator().validate(dataclasses.replace(record, value=signer.sign_value(record)))


def test_a_full_peers_key_refuses_new_peers_and_keeps_refreshing_its_own(dht_time):
    node = a_node()
    assert rpc_store(node, stored(beat(), expiration=NOW + 15)) == [True]
    fill(node, PEERS_ID, records.MAX_SUBKEYS - 1)
    assert rpc_store(node, stored(beat(), by=ATTACKER)) == [False]  # a new subkey: the key is full
    assert rpc_store(node, stored(beat(round=4), expiration=NOW + 20)) == [True]  # a refresh passes
    dht_time[0] = NOW + 61  # the junk expired: room again
    assert rpc_store(node, stored(beat(), by=ATTACKER, expiration=NOW + 70)) == [True]


def test_every_key_caps_its_subkeys_and_bytes(dht_time):
    node = a_node()
    fill(node, OTHER_KEY, records.MAX_SUBKEYS)
    averager = DHTRecord(OTHER_KEY, MSGPackSerializer.dumps(b"peer id"), MSGPackSerializer.dumps(True), NOW + 30)
    assert rpc_store(node, averager) == [False]
    other = DHTID.generate(source="another key").to_bytes()
    fill(node, other, records.MAX_KEY_BYTES // records.MAX_ANY_VALUE_BYTES - 1, size=records.MAX_ANY_VALUE_BYTES)
    assert rpc_store(node, dataclasses.replace(averager, key=other)) == [True]  # a small one still fits...
    big = dataclasses.replace(averager, key=other, subkey=MSGPackSerializer.dumps(b"p2"),
                              value=b"x" * records.MAX_ANY_VALUE_BYTES)
    assert rpc_store(node, big) == [False]  # ...a whole value no longer does: one get answer stays < 4 MiB


def test_a_value_over_the_cap_is_refused_under_any_key(dht_time):
    plain = DHTRecord(OTHER_KEY, DHTProtocol.IS_REGULAR_VALUE, b"x" * records.MAX_ANY_VALUE_BYTES, NOW + 30)
    assert validator().validate(plain)
    assert not validator().validate(dataclasses.replace(plain, value=plain.value + b"x"))
    assert rpc_store(a_node(), dataclasses.replace(plain, value=b"x" * 15 * 2**20)) == [False]


def test_a_full_storage_refuses_new_records_says_so_once_and_forgets_expired_ones(dht_time, caplog):
    node = a_node()
    assert rpc_store(node, stored(beat(), expiration=NOW + 10)) == [True]
    value = b"x" * records.MAX_ANY_VALUE_BYTES
    stored_ok = [node.storage.store(DHTID.generate(source=f"key {i}"), value, NOW + 30)
                 for i in range(records.MAX_STORAGE_BYTES // len(value) + 1)]
    assert not stored_ok[-1] and sum(stored_ok) > 400  # full after ~500 such values (32 MiB)...
    tiny = DHTID.generate(source="tiny")
    assert not all(node.storage.store_subkey(tiny, i, b"x", NOW + 30) for i in range(500))  # ...to the last byte
    addrs = [f"/ip4/203.0.113.{i}/tcp/31337/p2p/{HONEST.peer_id}" for i in range(8)]
    refreshed = stored(beat(round=4, addrs=addrs), expiration=NOW + 12)  # ~700 bytes more: within the headroom
    assert rpc_store(node, refreshed, stored(beat(), by=ATTACKER)) == [True, False]
    assert len([r for r in caplog.records if "storage is full" in r.getMessage()]) == 1  # 3 refusals, 1 line
    dht_time[0] = NOW + 31  # everything expired: nothing counts any more
    assert rpc_store(node, stored(beat(), expiration=NOW + 45)) == [True]


def test_hivemind_records_still_pass(dht_time):
    node = a_node()
    declared = DHTRecord(OTHER_KEY, MSGPackSerializer.dumps(b"\x00\x24" + b"p" * 36), MSGPackSerializer.dumps(True),
                         NOW + 30)
    state = DHTRecord(DHTID.generate(source="shoal-run-1-outer.all_averagers").to_bytes(), declared.subkey,
                      MSGPackSerializer.dumps(1.5), NOW + 30)
    assert rpc_store(node, declared, state, stored(beat())) == [True, True, True]


# -- whose manifest a node stores, and a get that survives a poisoned subkey ------------------------
def test_a_node_that_learns_the_organiser_later_refuses_another_organisers_manifest():
    clock = [NOW]
    check = records.ShoalRecordValidator([RUN], HONEST, clock=lambda: clock[0])
    theirs = stored(the_manifest(key=STRANGER), key=RUN_ID, by=ATTACKER)
    assert check.validate(theirs)
    check.follow_organiser(RUN, ORGANISER.public, open_until=NOW + 30)  # a new organiser may still converge
    assert check.validate(theirs)
    clock[0] = NOW + 31
    assert not check.validate(theirs)
    assert check.validate(stored(the_manifest(), key=RUN_ID))
    check.follow_organiser(RUN, STRANGER.public)  # it converged on the other organiser
    assert check.validate(theirs) and not check.validate(stored(the_manifest(), key=RUN_ID))


class DirectoryWithValidator:
    """An in-process directory that records what ``join_run`` tells its DHT validator."""

    def __init__(self, hub: LocalSwarmHub, name: str):
        self._local, self.told = local_directory(hub, name), []

    def __getattr__(self, name):
        return getattr(self._local, name)

    def follow_organiser(self, key: bytes, open_until: float | None) -> None:
        self.told.append((key, open_until))


def test_join_run_tells_the_validator_whose_manifests_to_store(tmp_path):
    hub = LocalSwarmHub(clock=lambda: 2000.0)
    organiser = DirectoryWithValidator(hub, "organiser")
    saved = RunKey.generate()  # the pin saved by an earlier session, whose manifest has not reached us yet
    (tmp_path / "pin").write_bytes(saved.public)
    trust = RunTrust(pin_file=tmp_path / "pin")
    mine = join_run(organiser, ours(), record_ttl=600, trust=trust, settle_s=0)
    assert mine.organiser != saved.public  # it organised...
    assert organiser.told == [(mine.organiser, 2000.0 + ADOPT_PERIOD_S)]  # ...open while it may converge
    theirs = ours(1999.0).signed_by(saved)
    assert converge(mine, [theirs], trust, now=2001.0) == theirs
    assert organiser.told[-1] == (saved.public, 2000.0 + ADOPT_PERIOD_S)
    joiner = DirectoryWithValidator(hub, "joiner")
    join_run(joiner, ours(), record_ttl=600, trust=RunTrust(), settle_s=0)
    assert joiner.told == [(mine.organiser, None)]  # a joiner never moves: closed at once


def test_the_pin_reaches_the_validator_in_the_dht_process():
    check = validator()
    node = SimpleNamespace(protocol=SimpleNamespace(record_validator=CompositeValidator(
        [check, records.SwarmKeyValidator(None)])))
    asyncio.run(run_record.follow_organiser_in_dht(None, node, run_id=RUN, key=ORGANISER.public, open_until=None))
    assert not check.validate(stored(the_manifest(key=STRANGER), key=RUN_ID))


def found(node: DHTProtocol, key: bytes, *items: DHTRecord):
    """What our ``call_find`` makes of a peer's answer holding these subkeys under ``key``."""
    answer = DictionaryDHTValue()
    for item in items:
        answer.store(MSGPackSerializer.loads(item.subkey), item.value, item.expiration_time)
    result = dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=MSGPackSerializer.dumps(answer),
                                expiration_time=answer.latest_expiration_time)

    class Peer:
        async def rpc_find(self, request, timeout=None):
            return dht_pb2.FindResponse(results=[result])

    node.get_stub, node.rpc_semaphore, node.wait_timeout = lambda peer: Peer(), asyncio.Semaphore(), 1.0
    key_id = DHTID.from_bytes(key)
    value, _nearest = asyncio.run(node.call_find(PeerID(b"\x12\x20" + b"\x01" * 32), [key_id]))[key_id]
    return None if value is None else {subkey: item.value for subkey, item in value.value.items()}


def test_a_get_keeps_the_good_subkeys_of_an_answer_with_a_poisoned_one(dht_time):
    joiner = a_node(validator(ATTACKER, pinned_run_key=ORGANISER.public))
    good = stored(the_manifest(), key=RUN_ID)
    poisoned = stored(the_manifest(key=STRANGER), key=RUN_ID, by=ATTACKER)  # stored by an unpinned node
    assert found(joiner, RUN_ID, good, poisoned) == {HONEST.public: good.value}
    junk = dataclasses.replace(poisoned, value=b"junk")
    assert found(joiner, RUN_ID, junk) is None  # nothing valid left: no answer, as before


def test_a_replicated_dictionary_keeps_its_good_subkeys(dht_time):
    node = a_node(validator(pinned_run_key=ORGANISER.public))
    answer = DictionaryDHTValue()
    for item in (stored(the_manifest(), key=RUN_ID), stored(the_manifest(key=STRANGER), key=RUN_ID, by=ATTACKER)):
        answer.store(MSGPackSerializer.loads(item.subkey), item.value, item.expiration_time)
    request = dht_pb2.StoreRequest(keys=[RUN_ID], subkeys=[DHTProtocol.IS_DICTIONARY],
                                   values=[MSGPackSerializer.dumps(answer)],
                                   expiration_time=[answer.latest_expiration_time], in_cache=[False])
    asyncio.run(node.rpc_store(request, STRANGER_PEER))
    kept = node.storage.get(DHTID.from_bytes(RUN_ID))
    assert kept is not None and [subkey for subkey, _ in kept.value.items()] == [HONEST.public]


def test_every_progress_shard_key_is_validated_like_the_one_key():
    """A sharded run (``averaging.progress_shards``) stores records under ``peers_key(run, shard)``:
    each such key is the progress kind, so a forged or unsigned record there is refused too."""
    last = DHTID.generate(source=peers_key(RUN, MAX_PROGRESS_SHARDS - 1)).to_bytes()
    assert validator(ATTACKER).validate(stored(beat(), key=last))
    assert not validator().validate(stored(beat(), by=ATTACKER, subkey_owner=HONEST, key=last))
    unsigned = DHTRecord(last, MSGPackSerializer.dumps(HONEST.public), MSGPackSerializer.dumps(beat()), NOW + 15)
    assert not validator().validate(unsigned)
