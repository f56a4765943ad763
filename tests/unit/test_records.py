"""DHT record validation on crafted records: every attack of the hostile-swarm issue is refused,
honest records pass, and the signatures are stripped before the application sees a value."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from node.library.local_network import LocalNetwork, LocalSwarmHub
from node.library.run_record import RunTrust, converge, join_run
from protocols import progress, records
from protocols.errors import ConfigError
from protocols.identity import PeerKey, RunKey, format_run_key, parse_run_key, peer_id_of
from protocols.keys import peers_key, run_key
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


def test_hivemind_rpc_store_is_the_reviewed_code():
    assert records.rpc_store_digest() == records.REVIEWED_RPC_STORE


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


def test_only_a_new_organiser_converges_and_only_within_the_window():
    mine = ours(1000.0).signed_by(ORGANISER)
    near, far = ours(990.0).signed_by(STRANGER), ours(0.0).signed_by(STRANGER)
    fresh = lambda: RunTrust(pinned=ORGANISER.public, organised_at=1000.0)  # noqa: E731
    assert converge(mine, [far], fresh(), now=1001.0) == mine  # start_time=0 moves nobody
    assert converge(mine, [near], fresh(), now=1001.0) == near  # simultaneous organisers settle
    assert converge(mine, [near], fresh(), now=1000.0 + 61) == mine  # too late
    assert converge(mine, [near], RunTrust(pinned=ORGANISER.public, explicit=True), now=1001.0) == mine
    assert converge(mine, [near], RunTrust(pinned=ORGANISER.public), now=1001.0) == mine  # a joiner never moves


def test_an_envelope_is_small():
    assert len(msgpack.packb(stored(beat()).value)) < 1024
