"""The baseline a user would otherwise run: synchronous data parallelism (torch DDP over gloo).

Same model, data shards, inner optimizer, learning-rate schedule (as a function of wall-clock
time) and throttles as the shoal peers; gradients all-reduced every step with DDP's fp16
compression hook, over the same capped links. Launched by ``sync_modes.py``, one process per rank:

    RANK=0 WORLD_SIZE=4 MASTER_ADDR=10.213.0.1 MASTER_PORT=29500 \
        python -m benchmarks.swarm.ddp_baseline --config benchmarks/configs/bench.toml --budget 120 --out r0.jsonl

``--no-sync`` is the ceiling: the same processes training alone, with no communication at all.

``--tokens N`` (``learning.py``) trains to a token budget instead: N tokens over all ranks (one
process's own with ``--no-sync``), the learning-rate schedule following the share of N done (so
``inner.total_rounds`` rounds span the budget, as the shoal runs' rounds span theirs), one eval
per ``N / inner.total_rounds`` tokens and one at the end.

Utilization: DDP overlaps its all-reduce with backward, so "compute" is the calibrated time of
one step without communication (median of 5 ``no_sync`` steps) times the throttle, per step.

``--throttle-clock`` (how the throttle stretches a step): ``calibrated`` (the default) sleeps a fixed
``(throttle - 1) x`` that calibrated forward and backward, the one rule that leaves DDP's all-reduce
out; with ``--no-sync``, ``wall`` sleeps ``(throttle - 1) x`` the step's own wall time, optimizer
step and batch included, exactly as ``shoal run --throttle`` does, and ``cpu`` ``(throttle - 1) x``
its thread CPU time, as ``cpu_throttle.py``'s peers do: a lone baseline then runs at the pace a shoal
peer of that throttle would (``speedup_real.py``). At learning.toml's model, throttle 2.5, alone on
the machine: 285 steps a 10 s round calibrated, 263 for a lone ``shoal run``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from node.process.config import load_config
from node.training.data import BatchSampler, eval_batches, load_corpus, shard_ranges, split_corpus
from node.training.model import build_model
from node.training.trainer import Trainer, inner_lr


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", type=float, help="seconds of training (the lr schedule follows wall-clock rounds)")
    budget.add_argument("--tokens", type=int, help="tokens of training over all ranks (the lr schedule follows them)")
    parser.add_argument("--throttle", type=float, default=1.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-sync", action="store_true",
                        help="the ceiling: train alone, no communication at all (same model, data, throttle)")
    parser.add_argument("--throttle-clock", choices=("calibrated", "wall", "cpu"), default="calibrated",
                        help="stretch a step by a calibrated compute time, or (--no-sync) its own wall or CPU time")
    args = parser.parse_args()
    if args.throttle_clock != "calibrated" and not args.no_sync:
        parser.error(f"--throttle-clock {args.throttle_clock} needs --no-sync (a DDP step's time includes its "
                     "all-reduce); use --throttle-clock calibrated for DDP")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = load_config(args.config)
    torch.set_num_threads(max(1, config.train.torch_threads))
    if not args.no_sync:
        dist.init_process_group("gloo", rank=rank, world_size=world)

    split = split_corpus(load_corpus(config.data), config.data.eval_fraction, config.data.max_eval_bytes,
                         block_bytes=config.data.eval_block_bytes)
    # The batch order follows train.seed too, so two seeds differ in data order as well as init.
    sampler = BatchSampler(split.tokens, config.model.seq_len, config.data.batch_size, seed=[config.train.seed, rank],
                           held_out=split.held_out,
                           ranges=shard_ranges(len(split.tokens), config.data.num_shards, rank % config.data.num_shards,
                                                config.data.shard_stripe_bytes))
    evals = eval_batches(split.eval, config.model.seq_len, config.data.batch_size, config.train.eval_batches)
    model = build_model(config.model, seed=config.train.seed)
    if not args.no_sync:
        model = DistributedDataParallel(model)
        model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    module = model.module if not args.no_sync else model
    # shoal's own inner optimizer (AdamW without weight decay on biases and norms, or Muon on the
    # Linear weights and AdamW on the rest, as inner.optimizer says), on the same parameters.
    optimizers = Trainer(module, config.inner, config.train, torch.device("cpu")).optimizers

    def step(sync: bool) -> None:
        x, y = sampler.next_batch()
        context = model.no_sync() if not sync and not args.no_sync else torch.enable_grad()
        with context:
            _, loss = model(x, y)
            loss.backward()
        if sync:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.inner.grad_clip)
            for optimizer in optimizers:
                optimizer.step()
        model.zero_grad(set_to_none=True)

    calibration = []
    for _ in range(5):
        t0 = time.perf_counter()
        step(sync=False)
        calibration.append(time.perf_counter() - t0)
    compute_per_step = statistics.median(calibration) * args.throttle

    out = args.out.open("w")
    if not args.no_sync:
        dist.barrier()
    started = time.time()
    tokens = steps = 0
    last_report = started
    batch_tokens = config.data.batch_size * config.model.seq_len
    stop = torch.zeros(1)
    measured = 0.0  # actual step time, throttle included (the ceiling's compute: it never waits)
    ranks = 1 if args.no_sync else world
    rank_budget = args.tokens // ranks if args.tokens else None  # tokens this rank trains on
    eval_every = rank_budget / config.inner.total_rounds if rank_budget else None
    next_eval = eval_every
    clock = time.thread_time if args.throttle_clock == "cpu" else time.perf_counter
    while True:
        t0 = time.perf_counter()
        c0 = clock()
        if rank_budget:
            progress = tokens / rank_budget * config.inner.total_rounds
        else:
            progress = (time.time() - started) / config.round.seconds
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = inner_lr(config.inner, progress)
        step(sync=True)
        if args.throttle > 1:  # stretch by the calibrated compute, or by this step's own time on the chosen clock
            stretched = compute_per_step / args.throttle if args.throttle_clock == "calibrated" else clock() - c0
            time.sleep((args.throttle - 1) * stretched)
        steps, tokens = steps + 1, tokens + batch_tokens
        measured += time.perf_counter() - t0
        now = time.time()
        stop[0] = float(tokens >= rank_budget if rank_budget else now - started >= args.budget)
        if not args.no_sync:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        due = tokens >= next_eval if rank_budget else now - last_report >= config.round.seconds
        if due or stop[0] > 0:
            next_eval = next_eval + eval_every if rank_budget else None
            eval_loss = None
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    eval_loss = sum(float(module(x, y)[1]) for x, y in evals) / len(evals)
                model.train()
            record = {"event": "round", "time": time.time(), "elapsed": now - started, "steps": steps, "tokens": tokens,
                      "compute_s": measured if args.no_sync else steps * compute_per_step, "wall_s": now - started, "eval_loss": eval_loss,
                      "step_s": (now - started) / steps}
            out.write(json.dumps(record) + "\n")
            out.flush()
            last_report = time.time()
        if stop[0] > 0:
            break
    if not args.no_sync:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
