"""The faults of a home machine, on real processes: the disk fills up under the checkpoints, and the
network splits the swarm in two for a while."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time

import pytest

from benchmarks.common import netns
from node.library.checkpoint import TMP_PREFIX, list_checkpoints, load_latest_valid
from node.observe.metrics import read_metrics
from tests.integration.swarm import TINY, anchor_at, every_round_checkpoints, rounds_of, wait_until

pytestmark = pytest.mark.integration


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.timeout(240)
def test_a_full_disk_costs_checkpoints_never_the_run_and_a_killed_averager_ends_it_in_one_line(swarm):
    """A tmpfs with room for one checkpoint of the tiny model (~2 MB) under --checkpoint-dir: the
    first is written, the next ones fail with ENOSPC. The peer says so once, keeps the good one
    intact, leaves no staging files and trains on. Then its averager process is killed (as the
    kernel's out-of-memory killer would): the peer notices within a second and leaves, in one line
    naming the process, with exit code 6 and no process left behind. (One peer for both faults.)"""
    checkpoints = swarm.root / "alone" / "checkpoints"
    if not _mount_tmpfs(checkpoints, "3m"):
        pytest.skip("mounting a small tmpfs needs root (and a kernel that allows it here)")
    try:
        config = every_round_checkpoints(swarm.root / "tiny.toml", TINY)
        peer = swarm.start("alone", "--round-seconds", "4", "--max-rounds", "30", config=config)

        def trained_after_a_failed_checkpoint() -> bool:
            assert peer.proc.poll() is None, peer.log()[-3000:]
            events = read_metrics(peer.metrics_path) if peer.metrics_path.exists() else []
            failed = [e["round"] for e in events if e["event"] == "checkpoint_failed"]
            return bool(failed) and max(rounds_of(peer), default=0) > failed[0]

        wait_until(trained_after_a_failed_checkpoint, 150, "no round after a failed checkpoint")
        log = peer.log()
        assert log.count("not written to") == 1, log[-3000:]
        assert "No space left on device" in log and "is kept and training goes on" in log
        kept = list_checkpoints(checkpoints)
        assert len(kept) == 1 and load_latest_valid(checkpoints).round == int(kept[0].name.split("-")[-1])

        # The averager is killed: the peer leaves within a second (a round is 4 s), in one line.
        start = next(e for e in read_metrics(peer.metrics_path) if e["event"] == "start")
        assert set(start["processes"]) == {"dht", "averager", "p2pd"}, start
        killed_at, killed_wall = time.monotonic(), time.time()
        os.kill(start["processes"]["averager"], signal.SIGKILL)
        assert peer.wait(timeout=60) == 6, peer.log()[-3000:]
        noticed = next(e for e in read_metrics(peer.metrics_path) if e["event"] == "error" and e["kind"] == "process")
        assert f"averager process (pid {start['processes']['averager']}) exited with signal 9" in noticed["message"]
        errors = [line for line in peer.log().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "averager process" in errors[0] and "start shoal run again" in errors[0], errors
        # The leave itself (a checkpoint attempt, closing) included. A sync in flight gives up within a
        # second of the averager's death: it used to wait out its all-reduce timeout (34 s of 52 here).
        assert time.monotonic() - killed_at < 15
        assert noticed["time"] - killed_wall < 3, noticed  # checked once a second from the training loop
        # No staging files once the peer is gone (checked only now: a save runs beside training, so
        # mid-run a later round's staging dir may legitimately exist).
        assert not [p for p in checkpoints.iterdir() if p.name.startswith(TMP_PREFIX)], list(checkpoints.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], capture_output=True)


# -- a network split ------------------------------------------------------------------------------
SPLIT_ROUND_S = 6.0
SPLIT_S = 30.0  # the outage of issue 31: long enough for every record and routing entry across it to expire
# A third of a core each: three unthrottled peers training took both cores, and the fourth one's
# start-up (an interpreter importing torch) then took 35 s instead of 10. How fast they train is
# not what this test is about.
SPLIT_THROTTLE = ("--throttle", "3")


@pytest.mark.timeout(420)
def test_a_split_swarm_trains_in_halves_and_becomes_one_again(swarm):
    """Four peers in network namespaces; after a round of all four, peers 2-3 are cut off from
    0-1 for 30 s, then the link is back. Both halves train in pairs meanwhile; after the heal the
    peers find each other again (rediscovery: the peers met are re-dialled) and average in one
    group of four within a few rounds; their anchors then agree, and the re-synced half's outer
    steps apart were merged into the kept anchor through its next contribution, not dropped."""
    if not netns.available():
        pytest.skip("network namespaces need root, ip and tc")
    netns.BRIDGE, netns.PREFIX, netns.SUBNET = "shoaltbr0", "shoalt", "10.217.0"  # ours alone
    config = every_round_checkpoints(swarm.root / "tiny.toml", TINY)
    with netns.Network(4, mbit=200) as net:
        def start(i: int, joining=None):
            """Peer ``i`` (started now; with ``joining``, it joins that peer once its address is shared)."""
            args = ("--round-seconds", str(SPLIT_ROUND_S), *SPLIT_THROTTLE)
            kwargs = dict(config=config, prefix=net.hosts[i].prefix(), listen=f"/ip4/{net.hosts[i].address}/tcp/0")
            return swarm.start_joining(joining, f"p{i}", *args, **kwargs) if joining else swarm.start(f"p{i}", *args, **kwargs)

        def share_address(peer, i: int) -> None:
            swarm.share_address(peer, [m for m in peer.wait_for_address() if net.hosts[i].address in m][:1])

        p0 = start(0)
        p1, p2 = start(1, joining=p0), start(2, joining=p0)
        p3 = start(3, joining=p2)  # its only initial peer is on its side of the split
        share_address(p0, 0)
        share_address(p2, 2)
        peers = [p0, p1, p2, p3]

        def rounds_with(size: int, after: float, until: float = math.inf) -> list[list[int]]:
            """Per peer, its rounds with a deadline after ``after`` (and at ``until`` at the latest)
            averaged in a group of ``size``."""
            return [[r for r, rec in rounds_of(p).items() if rec["group_size"] == size and rec["applied"] == "averaged"
                     and after < schedule_start(p) + r * SPLIT_ROUND_S <= until] for p in peers]

        wait_until(lambda: all(rounds_with(4, 0.0)), 240, "the four peers never averaged in one group")
        net.split([2, 3])
        cut = time.time()
        time.sleep(SPLIT_S)
        net.heal()
        healed = time.time()
        # Every round of the split has landed (a round's record comes after its sync) before the halves are read.
        split_rounds = [math.floor((healed - schedule_start(p)) / SPLIT_ROUND_S) for p in peers]
        wait_until(lambda: all(last in rounds_of(p) for p, last in zip(peers, split_rounds, strict=True)), 60,
                   f"the split's rounds never landed:\n{_tails(peers)}")
        halves = rounds_with(2, cut, until=healed)
        assert all(halves), ("both halves train in pairs during the split", halves)
        wait_until(lambda: all(rounds_with(4, healed)), 120,
                   f"not one group of four after the heal:\n{_tails(peers)}")
        whole = rounds_with(4, healed)
        heal_round = math.ceil((healed - schedule_start(p0)) / SPLIT_ROUND_S)
        # Within a minute: 1-3 rounds here; CI once took 9 (its first group of four after the heal
        # that all applied), so the bound is 10 rounds and a miss prints every peer's rounds.
        assert max(min(rounds) for rounds in whole) <= heal_round + 10, (heal_round, whole, _tails(peers))
        last = max(max(rounds) for rounds in whole)

        def averaged_by_all() -> list[int]:
            """Rounds after ``last`` whose average all four applied (a follower that missed its leader's
            answer on two busy cores leaves a round partial for everyone: no checkpoint of that round)."""
            per_peer = [rounds_of(p) for p in peers]
            return [r for r in sorted(per_peer[0]) if r > last
                    and all(r in rounds and rounds[r]["applied"] == "averaged" for rounds in per_peer)]

        try:
            wait_until(averaged_by_all, 60, "the swarm did not average together after the heal")
        except TimeoutError:
            raise TimeoutError(f"the swarm did not average together after the heal:\n{_tails(peers)}") from None
        final = averaged_by_all()[0]
        for peer in peers:
            peer.interrupt()
        for peer in peers:
            assert peer.wait(timeout=60) == 0, peer.log()[-3000:]
        assert any("rediscovery:" in p.log() and "reached" in p.log() for p in peers), _tails(peers)
        anchors = [anchor_at(p, final) for p in peers]
        spread = max(float((a - anchors[0]).norm() / anchors[0].norm()) for a in anchors[1:])
        assert spread < 1e-3, spread  # one anchor again (one half re-synced to the other's)
        # ... keeping the other half's work: its outer steps apart are merged through its next contribution.
        replaced = [e for p in peers for e in read_metrics(p.metrics_path) if e["event"] == "reunion" and not e["kept"]]
        assert any(e["steps_merged"] > 0 for e in replaced), (replaced, _tails(peers))
        # The kept half tells it too (the round engine judged it a reunion: the others stepped apart).
        assert any(e["event"] == "reunion" and e["kept"] for p in peers for e in read_metrics(p.metrics_path)), \
            _tails(peers)
        assert "merged into the group's anchor through our next contribution" in "".join(p.log() for p in peers), \
            _tails(peers)


def schedule_start(peer) -> float:
    return next(r for r in read_metrics(peer.metrics_path) if r["event"] == "start")["schedule_start"]


def _tails(peers) -> str:
    return "\n".join(f"--- {p.name} rounds {[(r, rec['group_size'], rec['applied']) for r, rec in sorted(rounds_of(p).items())]}"
                     f"\n{p.log()[-1500:]}" for p in peers)
