"""Where a peer's training tokens come from: the byte corpus or a tokenized document dataset.

The training loop sees one interface for both: the fields peers compare at join, a sampler over
this peer's shard, the held-out batches, and ``move`` to another shard. The byte corpus (the
default: raw bytes of local text files, ``node.training.data``) holds every shard in one memory map,
so a move is instant. A document dataset (a tokenizer, JSONL/parquet/arrow, a hub dataset:
``node.training.token_cache``) tokenizes one shard per file; moving to a shard not yet in the cache
starts its build in the background and keeps training on the old shard until it is ready, so a
move never stalls a round.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from node.training.data import (
    BatchSampler,
    DataConfig,
    Split,
    corpus_fingerprint,
    eval_batches,
    load_corpus,
    shard_ranges,
    split_corpus,
)

logger = logging.getLogger(__name__)

Batches = list[tuple[torch.Tensor, torch.Tensor]]

# What must agree even where the text may differ (data.heterogeneous): ids mean the same tokens.
TOKENIZER_FIELDS = ("data.tokenizer_sha256", "data.vocab_size")


class ByteCorpus:
    """Raw bytes of local text files: shards are stripes of one corpus, eval its held-out blocks."""

    tokenizer_spec = "bytes"
    vocab_size = 256
    tokenizer = None  # raw bytes: nothing to ship beside a checkpoint

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        tokens = load_corpus(config)
        self._fingerprint = corpus_fingerprint(tokens)
        self.split: Split = split_corpus(tokens, config.eval_fraction, config.max_eval_bytes,
                                         block_bytes=config.eval_block_bytes)

    def fingerprint(self) -> dict[str, Any]:
        """``data.corpus_bytes`` and ``data.corpus_sha256`` (the fields before documents existed)."""
        return {} if self.config.heterogeneous else dict(self._fingerprint)

    def sampler(self, shard: int, seq_len: int, batch_size: int, seed: int) -> BatchSampler:
        return BatchSampler(self.split.tokens, seq_len, batch_size, seed=seed, held_out=self.split.held_out,
                            ranges=self._ranges(shard))

    def move(self, sampler: BatchSampler, shard: int) -> BatchSampler:
        sampler.retarget(self._ranges(shard))
        return sampler

    def eval_set(self, seq_len: int, batch_size: int, num_batches: int) -> Batches:
        return eval_batches(self.split.eval, seq_len, batch_size, num_batches)

    def _ranges(self, shard: int) -> list[tuple[int, int]]:
        data = self.config
        return shard_ranges(len(self.split.tokens), data.num_shards, shard, data.shard_stripe_bytes)


class DocumentShards:
    """A tokenized document dataset: one cached token file per shard, held-out documents apart."""

    def __init__(self, config: DataConfig) -> None:
        from node.training.documents import check_files
        from node.training.token_cache import TokenizedDataset  # datasets loads only for these runs

        self.config = config
        self.dataset = TokenizedDataset(config)
        check_files(self.dataset.source)  # a broken file fails now, before the peer joins a swarm
        self.tokenizer_spec = config.tokenizer
        self.tokenizer = self.dataset.tokenizer
        self.vocab_size = self.tokenizer.vocab_size
        self._seed, self._moves = 0, 0  # a new sampler per move: seeded by the peer's seed and the move

    def fingerprint(self) -> dict[str, Any]:
        """The dataset's fields (``data.dataset_sha256``, ``data.dataset_files``) and the tokenizer's;
        a heterogeneous run compares only the tokenizer's."""
        fields = self.dataset.fingerprint()
        if self.config.heterogeneous:
            return {key: value for key, value in fields.items() if key in TOKENIZER_FIELDS}
        # Which documents are held out and where reading stops: peers that differ would train on
        # each other's eval text.
        data = self.config
        return {**fields, "data.eval_fraction": data.eval_fraction, "data.max_eval_tokens": data.max_eval_tokens,
                "data.max_corpus_bytes": data.max_corpus_bytes}

    def sampler(self, shard: int, seq_len: int, batch_size: int, seed: int) -> BatchSampler:
        self._seed = seed
        return BatchSampler(self.dataset.shard_tokens(shard), seq_len, batch_size, seed=[seed, shard])

    def move(self, sampler: BatchSampler, shard: int) -> BatchSampler | None:
        """The sampler over ``shard``, or None while its tokens are being built (the caller keeps its
        old shard and asks again later)."""
        if self.dataset.failed(shard):
            self.dataset.shard_tokens(shard)  # re-raises the build's error: the data is broken, say so
        if not self.dataset.is_ready(shard):
            self.dataset.prepare(shard)
            return None
        self._moves += 1
        return BatchSampler(self.dataset.shard_tokens(shard), sampler.seq_len, sampler.batch_size,
                            seed=[self._seed, shard, self._moves])

    def eval_set(self, seq_len: int, batch_size: int, num_batches: int) -> Batches:
        return eval_batches(np.asarray(self.dataset.eval_tokens()), seq_len, batch_size, num_batches)


def open_source(config: DataConfig) -> ByteCorpus | DocumentShards:
    """The byte corpus unless the run names a tokenizer, a non-text format or a hub dataset."""
    from node.training.documents import uses_documents

    return DocumentShards(config) if uses_documents(config) else ByteCorpus(config)
