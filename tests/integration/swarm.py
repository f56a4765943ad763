"""Test-side helpers around ``examples.swarm_launcher``: the tiny config and a cache dir per swarm."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from examples.swarm_launcher import LocalPeer, LocalSwarm, session_members, shoal_command

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "tiny.toml"

__all__ = ["REPO", "TINY", "LocalPeer", "Swarm", "session_members", "shoal_command", "wait_until"]


class Swarm(LocalSwarm):
    """A loopback swarm of tiny-config peers."""

    def __init__(self, root: Path, run_id: str):
        super().__init__(root, run_id, cwd=REPO)

    def start(self, name: str, *args: str, initial: list[str] | None = None, config: Path = TINY, **kwargs) -> LocalPeer:
        return super().start(name, *args, initial=initial, config=config, **kwargs)


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; ``TimeoutError(what)`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(what)
