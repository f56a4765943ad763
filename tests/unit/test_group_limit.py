"""A swarm of one group a round that outgrows it is told to its operator once, with the cap and the
fix, sub-groups (``node.library.group_limit``); a swarm in sub-groups is not, and publishes its
group count; in-process peers for the library's wiring."""

from __future__ import annotations

import logging

import torch

from averaging.math.groups import balanced_groups
from node.library import swarm as swarm_module
from node.library.config import AveragingConfig, RoundConfig
from node.library.group_limit import GroupLimitWatch
from node.library.local_network import LocalNetwork, LocalSwarmHub
from node.library.swarm import DiLoCoSwarm


def test_the_warning_comes_once_per_crossing_and_names_the_cap_and_the_fix():
    watch = GroupLimitWatch(cap=64)
    assert watch.observe(64) is None  # everybody fits
    first = watch.observe(65)
    assert first is not None and "65 live peers" in first and "(64)" in first and "keep the run to 64" in first
    assert "Set averaging.target_group_size" in first  # the fix: sub-groups
    assert watch.observe(70) is None  # told already
    assert watch.observe(60) is None and watch.observe(66) is not None  # back within, then over again
    assert GroupLimitWatch(cap=None).observe(10**6) is None


def swarm_of_three(hub, averaging):
    peers = []
    for name in ("a", "b", "c"):
        net = torch.nn.Linear(4, 1)
        peers.append(DiLoCoSwarm(net, run_id="capped", network=LocalNetwork(hub, name), averaging=averaging,
                                 rounds=RoundConfig(seconds=600.0), initial_peers=[] if name == "a" else ["a"]))
    return peers


def test_a_swarm_over_one_group_warns_its_operator_and_one_in_sub_groups_does_not(caplog, monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(swarm_module, "leader_group_cap", lambda target, robust: 2)  # a cap of 2 for 3 peers
    quick = dict(matchmaking_seconds=0.4, request_timeout=0.2, allreduce_timeout=5.0)
    peers = []
    try:
        peers = swarm_of_three(LocalSwarmHub(), AveragingConfig(**quick))
        for peer in peers[:2]:
            peer._monitor.tick()
        with caplog.at_level(logging.WARNING, logger="node.library.swarm"):
            peers[0]._monitor.tick()  # two peers: within the cap of 2
            assert "more than one averaging group" not in caplog.text
            peers[2]._monitor.tick()  # c sees three: it warns
            peers[0]._monitor.tick()  # so does a
            peers[0]._monitor.tick()  # once
        assert caplog.text.count("the swarm has 3 live peers, more than one averaging group holds (2)") == 2
        assert all(record.group_count is None for record in peers[0].peers)  # one group: nothing published
    finally:
        for peer in reversed(peers):
            peer.close()
    caplog.clear()
    peers = []
    try:
        peers = swarm_of_three(LocalSwarmHub(), AveragingConfig(target_group_size=2, **quick))
        with caplog.at_level(logging.WARNING, logger="node.library.swarm"):
            for _ in range(2):
                for peer in peers:
                    peer._monitor.tick()
        assert "more than one averaging group" not in caplog.text
        # three live peers in groups of about 2: two groups, of 2 and 1 (balanced: never 3 and 0), each
        # peer's from its rank in the shared hash order of the live peers
        expected = balanced_groups([peer.peer_id for peer in peers], 5, 2, salt="capped")
        assert sorted(expected.values()) == [0, 0, 1] or sorted(expected.values()) == [0, 1, 1]
        assert all(peer._group_plan(5) == (expected[peer.peer_id], 2) for peer in peers)
        # ...counted from every live record, not only the peers met lately: a clique that counted only
        # its own members planned one group of itself and never met the others again (16 real peers)
        monkeypatch.setattr(peers[0]._acquaintances, "present", lambda others, round: [])
        assert peers[0]._group_plan(5)[1] == 2
    finally:
        for peer in reversed(peers):
            peer.close()
