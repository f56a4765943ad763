"""A public swarm's worst day: home machines' clocks are wrong (libfaketime on the whole peer
process: one peer's clock is right, the control; the others' are 5 s fast, 5 s slow, 1 s fast, and
the newcomer's 1 s slow), a peer is killed with SIGKILL in the middle of an all-reduce, and a
newcomer arrives two rounds later. Every peer averages on swarm time in (nearly) every round
before the kill, in one group. The survivors' rounds keep completing within a bound, the newcomer
catches up and contributes, and nobody gets a NaN or a diverged anchor. Meanwhile an organiser
watches with ``shoal status --json``: it sees every peer and the schedule's round, and the killed
peer's progress record drops out once it expires (one swarm for all of it: CI time; both looks run
beside the swarm, in the background, as an organiser's terminal would).

At 873d623 a peer 1 s fast never averaged once ("could not find a group" in every round) and a
peer 3 s or more off could not even bootstrap."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from examples.swarm_launcher import kill_process_group
from node.library.checkpoint import load_latest_valid
from node.observe.metrics import read_metrics
from protocols.schedule import RoundSchedule
from tests.integration.start_gate import gated, open_gate
from tests.integration.swarm import (
    FAKETIME,
    REPO,
    SKEWED_PEER,
    TINY,
    anchor_at,
    every_round_checkpoints,
    shoal_command,
    skewed,
    took_part,
    wait_until,
)

pytestmark = pytest.mark.integration

ROUND_S = 6.0
ALLREDUCE_TIMEOUT_S = 10.0
# A survivor's round record lands at most this long after the round's deadline: the all-reduce
# (bounded by its timeout), plus a re-sync download if the crash left the group's anchors apart.
LATE_BOUND_S = 2 * ALLREDUCE_TIMEOUT_S + ROUND_S
# A progress record is republished every period (node/api.py: min(5, max(1, round / 3)) s) and
# expires three periods after it was stored.
HEARTBEAT_PERIOD = min(5.0, max(1.0, ROUND_S / 3))
RECORD_TTL = 3 * HEARTBEAT_PERIOD
CLOCK_SLACK = 1.0
# Each peer's clock, off the true time (the ``shoal status`` look runs on the true one). Four
# peers at a quarter of a core each: their training needs one of the two cores (starved of CPU,
# matchmaking misses rounds for reasons that are not the clocks').
CLOCKS = {"a": None, "b": "+5s", "c": "-5s", "victim": "+1s", "joiner": "-1s"}
THROTTLE = ("--throttle", "4")


def clock_offset(name: str) -> float:
    """Seconds peer ``name``'s wall clock runs ahead of the true time in this test (0 without libfaketime)."""
    return float(CLOCKS[name].removesuffix("s")) if CLOCKS[name] and FAKETIME is not None else 0.0


ROUNDS_TOGETHER = 3  # rounds of all four before the kill: how often the wrong clocks averaged


