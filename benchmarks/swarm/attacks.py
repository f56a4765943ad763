"""Attacks on a training swarm, end to end: three honest ``shoal run`` peers and one hostile peer
(``tests/integration/hostile_node.py``: a whole node with a hostile twist), against a clean run of
the same length, all in one run.

    .venv/bin/python -m benchmarks.swarm.attacks [--rounds 12] [--round-seconds 5] [--throttle 4] [--only clean,flip]
        [--peers 4] [--group-size 0] [--out benchmarks/results/attacks]

For each scenario the honest peers must stay alive (exit 0), stay on schedule (train every round,
average in most), never adopt the attacker's state (their final anchors agree with each other and
the eval loss stays near the clean run's), and name the attacker in their logs. Scenarios:

- ``clean``: four honest peers (``--peers``), robust aggregation (``centered_clip``, the default): the reference.
- ``clean-mean``: the same with ``averaging.aggregation = "mean"`` (hivemind's weighted mean, with
  shoal's part checks): what robust aggregation costs a clean run, in all-reduce time and eval loss.
- ``clean-unsigned``: the same as ``clean`` with every peer's claims unsigned and unchecked
  (hostile_node's ``unsigned``, test-only): what signed claims cost a clean run, in all-reduce time
  and join time (a peer's start to its first averaged round).
- ``three-honest``: the three honest peers alone: what is left when the attacker is shut out.
- one per attack of ``hostile_peer.ATTACKS`` (scale, flip, noise, nan, shape, weight, lie, short), and
  hostile_node's ``hijack`` (a consistent liar about its anchor, in its claims and its state),
  ``forged-leader`` (the hijacker, leading groups whose other members' claims it forges),
  ``donor-scale`` / ``donor-momentum`` (a member serving a state of scale 1e300, or with momentum
  values of 1e6), ``sybil`` (a member publishing five more identities' records claiming a day of
  sync lateness) and ``clock`` (a member running five more identities whose records' DHT pings answer
  the time + 3000 s: ``tests/integration/clock_liars.py``). In the two donor scenarios a fourth honest peer (``late``) starts ``--late-rounds``
  rounds after the others and must download the swarm's state.
- hostile_node's ``far-state`` and ``fake-state``, for sub-groups (``--group-size``): a member whose
  anchor in its groups' all-reduce is its own x 10, claimed too (``far-state``: the far-member rule
  must give it weight 0) or under an honest claim (``fake-state``: CenteredClip on the state's parts
  must bound it). Counted from the honest peers' logs: the groups in which they found it far, the
  groups whose reducers clipped its parts, and the rounds whose group state their check refused.

``--peers N`` (default 4) runs N - 1 honest peers beside the attacker (N honest in the clean runs, of
which the first N - 1 are measured), ``--group-size G`` sets ``averaging.target_group_size`` (sub-groups;
0: one group of everybody). Throttle the peers so that N / throttle stays about one core (6 peers:
``--throttle 6``) and write a run with another shape elsewhere than the default results:

    .venv/bin/python -m benchmarks.swarm.attacks --peers 6 --group-size 3 --throttle 6 \
        --only clean,far-state,fake-state --out benchmarks/results/attacks_far_state

Loopback, no link caps (the attacks are about content, not bandwidth); every peer throttled so
that the swarm's training needs about one of the machine's cores. The final eval loss is each
honest peer's final checkpoint on the config's held-out batches, computed here after the swarm
has exited (the three honest peers started at once; ``late``'s anchor is compared with theirs).
Writes ``benchmarks/results/attacks.md`` and ``.json`` (rewritten after each run; ``--report-only``
redraws the tables from it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.common.results import CONFIGS, REPO, command_line, write_results
from benchmarks.common.results import RESULTS as RESULTS_DIR
from benchmarks.common.swarm import CpuMeter, Evaluator, start_entry_peer, write_config
from examples.swarm_launcher import LocalSwarm, kill_process_group
from node.library.checkpoint import load_latest_valid
from node.library.resume import MOMENTUM_PREFIX
from node.observe.metrics import read_metrics
from tests.integration.hostile_peer import ATTACKS

RESULTS = RESULTS_DIR / "attacks"
HONEST = 3  # the default shape's honest peers (--peers 4)
CLEAN = ("clean", "clean-mean", "clean-unsigned", "three-honest")
# What each attack does, and what it did before shoal's defences, with the issue that fixed it.
WHAT = {
    "scale": ("its parts x1000", "its part became the average (issue 11)"),
    "flip": ("its parts x-50", "accepted: it passed the only check (finite, RMS <= 100x ours) (issue 11)"),
    "noise": ("its parts + 99x noise", "accepted, same check (issue 11)"),
    "nan": ("a NaN in each part", "the round folded for everyone, every round: the run stalled (issue 11)"),
    "shape": ("parts of shape [1]", "hivemind broadcast them; honest senders waited out the timeout (issue 11)"),
    "weight": ("sign-flipped parts, weight 1e30", "its part became the average (issue 11)"),
    "lie": ("as a reducer, returns average + 1e4", "honest peers applied it (issue 11)"),
    "short": ("as a reducer, ends each answer stream one part early",
              "every member's round came back partial, every round, and it was never banned (issue 29)"),
    "hijack": ("claims a poisoned anchor one step ahead and serves it as its state",
               "a claimed step count won every tie; a re-sync or joiner could adopt its state (issue 11)"),
    "forged-leader": ("the hijacker, leading: relays the other members' claims rewritten as its own",
                      "each follower saw 3 of 4 members claim the leader's anchor and re-synced to its state "
                      "(issue 29)"),
    "donor-scale": ("serves its true state claiming a scale of 1e300",
                    "its slices agreed with every state; a fresh joiner adopted its scale (issue 29)"),
    "donor-momentum": ("serves its true anchor and claim, every other momentum value 1e6",
                       "a joiner adopted the momentum (issue 29)"),
    "sybil": ("publishes 5 more identities' records: sync lateness 86400 s, 1000 steps ahead",
              "5 of the 9 lateness figures each peer read: its sync period would be 17,280 rounds, no averaging "
              "(issue 29)"),
    "clock": ("runs 5 more identities whose records' DHT pings answer the time + 3000 s",
              "5 of the 7 clocks each peer measured: every honest peer moved an hour, rounds 11 -> 311 (issue 54)"),
    "far-state": ("sub-groups: claims and sends its anchor x10 in the state it averages",
                  "not run before; the far-member rule (issue 32) gives its state weight 0"),
    "fake-state": ("sub-groups: sends its anchor x10 in the state it averages, under an honest claim",
                   "not run before; CenteredClip on the state's parts bounds it (issue 32)"),
}
HOSTILE = (*ATTACKS, "hijack", "forged-leader", "donor-scale", "donor-momentum", "sybil", "clock", "far-state",
           "fake-state")  # hostile_node's modes
STATE_ATTACKS = ("far-state", "fake-state")
# What the honest peers' logs say about a member's state in sub-group rounds (averaging.network.hivemind.allreduce,
# averaging.engine.mixing.state_problem).
FAR_LINE = "are far from the others'"
CLIPPED_LINE = "clipped outlying parts of"
REFUSED_STATE = "than the members' claims allow"
CLOCK_MOVED = re.compile(r"swarm time: this clock is ([-+][0-9.]+)s off")
LATE = ("donor-scale", "donor-momentum")  # scenarios with a late honest joiner


def base(name: str) -> str:
    """A scenario's kind: ``clean#2`` is a second clean run (the spread between clean runs is the
    noise the attacks' differences must be read against)."""
    return name.split("#")[0]


