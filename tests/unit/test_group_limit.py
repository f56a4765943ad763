"""A swarm larger than one averaging group is told to its operator once, with the cap and the fix
(``node.library.group_limit``); in-process peers for the library's wiring."""

from __future__ import annotations

import logging

import torch

from node.library.config import AveragingConfig, RoundConfig
from node.library.group_limit import GroupLimitWatch
from node.library.local_network import LocalNetwork, LocalSwarmHub
from node.library.swarm import DiLoCoSwarm


def test_the_warning_comes_once_per_crossing_and_names_the_cap_and_the_fix():
    watch = GroupLimitWatch(cap=64)
    assert watch.observe(64) is None  # everybody fits
    first = watch.observe(65)
    assert first is not None and "65 live peers" in first and "(64:" in first and "keep the run to 64" in first
    assert "raise averaging.target_group_size" not in first  # 64 is the hard cap: raising the target does not help
    assert watch.observe(70) is None  # told already
    assert watch.observe(60) is None and watch.observe(66) is not None  # back within, then over again
    small = GroupLimitWatch(cap=8).observe(9)
    assert small is not None and "raise averaging.target_group_size" in small
    assert GroupLimitWatch(cap=None).observe(10**6) is None


def test_a_swarm_over_its_target_group_size_warns_its_operator(caplog):
    torch.manual_seed(0)
    hub = LocalSwarmHub()
    averaging = AveragingConfig(matchmaking_seconds=0.4, request_timeout=0.2, allreduce_timeout=5.0,
                                target_group_size=2)
    peers = []
    try:
        for name in ("a", "b", "c"):
            net = torch.nn.Linear(4, 1)
            peers.append(DiLoCoSwarm(net, run_id="capped", network=LocalNetwork(hub, name), averaging=averaging,
                                     rounds=RoundConfig(seconds=600.0), initial_peers=[] if name == "a" else ["a"]))
        for peer in peers[:2]:
            peer._monitor.tick()
        with caplog.at_level(logging.WARNING, logger="node.library.swarm"):
            peers[0]._monitor.tick()  # two peers: within the cap of 2
            assert "more than one averaging group" not in caplog.text
            peers[2]._monitor.tick()  # c sees three: it warns
            peers[0]._monitor.tick()  # so does a
            peers[0]._monitor.tick()  # once
        assert caplog.text.count("the swarm has 3 live peers, more than one averaging group holds (2:") == 2
    finally:
        for peer in reversed(peers):
            peer.close()
