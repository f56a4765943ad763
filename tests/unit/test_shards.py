"""Shard claims: least used first, spread for simultaneous joiners, conflicts resolved the same way
by everyone, and no two peers on one shard while a free one exists."""

from __future__ import annotations

import random

import pytest

from node.library.shards import choose_shard


def settle(peers: list[str], num_shards: int, *, views: int, seed: int) -> dict[str, int]:
    """Peers that each see a random, possibly stale subset of the others' claims, for a few ticks,
    then everyone sees everything (a heartbeat later)."""
    rng = random.Random(seed)
    claims: dict[str, int | None] = dict.fromkeys(peers)
    for _ in range(views):
        snapshot = dict(claims)
        for peer in rng.sample(peers, len(peers)):
            visible = {p: s for p, s in snapshot.items() if rng.random() < 0.5}
            claims[peer] = choose_shard(num_shards, peer, visible, claims[peer])
    for _ in range(3):  # full information, a few heartbeats
        snapshot = dict(claims)
        for peer in peers:
            claims[peer] = choose_shard(num_shards, peer, snapshot, claims[peer])
    return claims


@pytest.mark.parametrize("peers, num_shards", [(2, 4), (4, 4), (7, 16), (16, 16)])
@pytest.mark.parametrize("seed", range(5))
def test_no_two_peers_share_a_shard_while_one_is_free(peers, num_shards, seed):
    ids = [f"12D3KooW{seed}{i:04d}" for i in range(peers)]
    claims = settle(ids, num_shards, views=3, seed=seed)
    assert len(set(claims.values())) == peers, claims


def test_more_peers_than_shards_use_every_shard_evenly():
    ids = [f"peer-{i:03d}" for i in range(10)]
    claims = settle(ids, 4, views=2, seed=1)
    counts = sorted([list(claims.values()).count(s) for s in range(4)])
    assert counts[0] >= 2 and counts[-1] <= 3, claims


def test_a_newcomer_takes_the_least_used_shard_and_a_lone_peer_keeps_its_own():
    claims = {"a": 0, "b": 1, "c": 1}
    assert choose_shard(3, "d", claims, None) == 2
    assert choose_shard(3, "a", claims, 0) == 0  # alone on it: stays
    assert choose_shard(3, "c", claims, 1) == 2  # b < c share shard 1 while 2 is free: c moves
    assert choose_shard(3, "b", claims, 1) == 1  # b outranks c: stays


def test_simultaneous_joiners_spread_out():
    picks = {choose_shard(64, f"peer-{i}", {}, None) for i in range(16)}
    assert len(picks) > 8  # not everyone on shard 0


def test_an_out_of_range_claim_is_ignored_and_replaced():
    assert choose_shard(4, "me", {"x": 99, "y": -1}, 7) in range(4)
