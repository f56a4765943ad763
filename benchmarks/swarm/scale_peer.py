"""One peer of ``benchmarks.swarm.scale_real``: ``shoal run`` with hivemind's matchmaking, all-reduce
and p2p logs at DEBUG (when its groups assemble; why a reducer's or a sender's stream failed, when each
all-reduce ended, and an answer a stream handler could not send); the CLI's logging set-up quiets the
"hivemind" logger, not these children's own levels. Throttled by CPU time when scale_real's
``--throttle-clock cpu`` puts ``cpu_throttle``'s variable in our environment.

A module of its own so that a peer imports nothing of the benchmark (torch at start-up would undo
shoal's deferred imports)."""

from __future__ import annotations

import logging
import sys

from benchmarks.common.cpu_throttle import run_shoal

PROGRAM = [sys.executable, "-m", __spec__.name]  # a ``LocalSwarm.start`` program (run from the repository root)

if __name__ == "__main__":
    for name in ("hivemind.averaging.matchmaking", "hivemind.averaging.allreduce", "hivemind.p2p.p2p_daemon"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    run_shoal(sys.argv[1:])
