"""``averaging.progress_shards = "auto"`` in ``DhtDirectory``: writers move to more keys as the
swarm they count grows, readers follow the counts the records publish, a joiner or ``shoal status``
finds every record in one read, and nobody is lost while counts change. Over an in-memory stand-in
for hivemind's DHT (store/get of subkeyed values; the real DHT is in test_entry_peers), with the
rule's thresholds lowered so six peers cross them."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from node.library.run_record import DhtDirectory
from protocols import keys, swarm_time
from protocols.identity import PeerKey, peer_id_of
from protocols.keys import peers_key, progress_shard
from protocols.progress import ProgressRecord

RUN = "auto-shards"


def _identities(count: int = 6) -> list[PeerKey]:
    """Random identities, at least two of whose records land outside key 0 at 4 keys (the shrink
    test needs two such; five of six landing in key 0 happens about once in 200 draws) and at least
    one inside it (the growth test checks key 0's share; none of six there happens about once in 6)."""
    while True:
        keys_ = [PeerKey.generate() for _ in range(count)]
        outside = sum(progress_shard(peer_id_of(k.public), 4) != 0 for k in keys_)
        if 2 <= outside < count:
            return keys_


IDENTITIES = _identities()


class FakeDht:
    """hivemind's DHT as ``DhtDirectory`` uses it: subkeyed values under a key, read whole."""

    def __init__(self, peer_id: str = "reader"):
        self.data: dict[str, dict[bytes, SimpleNamespace]] = {}
        self.peer_id = peer_id
        self.gets: list[str] = []

    def for_peer(self, peer_id: str) -> FakeDht:
        view = FakeDht(peer_id)
        view.data, view.gets = self.data, self.gets
        return view

    def store(self, key: str, *, subkey: bytes, value, expiration_time: float) -> None:
        self.data.setdefault(key, {})[subkey] = SimpleNamespace(value=value, expiration_time=expiration_time)

    def get(self, key: str, *, latest: bool, return_future: bool = False):
        self.gets.append(key)
        found = Future()
        found.set_result(SimpleNamespace(value=dict(self.data[key])) if key in self.data else None)
        return found


def record(peer_id: str, **changes) -> ProgressRecord:
    return ProgressRecord(peer_id=peer_id, round=3, tokens_per_s=10.0, loss=2.0, eval_loss=None, device="cpu",
                          utilization=0.5, bytes_sent=1, bytes_received=2, mode="full", version="0.1", tokens=100,
                          time=swarm_time.now(), phase="training", **changes)


@pytest.fixture
def low_thresholds(monkeypatch):
    """4 keys from 4 live peers, 8 from 8 (the real rule: 48 and 96)."""
    monkeypatch.setattr(keys, "AUTO_MIN_PEERS", 4)
    monkeypatch.setattr(keys, "PEERS_PER_SHARD", 1)


def swarm(dht: FakeDht, count: int = len(IDENTITIES)) -> list[DhtDirectory]:
    directories = []
    for identity in IDENTITIES[:count]:
        directory = DhtDirectory(dht.for_peer(peer_id_of(identity.public)), RUN, owner=identity.public)
        directory.use_progress_shards("auto")
        directories.append(directory)
    return directories


def heartbeat(directories: list[DhtDirectory]) -> list[dict[str, ProgressRecord]]:
    """Every peer publishes, then every peer reads (as each monitor does once a heartbeat)."""
    for directory in directories:
        directory.publish_progress(record(str(directory.dht.peer_id)), ttl=60)
    return [directory.progress()[0] for directory in directories]


def test_writers_spread_as_the_swarm_grows_and_every_reader_still_sees_everyone(low_thresholds):
    dht = FakeDht()
    peers = swarm(dht)
    ids = sorted(str(d.dht.peer_id) for d in peers)
    seen = heartbeat(peers)  # all at one key: everyone counts 6 and moves to 4 keys
    assert all(sorted(s) == ids for s in seen) and {d.shards for d in peers} == {4}
    dht.data.clear()  # the one-key records expired
    seen = heartbeat(peers)
    assert all(sorted(s) == ids for s in seen), "a reader lost a peer after the count changed"
    assert all(s[i].progress_shards == 4 for s in seen for i in ids)  # each record names its writer's count
    assert sorted(dht.data[peers_key(RUN, 0)]) == sorted(  # the one key holds only its share now
        identity.public for identity in IDENTITIES if progress_shard(peer_id_of(identity.public), 4) == 0)
    # A newcomer (or `shoal status`) starts from the one key and follows the counts it finds there,
    # within one call; a reader stuck at one key (a fixed run's) would see a part.
    newcomer = DhtDirectory(dht, RUN)
    newcomer.use_progress_shards("auto")
    assert sorted(newcomer.progress()[0]) == ids and newcomer.read_shards == 4
    fixed = DhtDirectory(dht, RUN)
    fixed.use_progress_shards(1)
    assert len(fixed.progress()[0]) < len(ids)


def test_a_swarm_that_shrank_goes_back_to_one_key_and_a_lingering_record_never_wins(low_thresholds):
    dht = FakeDht()
    peers = swarm(dht)
    heartbeat(peers)
    dht.data.clear()
    heartbeat(peers)
    assert {d.shards for d in peers} == {4}
    # Two stay, four leave (their records expire); the two that stay write away from key 0 at 4.
    stayed = [d for d in peers if progress_shard(str(d.dht.peer_id), 4) != 0][:2]
    assert len(stayed) == 2
    for directory in peers:
        if directory not in stayed:
            for values in dht.data.values():
                values.pop(directory.owner, None)
    heartbeat(stayed)  # 2 < 0.75 x 4 live peers: down to one key
    assert {d.shards for d in stayed} == {1}
    # Their records at 4 keys linger beside the new ones in key 0, which is read first: the newest counts.
    seen = heartbeat(stayed)
    assert all(len(s) == 2 and {r.progress_shards for r in s.values()} == {1} for s in seen), seen
    dht.data.clear()
    heartbeat(stayed)
    assert {d.read_shards for d in stayed} == {1}


def test_a_strangers_record_claiming_64_keys_makes_a_small_swarm_read_at_most_4(low_thresholds):
    dht = FakeDht()
    peers = swarm(dht, 2)
    stranger = DhtDirectory(dht.for_peer(peer_id_of(IDENTITIES[5].public)), RUN, owner=IDENTITIES[5].public)
    stranger.use_progress_shards("auto")
    stranger.publish_progress(dataclasses.replace(record(str(stranger.dht.peer_id))), ttl=60)
    # its record lands in key 0 (count 1 at publish); a forged count rides it
    entry = dht.data[peers_key(RUN, 0)][IDENTITIES[5].public]
    entry.value = {**entry.value, "progress_shards": 64}
    dht.gets.clear()
    seen = heartbeat(peers)
    assert all(len(s) == 3 for s in seen)
    assert {d.read_shards for d in peers} == {4}, "a forged count was followed past 4x our own"
    assert len(set(dht.gets)) <= 4


def test_a_newcomer_finds_a_sharded_swarm_whose_first_key_holds_nobody(low_thresholds):
    """Four writers at 4 keys, none of them under key 0 (a third of the time in so small a swarm):
    a newcomer's first read covers the first 4 keys, so it still finds them all."""
    writers = []
    while len(writers) < 4:  # identities whose records land outside key 0 at 4 keys
        identity = PeerKey.generate()
        if progress_shard(peer_id_of(identity.public), 4) != 0:
            writers.append(identity)
    dht = FakeDht()
    peers = []
    for identity in writers:
        directory = DhtDirectory(dht.for_peer(peer_id_of(identity.public)), RUN, owner=identity.public)
        directory.use_progress_shards("auto")
        peers.append(directory)
    heartbeat(peers)
    dht.data.clear()
    heartbeat(peers)  # now at 4 keys, key 0 empty
    assert {d.shards for d in peers} == {4} and peers_key(RUN, 0) not in dht.data
    newcomer = DhtDirectory(dht, RUN)
    newcomer.use_progress_shards("auto")
    assert len(newcomer.progress()[0]) == 4 and newcomer.read_shards == 4
    # A joiner reads the one key while it joins (before it knows the run's setting), then switches.
    joiner = DhtDirectory(dht, RUN)
    assert joiner.progress()[0] == {}
    joiner.use_progress_shards("auto")
    assert len(joiner.progress()[0]) == 4
