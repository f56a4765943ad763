"""The sync worker: the one owner of the averaging backend, on its own thread.

The training loop never calls the network. It asks the worker to ``prepare`` a round (start
matchmaking ahead of the deadline), hands over a pseudo-gradient snapshot with ``begin_sync``
and gets a ``Future``; it may block on it (blocking mode) or poll it at step boundaries while
it keeps training (overlap mode). All backend calls run serially on the worker's thread, so
the backend needs no locking of its own (torchft's quorum thread, hivemind's StepControl).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from averaging.backend import AverageOutcome, AveragingBackend, DownloadedState


@dataclass(slots=True)
class SyncResult:
    """An averaging round as seen by the loop: the averaged vector is only set on success."""

    round: int
    outcome: AverageOutcome
    averaged: torch.Tensor | None
    started: float  # perf_counter at begin_sync
    finished: float  # perf_counter when the outcome was known


class SyncWorker:
    def __init__(self, backend: AveragingBackend, *, allreduce_timeout: float, matchmaking_grace: float):
        self.backend = backend
        self.allreduce_timeout = allreduce_timeout
        self.matchmaking_grace = matchmaking_grace  # how long past the deadline a group may still form
        # Created lazily on first submit: the thread starts after hivemind's forks (HIVEMIND_NOTES).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-sync")

    @property
    def peer_id(self) -> str:
        return self.backend.peer_id

    def prepare(self, *, round: int, scheduled_time: float, gather: dict) -> Future:
        timeout = scheduled_time - time.time() + self.matchmaking_grace
        return self._executor.submit(self.backend.prepare, round=round, scheduled_time=scheduled_time,
                                     gather=gather, timeout=timeout)

    def begin_sync(self, *, round: int, pseudo_grad: torch.Tensor, weight: float) -> Future[SyncResult]:
        """Average a snapshot in the background; ``pseudo_grad`` must not change until the future is done."""
        started = time.perf_counter()

        def run() -> SyncResult:
            averaged = pseudo_grad.clone()  # the caller keeps its snapshot as the fallback update
            outcome = self.backend.average(averaged, weight=weight,
                                           timeout=self.matchmaking_grace + self.allreduce_timeout)
            return SyncResult(round, outcome, averaged if outcome.ok else None, started, time.perf_counter())

        return self._executor.submit(run)

    def download_state(self, peers: list[str], *, timeout: float) -> DownloadedState | None:
        return self._executor.submit(self.backend.download_state, peers, timeout=timeout).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.backend.shutdown()
