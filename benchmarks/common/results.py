"""Writing a benchmark's results: where they go, what every result records about its run (the commit
and the machine), and the command line that reproduces it.

Every writer calls ``write_results``: ``out``.json gets a ``provenance`` key and ``out``.md a
provenance line under its title, so a figure can always be traced to the code and machine it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
CONFIGS = REPO / "benchmarks" / "configs"


# -- provenance -------------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@cache
def commit() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when tracked files differ from it."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown (no git checkout)"
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def _gpus() -> list[str]:
    """GPU names from nvidia-smi, so that asking never initializes CUDA in a process that forks
    workers later; torch's own answer only where this process already uses CUDA."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout
            return [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return []


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@cache
def machine() -> dict:
    """The machine this process runs on: CPU model and cores, GPUs, torch and Python versions."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "gpus": _gpus(), "torch": _version("torch"),
            "hivemind": _version("hivemind"), "python": platform.python_version(), "os": platform.platform()}


def provenance() -> dict:
    """What a result records about its run: the commit (computed once per process) and the machine."""
    return {"commit": commit(), "machine": machine()}


def provenance_line(record: dict | None) -> str:
    if not record:
        return "Commit and machine: not recorded (this result was written before they were)."
    m = record["machine"]
    return (f"Commit `{record['commit']}` on {m['cpu']} ({m['cores']} cores), "
            f"{', '.join(m['gpus']) or 'no GPU'}, torch {m['torch']}, Python {m['python']}.")


def with_provenance(text: str, record: dict | None) -> str:
    """``text`` (markdown) with the provenance line under its first line when that is a title."""
    line = provenance_line(record)
    title, _, rest = text.partition("\n")
    if title.startswith("#"):
        return f"{title}\n\n{line}\n" + (rest if rest.startswith("\n") else f"\n{rest}")
    return f"{line}\n\n{text}"


def write_results(results: dict, out: Path, report: Callable[[dict], str], *, redraw: bool = False,
                  indent: int = 1) -> None:
    """``out``.json (the raw results, which ``--report-only`` redraws from) and ``out``.md
    (``report(results)``), both recording this run's commit and machine (``provenance``). ``redraw``:
    the results are an earlier run's, redrawn: they keep the provenance they have (none if written
    before it was recorded)."""
    if not redraw:
        results["provenance"] = provenance()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=indent) + "\n")
    out.with_suffix(".md").write_text(with_provenance(report(results), results.get("provenance")))


# -- command lines ----------------------------------------------------------------------------------
def command_line(module: str, argv: list[str] | None = None, *, python: str = ".venv/bin/python") -> str:
    """How to run this again: ``python -m module args`` from the repository root."""
    args = sys.argv[1:] if argv is None else argv
    return f"{python} -m {module}" + (" " + shlex.join(args) if args else "")


def stored_argv(command: str) -> list[str]:
    """The arguments of a stored command line, after its script (``… benchmarks/x.py`` as results
    written before the move to modules have it, or ``… -m benchmarks.kind.x``)."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word.endswith(".py"):
            return words[i + 1:]
        if word == "-m":
            return words[i + 2:]
    raise ValueError(f"no script in the stored command {command!r}")


def out_flag(out: Path, default: Path) -> str:
    """``--out`` as a results file's command line needs it: nothing for the script's default."""
    out = Path(out).resolve()
    return "" if out == default.resolve() else f" --out {out.relative_to(REPO) if out.is_relative_to(REPO) else out}"


def setting(text: str) -> tuple[str, object]:
    """``section.field=value``; the value as TOML would read it (a boolean, a number or a string)."""
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected section.field=value")
    if value in ("true", "false"):
        return key, value == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def spread(values: list[float]) -> str:
    """Mean ± half the range over seeds, for a report's cell."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    half = (max(values) - min(values)) / 2
    return f"{mean:.4f} ± {half:.4f}" if len(values) > 1 else f"{mean:.4f} (1 seed)"
