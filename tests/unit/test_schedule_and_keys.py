"""The global round schedule, DHT keys, the inner learning-rate schedule and the step timer."""

import math
import random
import time
from collections import Counter

import pytest

from averaging.engine.stats import StepTimer
from averaging.math.outer_step import OuterConfig
from node.library.config import AveragingConfig, RoundConfig, sync_shared_fields
from node.training.config import InnerConfig
from node.training.trainer import inner_lr
from protocols.errors import ConfigError
from protocols.keys import (
    MAX_PROGRESS_SHARDS,
    auto_progress_shards,
    averager_prefix,
    peers_key,
    progress_shard,
    run_key,
    shards_to_read,
    validate_progress_shards,
    validate_run_id,
)
from protocols.manifest import RunManifest, progress_shards
from protocols.messages import MessageError
from protocols.schedule import RoundSchedule

# -- RoundSchedule -----------------------------------------------------------------------------
SCHEDULE = RoundSchedule(start_time=1000.0, round_seconds=10.0)


@pytest.mark.parametrize(
    ("t", "round"),
    [(0.0, 0), (999.999, 0), (1000.0, 1), (1009.999, 1), (1010.0, 2), (1015.0, 2), (1020.0, 3), (1995.0, 100)],
)
def test_round_at_boundaries(t, round):
    assert SCHEDULE.round_at(t) == round


def test_round_start_and_end():
    assert (SCHEDULE.round_start(1), SCHEDULE.round_end(1)) == (1000.0, 1010.0)
    assert (SCHEDULE.round_start(7), SCHEDULE.round_end(7)) == (1060.0, 1070.0)
    for round in range(1, 50):
        assert SCHEDULE.round_end(round) == SCHEDULE.round_start(round + 1)
        assert SCHEDULE.round_at(SCHEDULE.round_start(round)) == round
        assert SCHEDULE.round_at(SCHEDULE.round_end(round) - 1e-6) == round


def test_every_time_lies_inside_the_round_it_maps_to():
    rng = random.Random(0)
    for _ in range(2000):
        schedule = RoundSchedule(start_time=1.7e9 + rng.random(), round_seconds=rng.uniform(1.0, 600.0))
        t = schedule.start_time + rng.uniform(0.0, 1e6)
        round = schedule.round_at(t)
        assert round >= 1
        assert schedule.round_start(round) <= t < schedule.round_end(round)


def test_progress_counts_rounds_from_the_start_and_is_never_negative():
    assert SCHEDULE.progress(900.0) == 0.0
    assert SCHEDULE.progress(1000.0) == 0.0
    assert SCHEDULE.progress(1032.5) == pytest.approx(3.25)  # a quarter into round 4
    assert SCHEDULE.round_at(1032.5) == 4
    assert SCHEDULE.progress(1070.0) == pytest.approx(7.0)


# -- keys --------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_id", ["a", "7", "shoal-tiny", "My_Run-2", "x" * 64])
def test_validate_run_id_accepts(run_id):
    assert validate_run_id(run_id) == run_id


@pytest.mark.parametrize(
    "run_id",
    ["", "-leading", "_leading", "x" * 65, "has.dot", "has space", "slash/es", "ünïcode", "a:b", None, 42, b"bytes"],
)
def test_validate_run_id_rejects_with_a_config_error(run_id):
    with pytest.raises(ConfigError, match="run id .* is invalid"):
        validate_run_id(run_id)


def test_validate_run_id_rejects_a_trailing_newline():
    with pytest.raises(ConfigError):
        validate_run_id("abc\n")


@pytest.mark.parametrize("make_key", [run_key, peers_key, averager_prefix])
def test_keys_contain_the_run_id_and_differ_between_runs(make_key):
    assert "run-1" in make_key("run-1")
    assert make_key("run-1") != make_key("run-2")
    assert make_key("run-1") == make_key("run-1")
    with pytest.raises(ConfigError):
        make_key("bad id")


def test_the_keys_of_one_run_are_distinct():
    assert len({run_key("r"), peers_key("r"), averager_prefix("r")}) == 3


def test_averager_prefix_has_no_dot():
    prefix = averager_prefix("My_Run-2")
    assert "." not in prefix and "My_Run-2" in prefix


# -- inner learning rate -----------------------------------------------------------------------
INNER = InnerConfig(lr=1e-3, warmup_rounds=2.0, total_rounds=12.0, min_lr_ratio=0.1)


