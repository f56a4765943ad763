"""A whole ``shoal run`` whose averager is the test-only hostile one (``hostile_peer``): it trains,
joins groups and serves state like an honest peer, but corrupts its all-reduce as ``ATTACK`` says.
For benchmarks/attacks.py; lives under tests/ so that nothing in the CLI can reach it.

    python -m tests.integration.hostile_node ATTACK [shoal run options...]

``hijack`` (issue 11, items 5 and 6) lies about its anchor instead, consistently: every claim it
reports is of a poisoned anchor (its own plus noise of 0.05 RMS) one outer step ahead of its real
count, and the state it serves to a joiner or a re-syncing peer is that poisoned anchor with a
matching claim. Its all-reduce parts stay honest.
"""

from __future__ import annotations

import sys

import torch

from averaging.math.fingerprints import AnchorClaim, encode_claim, fingerprint
from averaging.state.shared_state import SharedState
from node import cli
from node.library import network
from tests.integration.hostile_peer import ATTACK, ATTACKS, HostileBackend


def poisoned(anchor: torch.Tensor) -> torch.Tensor:
    return anchor + 0.05 * torch.randn(anchor.numel(), generator=torch.Generator().manual_seed(666))


def lie_about_the_anchor() -> None:
    """Patch ``SharedState`` (this process only) so that its claims and shared state describe a
    poisoned anchor, one outer step ahead."""
    def claim(self: SharedState) -> AnchorClaim:  # never cached: SharedState caches the honest one
        return AnchorClaim(fingerprint(poisoned(self.anchor)), self._scale.clone(), self.rounds_done + 1)

    honest_shared_state = SharedState.shared_state

    def shared_state(self: SharedState):
        metadata, (anchor, momentum) = honest_shared_state(self)
        lie = claim(self)
        metadata = {**metadata, "rounds_done": lie.rounds_done,
                    "claim": encode_claim(lie, round=metadata["round"]).encode()}
        return metadata, [poisoned(anchor), momentum]

    SharedState._current_claim = claim
    SharedState.shared_state = shared_state


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in (*ATTACKS, "hijack"):
        raise SystemExit(f"usage: python -m tests.integration.hostile_node {{{','.join(ATTACKS)},hijack}} "
                         "[shoal run options]")
    ATTACK.value = argv[0].encode()  # before the averager forks: it reads the shared value
    network.HivemindBackend = HostileBackend  # the one place a node builds its backend
    if argv[0] == "hijack":
        lie_about_the_anchor()
    sys.argv = ["shoal", "run", *argv[1:]]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
