"""One shoal peer: build everything, train round after round, leave cleanly.

Phases (``Node.__init__``): 1. model + anchor on the CPU, 2. corpus, 3. DHT and run record,
4. averager (a forked process: before CUDA and before our threads), 5. device, 6. metrics, view
and monitor. ``Node.train`` runs rounds on the global schedule; ``Node.close`` always runs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from averaging.diloco import OuterState, RoundConclusion
from averaging.flat import FlatLayout
from averaging.hivemind_backend import HivemindBackend
from averaging.sync import SyncWorker
from node.checkpoint import save_checkpoint
from node.config import RunConfig, shared_fields, shared_hash
from node.data import BatchSampler, eval_batches, load_corpus, shard_bounds, shard_for_peer, split_corpus
from node.metrics import MetricsWriter, round_record_fields
from node.model import build_model, count_parameters
from node.sockets import hivemind_sockets, remove_stale
from node.swarm import PeerMonitor, join_run, start_dht
from node.trainer import StepTimer, Trainer, inner_lr, resolve_device
from node.ui import LiveView, NodeStatus, PlainView
from protocols.addresses import format_join_command
from protocols.keys import averager_prefix
from protocols.messages import MessageError

logger = logging.getLogger(__name__)

RESYNC_ATTEMPTS = 5


@dataclass(kw_only=True, slots=True)
class NodeOptions:
    """Per-process options: how this peer connects and where it writes (not shared with the run)."""

    initial_peers: list[str] = field(default_factory=list)
    listen: list[str] = field(default_factory=list)
    announce: list[str] = field(default_factory=list)
    max_rounds: int | None = None
    checkpoint_dir: Path | None = None
    metrics_file: Path | None = None
    ui: bool = True
    bootstrap_timeout: float = 30.0


class Node:
    def __init__(self, config: RunConfig, options: NodeOptions, stop: threading.Event):
        self.config, self.options, self.stop = config, options, stop
        self._closers: list = []
        self._sockets_before: set[str] | None = None
        try:
            self._build()
        except BaseException:
            self._run_closers()  # a failed start must not leave a DHT or an averager behind
            raise

    def _build(self) -> None:
        config, options = self.config, self.options
        if config.train.torch_threads:
            torch.set_num_threads(config.train.torch_threads)
        # Fail on an unusable --device before starting any network process.
        self.device = resolve_device(config.train.device)

        # 1. Model and anchor on the CPU; every peer builds the same weights from the run's seed.
        model = build_model(config.model, seed=config.train.seed)
        self.layout = FlatLayout.of(model.named_parameters())
        anchor = self.layout.pack(dict(model.named_parameters()), self.layout.new_buffer())
        self.outer = OuterState(self.layout, anchor, config.outer,
                                rel_tol=config.averaging.rel_tol, abs_tol=config.averaging.abs_tol)

        # 2. Data (read once into the token cache).
        split = split_corpus(load_corpus(config.data), config.data.eval_fraction, config.data.max_eval_bytes)

        # 3. The swarm. Forks a process (hivemind's DHT).
        self._sockets_before = hivemind_sockets()
        self.dht = start_dht(initial_peers=options.initial_peers, listen=options.listen,
                             announce=options.announce, timeout=options.bootstrap_timeout)
        self._closers.append(self.dht.shutdown)
        self.peer_id = str(self.dht.peer_id)
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        self.shared = shared_fields(config)
        heartbeat = min(5.0, max(1.0, config.round.seconds / 3))
        self.schedule = join_run(self.dht, config.run_id, self.shared, config.round.seconds,
                                 record_ttl=max(600.0, 3 * heartbeat))

        # 4. The averager: forks again, and sets SIGINT to ignored (the CLI restores its handler).
        avg = config.averaging
        backend = HivemindBackend(
            self.dht, numel=self.layout.numel, prefix=averager_prefix(config.run_id),
            state_provider=self.outer.shared_state, compression=avg.compression,
            target_group_size=avg.target_group_size or None, min_group_size=avg.min_group_size,
            min_matchmaking_time=avg.matchmaking_seconds, request_timeout=avg.request_timeout,
            allreduce_timeout=avg.allreduce_timeout,
        )
        self.worker = SyncWorker(backend, allreduce_timeout=avg.allreduce_timeout,
                                 matchmaking_grace=2 * avg.matchmaking_seconds)
        self._closers.insert(0, self.worker.close)

        # 5. The model on its device and the data this peer trains on (its own shard).
        self.trainer = Trainer(model, self.layout, config.inner, config.train, self.device)
        self.shard = shard_for_peer(self.peer_id, config.data.num_shards)
        lo, hi = shard_bounds(len(split.train), config.data.num_shards, self.shard)
        self.sampler = BatchSampler(split.train[lo:hi], config.model.seq_len, config.data.batch_size,
                                    seed=int.from_bytes(self.dht.peer_id.to_bytes()[-8:], "big"))
        self.eval_set = eval_batches(split.eval, config.model.seq_len, config.data.batch_size,
                                     config.train.eval_batches)
        self.pseudo_grad = self.layout.new_buffer()

        # 6. Metrics, the view, the monitor.
        self.metrics = MetricsWriter(options.metrics_file, self.peer_id)
        self._closers.append(self.metrics.close)
        self.status = NodeStatus(peer_id=self.peer_id, run_id=config.run_id, max_rounds=options.max_rounds)
        self.view = LiveView() if options.ui else PlainView()
        self.monitor = PeerMonitor(self.dht, config.run_id, schedule=self.schedule, shared=self.shared,
                                   period=heartbeat, status=self._heartbeat, on_change=self._peers_changed)
        self._closers.insert(0, self.monitor.stop)
        self.last_eval: float | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def announce(self) -> None:
        extra = "" if self.config.run_id == "shoal-tiny" else f"--run-id {self.config.run_id}"
        print(f"peer {self.peer_id} listening on {' '.join(self.maddrs)}", flush=True)
        print(f"to join: {format_join_command(self.maddrs, extra)}", flush=True)
        self.metrics.write("start", run_id=self.config.run_id, maddrs=self.maddrs, device=str(self.device),
                           parameters=count_parameters(self.trainer.model), shard=self.shard,
                           config_hash=shared_hash(self.shared), schedule_start=self.schedule.start_time)
        logger.info(f"peer {self.peer_id}: {count_parameters(self.trainer.model):,} parameters on {self.device}, "
                    f"shard {self.shard}/{self.config.data.num_shards}, round length {self.config.round.seconds}s")

    def train(self) -> int:
        self.announce()
        self._initial_sync()
        self.monitor.start()
        self.view.start()
        self._closers.insert(0, self.view.stop)
        round = max(1, self.monitor.schedule.round_at(time.time()))
        max_rounds = self.options.max_rounds
        while not self.stop.is_set() and (max_rounds is None or round <= max_rounds):
            self._run_round(round)
            round = max(round + 1, self.monitor.schedule.round_at(time.time()))
        return 0

    def _initial_sync(self) -> None:
        """Joining a run in progress: start from the swarm's current anchor, not from the init.

        Runs before the monitor thread starts, so this thread is still the DHT's only user.
        """
        if not self.options.initial_peers:
            return
        self.monitor.tick()
        donors = sorted((p for p in self.monitor.peers if p != self.peer_id),
                        key=lambda p: -self.monitor.peers[p].get("round", 0))
        if not donors:
            return
        started = time.perf_counter()
        state = self.worker.download_state(donors, timeout=self.config.averaging.allreduce_timeout)
        if state is None:
            logger.warning("could not download the swarm's state; starting from the initial weights")
            return
        try:
            adopted = self.outer.adopt(state)
        except MessageError as e:
            self.metrics.write("error", round=0, kind="state_download", message=str(e))
            return
        self.trainer.load_anchor(self.outer.anchor)
        seconds = time.perf_counter() - started
        logger.info(f"joined at round {adopted}: downloaded the shared state from {state.peer} in {seconds:.1f}s")
        self.metrics.write("state_download", source=state.peer, adopted_round=adopted, seconds=seconds)

    def close(self, reason: str) -> None:
        """Leave: save the shared state, then shut everything down (each step best-effort)."""
        self.status.phase = "leaving"
        self.view.update(self.status)
        if self.options.checkpoint_dir is not None and self.outer.rounds_done > 0:
            try:
                self.save_checkpoint()
            except Exception as e:  # noqa: BLE001 - leaving must go on
                logger.error(f"final checkpoint failed: {e}")
        self.metrics.write("exit", reason=reason, rounds_done=self.outer.rounds_done, round=self.outer.last_round)
        self._run_closers()

    def _run_closers(self) -> None:
        closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except Exception as e:  # noqa: BLE001
                logger.warning(f"shutdown step {getattr(close, '__qualname__', close)} failed: {e!r}")
        if self._sockets_before is not None:  # after every hivemind process has ended
            remove_stale(hivemind_sockets() - self._sockets_before)

    # -- one round -------------------------------------------------------------------------
    def _run_round(self, round: int) -> None:
        schedule = self.monitor.schedule
        deadline, round_started = schedule.round_end(round), time.time()
        # Matchmaking starts now so the group is formed when the round ends; the report
        # carries the fingerprint of the anchor everybody should share.
        self.worker.prepare(round=round, scheduled_time=deadline,
                            gather=self.outer.round_report(round=round).encode())
        self.status.round, self.status.phase = round, "training"
        self.status.round_start, self.status.round_end = schedule.round_start(round), deadline

        # 1. Inner steps until the next one would overrun the deadline.
        timer, steps, tokens, compute_s, loss_sum = StepTimer(), 0, 0, 0.0, 0.0
        batch_tokens = self.config.data.batch_size * self.config.model.seq_len
        while not self.stop.is_set() and timer.fits_before(deadline):
            t0 = time.perf_counter()
            x, y = self.sampler.next_batch()
            lr = inner_lr(self.config.inner, schedule.progress(time.time()))
            loss = float(self.trainer.inner_step(x, y, lr))  # reading the loss syncs the device: honest timing
            dt = time.perf_counter() - t0
            timer.add(dt)
            steps, tokens, compute_s, loss_sum = steps + 1, tokens + batch_tokens, compute_s + dt, loss_sum + loss
            self.status.loss, self.status.tokens_per_s = loss, tokens / max(compute_s, 1e-9)
            self.view.update(self.status)
        if self.stop.is_set():
            return

        # 2. Average the pseudo-gradient with the group (blocking in this mode).
        self.status.phase = "averaging"
        self.view.update(self.status)
        pseudo_grad = self.trainer.pseudo_gradient(self.outer.anchor, out=self.pseudo_grad)
        wait_started = time.perf_counter()
        result = self.worker.begin_sync(round=round, pseudo_grad=pseudo_grad, weight=float(tokens)).result()
        wait_s = time.perf_counter() - wait_started

        # 3. Outer step (averaged, or local if the round failed), consistency check, re-sync.
        conclusion = self.outer.conclude(result.outcome, pseudo_grad, round=round, averaged=result.averaged,
                                         self_id=self.peer_id)
        if conclusion.error:
            logger.warning(f"round {round}: {conclusion.error}")
            self.metrics.write("error", round=round, kind="averaging", message=conclusion.error)
        if conclusion.donors:
            self._resync(round, conclusion, result.averaged)
        self.trainer.load_anchor(self.outer.anchor)

        # 4. Eval, metrics, checkpoint.
        if round % self.config.train.eval_every_rounds == 0:
            self.last_eval = self.trainer.evaluate(self.eval_set)
        mean_loss = loss_sum / steps if steps else None
        self.metrics.write("round", **round_record_fields(
            round=round, group_size=conclusion.group_size, inner_steps=steps, tokens=tokens,
            compute_s=compute_s, wait_s=wait_s, sync_s=result.outcome.sync_s,
            wall_s=time.time() - round_started, loss=mean_loss, eval_loss=self.last_eval,
            applied=conclusion.applied, group=list(result.outcome.group), peers=self.monitor.peer_count,
            rounds_done=self.outer.rounds_done, lr=inner_lr(self.config.inner, schedule.progress(time.time())),
            diverged=sorted(conclusion.verdict.diverged) if conclusion.verdict else [],
            bad_reports=conclusion.bad_reports,
        ))
        self.status.eval_loss, self.status.group_size = self.last_eval, conclusion.group_size
        self.status.sync_s, self.status.rounds_done = result.outcome.sync_s, self.outer.rounds_done
        self.status.last_sync = conclusion.applied if not conclusion.error else f"{conclusion.applied} (failed)"
        self.status.peers = self.monitor.peer_count
        self.view.round_done(self.status)
        if self.options.checkpoint_dir is not None and round % self.config.train.checkpoint_every_rounds == 0:
            self.save_checkpoint()

    def _resync(self, round: int, conclusion: RoundConclusion, averaged: torch.Tensor | None) -> None:
        """Our anchor disagrees with the group's: take the state of a peer that agrees."""
        self.status.phase = "resyncing"
        self.view.update(self.status)
        logger.warning(f"round {round}: our anchor diverged from the group's; re-syncing from {conclusion.donors}")
        adopted = None
        for _ in range(RESYNC_ATTEMPTS):
            state = self.worker.download_state(conclusion.donors, timeout=self.config.averaging.allreduce_timeout)
            if state is None:
                continue
            try:
                adopted = self.outer.adopt(state)
            except MessageError as e:
                self.metrics.write("error", round=round, kind="resync", message=str(e))
                continue
            if adopted >= round:
                break
            time.sleep(0.2)  # the donor has not applied this round's outer step yet
        if adopted is not None and adopted < round and averaged is not None:
            self.outer.apply(averaged, round=round)  # catch the donor's state up to this round
        self.metrics.write("resync", round=round, donors=conclusion.donors, ok=adopted is not None,
                           adopted_round=adopted)

    # -- helpers ---------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        params = dict(self.layout.views(self.outer.anchor))
        outer_state = {f"momentum.{k}": v for k, v in self.layout.views(self.outer.momentum).items()}
        path = save_checkpoint(self.options.checkpoint_dir, round=self.outer.last_round, params=params,
                               outer_state=outer_state,
                               meta={"run_id": self.config.run_id, "peer": self.peer_id,
                                     "rounds_done": self.outer.rounds_done, "config_hash": shared_hash(self.shared)})
        self.metrics.write("checkpoint", round=self.outer.last_round, path=str(path))
        return path

    def _heartbeat(self) -> dict:
        s = self.status
        return {"round": int(s.round), "loss": s.loss, "tokens_per_s": float(s.tokens_per_s), "device": str(self.device)}

    def _peers_changed(self, joined: set[str], left: set[str]) -> None:
        for peer in sorted(joined - {self.peer_id}):
            self.metrics.write("peer_join", other=peer, peers=self.monitor.peer_count)
        for peer in sorted(left):
            self.metrics.write("peer_leave", other=peer, peers=self.monitor.peer_count)
        self.status.peers = self.monitor.peer_count
        self.view.update(self.status)
