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


def test_a_joiner_downloads_the_state_only_once_the_swarm_has_stepped():
    # In round 1, with every record at 0 outer steps, the shared model is the run's initial weights,
    # which the joiner builds itself: nothing to download (minutes on a slow link), however late in
    # the round (a lone step it misses at the deadline is replayed at its first averaged round: the
    # next test). After a step it downloads, and after round 1 too (a record may be stale).
    hub = LocalSwarmHub()
    long_rounds = RoundConfig(seconds=600.0)
    first = swarm(hub, "first", rounds=long_rounds)
    joiners = []

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded the initial weights")

    try:
        first._monitor.tick()  # publishes its record, as its monitor thread will
        for name, period in (("early", None), ("unheard", 1e4)):  # the latter too late to be heard in round 1
            joiner = swarm(hub, name, rounds=long_rounds, initial_peers=["first"])
            joiners.append(joiner)
            joiner._loop.initial_sync = no_download
            if period is not None:
                joiner._monitor.period = period
            assert joiner.start() is None and joiner.rounds_done == 0
        assert any(record.rounds_done == 0 for record in joiners[0].peers if record.peer_id == first.peer_id)
        first._shared.apply(torch.full_like(first._shared.anchor, 0.01), round=1)  # as a lone peer's round 1
        first._monitor.tick()
        late = swarm(hub, "late", rounds=long_rounds, initial_peers=["first"])
        joiners.append(late)
        joined = late.start()
        assert joined is not None and late.rounds_done == first.rounds_done == 1, joined
        assert all(torch.equal(late.anchor_params()[k], v) for k, v in first.anchor_params().items())
    finally:
        for peer in (*joiners, first):
            peer.close()
    # Round 2, every record still at 0: one may predate its peer's lone step at round 1's deadline.
    hub = LocalSwarmHub()
    short_rounds = RoundConfig(seconds=1.0)
    first = swarm(hub, "first", rounds=short_rounds)
    joiner = swarm(hub, "round-2", rounds=short_rounds, initial_peers=["first"])
    downloads = []
    joiner._loop.initial_sync = lambda *args, **kwargs: downloads.append(args)
    try:
        first._monitor.tick()
        time.sleep(max(0.0, first.schedule.round_end(1) - time.time()) + 0.1)
        joiner.start()
        assert len(downloads) == 1
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


def test_a_joiner_that_trusted_a_stale_record_replays_the_step_it_missed():
    """The first peer's record still says 0 outer steps when it has just stepped alone: the joiner
    starts from the initial weights, one step behind, and its first averaged round replays that
    step from its group instead of downloading the state."""
    hub = LocalSwarmHub()
    rounds = RoundConfig(seconds=3.0)  # the joiner decides in round 1 (it would download in round 2)
    first = swarm(hub, "first", rounds=rounds)
    joiner = None
    try:
        first._monitor.tick()  # its record: 0 outer steps
        first._shared.apply(torch.full_like(first._shared.anchor, 0.01), round=1)  # stepped alone since
        joiner = swarm(hub, "joiner", rounds=rounds, initial_peers=["first"])
        downloads = []
        joiner._loop.initial_sync = lambda *args, **kwargs: downloads.append(args)
        # The first peer publishes its new record only once the joiner has decided (else a race).
        decided, start_joiner, start_first = threading.Event(), joiner.start, first.start
        joiner.start = lambda: (start_joiner(), decided.set())[0]
        first.start = lambda: (decided.wait(30), start_first())[1]
        finished_joiner, finished_first = run_together([joiner, first], rounds=2)
        assert not downloads and not any(s.resynced for s in (*finished_first, *finished_joiner))
        assert any(s.applied == Applied.AVERAGED for s in finished_joiner), [(s.round, s.applied, s.error)
                                                                              for s in finished_joiner]
        assert joiner.rounds_done == first.rounds_done >= 2
        anchor_first, anchor_joiner = first.anchor_params(), joiner.anchor_params()
        assert all((anchor_first[k] - anchor_joiner[k]).abs().max() < 1e-4 for k in anchor_first)  # fp16 replay
    finally:
        for peer in (first, joiner):
            if peer is not None:
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
