"""A joiner's state download in log lines (``--no-ui``, logs, Docker): one at every quarter.

On a terminal the live panel shows the same progress (``NodeStatus.download_fraction``).
``__call__`` runs on the sync worker's thread (the download's progress callback).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class DownloadLog:
    def __init__(self) -> None:
        self._logged_quarter = -1

    def __call__(self, done: int, total: int) -> None:
        quarter = 4 * done // max(total, 1)
        if quarter > self._logged_quarter:
            self._logged_quarter = quarter
            logger.info(f"downloading the swarm's state: {100 * done / max(total, 1):.0f}% "
                        f"of {total / 2**20:.1f} MiB")
