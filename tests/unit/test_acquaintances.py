"""Whose self-claimed figures count (issue 29, item 3): records alone no longer steer a peer.
The audit's proof: five records claiming ``sync_late_s = 86400`` moved the sync period from 1 to
1,440 rounds and kept a lone honest peer from ever stepping alone."""

from __future__ import annotations

import pytest

from node.api import Applied
from node.library.acquaintances import Acquaintances
from node.library.local_network import LocalSwarmHub
from protocols import progress
from protocols.identity import PeerKey
from protocols.progress import ProgressRecord
from tests.unit.test_api import run_together, swarm


def test_only_peers_met_lately_have_a_voice_and_newcomers_are_present_for_a_grace():
    people = Acquaintances(met_window=5, grace_rounds=2)
    people.saw(["a", "b", "sybil"], round=10)
    people.met(["a"], round=10)
    assert people.voices(["a", "b", "sybil"], round=11) == ["a"]
    assert people.present(["a", "b", "sybil"], round=12) == ["a", "b", "sybil"]  # b and sybil: new
    assert people.present(["a", "b", "sybil"], round=13) == ["a"]  # never met us: no longer counted
    people.saw(["sybil"], round=20)  # a record that lapsed and came back is not new again
    assert people.present(["sybil"], round=20) == []
    assert people.voices(["a"], round=15) == ["a"] and people.voices(["a"], round=16) == []
    people.met(["b"], round=14)
    assert people.present(["b"], round=19) == ["b"]


def sybil_record(peer: str) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, round=1, tokens_per_s=1e6, loss=None, eval_loss=None, device="cpu",
                          utilization=1.0, bytes_sent=0, bytes_received=0, mode="full", version="x", tokens=0,
                          time=0.0, phase="training", sync_late_s=86400.0, rounds_done=0)


@pytest.mark.wall_clock  # an in-process swarm on real rounds (scripts/run-suite.sh)
def test_records_that_never_average_with_us_neither_set_our_sync_period_nor_keep_us_from_stepping_alone():
    hub = LocalSwarmHub()
    peer = swarm(hub, "lone-honest-peer")
    try:
        for _ in range(5):
            sybil = PeerKey.generate().peer_id  # five identities: five keys
            hub.store("api-test", "progress", sybil, progress.encode(sybil_record(sybil)), ttl=600.0)
        finished = run_together([peer], rounds=8)[0]
        applied = [s.applied for s in finished]
        assert Applied.LOCAL in applied, applied  # before: folded every round, while the records lived
        assert peer._loop.sync_period == 1  # before: 86400 s rounds of lateness, a period of 86,400 rounds
        assert len(peer.peers) == 6 and [r.peer_id for r in peer.present_peers] == [peer.peer_id]
    finally:
        peer.close()
