"""The sync worker: the one owner of the averaging backend, on its own thread.

The training loop never calls the network. It submits jobs (``RoundEngine``'s round sync, a state
download) and gets ``Future``s; it may block on one (blocking mode, start-up) or poll it at step
boundaries while it keeps training (overlap mode). Those jobs run serially on one thread (torchft's
quorum thread, hivemind's StepControl). Matchmaking for the next round has a lane of its own
(``submit_prepare``): it must start on time even while a long all-reduce is still running, so the
backend's ``prepare`` must be safe to call concurrently with its other methods.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from averaging.network.interface import AveragingBackend

T = TypeVar("T")


class SyncWorker:
    def __init__(self, backend: AveragingBackend, *, allreduce_timeout: float, matchmaking_grace: float):
        # Used from the worker's threads; the one other caller is DiLoCoSwarm.start setting
        # ``share_state`` (a flag) from the training thread, once, before the loop starts.
        self.backend = backend
        self.allreduce_timeout = allreduce_timeout
        self.matchmaking_grace = matchmaking_grace  # how long past a deadline a group may still form
        # The thread starts on the first submit, after hivemind's forks (docs/hivemind.md).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-sync")
        self._prepare_lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-sync-prepare")

    @property
    def peer_id(self) -> str:
        return self.backend.peer_id

    def submit(self, job: Callable[..., T], *args, **kwargs) -> Future[T]:
        """Run ``job`` on the worker's thread, after every job submitted before it."""
        return self._executor.submit(job, *args, **kwargs)

    def submit_prepare(self, job: Callable[..., T], *args, **kwargs) -> Future[T]:
        """Run ``job`` on the prepare lane: in order with other prepares, concurrently with ``submit``'s."""
        return self._prepare_lane.submit(job, *args, **kwargs)

    def close(self) -> None:
        self._prepare_lane.shutdown(wait=True, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.backend.shutdown()
