"""Round-seeded sub-groups (``averaging.math.groups``): counts at their boundaries, the same groups in
every process, balanced and remixed groups, groups that hold when views of the live peers differ,
and keys that stay today's key for one group."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from averaging.math.groups import (
    agreed_group_count,
    balanced_groups,
    group_among,
    group_count,
    group_key_bits,
    group_of,
    members,
    settled_group_count,
)
from averaging.network.hivemind.backend import round_bits

REPO = Path(__file__).resolve().parents[2]
IDS = [f"12D3KooWpeer{i:04d}" for i in range(1024)]


@pytest.mark.parametrize(("live", "target", "expected"), [
    (0, 16, 1), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 4),
    (255, 16, 16), (256, 16, 16), (257, 16, 32), (1024, 16, 64), (1025, 16, 128),
    (1024, 8, 128), (9, 8, 2), (5000, 0, 1), (3, 1, 4),
])
def test_group_count_at_its_boundaries(live, target, expected):
    assert group_count(live, target) == expected


def test_group_count_keeps_the_mean_group_between_half_the_target_and_the_target():
    for target, live in itertools.product((2, 3, 8, 12, 16), range(1, 3000)):
        groups = group_count(live, target)
        assert groups & (groups - 1) == 0
        assert live / groups <= target
        if groups > 1:
            assert live / groups > target / 2


def test_group_count_refuses_negative_input():
    with pytest.raises(ValueError):
        group_count(-1, 16)
    with pytest.raises(ValueError):
        group_count(10, -16)


def test_one_group_is_todays_key():
    for round in range(40):
        assert group_key_bits(round, 0, 1) == round_bits(round)


def test_neighbouring_rounds_never_share_a_key():
    for round, groups in itertools.product(range(50), (1, 2, 16, 64)):
        keys_now = {group_key_bits(round, g, groups) for g in range(groups)}
        keys_next = {group_key_bits(round + 1, g, groups) for g in range(groups)}
        assert not keys_now & keys_next


def test_key_bits_append_the_group():
    assert group_key_bits(5, 3, 16) == "0101" + "0011"
    assert group_key_bits(21, 1, 2) == "0101" + "1"
    with pytest.raises(ValueError):
        group_key_bits(5, 16, 16)
    with pytest.raises(ValueError):
        group_key_bits(5, 0, 12)


def test_a_doubled_estimate_differs_in_one_appended_bit():
    for round, groups in itertools.product((0, 7, 123), (1, 2, 8, 32)):
        for live in (IDS[:64], IDS[:100]):
            small, large = balanced_groups(live, round, groups), balanced_groups(live, round, 2 * groups)
            for peer in live:
                small_key = group_key_bits(round, small[peer], groups)
                large_key = group_key_bits(round, large[peer], 2 * groups)
                assert large_key[:-1] == small_key and len(large_key) == len(small_key) + 1
        for peer in IDS[:64]:  # the hashed rule too
            small_key = group_key_bits(round, group_of(peer, round, groups), groups)
            assert group_key_bits(round, group_of(peer, round, 2 * groups), 2 * groups)[:-1] == small_key


def test_groups_are_the_same_in_another_process():
    script = ("import json, sys; from averaging.math.groups import balanced_groups; "
              "print(json.dumps(balanced_groups([f'12D3KooWpeer{i:04d}' for i in range(200)], 77, 64, salt='run')))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    here = balanced_groups(IDS[:200], 77, 64, salt="run")
    assert json.loads(out) == here
    assert [here[peer] for peer in IDS[:200]] != sorted(here.values())  # not in id order: the hash orders them


def test_the_salt_and_the_round_change_the_groups():
    base = members(IDS[:256], 3, 16)
    assert base != members(IDS[:256], 3, 16, salt="other-run")
    # round 19 has round 3's key bits, but not its groups: the full round seeds the hash
    assert base != members(IDS[:256], 19, 16)


def test_groups_differ_in_size_by_one_at_most():
    for live, groups in itertools.product((2, 3, 7, 16, 100, 255, 1024), (1, 2, 4, 16, 64)):
        if groups > live:
            continue
        sizes = [len(group) for group in members(IDS[:live], live % 5, groups).values()]
        assert len(sizes) == groups and sum(sizes) == live
        assert max(sizes) - min(sizes) <= 1, (live, groups, sizes)
    # the hashed rule's sizes are binomial: 16 peers in 4 groups met in groups of 1 to 8 (16 real peers)
    hashed = Counter(group_of(peer, 3, 4) for peer in IDS[:16])
    assert max(hashed.values()) - min(hashed.values()) > 1


def test_groups_remix_every_round():
    groups = 16
    pairs = list(itertools.combinations(range(512), 2))
    now_groups, later_groups = balanced_groups(IDS[:512], 40, groups), balanced_groups(IDS[:512], 41, groups)
    now, later = [now_groups[p] for p in IDS[:512]], [later_groups[p] for p in IDS[:512]]
    together_now = [(a, b) for a, b in pairs if now[a] == now[b]]
    apart_now = [(a, b) for a, b in pairs if now[a] != now[b]]
    share_after_together = sum(later[a] == later[b] for a, b in together_now) / len(together_now)
    share_after_apart = sum(later[a] == later[b] for a, b in apart_now) / len(apart_now)
    # ~1/16 either way: last round's groups say nothing about this round's
    assert abs(share_after_together - 1 / groups) < 0.02
    assert abs(share_after_apart - 1 / groups) < 0.01


def test_members_lists_every_peer_once():
    assigned = members(IDS[:100] + IDS[:10], 8, 4)
    assert sorted(itertools.chain.from_iterable(assigned.values())) == sorted(IDS[:100])
    by_peer = balanced_groups(IDS[:100], 8, 4)
    assert all(by_peer[peer] == group == group_among(peer, IDS[:100], 8, 4)
               for group, peers in assigned.items() for peer in peers)
    assert group_among("newcomer", IDS[:100], 8, 4) in range(4)  # a peer counts itself even if unlisted


def test_a_view_that_misses_records_puts_a_peer_in_its_group_or_the_next():
    """Each peer orders the live peers it has records of. A view that misses some records (each
    1%, the simulation's rate) or holds a leaver's record a little longer shifts a peer's rank and
    the count alike, so the peer lands in the group the full view gives it, or at a cut the
    neighbouring one (it still meets a group, one member larger)."""
    rng = random.Random(5)
    live, groups = IDS[:256], 16
    moved = 0
    for round in range(5):
        full = balanced_groups(live, round, groups)
        for peer in live:
            view = [p for p in live if p == peer or rng.random() >= 0.01] + IDS[256:256 + rng.randint(0, 2)]
            mine = group_among(peer, view, round, groups)
            assert abs(mine - full[peer]) <= 1, (round, peer, mine, full[peer])
            moved += mine != full[peer]
    assert moved / (5 * len(live)) < 0.08, moved / (5 * len(live))  # measured: 3.4%


def test_settled_count_holds_inside_its_band_and_moves_outside():
    # 16 groups of 16: the swarm drifting around the boundary at 256 keeps 16 groups
    for live in range(240, 321):
        assert settled_group_count(live, 16, 16) == 16
    assert settled_group_count(321, 16, 16) == 32  # mean 20.06 > 16 * 1.25
    assert settled_group_count(95, 16, 16) == 8  # mean 5.9 < 8 * 0.75
    assert settled_group_count(257, 16, None) == 32  # a peer with no count yet takes group_count
    assert settled_group_count(20, 16, 1) == 1 and settled_group_count(21, 16, 1) == 2
    assert settled_group_count(500, 0, 16) == 1  # target 0: everybody, whatever came before
    assert settled_group_count(257, 16, 12) == 32  # not a power of two: ignored


def test_agreed_count_follows_the_published_majority():
    # a minority that moved to 32 groups early comes back while the swarm stays in 16's band
    assert agreed_group_count([16] * 200 + [32] * 56, 262, 16) == 16
    assert agreed_group_count([16] * 100 + [32] * 156, 262, 16) == 32
    assert agreed_group_count([16] * 10 + [32] * 10, 262, 16) == 16  # a tie goes to the smaller count
    assert agreed_group_count([16] * 250, 330, 16) == 32  # out of the band: everyone moves
    assert agreed_group_count([], 257, 16) == 32
    assert agreed_group_count([7, "16", None], 100, 16) == 8  # nothing valid: group_count
