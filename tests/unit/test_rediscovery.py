"""Rediscovery: when to re-dial (the backoff), whom (the peer cache, the initial peers), the cache
on disk, and the addresses a progress record may carry. The dialling itself runs against real
DHTs in tests/integration/test_partition.py."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future

import pytest

from node.library.rediscovery import CACHE_LIMIT, SWEEP_TICKS, Backoff, PeerCache, Rediscovery, ReunionWatch
from protocols.messages import MessageError
from protocols.progress import MAX_ADDRS, ProgressRecord, decode, encode

A = "12D3KooWNSgyp7Jk9sKE6bQqBHmCKDCX6ayX3cFHpLdcFWUy56Sd"
B = "QmTXBvkP4c7dTFVHy1zWMn2p2GvS6hUgSjtFQyJSTJwmv6"


def addr(peer: str, port: int = 31337) -> str:
    return f"/ip4/10.0.0.1/tcp/{port}/p2p/{peer}"


def record(peer: str, addrs: tuple[str, ...] | None = None) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, round=3, tokens_per_s=1.0, loss=None, eval_loss=None, device="cpu",
                          utilization=0.5, bytes_sent=0, bytes_received=0, mode="full", version="0.1.0", tokens=0,
                          time=1.0, phase="training", addrs=addrs)


# -- the record's addresses ---------------------------------------------------------------------
def test_addresses_round_trip_and_older_records_have_none():
    ours = record(A, (addr(A), addr(A, 4001)))
    assert decode(A, encode(ours)) == ours
    assert decode(A, encode(record(A))).addrs is None and "addrs" not in encode(record(A))


@pytest.mark.parametrize(("addrs", "problem"), [
    ([addr(B)], "another peer"),  # a record signed by A cannot send us dialling B
    ([addr(A)] * (MAX_ADDRS + 1), "at most"),
    ("/ip4/1.2.3.4/tcp/1", "list"),
    ([7], "strings"),
    (["/ip4/1.2.3.4/tcp/1/p2p/" + A + "x" * 300], "strings"),
    (["not a multiaddr"], "multiaddr"),
    (["/ip4/1.2.3.4/p2p/" + A], "transport"),
])
def test_bad_addresses_are_refused(addrs, problem):
    value = {**encode(record(A)), "addrs": addrs}
    with pytest.raises(MessageError, match=problem):
        decode(A, value)


# -- when ---------------------------------------------------------------------------------------
def test_backoff_dials_at_once_when_short_then_doubles_the_gap_and_resets_when_whole():
    backoff = Backoff(window=100, max_gap=4)
    assert [backoff.observe(4) for _ in range(3)] == [False] * 3  # whole: nothing to do
    tries = [backoff.observe(2) for _ in range(16)]  # split: 2 of the 4 seen lately
    assert [i for i, tried in enumerate(tries) if tried] == [0, 1, 3, 7, 11, 15]  # gaps 1, 2, 4, 4, 4
    assert backoff.observe(4) is False  # healed
    assert backoff.observe(3) is True  # a new drop is tried at once again


def test_backoff_forgets_peers_older_than_its_window():
    backoff = Backoff(window=5, max_gap=4)
    backoff.observe(4)
    tried = [backoff.observe(1) for _ in range(8)]
    assert tried[0] and not any(tried[5:])  # the 4 has left the window: 1 is all there is now


# -- whom ---------------------------------------------------------------------------------------
def test_the_cache_keeps_the_newest_peers_and_lists_the_missing_ones(tmp_path):
    cache = PeerCache(tmp_path / "peers.json")
    cache.remember({A: record(A, (addr(A),)), B: record(B)}, now=100.0)  # B lists no address: not kept
    assert cache.missing(live=set(), since=0.0) == [(A, (addr(A),))]
    assert cache.missing(live={A}, since=0.0) == [] and cache.missing(live=set(), since=101.0) == []
    many = {f"peer{i}": (addr(A),) for i in range(CACHE_LIMIT + 5)}
    for i, (peer, addrs) in enumerate(many.items()):
        cache.peers[peer] = (addrs, 200.0 + i)
    cache._trim()
    assert len(cache.peers) == CACHE_LIMIT and "peer0" not in cache.peers and A not in cache.peers


def test_the_cache_survives_a_restart_and_a_broken_file_is_ignored(tmp_path, caplog):
    path = tmp_path / "run.peers.json"
    cache = PeerCache(path)
    cache.remember({A: record(A, (addr(A),))}, now=1_000.0)
    cache.save()
    assert PeerCache.load(path, now=1_001.0).peers == {A: ((addr(A),), 1_000.0)}
    assert PeerCache.load(path, now=1_000.0 + 8 * 86400).peers == {}  # a week old: forgotten
    data = json.loads(path.read_text())
    data["peers"][A]["addrs"] = [addr(B)]  # an edited file naming another peer
    path.write_text(json.dumps(data))
    assert PeerCache.load(path, now=1_001.0).peers == {}
    path.write_text("{not json")
    assert PeerCache.load(path).peers == {} and "ignoring the peer cache" in caplog.text
    assert PeerCache.load(tmp_path / "missing.json").peers == {}


def done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_rediscovery_dials_the_missing_peers_when_short_and_the_initial_ones_on_its_sweep(tmp_path):
    boot = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    me = "QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oFGL1KrGM"
    found = Rediscovery(initial_peers=[addr(boot)], cache=PeerCache(tmp_path / "p.json"), peer_id=me, period=1.0)
    calls = []

    def reconnect(targets):
        calls.append(sorted(peer for peer, _ in targets))
        return done([peer for peer, _ in targets if peer == A])

    whole = {me: record(me, (addr(me),)), A: record(A, (addr(A),)), B: record(B, (addr(B),))}
    for _ in range(SWEEP_TICKS - 1):
        assert found.tick(whole, reconnect, met={me, A, B}) == []
    assert calls == []  # whole, and not yet time for the sweep
    found.tick(whole, reconnect, met={me, A, B})
    assert calls == [[boot]]  # the sweep: the bootstrap (never in the records) is pinged
    assert found.tick({me: whole[me]}, reconnect, met={me, A, B}) == []  # the sweep's answer: not a try of ours
    assert calls[-1] == sorted([A, B, boot])  # A and B gone: dialled at once, never ourselves
    assert found.tick({me: whole[me]}, reconnect, met={me, A, B}) == [A]  # that try's answer, read a tick later
    assert found.tries == 2 and found.reached == 1  # and the next try (a gap of 1) has started
    assert json.loads((tmp_path / "p.json").read_text())["peers"].keys() == {me, A, B}


def test_only_peers_we_averaged_with_are_kept_and_a_public_node_dials_only_public_addresses(tmp_path):
    """Issue 54, item 6: a stranger's record (never averaged with us) is not remembered, so withdrawing
    records cannot make us dial it; a node with a public address skips the loopback and LAN
    addresses a peer lists (a node on a LAN swarm dials them); the initial peers are always dialled."""
    me, boot = "QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oFGL1KrGM", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    public = f"/ip4/1.2.3.4/tcp/4001/p2p/{A}"  # (never dialled: the reconnect here is a stub)
    listed = (f"/ip4/127.0.0.1/tcp/4001/p2p/{A}", addr(A), public)
    whole = {me: record(me), A: record(A, listed), B: record(B, (f"/ip4/192.168.1.9/tcp/22/p2p/{B}",))}
    for local, expected in ((False, [(A, (public,)), (boot, (addr(boot),))]),
                            (True, [(A, listed), (boot, (addr(boot),))])):
        found = Rediscovery(initial_peers=[addr(boot)], cache=PeerCache(), peer_id=me, period=1.0, local=local)
        calls: list[list] = []

        def reconnect(targets, calls=calls):
            calls.append(sorted(targets))
            return Future()

        found.tick(whole, reconnect, met={A})  # B never met us
        assert B not in found.cache.peers
        found.tick({me: whole[me]}, reconnect, met={A})
        assert calls == [sorted(expected)], (local, calls)


def test_a_try_still_running_is_not_doubled():
    found = Rediscovery(initial_peers=[], cache=PeerCache(), peer_id="me", period=1.0)
    pending: Future = Future()
    calls = []

    def reconnect(targets):
        calls.append(targets)
        return pending

    found.cache.peers[A] = ((addr(A),), time.time())
    found.tick({"me": record(A, None), A: record(A, (addr(A),))}, reconnect, met={A})
    for _ in range(6):  # short for six ticks: tries due, but the first is still dialling
        found.tick({"me": record(A, None)}, reconnect, met={A})
    assert len(calls) == 1
    pending.set_result([])
    found.tick({"me": record(A, None)}, reconnect, met={A})  # read (reached none)
    found.tick({"me": record(A, None)}, reconnect, met={A})
    assert len(calls) == 2 and found.reached == 0


# -- the reunion event ----------------------------------------------------------------------------
def rounds(watch: ReunionWatch, sizes: list[int], folded_rounds: tuple[int, ...] = (), **last) -> dict | None:
    out = None
    for r, size in enumerate(sizes, start=1):
        final = r == len(sizes)
        out = watch.observe(round=r, group_size=size, applied="folded" if r in folded_rounds else "averaged", tokens=100,
                            resynced=final and last.get("resynced", False), diverged=last.get("diverged", []) if final else [],
                            folded=last.get("folded", 0) if final else 0,
                            reunion=last.get("reunion") if final else False)
    return out


def test_a_reunion_is_told_on_both_sides_with_what_the_replaced_side_folded_or_dropped():
    folded = rounds(ReunionWatch(), [4, 4, 2, 2, 2, 4], resynced=True, diverged=["x"], folded=3)
    assert folded == {"round": 6, "group_size": 4, "apart_rounds": 3, "apart_group_size": 2, "kept": False,
                      "steps_dropped": 0, "tokens_dropped": 0, "rejoined": ["x"], "steps_merged": 3,
                      "tokens_merged": 300}
    # No whole round in common with the other side (the round engine folded nothing): dropped, and told.
    lost = rounds(ReunionWatch(), [4, 4, 2, 2, 2, 4], resynced=True, diverged=["x"])
    assert lost == {**folded, "steps_dropped": 3, "tokens_dropped": 300, "steps_merged": 0, "tokens_merged": 0}
    kept = rounds(ReunionWatch(), [4, 4, 2, 2, 4], diverged=["y", "x"], reunion=True)
    assert kept["kept"] and kept["steps_dropped"] == kept["steps_merged"] == 0 and kept["rejoined"] == ["x", "y"]
    # The same records where the round engine found the diverged members merely behind (they missed
    # rounds and catch up; they did not step apart): no reunion on the kept side. Records alone
    # (reunion unknown) cannot tell the two apart and report it.
    assert rounds(ReunionWatch(), [4, 4, 2, 2, 4], diverged=["y", "x"], reunion=False) is None
    assert rounds(ReunionWatch(), [4, 4, 2, 2, 4], diverged=["y", "x"])["kept"]


@pytest.mark.parametrize(("sizes", "last"), [
    ([4, 4, 2, 2, 4], {}),  # whole again, one anchor: nothing to tell
    ([1, 2, 3, 4], {"diverged": ["joiner"]}),  # the swarm growing: a joiner that catches up
    ([4, 3, 3, 3], {"resynced": True}),  # a re-sync in a group no larger than before
])
def test_no_reunion_without_a_split_that_ends(sizes, last):
    assert rounds(ReunionWatch(), sizes, **last) is None


def test_a_folded_round_neither_ends_a_split_nor_starts_one():
    """Seen in the split test: the first group of four after the heal was a partial round (folded by
    the kept side), the next one averaged with the diverged half. The folded round met nobody for
    good: the reunion is told at the averaged one, with the apart rounds' tokens and a folded
    round's between them. And a round we stayed out of (group 1, folded: the last sync still ran)
    is no split: the re-sync after it is a member catching up, not a reunion."""
    kept = rounds(ReunionWatch(), [4, 4, 2, 2, 1, 2, 4, 4], folded_rounds=(5, 7), diverged=["x", "y"], reunion=True)
    assert kept is not None and kept["kept"] and kept["round"] == 8
    assert (kept["apart_rounds"], kept["apart_group_size"]) == (3, 2)
    replaced = rounds(ReunionWatch(), [4, 4, 2, 2, 1, 2, 4, 4], folded_rounds=(5, 7), resynced=True, diverged=["x"])
    assert (replaced["steps_dropped"], replaced["tokens_dropped"]) == (3, 400)  # round 5's work rode on round 6's
    assert rounds(ReunionWatch(), [4, 4, 4, 1, 4], folded_rounds=(4,), resynced=True, diverged=["x"]) is None
