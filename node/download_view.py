"""A joiner's state download as the person at the terminal sees it.

On a terminal: a rich progress bar (bytes, speed, time left) that disappears when done. Without
one (``--no-ui``, logs, Docker): a log line at every quarter. ``__call__`` runs on the sync
worker's thread (the download's progress callback); rich's progress bar is thread-safe.
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

logger = logging.getLogger(__name__)


class DownloadView:
    def __init__(self, *, ui: bool, console: Console | None = None):
        self.ui, self.console = ui, console
        self._progress: Progress | None = None
        self._task = None
        self._logged_quarter = -1
        self.done = self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self.ui:
            if self._progress is None:
                self._progress = Progress(TextColumn("joining: downloading the swarm's state"), BarColumn(),
                                          DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                          console=self.console, transient=True)
                self._task = self._progress.add_task("download", total=total)
                self._progress.start()
            self._progress.update(self._task, completed=done, total=total)
            return
        quarter = 4 * done // max(total, 1)
        if quarter > self._logged_quarter:
            self._logged_quarter = quarter
            logger.info(f"downloading the swarm's state: {100 * done / max(total, 1):.0f}% "
                        f"of {total / 2**20:.1f} MiB")

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
