"""What the person at the terminal sees: a live status panel (rich) or plain log lines.

The view only reads a ``NodeStatus`` snapshot that the loop replaces at step boundaries; rich's
own refresh thread draws it, so a busy GPU never waits on the terminal. Everything the render
thread reads is replaced whole (the snapshot, history tuples), never mutated in place, so the
two threads need no lock.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.cells import cell_len, set_cell_size
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from averaging.state.verdict import Applied
from node.observe.fmt import human_bytes, number, short_id
from protocols import swarm_time
from protocols.progress import ProgressRecord, SwarmThroughput

logger = logging.getLogger(__name__)

# One console for the live panel and the log handler, so log lines scroll above the panel.
CONSOLE = Console()

SPARK_CHARS = "▁▂▃▄▅▆▇█"
HISTORY = 24  # rounds kept for the sparklines
MAX_PEER_ROWS = 8


@dataclass(slots=True)
class NodeStatus:
    peer_id: str = ""
    run_id: str = ""
    peers: int = 1
    round: int = 0
    max_rounds: int | None = None
    phase: str = "starting"  # starting | joining | training | averaging | resyncing | leaving
    round_start: float = 0.0
    round_end: float = 0.0
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float = 0.0
    group_size: int = 0
    group_count: int | None = None  # sub-groups the last round split into (None: one group of everybody)
    sync_s: float = 0.0
    last_sync: str = "-"  # averaged | local (why) | ...
    rounds_done: int = 0
    finished_round: int = 0  # the last round whose sync landed
    utilization: float | None = None  # share of wall time spent computing, 0..1
    device: str = ""
    download_fraction: float | None = None  # phase "joining": share of the swarm state downloaded
    bytes_sent: int = 0  # cumulative, for the bandwidth figure
    bytes_received: int = 0
    sync_bytes_per_s: float | None = None  # this peer's payload (each way) over the last all-reduce's duration
    round_bytes_sent: int | None = None  # the last finished round's all-reduce payload (None: no round yet)
    round_bytes_received: int | None = None
    sync_advice: str | None = None  # syncs end more than a round late: what to change (round_advice)
    clock_advice: str | None = None  # this clock is off the swarm's by over a second (swarm_time.describe_offset)
    robust: dict[str, int] = field(default_factory=dict)  # what robust aggregation refused since start, by kind
    peer_records: Sequence[ProgressRecord] = ()  # the swarm's progress records (replace, never mutate)


def sparkline(values: Sequence[float], width: int = HISTORY) -> str:
    """The last ``width`` values as unicode bars scaled between their min and max."""
    finite = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    if high - low < 1e-12:
        return SPARK_CHARS[len(SPARK_CHARS) // 2] * len(finite)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - low) / (high - low) * top)] for v in finite)


def sync_state(status: NodeStatus) -> str:
    """averaging (in flight) / merged (the last round's average landed) / stayed out / missed / alone."""
    if "averaging" in status.phase:
        return "averaging"
    if status.finished_round == 0:
        return "-"
    if status.last_sync == Applied.AVERAGED:
        return "merged"
    if status.peers <= 1:
        return "alone (own update)"
    if status.last_sync.endswith("(stayed out)"):
        return "stayed out (work carried over)"
    return "missed (own update)"


class LiveView:
    """A rich panel redrawn a few times per second from the latest status."""

    def __init__(self, console: Console | None = None):
        self.status = NodeStatus()
        self.console = console or CONSOLE
        self.loss_history: tuple[float, ...] = ()
        self.eval_history: tuple[float, ...] = ()
        self._live = Live(get_renderable=self.render, console=self.console, refresh_per_second=2,
                          transient=False, redirect_stdout=True, redirect_stderr=True)

    def start(self) -> None:
        self._live.start()

    def stop(self) -> None:
        self._live.stop()

    def update(self, status: NodeStatus) -> None:
        """Called by the training loop every step: swap the snapshot, nothing else of note."""
        self.status = dataclasses.replace(status)

    def round_done(self, status: NodeStatus) -> None:
        self.update(status)
        if status.loss is not None:
            self.loss_history = (*self.loss_history[-(HISTORY - 1):], status.loss)
        if status.eval_loss is not None:
            self.eval_history = (*self.eval_history[-(HISTORY - 1):], status.eval_loss)

    # -- drawing (rich's refresh thread) ---------------------------------------------------------
    def render(self) -> Panel:
        s, now = self.status, swarm_time.now()  # round times and records are in swarm time
        records = list(s.peer_records)
        # Our live rate, not our record's (a heartbeat old): the rows then add up on screen.
        rate = SwarmThroughput.of(records, me=s.peer_id, mine=s.tokens_per_s)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", justify="right", no_wrap=True)
        grid.add_column()
        _swarm_rows(grid, s, rate)
        if s.phase == "joining":
            _joining_rows(grid, s)
        else:
            _round_rows(grid, s, now)
        _training_rows(grid, s, rate, self.loss_history, self.eval_history)
        _network_rows(grid, s)
        parts: list = [grid]
        if rate.other_peers:
            parts.append(peer_table(records, me=s.peer_id, now=now, limit=MAX_PEER_ROWS))
        title = f"shoal · run {s.run_id} · peer {short_id(s.peer_id)}" + (f" · {s.device}" if s.device else "")
        return Panel(Group(*parts), title=title, expand=False)


def _swarm_rows(grid: Table, s: NodeStatus, rate: SwarmThroughput) -> None:
    if s.peers <= 1 and not rate.other_peers:
        grid.add_row("swarm", Text("alone: waiting for other peers to join", style="bold yellow"))
        return
    online = max(s.peers, rate.other_peers + 1)
    line = Text(f"{online} peers online", style="bold green")
    line.append(f"   {rate.total:,.0f} tokens/s total")
    if rate.share is not None:
        line.append(f"   this peer {rate.share:.0%}")
    grid.add_row("swarm", line)


def _joining_rows(grid: Table, s: NodeStatus) -> None:
    fraction = s.download_fraction
    label = "joining: downloading state" + (f" {fraction:.0%}" if fraction is not None else "")
    grid.add_row("state", Text(label, style="bold yellow"))
    if fraction is not None:
        grid.add_row("", ProgressBar(total=1.0, completed=min(max(fraction, 0.0), 1.0), width=40))


def _round_rows(grid: Table, s: NodeStatus, now: float) -> None:
    rounds = f"{s.round}" + (f" / {s.max_rounds}" if s.max_rounds else "")
    grid.add_row("round", f"{rounds}   ({s.phase})   sync: {sync_state(s)}")
    span = max(s.round_end - s.round_start, 1e-9)
    done = min(max(now - s.round_start, 0.0), span)
    left = max(s.round_end - now, 0.0) if s.round_end else 0.0
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=span, completed=done, width=40), f"{left:.0f}s to deadline")
    grid.add_row("", bar)


def _training_rows(grid: Table, s: NodeStatus, rate: SwarmThroughput, loss_history: Sequence[float],
                   eval_history: Sequence[float]) -> None:
    loss = Text(f"{number(s.loss)} ")
    loss.append(sparkline(loss_history), style="magenta")
    loss.append(f"   eval {number(s.eval_loss)} ")
    loss.append(sparkline(eval_history), style="green")
    grid.add_row("loss", loss)
    util = f"   utilization {s.utilization:.0%}" if s.utilization is not None else ""
    grid.add_row("tokens/s", f"{s.tokens_per_s:,.0f}{swarm_beside(rate)}{util}")


def swarm_beside(rate: SwarmThroughput) -> str:
    """What follows this peer's tokens/s: the swarm's, and what the other peers add ("" alone)."""
    if not rate.other_peers:
        return ""
    others = f"{rate.other_peers} other peer" + ("s" if rate.other_peers > 1 else "")
    return f" this peer   {rate.total:,.0f} swarm (+{rate.others:,.0f} from {others})"


def _network_rows(grid: Table, s: NodeStatus) -> None:
    # Averaging traffic comes in bursts (one all-reduce per round): the rate during the last
    # sync says more about the link than a per-second rate that is zero most of the time.
    bandwidth = f"   {human_bytes(s.sync_bytes_per_s)}/s while syncing" if s.sync_bytes_per_s else ""
    if s.round_bytes_sent is not None and s.round_bytes_received is not None:
        bandwidth += f"   round ↑ {human_bytes(s.round_bytes_sent)} ↓ {human_bytes(s.round_bytes_received)}"
    bandwidth += f"   total ↑ {human_bytes(s.bytes_sent)} ↓ {human_bytes(s.bytes_received)}"
    groups = f" (one of {s.group_count} sub-groups)" if s.group_count and s.group_count > 1 else ""
    grid.add_row("network", f"group {s.group_size}{groups}   sync {s.sync_s:.2f}s   last {s.last_sync}{bandwidth}")
    if s.sync_advice:
        grid.add_row("round length", Text(s.sync_advice, style="yellow"))
    if s.clock_advice:
        grid.add_row("clock", Text(s.clock_advice, style="yellow"))
    if any(s.robust.values()):
        grid.add_row("refused", Text(robust_summary(s.robust), style="yellow"))


