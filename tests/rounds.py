"""Round records for tests: a finished round as the round engine reports it."""

from __future__ import annotations

import dataclasses

from averaging.engine.stats import RoundStats
from averaging.state.verdict import Applied
from node.observe.metrics import RoundRecord


def round_stats(**changes) -> RoundStats:
    base = RoundStats(round=7, inner_steps=40, tokens=40960, compute_s=9.0, wait_s=0.1, sync_s=1.5, allreduce_s=0.75,
                      wall_s=10.0, loss=3.25, group_size=3, group=["a", "b", "c"], applied=Applied.AVERAGED, error=None,
                      diverged=[], bad_reports=0, resynced=False, rounds_done=6)
    return dataclasses.replace(base, **changes)


def round_record(*, eval_loss: float | None = 3.5, peers: int = 4, lr: float = 1e-3, **changes) -> RoundRecord:
    return RoundRecord(stats=round_stats(**changes), eval_loss=eval_loss, peers=peers, lr=lr)
