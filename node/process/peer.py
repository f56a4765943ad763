"""One ``shoal run`` process: build everything, train round after round, leave cleanly.

``run_peer`` is the whole lifecycle (uvicorn's shape): install the Ctrl+C handling, build a
``Peer``, train until ``--max-rounds`` or Ctrl+C, and always close. A ``Peer`` composes the
other layers and reaches the swarm only through the library's public surface
(``node.api.DiLoCoSwarm``, the same class library users get): training (model, data, inner
AdamW) on one side, observation (live view, metrics file, Prometheus exporter) on the other.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import torch

from node.api import (
    Applied,
    DiLoCoSwarm,
    Heartbeat,
    InnerStateSync,
    Network,
    RoundStats,
    choose_shard,
    round_advice,
)
from node.library.checkpoint import list_checkpoints
from node.library.rediscovery import ReunionWatch
from node.observe.download_log import DownloadLog
from node.observe.experiment_log import ExperimentLog, open_experiment_logs
from node.observe.exporter import MetricsExporter
from node.observe.metrics import MetricsWriter, RoundRecord
from node.observe.ui import LiveView, NodeStatus, PlainView
from node.process.config import RunConfig, shared_fields
from node.process.options import PeerOptions
from node.process.signals import Interrupts
from node.training.data import seed_for_peer
from node.training.export import RUN_CONFIG_KEY, TOKENIZER_COPY, run_config_meta
from node.training.model import build_model, count_parameters, model_fingerprint
from node.training.sources import open_source
from node.training.trainer import Trainer, device_label, inner_lr, muon_params, resolve_device
from protocols import swarm_time
from protocols.addresses import format_join_command
from protocols.errors import CheckpointError, ConfigError, ProcessDied, ShoalError
from protocols.identity import format_run_key

logger = logging.getLogger(__name__)

DEFAULT_RUN_ID = "shoal-tiny"  # the join line omits --run-id for the default run


def run_peer(config: RunConfig, options: PeerOptions, *, stop: threading.Event | None = None,
             handle_signals: bool = True, network: Network | None = None) -> str:
    """Build a peer, train, and always leave cleanly; returns why it ended (``max_rounds`` or
    ``interrupted``). The user's mistakes raise ``ShoalError`` (after leaving); anything else is
    a bug and propagates with its traceback."""
    stop = stop if stop is not None else threading.Event()
    interrupts = Interrupts(stop) if handle_signals else None
    if interrupts is not None:
        interrupts.install()
    peer, reason = None, "crash"
    try:
        peer = Peer(config, options, stop, network=network)
        if interrupts is not None:
            interrupts.install()  # hivemind's averager set SIGINT to ignored when it started
        peer.train()
        reason = "interrupted" if stop.is_set() else "max_rounds"
        return reason
    except ShoalError:
        reason = "error"
        raise
    finally:
        if peer is not None:
            peer.close(reason)


class Peer:
    """The process's parts, built in the order hivemind needs (its forks before CUDA and threads)."""

    def __init__(self, config: RunConfig, options: PeerOptions, stop: threading.Event, *,
                 network: Network | None = None):
        """``network``: default hivemind's, from ``options``; an in-process one in tests."""
        self.config, self.options, self.stop = config, options, stop
        self.swarm: DiLoCoSwarm | None = None
        self.metrics: MetricsWriter | None = None
        self.experiment: ExperimentLog | None = None
        self.exporter: MetricsExporter | None = None
        self._exported_at = 0.0
        self.view = LiveView() if options.ui else PlainView()
        self.status = NodeStatus(run_id=config.run_id, max_rounds=options.max_rounds)
        self.last_eval: float | None = None
        self._eval_s = 0.0  # how long the last eval took
        self._reunion = ReunionWatch()  # a split swarm meeting again (the ``reunion`` event)
        self._checkpoint_failing = False  # the last periodic checkpoint could not be written
        self._processes_checked = 0.0  # when _check_processes last looked
        try:
            model = self._build_local()
            self._join(model, network)
            self._build_training(model)
            self._build_observers()
            if options.checkpoint_dir is not None:
                self._resume(options.checkpoint_dir)
            self._build_exporter()  # last: nothing after it can fail
        except BaseException:
            if self.swarm is not None:
                self.swarm.close()  # a failed start must not leave a DHT or an averager behind
            if self.metrics is not None:
                self.metrics.close()
            if self.experiment is not None:
                self.experiment.close()
            raise

    # -- building ------------------------------------------------------------------------------
    def _build_local(self):
        """What needs no network: an unusable --device fails here, before any network process;
        the model (on the CPU: every peer starts from the same weights) and the corpus split."""
        config = self.config
        if config.train.torch_threads:
            torch.set_num_threads(config.train.torch_threads)
        self.device = resolve_device(config.train.device)
        self.source = source = open_source(config.data)
        self.vocab_size = self._vocab_size(source.vocab_size)
        model = build_model(config.model, seed=config.train.seed, vocab_size=self.vocab_size)
        # What every peer must agree on: the config's fields, the tokenizer, and (unless the run allows
        # other text) the corpus; a pretrained init's weights by their hash (their path is this machine's).
        self.shared = {**shared_fields(config, vocab_size=self.vocab_size), **source.fingerprint()}
        if config.model.init:
            self.shared["model.init_sha256"] = model_fingerprint(model)
        return model

    def _vocab_size(self, tokenizer_vocab: int) -> int:
        """The embedding rows: the tokenizer's for an hf model (unless [model.hf] pins more); for the
        byte GPT, model.vocab_size, which must hold every id the tokenizer gives."""
        model = self.config.model
        if model.kind == "gpt" and model.vocab_size < tokenizer_vocab:
            raise ConfigError(f"model.vocab_size ({model.vocab_size}) is below the tokenizer's vocabulary "
                              f"({tokenizer_vocab}, data.tokenizer = {self.config.data.tokenizer!r}); set "
                              f"model.vocab_size = {tokenizer_vocab}")
        return model.vocab_size if model.kind == "gpt" else tokenizer_vocab

    def _join(self, model: torch.nn.Module, network: Network | None) -> None:
        """The swarm: DHT, run record, averager (forked processes), peer monitor, round engine."""
        config, options = self.config, self.options
        # The moments that ride the all-reduce, planned before the optimizers exist (bound in _build_training).
        self.inner_sync = InnerStateSync(model, muon=muon_params(model) if config.inner.optimizer == "muon" else []) \
            if config.averaging.average_inner_state else None
        self.swarm = DiLoCoSwarm(
            model, run_id=config.run_id, outer=config.outer, averaging=config.averaging, rounds=config.round,
            initial_peers=options.initial_peers, listen=options.listen, announce=options.announce,
            bootstrap_timeout=options.bootstrap_timeout, identity=options.identity, client_mode=options.client_mode,
            use_relay=options.use_relay, shared=self.shared, device=self.device,
            heartbeat=self._heartbeat, on_peers_changed=self._peers_changed, network=network,
            run_key=options.run_key, swarm_key=options.swarm_key, trust_dir=options.checkpoint_dir,
            inner_state=self.inner_sync,
        )
        self.peer_id = self.swarm.peer_id

    def _build_training(self, model: torch.nn.Module) -> None:
        """The model on its device with its inner optimizer, and this peer's shard of the data."""
        config = self.config
        self.trainer = Trainer(model, config.inner, config.train, self.device)
        if self.inner_sync is not None:
            self.inner_sync.bind(self.trainer.optimizers)
        self.shard = choose_shard(config.data.num_shards, self.peer_id, {}, None)  # revised once we see the swarm
        self.sampler = self.source.sampler(self.shard, config.model.seq_len, config.data.batch_size,
                                           seed=seed_for_peer(self.peer_id))
        self.eval_set = self.source.eval_set(config.model.seq_len, config.data.batch_size, config.train.eval_batches)
        self._run_config_meta = {RUN_CONFIG_KEY: run_config_meta(config.model, self.source.tokenizer_spec,
                                                                 self.vocab_size)}

    def _build_observers(self) -> None:
        # TensorBoard / W&B get every record the metrics file gets (`event("round", ...)` is a round).
        self.experiment = open_experiment_logs(self.options.tensorboard, self.options.wandb_project,
                                               self.peer_id, self.config.run_id)
        self.experiment.start(self.shared)
        forward = (lambda record: self.experiment.event(record["event"], record))  # noqa: E731
        self.metrics = MetricsWriter(self.options.metrics_file, self.peer_id, forward=forward)
        self.device_label = device_label(self.device)
        self.status.peer_id, self.status.device = self.peer_id, self.device_label

    def _build_exporter(self) -> None:
        """The optional Prometheus endpoint and liveness probe (``--metrics-port``)."""
        if self.options.metrics_port is None:
            return
        self.exporter = MetricsExporter(host=self.options.metrics_host, port=self.options.metrics_port,
                                        peer_id=self.peer_id, run_id=self.config.run_id)
        self.exporter.touch()

    def _resume(self, checkpoint_dir: Path) -> None:
        """Start from the newest valid checkpoint, if any (the swarm may still be newer: ``start``)."""
        def broken(error: CheckpointError) -> None:
            logger.error(f"{error}; trying the next older one")
            self.metrics.write("error", kind="checkpoint", message=str(error))

        self._keep_tokenizer(checkpoint_dir)
        resumed = self.swarm.resume_from_checkpoints(checkpoint_dir, on_invalid=broken)
        if resumed is None:
            return
        inner = bool(resumed.local_state)
        if inner:
            try:
                self.trainer.load_inner_state(resumed.local_state)
            except CheckpointError as e:  # e.g. written under another inner.optimizer: the model is what counts
                logger.warning(f"{e}; the inner optimizer starts fresh, the shared model is resumed")
                inner = False
        logger.info(f"resumed from {resumed.path} (round {resumed.round}{', with the inner optimizer' if inner else ''})")
        self.metrics.write("resume", path=str(resumed.path), round=resumed.round, inner_optimizer=inner)

    def _keep_tokenizer(self, checkpoint_dir: Path) -> None:
        """A copy of the run's tokenizer in ``<checkpoint-dir>/tokenizer``: the checkpoints then carry
        all that `shoal export` and `shoal sample` need, on a machine without data.tokenizer's path."""
        if self.source.tokenizer is None:
            return
        try:
            self.source.tokenizer.save(Path(checkpoint_dir) / TOKENIZER_COPY)
        except OSError as e:  # a full disk costs the copy, never the run
            logger.warning(f"could not keep a copy of the tokenizer in {checkpoint_dir}: {e.strerror or e}")

    # -- lifecycle -----------------------------------------------------------------------------
    def announce(self) -> None:
        """Tell the user how to reach this peer, and write the ``start`` record."""
        swarm, config = self.swarm, self.config
        maddrs, reachability = swarm.maddrs, swarm.reachability
        if reachability.client_mode:
            print(f"peer {self.peer_id} in {reachability.describe(maddrs)}", flush=True)
        elif not maddrs:  # an in-process network (tests): nothing to dial
            print(f"peer {self.peer_id} has no address others can dial", flush=True)
        else:
            extra = "" if config.run_id == DEFAULT_RUN_ID else f"--run-id {config.run_id}"
            if swarm.manifest.organiser:  # joiners follow only the schedule this key signed
                extra = f"{extra} --run-key {format_run_key(swarm.manifest.organiser)}"
            if self.options.swarm_key is not None:
                extra = f"{extra} --swarm-key FILE"
            print(f"peer {self.peer_id} listening on {' '.join(maddrs)}", flush=True)
            print(f"to join: {format_join_command(maddrs, extra)}", flush=True)
            logger.info(f"reachability: {reachability.describe(maddrs)}")
        parameters = count_parameters(self.trainer.model)
        self.metrics.write("start", run_id=config.run_id, maddrs=maddrs, device=str(self.device),
                           parameters=parameters, shard=self.shard, config_hash=swarm.manifest.config_hash,
                           schedule_start=swarm.schedule.start_time, sync_mode=config.round.sync_mode,
                           throttle=config.train.throttle, mode=reachability.mode, processes=swarm.processes)
        if self.exporter is not None:
            logger.info(f"metrics on {self.exporter.url}/metrics, liveness on {self.exporter.url}/healthz")
        logger.info(f"peer {self.peer_id}: {parameters:,} parameters on {self.device}, shard "
                    f"{self.shard}/{config.data.num_shards}, {config.round.sync_mode} sync, "
                    f"rounds of {config.round.seconds:g}s")

    def train(self) -> None:
        self.announce()
        self._catch_up()
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
            self._check_processes()
        for stats in self.swarm.finish():
            self._round_finished(stats)

    def _check_processes(self) -> None:
        """Once a second: our DHT, averager and p2pd still run. One killed (an out-of-memory kill,
        a stray ``kill``) leaves a peer that trains but can never average again, and whose round
        records would say only "could not find a group": leave instead, with one line (the shared
        model is checkpointed on the way out)."""
        now = time.monotonic()
        if now - self._processes_checked < 1.0:
            return
        self._processes_checked = now
        if (dead := self.swarm.dead_process()) is not None:
            saved = (f"it leaves now, saving the shared model (round {self.swarm.last_round}) to "
                     f"{self.options.checkpoint_dir}; " if self.options.checkpoint_dir is not None and self.swarm.rounds_done
                     else "it leaves now; ")
            self.metrics.write("error", kind="process", message=dead)
            raise ProcessDied(f"this peer's {dead}, so it can no longer average; {saved}start shoal run again "
                              "(with the same --checkpoint-dir and --identity to resume); if it keeps happening, "
                              "look for an out-of-memory kill (dmesg)")

    def _catch_up(self) -> None:
        """A joiner downloads the swarm's state first: the panel (or log lines) shows how far along."""
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
        self._claim_shard()  # a joiner has seen the swarm's records by now
        self.status.download_fraction, self.status.phase = None, "training"
        if joined is not None:
            self.metrics.write("state_download", adopted_round=joined["round"], seconds=joined["seconds"],
                               donors=joined["donors"], bytes=joined["bytes"], replayed=joined.get("replayed", 0))

    def close(self, reason: str) -> None:
        """Leave: save the shared state, then shut everything down (each step best-effort)."""
        self.status.phase = "leaving"
        if self.options.max_rounds is not None:  # the loop stepped into the round after the last one
            self.status.round = min(self.status.round, self.options.max_rounds)
        self.view.update(self.status)
        if self.options.checkpoint_dir is not None and self.swarm.rounds_done > 0:
            try:
                self.save_checkpoint()
            except Exception as e:  # noqa: BLE001 - leaving must go on
                logger.error(f"final checkpoint failed: {e}")
        self.metrics.write("exit", reason=reason, rounds_done=self.swarm.rounds_done, round=self.swarm.last_round)
        self.view.stop()
        if self.exporter is not None:
            self.exporter.close()
        self.swarm.close()
        self.metrics.close()
        self.experiment.close()

    # -- rounds --------------------------------------------------------------------------------
    def _round_finished(self, stats: RoundStats) -> None:
        self._report_problems(stats)
        self._claim_shard()
        evaluated = stats.round % self.config.train.eval_every_rounds == 0 and self._eval_fits()
        if evaluated:
            started = time.perf_counter()
            self.last_eval = self.trainer.evaluate_anchor(self.swarm.anchor_params(), self.eval_set)
            self._eval_s = time.perf_counter() - started
        record = RoundRecord(stats=stats, eval_loss=self.last_eval if evaluated else None,
                             peers=self.swarm.peer_count, lr=inner_lr(self.config.inner, self.swarm.progress()))
        self.metrics.write_round(record)
        if self.exporter is not None:
            self.exporter.observe_round(record)
        self._show_round(stats)
        if self.options.checkpoint_dir is not None and stats.round % self.config.train.checkpoint_every_rounds == 0:
            self._periodic_checkpoint(stats.round)

    def _claim_shard(self) -> None:
        """Move to the least-used shard if ours is shared while another has fewer peers."""
        claims = {r.peer_id: r.shard for r in self.swarm.present_peers}  # records that never meet us do not herd us
        shard = choose_shard(self.config.data.num_shards, self.peer_id, claims, self.shard)
        if shard == self.shard:
            return
        sampler = self.source.move(self.sampler, shard)
        if sampler is None:  # its tokens are being built in the background: ask again next round
            logger.info(f"preparing data shard {shard}/{self.config.data.num_shards} (tokenizing it in the background)")
            return
        sharing = sorted(p for p, s in claims.items() if s == self.shard and p != self.peer_id)
        logger.info(f"training on data shard {shard}/{self.config.data.num_shards} "
                    f"(shard {self.shard} is also trained by {', '.join(sharing) or 'nobody'})")
        self.metrics.write("shard", shard=shard, previous=self.shard, sharing=sharing)
        self.sampler, self.shard = sampler, shard

    def _report_problems(self, stats: RoundStats) -> None:
        if stats.error:
            alone = self.swarm.peer_count <= 1  # nobody to average with: expected, not a warning
            # Staying out of a round is a decision (the loop logged why), not a failure.
            logger.log(logging.INFO if alone or stats.skipped else logging.WARNING,
                       f"round {stats.round}: {'alone in the swarm, kept the local update' if alone else stats.error}")
            self.metrics.write("error", round=stats.round, kind="averaging", message=stats.error)
        if stats.resynced:
            self.metrics.write("resync", round=stats.round, diverged=stats.diverged)
        met = self._reunion.observe(round=stats.round, group_size=stats.group_size, applied=stats.applied,
                                    tokens=stats.tokens, resynced=stats.resynced, diverged=stats.diverged,
                                    folded=stats.lineage_merged, reunion=stats.lineage_reunion)
        if met is not None:
            self.metrics.write("reunion", **met)
            whole = (f"round {stats.round}: the swarm is whole again (a group of {met['group_size']} after "
                     f"{met['apart_rounds']} round(s) in groups of at most {met['apart_group_size']}); ")
            if met["kept"]:
                logger.info(whole + f"{len(met['rejoined'])} member(s) held another anchor and re-sync to ours")
            elif met["steps_merged"]:
                logger.info(whole + f"our side's anchor was replaced by the group's (re-sync); the {met['steps_merged']} "
                            "outer step(s) it took apart are merged into it through our next contribution")
            else:
                logger.warning(whole + "our side's anchor was replaced by the group's (re-sync): the "
                               f"{met['steps_dropped']} outer step(s) it took apart are not in the shared model "
                               "(we never averaged with the other side, so there was nothing to fold them against)")

    def _show_round(self, stats: RoundStats) -> None:
        status = self.status
        status.eval_loss, status.group_size, status.sync_s = self.last_eval, stats.group_size, stats.sync_s
        status.group_count = self.swarm.group_count
        status.round_bytes_sent, status.round_bytes_received = stats.bytes_sent, stats.bytes_received
        status.sync_advice = round_advice(self.swarm.sync_lateness, self.swarm.schedule.round_seconds)
        status.clock_advice = self.swarm.clock_advice
        for kind, count in stats.robust.items():
            status.robust[kind] = status.robust.get(kind, 0) + count
        if stats.applied == Applied.AVERAGED and stats.allreduce_s > 0:
            # the round's own payload (the inner optimizer's moments and sub-groups' state included)
            sent = stats.bytes_sent or self.swarm.allreduce_payload(stats.group_size)
            status.sync_bytes_per_s = sent / stats.allreduce_s
        if stats.compute_s > 0:  # the finished round's rate (the live figure restarts with the next window)
            status.tokens_per_s = stats.tokens / stats.compute_s
        status.rounds_done, status.finished_round = stats.rounds_done, stats.round
        status.last_sync = (stats.applied if not stats.error else
                            f"{stats.applied} (stayed out)" if stats.skipped else f"{stats.applied} (failed)")
        self.view.round_done(status)

    def _eval_fits(self) -> bool:
        """Eval runs on the training thread: skip it (the record's eval_loss is null) when it would
        push this round's snapshot past its deadline, which would make a slow peer miss rounds."""
        deadline = self.swarm.schedule.round_end(self.swarm.round)
        return swarm_time.now() + 2 * self._eval_s <= deadline

    def _update_status(self, loss: float) -> None:
        swarm, status = self.swarm, self.status
        live, schedule = swarm.live_round(), swarm.schedule
        if swarm.utilization is not None:
            status.utilization = swarm.utilization
        status.bytes_sent, status.bytes_received = swarm.bytes_sent, swarm.bytes_received
        status.peer_records = swarm.peers
        if self.exporter is not None and time.monotonic() - self._exported_at >= 1.0:
            self._exported_at = time.monotonic()
            self.exporter.update(round=live.round, loss=loss, peers=swarm.peer_count,
                                 bytes_sent=swarm.bytes_sent, bytes_received=swarm.bytes_received)
        status.round, status.loss, status.peers = live.round, loss, swarm.peer_count
        status.tokens_per_s = live.tokens / max(live.compute_s, 1e-9)
        status.phase = "training" if not swarm.syncing else "training + averaging"
        status.round_start, status.round_end = schedule.round_start(live.round), schedule.round_end(live.round)
        self.view.update(status)

    # -- helpers -------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        # run_config: what `shoal export` / `shoal sample` rebuild the model and tokenizer from.
        path, round = self.swarm.save_checkpoint(self.options.checkpoint_dir, local_state=self.trainer.inner_state(),
                                                 meta=self._run_config_meta)
        self.metrics.write("checkpoint", round=round, path=str(path))
        return path

    def _periodic_checkpoint(self, round: int) -> None:
        """A checkpoint between rounds. A disk that is full (or gone read-only) costs this one
        checkpoint, never the run: the write is atomic, so the last good one is untouched, and
        training goes on; the user is told once per streak of failures, with the fix."""
        try:
            self.save_checkpoint()
        except OSError as e:
            self.metrics.write("checkpoint_failed", round=round, error=f"{e.strerror or e}"[:200])
            if not self._checkpoint_failing:
                kept = list_checkpoints(self.options.checkpoint_dir)
                logger.error(f"checkpoint of round {round} not written to {self.options.checkpoint_dir}: "
                             f"{e.strerror or e}; the last good checkpoint ({kept[0].name if kept else 'none yet'}) "
                             "is kept and training goes on; free space there (or pass another --checkpoint-dir)")
            self._checkpoint_failing = True
        else:
            if self._checkpoint_failing:
                logger.info(f"checkpoints written again (round {round})")
            self._checkpoint_failing = False

    def _heartbeat(self) -> Heartbeat:
        """Our figures for the progress record (monitor thread; reads a status the loop replaces)."""
        s = self.status
        finite = lambda v: v if v is not None and math.isfinite(v) and v >= 0 else None  # noqa: E731
        return Heartbeat(loss=finite(s.loss), eval_loss=finite(s.eval_loss), tokens_per_s=float(s.tokens_per_s),
                         device=self.device_label, phase=s.phase[:64], shard=self.shard)

    def _peers_changed(self, joined: set[str], left: set[str]) -> None:
        if self.metrics is None:
            return
        count = self.swarm.peer_count if self.swarm else 1
        for peer in sorted(joined - {self.status.peer_id}):
            self.metrics.write("peer_join", other=peer, peers=count)
        for peer in sorted(left):
            self.metrics.write("peer_leave", other=peer, peers=count)
        self.status.peers = count
