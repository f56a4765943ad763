"""Several entry peers: a swarm started at once through two entry nodes that do not know each other
is one swarm (hivemind issue #624 saw peers started with one bootstrap list split into two DHTs).
The run's progress records spread themselves over more keys as the swarm grows
(``averaging.progress_shards = "auto"``, the default; its thresholds lowered here so that four
peers move to 4 keys), so the same swarm shows that every peer, and ``shoal status`` from a node
outside the run, still reads them all.

Real hivemind DHT nodes as ``shoal run`` starts them, with real ``PeerMonitor``s and nothing else
(benchmarks.swarm.dht_load --bootstraps measures the same at 8-32 peers and the entry peers' load)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

RUN = "entries"


# Real DHTs and in-process monitors waiting on heartbeats: run beside the unit tests (scripts/run-suite.sh).
@pytest.mark.wall_clock
@pytest.mark.timeout(180)
def test_peers_started_at_once_through_two_unconnected_entry_peers_form_one_swarm(monkeypatch):
    from hivemind.utils import get_dht_time

    from protocols import keys

    monkeypatch.setattr(keys, "AUTO_MIN_PEERS", 4)  # 4 keys from 4 live peers (the real rule: 48)
    monkeypatch.setattr(keys, "PEERS_PER_SHARD", 1)

    from node.library.dht import RecordRules, shutdown_dht, start_dht
    from node.library.monitor import PeerMonitor
    from node.library.run_record import DhtDirectory, RunTrust, join_run
    from node.library.snapshot import look
    from protocols.keys import progress_shard
    from protocols.manifest import RunManifest, progress_shards
    from protocols.progress import ProgressRecord

    rules = RecordRules(run_ids=(RUN,))
    start = lambda initial: start_dht(initial_peers=initial, listen=["/ip4/127.0.0.1/tcp/0"],  # noqa: E731
                                      announce=[], timeout=60, rules=rules)
    entries, peers, monitors = [], [], []
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            entries = list(pool.map(start, [[], []]))  # each alone: neither knows the other
            addresses = [str(m) for entry in entries for m in entry.get_visible_maddrs()]
            peers = list(pool.map(start, [addresses] * 4))  # all at once, each given both
        ours = RunManifest.create(RUN, {"model.d_model": 64, "averaging.progress_shards": "auto"},
                                  start_time=get_dht_time(), round_seconds=6.0)
        for dht in peers:
            peer_id = str(dht.peer_id)
            directory = DhtDirectory(dht, RUN, owner=dht.shoal_key.public)
            trust = RunTrust()
            manifest = join_run(directory, ours, record_ttl=600, trust=trust, settle_s=20)
            directory.use_progress_shards(progress_shards(manifest))  # as DiLoCoSwarm does after joining
            status = lambda peer_id=peer_id, directory=directory: ProgressRecord(  # noqa: E731
                peer_id=peer_id, round=1, tokens_per_s=1.0, loss=None, eval_loss=None, device="cpu", utilization=1.0,
                bytes_sent=0, bytes_received=0, mode="full", version="0.1.0", tokens=0, time=directory.now(),
                phase="training")
            monitor = PeerMonitor(directory, manifest, peer_id=peer_id, period=2.0, status=status,
                                  on_change=lambda joined, left: None, trust=trust)
            monitor.start()
            monitors.append(monitor)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(len(m.peers) for m in monitors) < len(peers):
            time.sleep(1.0)
        seen = sorted(len(m.peers) for m in monitors)
        assert seen == [len(peers)] * len(peers), f"records each peer saw: {seen} (a split DHT sees a part)"
        assert len({m.manifest.organiser for m in monitors}) == 1, "two halves organised two runs"
        # The records spread: once the one-key records expired (3 heartbeats), the one key (shard 0)
        # holds only the peers that hash there ...
        ids = [str(dht.peer_id) for dht in peers]
        share = sorted(i for i in ids if progress_shard(i, 4) == 0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sorted(DhtDirectory(entries[0], RUN).progress()[0]) != share:
            time.sleep(1.0)
        first_key, _ = DhtDirectory(entries[0], RUN).progress()
        assert sorted(first_key) == share, (first_key, ids)
        assert [m.directory.shards for m in monitors] == [4] * len(peers)
        assert min(len(m.peers) for m in monitors) == len(peers), "a peer lost sight of another as the keys spread"
        # ... and ``shoal status`` (a read-only directory, from the one key up) sees all in one look.
        snapshot = look(entries[1], RUN)
        assert sorted(snapshot.records) == sorted(ids) and snapshot.malformed == 0 and snapshot.progress_shards == 4
    finally:
        for monitor in monitors:
            monitor.stop()
        for dht in peers + entries:
            shutdown_dht(dht)
