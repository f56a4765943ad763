"""Experiment logs (``--tensorboard``, ``--wandb``): the metrics file's records, as ML dashboards want them.

The node hands each sink the same dicts the metrics file gets: ``round(record)`` per finished
round, ``event(name, fields)`` for everything else, ``start(config)`` once. ``ExperimentLog`` turns
them into scalars, text and a config once, here, so TensorBoard and W&B show the same tags; a
sink (``node.observe.experiment_sinks``) only writes them.

Logging never breaks training: the first exception inside a sink (a full disk, a W&B network
error) is logged once as a warning and that sink stops; the run goes on. NaN and infinity are
skipped (a dashboard draws a gap, not a spike to 1e38). Records come from the training thread
and the peer monitor thread, so each sink writes under its own lock.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Round fields -> tag. train/: this peer's inner loop; eval/: the shared model; sync/: the outer
# step and the network; swarm/: the run as this peer sees it. Fields not named here that carry
# numbers still appear, as round/<field>, so a new RoundStats field needs no change here.
ROUND_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens": "train/tokens",
    "inner_steps": "train/inner_steps",
    "compute_s": "train/compute_s",
    "wall_s": "train/wall_s",
    "eval_loss": "eval/loss",
    "group_size": "sync/group_size",
    "sync_s": "sync/sync_s",
    "allreduce_s": "sync/allreduce_s",
    "wait_s": "sync/wait_s",
    "bytes_sent": "sync/bytes_sent",
    "bytes_received": "sync/bytes_received",
    "caught_up": "sync/caught_up",
    "bad_reports": "sync/bad_reports",
    "skipped": "sync/skipped",
    "resynced": "sync/resynced",
    "peers": "swarm/peers",
    "rounds_done": "swarm/rounds_done",
}
_ENVELOPE = frozenset({"event", "peer", "time", "round"})  # every line's; round is the step, not a value
# ... and the round fields mapped by hand in round_scalars (strings, lists).
_NOT_SCALARS = _ENVELOPE | {"group", "applied", "error", "diverged", "robust"}
# Tag prefixes every scalar falls under; W&B plots each against the round (see WandbLog).
TAG_PREFIXES = ("train", "eval", "sync", "swarm", "round", "events")


def _number(value: Any) -> float | None:
    """A finite number (bools as 0/1), or None for anything a chart cannot draw."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one ``round`` line (the flat dict ``MetricsWriter.write_round`` writes)."""
    scalars: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        if (number := _number(value)) is not None:
            scalars[tag] = number

    for key, value in record.items():
        if key in _NOT_SCALARS:
            continue
        if isinstance(value, dict):
            for sub, item in value.items():
                put(f"round/{key}/{sub}", item)
        else:
            put(ROUND_TAGS.get(key, f"round/{key}"), value)
    tokens, compute_s, wall_s = (_number(record.get(key)) for key in ("tokens", "compute_s", "wall_s"))
    # The dashboard's "this peer" rate (tokens per second of compute) and its utilization.
    if tokens is not None and compute_s:
        put("train/tokens_per_s", tokens / compute_s)
    if compute_s is not None and wall_s:
        put("train/utilization", min(max(compute_s / wall_s, 0.0), 1.0))
    if "applied" in record:
        put("sync/averaged", record["applied"] == "averaged")
    if "error" in record:
        put("sync/failed", record["error"] is not None)
    if isinstance(record.get("diverged"), list):
        put("sync/diverged", len(record["diverged"]))
    if isinstance(record.get("robust"), dict):
        for kind, count in record["robust"].items():
            put(f"sync/robust/{kind}", count)
    return scalars


def event_scalars(name: str, fields: dict[str, Any]) -> dict[str, float]:
    """An event's numbers (a list: its length) as ``events/<name>/<field>``; a join or leave also
    moves swarm/peers."""
    scalars = {}
    for key, value in fields.items():
        number = len(value) if isinstance(value, list) else _number(value)
        if key not in _ENVELOPE and number is not None:
            scalars[f"events/{name}/{key}"] = float(number)
    if name in ("peer_join", "peer_leave") and (peers := _number(fields.get("peers"))) is not None:
        scalars["swarm/peers"] = peers
    return scalars


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested config sections as dotted keys with plain values (what TensorBoard's hparams accept)."""
    flat: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, (str, bool, int, float)):
            flat[name] = value
        elif value is None or isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value, default=str)
        else:  # a path, an enum: its text
            flat[name] = str(value)
    return flat


