"""``shoal status`` as a person sees it: one swarm snapshot as a rich panel, with the same peer
table as the node's live view."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from averaging.engine.policy import round_advice
from averaging.math.groups import most_published
from node.library.snapshot import SwarmSnapshot
from node.observe.fmt import number, short_id
from node.observe.ui import peer_table
from protocols.swarm_time import WARN_S

MAX_ADVICE_ROWS = 3


def sub_groups(records) -> int:
    """How many sub-groups most peers split their last round into (``averaging.target_group_size``;
    1 when none publishes a count: one group of everybody)."""
    return most_published(r.group_count for r in records) or 1


def render_snapshot(snapshot: SwarmSnapshot) -> Panel:
    """The panel ``shoal status`` prints (and redraws with ``--watch``)."""
    summary, schedule = snapshot.summary, snapshot.schedule
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", justify="right", no_wrap=True)
    grid.add_column()
    if not snapshot.records:
        grid.add_row("peers", Text(f"no peer of run '{snapshot.run_id}' is online (wrong --run-id?)", style="bold yellow"))
    else:
        spread = f"   (records under {snapshot.progress_shards} DHT keys)" if snapshot.progress_shards > 1 else ""
        groups = sub_groups(snapshot.records.values())
        split = f"   (averaging in {groups} sub-groups a round)" if groups > 1 else ""
        grid.add_row("peers", Text(f"{summary.peers} online{spread}{split}", style="bold green"))
    if schedule is not None:
        left = schedule.round_end(snapshot.round) - snapshot.time if snapshot.round else schedule.start_time - snapshot.time
        grid.add_row("round", f"{snapshot.round}   ({schedule.round_seconds:g}s rounds, {max(left, 0.0):.0f}s left)")
    elif summary.round is not None:
        grid.add_row("round", f"{summary.round}   (from the peers' records; no run manifest found)")
    grid.add_row("throughput", f"{summary.tokens_per_s:,.0f} tokens/s   {summary.tokens:,} tokens so far")
    grid.add_row("loss", f"{number(summary.loss)}   eval {number(summary.eval_loss)}")
    if snapshot.malformed or snapshot.malformed_manifests:
        grid.add_row("ignored", Text(f"{snapshot.malformed} malformed progress records, "
                                     f"{snapshot.malformed_manifests} malformed manifests", style="yellow"))
    if schedule is not None:
        # Each record names its own peer; a flood of records (one DHT store each) gets a few rows.
        advised = [(record, advice) for record in sorted(snapshot.records.values(), key=lambda r: r.peer_id)
                   if (advice := round_advice(record.sync_late_s, schedule.round_seconds))]
        for record, advice in advised[:MAX_ADVICE_ROWS]:
            grid.add_row("round length", Text(f"peer {short_id(record.peer_id)}: {advice}", style="yellow"))
        if len(advised) > MAX_ADVICE_ROWS:
            grid.add_row("round length", Text(f"and {len(advised) - MAX_ADVICE_ROWS} more peers", style="yellow"))
    for record in sorted(snapshot.records.values(), key=lambda r: r.peer_id):
        if record.clock_offset_s is not None and abs(record.clock_offset_s) > WARN_S:
            side = "ahead of" if record.clock_offset_s < 0 else "behind"
            grid.add_row("clock", Text(f"peer {short_id(record.peer_id)}: clock {abs(record.clock_offset_s):.1f}s {side} "
                                       "the swarm's (corrected; its owner should enable NTP)", style="yellow"))
    parts: list = [grid]
    if snapshot.records:
        parts.append(peer_table(list(snapshot.records.values()), now=snapshot.time))
    return Panel(Group(*parts), title=f"shoal status · run {snapshot.run_id}", expand=False)
