"""One shoal peer: build everything, train round after round, leave cleanly.

Phases (``Node.__init__``): 1. device check, model and data on the CPU, 2. the swarm (DHT,
run record, averager: forked processes, so before CUDA and before our threads), 3. the model on
its device, 4. metrics and the view. ``Node.train`` runs inner steps and hands each one to the
swarm (``node.api.DiLoCoSwarm``, the same API library users get); ``Node.close`` always runs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from averaging.outer_loop import RoundStats
from node.api import DiLoCoSwarm
from node.checkpoint import save_checkpoint
from node.config import RunConfig, shared_fields, shared_hash
from node.data import BatchSampler, eval_batches, load_corpus, shard_bounds, shard_for_peer, split_corpus
from node.download_view import DownloadLog
from node.exporter import MetricsExporter
from node.metrics import MetricsWriter, round_record_fields
from node.model import build_model, count_parameters
from node.resume import MOMENTUM_PREFIX, find_resume_point, outer_meta, state_from_checkpoint
from node.trainer import Trainer, device_label, inner_lr, resolve_device
from node.ui import LiveView, NodeStatus, PlainView
from protocols.addresses import format_join_command
from protocols.errors import CheckpointError
from protocols.messages import MessageError

logger = logging.getLogger(__name__)


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
    identity: Path | None = None
    client_mode: bool = False
    use_relay: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


class Node:
    def __init__(self, config: RunConfig, options: NodeOptions, stop: threading.Event):
        self.config, self.options, self.stop = config, options, stop
        self.swarm: DiLoCoSwarm | None = None
        self.metrics: MetricsWriter | None = None
        self.exporter: MetricsExporter | None = None
        self._exported_at = 0.0
        self.view = LiveView() if options.ui else PlainView()
        self.status = NodeStatus(run_id=config.run_id, max_rounds=options.max_rounds)
        try:
            self._build()
        except BaseException:
            if self.swarm is not None:
                self.swarm.close()  # a failed start must not leave a DHT or an averager behind
            raise

    def _build(self) -> None:
        config, options = self.config, self.options
        # 1. Fail on an unusable --device before starting any network process; model and data.
        if config.train.torch_threads:
            torch.set_num_threads(config.train.torch_threads)
        self.device = resolve_device(config.train.device)
        model = build_model(config.model, seed=config.train.seed)  # every peer starts from these weights
        split = split_corpus(load_corpus(config.data), config.data.eval_fraction, config.data.max_eval_bytes)

        # 2. The swarm: DHT, run record, averager (forks), monitor, round engine.
        self.shared = shared_fields(config)
        self.swarm = DiLoCoSwarm(
            model, run_id=config.run_id, outer=config.outer, averaging=config.averaging, rounds=config.round,
            initial_peers=options.initial_peers, listen=options.listen, announce=options.announce,
            bootstrap_timeout=options.bootstrap_timeout, identity=options.identity, client_mode=options.client_mode,
            use_relay=options.use_relay, shared=self.shared, device=self.device,
            heartbeat=self._heartbeat, on_peers_changed=self._peers_changed,
        )
        self.peer_id = self.swarm.peer_id

        # 3. The model on its device, and the data this peer trains on (its own shard).
        self.trainer = Trainer(model, config.inner, config.train, self.device)
        self.shard = shard_for_peer(self.peer_id, config.data.num_shards)
        lo, hi = shard_bounds(len(split.train), config.data.num_shards, self.shard)
        self.sampler = BatchSampler(split.train[lo:hi], config.model.seq_len, config.data.batch_size,
                                    seed=int.from_bytes(self.swarm.dht.peer_id.to_bytes()[-8:], "big"))
        self.eval_set = eval_batches(split.eval, config.model.seq_len, config.data.batch_size,
                                     config.train.eval_batches)

        # 4. Metrics and the view.
        self.metrics = MetricsWriter(options.metrics_file, self.peer_id)
        self.status.peer_id = self.peer_id
        self.device_label = device_label(self.device)
        self.status.device = self.device_label
        self.last_eval: float | None = None
        self._eval_s = 0.0  # how long the last eval took

        # 5. Resume from the newest valid checkpoint, if any (the swarm may still be newer: start()).
        if options.checkpoint_dir is not None:
            self._resume(options.checkpoint_dir)

        # 6. The optional Prometheus endpoint and liveness probe (last: nothing after it can fail).
        if options.metrics_port is not None:
            self.exporter = MetricsExporter(host=options.metrics_host, port=options.metrics_port,
                                            peer_id=self.peer_id, run_id=config.run_id)
            self.exporter.touch()

    def _resume(self, checkpoint_dir: Path) -> None:
        def broken(error: CheckpointError) -> None:
            logger.error(f"{error}; trying the next older one")
            self.metrics.write("error", kind="checkpoint", message=str(error))

        checkpoint = find_resume_point(checkpoint_dir, on_invalid=broken)
        if checkpoint is None:
            return
        state = state_from_checkpoint(checkpoint, self.swarm.layout, run_id=self.config.run_id,
                                      config_hash=shared_hash(self.shared))
        try:
            resumed = self.swarm.resume(state)
        except MessageError as e:
            raise CheckpointError(f"checkpoint {checkpoint.path} holds an invalid state ({e}); delete it or use "
                                  "an older checkpoint") from None
        logger.info(f"resumed from {checkpoint.path} (round {resumed})")
        self.metrics.write("resume", path=str(checkpoint.path), round=resumed)

    # -- lifecycle -------------------------------------------------------------------------
    def announce(self) -> None:
        maddrs = self.swarm.maddrs
        extra = "" if self.config.run_id == "shoal-tiny" else f"--run-id {self.config.run_id}"
        reachability = self.swarm.reachability
        if reachability.client_mode:
            print(f"peer {self.peer_id} in {reachability.describe(maddrs)}", flush=True)
        else:
            print(f"peer {self.peer_id} listening on {' '.join(maddrs)}", flush=True)
            print(f"to join: {format_join_command(maddrs, extra)}", flush=True)
            logger.info(f"reachability: {reachability.describe(maddrs)}")
        parameters = count_parameters(self.trainer.model)
        self.metrics.write("start", run_id=self.config.run_id, maddrs=maddrs, device=str(self.device),
                           parameters=parameters, shard=self.shard, config_hash=shared_hash(self.shared),
                           schedule_start=self.swarm.schedule.start_time, sync_mode=self.config.round.sync_mode,
                           throttle=self.config.train.throttle, mode=reachability.mode)
        if self.exporter is not None:
            logger.info(f"metrics on {self.exporter.url}/metrics, liveness on {self.exporter.url}/healthz")
        logger.info(f"peer {self.peer_id}: {parameters:,} parameters on {self.device}, shard "
                    f"{self.shard}/{self.config.data.num_shards}, {self.config.round.sync_mode} sync, "
                    f"rounds of {self.config.round.seconds:g}s")

    def train(self) -> int:
        self.announce()
        # A joiner downloads the swarm's state first: the panel (or log lines) shows how far along.
        download = DownloadLog()
        self.status.phase = "joining"
        self.view.start()

        def progress(done: int, total: int) -> None:  # the sync worker's thread
            if self.options.ui:
                self.status.download_fraction = done / max(total, 1)
                self.view.update(self.status)
            else:
                download(done, total)
            if self.exporter is not None:
                self.exporter.touch()  # a long download is not a hung node

        joined = self.swarm.start(progress=progress)
        self.status.download_fraction, self.status.phase = None, "training"
        if joined is not None:
            self.metrics.write("state_download", adopted_round=joined["round"], seconds=joined["seconds"],
                               donors=joined["donors"], bytes=joined["bytes"])
        batch_tokens = self.config.data.batch_size * self.config.model.seq_len
        throttle, max_rounds = self.config.train.throttle, self.options.max_rounds
        while not self.stop.is_set() and (max_rounds is None or self.swarm.round <= max_rounds):
            started = time.perf_counter()
            x, y = self.sampler.next_batch()
            lr = inner_lr(self.config.inner, self.swarm.progress())
            loss = float(self.trainer.inner_step(x, y, lr))  # reading the loss syncs the device: honest timing
            if throttle > 1:
                time.sleep((throttle - 1) * (time.perf_counter() - started))  # a slower GPU, counted as compute
            for stats in self.swarm.step(tokens=batch_tokens, seconds=time.perf_counter() - started, loss=loss):
                self._round_finished(stats)
            self._update_status(loss)
        for stats in self.swarm.finish():
            self._round_finished(stats)
        return 0

    def close(self, reason: str) -> None:
        """Leave: save the shared state, then shut everything down (each step best-effort)."""
        self.status.phase = "leaving"
        if self.options.max_rounds is not None:  # the loop stepped into the round after the last one
            self.status.round = min(self.status.round, self.options.max_rounds)
        self.view.update(self.status)
        if self.swarm is not None and self.options.checkpoint_dir is not None and self.swarm.outer.rounds_done > 0:
            try:
                self.save_checkpoint()
            except Exception as e:  # noqa: BLE001 - leaving must go on
                logger.error(f"final checkpoint failed: {e}")
        if self.metrics is not None:
            outer = self.swarm.outer
            self.metrics.write("exit", reason=reason, rounds_done=outer.rounds_done, round=outer.last_round)
        self.view.stop()
        if self.exporter is not None:
            self.exporter.close()
        if self.swarm is not None:
            self.swarm.close()
        if self.metrics is not None:
            self.metrics.close()

    # -- rounds ----------------------------------------------------------------------------
    def _round_finished(self, stats: RoundStats) -> None:
        if stats.error:
            alone = self.swarm.peer_count <= 1  # nobody to average with: expected, not a warning
            logger.log(logging.INFO if alone else logging.WARNING,
                       f"round {stats.round}: {'alone in the swarm, kept the local update' if alone else stats.error}")
            self.metrics.write("error", round=stats.round, kind="averaging", message=stats.error)
        if stats.resynced:
            self.metrics.write("resync", round=stats.round, diverged=stats.diverged)
        evaluated = stats.round % self.config.train.eval_every_rounds == 0 and self._eval_fits()
        if evaluated:
            started = time.perf_counter()
            self.last_eval = self.trainer.evaluate_anchor(self.swarm.layout.views(self.swarm.outer.anchor), self.eval_set)
            self._eval_s = time.perf_counter() - started
        record = self.metrics.write("round", **round_record_fields(
            round=stats.round, group_size=stats.group_size, inner_steps=stats.inner_steps, tokens=stats.tokens,
            compute_s=stats.compute_s, wait_s=stats.wait_s, sync_s=stats.sync_s, wall_s=stats.wall_s,
            loss=stats.loss, eval_loss=self.last_eval if evaluated else None, applied=stats.applied, group=stats.group,
            peers=self.swarm.peer_count, rounds_done=stats.rounds_done, diverged=stats.diverged,
            bad_reports=stats.bad_reports, allreduce_s=stats.allreduce_s, lr=inner_lr(self.config.inner, self.swarm.progress()),
        ))
        if self.exporter is not None:
            self.exporter.observe_round(record)
        self.status.eval_loss, self.status.group_size, self.status.sync_s = self.last_eval, stats.group_size, stats.sync_s
        if stats.applied == "averaged" and stats.allreduce_s > 0:
            self.status.sync_bytes_per_s = self.swarm.allreduce_payload(stats.group_size) / stats.allreduce_s
        if stats.compute_s > 0:  # the finished round's rate (the live figure restarts with the next window)
            self.status.tokens_per_s = stats.tokens / stats.compute_s
        self.status.rounds_done, self.status.finished_round = stats.rounds_done, stats.round
        self.status.last_sync = stats.applied if not stats.error else f"{stats.applied} (failed)"
        self.view.round_done(self.status)
        if self.options.checkpoint_dir is not None and stats.round % self.config.train.checkpoint_every_rounds == 0:
            self.save_checkpoint()

    def _eval_fits(self) -> bool:
        """Eval runs on the training thread: skip it (the record's eval_loss is null) when it would
        push this round's snapshot past its deadline, which would make a slow peer miss rounds."""
        deadline = self.swarm.monitor.schedule.round_end(self.swarm.round)
        return time.time() + 2 * self._eval_s <= deadline

    def _update_status(self, loss: float) -> None:
        window, schedule, swarm = self.swarm.loop.window, self.swarm.monitor.schedule, self.swarm
        if swarm.utilization is not None:
            self.status.utilization = swarm.utilization
        self.status.bytes_sent, self.status.bytes_received = swarm.traffic.sent, swarm.traffic.received
        self.status.peer_records = tuple(swarm.monitor.peers.values())  # the monitor swaps the dict whole
        if self.exporter is not None and time.monotonic() - self._exported_at >= 1.0:
            self._exported_at = time.monotonic()
            self.exporter.update(round=window.round, loss=loss, peers=swarm.peer_count,
                                 bytes_sent=swarm.traffic.sent, bytes_received=swarm.traffic.received)
        self.status.round, self.status.loss, self.status.peers = window.round, loss, self.swarm.peer_count
        self.status.tokens_per_s = window.tokens / max(window.compute_s, 1e-9)
        self.status.phase = "training" if not self.swarm.loop.syncing else "training + averaging"
        self.status.round_start, self.status.round_end = schedule.round_start(window.round), schedule.round_end(window.round)
        self.view.update(self.status)

    # -- helpers ---------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        layout = self.swarm.layout
        metadata, (anchor, momentum) = self.swarm.outer.shared_state()  # one consistent copy
        params = dict(layout.views(anchor))
        outer_state = {f"{MOMENTUM_PREFIX}{k}": v for k, v in layout.views(momentum).items()}
        path = save_checkpoint(self.options.checkpoint_dir, round=metadata["round"], params=params,
                               outer_state=outer_state,
                               meta={"run_id": self.config.run_id, "peer": self.peer_id,
                                     "rounds_done": metadata["rounds_done"], "config_hash": shared_hash(self.shared),
                                     "outer": outer_meta(metadata)})
        self.metrics.write("checkpoint", round=metadata["round"], path=str(path))
        return path

    def _heartbeat(self) -> dict:
        """Our figures for the progress record (monitor thread; reads a status the loop replaces)."""
        s = self.status
        finite = lambda v: v if v is not None and math.isfinite(v) and v >= 0 else None  # noqa: E731
        return {"loss": finite(s.loss), "eval_loss": finite(s.eval_loss), "tokens_per_s": float(s.tokens_per_s),
                "device": self.device_label, "phase": s.phase[:64]}

    def _peers_changed(self, joined: set[str], left: set[str]) -> None:
        if self.metrics is None:
            return
        count = self.swarm.peer_count if self.swarm else 1
        for peer in sorted(joined - {self.status.peer_id}):
            self.metrics.write("peer_join", other=peer, peers=count)
        for peer in sorted(left):
            self.metrics.write("peer_leave", other=peer, peers=count)
        self.status.peers = count
