"""The training loop's view of its data: a document dataset's shard move never stalls a round, and
a shard whose build failed is said, not retried in silence."""

from __future__ import annotations

import time

import pytest

from node.training.data import DataConfig
from node.training.sources import ByteCorpus, DocumentShards, open_source
from protocols.errors import ConfigError
from tests.unit.text_fixtures import documents, train_tokenizer, write_jsonl


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_move_waits_for_the_shards_background_build_and_a_failed_build_is_raised(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "data" / "a.jsonl", documents(240, words=30))
    config = DataConfig(paths=[str(tmp_path / "data" / "*.jsonl")], tokenizer=str(train_tokenizer(tmp_path / "bpe")),
                        cache_dir=str(tmp_path / "cache"), num_shards=4, eval_fraction=0.1)
    source = open_source(config)
    assert isinstance(source, DocumentShards) and source.vocab_size == 400
    sampler = source.sampler(0, 16, 4, seed=1)
    assert source.move(sampler, 1) is None  # not built yet: built in the background, the old shard kept
    wait_for(lambda: source.dataset.is_ready(1))
    moved = source.move(sampler, 1)
    assert moved is not None and moved is not sampler and moved.next_batch()[0].shape == (4, 16)

    def broken(shard):
        raise ConfigError("data.paths: a.jsonl cannot be read")

    monkeypatch.setattr(source.dataset, "_build", broken)
    assert source.move(moved, 2) is None
    wait_for(lambda: source.dataset.failed(2))
    with pytest.raises(ConfigError, match="cannot be read"):
        source.move(moved, 2)


def test_the_byte_corpus_moves_at_once(tmp_path):
    (tmp_path / "corpus.txt").write_text("".join(f"line {i} of some text to learn\n" for i in range(4000)))
    source = open_source(DataConfig(paths=[str(tmp_path / "corpus.txt")], cache_dir=str(tmp_path / "cache"), num_shards=4))
    assert isinstance(source, ByteCorpus) and source.tokenizer is None
    sampler = source.sampler(0, 16, 4, seed=1)
    assert source.move(sampler, 3) is sampler and sampler.next_batch()[0].shape == (4, 16)
