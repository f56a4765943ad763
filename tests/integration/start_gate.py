"""A start gate for the test-only peer launchers (``skewed_peer.py``, ``delayed_sync.py``): with
``SHOAL_TEST_GATE`` set to a path, the launcher imports what ``shoal run`` imports and then waits
until that file exists before ``shoal run`` begins (its DHT, its join, its training).

Why: an interpreter importing torch, hivemind and the training stack takes 3 s of a core, 5-15 s
of wall time on two cores busy with a swarm. A test that starts a peer at a chosen moment (a
newcomer two rounds after a crash, a third peer once two have paired) spawns it early behind the
gate and opens the gate (``open_gate``) at that moment: the peer joins when it would have, minus
the import. Nothing of ``shoal run`` itself runs before the gate opens."""

from __future__ import annotations

import os
import time
from pathlib import Path

GATE_VAR = "SHOAL_TEST_GATE"
GATE_TIMEOUT_S = 600.0  # a test that never opens it has failed; its fixture kills the peer anyway


def gated(path: Path) -> dict[str, str]:
    """The environment that holds a launcher's peer behind the gate file ``path``."""
    return {GATE_VAR: str(path)}


def open_gate(path: Path) -> None:
    path.touch()


def wait_for_gate() -> None:
    """In a launcher, before ``shoal run`` starts: import its modules, then wait for the gate (no-op
    without ``SHOAL_TEST_GATE``)."""
    gate = os.environ.get(GATE_VAR)
    if not gate:
        return
    import node.process.peer  # noqa: F401 - the imports ``shoal run`` makes, done while we wait

    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise SystemExit(f"the test never opened the start gate {gate}")
        time.sleep(0.05)