ROBUST_WORDS = {"refused_parts": "parts", "refused_returns": "returned averages", "clipped_parts": "clipped",
                "bans": "peers banned", "lattice_edges": "state values near the lattice's edge"}


def robust_summary(counts: dict[str, int]) -> str:
    """What robust aggregation refused since start, in words (the peers are named in the log)."""
    return "   ".join(f"{count:,} {ROBUST_WORDS.get(kind, kind)}" for kind, count in counts.items() if count) + \
        "   (see the log for who)"


def _cell(value: str, width: int, right: bool) -> str:
    """``value`` in ``width`` terminal cells: numbers right-aligned (never cut), text cut with "…"."""
    if right:
        return " " * max(width - cell_len(value), 0) + value
    if cell_len(value) > width:
        value = set_cell_size(value, width - 1) + "…"
    return set_cell_size(value, width)


PEER_COLUMNS = (  # header, width in cells, right-aligned; 94 cells in all, fits a 100-column panel
    ("peer", 14, False), ("device", 16, False), ("tokens/s", 9, True), ("round", 5, True), ("loss", 6, True),
    ("util", 4, True), ("shard", 5, True), ("round ↑", 8, True), ("phase", 9, False), ("last seen", 9, True),
)


def peer_table(records: Sequence[ProgressRecord], *, me: str = "", now: float, limit: int | None = None) -> Text:
    """Peers by throughput, as fixed-width lines.

    Not a rich ``Table``: measuring its columns cost ~3 ms per row per frame (benchmarks.micro.ui_overhead),
    taken from the training thread twice a second. Peer-supplied strings are appended as plain
    text, so rich markup in a device name is shown, not interpreted.
    """
    def cells(values: Sequence[str]) -> str:
        return " ".join(_cell(value, width, right) for value, (_, width, right) in zip(values, PEER_COLUMNS))

    table = Text(cells([name for name, _, _ in PEER_COLUMNS]) + "\n", style="bold", no_wrap=True, overflow="crop")
    ordered = sorted(records, key=lambda r: (-r.tokens_per_s, r.peer_id))
    shown = ordered if limit is None else ordered[:limit]
    for r in shown:
        you = r.peer_id == me
        row = cells([short_id(r.peer_id) + (" (you)" if you else ""), r.device, f"{r.tokens_per_s:,.0f}",
                     str(r.round), number(r.loss, ".3f"), f"{r.utilization:.0%}", number(r.shard, "d"),
                     human_bytes(r.round_bytes_sent) if r.round_bytes_sent is not None else "-", r.phase,
                     f"{max(now - r.time, 0.0):.0f}s ago"])
        table.append(row + "\n", style="bold" if you else "")
    if len(ordered) > len(shown):
        table.append(f"… and {len(ordered) - len(shown)} more\n", style="dim")
    table.rstrip()
    return table


class PlainView:
    """``--no-ui``: one log line per round, nothing redrawn."""

    def __init__(self):
        self.status = NodeStatus()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update(self, status: NodeStatus) -> None:
        self.status = status

    def round_done(self, status: NodeStatus) -> None:
        self.status = status
        util = f" utilization={status.utilization:.0%}" if status.utilization is not None else ""
        swarm = SwarmThroughput.of(status.peer_records, me=status.peer_id, mine=status.tokens_per_s).total
        logger.info(
            f"round {status.finished_round}: peers={status.peers} loss={number(status.loss)} eval_loss={number(status.eval_loss)} "
            f"tokens/s={status.tokens_per_s:,.0f} swarm_tokens/s={swarm:,.0f}{util} sync={status.last_sync} "
            f"group={status.group_size} sync_s={status.sync_s:.2f}"
        )
