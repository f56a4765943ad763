"""``DiLoCoSwarm``: DiLoCo over a shoal swarm for your own model and training loop.

One ``step`` call per inner step is all the training loop does (usage: ``node.api``'s docstring);
averaging runs on a background thread and its result is merged into the model at a later ``step``
(overlap mode), or right away (blocking mode). ``shoal run`` drives its own model through exactly this class and nothing
else of the library: everything it reads (rounds, peers, traffic, checkpoints) is a method or
property here. Import it from ``node.api``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from averaging.engine.config import LoopConfig
from averaging.engine.inner_sync import InnerStateSync
from averaging.engine.loop import REPLAY_DONORS, RoundEngine
from averaging.engine.stats import RoundStats, Traffic
from averaging.engine.subgroups import Mixing, one_group, state_numel
from averaging.engine.worker import SyncWorker
from averaging.math.flat import FlatLayout
from averaging.math.groups import agreed_group_count, group_among
from averaging.math.outer_step import OuterConfig
from averaging.math.wire import EXTRA_CODE, STATE_BYTES_PER_VALUE, mix_code, round_payload
from averaging.network.hivemind.averager import leader_group_cap
from averaging.network.interface import Progress
from averaging.state.served import DownloadedState
from averaging.state.shared_state import HISTORY_ROUNDS, SharedState
from averaging.state.verdict import Applied
from node.library.acquaintances import Acquaintances
from node.library.cleanup import close_hivemind, hivemind_sockets
from node.library.config import AveragingConfig, RoundConfig, sync_shared_fields
from node.library.dht import Reachability, RecordRules
from node.library.group_limit import GroupLimitWatch
from node.library.monitor import PeerMonitor
from node.library.network import HivemindNetwork, Network
from node.library.rediscovery import PeerCache, Rediscovery
from node.library.resume import find_resume_point, save_shared_state, state_from_checkpoint
from node.library.run_record import MANIFEST_TTL, RunTrust, join_run
from node.library.swarm_clock import ClockKeeper
from protocols import swarm_time
from protocols.addresses import is_public, parse_peer_multiaddr, peer_id_of
from protocols.errors import AddressError, CheckpointError, ConfigError
from protocols.manifest import RunManifest, progress_shards
from protocols.messages import MessageError
from protocols.progress import ProgressRecord
from protocols.schedule import RoundSchedule
from protocols.version import shoal_version

logger = logging.getLogger(__name__)

ALONE_AFTER_ROUNDS = 2  # rounds without a joiner or another live record before a peer steps alone (_alone)
PUBLISHED_ADDRS = 4  # addresses in our record (each ~90 bytes, stored every heartbeat): enough to be found

__all__ = ["DiLoCoSwarm", "Heartbeat", "LiveRound", "Resumed", "RoundStats"]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What the caller's training loop adds to this peer's progress record (each optional).

    Typed, so a misspelled figure is an error where it is written, not a silently dropped key."""

    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float = 0.0
    device: str | None = None  # default: the model's device
    phase: str | None = None  # default: training / averaging
    shard: int | None = None  # the data shard this peer trains on (``node.library.shards``)


@dataclass(frozen=True, slots=True)
class Resumed:
    """The checkpoint a swarm resumed from."""

    path: Path
    round: int
    local_state: dict[str, torch.Tensor]  # what the caller saved beside the shared state (may be empty)


@dataclass(frozen=True, slots=True)
class LiveRound:
    """The round being trained right now, as far as it got."""

    round: int
    steps: int
    tokens: int
    compute_s: float


def donor_order(records: Mapping[str, ProgressRecord], *, me: str, max_rounds_done: int,
                rng: random.Random | None = None) -> list[str]:
    """The peers to download the swarm's state from, in the order to ask them: the most outer steps
    first, counted only up to what the schedule allows (a count is a donor's own word), ties
    shuffled; client-mode peers accept no connections."""
    donors = [p for p, record in records.items() if p != me and record.mode != "client"]
    (rng or random.Random()).shuffle(donors)
    return sorted(donors, key=lambda p: -min(records[p].rounds_done or 0, max_rounds_done))  # stable


