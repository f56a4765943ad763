"""What the person at the terminal sees: a live status panel (rich) or plain log lines.

The view only reads a ``NodeStatus`` snapshot that the loop replaces at step boundaries; rich's
own refresh thread draws it, so a busy GPU never waits on the terminal.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

logger = logging.getLogger(__name__)

# One console for the live panel and the log handler, so log lines scroll above the panel.
CONSOLE = Console()


@dataclass(slots=True)
class NodeStatus:
    peer_id: str = ""
    run_id: str = ""
    peers: int = 1
    round: int = 0
    max_rounds: int | None = None
    phase: str = "starting"  # starting | training | averaging | resyncing | leaving
    round_start: float = 0.0
    round_end: float = 0.0
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float = 0.0
    group_size: int = 0
    sync_s: float = 0.0
    last_sync: str = "-"  # averaged | local (why) | ...
    rounds_done: int = 0
    finished_round: int = 0  # the last round whose sync landed


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


class LiveView:
    """A rich panel redrawn a few times per second from the latest status."""

    def __init__(self, console: Console | None = None):
        self.status = NodeStatus()
        self.console = console or CONSOLE
        self._live = Live(get_renderable=self._render, console=self.console, refresh_per_second=4,
                          transient=False, redirect_stdout=True, redirect_stderr=True)

    def start(self) -> None:
        self._live.start()

    def stop(self) -> None:
        self._live.stop()

    def update(self, status: NodeStatus) -> None:
        self.status = dataclasses.replace(status)

    def round_done(self, status: NodeStatus) -> None:
        self.update(status)

    def _render(self):
        s = self.status
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", justify="right")
        grid.add_column()
        rounds = f"{s.round}" + (f" / {s.max_rounds}" if s.max_rounds else "")
        grid.add_row("peers", Text(f"{s.peers} in swarm", style="bold green"))
        grid.add_row("round", f"{rounds}   ({s.phase})")
        span = max(s.round_end - s.round_start, 1e-9)
        done = min(max(time.time() - s.round_start, 0.0), span)
        grid.add_row("", ProgressBar(total=span, completed=done, width=40))
        grid.add_row("loss", f"{_fmt(s.loss)}   eval {_fmt(s.eval_loss)}")
        grid.add_row("tokens/s", f"{s.tokens_per_s:,.0f}")
        grid.add_row("last sync", f"{s.last_sync}   group {s.group_size}   {s.sync_s:.2f}s")
        title = f"shoal · run {s.run_id} · peer …{s.peer_id[-8:]}"
        return Panel(Group(grid), title=title, expand=False)


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
        logger.info(
            f"round {status.finished_round}: peers={status.peers} loss={_fmt(status.loss)} eval_loss={_fmt(status.eval_loss)} "
            f"tokens/s={status.tokens_per_s:,.0f} sync={status.last_sync} group={status.group_size} "
            f"sync_s={status.sync_s:.2f}"
        )
