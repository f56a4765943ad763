"""Test-side helpers around ``examples.swarm_launcher``: the tiny config and a cache dir per swarm."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from averaging.network.interface import PARTIAL_ERROR
from examples.swarm_launcher import LocalPeer, LocalSwarm, session_members, shoal_command
from node.library.bootstrap import write_address_file
from node.library.checkpoint import load_checkpoint, round_dir_name
from node.library.cleanup import hivemind_sockets, remove_stale
from node.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "tiny.toml"

# libfaketime itself, preloaded into a peer (not the ``faketime`` wrapper, which would stand between
# the test and the peer and swallow its Ctrl+C). The multi-threaded build: peers have threads.
FAKETIME = next((str(p) for p in (Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
                                  Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
                                  Path("/usr/local/lib/faketime/libfaketimeMT.so.1")) if p.exists()), None)
# What a peer with a wrong clock runs instead of ``shoal run`` (tests/integration/skewed_peer.py says why).
SKEWED_PEER = [sys.executable, str(REPO / "tests" / "integration" / "skewed_peer.py")]


def skewed(offset: str) -> dict[str, str] | None:
    """The environment that runs a peer (and what it forks) with its wall clock ``offset`` ("+5s")
    off the true time, its monotonic clock left alone; None without libfaketime. Run the peer as
    ``SKEWED_PEER``: faking only the wall clock breaks ``time.sleep``, which it replaces."""
    if FAKETIME is None:
        return None
    return {"LD_PRELOAD": FAKETIME, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


__all__ = ["FAKETIME", "REPO", "SKEWED_PEER", "TINY", "LocalPeer", "Swarm", "anchor_at", "every_round_checkpoints",
           "rounds_of", "session_members", "shoal_command", "skewed", "train_then_interrupt", "wait_until"]


# ``shoal run`` with its imports made first (an interpreter importing torch, hivemind and the training
# stack: 2-3 s of a core, 5-15 s of wall time on two busy cores), before it parses its flags; behind
# a start gate when its environment names one (start_gate.py).
PRELOADED_RUN = [sys.executable, "-c", "import node.process.peer; from tests.integration.start_gate import "
                 "wait_for_gate; wait_for_gate(); from node.cli import main; main()", "run"]


class Swarm(LocalSwarm):
    """A loopback swarm of tiny-config peers."""

    def __init__(self, root: Path, run_id: str):
        super().__init__(root, run_id, cwd=REPO)

    def start(self, name: str, *args: str, initial: list[str] | None = None, config: Path = TINY, **kwargs) -> LocalPeer:
        return super().start(name, *args, initial=initial, config=config, **kwargs)

    def start_joining(self, first: LocalPeer, name: str, *args: str, **kwargs) -> LocalPeer:
        """Start ``name`` now, to join ``first`` once ``share_address(first)`` has run: its imports
        overlap ``first``'s start-up, and its ``shoal run`` waits for ``first``'s address file
        (``--initial-peer @FILE``), so it joins a run ``first`` has organised, as if started then."""
        return self.start(name, *args, "--bootstrap-timeout", "150", initial=[f"@{self._address_file(first)}"],
                          program=PRELOADED_RUN, **kwargs)

    def share_address(self, first: LocalPeer, address: list[str] | None = None) -> list[str]:
        """Wait for ``first``'s addresses, and hand the first (or ``address``) to the peers started
        with ``start_joining``. Returns ``first``'s addresses."""
        addresses = first.wait_for_address()
        write_address_file(self._address_file(first), address or addresses[:1])
        return addresses

    def _address_file(self, peer: LocalPeer) -> Path:
        return self.root / f"{peer.name}.maddr"


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; ``TimeoutError(what)`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def rounds_of(peer: LocalPeer) -> dict[int, dict]:
    """A peer's round records by round (none while it is still starting)."""
    if not peer.metrics_path.exists():
        return {}
    return {r["round"]: r for r in read_metrics(peer.metrics_path) if r["event"] == "round"}


def is_partial(record: dict) -> bool:
    """A round whose all-reduce came back partial to this peer (a reducer's stream failed or ended
    short: docs/limitations.md): not applied, and the step is replayed next round."""
    return (record["error"] or "").startswith(PARTIAL_ERROR)


# hivemind's error when a step's matchmaking ended with no group (AllreduceException).
NO_GROUP_ERROR = "could not find a group"


def found_no_group(record: dict) -> bool:
    """A round in which this peer's matchmaking found no group in time (on two starved cores a
    throttled follower can miss its leader's answer): it folds its pseudo-gradient into the next
    round, is a step behind the others there, and replays their step."""
    return record["applied"] == "folded" and NO_GROUP_ERROR in (record["error"] or "")


def took_part(record: dict) -> bool:
    """The peer's pseudo-gradient went into its group's all-reduce (whether or not all of the
    average came back)."""
    return record["applied"] == "averaged" or is_partial(record)


def every_round_checkpoints(path: Path, config: Path = TINY, text: str | None = None) -> Path:
    """``config`` (or its ``text``) with a checkpoint after every round, written to ``path``: peers
    stopped with Ctrl+C can then be compared at a round they all finished."""
    text = config.read_text() if text is None else text
    changed = text.replace("checkpoint_every_rounds = 5", "checkpoint_every_rounds = 1")
    assert changed != text, "the config no longer says checkpoint_every_rounds = 5"
    path.write_text(changed)
    return path


def anchor_at(peer: LocalPeer, round: int) -> torch.Tensor:
    """The peer's shared model (anchor) as saved after ``round``, flattened."""
    checkpoint = load_checkpoint(peer.checkpoint_dir / round_dir_name(round))
    assert checkpoint.round == round, (peer.name, checkpoint.path)
    return torch.cat([t.flatten() for t in checkpoint.params.values()])


def train_then_interrupt(peers: list[LocalPeer], *, full_rounds: int, timeout: float,
                         until: Callable[[int], object] | None = None) -> range:
    """Let peers started without ``--max-rounds`` train until each has recorded ``full_rounds``
    rounds from the first one that all of them trained from its start (and, with ``until``, until
    ``until(last of those rounds)`` is true: an event the checks need, such as a round the whole
    group confirmed); then Ctrl+C them all and check that each exits 0. Returns those common rounds.

    Unlike a fixed ``--max-rounds``, the run is as long as the peers' start-up needs: short on an
    idle machine, longer (not failing) when start-up is slow on a loaded one. The peers leave
    during the round after the last one (before its sync starts, unless that round's start was
    very late), so compare their models at a round with ``anchor_at`` rather than at exit."""
    def started() -> bool:
        for peer in peers:
            if peer.proc.poll() is not None:
                raise RuntimeError(f"{peer.name} exited with {peer.proc.returncode}:\n{peer.log()[-3000:]}")
        return all(rounds_of(peer) for peer in peers)

    deadline = time.time() + timeout
    wait_until(started, timeout, "not every peer finished a round")
    first = max(min(rounds_of(peer)) for peer in peers) + 1  # a peer's first round may be partial
    last = first + full_rounds - 1
    try:
        wait_until(lambda: started() and all(last in rounds_of(peer) for peer in peers)
                   and (until is None or until(last)), deadline - time.time(),
                   f"not every peer reached round {last}" + ("" if until is None else " and the awaited event"))
    except TimeoutError:
        raise TimeoutError(f"round {last} (or the awaited event) not reached by every peer:\n" + "\n".join(
            f"--- {peer.name}, rounds {sorted(rounds_of(peer))}:\n{peer.log()[-2000:]}" for peer in peers)) from None
    for peer in peers:
        peer.interrupt()
    for peer in peers:
        assert peer.wait(timeout=60) == 0, peer.log()[-3000:]
    return range(first, last + 1)


@contextlib.contextmanager
def fresh_swarm():
    """A swarm in its own temp dir with its own run id; on exit every process it started is gone."""
    root = Path(tempfile.mkdtemp(prefix="shoal-test-"))
    sockets_before = hivemind_sockets()
    swarm = Swarm(root, run_id=f"test-{uuid.uuid4().hex[:8]}")
    try:
        yield swarm
    finally:
        # A peer that exited by itself must have taken its DHT, averager and p2pd with it.
        exited = [peer for peer in swarm.peers if peer.proc.poll() is not None]
        time.sleep(0.5 if exited else 0)
        leaked = {peer.name: peer.leftovers() for peer in exited if peer.leftovers()}
        swarm.kill_all()
        remove_stale(hivemind_sockets() - sockets_before)  # peers killed with -9 cannot clean up
        if os.environ.get("SHOAL_KEEP_SWARM"):  # to read the peers' logs after a failure
            print(f"swarm kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        assert not leaked, f"processes left behind by peers that exited: {leaked}"