def run_scenario(name: str, args, root: Path, evaluator: Evaluator) -> dict:
    kind = base(name)
    attack = kind if kind in HOSTILE else None
    folder = name.replace("#", "-")
    overrides = {"inner.total_rounds": float(args.rounds), "inner.warmup_rounds": 0.1 * args.rounds,
                 "round.seconds": args.round_seconds, "train.seed": 0, "train.eval_every_rounds": 10**6,
                 "train.checkpoint_every_rounds": 10**6,
                 "averaging.aggregation": "mean" if kind == "clean-mean" else "centered_clip"}
    if args.group_size:
        overrides["averaging.target_group_size"] = args.group_size
    honest_count = args.peers - 1
    config = write_config(args.config, root / f"{folder}.toml", overrides)
    swarm = LocalSwarm(root / folder, run_id=f"attacks-{folder}-{uuid.uuid4().hex[:6]}", cwd=REPO)
    entry = None
    common = ("--throttle", str(args.throttle), "--max-rounds", str(args.rounds))
    node = [sys.executable, "-m", "tests.integration.hostile_node"]
    honest_program = [*node, "unsigned"] if kind == "clean-unsigned" else None
    started: dict[str, float] = {}

    def start(peer_name: str, program: list[str] | None):
        started[peer_name] = time.time()
        return swarm.start(peer_name, *common, config=config, initial=address, program=program)

    try:
        with CpuMeter() as cpu:
            entry, address = start_entry_peer(root / folder, None)
            # The first peer organises the run; the others start once it has (two peers started at
            # the same moment can both organise it, and then a third refuses to choose).
            peers = [start("honest-0", honest_program)]
            peers[0].wait_for_address(timeout=180)
            peers += [start(f"honest-{i}", honest_program) for i in range(1, honest_count)]
            if kind != "three-honest":
                peers.append(start("attacker", [*node, attack]) if attack else
                             start(f"honest-{honest_count}", honest_program))
            for peer in peers:
                peer.wait_for_address(timeout=180)
            if kind in LATE:  # a joiner, once the swarm has taken a few outer steps
                time.sleep(args.late_rounds * args.round_seconds)
                peers.append(start("late", None))
                peers[-1].wait_for_address(timeout=180)
            codes = {p.name: p.wait(timeout=args.rounds * args.round_seconds + 300) for p in peers}
    finally:
        swarm.kill_all()
        if entry is not None:
            kill_process_group(entry.proc)
    honest = [p for p in peers if p.name.startswith("honest-")][:honest_count]
    watched = honest + [p for p in peers if p.name == "late"]  # the honest peers whose state is checked
    attacker = next((p for p in peers if p.name == "attacker"), None)
    attacker_id = _peer_id(attacker.maddrs) if attacker else None
    records = {p.name: [r for r in read_metrics(p.metrics_path) if r.get("event") == "round"] for p in watched}
    rounds = {n: records[n] for n in (p.name for p in honest)}
    logs = {p.name: p.log() for p in watched}
    finals, anchors, momentum_rms = {}, {}, {}
    for p in watched:
        checkpoint = load_latest_valid(p.checkpoint_dir)
        if checkpoint is not None:
            if p in honest:
                finals[p.name] = evaluator.evaluate(checkpoint.params)
            anchors[p.name] = torch.cat([t.flatten().float() for t in checkpoint.params.values()])
            momentum = [t.flatten().double() for k, t in checkpoint.outer_state.items() if k.startswith(MOMENTUM_PREFIX)]
            momentum_rms[p.name] = float(torch.cat(momentum).square().mean().sqrt()) if momentum else None
    names = sorted(anchors)
    spread = max((float((anchors[a] - anchors[b]).norm() / anchors[a].norm())
                  for a in names for b in names if a < b), default=None)
    # How far the late joiner's final anchor is from the nearest of the others' (relative L2).
    late_gap = min((float((anchors["late"] - anchors[n]).norm() / anchors[n].norm()) for n in names if n != "late"),
                   default=None) if "late" in anchors else None
    allreduce = [r["allreduce_s"] for recs in rounds.values() for r in recs if r.get("applied") == "averaged"]
    robust: dict[str, int] = {}
    for recs in records.values():
        for r in recs:
            for key, n in (r.get("robust") or {}).items():
                robust[key] = robust.get(key, 0) + n
    return {
        "scenario": name, "exit_codes": codes, "cpu": cpu.summary(),
        "last_round": {n: max((r["round"] for r in recs), default=0) for n, recs in records.items()},
        "rounds_trained": {n: len(recs) for n, recs in records.items()},
        "averaged": {n: sum(r.get("applied") == "averaged" for r in recs) for n, recs in records.items()},
        "resyncs": {n: sum(bool(r.get("resynced")) for r in recs) for n, recs in records.items()},
        "caught_up": {n: sum(r.get("caught_up", 0) for r in recs) for n, recs in records.items()},
        "attacker_in_group": {n: sum(attacker_id in (r.get("group") or []) for r in recs)
                              for n, recs in records.items()} if attacker_id else {},
        "robust": robust,
        "honest_tokens": sum(r["tokens"] for recs in rounds.values() for r in recs),
        "median_allreduce_s": statistics.median(allreduce) if allreduce else None,
        "join_s": {n: _join_s(recs, started[n]) for n, recs in records.items()},
        # Rounds an honest peer stayed out of because the swarm's sync lateness set a period over 1.
        "out_for_sync_period": {n: sum("divisible by" in (r.get("error") or "") for r in recs)
                                for n, recs in records.items()},
        # Groups refused (a forged one: its leader relayed forged metadata; logged once per reason)
        # and the peers that banned a leader for it.
        "groups_refused": {n: sum("refused group" in line for line in log.splitlines()) for n, log in logs.items()},
        "banned_forged_leader": sorted(n for n, log in logs.items() if attacker_id and any(
            "led a group with forged metadata" in line and attacker_id in line for line in log.splitlines())),
        "momentum_rms": momentum_rms, "late_anchor_gap": late_gap,
        # Downloaded states (a join or a re-sync) the whole-state checks refused after assembly.
        "states_refused": sum(1 for log in logs.values() for line in log.splitlines()
                              if "refused the swarm's state" in line or "refused the state of" in line),
        "final_eval": finals, "anchor_spread": spread,
        # The farthest each honest peer's swarm time moved from its own clock (all share one clock here).
        "clock_moved_s": {n: max((abs(float(x)) for x in CLOCK_MOVED.findall(log)), default=0.0)
                          for n, log in logs.items()},
        "attacker": attacker_id,
        "attacker_named_in": sorted(n for n, log in logs.items() if attacker_id and attacker_id in log),
        # States the honest peers assembled with slices the attacker served (must stay 0).
        "attacker_state_used": sum(1 for log in logs.values() for line in log.splitlines()
                                   if attacker_id and "assembled from" in line and attacker_id in line),
        "attacker_exit": codes.get("attacker"),
        # Sub-group state (far-state / fake-state): per honest peer, groups whose reducers found a member
        # far (and found the attacker far), groups whose reducers clipped the attacker's parts, and
        # rounds whose group state its own check refused (the round folded).
        "far_flags": {n: _lines(log, FAR_LINE) for n, log in logs.items()},
        "far_flags_attacker": {n: _lines(log, FAR_LINE, attacker_id) for n, log in logs.items()} if attacker_id else {},
        "clipped_attacker": {n: _lines(log, CLIPPED_LINE, attacker_id) for n, log in logs.items()} if attacker_id else {},
        "state_refused": {n: sum(REFUSED_STATE in (r.get("error") or "") for r in recs) for n, recs in records.items()},
        "group_sizes": sorted({len(r.get("group") or []) for recs in records.values() for r in recs
                               if r.get("applied") == "averaged"}),
    }


