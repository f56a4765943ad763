"""hivemind's unix sockets: it creates them under /tmp and does not always remove them.

A clean shutdown leaves the averager's client socket behind, and a killed peer leaves all of
them. We remove the ones nobody listens on any more (connecting is refused), so that repeated
runs and test suites leave /tmp as they found it, without touching a live peer's socket.
"""

from __future__ import annotations

import glob
import os
import socket

SOCKET_GLOB = "/tmp/hivemind-*.sock"


def hivemind_sockets() -> set[str]:
    return set(glob.glob(SOCKET_GLOB))


def is_stale(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
        return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False  # unsure (timeout, permissions): leave it
    finally:
        probe.close()


def remove_stale(paths: set[str]) -> int:
    """Remove the sockets among ``paths`` that no process listens on; returns how many."""
    removed = 0
    for path in paths:
        if os.path.exists(path) and is_stale(path):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed
