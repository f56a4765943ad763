"""How hivemind cuts our vector into parts (balanced, block-aligned: averaging.network.hivemind.parts),
and the part timeouts that follow the all-reduces measured."""

from __future__ import annotations

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import Float16Compression, NoCompression

from averaging.math import codecs
from averaging.math.wire import WireFormat
from averaging.network.hivemind.codecs import ShoalCodec
from averaging.network.hivemind.parts import (
    OPEN_GROUP_PARTS,
    averager_compression,
    balanced_part_size,
    part_timeouts,
)


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

    from averaging.network.hivemind import averager as hivemind_averager

    built: list[dict] = []

    class Runner:  # stands in for hivemind's AllReduceRunner: records what it was built with
        def __init__(self, **kwargs):
            built.append(kwargs)
            raise RuntimeError("built")

    monkeypatch.setattr(hivemind_averager, "AllReduceRunner", Runner)
    averager = types.SimpleNamespace(_part_timeouts=torch.zeros(2, dtype=torch.float64), _p2p=None, prefix="p",
                                     _robust=None, _far_state_numel=0, _lattice=False)
    group = GroupInfo(group_id=b"g" * 8, peer_ids=(PeerID(b"a"),), gathered=(b"",))
    configured = dict(sender_timeout=24.0, reducer_timeout=30.0)

    def run() -> dict:
        with pytest.raises(RuntimeError, match="built"):
            asyncio.run(hivemind_averager.ShoalAverager._run_allreduce_inplace_(
                averager, [torch.zeros(4)], group, **configured))
        return built[-1]

    assert (run()["sender_timeout"], run()["reducer_timeout"]) == (24.0, 30.0)  # nothing measured yet
    hivemind_averager.ShoalAverager.set_part_timeouts(averager, 43.2, 54.0)
    assert (run()["sender_timeout"], run()["reducer_timeout"]) == (43.2, 54.0)


# -- part sizes -----------------------------------------------------------------------------------
def hivemind_parts_per_peer(numel: int, group_size: int, part_values: int | None) -> tuple[int, ...]:
    codec = ShoalCodec("int4", part_values=part_values) if part_values else ShoalCodec("int4")
    container = TensorPartContainer([torch.zeros(numel)], (1.0,) * group_size, compression=codec)
    return container.num_parts_by_peer


@pytest.mark.parametrize("numel", [1000, 100_000, 1_000_000, 3_000_000, 20_000_000])
@pytest.mark.parametrize("group_size", [2, 3, 4])
def test_balanced_parts_are_whole_blocks_under_the_byte_cap_and_even(numel, group_size):
    bytes_per_value = codecs.bytes_per_value("int4")
    part = balanced_part_size(numel, group_size, 64, bytes_per_value=bytes_per_value)
    assert part % 64 == 0 and part * bytes_per_value <= 2**19
    parts = hivemind_parts_per_peer(numel, group_size, part)
    assert min(parts) >= 1 and max(parts) - min(parts) <= 1, parts


def test_hivemind_default_parts_are_uneven_for_small_vectors():
    """Why balanced_part_size exists: fp16-sized parts spread 3.5 parts over 4 peers as 1,1,0,2;
    int4 parts put a 1M vector in 2 parts, so 2 of 4 peers reduce nothing."""
    fp16_part = 2**19 // 2
    numel = int(3.5 * fp16_part)
    container = TensorPartContainer([torch.zeros(numel)], (1.0,) * 4, part_size_bytes=2**19)
    assert sorted(container.num_parts_by_peer) != [1, 1, 1, 1]
    assert 0 in hivemind_parts_per_peer(1_000_000, 4, None)
    assert hivemind_parts_per_peer(1_000_000, 4, balanced_part_size(
        1_000_000, 4, 64, bytes_per_value=codecs.bytes_per_value("int4"))) == (1, 1, 1, 1)


def test_balanced_part_size_validates():
    with pytest.raises(ValueError):
        balanced_part_size(100, 0, 64, bytes_per_value=0.5)
    assert balanced_part_size(0, 4, 64, bytes_per_value=0.5) == 64
    assert balanced_part_size(10, 4, 64, bytes_per_value=0.5) == 64


@pytest.mark.parametrize(("code", "peers"), [("int4", 3), ("int2", 3), ("int8", 4), ("int4", 2)])
def test_the_averager_gets_shoal_codecs_with_balanced_block_aligned_parts(code, peers):
    wire = WireFormat.of(code)
    numel = 2_500_000  # 10 MB of fp32: the benchmark's size
    compression = averager_compression(wire, numel=numel, target_group_size=None)
    assert isinstance(compression, ShoalCodec) and compression.code == code
    assert compression.return_code == wire.return_code == {"int8": "int8", "int4": "int4", "int2": "int4"}[code]
    assert compression.part_values % wire.block_size == 0
    container = TensorPartContainer([torch.zeros(numel)], (1.0,) * peers, compression=compression)
    sizes = [sum(part.numel() for part in container.get_raw_input_parts(i)) for i in range(peers)]
    assert max(sizes) - min(sizes) <= compression.part_values  # within one part of even
    assert container.num_parts_by_peer[0] >= 1 and len(set(container.num_parts_by_peer)) == 1
    assert isinstance(averager_compression(WireFormat.of("fp16"), numel=numel, target_group_size=None),
                      Float16Compression)
    assert isinstance(averager_compression(WireFormat.of("fp32"), numel=numel, target_group_size=None), NoCompression)
    assert OPEN_GROUP_PARTS % peers == 0
