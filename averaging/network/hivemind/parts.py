"""How long an all-reduce waits for one peer's next part: scaled to how long all-reduces take.

hivemind fails a sender whose next part does not arrive within ``sender_timeout`` and a reducer
whose next answer does not arrive within ``reducer_timeout``; both are fixed when the averager is
built (shoal: 0.4 and 0.5 x ``allreduce_timeout``). On a slow link one answer can take most of an
all-reduce: the reducer waits for the slowest sender's part, then sends every member its answer
over one uplink. With four peers at 1.1 Mbit/s (an 18 s bandwidth bound) the fixed 30 s reducer
timeout failed a reducer in every round (benchmarks/sync_modes.py, the 1.5-round regime), and
every round's average came back partial. So the timeouts grow with the all-reduces that succeeded
(a failed one lasted as long as the timeout that failed it: it measures the timeout, not the link)."""

from __future__ import annotations

from collections.abc import Iterable

SENDER_SHARE = 0.4  # of allreduce_timeout, as configured (hivemind requires sender < reducer)
REDUCER_SHARE = 0.5
CEILING_SHARE = 0.9  # no part timeout reaches the whole all-reduce's
HEADROOM = 1.5  # a reducer's answer may take up to a whole all-reduce, and all-reduces vary


def part_timeouts(recent_allreduce_s: Iterable[float], allreduce_timeout: float) -> tuple[float, float]:
    """(sender_timeout, reducer_timeout): the configured shares of ``allreduce_timeout``, or
    ``HEADROOM`` x the longest recent all-reduce if that is longer, capped below the all-reduce
    timeout; the sender's stays shorter than the reducer's in the configured ratio."""
    reducer = REDUCER_SHARE * allreduce_timeout
    longest = max((s for s in recent_allreduce_s if s >= 0), default=0.0)
    reducer = min(CEILING_SHARE * allreduce_timeout, max(reducer, HEADROOM * longest))
    return reducer * SENDER_SHARE / REDUCER_SHARE, reducer