def test_inner_lr_warms_up_linearly():
    assert inner_lr(INNER, 0.5) == pytest.approx(0.25e-3)
    assert inner_lr(INNER, 1.0) == pytest.approx(0.5e-3)
    assert inner_lr(INNER, 1.5) == pytest.approx(0.75e-3)
    assert inner_lr(INNER, 0.0) == pytest.approx(0.01e-3)  # never zero: a floor of 1% of the peak
    assert inner_lr(INNER, 2.0 - 1e-9) == pytest.approx(1e-3, rel=1e-6)


def test_inner_lr_peaks_at_the_end_of_warmup_then_follows_a_cosine_to_the_floor():
    assert inner_lr(INNER, 2.0) == pytest.approx(1e-3)
    assert inner_lr(INNER, 7.0) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # halfway down
    quarter = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))
    assert inner_lr(INNER, 4.5) == pytest.approx(1e-3 * quarter)
    assert inner_lr(INNER, 12.0) == pytest.approx(1e-4)
    assert inner_lr(INNER, 13.0) == pytest.approx(1e-4)
    assert inner_lr(INNER, 1e6) == pytest.approx(1e-4)


def test_inner_lr_is_monotone_on_each_side_of_the_peak():
    rising = [inner_lr(INNER, 0.02 * i) for i in range(101)]  # 0 .. 2
    falling = [inner_lr(INNER, 2.0 + 0.1 * i) for i in range(120)]  # 2 .. 14
    assert all(a < b for a, b in zip(rising[1:], rising[2:]))
    assert all(a >= b for a, b in zip(falling, falling[1:]))
    assert max(rising + falling) == pytest.approx(1e-3)


def test_inner_lr_without_warmup_starts_at_the_peak():
    config = InnerConfig(lr=2e-3, warmup_rounds=0.0, total_rounds=10.0, min_lr_ratio=0.0)
    assert inner_lr(config, 0.0) == pytest.approx(2e-3)
    assert inner_lr(config, 10.0) == pytest.approx(0.0, abs=1e-12)


# -- StepTimer ---------------------------------------------------------------------------------
def test_step_timer_with_no_samples_allows_a_step_until_the_deadline():
    timer = StepTimer()
    assert timer.mean is None
    assert timer.fits_before(100.0, now=100.0)
    assert not timer.fits_before(100.0, now=100.001)


def test_step_timer_is_an_exponential_moving_average():
    timer = StepTimer(alpha=0.5)
    timer.add(1.0)
    assert timer.mean == 1.0  # the first sample is taken as is
    timer.add(3.0)
    assert timer.mean == 2.0
    assert timer.fits_before(10.0, now=8.0)
    assert not timer.fits_before(10.0, now=8.5)
    default = StepTimer()
    for seconds in (1.0, 2.0):
        default.add(seconds)
    assert default.mean == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)




def test_step_timer_needs_the_time_it_is_asked_about():
    timer = StepTimer()
    timer.add(3600.0)
    now = time.time()
    assert not timer.fits_before(now + 60.0, now)
    assert timer.fits_before(now + 7200.0, now)


def test_progress_shards_keep_the_one_key_and_spread_peers_evenly():
    """Shard 0 is the key every unsharded run uses (old and new peers meet there); a peer's shard
    is a stable hash of its id, and 2,048 ids fill 8 shards evenly."""
    assert peers_key("r", 0) == peers_key("r") == "shoal.r.peers"
    keys = {peers_key("r", shard) for shard in range(MAX_PROGRESS_SHARDS)}
    assert len(keys) == MAX_PROGRESS_SHARDS and run_key("r") not in keys
    with pytest.raises(ValueError):
        peers_key("r", MAX_PROGRESS_SHARDS)
    ids = [f"12D3KooW{i:040d}" for i in range(2048)]
    assert all(progress_shard(i, 1) == 0 for i in ids[:10])
    assert [progress_shard(i, 8) for i in ids[:50]] == [progress_shard(i, 8) for i in ids[:50]]
    counts = Counter(progress_shard(i, 8) for i in ids)
    assert sorted(counts) == list(range(8)) and max(counts.values()) < 1.3 * 256, counts


