"""A whole ``shoal run`` whose averager is the test-only hostile one (``hostile_peer``): it trains,
joins groups and serves state like an honest peer, but corrupts its all-reduce as ``ATTACK`` says.
For benchmarks/attacks.py; lives under tests/ so that nothing in the CLI can reach it.

    python -m tests.integration.hostile_node ATTACK [shoal run options...]
"""

from __future__ import annotations

import sys

from node import cli
from node.library import network
from tests.integration.hostile_peer import ATTACK, ATTACKS, HostileBackend


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ATTACKS:
        raise SystemExit(f"usage: python -m tests.integration.hostile_node {{{','.join(ATTACKS)}}} [shoal run options]")
    ATTACK.value = argv[0].encode()  # before the averager forks: it reads the shared value
    network.HivemindBackend = HostileBackend  # the one place a node builds its backend
    sys.argv = ["shoal", "run", *argv[1:]]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
