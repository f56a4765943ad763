"""A sync that outlasts its round (issue: never idle on slow links), with real peers: one peer's
all-reduce is triggered 7 s late in 6 s rounds, so its groups' all-reduces end more than a round
after their deadline. Nobody's training waits for it, nobody re-syncs, every peer still averages at
least every other round (staying out of a round while its previous sync runs, and replaying the
outer steps it missed), and the anchors agree at the end. (A peer that folds a round for want of a
group replays the step the same way: in-process, tests/unit/test_process.py.)"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from averaging.state.shared_state import HISTORY_ROUNDS
from node.library.checkpoint import list_checkpoints
from tests.integration.start_gate import gated, open_gate
from tests.integration.swarm import (
    REPO,
    TINY,
    anchor_at,
    every_round_checkpoints,
    found_no_group,
    is_partial,
    rounds_of,
    took_part,
    train_then_interrupt,
    wait_until,
)

pytestmark = pytest.mark.integration

LAUNCHER = str(REPO / "tests" / "integration" / "delayed_sync.py")
DELAYED = [sys.executable, LAUNCHER, "7", "--"]
ROUND_S = 6.0
# A member that got only part of the average does not apply it and replays the step next round
# (``took_part``): a fault of the transport, not what this file tests.


def assert_no_resync(peer, records: list[dict], shown) -> None:
    resyncs = [r["round"] for r in records if r["resynced"]]
    if resyncs:  # what led to it, from the peer's log (the swarm's directory is gone after the test)
        marks = [f"round {r}:" for r in resyncs] + ["diverged", "reducer", "Averaging", "refused", "caught up"]
        why = [line for line in peer.log().splitlines() if any(mark in line for mark in marks)]
        raise AssertionError(f"{peer.name} re-synced in rounds {resyncs}; {shown}\n" + "\n".join(why[-40:]))


def assert_anchors_agree(anchors: dict[str, torch.Tensor]) -> None:
    for x, y in itertools.combinations(anchors, 2):
        rms = (anchors[x] - anchors[y]).square().mean().sqrt()
        assert rms < 1e-3, (x, y, float(rms))  # fp16 noise is ~1e-4 here (see test_swarm); a failure ~1e-2


def start_three(swarm, tmp_path, name: str, prefix: list[str]) -> list:
    """Two plain peers and, once they have averaged together, ``name`` run through ``prefix``; in 6 s
    rounds with a checkpoint each round. Staggered so that what is measured is a swarm with slow
    syncs, not three peers pairing up at once (joining is test_swarm's)."""
    # A sender 7 s late leaves 5 s of the others' sender timeout (0.4 x allreduce_timeout = 12 s):
    # on two busy cores a starved late peer's parts sometimes missed it (its group then averaged
    # without it). What is tested is the round engine, not that margin: give it room.
    text = TINY.read_text()
    roomy = text.replace("allreduce_timeout = 30.0", "allreduce_timeout = 60.0")
    assert roomy != text, "the tiny config no longer says allreduce_timeout = 30.0"
    config = every_round_checkpoints(tmp_path / "tiny.toml", text=roomy)
    # Throttled so that three peers' training needs fewer than the two cores: starved of CPU, hivemind's
    # matchmaking now and then failed a round, which is not what this test is about.
    args = ["--round-seconds", str(ROUND_S), "--throttle", "2"]
    first = swarm.start("a", *args, config=config)
    second = swarm.start_joining(first, "b", *args, config=config)
    address = swarm.share_address(first)[:1]

    def paired() -> bool:
        for peer in (first, second):
            assert peer.proc.poll() is None, peer.log()[-3000:]
        ours, theirs = rounds_of(first), rounds_of(second)
        return any(ours[r]["applied"] == theirs[r]["applied"] == "averaged" for r in ours.keys() & theirs.keys())

    # ``name``'s interpreter starts now, its ``shoal run`` once the two have paired (start_gate.py).
    gate = swarm.root / f"{name}.gate"
    third = swarm.start(name, *args, initial=address, prefix=prefix, config=config, env=gated(gate))
    wait_until(paired, 120, "the first two peers never averaged together")
    open_gate(gate)
    return [first, second, third]


@pytest.mark.timeout(420)
def test_a_sync_longer_than_a_round_costs_no_stall_and_no_resync(swarm, tmp_path):
    peers = start_three(swarm, tmp_path, "late", DELAYED)
    # The run ends at an event, not after a count of rounds: a round from the last full one on in
    # which all three averaged in one group and their claims confirmed one anchor (the engine's own
    # fingerprint check of every member; a step missed unseen, which only a later round's claims
    # heal, is then healed).
    common = train_then_interrupt(peers, full_rounds=7, timeout=300,
                                  until=lambda last: bool(confirmed_rounds(peers, last)))
    per_peer = {peer.name: rounds_of(peer) for peer in peers}
    for name, rounds in per_peer.items():  # shown on failure
        print(name, [(r, x["applied"][0], x["skipped"], x["caught_up"], x["resynced"], x["rounds_done"],
                      round(x["wait_s"], 2), round(x["sync_s"], 1), x["error"]) for r, x in sorted(rounds.items())])
    # From the first round that every peer averaged together on: a peer that joins while syncs
    # overlap can miss a step unseen (the reports in that round predate it) and re-sync once, a
    # known gap; after that, none.
    together = min(r for r in common if all(per_peer[name][r]["applied"] == "averaged" for name in per_peer))
    # The late peer's syncs outlast the round: it has to stay out of rounds (the others may average
    # without it in between, then it replays their step when it rejoins). Until the first time it
    # did, its syncs' lateness was not yet measured (two overlapping syncs, then a round or two out
    # to fall into phase); from then on, the steady state.
    settled = min((r for r in common if r > together and per_peer["late"][r]["skipped"]), default=None)
    assert settled is not None, f"the late peer never stayed out of a round after {together}"
    steady = range(settled, common[-1] + 1)
    assert len(steady) >= 3, (together, settled, common)
    for peer in peers:
        name, rounds = peer.name, per_peer[peer.name]
        records = [rounds[r] for r in range(together, common[-1] + 1)]
        assert_no_unexcused_resync(peer, per_peer, records[1:], records)
        # The loop never waited for the network.
        assert all(r["wait_s"] < 0.5 for r in records), (name, records)
        # Every other round at least, from its first contribution in the steady state to the end: a
        # longer gap only where the load explains every round of it (a starved sync, matchmaking that
        # found no group in time).
        averaged = [r for r in steady if took_part(rounds[r])]
        assert averaged, (name, records)
        for a, b in zip(averaged, [*averaged[1:], steady[-1] + 1], strict=True):
            gap = range(a + 1, b)
            assert len(gap) <= 1 or all(explained_by_load(rounds, r) for r in gap), (name, list(gap), records)
    # The shared models agree. On disk, a checkpoint is named by its state's last outer step and
    # peers keep their newest three: the fast pair's names are the same; the late peer, whose syncs
    # land a round late, often shares none with them (the fast pair has applied the next round's
    # step by the time its round lands). Each pair is compared at the newest round both hold; a pair
    # with the late peer only at a round the whole group confirmed (its newest checkpoint may lack a
    # step missed unseen, which the next confirmed round heals).
    confirmed = set(confirmed_rounds(peers, 0))
    compared = []
    for x, y in itertools.combinations(peers, 2):
        both = {r for r in saved_rounds(x) & saved_rounds(y) if "late" not in (x.name, y.name) or r in confirmed}
        if both:
            assert_anchors_agree({peer.name: anchor_at(peer, max(both)) for peer in (x, y)})
            compared.append((x.name, y.name))
    assert ("a", "b") in compared, {peer.name: saved_rounds(peer) for peer in peers}


def saved_rounds(peer) -> set[int]:
    return {int(path.name.removeprefix("round-")) for path in list_checkpoints(peer.checkpoint_dir)}


def confirmed_rounds(peers, after: int) -> list[int]:
    """The rounds from ``after`` on that every peer averaged in one group of all of them, re-syncing
    nobody, and in which every member its claims found apart (behind: it stayed out of a round)
    replayed the steps it missed, each replay verified against the group's reference before the
    round's average was applied: every peer then holds the same anchor."""
    per_peer = [rounds_of(peer) for peer in peers]

    def confirmed(r: int) -> bool:
        records = [rounds.get(r) for rounds in per_peer]
        if not all(x is not None and x["applied"] == "averaged" and x["group_size"] == len(peers)
                   and not x["resynced"] for x in records):
            return False
        apart = {peer for x in records for peer in x["diverged"]}
        return all(x["caught_up"] for x in records if x["peer"] in apart)

    return sorted(r for r in per_peer[0] if r >= after and confirmed(r))


def explained_by_load(rounds: dict[int, dict], r: int) -> bool:
    """Round ``r`` without this peer for a reason that a starved machine gives (the engine handling
    it as it should): matchmaking found no group in time, a training step ran past the deadline, or
    the peer stayed out because one of its syncs took over two rounds (the policy follows the
    measured lateness: stays out while that sync runs, or averages every k-th round only)."""
    record = rounds[r]
    if found_no_group(record) or "a training step ran past" in (record["error"] or ""):
        return True
    starved = any(x["sync_s"] > 2 * ROUND_S for x in rounds.values() if x["round"] < r)
    return record["skipped"] and starved


# A round that came back partial to one member and whole to another leaves their step histories
# apart for a while: a replay in the next few rounds can miss the group's anchor, and the peer
# re-syncs (docs/limitations.md; seen in 2 of 8 suite runs, 1 and 4 rounds after the partial one).
PARTIAL_AFTERMATH = 5


def assert_no_unexcused_resync(peer, per_peer: dict[str, dict[int, dict]], records: list[dict], shown) -> None:
    """No re-sync, unless the peer had fallen more than ``HISTORY_ROUNDS`` outer steps behind the
    others (past what a catch-up replays: it folded rounds for want of a group on a starved machine),
    or a round came back partial to some peer in the ``PARTIAL_AFTERMATH`` rounds before."""
    others = [rounds for name, rounds in per_peer.items() if name != peer.name]
    ours = per_peer[peer.name]
    partial = {r for rounds in per_peer.values() for r, x in rounds.items() if is_partial(x)}
    unexcused = []
    for record in records:
        r = record["round"]
        if not record["resynced"] or partial & set(range(r - PARTIAL_AFTERMATH, r)):
            continue
        behind = max((rounds[r - 1]["rounds_done"] for rounds in others if r - 1 in rounds), default=0) - \
            ours[r - 1]["rounds_done"] if r - 1 in ours else 0
        if behind <= HISTORY_ROUNDS:
            unexcused.append(r)
    assert_no_resync(peer, [ours[r] for r in unexcused], shown)
