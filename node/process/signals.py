"""Ctrl+C and SIGTERM for a long-running command, the way a terminal user expects (uvicorn's way).

Once: finish the current step, leave the swarm, checkpoint. Twice: kill our children (hivemind's
processes and p2pd) and exit now with 130. The handler is installed again after hivemind starts,
because creating an averager sets SIGINT to ignored in the parent (docs/hivemind.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

EXIT_INTERRUPTED = 130

logger = logging.getLogger(__name__)


class Interrupts:
    """Ctrl+C once: finish the current step, leave, checkpoint. Twice: exit now (children too)."""

    def __init__(self, stop: threading.Event):
        self.stop, self.count = stop, 0
        self.pid = os.getpid()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)

    def __call__(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            # A forked hivemind child inherited this handler. Ctrl+C reaches the whole process
            # group: the child ignores it and lets the parent shut it down in order. SIGTERM keeps
            # its default (hivemind ends a stuck child with it; it must not be swallowed).
            if signum == signal.SIGINT:
                signal.signal(signum, signal.SIG_IGN)
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.count += 1
        if self.count == 1:
            self.stop.set()
            # Ctrl+C also reached p2pd (same process group), which exits at once: hivemind then
            # logs errors about its closed socket and a slow DHT shutdown. Expected now, so muted.
            for name in ("hivemind.p2p.p2p_daemon", "hivemind.dht.dht"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
            logger.warning("stopping after the current step; press Ctrl+C again to exit immediately")
            return
        kill_children()
        os._exit(EXIT_INTERRUPTED)


def kill_children() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
