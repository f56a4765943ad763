"""The all-reduce's part timeouts follow the all-reduces measured (averaging.network.hivemind.parts)."""

from __future__ import annotations

import pytest

from averaging.network.hivemind.parts import part_timeouts


def test_fast_all_reduces_keep_the_configured_timeouts():
    assert part_timeouts([], 60.0) == pytest.approx((24.0, 30.0))
    assert part_timeouts([2.0, 3.5], 60.0) == pytest.approx((24.0, 30.0))


def test_slow_all_reduces_stretch_them_up_to_a_ceiling_keeping_sender_below_reducer():
    # Four peers at 1.1 Mbit/s: all-reduces of 25-37 s failed a reducer at the fixed 30 s.
    sender, reducer = part_timeouts([25.0, 37.0, 30.0], 60.0)
    assert reducer == pytest.approx(54.0) and sender == pytest.approx(43.2)  # capped at 0.9 x 60
    sender, reducer = part_timeouts([25.0, 28.0], 60.0)
    assert reducer == pytest.approx(42.0) and sender < reducer


def test_the_longest_recent_all_reduce_counts():
    assert part_timeouts([30.0, 4.0], 60.0) == part_timeouts([4.0, 30.0], 60.0) == part_timeouts([30.0], 60.0)


def test_the_averager_runs_each_all_reduce_with_the_hosts_latest_timeouts(monkeypatch):
    import asyncio
    import types

    import torch
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.p2p import PeerID

    from averaging.network.hivemind import backend as hivemind_backend

    built: list[dict] = []

    class Runner:  # stands in for hivemind's AllReduceRunner: records what it was built with
        def __init__(self, **kwargs):
            built.append(kwargs)
            raise RuntimeError("built")

    monkeypatch.setattr(hivemind_backend, "AllReduceRunner", Runner)
    averager = types.SimpleNamespace(_part_timeouts=torch.zeros(2, dtype=torch.float64), _p2p=None, prefix="p",
                                     _robust=None)
    group = GroupInfo(group_id=b"g" * 8, peer_ids=(PeerID(b"a"),), gathered=(b"",))
    configured = dict(sender_timeout=24.0, reducer_timeout=30.0)

    def run() -> dict:
        with pytest.raises(RuntimeError, match="built"):
            asyncio.run(hivemind_backend.ShoalAverager._run_allreduce_inplace_(
                averager, [torch.zeros(4)], group, **configured))
        return built[-1]

    assert (run()["sender_timeout"], run()["reducer_timeout"]) == (24.0, 30.0)  # nothing measured yet
    hivemind_backend.ShoalAverager.set_part_timeouts(averager, 43.2, 54.0)
    assert (run()["sender_timeout"], run()["reducer_timeout"]) == (43.2, 54.0)
