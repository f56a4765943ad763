"""Your own model and training loop on a shoal swarm, through the library API.

Start one copy, then paste the address it prints into more copies (here or on other machines):

    python examples/bring_your_own_model.py --rounds 5
    python examples/bring_your_own_model.py --rounds 5 --initial-peer /ip4/127.0.0.1/tcp/PORT/p2p/12D3KooW...

The model is a small MLP fitting a fixed random linear map: nothing shoal-specific in it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from node.api import DiLoCoSwarm, RoundConfig  # noqa: E402 - the library's one import place


def report(done) -> None:
    print(f"round {done.round}: group of {done.group_size}, {done.applied}, mean loss {done.loss or 0.0:.4f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-seconds", type=float, default=5.0)
    parser.add_argument("--run-id", default="byo-example")
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # every peer starts from the same weights and learns the same target
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    target = torch.randn(32, 8)
    # Create the swarm before moving the model to a GPU: hivemind forks its processes here.
    swarm = DiLoCoSwarm(model, run_id=args.run_id, initial_peers=args.initial_peer,
                        listen=["/ip4/127.0.0.1/tcp/0"], rounds=RoundConfig(seconds=args.round_seconds))
    print("to join:", " ".join(f"--initial-peer {m}" for m in swarm.maddrs), flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(int(time.time() * 1e6) % 2**31)  # each peer its own data
    try:
        swarm.start()
        while swarm.round <= args.rounds:
            started = time.perf_counter()
            x = torch.randn(64, 32, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), x @ target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.01)  # stand-in for a bigger model's step
            for done in swarm.step(tokens=x.shape[0], seconds=time.perf_counter() - started, loss=loss.item()):
                report(done)
        for done in swarm.finish():
            report(done)
    finally:
        swarm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