def _lines(log: str, marker: str, peer: str | None = "") -> int:
    """Lines of ``log`` with ``marker`` (and ``peer``'s id, when given)."""
    return sum(marker in line and (peer or "") in line for line in log.splitlines())


def _join_s(records: list[dict], started: float) -> float | None:
    """From a peer's start to the end of its first averaged round (that round's metrics line)."""
    averaged = [r["time"] for r in records if r.get("applied") == "averaged"]
    return min(averaged) - started if averaged else None


def _peer_id(maddrs: list[str]) -> str | None:
    match = next((re.search(r"/p2p/(\w+)", m) for m in maddrs), None)
    return match.group(1) if match else None


def _at_equal_tokens(runs: dict[str, dict]) -> list[str]:
    """Each attack run's final eval against what attacker-free runs (clean, three-honest,
    clean-mean) reach with as many honest tokens: a least-squares line through them. On a shared
    machine the attacker's process takes CPU from the honest peers, which then train fewer tokens
    in the same rounds; this separates that from what the attack does to the model."""
    free = [(r["honest_tokens"], _mean(r["final_eval"].values())) for n, r in runs.items()
            if base(n) in CLEAN and r.get("honest_tokens") and r["final_eval"]]
    if len(free) < 3:
        return []
    mean_x = sum(x for x, _ in free) / len(free)
    mean_y = sum(y for _, y in free) / len(free)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in free) / sum((x - mean_x) ** 2 for x, _ in free)
    predict = lambda x: mean_y + slope * (x - mean_x)  # noqa: E731
    spread = max(abs(y - predict(x)) / predict(x) for x, y in free)
    lines = ["", "## At equal honest tokens", "",
             f"A line through the {len(free)} attacker-free runs (final eval vs tokens the honest peers trained; "
             f"{slope * 1e5:+.3f} per 100k tokens; those runs lie within ±{spread:.1%} of it) gives what each "
             "run would reach without the attack with as many tokens:", "",
             "| run | honest tokens | final eval | expected | gap |", "|---|---|---|---|---|"]
    for name, run in runs.items():
        final = _mean(run["final_eval"].values())
        if base(name) in HOSTILE and run.get("honest_tokens") and final is not None:
            expected = predict(run["honest_tokens"])
            lines.append(f"| {name} | {run['honest_tokens']:,} | {final:.4f} | {expected:.4f} "
                         f"| {100 * (final - expected) / expected:+.1f}% |")
    return lines