@pytest.mark.parametrize("bad", [0, 3, 128, True, "4", 2.0])
def test_a_progress_shard_count_that_is_no_power_of_two_up_to_64_is_one_line(bad):
    with pytest.raises(ConfigError, match=r"averaging.progress_shards .* power of two from 1 to 64"):
        validate_progress_shards(bad)


def test_the_shard_setting_rides_the_manifest():
    """Every run's shared fields name the setting (one key, "auto" or a fixed count), which
    ``progress_shards`` reads back (and a bad count is refused, on the network and in a config alike)."""
    one_key = sync_shared_fields(outer=OuterConfig(), rounds=RoundConfig(), averaging=AveragingConfig(progress_shards=1))
    assert one_key["averaging.progress_shards"] == 1
    default = sync_shared_fields(outer=OuterConfig(), rounds=RoundConfig(), averaging=AveragingConfig())
    assert default == {**one_key, "averaging.progress_shards": "auto"}
    sharded = sync_shared_fields(outer=OuterConfig(), rounds=RoundConfig(), averaging=AveragingConfig(progress_shards=8))
    assert sharded == {**one_key, "averaging.progress_shards": 8}
    make = lambda fields: RunManifest.create("r", fields, start_time=1e9, round_seconds=10.0)  # noqa: E731
    assert progress_shards(make(one_key)) == 1 and progress_shards(make(sharded)) == 8
    assert progress_shards(make(default)) == "auto"
    for bad in (6, "many", None):
        with pytest.raises(MessageError, match="power of two"):
            progress_shards(make({**one_key, "averaging.progress_shards": bad}))
    with pytest.raises(ConfigError, match="power of two"):
        AveragingConfig(progress_shards=6)
    with pytest.raises(ConfigError, match='or "auto"'):
        AveragingConfig(progress_shards="Auto")


def test_auto_shards_start_at_48_peers_with_4_keys_and_come_down_with_a_margin():
    """The writer's count: one key below 48 live peers, then the power of two at most N / 12 (the
    measured guidance, docs/scale.md), capped at 64; it rises at once and falls only once the swarm
    is a quarter below the size that raised it."""
    grow = {n: auto_progress_shards(n) for n in (1, 16, 47, 48, 95, 96, 191, 192, 767, 768, 5000)}
    assert grow == {1: 1, 16: 1, 47: 1, 48: 4, 95: 4, 96: 8, 191: 8, 192: 16, 767: 32, 768: 64, 5000: 64}
    assert auto_progress_shards(48, 1) == 4 and auto_progress_shards(200, 4) == 16  # up at once
    assert auto_progress_shards(47, 4) == 4 and auto_progress_shards(36, 4) == 4  # held near the boundary
    assert auto_progress_shards(35, 4) == 1  # 35 < 0.75 x 48
    assert auto_progress_shards(95, 8) == 8 and auto_progress_shards(71, 8) == 4  # 71 < 0.75 x 96
    assert auto_progress_shards(10, 64) == 1
    # Every count is a power of two no larger than the cap: a writer lands in a key a reader at any
    # count up to its own reads.
    assert all(c & (c - 1) == 0 and c <= MAX_PROGRESS_SHARDS
               for n in range(0, 3000, 7) for cur in (1, 4, 8, 64) for c in [auto_progress_shards(n, cur)])


def test_a_reader_reads_up_to_the_highest_count_published_within_a_ceiling():
    """Readers follow the writers (a peer at 4 keys is found by one still at 1), but a count far
    above what the reader's own count of peers gives (a stranger's record) is cut to 4x it."""
    assert shards_to_read(1, [None, 1, 1], 20) == 1
    assert shards_to_read(1, [1, 4, 4], 47) == 4  # the swarm just crossed 48: followed
    assert shards_to_read(4, [1, 1], 40) == 4  # our own keys always
    assert shards_to_read(1, [64], 10) == 4  # a lone claim of 64 in a small swarm: cut to 4
    assert shards_to_read(8, [64, 8], 100) == 32 and shards_to_read(16, [64], 400) == 64
    # Whatever the mix of published counts up to 4x ours, a writer at any of them lands below the
    # count read.
    ids = [f"12D3KooW{i:040d}" for i in range(500)]
    for counts in ([1, 4], [4, 8], [1, 4, 16]):
        read = shards_to_read(counts[0], counts, 200)
        assert all(progress_shard(i, c) < read for i in ids for c in counts)