class DiLoCoSwarm:
    """Joins a swarm and keeps a model in sync with it (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        run_id: str,
        outer: OuterConfig | None = None,
        averaging: AveragingConfig | None = None,
        rounds: RoundConfig | None = None,
        initial_peers: list[str] | tuple[str, ...] = (),
        listen: list[str] | tuple[str, ...] = (),
        announce: list[str] | tuple[str, ...] = (),
        bootstrap_timeout: float = 30.0,
        identity: str | Path | None = None,
        client_mode: bool = False,
        use_relay: bool = False,
        shared: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        heartbeat: Callable[[], Heartbeat] | None = None,
        on_peers_changed: Callable[[set[str], set[str]], None] | None = None,
        network: Network | None = None,
        run_key: bytes | None = None,
        swarm_key: bytes | None = None,
        trust_dir: str | Path | None = None,
        inner_state: InnerStateSync | None = None,
    ):
        """``network``: how this peer reaches the others; default hivemind's DHT and all-reduce,
        started from ``initial_peers``/``listen``/``announce``/``identity`` (those are ignored when a
        network is given, e.g. ``node.library.local_network.LocalNetwork`` in tests). ``run_key``: the
        organiser key to follow (``--run-key``); ``swarm_key``: a private swarm's key (``--swarm-key``);
        ``trust_dir``: where the run key trusted on first use and our own organiser key are kept.
        ``inner_state``: the inner optimizer's moments (``InnerStateSync.of(model, [optimizer])``),
        needed when ``averaging.average_inner_state`` is on: they ride every all-reduce."""
        self.model, self.run_id = model, run_id
        self.outer_config = outer or OuterConfig()
        self.averaging = averaging or AveragingConfig()
        self.rounds = rounds or RoundConfig()
        self.initial_peers = list(initial_peers)
        self._closers: list[Callable[[], Any]] = []
        self._sockets_before = hivemind_sockets()
        self._heartbeat = heartbeat
        self.reachability = Reachability(client_mode=client_mode, use_relay=use_relay)
        self._resumed_round = -1
        self._served_at = 0.0  # when a peer last downloaded our state (see _alone)
        self._acquaintances = Acquaintances()  # whose figures count (node.library.acquaintances)
        self._traffic = Traffic()
        self.tokens_contributed = 0
        self.last_stats: RoundStats | None = None
        self._network: Network | None = None
        self._mixing: Mixing | None = None  # sub-groups (set with the engine)
        folder = self._trust_dir = Path(trust_dir) if trust_dir is not None else None
        self.trust = RunTrust(pinned=run_key, explicit=run_key is not None,
                              pin_file=folder / f"{run_id}.run-key" if folder else None,
                              organiser_file=folder / f"{run_id}.organiser.key" if folder else None)
        if self.averaging.average_inner_state and inner_state is None:
            raise ConfigError("averaging.average_inner_state needs the inner optimizers: pass "
                              "inner_state=InnerStateSync.of(model, [optimizer]) to DiLoCoSwarm")
        self._inner_state = inner_state if self.averaging.average_inner_state else None
        try:
            self._build_state(shared or {})
            self._network = network or HivemindNetwork.start(
                initial_peers=self.initial_peers, listen=list(listen), announce=list(announce),
                timeout=bootstrap_timeout, identity=Path(identity) if identity else None,
                reachability=self.reachability,
                rules=RecordRules(run_ids=(run_id,), pinned_run_key=run_key, swarm_key=swarm_key))
            self._closers.append(self._network.close)
            self._join()
            self._build_engine(device, on_peers_changed)
        except BaseException:
            self.close()
            raise

    def _build_state(self, shared: dict[str, Any]) -> None:
        """The anchor (an fp32 CPU copy of the trainable parameters), the outer state, and the fields
        every peer of the run must agree on (the caller's, the sync protocol's, the parameters')."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._layout = FlatLayout.of(named)
        anchor = self._layout.pack(dict(named), self._layout.new_buffer())
        avg = self.averaging
        self._shared = SharedState(self._layout, anchor, self.outer_config, rel_tol=avg.rel_tol, abs_tol=avg.abs_tol)
        self.shared = {
            **shared,
            **sync_shared_fields(outer=self.outer_config, rounds=self.rounds, averaging=avg),
            "parameters": hashlib.sha256(json.dumps(
                [[n, list(p.shape), str(p.dtype)] for n, p in named]).encode()).hexdigest()[:16],
        }
        if self._inner_state is not None:  # which moments ride the all-reduce (AdamW's or Muon's): peers cut alike
            self.shared["averaging.inner_state_layout"] = self._inner_state.describe()

    def _join(self) -> None:
        """Adopt the run's schedule, or refuse an incompatible run (``ConfigError``) before averaging."""
        network = self._network
        self.peer_id, self.maddrs = network.peer_id, list(network.maddrs)
        self._directory = network.directory(self.run_id)
        ours = RunManifest.create(self.run_id, self.shared, start_time=self._directory.now(),
                                  round_seconds=self.rounds.seconds)
        self.manifest = join_run(self._directory, ours, record_ttl=MANIFEST_TTL, trust=self.trust,
                                 # a DHT that knows no peer cannot see another organiser (in-process hubs can)
                                 alone=not self.initial_peers and isinstance(network, HivemindNetwork))
        self._directory.use_progress_shards(progress_shards(self.manifest))

    def _build_engine(self, device, on_peers_changed) -> None:
        """The averager (hivemind forks it: before our own threads, and before CUDA if the caller
        allows), the sync worker, the peer monitor and the round engine."""
        avg = self.averaging
        # Sub-groups (averaging.engine.subgroups): the anchor and momentum ride every all-reduce, ahead
        # of the inner optimizer's moments when those ride too.
        code = mix_code(avg.wire, with_inner_state=avg.average_inner_state, requested=avg.state_compression)
        mixing = self._mixing = Mixing(plan=self._group_plan, code=code) if avg.target_group_size else None
        extra_numel = (state_numel(self._layout.numel) if mixing else 0) + (
            self._inner_state.numel if self._inner_state else 0)
        # A peer that downloads the swarm's state first serves none until then (``share_state``).
        backend = self._network.backend(run_id=self.run_id, numel=self._layout.numel,
                                        state_provider=self._serve_state, averaging=avg,
                                        client_mode=self.reachability.client_mode,
                                        update_provider=self._shared.update_after,
                                        share_state=not self.initial_peers,
                                        extra_numel=extra_numel, extra_code=code if mixing else EXTRA_CODE)
        self._backend = backend
        self._worker = SyncWorker(backend, allreduce_timeout=avg.allreduce_timeout,
                                  matchmaking_grace=avg.matchmaking_seconds)
        self._closers.insert(0, self._worker.close)
        period = min(5.0, max(1.0, self.rounds.seconds / 3))
        # (sub-groups have no such limit: each group meets under its own key)
        self._group_limit = GroupLimitWatch(None if mixing else leader_group_cap(None, avg.robust))
        self._on_peers_changed = on_peers_changed
        self._monitor = PeerMonitor(self._directory, self.manifest, peer_id=self.peer_id,
                                    period=period, status=self._status,
                                    on_change=self._peers_changed, trust=self.trust,
                                    rediscovery=self._rediscovery(period), present=self._present_others,
                                    voices=self._voices,
                                    clock=ClockKeeper(trusted=[peer_id_of(a) for a in self.initial_peers]))
        self._closers.insert(0, self._monitor.stop)
        self.device = torch.device(device) if device is not None else next(self.model.parameters()).device
        named_now = lambda: dict(self.model.named_parameters())  # noqa: E731 - follows .to(device)
        self._loop = RoundEngine(
            state=self._shared, worker=self._worker, layout=self._layout, params=named_now,
            schedule=lambda: self._monitor.schedule,
            config=LoopConfig(mode=self.rounds.sync_mode, inner_steps=self.rounds.inner_steps,
                              matchmaking_seconds=avg.matchmaking_seconds, download_timeout=avg.allreduce_timeout,
                              prepare_lead=avg.matchmaking_seconds + avg.request_timeout),
            peer_id=self.peer_id, alone=self._alone,
            device=self.device, wire=avg.wire, client_mode=self.reachability.client_mode,
            swarm_lateness=self._others_lateness, inner_state=self._inner_state, mixing=mixing,
        )

    def _peers_changed(self, joined: set[str], left: set[str]) -> None:
        """The monitor's news (its thread): the operator is told once when the swarm outgrows one
        group (``node.library.group_limit``), then the caller's callback runs."""
        if (warning := self._group_limit.observe(self._monitor.peer_count)) is not None:
            logger.warning(warning)
        if self._on_peers_changed is not None:
            self._on_peers_changed(joined, left)

    def _rediscovery(self, period: float) -> Rediscovery:
        """Re-dialling the initial peers and the peers averaged with (kept in ``trust_dir``, the checkpoint
        folder, across restarts) when the swarm seems to shrink: ``node.library.rediscovery``."""
        path = self._trust_dir / f"{self.run_id}.peers.json" if self._trust_dir is not None else None
        return Rediscovery(initial_peers=self.initial_peers, cache=PeerCache.load(path), peer_id=self.peer_id,
                           period=period, local=not any(is_public(a) for a in self.maddrs))

    def _group_plan(self, round: int) -> tuple[int, int]:
        """Our sub-group in ``round`` and the round's group count (the prepare lane's thread), from
        every live record (``averaging.math.groups``). Every live record, not only the members met
        lately: counted from members, a swarm can split for good (docs/incidents.md); strangers'
        records can thin the groups instead (docs/security.md)."""
        records = self._monitor.peers  # one snapshot for the count and the cut (the monitor swaps its dict whole)
        count = self._agreed_group_count(records)
        return group_among(self.peer_id, records, round, count, salt=self.run_id), count

    def _agreed_group_count(self, records: Mapping[str, ProgressRecord]) -> int:
        """The sub-group count from every live record (``_group_plan`` says why every one)."""
        return agreed_group_count((r.group_count for r in records.values()), max(1, len(records)),
                                  self.averaging.target_group_size)

    def _serve_state(self) -> tuple[dict, list[torch.Tensor]]:
        """Our shared state for a peer downloading it (hivemind's fetcher thread, in this process)."""
        self._served_at = time.time()
        return self._shared.shared_state()

    def _alone(self) -> bool:
        """Whether a round that found no group applies our own pseudo-gradient (we define the shared
        model). Not while another member is known (``node.library.acquaintances``), nor within two
        rounds of a peer downloading our state (it would be left a step behind unseen) or of hearing
        another peer (records can miss their TTL on a saturated link: docs/incidents.md). Folding
        the round instead costs nothing."""
        now, wait = time.time(), ALONE_AFTER_ROUNDS * self._monitor.schedule.round_seconds
        recent = now - self._served_at < wait or now - self._monitor.others_seen_at < wait
        others = [p for p in self._monitor.peers if p != self.peer_id]
        return not self._acquaintances.present(others, self._loop.round) and not recent

    def _voices(self, others: list[str]) -> list[str]:
        """Of the other live peers, those we averaged with lately (monitor thread)."""
        return self._acquaintances.voices(others, self._loop.round)

    def _present_others(self, others: list[str]) -> list[str]:
        """The monitor's filter (its thread): of the other live records, the peers that count."""
        round = self._loop.round if hasattr(self, "_loop") else 0
        self._acquaintances.saw(others, round)
        return self._acquaintances.present(others, round)

    # -- the training loop's calls -------------------------------------------------------------
    def resume(self, state: DownloadedState) -> int:
        """Start from a saved shared state instead of the model's weights; call before ``start``.
        Returns the state's round. ``start`` still catches up from the swarm if it has moved on."""
        self._resumed_round = self._loop.resume(state)
        return self._resumed_round

    def resume_from_checkpoints(self, checkpoint_dir: str | Path, *, config_hash: str | None = None,
                                on_invalid: Callable[[CheckpointError], None] | None = None) -> Resumed | None:
        """Resume from the newest checkpoint in ``checkpoint_dir`` that verifies (call before
        ``start``); each newer broken one is passed to ``on_invalid``. Returns what was resumed (with
        the ``local_state`` saved beside it, e.g. your inner optimizer's), or None when the folder
        holds no checkpoint. A checkpoint of another run or config is refused (``ConfigError``); one
        whose values are invalid raises ``CheckpointError``."""
        checkpoint = find_resume_point(Path(checkpoint_dir), on_invalid=on_invalid or (lambda error: None))
        if checkpoint is None:
            return None
        state = state_from_checkpoint(checkpoint, self._layout, run_id=self.run_id,
                                      config_hash=config_hash or self.manifest.config_hash)
        try:
            return Resumed(path=checkpoint.path, round=self.resume(state), local_state=checkpoint.local_state)
        except MessageError as e:
            raise CheckpointError(f"checkpoint {checkpoint.path} holds an invalid state ({e}); delete it or use "
                                  "an older checkpoint") from None

    def save_checkpoint(self, checkpoint_dir: str | Path, *, meta: dict | None = None,
                        local_state: dict[str, torch.Tensor] | None = None) -> tuple[Path, int]:
        """Write the shared state (anchor, outer momentum, counters) as an atomic, verified checkpoint,
        with this peer's own ``local_state`` tensors if given (e.g. ``Trainer.inner_state()``);
        returns (path, round). Safe while a sync is in flight: the state is copied under its lock."""
        return save_shared_state(Path(checkpoint_dir), self._layout, self._shared.shared_state(),
                                 meta={"run_id": self.run_id, "peer": self.peer_id,
                                       "config_hash": self.manifest.config_hash, **(meta or {})},
                                 local_state=local_state)

    def start(self, progress: Progress | None = None) -> dict | None:
        """Catch up with a running swarm (download its state), then begin the first round.
        Returns what was downloaded (``donors``, ``round``, ``seconds``), if anything;
        ``progress(done_bytes, total_bytes)`` follows the download (from another thread)."""
        joined = self._initial_sync(progress)
        # Our state is now the one we train on: serve it. Until now it was the initial weights, and
        # joiners would have counted it as a vote against the swarm's state (docs/design.md).
        self._backend.share_state(True)
        self._monitor.start()
        self._loop.start()
        return joined

    def step(self, *, tokens: int, seconds: float, loss: float | None = None) -> list[RoundStats]:
        """Call after each inner optimizer step; returns the rounds that finished."""
        return self._account(self._loop.after_step(tokens=tokens, seconds=seconds, loss=loss))

    @property
    def round(self) -> int:
        return self._loop.round

    def progress(self) -> float:
        return self._loop.progress()

    @property
    def schedule(self) -> RoundSchedule:
        """The run's round schedule (converges on the earliest published start)."""
        return self._monitor.schedule

    @property
    def group_count(self) -> int | None:
        """With sub-groups: how many groups our last prepared round split into; None without them."""
        return self._loop.group_count

    @property
    def peer_count(self) -> int:
        return self._monitor.peer_count

    @property
    def present_peers(self) -> tuple[ProgressRecord, ...]:
        """The live records of this peer and of the peers that count as members (met in a group
        lately, or new): what swarm-wide choices such as the data shard follow."""
        peers = self._monitor.peers
        present = set(self._acquaintances.present([p for p in peers if p != self.peer_id], self._loop.round))
        return tuple(record for p, record in peers.items() if p == self.peer_id or p in present)

    @property
    def peers(self) -> tuple[ProgressRecord, ...]:
        """The live peers' latest progress records (ours included)."""
        return tuple(self._monitor.peers.values())  # the monitor swaps its dict whole

    @property
    def syncing(self) -> bool:
        """A round's sync is in flight (training goes on meanwhile in overlap mode)."""
        return self._loop.syncing

    def live_round(self) -> LiveRound:
        window = self._loop.window
        if window is None:
            return LiveRound(round=0, steps=0, tokens=0, compute_s=0.0)
        return LiveRound(round=window.round, steps=window.steps, tokens=window.tokens, compute_s=window.compute_s)

    @property
    def rounds_done(self) -> int:
        """Outer steps applied to the shared model since the run began."""
        return self._shared.rounds_done

    @property
    def last_round(self) -> int:
        """Global round of the last outer step applied."""
        return self._shared.last_round

    @property
    def bytes_sent(self) -> int:
        """Averaging payload this peer sent so far (all-reduce parts)."""
        return self._traffic.sent

    @property
    def bytes_received(self) -> int:
        """Averaging payload received so far (all-reduce parts and downloaded state)."""
        return self._traffic.received

    def anchor_params(self) -> dict[str, torch.Tensor]:
        """A consistent CPU copy of the shared model (the anchor) by parameter name, e.g. for eval:
        the live parameters also hold this peer's unsynced progress."""
        return self._layout.views(self._shared.anchor_copy())

    def dead_process(self) -> str | None:
        """Which of this peer's own network processes died (killed, crashed), or None: without
        them the peer cannot average, and its caller should leave (``shoal run`` exits with one line)."""
        return self._network.dead() if self._network is not None else None

    @property
    def processes(self) -> dict[str, int]:
        """This peer's network processes by role (``dht``, ``averager``, ``p2pd``; none in-process)."""
        processes = getattr(self._network, "processes", None)
        return processes() if processes is not None else {}

    def finish(self) -> list[RoundStats]:
        """Let a sync in flight land before leaving."""
        return self._account(self._loop.finish())

    def close(self) -> None:
        """Leave: stop the round engine, the monitor, the averager and the DHT, and make sure none of
        hivemind's processes (p2pd included) or sockets outlive us. Safe to call twice."""
        closers, self._closers = self._closers, []
        close_hivemind(closers, self._network.pids() if self._network is not None else [], self._sockets_before)

    # -- internals -------------------------------------------------------------------------------
    def _initial_sync(self, progress: Progress | None) -> dict | None:
        """Joining a run in progress: start from the swarm's current anchor, not from the init.
        Runs before the monitor thread starts, so this thread is still the DHT's only user."""
        if not self.initial_peers:
            return None
        self._monitor.tick()
        donors = donor_order(self._monitor.peers, me=self.peer_id,
                             max_rounds_done=self._monitor.schedule.round_at(self._directory.now()))
        if self._mixing is not None:
            # Anchors of different sub-groups differ by more than a download's per-slice check
            # allows: take the state from the members of one group of the last round.
            last = self._monitor.schedule.round_at(self._directory.now()) - 1
            records = self._monitor.peers
            donors = one_group(donors, live=records, round=last, groups=self._agreed_group_count(records),
                               salt=self.run_id)
        if not donors:
            return None
        if (joined := self._join_by_replay(donors)) is not None:
            return joined or None
        started = time.perf_counter()
        try:
            adopted = self._loop.initial_sync(donors, newer_than=self._resumed_round, progress=progress)
        except MessageError as e:
            logger.warning(f"refused the swarm's state: {e}; starting from the initial weights")
            return None
        if adopted is None:
            if self._resumed_round < 0:
                logger.warning("could not download the swarm's state; starting from the initial weights")
            return None
        seconds = time.perf_counter() - started
        state = self._loop.last_download
        donors = list(state.donors or (state.peer,))
        size = sum(t.numel() * t.element_size() for t in state.tensors)
        self._traffic.add(received=size)
        logger.info(f"joined at round {adopted}: downloaded the shared state ({size / 2**20:.1f} MiB) from "
                    f"{len(donors)} peer(s) in {seconds:.1f}s")
        return {"round": adopted, "seconds": seconds, "donors": donors, "bytes": size}

    def _join_by_replay(self, donors: list[str]) -> dict | None:
        """A run young enough that its donors hold every outer step taken (at most ``HISTORY_ROUNDS``
        by their records): start from the run's initial weights, which we built from its seed too,
        and replay those steps (2 bytes a parameter each) instead of downloading the state (8, all
        through the donors' uplinks: minutes on slow links while the run's first peers train).
        None: download instead; {}: nobody has stepped (nothing to fetch)."""
        claimed = [self._monitor.peers[p].rounds_done for p in donors]
        if self._resumed_round >= 0 or None in claimed or max(claimed) > HISTORY_ROUNDS:
            return None
        started = time.perf_counter()
        steps = self._loop.join_by_replay(donors, at_least=max(claimed))
        if steps is None:
            return None
        if steps == 0:
            if self._monitor.schedule.round_end(1) <= self._directory.now():
                return None  # past round 1 "no step" may be a donor that could not answer in time: download
            logger.info("the swarm has not applied an outer step yet: starting from the run's initial weights, "
                        "as every peer does (nothing to download)")
            return {}
        seconds, size = time.perf_counter() - started, steps * self._layout.numel * torch.float16.itemsize
        self._traffic.add(received=size)
        logger.info(f"joined at round {self._shared.last_round}: replayed the swarm's {steps} outer step(s) "
                    f"({size / 2**20:.1f} MiB) in {seconds:.1f}s")
        return {"round": self._shared.last_round, "seconds": seconds, "donors": donors[:REPLAY_DONORS],
                "bytes": size, "replayed": steps}

    def _account(self, finished: list[RoundStats]) -> list[RoundStats]:
        """Tokens contributed and bytes moved, for the progress record and the dashboard."""
        for stats in finished:
            self.last_stats = stats
            if stats.applied == Applied.AVERAGED:
                self._acquaintances.met((p for p in stats.group if p != self.peer_id), stats.round)
            if stats.applied != Applied.FOLDED:
                self.tokens_contributed += stats.tokens
            self._traffic.add(sent=stats.bytes_sent, received=stats.bytes_received)  # 0 unless an all-reduce ran
            if stats.resynced:
                self._traffic.add(received=2 * self._layout.numel * STATE_BYTES_PER_VALUE)  # anchor + momentum
        return finished

    def allreduce_payload(self, group_size: int) -> int:
        """Bytes this peer sends in one all-reduce with ``group_size`` members (sends and returns,
        each in its code; about what it receives)."""
        wire = self.averaging.wire
        sent, _ = round_payload(self._layout.numel, group_size, client_mode=self.reachability.client_mode,
                                send_bytes_per_value=wire.send_bytes_per_value(),
                                return_bytes_per_value=wire.return_bytes_per_value())
        return sent

    @property
    def clock_advice(self) -> str | None:
        """What to tell the user while this machine's clock is off the swarm's by over a second."""
        return self._monitor.clock.advice

    @property
    def utilization(self) -> float | None:
        """Share of the last finished round's wall-clock time spent in inner steps."""
        stats = self.last_stats
        return min(1.0, stats.compute_s / stats.wall_s) if stats is not None and stats.wall_s > 0 else None

    @property
    def sync_lateness(self) -> float | None:
        """How long after their round's deadline our syncs end (EMA, seconds), once measured."""
        return self._loop.sync_lateness

    def _others_lateness(self) -> list[float]:
        """The sync lateness the other live peers we averaged with lately published (the round
        engine agrees on a period from their median): a record we never met has no say."""
        peers = self._monitor.peers
        voices = self._voices([p for p in peers if p != self.peer_id])
        return [peers[p].sync_late_s for p in voices if peers[p].sync_late_s is not None]

    def _status(self) -> ProgressRecord:
        """Our progress record (monitor thread): the library's own figures, then the caller's."""
        beat = self._heartbeat() if self._heartbeat is not None else Heartbeat()
        return ProgressRecord(
            peer_id=self.peer_id, round=int(self._loop.round), tokens_per_s=float(beat.tokens_per_s),
            loss=beat.loss, eval_loss=beat.eval_loss, device=beat.device or str(self.device),
            mode=self.reachability.mode, version=shoal_version(), utilization=self.utilization or 0.0,
            bytes_sent=self._traffic.sent, bytes_received=self._traffic.received, tokens=self.tokens_contributed,
            round_bytes_sent=self.last_stats.bytes_sent if self.last_stats else None,
            round_bytes_received=self.last_stats.bytes_received if self.last_stats else None,
            time=self._directory.now(), phase=beat.phase or ("averaging" if self._loop.syncing else "training"),
            shard=beat.shard, sync_late_s=self._loop.sync_lateness, rounds_done=self._shared.rounds_done,
            group_count=self.group_count,
            clock_offset_s=swarm_time.offset() if self._monitor.clock.peers_measured else None,
            addrs=self._dialable_addrs(),
        )

    def _dialable_addrs(self) -> tuple[str, ...] | None:
        """Our addresses as others can dial them, for their rediscovery; None in client mode."""
        if self.reachability.client_mode:
            return None
        valid = []
        for maddr in self.maddrs:
            try:
                valid.append(parse_peer_multiaddr(maddr, flag="our address"))
            except AddressError:
                continue
        return tuple(a for a in valid if peer_id_of(a) == self.peer_id)[:PUBLISHED_ADDRS] or None
