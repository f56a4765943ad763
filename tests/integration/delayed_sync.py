"""Test-only launcher: ``python tests/integration/delayed_sync.py DELAY [MISS] -- <python> -m node.cli run ...``
runs ``shoal run`` with every all-reduce of this peer triggered ``DELAY`` seconds after its sync job
starts, as on a link too slow for the round: its whole group's all-reduce then ends late. With
``MISS`` = k it also skips matchmaking for every round divisible by k, as if it found no group: it
folds that round and is one outer step behind the others at the next. Never reachable from the CLI;
``tests/integration/test_slow_sync.py`` starts it through the launcher's ``prefix``."""

from __future__ import annotations

import sys
import time


def main() -> None:
    separator = sys.argv.index("--")
    delay, *miss = sys.argv[1:separator]
    command = sys.argv[separator + 1:]
    assert command[1:3] == ["-m", "node.cli"], sys.argv
    from averaging.network.hivemind import backend as hivemind_backend

    original_average = hivemind_backend.HivemindBackend.average
    original_prepare = hivemind_backend.HivemindBackend.prepare

    def late_average(self, vector, **kwargs):
        time.sleep(float(delay))
        return original_average(self, vector, **kwargs)

    def forgetful_prepare(self, *, round, **kwargs):
        if miss and round % int(miss[0]) == 0:
            return  # no step for this round: its average() finds none and the round folds
        return original_prepare(self, round=round, **kwargs)

    hivemind_backend.HivemindBackend.average = late_average
    hivemind_backend.HivemindBackend.prepare = forgetful_prepare
    sys.argv = ["shoal", *command[3:]]
    from node.cli import main as shoal_main

    shoal_main()


if __name__ == "__main__":
    main()
