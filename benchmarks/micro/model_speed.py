"""What a standard model costs: training tokens/s of the built-in byte GPT and of a
``LlamaForCausalLM`` of the same shape (``[model] kind = "hf"``), measured side by side in one run.

    .venv/bin/python -m benchmarks.micro.model_speed [--sizes tiny,small] [--repeats 8] [--block-seconds 4]
    .venv/bin/python -m benchmarks.micro.model_speed --device cuda --sizes small,125m   # bf16 autocast

Both models are trained by shoal's own ``Trainer`` (forward, backward, gradient clipping and an
AdamW step: what one inner step of ``shoal run`` does), fp32 on the CPU with one torch thread, bf16
autocast on CUDA. The Llama matches the GPT's width, layers, heads, MLP width (4 x width), 256-token
byte vocabulary, context and tied head; its SwiGLU MLP has three matrices to the GPT's two, so it
has more parameters at the same shape (both counts are reported). Blocks of steps alternate
between the two models, the order flipped each repeat (GPT, Llama, Llama, GPT, ...), so a machine
whose load drifts (other jobs on these 2 cores) slows both alike; the Llama/GPT ratio is taken per
repeat. Each block runs about ``--block-seconds`` of compute (its step count is set from a warm-up
step). On the CPU the figure is tokens per CPU-second of this process (one torch thread: its
compute time), which other jobs on a shared machine disturb far less than wall-clock time; the
wall-clock rate is reported beside it. On CUDA the figure is wall-clock tokens/s.

Writes ``benchmarks/results/model_speed.md`` and ``.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.results import RESULTS, command_line, cpu_name, write_results
from node.training.config import InnerConfig, TrainConfig
from node.training.model import BYTE_VOCAB_SIZE, ModelConfig, build_model, count_parameters
from node.training.trainer import Trainer, resolve_device

# Shapes: tiny is examples/configs/tiny.toml's model and batch; small is examples/configs/small.toml's
# model at batch 1 (a few seconds a step on one CPU thread); 125m is rtx4090-125m.toml's, for CUDA.
SIZES = {
    "tiny": {"d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 64, "batch": 16},
    "small": {"d_model": 512, "n_layer": 8, "n_head": 8, "seq_len": 512, "batch": 1},
    "125m": {"d_model": 768, "n_layer": 18, "n_head": 12, "seq_len": 1024, "batch": 16},
}
MODELS = ("gpt", "llama")
LR = 1e-3


def model_configs(size: dict) -> dict[str, ModelConfig]:
    """The byte GPT and the Llama of the same shape."""
    gpt = ModelConfig(d_model=size["d_model"], n_layer=size["n_layer"], n_head=size["n_head"],
                      seq_len=size["seq_len"], mlp_ratio=4)
    llama = ModelConfig(kind="hf", architecture="LlamaForCausalLM", seq_len=size["seq_len"], hf={
        "hidden_size": size["d_model"], "intermediate_size": 4 * size["d_model"],
        "num_hidden_layers": size["n_layer"], "num_attention_heads": size["n_head"],
        "num_key_value_heads": size["n_head"], "tie_word_embeddings": True})
    return {"gpt": gpt, "llama": llama}


def run_block(trainer: Trainer, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> dict:
    """``steps`` inner steps: tokens per wall-clock second (synchronized on CUDA, so queued work
    counts) and per CPU-second of this process. ``tokens_per_s`` is the figure compared: the CPU
    rate on the CPU, the wall-clock rate on CUDA (whose kernels run while the CPU waits)."""
    x, y = batch
    on_cuda = trainer.device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_cuda else (lambda: None)
    synchronize()
    cpu_started, started = time.process_time(), time.perf_counter()
    for _ in range(steps):
        trainer.inner_step(x, y, LR)
    synchronize()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    wall_rate, cpu_rate = steps * x.numel() / elapsed, steps * x.numel() / max(cpu, 1e-9)
    return {"steps": steps, "seconds": elapsed, "cpu_seconds": cpu, "wall_tokens_per_s": wall_rate,
            "cpu_tokens_per_s": cpu_rate, "tokens_per_s": wall_rate if on_cuda else cpu_rate}


def measure_size(name: str, device: torch.device, train: TrainConfig, repeats: int, block_seconds: float) -> dict:
    size = SIZES[name]
    generator = torch.Generator().manual_seed(0)
    shape = (size["batch"], size["seq_len"])
    batch = (torch.randint(0, BYTE_VOCAB_SIZE, shape, generator=generator),
             torch.randint(0, BYTE_VOCAB_SIZE, shape, generator=generator))
    trainers, params, steps = {}, {}, {}
    for model_name, config in model_configs(size).items():
        model = build_model(config, seed=0, vocab_size=BYTE_VOCAB_SIZE)
        params[model_name] = count_parameters(model)
        trainers[model_name] = Trainer(model, InnerConfig(), train, device)
        run_block(trainers[model_name], batch, 2)  # warm-up: AdamW state, allocator, SDPA kernels
        warm = run_block(trainers[model_name], batch, 1)
        step_seconds = warm["seconds"] if device.type == "cuda" else warm["cpu_seconds"]
        steps[model_name] = max(2, round(block_seconds / step_seconds))
    blocks = []
    for repeat in range(repeats):
        for model_name in MODELS if repeat % 2 == 0 else MODELS[::-1]:
            block = run_block(trainers[model_name], batch, steps[model_name])
            blocks.append({"repeat": repeat, "model": model_name, **block})
            print(f"{name} repeat {repeat} {model_name:>5}: {block['tokens_per_s']:,.0f} tokens/s "
                  f"({block['steps']} steps in {block['seconds']:.1f} s, {block['cpu_seconds']:.1f} CPU s)",
                  flush=True)
    summary = {}
    for model_name in MODELS:
        rates = [b["tokens_per_s"] for b in blocks if b["model"] == model_name]
        wall = [b["wall_tokens_per_s"] for b in blocks if b["model"] == model_name]
        summary[model_name] = {"parameters": params[model_name], "steps_per_block": steps[model_name],
                               "median": statistics.median(rates), "min": min(rates), "max": max(rates),
                               "stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0, "blocks": rates,
                               "wall_median": statistics.median(wall), "wall_blocks": wall}
    rate = {(b["repeat"], b["model"]): b["tokens_per_s"] for b in blocks}
    ratios = [rate[(r, "llama")] / rate[(r, "gpt")] for r in range(repeats)]
    return {"size": name, "shape": size, "tokens_per_step": size["batch"] * size["seq_len"], "summary": summary,
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "ratios": ratios},
            "blocks": blocks}


def machine(device: torch.device) -> dict:
    import transformers

    label = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"device": str(device), "device_name": label, "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,small", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=12, help="blocks per model and size (an even number balances the order)")
    parser.add_argument("--block-seconds", type=float, default=3.0, help="compute per block (CPU time on the CPU)")
    parser.add_argument("--device", default="cpu", help="cpu (fp32, one thread) | cuda (bf16 autocast)")
    parser.add_argument("--out", type=Path, default=RESULTS / "model_speed")
    args = parser.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")

    device = resolve_device(args.device)
    torch.set_num_threads(1)  # the CPU figure is one thread's (this machine has 2 shared cores)
    train = TrainConfig(device=args.device, precision="bf16" if device.type == "cuda" else "fp32")
    load_before = os.getloadavg()
    results = [measure_size(name, device, train, args.repeats, args.block_seconds) for name in sizes]
    result = {
        "command": command_line(__spec__.name, python="python"),
        "repeats": args.repeats, "block_seconds": args.block_seconds, "precision": train.precision,
        "machine": {**machine(device), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "sizes": results,
    }
    write_results(result, args.out, report)
    print(args.out.with_suffix(".md").read_text())
    return 0


def report(result: dict) -> str:
    m = result["machine"]
    on_cuda = m["device"].startswith("cuda")
    where = (f"{m['device_name']}, bf16 autocast" if on_cuda
             else f"{m['cpus']} CPUs ({m['device_name']}), fp32, {m['torch_threads']} torch thread")
    rate = "tokens/s" if on_cuda else "tokens per CPU-second"
    command = result["command"].removeprefix("python ").strip()
    lines = [
        "# Model speed: the byte GPT vs a LlamaForCausalLM of the same shape, training tokens/s",
        "",
        f"Command: `.venv/bin/python {command}` ({result['repeats']} repeats x 2 models per size, "
        f"blocks of ~{result['block_seconds']:g} s of compute interleaved GPT, Llama, Llama, GPT, ...)",
        "",
        f"Machine: {where}; torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; "
        f"load average {m['loadavg_before'][0]:.1f} before, {m['loadavg_after'][0]:.1f} after (shared machine). "
        "One step: forward, backward, gradient clipping and AdamW through shoal's Trainer.",
        "",
        f"| size (width x layers, heads, batch x context) | model | parameters | median {rate} | min - max "
        "| Llama / GPT (median of paired repeats, min - max) | 6 x parameters x rate | median wall-clock tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in result["sizes"]:
        shape, ratio = size["shape"], size["ratio"]
        label = (f"{size['size']} ({shape['d_model']} x {shape['n_layer']}, {shape['n_head']} heads, "
                 f"{shape['batch']} x {shape['seq_len']})")
        for model in MODELS:
            s = size["summary"][model]
            paired = "-" if model == "gpt" else f"{ratio['median']:.2f}x ({ratio['min']:.2f} - {ratio['max']:.2f})"
            lines.append(f"| {label} | {'byte GPT' if model == 'gpt' else 'LlamaForCausalLM'} | {s['parameters']:,} | "
                         f"{s['median']:,.0f} | {s['min']:,.0f} - {s['max']:,.0f} | {paired} | "
                         f"{6 * s['parameters'] * s['median'] / 1e9:.1f} GFLOP/s | {s['wall_median']:,.0f} |")
    lines += [
        "",
        "Same shape, not the same parameter count: the Llama's SwiGLU MLP has three width x 4 width matrices "
        "to the GPT's two (and no biases, RMSNorm for LayerNorm, rotary positions for a learned table), so per "
        "block it holds 16 x width^2 weights to the GPT's 12 x width^2. The ratio is what the standard "
        "model costs per token on this machine, its extra MLP matrix included. The 6 x parameters column is "
        "the work done per second by the usual 6 FLOPs per parameter per token (attention left out): equal "
        "figures mean the Llama's code runs as fast per FLOP and its cost is its larger MLP alone.",
        "",
    ]
    if not on_cuda:
        lines += [
            "Tokens per CPU-second count this process's CPU time (one torch thread), which other jobs on a "
            "shared machine slow far less than the wall clock; the wall-clock rate is what this machine "
            "gave at its load during the run.",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
