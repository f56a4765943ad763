"""The JSON-lines metrics file (``--metrics-file``): a contract users' scripts rely on.

Each line is one JSON object with at least ``event``, ``peer`` and ``time`` (unix seconds).
``event == "round"`` lines carry every key in ``ROUND_FIELDS`` (and every other field of
``RoundRecord``). Lines are strict JSON: NaN and
infinity become ``null``, because a diverged loss must not make the whole file unparseable
for ``jq`` or a browser.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only where rounds are produced, not for `shoal plot`
    from averaging.engine.stats import RoundStats

ROUND_FIELDS = (
    "round",
    "group_size",
    "inner_steps",
    "tokens",
    "compute_s",
    "wait_s",
    "sync_s",
    "wall_s",
    "loss",
    "eval_loss",
)
logger = logging.getLogger(__name__)

_RESERVED = ("event", "peer", "time")


def _finite_or_none(value: Any) -> Any:
    """Replace NaN/inf floats (at any depth) with None so the line stays valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


class MetricsWriter:
    """Appends one JSON object per line; thread-safe, flushed per line; ``path=None`` is a no-op.

    Flushing per line means a crash loses nothing already written. Writes after ``close()``
    are dropped rather than raised: a background thread may still report while the node shuts down.
    """

    def __init__(self, path: Path | None, peer_id: str, *, forward: Callable[[dict], None] | None = None) -> None:
        """``forward``: also called with every record as written (the experiment logs: TensorBoard,
        W&B), whether or not there is a file; it must not raise (``ExperimentLog`` contains its own errors)."""
        self.path = Path(path) if path is not None else None
        self.peer_id = peer_id
        self._forward = forward
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self._good = 0  # the file's size after the last line that was written whole
        self._dropping = False  # the last write failed
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered, appending: each line is one write() call that nothing else holds back,
            # so a failed one leaves nothing queued to spill into the file later.
            self._file = open(self.path, "ab", buffering=0)
            self._good = os.fstat(self._file.fileno()).st_size

    def write(self, event: str, **fields: Any) -> dict:
        """Write one record and return it (as written: NaN/inf already replaced by None)."""
        if clash := [key for key in _RESERVED if key in fields]:
            raise ValueError(f"metrics fields {clash} are reserved; MetricsWriter fills them in")
        record = _finite_or_none({"event": event, "peer": self.peer_id, "time": time.time(), **fields})
        # Serialize outside the lock; allow_nan=False guarantees strict JSON (raises otherwise).
        data = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
        with self._lock:
            if self._file is not None:
                try:
                    # One write() call per line, so concurrent writers never interleave inside a line.
                    if self._file.write(data) != len(data):
                        raise OSError(errno.ENOSPC, "short write (is the disk full?)")
                    self._good += len(data)
                    if self._dropping:
                        self._dropping = False
                        logger.info(f"metrics file {self.path}: writing again")
                except OSError as e:  # a full disk costs these lines, never the run
                    self._drop(e)
        if self._forward is not None:
            self._forward(record)
        return record

    def _drop(self, error: OSError) -> None:
        """After a failed write: cut the file back to its last whole line (a full disk may have
        taken part of this one; truncating frees space, so it works there). Said once per streak."""
        if not self._dropping:
            logger.error(f"metrics file {self.path}: {error.strerror or error}; its lines are dropped until it "
                         "can be written again (free space there)")
        self._dropping = True
        try:
            os.ftruncate(self._file.fileno(), self._good)
        except OSError:
            pass

    def write_round(self, record: RoundRecord) -> dict:
        return self.write("round", **record.fields())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """One finished round, from the round engine to the metrics file and the exporter: the engine's
    ``RoundStats`` as they are, plus what only the process knows."""

    stats: RoundStats
    eval_loss: float | None  # None: not evaluated this round
    peers: int  # live peers in the swarm when the round landed
    lr: float  # the inner learning rate at that time

    def fields(self) -> dict[str, Any]:
        """The ``round`` line's fields: ``ROUND_FIELDS`` first, in order, then every other figure."""
        values = {f.name: getattr(self.stats, f.name) for f in dataclasses.fields(self.stats)}
        values.update(eval_loss=self.eval_loss, peers=self.peers, lr=self.lr)
        return {**{key: values.pop(key) for key in ROUND_FIELDS}, **values}


def read_metrics(path: Path) -> list[dict]:
    """Parse a metrics file; a truncated final line (a crash mid-write) is skipped.

    A bad line anywhere else means the file is not ours or was edited: ``ValueError``.
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            # split("\n") leaves the unterminated tail last; only that one may be torn.
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from exc
    return records
