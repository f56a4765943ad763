"""Codec speed and accuracy, side by side in one run: shoal's fp16 / int8 / int4 / int2 codecs
(``averaging.math.codecs``) and hivemind's ``Float16Compression`` (what shoal sends today).

    .venv/bin/python -m benchmarks.micro.codecs [--numel 1048576] [--repeats 15] [--threads 1]

The default size is one hivemind part (an int4 part of 512 KiB holds ~1M values): what one
``compress`` / ``extract`` call in the all-reduce sees. One torch thread by default: the averager
shares the cores with training, and on a loaded 2-core machine two threads mostly wait for each
other. Speed is GB/s of fp32 input for encode (tensor -> bytes) and decode (bytes -> fp32 tensor), the
median of ``--repeats`` runs interleaved across codecs (so load drifting on a shared machine hits
all alike); on CUDA also ``quantize`` (no bytes, no host copy). Accuracy is the relative RMS error
``||x - decode(encode(x))|| / ||x||`` on Gaussian and Student-t(3) vectors. Upload per value is
what a full member of a butterfly all-reduce sends per value of the vector and per (n - 1) / n:
its parts in the send code plus what it returns as a reducer, in the code ``return_compression =
"auto"`` picks (``averaging.math.wire.AUTO_RETURN``: int8 for int8, int4 for int4 and int2; fp16 deltas
for fp16).

Writes ``benchmarks/results/codecs.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from hivemind.compression import CompressionInfo, Float16Compression

from averaging.math import codecs
from averaging.math.wire import AUTO_RETURN
from benchmarks.common.results import RESULTS, command_line, write_results

CODES = ("fp16", "int8", "int4", "int2")
HIVEMIND_FP16 = "hivemind fp16"


def student_t3(numel: int, generator: torch.Generator) -> torch.Tensor:
    normal = torch.randn(numel, generator=generator)
    return normal / torch.randn(numel, 3, generator=generator).pow(2).mean(1).sqrt()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def speeds(x: torch.Tensor, repeats: int) -> dict[str, dict[str, float]]:
    device = x.device
    gigabytes = x.numel() * 4 / 1e9
    hivemind_fp16, info = Float16Compression(), CompressionInfo.from_tensor(x.cpu())
    encoders: dict[str, Callable[[], object]] = {code: (lambda code=code: codecs.encode(x, code)) for code in CODES}
    if device.type == "cpu":
        encoders[HIVEMIND_FP16] = lambda: hivemind_fp16.compress(x, info)
    encoded = {name: encode() for name, encode in encoders.items()}
    decoders = {code: (lambda code=code: codecs.decode(encoded[code], max_numel=x.numel(), device=device))
                for code in CODES}
    if device.type == "cpu":
        decoders[HIVEMIND_FP16] = lambda: hivemind_fp16.extract(encoded[HIVEMIND_FP16])
    quantizers = {code: (lambda code=code: codecs.quantize(x, code)) for code in CODES}
    samples: dict[str, dict[str, list[float]]] = {name: {"encode": [], "decode": [], "quantize": []} for name in encoders}
    for repeat in range(repeats):
        names = list(encoders)
        names = names[repeat % len(names):] + names[: repeat % len(names)]  # rotate the order
        for name in names:
            samples[name]["encode"].append(timed(encoders[name], device))
            samples[name]["decode"].append(timed(decoders[name], device))
            if name in quantizers:
                samples[name]["quantize"].append(timed(quantizers[name], device))
    return {name: {op: round(gigabytes / statistics.median(times), 3) for op, times in ops.items() if times}
            for name, ops in samples.items()}


def errors(numel: int) -> dict[str, dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    data = {"gauss": torch.randn(numel, generator=generator), "student_t3": student_t3(numel, generator)}
    hivemind_fp16 = Float16Compression()
    result = {}
    for name in (*CODES, HIVEMIND_FP16):
        row = {}
        for kind, x in data.items():
            if name == HIVEMIND_FP16:
                y = hivemind_fp16.extract(hivemind_fp16.compress(x, CompressionInfo.from_tensor(x)))
            else:
                y = codecs.decode(codecs.encode(x, name), max_numel=numel)
            row[kind] = float((x - y).norm() / x.norm())
        result[name] = row
    return result


def wire(name: str) -> dict[str, float]:
    per_value = 2.0 if name == HIVEMIND_FP16 else codecs.bytes_per_value(name)
    returned = 2.0 if name in ("fp16", HIVEMIND_FP16) else codecs.bytes_per_value(AUTO_RETURN[name])
    return {"bytes_per_value": per_value, "upload_per_value": per_value + returned}


def markdown(report: dict) -> str:
    lines = [
        "# Codec speed and accuracy",
        "",
        f"`{report['command']}` on {report['machine']}, torch {report['torch']}, "
        f"{report['threads']} torch threads, {report['numel']:,} fp32 values, median of {report['repeats']}.",
        "",
        "GB/s of fp32 input. Upload: bytes a full all-reduce member sends per value (times (n-1)/n): "
        "parts in the code plus what it returns as a reducer with `return_compression = \"auto\"` (int8 "
        "averages for int8, int4 averages for int4 and int2; fp16 deltas for fp16 and hivemind fp16).",
        "",
    ]
    for device, rows in report["speed"].items():
        lines += [f"## {device}", "",
                  "| codec | bytes/value | upload/value | encode GB/s | decode GB/s | quantize GB/s "
                  "| RMS error Gaussian | RMS error Student-t(3) |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, speed in rows.items():
            err, size = report["error"][name], report["wire"][name]
            lines.append(f"| {name} | {size['bytes_per_value']:.4f} | {size['upload_per_value']:.4f} "
                         f"| {speed['encode']:.2f} | {speed['decode']:.2f} | {speed.get('quantize', float('nan')):.2f} "
                         f"| {err['gauss']:.5f} | {err['student_t3']:.5f} |")
        lines.append("")
    lines += [f"Load average during the run: {report['load_average']} (a shared machine: speeds are lower bounds).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.numel, generator=generator)
    report = {
        "command": command_line(__spec__.name),
        "machine": f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "numel": args.numel, "repeats": args.repeats,
        "speed": {"cpu": speeds(x, args.repeats)},
        "error": errors(min(args.numel, 1 << 22)),
        "wire": {name: wire(name) for name in (*CODES, HIVEMIND_FP16)},
    }
    if torch.cuda.is_available():
        report["speed"][f"cuda ({torch.cuda.get_device_name()})"] = speeds(x.cuda(), args.repeats)
    report["load_average"] = [round(v, 2) for v in os.getloadavg()]
    write_results(report, RESULTS / "codecs", markdown, indent=2)
    print((RESULTS / "codecs.md").read_text())


if __name__ == "__main__":
    main()