class ExperimentLog:
    """One sink for the node's records; this base class is also the no-op log (nothing configured).

    Subclasses write through the ``_write_*`` hooks; the public methods map records, hold the lock
    and turn a sink's first failure into one warning and silence (``disabled``).
    """

    def __init__(self, label: str = "experiment log") -> None:
        self.label = label  # names the sink in the one warning it may log
        self.disabled = False  # it failed or was closed: records are dropped
        self._lock = threading.Lock()
        self._step = 0  # the last round seen: events land there
        self._counts: Counter[str] = Counter()

    def start(self, config_fields: dict[str, Any]) -> None:
        """The run's config, once, before the first round."""
        self._guarded(self._write_config, dict(config_fields))

    def round(self, record: dict[str, Any]) -> None:
        """One ``round`` line; its ``round`` is the step, its ``time`` (if any) the wall time."""
        def write() -> None:
            step = record.get("round")
            if isinstance(step, int) and not isinstance(step, bool):
                self._step = step
            walltime = _number(record.get("time"))
            self._write_scalars(round_scalars(record), self._step, walltime)
            if isinstance(record.get("error"), str):  # why the sync failed, readable beside the charts
                self._write_text("sync/error", record["error"], self._step)
        self._guarded(write)

    def event(self, name: str, fields: dict[str, Any]) -> None:
        """Any other line: a running count ``events/<name>``, its numbers, and its fields as text.

        ``event("round", record)`` is ``round(record)``, so a caller may tee every metrics line here.
        """
        if name == "round":
            self.round(fields)
            return

        def write() -> None:
            self._counts[name] += 1
            step = fields.get("round")
            step = step if isinstance(step, int) and not isinstance(step, bool) else self._step
            scalars = {f"events/{name}": float(self._counts[name]), **event_scalars(name, fields)}
            self._write_scalars(scalars, step, _number(fields.get("time")))
            shown = {key: value for key, value in fields.items() if key not in ("event", "peer", "time")}
            self._write_text(f"events/{name}", json.dumps(shown, default=str, sort_keys=True), step)
        self._guarded(write)

    def close(self) -> None:
        """Flush and finish; later records are dropped (a background thread may still report)."""
        def finish() -> None:
            self.disabled = True  # under the lock: no write slips in after the sink is closed
            self._close()
        self._guarded(finish)

    def __enter__(self) -> ExperimentLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _guarded(self, write: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self.disabled:
                return
            try:
                write(*args)
            except Exception as e:  # a sink's failure costs its records, never the run
                self.disabled = True  # before anything else: the warning is said once
                logger.warning(f"{self.label}: {type(e).__name__}: {e}; logging there stops, training goes on")
                self._abandon()

    # Hooks a sink overrides; called under the lock, each at most once at a time.
    def _write_config(self, config: dict[str, Any]) -> None:
        pass

    def _write_scalars(self, scalars: dict[str, float], step: int, walltime: float | None) -> None:
        pass

    def _write_text(self, tag: str, text: str, step: int) -> None:
        pass

    def _close(self) -> None:
        pass

    def _abandon(self) -> None:
        """After a failure: release what the sink holds, quietly (it may be what failed)."""
        try:
            self._close()
        except Exception:
            pass


class MultiLog(ExperimentLog):
    """Fans every record out to several sinks; each fails (and goes quiet) on its own."""

    def __init__(self, logs: Sequence[ExperimentLog]) -> None:
        super().__init__("experiment logs")
        self.logs = list(logs)

    def start(self, config_fields: dict[str, Any]) -> None:
        for log in self.logs:
            log.start(config_fields)

    def round(self, record: dict[str, Any]) -> None:
        for log in self.logs:
            log.round(record)

    def event(self, name: str, fields: dict[str, Any]) -> None:
        for log in self.logs:
            log.event(name, fields)

    def close(self) -> None:
        for log in self.logs:
            log.close()
        self.disabled = True


def open_experiment_logs(tensorboard: Path | None, wandb_project: str | None, peer_id: str,
                         run_id: str) -> ExperimentLog:
    """The sinks the flags ask for (``--tensorboard DIR``, ``--wandb PROJECT``); a no-op log for none.

    Raises ``ConfigError`` when one cannot start: its package is missing, DIR cannot be written,
    W&B has neither credentials nor ``WANDB_MODE=offline``.
    """
    from node.observe.experiment_sinks import TensorBoardLog, WandbLog  # imports no extra by itself

    logs: list[ExperimentLog] = []
    try:
        if tensorboard is not None:
            logs.append(TensorBoardLog(Path(tensorboard), peer_id, run_id))
        if wandb_project is not None:
            logs.append(WandbLog(wandb_project, peer_id, run_id))
    except BaseException:
        for log in logs:  # the TensorBoard writer's thread must not outlive a W&B refusal
            log.close()
        raise
    if not logs:
        return ExperimentLog()
    return logs[0] if len(logs) == 1 else MultiLog(logs)
