"""Issue 32's one page: how shoal scales, from the three benchmarks that measure it.

    .venv/bin/python -m benchmarks.swarm.scale_report

reads the results of ``scale_real.py`` (real ``shoal run`` peers on this machine, after the
start-up fixes: ``scale_real_fixed.json``), ``dht_load.py`` (the heartbeat's DHT cost and entry
peers; with ``--shards``: ``dht_shards.json``, and ``dht_shards_auto.json``) and ``scale_sim.py`` (SIMULATED 64-1,024 peers) and writes ``benchmarks/results/scale.{md,json,png}``:
the figures an operator of a large run asks for, the issue's targets met or missed, and where it
breaks. It runs nothing: rerun the benchmarks (their commands are in the page) to refresh it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

from benchmarks.common.results import RESULTS, write_results
from benchmarks.swarm import scale_real

OUT = RESULTS / "scale"
# Real runs: after the start-up fixes, after the heartbeat's DHT fix as well, and (LATEST) 16 and 4
# peers again after the deferred scipy.optimize import (node.library.deferred_imports).
REAL_SOURCES = ("scale_real_fixed", "scale_real_heartbeat", "scale_real_boot")
LATEST = REAL_SOURCES[-1]
# Real runs with sub-groups (averaging.target_group_size, ``--group-size``) beside one group, side by side.
SUBGROUP_SOURCE = "scale_real_subgroups"
AFTER_HEARTBEAT_SOURCES = REAL_SOURCES[1:]
# scale_real_fixed's 12-peer run was appended after the heartbeat's fix (739263e) had landed.
AFTER_HEARTBEAT_FIX = {("scale_real_fixed", "n12-d0.4-cpuclock")}
SIM_TARGET_SHARE = 0.95  # issue 32: every round completes for >= 95% of live peers (simulated, 256, G=16)


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def real_rows(real: dict, *, source: str) -> list[dict]:
    """One row per real run of a results file (``source``: its name), sorted by churn, entry peers, N."""
    rows = []
    for key, run in real["runs"].items():
        s = scale_real.summary(run)
        group_size = int(match.group(1)) if (match := re.search(r"-g(\d+)", key)) else 0
        rows.append({"run": key, "source": source, "peers": run["peers_n"], "churn": run["churn"], "bootstraps": len(run.get("bootstraps") or [None]),
                     "group_size": group_size,
                     "join_s": s["join_s"], "after_boot_s": s["after_boot_s"], "boot_s": s["boot_s"],
                     "share_min": s["share_min"], "share_median": s["share_median"],
                     "resyncs": s["resyncs_run"], "whole_rounds": s["whole_rounds"], "window_rounds": s["window_rounds"],
                     "allreduce_p50": s["allreduce_p50"], "dht_io_kib_s": (s["dht_io"] or 0) / 1024,
                     "p2pd_io_kib_s": (s["p2pd_io"] or 0) / 1024, "pss_mib": s["pss"], "eval": s["eval"]})
    return sorted(rows, key=lambda r: (r["churn"], r["bootstraps"], r["peers"]))


def dht_rows(dht: dict) -> list[dict]:
    rows = []
    for run in dht["runs"]:
        per = run["per_peer"]
        rows.append({"peers": run["peers"], "policy": run["policy"], "bootstraps": run.get("bootstraps", 0),
                     "shards": run.get("shards", 1),
                     "io_kib_s": statistics.median(p["io_kib_s"] for p in per),
                     "io_max_kib_s": max(p["io_kib_s"] for p in per),
                     "period_s": statistics.median(p["period_s"] for p in per),
                     "seen_min": min(p["seen"] for p in per), "organisers": run.get("organisers"),
                     "entries_io_kib_s": [e["io_kib_s"] for e in run.get("entries", [])],
                     "keys_written": sorted({p["keys_written"] for p in per if "keys_written" in p}),
                     "keys_read": sorted({p["keys_read"] for p in per if "keys_read" in p})})
    return rows


def sim_rows(sim: dict) -> list[dict]:
    rows = []
    for r in sim["main"]:
        sc = r["scenario"]
        rows.append({"label": sc["label"].split(" | ")[0], "peers": sc["peers"], "churn": sc["churn"],
                     "share_mean": r["share_mean"], "share_min": r["share_min"],
                     "spread_done_median": r["spread_done_median"], "check_fires": r["check_fires"]})
    return rows


def targets(real: list[dict], sim: list[dict], twin_rounds: dict) -> list[tuple[str, str, bool]]:
    """The issue's targets, from the newest real runs (``LATEST``) and the simulation."""
    out = []
    base = [r for r in real if r["churn"] == 0 and r["bootstraps"] == 1 and r["source"] == LATEST
            and not r["group_size"]]
    four = next((r for r in base if r["peers"] == 4), None)
    sixteen = next((r for r in base if r["peers"] == 16), None)
    if sixteen:
        out.append(("16 real peers: every peer averages in >= 90% of rounds after warm-up",
                    f"lowest {sixteen['share_min']:.0%}", sixteen["share_min"] >= scale_real.TARGET_SHARE))
        out.append(("16 real peers: no re-sync in a fault-free run", f"{sixteen['resyncs']} re-syncs",
                    sixteen["resyncs"] == 0))
    if sixteen and four:
        ratio = sixteen["join_s"] / four["join_s"]
        boot_ratio = sixteen["after_boot_s"] / four["after_boot_s"]
        out.append(("16 real peers: join time within 2x of a 4-peer swarm's",
                    f"{ratio:.2f}x from process start ({sixteen['join_s']:.0f} s vs {four['join_s']:.0f} s); "
                    f"{boot_ratio:.2f}x from the end of boot", ratio <= scale_real.TARGET_JOIN_RATIO))
    for r in real:
        if r["source"] == SUBGROUP_SOURCE and r["group_size"] and r["peers"] == 16 and not r["churn"]:
            out.append((f"16 real peers in sub-groups (`averaging.target_group_size = {r['group_size']}`): every peer "
                        "averages in >= 90% of rounds after warm-up, no re-sync",
                        f"lowest {r['share_min']:.0%}, {r['resyncs']} re-syncs",
                        r["share_min"] >= scale_real.TARGET_SHARE and r["resyncs"] == 0))
    for row in sim:
        if row["peers"] == 256 and row["label"].startswith("sub-groups G=16"):
            out.append((f"SIMULATED 256 peers, {row['label']}, churn {row['churn']:g}/h per 100: >= 95% of live peers "
                        "complete every round", f"mean {row['share_mean']:.1%}, worst round {row['share_min']:.1%}",
                        row["share_min"] >= SIM_TARGET_SHARE))
    if twin_rounds:
        worst = max(twin_rounds.values())
        out.append(("SIMULATED: anchors agree within log16(N) + 2 rounds of a change (sub-groups of 16; 3.5, 4 and "
                    "4.5 rounds at 64, 256 and 1,024)",
                    ", ".join(f"N={n}: {r}" for n, r in sorted(twin_rounds.items())) + " rounds (max over seeds)",
                    all(r <= math.log(n, 16) + 2 for n, r in twin_rounds.items()) and worst < math.inf))
    return out


