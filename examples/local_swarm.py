"""A swarm of shoal peers on this machine: what `make demo` runs.

Starts N peers on loopback (the first draws the live view on this terminal, the others log to
files), lets them train the tiny model together for a few rounds, then prints the eval loss
per round. Ctrl+C once: every peer leaves cleanly and checkpoints; twice: everything is killed.
No process is left behind either way.

    python examples/local_swarm.py [--peers 3] [--rounds 5] [--round-seconds 10] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from examples.swarm_launcher import LocalSwarm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-seconds", type=float, default=10.0)
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "tiny.toml")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs, metrics and checkpoints here")
    parser.add_argument("--no-ui", action="store_true", help="no live view (e.g. in CI)")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shoal-demo-"))
    swarm = LocalSwarm(workdir, run_id=f"demo-{uuid.uuid4().hex[:6]}", cwd=REPO)
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        if len(interrupted) == 1:
            print("\nstopping: every peer finishes its step, leaves and checkpoints (Ctrl+C again to kill)")
            swarm.interrupt_all()
        else:
            swarm.kill_all()
            sys.exit(130)

    signal.signal(signal.SIGINT, on_sigint)
    common = ["--max-rounds", str(args.rounds), "--round-seconds", str(args.round_seconds)]
    try:
        first = swarm.start("peer-1", *common, config=args.config, ui=not args.no_ui and sys.stdout.isatty())
        if first.log_path is None:
            # The live view owns the terminal; the first peer's address comes from its metrics file.
            address = _address_from_metrics(first)
        else:
            address = first.wait_for_address()
        for i in range(2, args.peers + 1):
            swarm.start(f"peer-{i}", *common, config=args.config, initial=address[:1])
        codes = [peer.wait(timeout=args.rounds * args.round_seconds + 300) for peer in swarm.peers]
    finally:
        swarm.kill_all()  # no-op for peers that already left; kills anything left otherwise
    _summary(swarm)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs, metrics and checkpoints: {workdir}")
    return 0 if all(code == 0 for code in codes) else 1


def _address_from_metrics(peer) -> list[str]:
    deadline = time.time() + 120
    while time.time() < deadline:
        if peer.metrics_path.exists():
            for line in peer.metrics_path.read_text().splitlines():
                record = json.loads(line)
                if record.get("event") == "start":
                    return [m for m in record["maddrs"] if "/p2p/" in m]
        if peer.proc.poll() is not None:
            raise SystemExit(f"peer-1 exited early with code {peer.proc.returncode}")
        time.sleep(0.2)
    raise SystemExit("peer-1 did not start within 120 s")


def _summary(swarm: LocalSwarm) -> None:
    print("\nround  group  eval_loss (peer-1)")
    metrics = swarm.peers[0].metrics_path
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "round":
                eval_loss = record["eval_loss"]
                print(f"{record['round']:>5}  {record['group_size']:>5}  {eval_loss if eval_loss is None else round(eval_loss, 4)}")


if __name__ == "__main__":
    sys.exit(main())
