"""The CUDA path, measured: one command for a machine with an NVIDIA GPU (and a reduced CPU run).

    .venv/bin/python -m benchmarks.micro.gpu_check                  # on a CUDA machine: the full check
    .venv/bin/python -m benchmarks.micro.gpu_check --device cpu     # the reduced version `make test` runs

What it checks and measures, side by side in one run (``--device cuda`` / ``--device cpu``):

1. **Overhead.** The same model, data and AdamW (bf16 autocast on CUDA) trained by a bare torch
   loop and by shoal's trainer through the library API in a 1-peer swarm, in alternating blocks of
   steps: tokens/s and peak device memory of each. Target: shoal within 2% of the bare loop.
   CUDA: the ~125M config (``examples/configs/rtx4090-125m.toml``); CPU: the tiny one.
2. **Peers sharing the device.** 2 and 3 ``shoal run`` processes on loopback, overlap mode, for
   several rounds: every round averaged, the anchors agree within the fp16 bound, and the
   training loop's stall (``wait_s``) and utilization per peer.
3. **Device-side engine = CPU reference.** The round engine's parameter snapshot (device→pinned
   host, async, with a CUDA event) and its fused merge (pinned host→device, ``_foreach_add_``)
   give bit-identical results to the same arithmetic on the CPU.
4. **Transfers and codecs.** Snapshot and merge time per round for a 125M and a ~1B parameter
   vector (CPU: 1M and 10M), and the low-bit codecs' speed on the device.

Writes ``benchmarks/results/gpu_check.{md,json}`` (``--out``) with the device, driver and torch
version; exits 1 if a check fails (the overhead target is reported, not enforced).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import platform
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path

import torch

from averaging.engine.config import LoopConfig
from averaging.engine.inner_sync import InnerStateSync
from averaging.engine.loop import RoundEngine
from averaging.engine.worker import SyncWorker
from averaging.math.flat import FlatLayout
from averaging.math.merge import apply_correction_
from averaging.network.local import LocalBackend, LocalHub
from averaging.state.shared_state import SharedState
from benchmarks.common.results import REPO, RESULTS, command_line, write_results
from benchmarks.micro.codecs import speeds
from examples.swarm_launcher import LocalSwarm, write_toml
from node.api import AveragingConfig, DiLoCoSwarm, RoundConfig
from node.library.checkpoint import list_checkpoints, load_checkpoint
from node.observe.metrics import read_metrics
from node.process.config import EXAMPLES_DIR, RunConfig, load_config
from node.training.data import BatchSampler, load_corpus, split_corpus
from node.training.model import build_model, count_parameters
from node.training.trainer import Trainer, device_label, inner_lr
from protocols.schedule import RoundSchedule

FP16_UNIT_ROUNDOFF = 2.0**-11
OVERHEAD_TARGET = 0.02
# The CPU run's rounds are short: matchmaking must fit well inside one (it starts before the deadline).
FAST_MATCHMAKING = {"matchmaking_seconds": 1.5, "request_timeout": 0.75}


# -- 1. bare torch loop vs shoal's trainer + library ------------------------------------------------
def bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x, y, *, device, autocast_dtype, clip) -> float:
    """One AdamW step written plainly, as a user without shoal would."""
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def overhead(config: RunConfig, device: torch.device, *, blocks: int, steps: int, round_s: float) -> dict:
    """Tokens/s and peak memory: a bare loop and shoal's, alternating blocks of ``steps`` steps."""
    split = split_corpus(load_corpus(config.data), config.data.eval_fraction, config.data.max_eval_bytes,
                         block_bytes=config.data.eval_block_bytes)
    sampler = BatchSampler(split.tokens, config.model.seq_len, config.data.batch_size, seed=0, held_out=split.held_out)
    batch_tokens = config.data.batch_size * config.model.seq_len
    cpu_model = build_model(config.model, seed=config.train.seed)
    # The swarm first: hivemind forks its processes, which must happen before CUDA is initialised.
    swarm = DiLoCoSwarm(cpu_model, run_id=f"gpu-check-{uuid.uuid4().hex[:6]}", listen=["/ip4/127.0.0.1/tcp/0"],
                        rounds=RoundConfig(seconds=round_s), averaging=AveragingConfig(), device=device)
    try:
        trainer = Trainer(cpu_model, config.inner, config.train, device)
        bare_model = copy.deepcopy(trainer.model)
        decay = [p for p in bare_model.parameters() if p.dim() >= 2]
        no_decay = [p for p in bare_model.parameters() if p.dim() < 2]
        bare_opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.inner.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=config.inner.lr,
                                     betas=(config.inner.beta1, config.inner.beta2), fused=device.type == "cuda")
        swarm.start()
        seconds = {"bare": 0.0, "shoal": 0.0}
        peak = {"bare": 0, "shoal": 0}
        rounds = []

        def shoal_step() -> None:
            started = time.perf_counter()
            x, y = sampler.next_batch()
            loss = float(trainer.inner_step(x, y, inner_lr(config.inner, swarm.progress())))
            rounds.extend(swarm.step(tokens=batch_tokens, seconds=time.perf_counter() - started, loss=loss))

        def bare() -> None:
            x, y = sampler.next_batch()
            bare_step(bare_model, bare_opt, x, y, device=device, autocast_dtype=trainer.autocast_dtype,
                      clip=config.inner.grad_clip)

        bare()  # warm-up (kernels, allocator, fused optimizer state)
        shoal_step()
        for block in range(blocks):
            for name, step in (("bare", bare), ("shoal", shoal_step)) if block % 2 == 0 else (
                    ("shoal", shoal_step), ("bare", bare)):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                started = time.perf_counter()
                for _ in range(steps):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    peak[name] = max(peak[name], torch.cuda.max_memory_allocated(device))
                seconds[name] += time.perf_counter() - started
        # The check needs a round to end while shoal trains; when the timed blocks all fit in one
        # round (a fast device, a slow start), keep stepping, untimed, until one does.
        deadline = time.perf_counter() + 3 * round_s
        while not rounds and time.perf_counter() < deadline:
            shoal_step()
        rounds.extend(swarm.finish())
    finally:
        swarm.close()
    tokens = blocks * steps * batch_tokens
    rate = {name: tokens / s for name, s in seconds.items()}
    result = {
        "parameters": count_parameters(cpu_model),
        "steps_each": blocks * steps,
        "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
        "overhead": round(1 - rate["shoal"] / rate["bare"], 4),
        "overhead_target": OVERHEAD_TARGET,
        "rounds_during_shoal": len(rounds),
        "rounds_applied": sorted({str(r.applied) for r in rounds}),
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = {k: round(v / 2**30, 3) for k, v in peak.items()}
    return result


# -- 2. several peers on one device ---------------------------------------------------------------
def _averaged(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(r["event"] == "round" and r["applied"] == "averaged" for r in read_metrics(metrics))


def peers_on_one_device(config_path: Path, device: str, *, peers: int, rounds: int, round_s: float,
                        root: Path, averaging: dict | None = None) -> dict:
    """``peers`` real ``shoal run`` processes on loopback sharing ``device``, overlap mode, until every
    peer has averaged ``rounds`` rounds; then Ctrl+C for all (a clean leave writes a checkpoint)."""
    data = tomllib.loads(config_path.read_text())
    data.setdefault("round", {}).update(seconds=round_s, sync_mode="overlap")
    data.setdefault("train", {}).update(checkpoint_every_rounds=1, torch_threads=1)
    data.setdefault("data", {}).update(num_shards=peers)  # the default corpus is too small for 64 shards
    data.setdefault("averaging", {}).update(averaging or {})
    config_file = write_toml(data, root / f"peers-{peers}.toml")
    swarm = LocalSwarm(root / f"swarm-{peers}", run_id=f"gpu-check-{uuid.uuid4().hex[:8]}", cwd=REPO)
    try:
        first = swarm.start("p0", "--device", device, config=config_file)
        initial = first.wait_for_address()
        for i in range(1, peers):
            swarm.start(f"p{i}", "--device", device, config=config_file, initial=initial)
        deadline = time.monotonic() + 180 + 4 * rounds * round_s
        while not all(_averaged(peer.metrics_path) >= rounds for peer in swarm.peers):
            if time.monotonic() > deadline or any(peer.proc.poll() is not None for peer in swarm.peers):
                raise RuntimeError("peers did not average {rounds} rounds each:\n" + "\n".join(
                    f"--- {peer.name} ({_averaged(peer.metrics_path)} averaged):\n{peer.log()[-2000:]}"
                    for peer in swarm.peers))
            time.sleep(1.0)
        swarm.interrupt_all()
        codes = {p.name: p.wait(timeout=120) for p in swarm.peers}
    finally:
        swarm.kill_all()
    per_peer, anchors = {}, {}
    for peer in swarm.peers:
        records = [r for r in read_metrics(peer.metrics_path) if r["event"] == "round"]
        compute = sum(r["compute_s"] for r in records)
        wall = sum(r["wall_s"] for r in records)
        per_peer[peer.name] = {
            "exit": codes[peer.name], "rounds": len(records),
            "averaged": sum(r["applied"] == "averaged" for r in records),
            "utilization": round(compute / wall, 4) if wall else None,
            "wait_s": round(sum(r["wait_s"] for r in records), 3),
            "tokens_per_s": round(sum(r["tokens"] for r in records) / compute, 1) if compute else None,
        }
        anchors[peer.name] = {load_checkpoint(path).round: path for path in list_checkpoints(peer.checkpoint_dir)}
    # Compare the anchors at the newest round every peer checkpointed (each keeps its last 3).
    common = set.intersection(*(set(rounds_) for rounds_ in anchors.values())) if anchors else set()
    common_round = max(common, default=None)
    agreement = {}
    if common_round is not None:
        # Relative to how far the anchor moved from the initial weights (a failed part is of that order).
        run = load_config(config_file)
        init = torch.cat([p.detach().flatten() for p in build_model(run.model, seed=run.train.seed).parameters()])
        flat = {name: torch.cat([t.flatten().float() for t in load_checkpoint(paths[common_round]).params.values()])
                for name, paths in anchors.items()}
        for a, b in itertools.combinations(flat, 2):
            agreement[f"{a}-{b}"] = {"round": common_round, "rms_diff": float((flat[a] - flat[b]).square().mean().sqrt()),
                                     "rms_moved": float((flat[a] - init).square().mean().sqrt())}
    averaged_rounds = min((p["averaged"] for p in per_peer.values()), default=0)
    bound = 7 * 2 * FP16_UNIT_ROUNDOFF * max(averaged_rounds, 1)
    ok = (all(c == 0 for c in codes.values()) and averaged_rounds >= 1 and len(agreement) == peers * (peers - 1) // 2
          and all(v["rms_diff"] <= bound * v["rms_moved"] for v in agreement.values()))
    return {"peers": per_peer, "anchors": agreement, "common_round": common_round, "relative_bound": bound, "ok": ok}


# -- 3. the engine's snapshot and merge on the device vs the CPU ------------------------------------
def _engine(params: dict[str, torch.Tensor], device: torch.device) -> RoundEngine:
    named = [(n, p.detach().cpu()) for n, p in params.items()]
    layout = FlatLayout.of(named)
    outer = SharedState(layout, layout.pack(dict(named), layout.new_buffer()), RunConfig().outer)
    worker = SyncWorker(LocalBackend(LocalHub(), "check", outer.shared_state), allreduce_timeout=1.0,
                        matchmaking_grace=1.0)
    return RoundEngine(state=outer, worker=worker, layout=layout, params=lambda: params,
                     schedule=lambda: RoundSchedule(time.time(), 60.0), config=LoopConfig(), peer_id="check",
                     alone=lambda: True, device=device)


@torch.no_grad()
def bit_identity(device: torch.device, numel: int) -> dict:
    """Snapshot and merge through the round engine on ``device``, against plain CPU arithmetic."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"w": (numel // 2 // 64, 64), "b": (numel - numel // 2 // 64 * 64,)}
    cpu = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    live = {n: t.to(device) for n, t in cpu.items()}
    engine = _engine(live, device)
    try:
        buffer = engine._host_params[0]  # the engine's first (pinned on CUDA) snapshot buffer
        event = engine._snapshot_params(buffer)
        if event is not None:
            event.synchronize()
        reference = engine.layout.pack(cpu, engine.layout.new_buffer())
        snapshot_equal = torch.equal(buffer, reference)
        correction = torch.randn(engine.layout.numel, generator=generator)
        engine._merge(correction)
        expected = dict(cpu)
        apply_correction_(list(expected.values()), [engine.layout.views(correction)[n] for n in expected])
        merge_equal = all(torch.equal(live[n].cpu(), expected[n]) for n in expected)
    finally:
        engine.worker.close()
    return {"numel": engine.layout.numel, "snapshot_bit_identical": snapshot_equal, "merge_bit_identical": merge_equal,
            "ok": snapshot_equal and merge_equal}


# -- 3b. the inner optimizer's moments (averaging.average_inner_state) on the device -----------------
@torch.no_grad()
def _adam_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.grad = g.to(p.device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def inner_state_landing(device: torch.device, width: int) -> dict:
    """Moments read off the device, a group mean landed two steps later, through ``InnerStateSync``
    on ``device`` (fused AdamW on CUDA, as ``Trainer`` builds it) and on the CPU: equal within the
    fused kernel's rounding. What ``averaging.average_inner_state`` does on a GPU peer every round."""
    generator = torch.Generator().manual_seed(1)
    grads = [[torch.randn(width, width, generator=generator) * 1e-3, torch.randn(width, generator=generator)]
             for _ in range(5)]
    mean = None
    moments = {}
    for where in (torch.device("cpu"), device):
        torch.manual_seed(0)
        model = torch.nn.Linear(width, width).to(where)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=where.type == "cuda")
        sync = InnerStateSync.of(model, [optimizer])
        _adam_steps(model, optimizer, grads[:3])
        snapshot = torch.zeros(sync.numel)
        sync.snapshot(snapshot)
        if mean is None:  # a stand-in for the group's mean: ours, moved
            mean = snapshot * torch.rand(sync.numel, generator=generator).add_(0.5)
        _adam_steps(model, optimizer, grads[3:])
        problem = sync.land(mean, snapshot, steps=2)
        landed = torch.zeros(sync.numel)
        sync.snapshot(landed)
        moments[where.type] = (landed, problem)
        layout = sync.layout
    (cpu, cpu_problem), (dev, dev_problem) = moments["cpu"], moments[device.type]
    # per moment tensor, relative to its largest value (exp_avg crosses zero; exp_avg_sq is ~1e-6 of it)
    error = max(float((d - c).abs().max() / c.abs().max().clamp_min(1e-30))
                for d, c in zip(layout.views(dev).values(), layout.views(cpu).values()))
    return {"numel": int(cpu.numel()), "max_relative_error": error,
            "ok": cpu_problem is None and dev_problem is None and error <= 1e-4}


# -- 4. transfer times and codec speed ----------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def transfers(device: torch.device, numel: int, repeats: int) -> dict:
    """A round's snapshot (device→pinned host) and merge (pinned host→device + add), in seconds."""
    pin = device.type == "cuda"
    params = torch.randn(numel, device=device)
    host = torch.empty(numel, pin_memory=pin)
    correction = torch.zeros(numel, pin_memory=pin)
    staging = torch.empty(numel, device=device) if device.type == "cuda" else None
    snapshot, merge = [], []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        host.copy_(params, non_blocking=True)
        _sync(device)
        snapshot.append(time.perf_counter() - started)
        started = time.perf_counter()
        if staging is not None:
            staging.copy_(correction, non_blocking=True)
            torch._foreach_add_([params], [staging])
        else:
            torch._foreach_add_([params], [correction])
        _sync(device)
        merge.append(time.perf_counter() - started)
    best_snapshot, best_merge = min(snapshot), min(merge)
    return {"numel": numel, "snapshot_s": round(best_snapshot, 5), "merge_s": round(best_merge, 5),
            "snapshot_gb_per_s": round(numel * 4 / best_snapshot / 1e9, 2)}


def codec_speeds(device: torch.device, numel: int) -> dict:
    """``benchmarks.micro.codecs``' speeds on ``device``."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(device)
    return speeds(x, repeats=3)


# -- the report -------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    env = {"device": device_label(device), "torch": torch.__version__, "python": platform.python_version(),
           "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   capability=f"{props.major}.{props.minor}")
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            env["driver"] = "unknown (nvidia-smi not available)"
    return env


def markdown(report: dict) -> str:
    env, over = report["environment"], report["overhead"]
    lines = [f"# GPU check: {env['device']}", "",
             f"torch {env['torch']}" + (f", CUDA {env.get('cuda')}, driver {env.get('driver')}" if "cuda" in env else "")
             + f"; {env['date']}; command: `{report['command']}`", "",
             "## 1. Overhead of shoal's loop (1-peer swarm) over a bare torch loop", "",
             "| loop | tokens/s | peak memory (GiB) |", "|---|---|---|"]
    for name in ("bare", "shoal"):
        memory = over.get("peak_memory_gib", {}).get(name, "-")
        lines.append(f"| {name} | {over['tokens_per_s'][name]:,.0f} | {memory} |")
    lines += ["", f"{over['parameters']:,} parameters, {over['steps_each']} steps each in alternating blocks; "
              f"overhead {over['overhead']:.1%} (target ≤ {OVERHEAD_TARGET:.0%}); "
              f"{over['rounds_during_shoal']} rounds ended during shoal's blocks ({', '.join(over['rounds_applied'])}).",
              "", "## 2. Peers sharing the device (overlap mode)", "",
              "| peers | peer | rounds | averaged | utilization | wait_s | tokens/s |", "|---|---|---|---|---|---|---|"]
    for run in report["swarms"]:
        for name, p in run["peers"].items():
            lines.append(f"| {len(run['peers'])} | {name} | {p['rounds']} | {p['averaged']} | {p['utilization']} | "
                         f"{p['wait_s']} | {p['tokens_per_s']} |")
    for run in report["swarms"]:
        for pair, a in run["anchors"].items():
            lines.append(f"\n{len(run['peers'])} peers, anchors {pair} at round {a['round']}: RMS diff "
                         f"{a['rms_diff']:.3e} ({a['rms_diff'] / max(a['rms_moved'], 1e-30):.2e} of how far the anchor moved; "
                         f"fp16 bound {run['relative_bound']:.2e})")
    bits = report["bit_identity"]
    lines += ["", "## 3. Engine on the device vs the CPU reference", "",
              f"{bits['numel']:,} values: snapshot bit-identical {bits['snapshot_bit_identical']}, "
              f"merge bit-identical {bits['merge_bit_identical']}.", "",
              f"Inner optimizer's moments ({report['inner_state']['numel']:,} values) read off the device and a mean "
              f"landed two steps later, against the CPU: max relative difference "
              f"{report['inner_state']['max_relative_error']:.2e} (fused AdamW's rounding on CUDA; bound 1e-4).", "",
              "## 4. Per-round transfers and codecs", "", "| values | snapshot (s) | merge (s) | snapshot GB/s |",
              "|---|---|---|---|"]
    for t in report["transfers"]:
        lines.append(f"| {t['numel']:,} | {t['snapshot_s']} | {t['merge_s']} | {t['snapshot_gb_per_s']} |")
    lines += ["", "| codec | encode GB/s | decode GB/s |", "|---|---|---|"]
    lines += [f"| {name} | {v.get('encode')} | {v.get('decode')} |" for name, v in report["codecs"].items()]
    lines += ["", f"Checks: {'all passed' if report['ok'] else 'FAILED: ' + ', '.join(report['failed'])}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the full check) or cpu (the reduced version)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--peers", default=None, help="comma-separated swarm sizes (default: 2,3 on CUDA, 2 on CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here; run with --device cpu for the reduced check", file=sys.stderr)
        return 2
    # A lone peer's failed matchmaking is expected here; hivemind would log it with a traceback.
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
    torch.manual_seed(0)
    if not cuda:
        torch.set_num_threads(1)
    config_path = EXAMPLES_DIR / ("rtx4090-125m.toml" if cuda else "tiny.toml")
    config = load_config(config_path)
    sizes = [int(s) for s in (args.peers or ("2,3" if cuda else "2")).split(",")]
    report: dict = {"command": command_line(__spec__.name, python="python"),
                    "environment": environment(device), "config": config_path.name}
    report["overhead"] = overhead(config, device, blocks=6 if cuda else 2, steps=20 if cuda else 8,
                                  round_s=20.0 if cuda else 3.0)
    with tempfile.TemporaryDirectory(prefix="shoal-gpu-check-") as root:
        report["swarms"] = [peers_on_one_device(config_path if cuda else EXAMPLES_DIR / "tiny.toml", args.device,
                                                peers=n, rounds=5 if cuda else 1, round_s=20.0 if cuda else 3.0, root=Path(root),
                                                averaging=None if cuda else FAST_MATCHMAKING) for n in sizes]
    report["bit_identity"] = bit_identity(device, numel=128_566_272 if cuda else 100_000)
    report["inner_state"] = inner_state_landing(device, width=1024 if cuda else 64)
    report["transfers"] = [transfers(device, n, repeats=5 if cuda else 2)
                           for n in ((128_566_272, 1_000_000_000) if cuda else (1_000_000, 10_000_000))]
    report["codecs"] = codec_speeds(device, 2**24 if cuda else 2**20)
    checks = {"swarm": all(run["ok"] for run in report["swarms"]), "bit_identity": report["bit_identity"]["ok"],
              "inner_state": report["inner_state"]["ok"],
              "shoal_rounds": report["overhead"]["rounds_during_shoal"] >= 1}
    report["failed"] = [name for name, ok in checks.items() if not ok]
    report["ok"] = not report["failed"]
    write_results(report, args.out / "gpu_check", markdown, indent=2)
    print((args.out / "gpu_check.md").read_text())
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