def twin_agreement(sim: dict) -> dict[int, int]:
    """Sub-groups of 16 (anchors averaged whole every round): the most rounds any seed of any change
    (a stale joiner, a failed group) took to agree again, by N."""
    worst: dict[int, int] = {}
    for twin in sim.get("twin", []):
        sc = twin["scenario"]
        if sc["mode"] == "groups" and sc["group_size"] == 16 and sc.get("anchor_slices", 1) == 1:
            agreed = twin["rounds_to_agree"] if twin["rounds_to_agree"] is not None else math.inf
            worst[sc["peers"]] = max(worst.get(sc["peers"], 0), agreed)
    return worst


def _dht_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    stalled = "; *stalled*" if row["seen_min"] < row["peers"] else ""
    return f"{row['io_kib_s']:.0f} ({row['io_max_kib_s']:.0f}){stalled}"


def report(summary: dict) -> str:
    real, dht, sim, met = summary["real"], summary["dht"], summary["sim"], summary["targets"]
    lines = ["# How shoal scales (issue 32)", "",
             "One page from three benchmarks; each figure's source has its command and the full tables. "
             "Written by `.venv/bin/python -m benchmarks.swarm.scale_report`.", "",
             "- Real peers: [scale_real_fixed.md](scale_real_fixed.md), and after the heartbeat's DHT fix "
             "[scale_real_heartbeat.md](scale_real_heartbeat.md), and again after the deferred import "
             "[scale_real_boot.md](scale_real_boot.md) (`" + summary["commands"]["real"] + "`); sub-groups beside one "
             "group: [scale_real_subgroups.md](scale_real_subgroups.md) (`" + summary["commands"]["subgroups"] + "`)",
             "- The heartbeat's DHT cost and entry peers: [dht_load.md](dht_load.md) (`" + summary["commands"]["dht"] + "`)",
             "- **Simulated** 64-1,024 peers: [scale_sim.md](scale_sim.md) (`" + summary["commands"]["sim"] + "`)", "",
             "## Targets", "", "| target | figure | met |", "|---|---|---|"]
    lines += [f"| {t} | {figure} | {'met' if ok else '**missed**'} |" for t, figure, ok in met]
    lines += ["", "## Real peers on this machine (2 cores, loopback, CPU-throttled training)", "",
              "| run | heartbeat | peers | join, s: first averaged (after boot) | averaged share: min / median | re-syncs | "
              "rounds in one group of all | all-reduce p50, s | DHT / p2pd I/O per peer, KiB/s | PSS per peer, MiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in real:
        after = r["source"] in AFTER_HEARTBEAT_SOURCES + (SUBGROUP_SOURCE,) or (r["source"], r["run"]) in AFTER_HEARTBEAT_FIX
        fix = ("after" if after else "before") + (", deferred import" if r["source"] == "scale_real_boot" else "")
        lines.append(f"| {r['run']} | {fix} | {r['peers']} | {r['join_s']:.1f} ({r['after_boot_s']:.1f}) | "
                     f"{r['share_min']:.0%} / {r['share_median']:.0%} | {r['resyncs']} | {r['whole_rounds']} of "
                     f"{r['window_rounds']} | {r['allreduce_p50']:.2f} | {r['dht_io_kib_s']:.0f} / {r['p2pd_io_kib_s']:.0f} | "
                     f"{r['pss_mib']:.0f} |")
    lines += ["", "*heartbeat*: before or after the heartbeat's DHT fix (below); *deferred import*: the rerun after every start "
              "stopped importing scipy.optimize (scale_real_boot.md); *-gG*: sub-groups of about G "
              "(scale_real_subgroups.md, the same session as its one-group runs). The targets take the newest runs.", "",
              "## The heartbeat's DHT cost per peer (real DHT nodes, no training)", "",
              "| peers | before, KiB/s (busiest) | after, KiB/s (busiest) | heartbeat after, s |", "|---|---|---|---|"]
    by = {(r["peers"], r["policy"]): r for r in dht if not r["bootstraps"]}
    for n in sorted({n for n, _ in by}):
        b, a = by.get((n, "before")), by.get((n, "after"))
        lines.append(f"| {n} | {_dht_cell(b)} | {_dht_cell(a)} | {a['period_s']:.1f} |" if a else
                     f"| {n} | {_dht_cell(b)} | - | - |")
    entered = [r for r in dht if r["bootstraps"]]
    if entered:
        lines += ["", "Peers started at once through 2 entry peers that do not know each other (hivemind issue #624):", ""]
        for r in entered:
            one = r["seen_min"] == r["peers"] and r["organisers"] == 1
            lines.append(f"- {r['peers']} peers: {'one swarm' if one else '**split**'}; each entry peer "
                         + ", ".join(f"{x:.0f}" for x in r["entries_io_kib_s"]) + " KiB/s")
    shards = summary.get("shards", [])
    if shards:
        lines += ["", "Progress records spread over 4 keys (`averaging.progress_shards`, [dht_shards.md](dht_shards.md): `"
                  + summary["commands"]["shards"] + "`):", "",
                  "| peers | one key, KiB/s (busiest) | 4 shards, KiB/s (busiest) | busiest, shards / one key |",
                  "|---|---|---|---|"]
        by_shards = {(r["peers"], r["shards"]): r for r in shards}
        for n in sorted({n for n, _ in by_shards}):
            one, four = by_shards.get((n, 1)), by_shards.get((n, 4))
            if one and four:
                lines.append(f"| {n} | {_dht_cell(one)} | {_dht_cell(four)} | "
                             f"{four['io_max_kib_s'] / one['io_max_kib_s']:.2f}x |")
    auto = summary.get("auto_shards", [])
    if auto:
        lines += ["", "The count chosen by each peer from the live peers it counts (`averaging.progress_shards = \"auto\"`, "
                  "the default), beside one key and 4 fixed keys in one session ([dht_shards_auto.md](dht_shards_auto.md): `"
                  + summary["commands"]["auto_shards"] + "`):", "",
                  "| peers | one key, KiB/s (busiest) | 4 keys, KiB/s (busiest) | auto, KiB/s (busiest) | auto: keys written / read |",
                  "|---|---|---|---|---|"]
        by_auto = {(r["peers"], r["shards"]): r for r in auto}
        for n in sorted({n for n, _ in by_auto}):
            one, four, chosen = by_auto.get((n, 1)), by_auto.get((n, 4)), by_auto.get((n, "auto"))
            if one and four and chosen:
                lines.append(f"| {n} | {_dht_cell(one)} | {_dht_cell(four)} | {_dht_cell(chosen)} | "
                             f"{'/'.join(map(str, chosen['keys_written']))} / {'/'.join(map(str, chosen['keys_read']))} |")
    lines += ["", "## SIMULATED: 64 to 1,024 peers (event-level model, no network, no model)", "",
              "Share of eligible peers whose round completed (mean / worst round) and the anchors' spread "
              "(RMS over a pseudo-gradient's, median; the consistency tolerance is 0.25):", "",
              "| scenario | peers | churn /h per 100 | completed | spread |", "|---|---|---|---|---|"]
    for r in sim:
        lines.append(f"| {r['label']} | {r['peers']} | {r['churn']:g} | {r['share_mean']:.1%} / {r['share_min']:.1%} | "
                     f"{r['spread_done_median']:.2f} |")
    lines += ["", "## Where it breaks, and why", ""] + [f"- {line}" for line in summary["breaks"]]
    return "\n".join(lines) + "\n"


BREAKS = [
    "**Past 64 peers with one group**: a group larger than `averaging.robust.max_group_size` is refused; "
    "hivemind now gets that cap as its target size, so one key splits into groups of at most 64 that "
    "apply different averages and the one-anchor check fires (simulated 256 peers: 46-60% of members). "
    "Rotating sub-groups (`averaging.target_group_size`, docs/scale.md) are the answer, now in the engine: "
    "16 real peers in groups of about 8 averaged in every round with no re-sync (scale_real_subgroups.md).",
    "**Sub-groups cost bytes and are only partly hardened**: the anchors and momenta ride the all-reduce in "
    "the 1-byte lattice code (2 bytes a parameter each way, about 4x an int4 round's payload; fp16 on request; "
    "fp32 where reducers return deltas: scale_real_lattice.md); a lying reducer's share of the anchors and momenta is bounded by the "
    "members' claims, and a member claiming a far anchor gets weight 0 instead of widening that bound (a close "
    "claim with a far anchor can still fold its group's round: docs/security.md). Groups are balanced cuts "
    "of the live records (16 real peers in groups of 4: exactly 4 every round; the first, hashed rule gave 1 to "
    "8), but a peer whose view of the records differs lands a group off (simulated: 3.4% of peers when 1% of "
    "records are missed per read) and may fold.",
    "**Join time on this machine** grows with N because N peers boot at once on 2 cores (importing torch and "
    "hivemind, starting a DHT, an averager and a p2pd each): after the heartbeat fix, boot took 15 s for 4 peers "
    "and 62 s for 16, about 7.5 core-seconds a peer either way, so the boot is the cores' queue; from the end of "
    "boot to the first averaged round 16 peers took 1.29x what 4 did. A machine per peer would not see it. "
    "Rerun after every start stopped importing scipy.optimize (~1 core-s a peer, docs/benchmarks.md "
    "'Start-up cost') on a quieter machine (0.04 cores of other load, against 0.6-1.3): boot 32 s at 16 peers, "
    "join 2.09x a 4-peer swarm's.",
    "**The DHT's progress key**: each peer's heartbeat cost is flat past 16 peers, but the key's 5 replicas "
    "serve every read (about 5 x N records a second each), and past 1,024 peers the key's cap refuses "
    "records. `averaging.progress_shards` spreads the records over S keys (the busiest node's load 0.41x at 32 "
    "and 48 peers with 4 shards, the median unchanged at 48), and by default (`\"auto\"`) each peer picks S "
    "from the live peers it counts (one key below 48, 4 at 48: every real peer moved, dht_shards_auto.md); "
    "not measured past 48 real DHT nodes.",
    "**One failure spoils a whole group's round** with one group of everybody: a member that leaves "
    "mid-all-reduce leaves every member's result partial, and nobody applies it (one anchor for all). With "
    "sub-groups a partial result is kept, each member's own values standing for the missing share "
    "(simulated: completion 80% -> 95% under heavy churn).",
]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help alone
    reals = {name: _load(name) for name in (*REAL_SOURCES, SUBGROUP_SOURCE)}
    dht, sim, shards, auto = _load("dht_load"), _load("scale_sim"), _load("dht_shards"), _load("dht_shards_auto")
    summary = {
        "commands": {"real": "`; `".join(c["command"] for name, real in reals.items() if name != SUBGROUP_SOURCE
                                         for c in real["meta"]["commands"]),
                     "subgroups": "`; `".join(c["command"] for c in reals[SUBGROUP_SOURCE]["meta"]["commands"]),
                     "dht": dht["command"].split("`; `")[0], "sim": sim["command"], "shards": shards["command"],
                     "auto_shards": auto["command"]},
        "real": [row for name, real in reals.items() for row in real_rows(real, source=name)], "dht": dht_rows(dht),
        "shards": dht_rows(shards), "auto_shards": dht_rows(auto), "sim": sim_rows(sim), "breaks": BREAKS,
    }
    summary["targets"] = targets(summary["real"], summary["sim"], twin_agreement(sim))
    write_results(summary, OUT, lambda s: report(s) + "\n![scale](scale.png)\n")
    plot(summary, OUT.with_suffix(".png"))


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    base = sorted((r for r in summary["real"] if r["churn"] == 0 and r["bootstraps"] == 1 and r["source"] == REAL_SOURCES[0]),
                  key=lambda r: r["peers"])
    ax = axes[0]
    ns = [r["peers"] for r in base]
    ax.plot(ns, [r["share_min"] for r in base], "o-", label="averaged share, lowest peer")
    ax.plot(ns, [r["join_s"] / max(r["join_s"] for r in base) for r in base], "s--",
            label="join time (of the slowest N's)")
    ax.set(xlabel="real peers (this machine)", title="Real swarm", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    ax = axes[1]
    for policy, style in (("before", "o--"), ("after", "o-")):
        rows = sorted((r for r in summary["dht"] if r["policy"] == policy and not r["bootstraps"]), key=lambda r: r["peers"])
        ax.plot([r["peers"] for r in rows], [r["io_kib_s"] for r in rows], style, label=f"heartbeat {policy}")
        for r in rows:
            if r["seen_min"] < r["peers"]:
                ax.annotate("stalled: peers saw\n{} of {}".format(r["seen_min"], r["peers"]),
                            (r["peers"], r["io_kib_s"]), fontsize=7, xytext=(-60, 15), textcoords="offset points")
    ax.set(xlabel="peers (DHT nodes)", ylabel="KiB/s per peer (loopback I/O)", title="Heartbeat's DHT cost")
    ax.legend(fontsize=8)
    ax = axes[2]
    for label in ("one key, hivemind cap 64 (today)", "sub-groups G=16", "sub-groups G=16, partial results kept"):
        for churn, style in ((5.0, "-"), (20.0, "--")):
            rows = sorted((r for r in summary["sim"] if r["label"] == label and r["churn"] == churn),
                          key=lambda r: r["peers"])
            ax.plot([r["peers"] for r in rows], [r["share_mean"] for r in rows], "o" + style,
                    label=f"{label}, churn {churn:g}")
    ax.axhline(SIM_TARGET_SHARE, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="peers (SIMULATED)", ylabel="rounds completed (mean share)",
           title="SIMULATED round completion", ylim=(0, 1.02))
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
