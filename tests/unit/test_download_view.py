"""The joiner's download progress without a terminal: a log line at each quarter, once."""

from __future__ import annotations

import logging

from node.observe.download_log import DownloadLog


def test_logs_each_quarter_once(caplog):
    view = DownloadLog()
    with caplog.at_level(logging.INFO, logger="node.observe.download_log"):
        for done in range(0, 101, 5):
            view(done * 2**20, 100 * 2**20)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"downloading the swarm's state: {p}% of 100.0 MiB" for p in (0, 25, 50, 75, 100)]
