"""Corpus loading and caching, held-out split, shards and batches."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from node.training import data
from node.training.data import (
    BatchSampler,
    DataConfig,
    default_corpus_files,
    eval_batches,
    load_corpus,
    resolve_files,
    shard_ranges,
    split_corpus,
)

torch.set_num_threads(1)


def _write_corpus(root: Path) -> list[bytes]:
    """Three files (one nested) big enough to pass the minimum corpus size; returns contents in path order."""
    rng = np.random.default_rng(0)
    contents = {
        root / "a.txt": rng.integers(0, 256, 9000, dtype=np.uint8).tobytes(),
        root / "b.txt": b"hello shoal\n" * 800,
        root / "sub" / "c.txt": rng.integers(0, 256, 7000, dtype=np.uint8).tobytes(),
    }
    for path, content in contents.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return [contents[path] for path in sorted(contents)]


def _config(tmp_path: Path, **overrides) -> DataConfig:
    return DataConfig(
        paths=[str(tmp_path / "text" / "**" / "*.txt")], cache_dir=str(tmp_path / "cache"), **overrides
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eval_fraction": 0.0}, r"data\.eval_fraction"),
        ({"eval_fraction": 0.5}, r"data\.eval_fraction"),
        ({"num_shards": 0}, r"data\.num_shards"),
        ({"batch_size": -4}, r"data\.batch_size"),
        ({"max_corpus_bytes": 0}, r"data\.max_corpus_bytes"),
        ({"max_eval_bytes": 0}, r"data\.max_eval_bytes"),
        ({"paths": "*.txt"}, r"data\.paths"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_default_corpus_has_stdlib_sources() -> None:
    files = default_corpus_files()
    py_files = [f for f in files if f.suffix == ".py"]
    assert len(py_files) > 50
    assert any(f.name == "os.py" for f in py_files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == sorted(files)


def test_resolve_files_expands_recursive_globs(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "text")
    files = resolve_files(_config(tmp_path))
    assert [f.name for f in files] == ["a.txt", "b.txt", "c.txt"]


def test_unmatched_glob_is_a_clear_error(tmp_path: Path) -> None:
    config = DataConfig(paths=[str(tmp_path / "nothing" / "*.txt")], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(
        ValueError, match=r"data\.paths: no files match .*nothing.*point it at existing text files"
    ):
        load_corpus(config)


def test_load_corpus_concatenates_files_and_caches_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    contents = _write_corpus(tmp_path / "text")
    config = _config(tmp_path)
    tokens = load_corpus(config)
    assert tokens.dtype == np.uint8
    assert tokens.tobytes() == b"\n".join(contents)
    cache_files = list((tmp_path / "cache").glob("corpus-*.bin"))
    assert len(cache_files) == 1
    assert not list((tmp_path / "cache").glob("*.tmp"))  # the temp file was renamed, not left behind

    # A second load must come from the cache: reading any corpus file would now fail.
    def no_reading(*args, **kwargs):
        raise AssertionError("corpus files were read again instead of using the cache")

    monkeypatch.setattr(data, "_read_files", no_reading)
    again = load_corpus(config)
    assert again.tobytes() == tokens.tobytes()


def test_editing_a_file_invalidates_the_cache(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "text")
    config = _config(tmp_path)
    load_corpus(config)
    edited = tmp_path / "text" / "b.txt"
    edited.write_bytes(b"changed\n" * 1000)
    os.utime(edited, ns=(0, 10**18))  # make sure mtime differs even on coarse clocks
    tokens = load_corpus(config)
    assert b"changed" in tokens.tobytes()
    assert len(list((tmp_path / "cache").glob("corpus-*.bin"))) == 2


def test_load_corpus_stops_at_max_bytes(tmp_path: Path) -> None:
    contents = _write_corpus(tmp_path / "text")
    tokens = load_corpus(_config(tmp_path, max_corpus_bytes=20_000))
    assert len(tokens) == 20_000
    assert tokens.tobytes() == b"\n".join(contents)[:20_000]


def test_tiny_corpus_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "small.txt").write_bytes(b"too short")
    with pytest.raises(ValueError, match="data.paths"):
        load_corpus(_config(tmp_path))
    assert not list(tmp_path.rglob("corpus-*.bin"))  # a useless corpus is not cached


def test_eval_split_is_spread_over_the_whole_corpus_and_fixed() -> None:
    tokens = np.arange(100_000, dtype=np.int64)  # distinct values make overlap detectable
    split = split_corpus(tokens, eval_fraction=0.05, max_eval_bytes=1_000_000, block_bytes=500)
    held = split.held_out
    assert len(split.eval) == 5000 and held.count == 10 and held.block == 500
    np.testing.assert_array_equal(split.eval, np.concatenate([tokens[s:s + 500] for s in held.starts()]))
    # Spread: one block in every tenth of the corpus (not the tail), the same on every call.
    assert [int(s) // 10_000 for s in held.starts()] == list(range(10))
    np.testing.assert_array_equal(split_corpus(tokens, 0.05, 1_000_000, block_bytes=500).eval, split.eval)
    assert split.train_bytes == 95_000
    capped = split_corpus(tokens, eval_fraction=0.4, max_eval_bytes=1234, block_bytes=500)
    assert len(capped.eval) <= 1234 and capped.held_out.count >= 8  # small splits use smaller blocks


def test_training_windows_never_touch_held_out_text() -> None:
    tokens = np.arange(200_000, dtype=np.int64)
    split = split_corpus(tokens, eval_fraction=0.02, max_eval_bytes=1_000_000, block_bytes=256)
    held = set(split.eval.tolist())
    for shard in range(4):
        ranges = shard_ranges(len(tokens), 4, shard, stripe_bytes=4096)
        mine = np.zeros(len(tokens), dtype=bool)
        for lo, hi in ranges:
            mine[lo:hi] = True
        sampler = BatchSampler(split.tokens, seq_len=64, batch_size=256, seed=shard, held_out=split.held_out,
                               ranges=ranges)
        for _ in range(20):
            x, y = sampler.next_batch()
            window = torch.cat([x, y[:, -1:]], dim=1)
            assert not held.intersection(window.flatten().tolist())  # no held-out byte, ever
            assert mine[window.flatten().numpy()].all()  # only this shard's bytes


def test_a_window_longer_than_the_gaps_between_held_out_blocks_is_refused() -> None:
    tokens = np.arange(10_000, dtype=np.int64)
    split = split_corpus(tokens, eval_fraction=0.3, max_eval_bytes=10_000, block_bytes=100)  # period 3 blocks
    with pytest.raises(ValueError, match="in a row between held-out blocks"):
        BatchSampler(split.tokens, seq_len=300, batch_size=2, seed=0, held_out=split.held_out, ranges=[(0, 5000)])
    BatchSampler(split.tokens, seq_len=150, batch_size=2, seed=0, held_out=split.held_out, ranges=[(0, 5000)]).next_batch()


def test_eval_split_too_small_is_rejected() -> None:
    with pytest.raises(ValueError, match="eval_fraction"):
        split_corpus(np.zeros(50, dtype=np.uint8), eval_fraction=0.01, max_eval_bytes=1000)


@pytest.mark.parametrize(("n_tokens", "num_shards", "stripe"),
                         [(0, 3, 8), (10, 1, 4), (10, 3, 2), (1000, 16, 16), (1000, 16, 1000), (17, 17, 4), (5, 8, 4)])
def test_shards_are_disjoint_striped_and_cover_everything(n_tokens: int, num_shards: int, stripe: int) -> None:
    owner = np.full(n_tokens, -1)
    for shard in range(num_shards):
        for lo, hi in shard_ranges(n_tokens, num_shards, shard, stripe):
            assert 0 <= lo < hi <= n_tokens and (owner[lo:hi] == -1).all()  # disjoint
            owner[lo:hi] = shard
    assert (owner >= 0).all()  # every byte belongs to a shard
    sizes = np.bincount(owner, minlength=num_shards)
    used = max(1, min(stripe, n_tokens // num_shards))
    assert sizes.max() - sizes.min() <= used  # balanced up to one stripe
    # Striped: consecutive stripes go to consecutive shards, so every shard spans the corpus.
    if n_tokens >= 2 * num_shards * used:
        assert all(shard_ranges(n_tokens, num_shards, s, stripe)[-1][0] >= n_tokens - 2 * num_shards * used
                   for s in range(num_shards))


def test_shard_index_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError):
        shard_ranges(100, 4, 4, 16)


def test_batch_sampler_windows_are_slices_of_one_stripe_and_y_is_x_shifted() -> None:
    corpus = np.arange(4000, dtype=np.int64)  # distinct values: each window reveals where it came from
    ranges = shard_ranges(len(corpus), 4, 2, stripe_bytes=250)  # 4 stripes: 500..750, 1500..1750, ...
    sampler = BatchSampler(corpus, seq_len=16, batch_size=64, seed=3, ranges=ranges)
    seen: dict[int, set[int]] = {lo: set() for lo, _ in ranges}
    for _ in range(20):
        x, y = sampler.next_batch()
        assert x.shape == y.shape == (64, 16)
        assert x.dtype == y.dtype == torch.int64
        for row_x, row_y in zip(x, y, strict=True):
            start = int(row_x[0])
            [(lo, hi)] = [(lo, hi) for lo, hi in ranges if lo <= start < hi]
            assert start + 17 <= hi  # never straddles into the next shard's stripe
            np.testing.assert_array_equal(row_x.numpy(), corpus[start : start + 16])
            np.testing.assert_array_equal(row_y.numpy(), corpus[start + 1 : start + 17])
            seen[lo].add(start - lo)
    # 1280 draws over 4 x 234 starts: every stripe is drawn from, both of its ends reachable.
    for offsets in seen.values():
        assert min(offsets) < 40 and max(offsets) > 250 - 17 - 40


def test_batch_sampler_is_reproducible_from_its_seed() -> None:
    shard = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)
    a, b, c = (BatchSampler(shard, seq_len=16, batch_size=4, seed=s) for s in (7, 7, 8))
    batches_a = [a.next_batch() for _ in range(3)]
    batches_b = [b.next_batch() for _ in range(3)]
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(batches_a[0][0], c.next_batch()[0])


def test_batch_sampler_rejects_a_shard_shorter_than_a_window() -> None:
    with pytest.raises(ValueError, match="fewer data.num_shards or more data"):
        BatchSampler(np.zeros(16, dtype=np.uint8), seq_len=16, batch_size=2, seed=0)


def test_batch_sampler_accepts_the_memmapped_corpus(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "text")
    tokens = load_corpus(_config(tmp_path))
    x, y = BatchSampler(tokens, seq_len=8, batch_size=2, seed=0).next_batch()
    assert x.shape == (2, 8) and x.max() < 256


def test_eval_batches_are_fixed_evenly_spaced_and_cover_the_split() -> None:
    tokens = np.arange(1000, dtype=np.int64)
    batches = eval_batches(tokens, seq_len=10, batch_size=4, num_batches=3)
    assert len(batches) == 3
    starts = [int(row[0]) for x, _ in batches for row in x]
    assert starts[0] == 0 and starts[-1] == 1000 - 11  # first and last windows touch both ends
    gaps = np.diff(starts)
    assert gaps.min() >= 1 and gaps.max() - gaps.min() <= 1
    for x, y in batches:
        assert x.shape == y.shape == (4, 10)
        torch.testing.assert_close(x + 1, y)
    again = eval_batches(tokens, seq_len=10, batch_size=4, num_batches=3)
    for (xa, ya), (xb, yb) in zip(batches, again, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_eval_batches_reject_a_split_shorter_than_a_window() -> None:
    with pytest.raises(ValueError, match="eval_fraction"):
        eval_batches(np.zeros(5, dtype=np.uint8), seq_len=8, batch_size=2, num_batches=1)
