"""What the terminal view costs the training loop: inner steps/s of the tiny model with no view,
with ``PlainView`` and with ``LiveView``, measured side by side in one run.

    .venv/bin/python -m benchmarks.micro.ui_overhead [--block-seconds 3] [--repeats 12]

Each variant runs for ``--block-seconds`` at a time, the variants interleaved (none, plain,
live, none, ...) with the order rotated each repeat, so a machine whose load drifts (other jobs
on these 2 cores) affects all three alike. The loop does what ``node.process.peer.Node`` does per step:
one inner AdamW step, then a status update handed to the view, and a ``round_done`` every
``--round-seconds``. The live view draws to an in-memory terminal (``force_terminal``: rich
lays out and writes every frame, twice a second, from its refresh thread) with a table of 8 peers.

Writes ``benchmarks/results/ui_overhead.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from benchmarks.common.results import RESULTS, command_line, write_results
from node.observe.ui import LiveView, NodeStatus, PlainView
from node.process.config import load_config
from node.training.model import build_model
from node.training.trainer import Trainer
from protocols.progress import ProgressRecord

VARIANTS = ("none", "plain", "live")


def fake_peers(now: float) -> tuple[ProgressRecord, ...]:
    return tuple(
        ProgressRecord(peer_id=f"12D3KooW{i:044d}", round=12, tokens_per_s=1000.0 + 100 * i, loss=3.0, eval_loss=3.1,
                       device="cpu", utilization=0.9, bytes_sent=0, bytes_received=0, mode="full", version="0.1.0",
                       tokens=10_000, time=now - i, phase="training")
        for i in range(8)
    )


def run_block(variant: str, trainer: Trainer, batch, seconds: float, round_seconds: float) -> dict:
    """Train for ``seconds`` with the given view; returns steps and elapsed time."""
    x, y = batch
    view = None
    if variant == "plain":
        view = PlainView()
    elif variant == "live":
        view = LiveView(console=Console(file=io.StringIO(), width=100, force_terminal=True))
    status = NodeStatus(peer_id="12D3KooW" + "0" * 44, run_id="bench", peers=8, max_rounds=100, phase="training",
                        device="cpu", peer_records=fake_peers(time.time()))
    if view is not None:
        view.start()
    steps, tokens = 0, x.numel()
    cpu_started = time.process_time()  # all threads of this process, rich's refresh thread included
    started = time.perf_counter()
    next_round = started + round_seconds
    try:
        while (now := time.perf_counter()) - started < seconds:
            loss = float(trainer.inner_step(x, y, 1e-3))
            steps += 1
            if view is None:
                continue
            # what Node._update_status does, then hand the snapshot to the view
            status.round, status.loss = 12, loss
            status.tokens_per_s = steps * tokens / max(now - started, 1e-9)
            status.round_start, status.round_end = time.time() - 1.0, time.time() + 5.0
            view.update(status)
            if now >= next_round:
                next_round += round_seconds
                status.finished_round += 1
                status.eval_loss, status.last_sync, status.group_size, status.utilization = loss, "averaged", 8, 0.9
                view.round_done(status)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        if view is not None:
            view.stop()
    return {"variant": variant, "steps": steps, "seconds": elapsed, "steps_per_s": steps / elapsed,
            "cpu_ms_per_step": 1000 * cpu / max(steps, 1)}


def frame_cost(frames: int = 200) -> float:
    """Milliseconds to build and lay out one live-view frame (what the refresh thread does 4x/s)."""
    view = LiveView(console=Console(file=io.StringIO(), width=100, force_terminal=True))
    view.update(NodeStatus(peer_id="12D3KooW" + "0" * 44, run_id="bench", peers=8, round=12, loss=3.0,
                           round_start=time.time() - 1, round_end=time.time() + 5, peer_records=fake_peers(time.time())))
    console = view.console
    started = time.perf_counter()
    for _ in range(frames):
        console.print(view.render())
    return 1000 * (time.perf_counter() - started) / frames


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--round-seconds", type=float, default=2.0, help="round_done every this many seconds")
    parser.add_argument("--out", type=Path, default=RESULTS / "ui_overhead")
    args = parser.parse_args()

    torch.set_num_threads(1)  # as the tiny config's peers do (train.torch_threads = 1)
    torch.manual_seed(0)
    config = load_config(None)
    # PlainView logs one line per round: send it somewhere real, at INFO, as the CLI does.
    logging.basicConfig(level=logging.INFO, stream=io.StringIO(), force=True)
    trainer = Trainer(build_model(config.model, seed=0), config.inner, config.train, torch.device("cpu"))
    shape = (config.data.batch_size, config.model.seq_len)
    batch = (torch.randint(0, config.model.vocab_size, shape), torch.randint(0, config.model.vocab_size, shape))

    run_block("none", trainer, batch, 2.0, args.round_seconds)  # warm-up (allocator, AdamW state)
    load_before = os.getloadavg()
    blocks = []
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]
        for variant in order:
            block = run_block(variant, trainer, batch, args.block_seconds, args.round_seconds)
            blocks.append({"repeat": repeat, **block})
            print(f"repeat {repeat} {variant:>5}: {block['steps_per_s']:.1f} steps/s, "
                  f"{block['cpu_ms_per_step']:.2f} CPU ms/step", flush=True)
    load_after = os.getloadavg()
    frame_ms = frame_cost()

    summary = {}
    for variant in VARIANTS:
        rates = [b["steps_per_s"] for b in blocks if b["variant"] == variant]
        cpu = [b["cpu_ms_per_step"] for b in blocks if b["variant"] == variant]
        summary[variant] = {"median": statistics.median(rates), "mean": statistics.fmean(rates),
                            "stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0, "blocks": rates,
                            "cpu_ms_per_step_median": statistics.median(cpu)}
    # Paired per repeat: each view against the no-view block of the same repeat (same machine load).
    paired = {}
    for variant in ("plain", "live"):
        ratios = [next(b for b in blocks if b["repeat"] == r and b["variant"] == variant)["steps_per_s"]
                  / next(b for b in blocks if b["repeat"] == r and b["variant"] == "none")["steps_per_s"]
                  for r in range(args.repeats)]
        paired[variant] = {"median_overhead": 1 - statistics.median(ratios), "ratios": ratios}

    result = {
        "command": command_line(__spec__.name, python="python"),
        "block_seconds": args.block_seconds, "repeats": args.repeats, "round_seconds": args.round_seconds,
        "model": {"d_model": config.model.d_model, "n_layer": config.model.n_layer, "seq_len": config.model.seq_len,
                  "batch_size": config.data.batch_size},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "loadavg_before": load_before,
                    "loadavg_after": load_after},
        "frame_ms": frame_ms, "summary": summary, "paired": paired, "blocks": blocks,
    }
    write_results(result, args.out, report)
    print(args.out.with_suffix(".md").read_text())
    return 0


def report(result: dict) -> str:
    s, p, m = result["summary"], result["paired"], result["machine"]
    lines = [
        "# Terminal view overhead: tiny model, inner steps/s",
        "",
        f"Command: `.venv/bin/python -m benchmarks.micro.ui_overhead` ({result['repeats']} repeats x 3 variants x "
        f"{result['block_seconds']:g} s blocks, interleaved; round_done every {result['round_seconds']:g} s)",
        "",
        f"Machine: {m['cpus']} CPUs, torch {m['torch']} with {m['torch_threads']} thread, Python {m['python']}; "
        f"load average {m['loadavg_before'][0]:.1f} before, {m['loadavg_after'][0]:.1f} after (shared machine). "
        f"Model: tiny config (d_model {result['model']['d_model']}, {result['model']['n_layer']} layers, batch "
        f"{result['model']['batch_size']} x {result['model']['seq_len']}).",
        "",
        "| view | median steps/s | mean ± stdev | slowdown vs no view (median of paired repeats) "
        "| process CPU ms per step (median) |",
        "|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        overhead = "-" if variant == "none" else f"{100 * p[variant]['median_overhead']:+.1f}%"
        lines.append(f"| {variant} | {s[variant]['median']:.1f} | {s[variant]['mean']:.1f} ± {s[variant]['stdev']:.1f} | "
                     f"{overhead} | {s[variant]['cpu_ms_per_step_median']:.2f} |")
    lines += [
        "",
        f"One live-view frame (8-peer table, 100 columns) takes {result['frame_ms']:.2f} ms to build and lay out; "
        f"at 2 frames/s that is {0.2 * result['frame_ms']:.2f}% of one core, taken from the training thread's "
        "GIL share on a CPU-bound loop.",
        "",
        "Positive slowdown = fewer steps/s than no view. Each repeat runs the three variants back to back, so "
        "the paired ratio cancels most of the load drift of a shared machine. Process CPU time per step "
        "(all threads, rich's refresh thread included) is the figure least disturbed by other jobs: the "
        "difference to `none` is what the view costs per step.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