def _peers(run: dict) -> list[str]:
    """The watched honest peers in the table's order: those started at once, then ``late``."""
    return sorted(run["rounds_trained"], key=lambda n: (n == "late", n))


def _late(run: dict) -> dict | None:
    """``late``'s figures, with the others' momentum RMS beside its own (None without a late peer)."""
    if "late" not in run["rounds_trained"]:
        return None
    others = [v for n, v in run["momentum_rms"].items() if n != "late" and v is not None]
    return {"join_s": run["join_s"].get("late"), "trained": run["rounds_trained"]["late"],
            "averaged": run["averaged"]["late"], "momentum_rms": run["momentum_rms"].get("late"),
            "others_momentum_rms": statistics.median(others) if others else None}


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _issue_29(runs: dict[str, dict]) -> list[str]:
    """What issue 29's checks did in each run of its attacks."""
    rows = [(n, r) for n, r in runs.items() if base(n) in ("forged-leader", *LATE, "sybil", "short")]
    if not rows:
        return []
    lines = ["", "## Issue 29's attacks", "",
             "Groups refused: log lines `refused group` of the honest peers (one per leader and reason). "
             "Out for the sync period: rounds an honest peer stayed out of because the swarm's syncs "
             "(the median of the lateness its acquaintances publish) seemed to need a period over 1. "
             "`late`: the joiner of the donor scenarios: from its start to its first averaged round, its final "
             "anchor's relative L2 distance from the nearest other honest peer's, and its final momentum's RMS beside "
             "the median of the other honest peers'. States refused: downloaded states (joins and re-syncs) that the "
             "whole-state checks refused once assembled.", "",
             "| run | groups refused (per honest peer) | banned it for a forged group | out for the sync period "
             "| late: join (s) | late: rounds trained / averaged | late: anchor distance | late: momentum RMS (others') "
             "| states assembled with its slices | states refused | re-syncs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in rows:
        peers = _peers(run)
        late = _late(run)
        refused = " / ".join(str(run["groups_refused"].get(n, 0)) for n in peers)
        out = " / ".join(str(run["out_for_sync_period"].get(n, 0)) for n in peers)
        banned = f"{len(run['banned_forged_leader'])} of {len(peers)}"
        late_cells = ("-", "-", "-", "-") if late is None else (
            _number(late["join_s"], ".1f"), f"{late['trained']}/{late['averaged']}",
            _number(run["late_anchor_gap"], ".1e"),
            f"{_number(late['momentum_rms'], '.2e')} ({_number(late['others_momentum_rms'], '.2e')})")
        lines.append(f"| {name} | {refused} | {banned} | {out} | {' | '.join(late_cells)} "
                     f"| {run['attacker_state_used']} | {run['states_refused']} | {sum(run['resyncs'].values())} |")
    return lines


# The clean runs of the results before issue 29's defences (benchmarks/results/attacks.md at 6f0594d,
# same command but --throttle 5): their median all-reduce, seconds. Join times were not recorded then.
BEFORE_ISSUE_29 = {"commit": "6f0594d", "median_allreduce_s": {"clean": 0.230, "clean#2": 0.244}}


def _cost_of_checks(runs: dict[str, dict]) -> list[str]:
    """Clean runs with and without signed claims: all-reduce time and join time."""
    rows = [(n, r) for n, r in runs.items() if base(n) in ("clean", "clean-unsigned")]
    if not rows:
        return []
    lines = ["", "## What the checks cost a clean run", "",
             "Join: from a peer's start to the end of its first averaged round (median over the peers started at "
             "once). The all-reduce's median is over every averaged round of the measured honest peers. "
             f"The last rows are the clean runs before issue 29's defences (results at {BEFORE_ISSUE_29['commit']}).",
             "", "| run | signed claims | median all-reduce (s) | median join (s) | honest tokens | final eval |",
             "|---|---|---|---|---|---|"]
    for name, run in rows:
        joins = [v for v in run["join_s"].values() if v is not None]
        lines.append(f"| {name} | {'no' if base(name) == 'clean-unsigned' else 'yes'} "
                     f"| {_number(run['median_allreduce_s'], '.3f')} "
                     f"| {_number(statistics.median(joins) if joins else None, '.1f')} | {run['honest_tokens']:,} "
                     f"| {_number(_mean(run['final_eval'].values()), '.4f')} |")
    for name, seconds in BEFORE_ISSUE_29["median_allreduce_s"].items():
        lines.append(f"| {name} at {BEFORE_ISSUE_29['commit']} | no (before issue 29) | {seconds:.3f} | - | - | - |")
    return lines


def _sub_groups(runs: dict[str, dict]) -> list[str]:
    """What the far-member rule, CenteredClip and the members' check did in the sub-group runs."""
    rows = [(n, r) for n, r in runs.items() if "far_flags" in r and (base(n) in STATE_ATTACKS or base(n) in CLEAN)]
    if not any(base(n) in STATE_ATTACKS for n, _ in rows):
        return []
    lines = ["", "## Sub-group state attacks", "",
             "Per honest peer, from its log: groups whose reducers found a member's claimed anchor far "
             f"(`{FAR_LINE}`; the attacker's, of them), groups whose reducers clipped the attacker's parts "
             f"(`{CLIPPED_LINE}`, one line per reducer and group, pseudo-gradient parts included), and rounds whose "
             f"group state its own check refused (`state_problem`: `{REFUSED_STATE}`; the round folded). "
             "Group sizes: of the honest peers' averaged rounds.", "",
             "| run | far flags (the attacker's) | attacker's parts clipped | states refused "
             "| rounds trained / averaged | attacker in groups | group sizes | final eval |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in rows:
        peers = _peers(run)
        far = " / ".join(f"{run['far_flags'].get(n, 0)} ({run['far_flags_attacker'].get(n, 0)})"
                         if run["attacker"] else str(run["far_flags"].get(n, 0)) for n in peers)
        clipped = " / ".join(str(run["clipped_attacker"].get(n, 0)) for n in peers) if run["attacker"] else "-"
        refused = " / ".join(str(run["state_refused"].get(n, 0)) for n in peers)
        trained = " / ".join(f"{run['rounds_trained'][n]}/{run['averaged'][n]}" for n in peers)
        in_groups = " / ".join(str(run["attacker_in_group"][n]) for n in peers) if run["attacker_in_group"] else "-"
        sizes = ", ".join(map(str, run.get("group_sizes") or [])) or "-"
        lines.append(f"| {name} | {far} | {clipped} | {refused} | {trained} | {in_groups} | {sizes} "
                     f"| {_number(_mean(run['final_eval'].values()), '.4f')} |")
    return lines


def _now(name: str, run: dict) -> str:
    """What the honest peers did against the attack, in a few words (the summary's "now")."""
    spread = run["anchor_spread"]
    split = f"; honest anchors split ({spread:.1e} apart)" if spread is not None and spread > 1e-2 else ""
    return _what_they_did(name, run) + split


def _what_they_did(name: str, run: dict) -> str:
    kind, peers = base(name), len(run["rounds_trained"])
    resyncs = f"{sum(run['resyncs'].values())} re-syncs"
    if kind == "forged-leader":
        return (f"{len(run['banned_forged_leader'])} of {peers} refused its forged groups and banned it; "
                f"{resyncs}, {run['attacker_state_used']} states with its slices")
    if kind in LATE:
        late = _late(run)
        if late is None:
            return "no joiner"
        return (f"{run['attacker_state_used']} states assembled with its slices, {run['states_refused']} refused; "
                f"the joiner ends {_number(run['late_anchor_gap'], '.1e')} from the others' anchor, momentum RMS "
                f"{_number(late['momentum_rms'], '.1e')} (others' {_number(late['others_momentum_rms'], '.1e')})")
    if kind == "sybil":
        out = sum(run["out_for_sync_period"].values())
        averaged = sum(run["averaged"].values())
        return f"sync period 1: {out} rounds out for it, {averaged} of {sum(run['rounds_trained'].values())} rounds averaged"
    if kind == "hijack":
        return f"kept in groups, outvoted; {resyncs}, {run['attacker_state_used']} states with its slices"
    if kind == "clock":
        moved = max(run.get("clock_moved_s", {}).values(), default=0.0)
        averaged = sum(run["averaged"].values())
        return (f"no honest clock moved over {moved:.2f} s; {averaged} of {sum(run['rounds_trained'].values())} "
                "rounds averaged")
    if kind in STATE_ATTACKS:
        flagged = sum(run["far_flags_attacker"].values())
        clipped = sum(run["clipped_attacker"].values())
        refused = sum(run["state_refused"].values())
        return (f"found far in {flagged} groups (honest peers' reducers, summed), its parts clipped in {clipped}, "
                f"{refused} group states refused by the members' check")
    return f"named by {len(run['attacker_named_in'])} of {peers}, banned {run['robust'].get('bans', 0)} times; {resyncs}"


def _summary(runs: dict[str, dict], clean: float | None) -> list[str]:
    """One row per attack run: what it did before, what the honest peers do now, the eval gap."""
    lines = ["", "## Summary", "", "| attack | before (fixed in) | now | eval vs clean |", "|---|---|---|---|"]
    for name, run in runs.items():
        if base(name) not in HOSTILE:
            continue
        final = _mean(run["final_eval"].values())
        versus = f"{100 * (final - clean) / clean:+.1f}%" if final is not None and clean else "-"
        lines.append(f"| {name} | {WHAT[base(name)][1]} | {_now(name, run)} | {versus} |")
    return lines


def _half_range(values: list[float]) -> float:
    return (max(values) - min(values)) / 2 / (sum(values) / len(values)) if len(values) > 1 else 0.0


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def report(results: dict) -> str:
    runs = {r["scenario"]: r for r in results["runs"]}
    cleans = [c for c in (_mean(r["final_eval"].values()) for n, r in runs.items() if base(n) == "clean")
              if c is not None]
    clean = _mean(cleans)
    honest = results.get("peers", HONEST + 1) - 1
    group_size = results.get("group_size", 0)
    groups = f", sub-groups of about {group_size} (`averaging.target_group_size`)" if group_size else ""
    lines = [
        f"# Attacks on a training swarm: {honest} honest peers and 1 hostile peer, against a clean run",
        "",
        f"Command: `{results['command']}` ({results['started']} to {results['ended']} UTC).",
        "",
        f"Each run: {results['rounds']} rounds of {results['round_seconds']} s, `benchmarks/configs/learning.toml` "
        f"(the tiny model){groups}, every peer throttle {results['throttle']}, loopback, through a `shoal bootstrap` entry "
        "peer: one honest peer organises the run, the others start together once it has. Honest peers: default "
        "robust aggregation (`centered_clip`, ban 10 rounds; signed claims, but in `clean-unsigned`). In the donor scenarios one more honest peer, `late`, "
        f"starts {results.get('late_rounds', 4):g} rounds after the others (listed last where a cell has one value per "
        "honest peer). Final eval: each honest peer's final checkpoint on the same held-out batches "
        "(mean over the honest peers); vs clean: against the mean of the `clean` runs "
        f"({', '.join(f'{c:.4f}' for c in cleans) or 'none'}). Anchor spread: the "
        "largest relative L2 distance between two honest peers' final anchors (`late`'s included).",
        "",
        "| scenario | attack | before (fixed in) | honest alive | rounds trained / averaged (per honest peer) "
        "| re-syncs | refused by robust aggregation | attacker in groups | attacker named in logs "
        "| states assembled with its slices | median all-reduce (s) | final eval | vs clean | anchor spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        what, before = WHAT.get(base(name), ("-", "-"))
        honest_codes = [c for n, c in run["exit_codes"].items() if n.startswith("honest") or n == "late"]
        final = _mean(run["final_eval"].values())
        versus = f"{100 * (final - clean) / clean:+.1f}%" if final is not None and clean else "-"
        trained = " / ".join(f"{run['rounds_trained'][n]}/{run['averaged'][n]}" for n in _peers(run))
        robust = ", ".join(f"{k} {v}" for k, v in sorted(run["robust"].items())) or "none"
        in_groups = " / ".join(str(run["attacker_in_group"][n]) for n in _peers(run)) if run["attacker_in_group"] else "-"
        named = f"{len(run['attacker_named_in'])} of {len(run['rounds_trained'])}" if run["attacker"] else "-"
        used = run.get("attacker_state_used", "-") if run["attacker"] else "-"
        median = f"{run['median_allreduce_s']:.2f}" if run["median_allreduce_s"] is not None else "-"
        spread = f"{run['anchor_spread']:.1e}" if run["anchor_spread"] is not None else "-"
        final_text = f"{final:.4f}" if final is not None else "-"
        lines.append(
            f"| {name} | {what} | {before} | {sum(c == 0 for c in honest_codes)} of {len(honest_codes)} | {trained} "
            f"| {sum(run['resyncs'].values())} | {robust} | {in_groups} | {named} | {used} | {median} "
            f"| {final_text} | {versus} | {spread} |")
    lines += ["", "## By scenario (mean over its runs; spread = half the range)", "",
              "| scenario | runs | final eval | spread | vs clean | attacker banned in (honest peers, all runs) | re-syncs per run |",
              "|---|---|---|---|---|---|---|"]
    by_base: dict[str, list[dict]] = {}
    for name, run in runs.items():
        by_base.setdefault(base(name), []).append(run)
    verdicts = []
    for kind, group in by_base.items():
        finals = [f for f in (_mean(r["final_eval"].values()) for r in group) if f is not None]
        if not finals:
            continue
        mean = sum(finals) / len(finals)
        spread = (max(finals) - min(finals)) / 2
        versus = f"{100 * (mean - clean) / clean:+.1f}%" if clean else "-"
        banned = sum(r["robust"].get("bans", 0) for r in group)
        resyncs = sum(sum(r["resyncs"].values()) for r in group) / len(group)
        lines.append(f"| {kind} | {len(finals)} | {mean:.4f} | ±{spread:.4f} | {versus} "
                     f"| {banned if kind in HOSTILE else '-'} | {resyncs:.1f} |")
        if kind in HOSTILE and clean:
            gap = 100 * (mean - clean) / clean
            verdicts.append(f"- {kind}: {mean:.4f} vs clean {clean:.4f}, {gap:+.1f}% -> "
                            f"{'met' if gap <= 5 else '**NOT met**'}")
    lines += ["", "Target (issue 11): the honest peers' final eval loss within 5% of a clean run of the same "
              f"length. The clean runs themselves differ by ±{_half_range(cleans):.1%} of their mean: a gap "
              "smaller than that is noise.", "", *verdicts]
    lines += _at_equal_tokens(runs)
    lines += _issue_29(runs)
    lines += _cost_of_checks(runs)
    lines += _sub_groups(runs)
    lines += _summary(runs, clean)
    lines += ["", "CPU (cores used by the swarm / the whole machine, of 2): "
              + "; ".join(f"{r['scenario']} {r['cpu']['own_cores']:.2f} / {r['cpu']['machine_busy_cores']:.2f}"
                          for r in results["runs"] if r.get("cpu")), ""]
    return "\n".join(lines)


def write(results: dict, out: Path = RESULTS, *, redraw: bool = False) -> None:
    write_results(results, out, report, redraw=redraw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--round-seconds", type=float, default=5.0)
    parser.add_argument("--throttle", type=float, default=4.0)
    parser.add_argument("--late-rounds", type=float, default=4.0,
                        help="how many rounds after the others the donor scenarios' joiner starts")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help="scenarios in order; NAME#K repeats one (default: every scenario, clean and "
                             "clean-unsigned twice; the sub-group ones only with --group-size)")
    parser.add_argument("--peers", type=int, default=HONEST + 1,
                        help="peers of a run: N - 1 honest and the attacker (N honest in the clean runs)")
    parser.add_argument("--group-size", type=int, default=0,
                        help="averaging.target_group_size (sub-groups; 0: one group of everybody)")
    parser.add_argument("--config", type=Path, default=CONFIGS / "learning.toml")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results path, without .md/.json")
    parser.add_argument("--report-only", action="store_true", help="redraw the table from the .json")
    args = parser.parse_args()
    if args.only is None:
        args.only = [*CLEAN, *(h for h in HOSTILE if h not in STATE_ATTACKS or args.group_size), "clean#2",
                     "clean-unsigned#2"]
    if args.report_only:
        write(json.loads(args.out.with_suffix(".json").read_text()), args.out, redraw=True)
        return 0
    unknown = {base(n) for n in args.only} - set(CLEAN) - set(HOSTILE)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}: choose from {', '.join([*CLEAN, *HOSTILE])}")
    if args.peers < 3 or args.group_size < 0 or args.group_size == 1:
        parser.error("--peers must be at least 3 and --group-size 0 or at least 2")
    if {base(n) for n in args.only} & set(STATE_ATTACKS) and not args.group_size:
        parser.error(f"{' and '.join(STATE_ATTACKS)} attack sub-group rounds: give --group-size")
    evaluator = Evaluator(args.config)
    results = {"command": command_line(__spec__.name), "rounds": args.rounds,
               "round_seconds": args.round_seconds, "throttle": args.throttle, "late_rounds": args.late_rounds,
               "peers": args.peers, "group_size": args.group_size, "runs": [],
               "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M")}
    root = Path(f"/tmp/shoal-attacks-{uuid.uuid4().hex[:6]}")
    root.mkdir(parents=True)
    for name in args.only:
        print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
        results["runs"].append(run_scenario(name, args, root, evaluator))
        results["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
        write(results, args.out)
        print(json.dumps({k: results["runs"][-1][k] for k in ("exit_codes", "final_eval", "robust", "resyncs")}),
              flush=True)
    print(f"wrote {args.out.with_suffix('.md')} (peers' logs in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
