"""The joiner's download progress: log lines at each quarter, or a rich bar on a terminal."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from node.download_view import DownloadView


def test_plain_mode_logs_each_quarter_once(caplog):
    view = DownloadView(ui=False)
    with caplog.at_level(logging.INFO, logger="node.download_view"):
        for done in range(0, 101, 5):
            view(done * 2**20, 100 * 2**20)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"downloading the swarm's state: {p}% of 100.0 MiB" for p in (0, 25, 50, 75, 100)]
    assert view.fraction == 1.0
    view.close()


def test_terminal_mode_draws_a_bar_with_bytes(caplog):
    out = io.StringIO()
    view = DownloadView(ui=True, console=Console(file=out, width=120, force_terminal=True))
    view(0, 8 * 2**20)
    view(4 * 2**20, 8 * 2**20)
    assert view.fraction == 0.5
    view.close()
    text = out.getvalue()
    assert "downloading the swarm's state" in text and "MB" in text
    assert not caplog.records  # no log lines on a terminal: the bar says it