def start_status(initial_peer: str, run_id: str) -> subprocess.Popen:
    """``shoal status --json`` started now; its snapshot is read with ``status_snapshot`` later (a
    look takes 5-20 s of process start-up on two busy cores: the swarm goes on meanwhile)."""
    return subprocess.Popen([*shoal_command(), "status", "--initial-peer", initial_peer, "--run-id", run_id, "--json"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def status_snapshot(look: subprocess.Popen) -> dict:
    try:
        out, err = look.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        look.kill()
        raise
    assert look.returncode == 0, err[-3000:]
    return json.loads(out)


def rounds_of(peer) -> dict[int, dict]:
    if not peer.metrics_path.exists():  # still starting
        return {}
    return {r["round"]: r for r in read_metrics(peer.metrics_path) if r["event"] == "round"}


@pytest.fixture
def config(tmp_path):
    text = TINY.read_text().replace("allreduce_timeout = 30.0", f"allreduce_timeout = {ALLREDUCE_TIMEOUT_S}")
    assert text != TINY.read_text()
    return every_round_checkpoints(tmp_path / "churn.toml", text=text)  # anchors compared at one round


@pytest.mark.timeout(420)
def test_wrong_clocks_then_a_kill_mid_allreduce_then_a_newcomer(swarm, config, request):
    common = ("--round-seconds", str(ROUND_S), *THROTTLE)

    def launch(name: str, initial: list[str] | None = None, gate: Path | None = None):
        """``gate``: the launcher's interpreter starts now, ``shoal run`` once the gate opens (start_gate.py)."""
        env = skewed(CLOCKS[name]) if CLOCKS[name] else None
        if env is not None and gate is not None:
            env = {**env, **gated(gate)}
        return swarm.start(name, *common, initial=initial, config=config, env=env,
                           program=SKEWED_PEER if env is not None else None)

    first = launch("a")
    address = first.wait_for_address()[:1]
    peers = [first] + [launch(n, address) for n in ("b", "c", "victim")]
    a, b, c, victim = peers

    # 1. Wait for rounds in which all four averaged together. The organiser looks once all four are
    # in the swarm (they formed a group of 4), while they go on averaging.
    def all_four() -> list[int]:
        return sorted(r for r, rec in rounds_of(a).items() if rec["group_size"] == 4)

    wait_until(lambda: len(all_four()) >= 1, 150, "the four peers never formed a group of 4")
    look = start_status(address[0], swarm.run_id)
    request.addfinalizer(lambda look=look: kill_process_group(look))
    wait_until(lambda: len(all_four()) >= ROUNDS_TOGETHER, ROUNDS_TOGETHER * ROUND_S + 60,
               f"the four peers never formed a group of 4 {ROUNDS_TOGETHER} times")
    start = next(r for r in read_metrics(a.metrics_path) if r["event"] == "start")["schedule_start"]
    ids = {p.name: next(r for r in read_metrics(p.metrics_path) if r["event"] == "start")["peer"] for p in peers}

    # The organiser's view: all four peers, the schedule's round, throughput adding up.
    snapshot = status_snapshot(look)
    assert snapshot["peers"] == 4 and {p["peer_id"] for p in snapshot["peer_list"]} == set(ids.values()), \
        json.dumps({**snapshot, "ids": ids}, indent=1)[:6000]
    assert snapshot["malformed"] == 0 and snapshot["round_seconds"] == ROUND_S, snapshot
    assert snapshot["round"] == RoundSchedule(start, ROUND_S).round_at(snapshot["time"]), snapshot
    for record in snapshot["peer_list"]:
        assert record["round"] in (snapshot["round"] - 1, snapshot["round"]), record  # one heartbeat old at most
        assert 0 <= record["last_seen_s"] <= RECORD_TTL + CLOCK_SLACK and record["mode"] == "full", record
    assert snapshot["tokens_per_s"] == pytest.approx(sum(p["tokens_per_s"] for p in snapshot["peer_list"]))

    schedule = RoundSchedule(start, ROUND_S)
    # The round after the current one: its deadline is 1 to 2 rounds away, its group long formed by then.
    crash_round = max(all_four()[-1], schedule.round_at(time.time())) + 1

    # 2. SIGKILL the victim (and its hivemind processes and p2pd) just after the crash round's
    # all-reduce began: the exchange starts at the deadline and takes 0.4-2 s here. 0.3 s after it,
    # not 0.05 s: a victim that led the crash round's matchmaking assembles the group at the deadline
    # on its own swarm clock, and killed 0.05 s after the true one it had sent the group to nobody
    # yet: the others matched again without it (a group of 3, averaged in 1.8 s) and the victim was
    # in no crash-round group (2 of 9 runs this session). At 0.3 s one follower or more has it. On an
    # idle machine the exchange may be over by then (the survivors then average with the victim).
    deadline = start + crash_round * ROUND_S
    time.sleep(max(0.0, deadline + 0.3 - time.time()))
    kill_process_group(victim.proc)
    killed_at = time.time()
    # The newcomer's interpreter starts now, behind a gate opened two rounds after the crash (below):
    # its imports (5-15 s on these two busy cores) overlap the wait; its `shoal run` begins then.
    # Without libfaketime it runs plain `shoal run`, started then.
    joiner_gate = swarm.root / "joiner.gate"
    gated_joiner = launch("joiner", address, gate=joiner_gate) if skewed(CLOCKS["joiner"]) is not None else None

    # The killed peer's record expires on its own: a look after its TTL no longer lists it (read
    # below; the newcomer may start meanwhile, and may be listed too).
    time.sleep(max(0.0, killed_at + RECORD_TTL + CLOCK_SLACK - time.time()))
    looked = time.time()
    look = start_status(address[0], swarm.run_id)
    request.addfinalizer(lambda look=look: kill_process_group(look))

    # 3. A newcomer two rounds later. Once it has contributed to a round, everybody trains until a
    # later round that all four averaged in (the next one, unless a starved follower found no group
    # there: it then holds the step only after it replays it); then all four get Ctrl+C after that
    # round (as long as start-up takes, but no longer: CI time).
    time.sleep(max(0.0, deadline + 2 * ROUND_S - time.time()))
    joiner_started = time.time()
    if gated_joiner is not None:
        open_gate(joiner_gate)
    joiner = gated_joiner or launch("joiner", address)
    after_the_kill = status_snapshot(look)
    print(f"shoal status after the kill took {time.time() - looked:.1f}s")

    def contributions() -> list[int]:
        joined = rounds_of(joiner)
        return [r for r in sorted(joined) if joined[r]["applied"] == "averaged" and joined[r]["group_size"] >= 2]

    def averaged_by_all() -> list[int]:
        """Rounds after the newcomer's first contribution in which all four applied their group's average."""
        per_peer = [rounds_of(p) for p in (a, b, c, joiner)]
        return [r for r in sorted(per_peer[-1]) if r > contributions()[0]
                and all(r in rounds and rounds[r]["applied"] == "averaged" for rounds in per_peer)]

    last_round = None
    try:
        wait_until(contributions, 9 * ROUND_S, "the newcomer never contributed")
        wait_until(averaged_by_all, 6 * ROUND_S, "the four peers did not average together again")
        last_round = averaged_by_all()[0]
    except TimeoutError:
        contributed = bool(contributions())
        behind = [joiner] if not contributed else [a, b, c, joiner]
        pytest.fail(f"{'no round averaged by all four after' if contributed else 'no contribution from'} the "
                    f"newcomer by {[p.name for p in behind]} (crash round {crash_round}):\n"
                    + "\n".join(f"--- {p.name} (exit {p.proc.poll()}), rounds {sorted(rounds_of(p))}:\n{p.log()[-2500:]}"
                                 for p in behind))
    for peer in (a, b, c, joiner):  # started without --max-rounds: Ctrl+C them now, at the same round
        peer.interrupt()
    for peer in (a, b, c, joiner):
        assert peer.wait(timeout=60) == 0, peer.log()[-3000:]

    survivors = {p.name: rounds_of(p) for p in (a, b, c)}
    victim_id = ids["victim"]

    # The clocks: from the first round all four trained from its start to the one before the crash,
    # every peer took part in (nearly) every round (target: >= 90%), in a group of all four: a
    # starved 2-core machine may make a follower miss one round's leader (as in test_swarm), no more.
    victim_rounds = rounds_of(victim)
    together = range(max(min(rounds_of(p)) for p in peers) + 1, crash_round)
    assert len(together) >= ROUNDS_TOGETHER - 1, (together, all_four())
    for name, rounds in {**survivors, "victim": victim_rounds}.items():
        joined = [r for r in together if r in rounds and took_part(rounds[r])]
        assert len(joined) >= len(together) - 1, (name, CLOCKS[name], {r: rounds.get(r) for r in together})
        assert any(rounds[r]["group_size"] == 4 for r in joined), (name, [rounds[r]["group_size"] for r in joined])
    if FAKETIME is not None:
        # 5 s off is past hivemind's 3 s bootstrap tolerance: the peer started again on its peer's
        # time; the offset was measured and told (once); the right clock was left alone.
        for peer, word in ((b, "ahead of"), (c, "behind")):
            log = peer.log()
            clock_lines = "\n".join(line for line in log.splitlines() if "clock" in line)
            print(f"--- {peer.name}:\n{clock_lines}")
            assert re.search(rf"clock is (4\.[89]|5\.[01])s {word} its initial peer's: starting again", log), clock_lines
            # The swarm's estimate: a median of round trips to peers on a loaded 2-core machine, within
            # half a second of the true 5 s (the design tolerates a second).
            assert re.search(rf"clock is (4\.[5-9]|5\.[0-5])s {word} the swarm's", log), clock_lines
        assert "NTP" not in a.log()

    # The victim was in the crash round's group: it died after matchmaking, mid-exchange. In some
    # survivor's record, or in none when it led them all: a follower whose leader's group message
    # the kill cut off ends its round with "Unable to run All-Reduce" and no group (seen in full
    # runs: a and b so, c in a group of four with the victim, its average 75% partial; once all
    # three so).
    cut_off = "Unable to run All-Reduce"
    assert any(victim_id in rounds[crash_round]["group"] for rounds in survivors.values()) or all(
        cut_off in (rounds[crash_round]["error"] or "") for rounds in survivors.values()), json.dumps(
        {p: {r: rounds.get(r) for r in range(crash_round - 1, crash_round + 2)} for p, rounds in survivors.items()})

    # Survivors: every round completed, none later than the bound, no NaN anywhere.
    worst = 0.0
    for name, rounds in survivors.items():
        for r in range(crash_round - 1, last_round + 1):
            record = rounds[r]
            late = record["time"] - clock_offset(name) - (start + r * ROUND_S)
            worst = max(worst, late)
            assert late <= LATE_BOUND_S, (name, r, late, record)
            assert record["loss"] is not None and math.isfinite(record["loss"]), (name, r, record)
    print(f"crash at round {crash_round} (+{killed_at - deadline:.2f}s): survivors' latest round record "
          f"{worst:.1f}s after its deadline (bound {LATE_BOUND_S:.0f}s); crash-round records: "
          + ", ".join(f"{n}: {rs[crash_round]['applied']} group {rs[crash_round]['group_size']} "
                      f"{rs[crash_round]['time'] - deadline:.1f}s" for n, rs in survivors.items()))

    # The victim's heartbeat expired on its own: every survivor saw it leave, within 3 periods
    # of the heartbeat (min(5, round/3) s) after the kill, plus one period to notice.
    period = min(5.0, max(1.0, ROUND_S / 3))
    for peer in (a, b, c):
        left = [r for r in read_metrics(peer.metrics_path) if r["event"] == "peer_leave" and r["other"] == victim_id]
        # A record's time is the peer's own wall clock: a clock 5 s fast writes it 5 s late.
        assert left and left[0]["time"] - clock_offset(peer.name) - killed_at <= 4 * period + 2, (peer.name, left)

    # The newcomer downloaded the state, then contributed to a group with everybody.
    joined = rounds_of(joiner)
    contributed = [r for r in sorted(joined) if joined[r]["applied"] == "averaged" and joined[r]["group_size"] >= 2]
    assert contributed, joined
    first_contribution = joined[contributed[0]]
    print(f"joiner: first contribution in round {contributed[0]}, "
          f"{first_contribution['time'] - joiner_started:.1f}s after its start")
    download = [r for r in read_metrics(joiner.metrics_path) if r["event"] == "state_download"]
    assert download, "the newcomer did not download the swarm's state"
    # Once the newcomer contributes, a divergence is repaired in the round it is found: on a busy
    # machine an all-reduce can still lose a part (a late sender), leaving members' averages apart;
    # the next round's check finds it and the peers apart re-sync or replay (seen in CI).
    ids["joiner"] = next(r for r in read_metrics(joiner.metrics_path) if r["event"] == "start")["peer"]
    seen = {p["peer_id"] for p in after_the_kill["peer_list"]}
    assert seen - {ids["joiner"]} == {ids["a"], ids["b"], ids["c"]}, after_the_kill
    by_id = {ids[name]: rounds for name, rounds in {**survivors, "joiner": joined}.items()}

    def repaired(rounds: dict, found: int) -> bool:
        """The peer found apart in round ``found`` re-synced or replayed in that round or, if that
        round did not apply for it (its own result partial, folded), by its next averaged round:
        never an averaged round still apart."""
        for r in sorted(k for k in rounds if k >= found):
            if rounds[r].get("resynced") or rounds[r].get("caught_up"):
                return True
            if rounds[r]["applied"] == "averaged":
                return False
        return False

    for r in contributed:
        for record in (joined[r], survivors["a"][r]):
            for apart in record["diverged"]:
                theirs = by_id[apart]
                shown = {k: {f: theirs[k].get(f) for f in ("applied", "group_size", "resynced", "caught_up",
                                                           "diverged", "error")} for k in sorted(theirs) if k >= r}
                assert repaired(theirs, r), (r, apart, record, shown)

    # Final anchors: everybody (joiner included) holds the same model after the last round, finite,
    # and saved it when it left.
    anchors = {}
    for peer in (a, b, c, joiner):
        checkpoint = load_latest_valid(peer.checkpoint_dir)
        assert checkpoint is not None and checkpoint.round >= last_round, peer.name
        anchors[peer.name] = anchor_at(peer, last_round)
        assert torch.isfinite(anchors[peer.name]).all(), peer.name
    scale = anchors["a"].square().mean().sqrt()
    for x, y in itertools.combinations(anchors, 2):
        rms = (anchors[x] - anchors[y]).square().mean().sqrt()
        assert rms <= 1e-3 * scale, (x, y, float(rms), float(scale))
    if FAKETIME is None:
        pytest.skip("libfaketime is not installed here (apt-get install faketime): the kill and the newcomer "
                    "were checked, with every clock right; wrong clocks were not")
