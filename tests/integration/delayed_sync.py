"""Test-only launcher: ``python tests/integration/delayed_sync.py DELAY -- <python> -m node.cli run ...``
runs ``shoal run`` with every all-reduce of this peer triggered ``DELAY`` seconds after its sync job
starts, as on a link too slow for the round: its whole group's all-reduce then ends late. Never reachable from the CLI;
``tests/integration/test_slow_sync.py`` starts it through the launcher's ``prefix``."""

from __future__ import annotations

import sys
import time


def main() -> None:
    separator = sys.argv.index("--")
    (delay,) = sys.argv[1:separator]
    command = sys.argv[separator + 1:]
    assert command[1:3] == ["-m", "node.cli"], sys.argv
    from averaging.network.hivemind import backend as hivemind_backend

    original_average = hivemind_backend.HivemindBackend.average

    def late_average(self, vector, **kwargs):
        time.sleep(float(delay))
        return original_average(self, vector, **kwargs)

    hivemind_backend.HivemindBackend.average = late_average
    sys.argv = ["shoal", *command[3:]]
    from start_gate import wait_for_gate  # beside this file

    from node.cli import main as shoal_main

    wait_for_gate()
    shoal_main()


if __name__ == "__main__":
    main()
