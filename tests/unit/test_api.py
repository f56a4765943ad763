"""The library API in-process: peers are threads meeting in a ``LocalSwarmHub`` (exact averaging,
records validated as over the DHT). What a library user relies on: rounds land in groups, anchors
agree, figures add up, checkpoints round-trip, an incompatible run is refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from node.api import Applied, AveragingConfig, ConfigError, DiLoCoSwarm, Heartbeat, OuterConfig, RoundConfig
from node.library.local_network import LocalNetwork, LocalSwarmHub

# In-process swarms on real rounds: run beside the CPU-bound unit tests (scripts/run-suite.sh).
pytestmark = pytest.mark.wall_clock

ROUND_S = 1.0
FAST = AveragingConfig(matchmaking_seconds=0.4, request_timeout=0.2, allreduce_timeout=5.0)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def swarm(hub: LocalSwarmHub, name: str, *, rounds: RoundConfig | None = None, **kwargs) -> DiLoCoSwarm:
    return DiLoCoSwarm(model(), run_id="api-test", network=LocalNetwork(hub, name), averaging=FAST,
                       rounds=rounds or RoundConfig(seconds=ROUND_S), **kwargs)


def train(peer: DiLoCoSwarm, optimizer: torch.optim.Optimizer, *, last_round: int, seed: int, finished: list) -> None:
    """A user's loop: fit a fixed linear map; one ``step`` per inner step."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.arange(8, dtype=torch.float32)
    peer.start()
    while peer.round <= last_round:
        started = time.perf_counter()
        x = torch.randn(32, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(peer.model(x).squeeze(-1), x @ target / 8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.005)
        finished += peer.step(tokens=32, seconds=time.perf_counter() - started, loss=loss.item())
    finished += peer.finish()


def run_together(peers: list[DiLoCoSwarm], rounds: int) -> list[list]:
    """Train all ``peers`` (threads) until ``rounds`` rounds after the current one on the run's
    schedule: relative, because building the swarms can take a round on a loaded machine."""
    # The first AdamW of a process takes seconds to build (torch's lazy imports): before the clock starts.
    optimizers = [torch.optim.AdamW(p.model.parameters(), lr=1e-2) for p in peers]
    last_round = peers[0].schedule.round_at(time.time()) + rounds
    results: list[list] = [[] for _ in peers]
    threads = [threading.Thread(target=train, args=(p, optimizers[i]), kwargs=dict(last_round=last_round, seed=i, finished=results[i]))
               for i, p in enumerate(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_two_peers_average_every_round_and_agree():
    hub = LocalSwarmHub()
    a, b = swarm(hub, "a"), swarm(hub, "b", heartbeat=lambda: Heartbeat(loss=1.5, device="test-device"))
    try:
        assert a.manifest.config_hash == b.manifest.config_hash and a.peer_id != b.peer_id
        finished_a, finished_b = run_together([a, b], rounds=3)
        for finished in (finished_a, finished_b):
            averaged = [s for s in finished if s.applied == Applied.AVERAGED]
            assert len(averaged) >= 2, [(s.round, s.applied, s.error) for s in finished]
            assert all(s.group_size == 2 and sorted(s.group) == sorted([a.peer_id, b.peer_id]) for s in averaged)
        assert a.rounds_done == b.rounds_done >= 2
        anchor_a, anchor_b = a.anchor_params(), b.anchor_params()
        assert all(torch.equal(anchor_a[name], anchor_b[name]) for name in anchor_a)  # exact local averaging
        # Figures a dashboard reads: both moved the same payload, and each saw the other's record.
        assert a.bytes_sent == a.bytes_received > 0 and a.bytes_sent == b.bytes_sent
        assert a.peer_count == 2 and {r.peer_id for r in a.peers} == {a.peer_id, b.peer_id}
        theirs = next(r for r in a.peers if r.peer_id == b.peer_id)
        assert theirs.loss == 1.5 and theirs.device == "test-device"  # the typed heartbeat arrived
        assert a.tokens_contributed > 0 and 0 < a.utilization <= 1
        live = a.live_round()
        assert live.round == a.round and live.tokens >= 0
    finally:
        a.close()
        b.close()


def test_a_lone_peer_applies_its_own_update():
    peer = swarm(LocalSwarmHub(), "alone")
    try:
        finished = run_together([peer], rounds=2)[0]
        assert finished and all(s.applied == Applied.LOCAL for s in finished)
        assert peer.rounds_done == len(finished) and peer.bytes_sent == 0
    finally:
        peer.close()


def test_a_lone_peer_whose_state_was_just_downloaded_folds_instead_of_stepping_alone():
    # A joiner holds the anchor as it was when it downloaded it: a local step now would leave the
    # joiner one step behind, unseen until both had moved on (a re-sync).
    hub = LocalSwarmHub()
    peer = swarm(hub, "donor")
    try:
        hub.averaging.state_providers[peer.peer_id]()  # a joiner downloads our state
        finished = run_together([peer], rounds=3)[0]
        applied = [s.applied for s in finished]
        assert applied[0] == Applied.FOLDED and Applied.LOCAL in applied, applied  # two rounds later: alone again
        assert peer.rounds_done == applied.count(Applied.LOCAL)
    finally:
        peer.close()


def test_a_peer_that_heard_another_lately_folds_instead_of_stepping_alone():
    # On a saturated link the others' records miss their TTL for a round or two: the peer that then
    # reads "peers=1" must not step alone off the swarm's lineage. Two rounds later, it is alone.
    peer = swarm(LocalSwarmHub(), "flapping")
    try:
        peer._monitor.others_seen_at = time.time()  # another peer's record, at the last read but one
        finished = run_together([peer], rounds=4)[0]
        applied = [s.applied for s in finished]
        assert applied[0] == Applied.FOLDED and Applied.LOCAL in applied, applied
        assert peer.rounds_done == applied.count(Applied.LOCAL)
    finally:
        peer.close()


def test_a_joiner_of_a_young_run_replays_its_steps_exactly_and_downloads_only_an_older_state():
    # While the donors hold every outer step taken, a joiner builds the run's initial weights from its
    # seed and replays those steps (2 bytes a parameter each) instead of downloading the state (8):
    # it ends with the donor's anchor and momentum exactly. It asks the donor, not its record, which
    # may be a heartbeat old. Past HISTORY_ROUNDS steps it downloads.
    hub = LocalSwarmHub()
    long_rounds = RoundConfig(seconds=600.0)
    first = swarm(hub, "first", rounds=long_rounds)
    joiners = []
    downloads = []

    def join(name: str) -> dict | None:
        joiner = swarm(hub, name, rounds=long_rounds, initial_peers=["first"])
        joiners.append(joiner)
        joiner._loop.initial_sync = lambda *args, **kwargs: downloads.append(name)
        return joiner.start()

    def same_state(joiner) -> bool:
        return (torch.equal(joiner._shared.anchor, first._shared.anchor)
                and torch.equal(joiner._shared.momentum, first._shared.momentum)
                and joiner.rounds_done == first.rounds_done)

    generator = torch.Generator().manual_seed(0)

    def lone_step(round: int) -> None:  # as a lone peer's round: a pseudo-gradient of no fp16 value
        first._shared.apply(torch.randn(first._shared.anchor.shape, generator=generator) / 3, round=round)

    try:
        first._monitor.tick()  # its record: 0 outer steps
        assert join("early") is None and same_state(joiners[-1])  # nothing to fetch
        lone_step(1)  # its record still says 0
        joined = join("stale-record")
        assert joined is not None and joined["replayed"] == 1 and joined["round"] == 1, joined
        assert joined["bytes"] == 2 * first._shared.anchor.numel() and same_state(joiners[-1])
        lone_step(2)
        first._monitor.tick()
        assert join("second-round")["replayed"] == 2 and same_state(joiners[-1])
        assert not downloads
        lone_step(3)
        first._monitor.tick()  # 3 steps: past the history a joiner replays
        join("late")
        assert downloads == ["late"]
    finally:
        for peer in (*joiners, first):
            peer.close()


def test_a_joiner_downloads_instead_of_replaying_a_step_from_a_round_not_yet_reached():
    # A donor's step carries the round it ended, the donor's own word: one the schedule has not
    # reached is refused, and the joiner takes the state by download (checked like any download).
    hub = LocalSwarmHub()
    first = swarm(hub, "first", rounds=RoundConfig(seconds=600.0))
    joiner = swarm(hub, "joiner", rounds=RoundConfig(seconds=600.0), initial_peers=["first"])
    downloads = []
    joiner._loop.initial_sync = lambda *args, **kwargs: downloads.append(args)
    try:
        first._shared.apply(torch.full_like(first._shared.anchor, 0.01), round=1_000)
        first._monitor.tick()
        joiner.start()
        assert len(downloads) == 1 and joiner.rounds_done == 0
    finally:
        for peer in (joiner, first):
            peer.close()


def test_a_joiner_serves_its_state_only_once_it_has_joined():
    # Until its own join is done a joiner holds the run's initial weights; served, they would count
    # as a vote against the donors that hold the swarm's state (test_donor_limits has the vote).
    hub = LocalSwarmHub()
    first = swarm(hub, "first", rounds=RoundConfig(seconds=600.0))
    joiner = swarm(hub, "joiner", rounds=RoundConfig(seconds=600.0), initial_peers=["first"])
    try:
        first._monitor.tick()
        providers = hub.averaging.state_providers
        assert first.peer_id in providers and joiner.peer_id not in providers  # the organiser serves at once
        joiner.start()
        assert joiner.peer_id in providers
    finally:
        for peer in (joiner, first):
            peer.close()


def test_an_incompatible_run_is_refused_naming_the_field():
    hub = LocalSwarmHub()
    first = swarm(hub, "first")
    try:
        with pytest.raises(ConfigError, match="outer.lr"):
            swarm(hub, "second", outer=OuterConfig(lr=0.5))
    finally:
        first.close()


def test_checkpoint_round_trip_resumes_the_shared_state(tmp_path):
    hub = LocalSwarmHub()
    peer = swarm(hub, "saver")
    try:
        run_together([peer], rounds=2)
        path, saved_round = peer.save_checkpoint(tmp_path)
        assert path.parent == tmp_path and saved_round == peer.last_round
        saved = peer.anchor_params()
    finally:
        peer.close()
    again = swarm(LocalSwarmHub(), "saver")
    try:
        resumed = again.resume_from_checkpoints(tmp_path)
        assert resumed.path == path and resumed.round == saved_round and resumed.local_state == {} and again.rounds_done == peer.rounds_done
        restored = again.anchor_params()
        assert all(torch.equal(restored[n], saved[n]) for n in saved)
        live = dict(again.model.named_parameters())
        assert all(torch.equal(live[n].detach(), saved[n]) for n in saved)  # the model starts from it
    finally:
        again.close()


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    peer = swarm(LocalSwarmHub(), "saver")
    try:
        run_together([peer], rounds=1)
        peer.save_checkpoint(tmp_path)
    finally:
        peer.close()
    other = DiLoCoSwarm(model(), run_id="another-run", network=LocalNetwork(LocalSwarmHub(), "x"), averaging=FAST,
                        rounds=RoundConfig(seconds=ROUND_S))
    try:
        with pytest.raises(ConfigError, match="belongs to run 'api-test'"):
            other.resume_from_checkpoints(tmp_path)
    finally:
        other.close()
