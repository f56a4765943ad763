"""The library API: DiLoCo over a shoal swarm for your own model and training loop.

    swarm = DiLoCoSwarm(model, run_id="my-run", initial_peers=[...])   # before model.cuda() if you can
    model.cuda(); opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    swarm.start()
    while swarm.round <= 100:
        t0 = time.perf_counter()
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        for finished in swarm.step(tokens=x.numel(), seconds=time.perf_counter() - t0, loss=loss.item()):
            print(finished.round, finished.group_size)
    swarm.close()

One ``step`` call per inner step is all the loop does; averaging runs on a background thread
and its result is merged into the model at a later ``step`` (overlap mode), or right away
(blocking mode). ``shoal run`` drives its own model through exactly this class.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hivemind.utils import get_dht_time

from averaging.backend import DownloadedState, Progress
from averaging.diloco import OuterConfig, OuterState
from averaging.flat import FlatLayout
from averaging.hivemind_backend import HivemindBackend
from averaging.outer_loop import LoopConfig, OuterLoop, RoundStats
from averaging.sync import SyncWorker
from averaging.traffic import BYTES_PER_VALUE, Traffic, allreduce_payload
from node.config import AveragingConfig, RoundConfig, sync_shared_fields
from node.reaper import process_trees, reap
from node.sockets import hivemind_sockets, remove_stale
from node.swarm import MANIFEST_TTL, PeerMonitor, Reachability, join_run, start_dht
from protocols.keys import averager_prefix
from protocols.manifest import RunManifest
from protocols.messages import MessageError
from protocols.progress import ProgressRecord, shoal_version
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(ProgressRecord)) - {"peer_id", "time"}

__all__ = ["DiLoCoSwarm", "RoundStats"]


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
        heartbeat: Callable[[], dict[str, Any]] | None = None,
        on_peers_changed: Callable[[set[str], set[str]], None] | None = None,
    ):
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
        self.traffic = Traffic()
        self.tokens_contributed = 0
        self.last_stats: RoundStats | None = None
        try:
            self._build(listen, announce, bootstrap_timeout, identity, shared or {}, device, on_peers_changed)
        except BaseException:
            self.close()
            raise

    def _build(self, listen, announce, bootstrap_timeout, identity, shared, device, on_peers_changed) -> None:
        # 1. The anchor: an fp32 CPU copy of the trainable parameters.
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.layout = FlatLayout.of(named)
        anchor = self.layout.pack(dict(named), self.layout.new_buffer())
        avg = self.averaging
        self.outer = OuterState(self.layout, anchor, self.outer_config, rel_tol=avg.rel_tol, abs_tol=avg.abs_tol)
        self.shared = {
            **shared,
            **sync_shared_fields(outer=self.outer_config, rounds=self.rounds, averaging=avg),
            "parameters": hashlib.sha256(json.dumps(
                [[n, list(p.shape), str(p.dtype)] for n, p in named]).encode()).hexdigest()[:16],
        }
        # 2. The DHT and the run's schedule (forks hivemind's DHT process).
        self.dht = start_dht(initial_peers=self.initial_peers, listen=list(listen), announce=list(announce),
                             timeout=bootstrap_timeout, identity=Path(identity) if identity else None,
                             reachability=self.reachability)
        self._closers.append(self.dht.shutdown)
        self.peer_id = str(self.dht.peer_id)
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        period = min(5.0, max(1.0, self.rounds.seconds / 3))
        ours = RunManifest.create(self.run_id, self.shared, start_time=get_dht_time(), round_seconds=self.rounds.seconds)
        self.manifest = join_run(self.dht, ours, record_ttl=MANIFEST_TTL)
        # 3. The averager (forks again; before our own threads, before CUDA if the caller allows).
        backend = HivemindBackend(
            self.dht, numel=self.layout.numel, prefix=averager_prefix(self.run_id),
            state_provider=self.outer.shared_state, compression=avg.compression,
            target_group_size=avg.target_group_size or None, min_group_size=avg.min_group_size,
            min_matchmaking_time=avg.matchmaking_seconds, request_timeout=avg.request_timeout,
            allreduce_timeout=avg.allreduce_timeout, client_mode=self.reachability.client_mode,
        )
        self.worker = SyncWorker(backend, allreduce_timeout=avg.allreduce_timeout,
                                 matchmaking_grace=avg.matchmaking_seconds)
        self._closers.insert(0, self.worker.close)
        # 4. Who else is here, and the round engine.
        self.monitor = PeerMonitor(self.dht, self.manifest, period=period, status=self._status, on_change=on_peers_changed or (lambda joined, left: None))
        self._closers.insert(0, self.monitor.stop)
        self.device = torch.device(device) if device is not None else next(self.model.parameters()).device
        named_now = lambda: dict(self.model.named_parameters())  # noqa: E731 - follows .to(device)
        self.loop = OuterLoop(
            outer=self.outer, worker=self.worker, layout=self.layout, params=named_now,
            schedule=lambda: self.monitor.schedule,
            config=LoopConfig(mode=self.rounds.sync_mode, inner_steps=self.rounds.inner_steps,
                              matchmaking_seconds=avg.matchmaking_seconds, download_timeout=avg.allreduce_timeout,
                              prepare_lead=avg.matchmaking_seconds + avg.request_timeout),
            peer_id=self.peer_id, alone=lambda: self.monitor.peer_count <= 1,
            device=self.device,
        )

    # -- the training loop's calls -------------------------------------------------------------
    def resume(self, state: DownloadedState) -> int:
        """Start from a saved shared state (e.g. ``node.resume.state_from_checkpoint``) instead of
        the model's weights; call before ``start``. Returns the state's round. ``start`` still
        catches up from the swarm if it has moved on since."""
        self._resumed_round = self.loop.resume(state)
        return self._resumed_round

    def start(self, progress: Progress | None = None) -> dict | None:
        """Catch up with a running swarm (download its state), then begin the first round.
        Returns what was downloaded (``donors``, ``round``, ``seconds``), if anything;
        ``progress(done_bytes, total_bytes)`` follows the download (from another thread)."""
        joined = self._initial_sync(progress)
        self.monitor.start()
        self.loop.start()
        return joined

    def step(self, *, tokens: int, seconds: float, loss: float | None = None) -> list[RoundStats]:
        """Call after each inner optimizer step; returns the rounds that finished."""
        return self._account(self.loop.after_step(tokens=tokens, seconds=seconds, loss=loss))

    @property
    def round(self) -> int:
        return self.loop.round

    def progress(self) -> float:
        return self.loop.progress()

    @property
    def schedule(self) -> RoundSchedule:
        """The run's round schedule (converges on the earliest published start)."""
        return self.monitor.schedule

    @property
    def peer_count(self) -> int:
        return self.monitor.peer_count

    def finish(self) -> list[RoundStats]:
        """Let a sync in flight land before leaving."""
        return self._account(self.loop.finish())

    def close(self) -> None:
        closers, self._closers = self._closers, []
        hivemind = process_trees(self._hivemind_pids())  # DHT, averager and their p2pd
        for close in closers:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - leaving goes on
                logger.warning(f"shutdown step {getattr(close, '__qualname__', close)} failed: {e!r}")
        reap(hivemind)  # whatever hivemind's own shutdown left running (e.g. a terminated DHT's p2pd)
        remove_stale(hivemind_sockets() - self._sockets_before)  # after every hivemind process ended

    def _hivemind_pids(self) -> list[int | None]:
        dht, worker = getattr(self, "dht", None), getattr(self, "worker", None)
        averager = getattr(getattr(worker, "backend", None), "_averager", None)
        return [getattr(dht, "pid", None), getattr(averager, "pid", None)]

    # -- internals -------------------------------------------------------------------------------
    def _initial_sync(self, progress: Progress | None) -> dict | None:
        """Joining a run in progress: start from the swarm's current anchor, not from the init.
        Runs before the monitor thread starts, so this thread is still the DHT's only user."""
        if not self.initial_peers:
            return None
        self.monitor.tick()
        # Client-mode peers accept no connections: they cannot serve their state.
        donors = sorted((p for p, record in self.monitor.peers.items() if p != self.peer_id and record.mode != "client"),
                        key=lambda p: -self.monitor.peers[p].round)
        if not donors:
            return None
        started = time.perf_counter()
        try:
            adopted = self.loop.initial_sync(donors, newer_than=self._resumed_round, progress=progress)
        except MessageError as e:
            logger.warning(f"refused the swarm's state: {e}; starting from the initial weights")
            return None
        if adopted is None:
            if self._resumed_round < 0:
                logger.warning("could not download the swarm's state; starting from the initial weights")
            return None
        seconds = time.perf_counter() - started
        state = self.loop.last_download
        donors = list(state.donors or (state.peer,))
        size = sum(t.numel() * t.element_size() for t in state.tensors)
        self.traffic.add(received=size)
        logger.info(f"joined at round {adopted}: downloaded the shared state ({size / 2**20:.1f} MiB) from "
                    f"{len(donors)} peer(s) in {seconds:.1f}s")
        return {"round": adopted, "seconds": seconds, "donors": donors, "bytes": size}

    def _account(self, finished: list[RoundStats]) -> list[RoundStats]:
        """Tokens contributed and bytes moved, for the progress record and the dashboard."""
        for stats in finished:
            self.last_stats = stats
            if stats.applied != "folded":
                self.tokens_contributed += stats.tokens
            if stats.applied == "averaged":
                payload = self.allreduce_payload(stats.group_size)
                self.traffic.add(sent=payload, received=payload)
            if stats.resynced:
                self.traffic.add(received=2 * self.layout.numel * 4)  # anchor + momentum, fp32
        return finished

    def allreduce_payload(self, group_size: int) -> int:
        """Bytes this peer sends (and receives) in one all-reduce with ``group_size`` members."""
        return allreduce_payload(self.layout.numel, group_size, client_mode=self.reachability.client_mode,
                                 bytes_per_value=BYTES_PER_VALUE.get(self.averaging.compression, 4))

    @property
    def utilization(self) -> float | None:
        """Share of the last finished round's wall-clock time spent in inner steps."""
        stats = self.last_stats
        return min(1.0, stats.compute_s / stats.wall_s) if stats is not None and stats.wall_s > 0 else None

    def _status(self) -> ProgressRecord:
        """Our progress record (monitor thread): the library's own figures, then the caller's."""
        record = ProgressRecord(
            peer_id=self.peer_id, round=int(self.loop.round), tokens_per_s=0.0, loss=None, eval_loss=None,
            device=str(self.device), mode=self.reachability.mode, version=shoal_version(),
            utilization=self.utilization or 0.0,
            bytes_sent=self.traffic.sent, bytes_received=self.traffic.received, tokens=self.tokens_contributed,
            time=get_dht_time(), phase="averaging" if self.loop.syncing else "training",
        )
        if self._heartbeat is not None:
            extras = self._heartbeat()
            record = dataclasses.replace(record, **{k: v for k, v in extras.items() if k in _RECORD_FIELDS})
        return record
