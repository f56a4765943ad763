"""The simulated peers every simulation shares: real ``Trainer`` s on a config's model and data in one
process, no network. ``setup`` loads the config, the corpus split and the eval batches once per worker
process (a ``ProcessPoolExecutor`` initializer); the rest reads them from ``DATA``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from averaging.math.flat import FlatLayout
from node.process.config import load_config
from node.training.data import BatchSampler, eval_batches, load_corpus, shard_ranges, split_corpus
from node.training.model import build_model
from node.training.trainer import Trainer, inner_lr

DATA: dict = {}  # per worker process: the config, split and eval batches, loaded once


def setup(config_path: str, rounds: int, overrides: dict | None = None) -> None:
    """Load ``config_path`` (with ``section.field`` ``overrides``), its schedule spanning ``rounds``
    (10% warmup, cosine), into ``DATA``; one torch thread per worker."""
    torch.set_num_threads(1)
    config = load_config(Path(config_path), overrides)
    config = dataclasses.replace(config, inner=dataclasses.replace(
        config.inner, total_rounds=float(rounds), warmup_rounds=0.1 * rounds))
    split = split_corpus(load_corpus(config.data), config.data.eval_fraction, config.data.max_eval_bytes,
                         block_bytes=config.data.eval_block_bytes)
    DATA.update(config=config, split=split,
                evals=eval_batches(split.eval, config.model.seq_len, config.data.batch_size, config.train.eval_batches))


def samplers(seed: int, peers: int, stripe_bytes: int, num_shards: int | None = None) -> list[BatchSampler]:
    """Per rank: the whole corpus (``stripe_bytes`` 0), or shard ``rank`` of ``num_shards`` (default
    ``data.num_shards``) cut in stripes of that size, as a swarm's peers draw (a stripe past the corpus
    makes contiguous shards)."""
    c, split = DATA["config"], DATA["split"]
    shards = num_shards or c.data.num_shards
    return [BatchSampler(split.tokens, c.model.seq_len, c.data.batch_size, seed=[seed, rank], held_out=split.held_out,
                         ranges=shard_ranges(len(split.tokens), shards, rank % shards, stripe_bytes)
                         if stripe_bytes else None)
            for rank in range(peers)]


def trainer(seed: int, lr: float, rounds: float | None = None, optimizer: str | None = None) -> Trainer:
    """A peer at inner lr ``lr``: the schedule ``setup`` set, or (``rounds``) one spanning ``rounds``
    (10% warmup, cosine); ``optimizer`` replaces the config's inner optimizer."""
    c = DATA["config"]
    inner = dataclasses.replace(c.inner, lr=lr)
    if rounds is not None:
        inner = dataclasses.replace(inner, total_rounds=float(rounds), warmup_rounds=0.1 * rounds)
    if optimizer is not None:
        inner = dataclasses.replace(inner, optimizer=optimizer)
    return Trainer(build_model(c.model, seed=seed), inner, c.train, torch.device("cpu"))


def evaluate(trainer: Trainer, layout: FlatLayout, flat: torch.Tensor) -> float:
    """The eval loss of the flat parameters ``flat`` on the shared eval batches."""
    return trainer.evaluate_anchor(layout.views(flat), DATA["evals"])


def lockstep_ddp(seed: int, peers: int, rounds: int, inner_steps: int, lr: float, stripe_bytes: int = 0) -> dict:
    """What DDP computes (minus its comm hook's fp16 rounding): one model, each step the mean gradient
    of one batch per rank, clipped, one AdamW step; ``rounds x inner_steps`` steps. The eval curve
    every 5 rounds' worth of steps and the final eval loss."""
    model, ranks = trainer(seed, lr), samplers(seed, peers, stripe_bytes)
    layout = FlatLayout.of(model.model.named_parameters())
    curve = []
    for step in range(rounds * inner_steps):
        batches = [s.next_batch() for s in ranks]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        model.inner_step(x, y, inner_lr(model.inner, step / inner_steps))
        if (step + 1) % (inner_steps * 5) == 0 or step + 1 == rounds * inner_steps:
            params = layout.pack(dict(model.model.named_parameters()), layout.new_buffer())
            curve.append(((step + 1) // inner_steps, evaluate(model, layout, params)))
    return {"curve": curve, "final_eval": curve[-1][1]}
