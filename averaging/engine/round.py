"""One round's sync on the worker's thread, read top to bottom in ``RoundRunner.run``:

    job -> pseudo-gradient -> exchange -> the kind's end -> the weight carried forward -> result

Matchmaking (``prepare``) runs earlier on the prepare lane, with our claim attached; the job comes
from ``RoundEngine.begin_sync``; the kind of round (``averaging.engine.kind``) turns the group's
answer into a moved anchor and a merge correction. The training thread merges the result
(``RoundEngine.try_merge``); this worker thread is the only one that changes the anchor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from averaging.engine.clock import Clock
from averaging.engine.config import LoopConfig
from averaging.engine.kind import RoundConclusion, RoundEnding, RoundKind
from averaging.engine.worker import SyncWorker
from averaging.math.codecs import bytes_per_value
from averaging.math.flat import FlatLayout
from averaging.math.outer_step import pseudo_gradient
from averaging.math.wire import WireFormat, round_payload
from averaging.network.interface import AverageOutcome
from averaging.state.shared_state import SharedState
from averaging.state.verdict import Applied
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RoundJob:
    """One round handed from the training thread to the worker (``RoundEngine.begin_sync``)."""

    round: int
    tokens: int  # our work this round, plus the tokens of rounds we stayed out of
    snapshot: torch.Tensor  # the parameters at the round's end (host)
    correction_out: torch.Tensor  # where the merge correction is written (host)
    event: torch.cuda.Event | None = None  # the snapshot's device->host copy, on CUDA
    pending_correction: torch.Tensor | None = None  # an earlier sync's correction the snapshot lacks
    prepared: Future | None = None  # the prepare lane's matchmaking for this round
    # (the inner optimizer's moments at the round's end, a buffer for the group's mean of them)
    moments: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class SyncResult:
    """What the worker hands back to the training thread for one round."""

    conclusion: RoundConclusion
    correction: torch.Tensor
    sync_s: float
    allreduce_s: float
    group: tuple[str, ...]
    resynced: bool
    bytes_sent: int = 0
    bytes_received: int = 0
    lateness_s: float | None = None  # when the all-reduce ended, relative to its round's deadline (None: none ran)
    rounds_done: int = 0  # outer steps applied once this round was concluded
    robust: dict[str, int] = field(default_factory=dict)
    lineage_merged: int = 0  # a reunion where we re-synced: our side's outer steps apart, merged
    reunion: bool = False  # the round met the other side of a split that stepped apart
    # The group's mean of the inner optimizer's moments, when applied; None: keep our own.
    inner_state: torch.Tensor | None = None


def carried_weight(weight: float, ending: RoundEnding) -> float:
    """The weight our next contribution carries beyond its own tokens: this round's if its work
    reached no anchor, plus what the round gave back."""
    return (0.0 if ending.reached else weight) + ending.given_back


class RoundRunner:
    """The worker thread's side of every round; holds what carries from one round to the next."""

    def __init__(self, *, kind: RoundKind, state: SharedState, worker: SyncWorker, layout: FlatLayout,
                 config: LoopConfig, schedule: Callable[[], RoundSchedule], clock: Clock, wire: WireFormat,
                 client_mode: bool, extra_numel: int = 0):
        """``extra_numel``: the inner optimizer's moments ride each all-reduce (``RoundJob.moments``)."""
        self.kind, self.state, self.worker, self.layout, self.config = kind, state, worker, layout, config
        # The extra vector sent and averaged, when the kind's state rides it (else the moments' own buffer is sent).
        self._extra = torch.zeros(kind.state_numel + extra_numel) if kind.state_numel else None
        self._schedule, self.clock = schedule, clock
        # The payload's codec and, for the byte counts, whether we reduce nothing (client mode).
        self.wire, self.client_mode = wire, client_mode
        self._pseudo_grad = layout.new_buffer()
        self._carried = 0.0  # weight of earlier work our next contribution carries (``carried_weight``)
        self._robust_seen: dict[str, int] = {}  # the backend's counters at the last sync

    # -- prepare (the prepare lane) ----------------------------------------------------------------
    def prepare(self, round: int, not_before: float = 0.0, previous: Future | None = None) -> None:
        """Start ``round``'s matchmaking with our claim (not before ``not_before``). Waiting here is
        free: in blocking mode the worker has nothing else to do until then."""
        self.clock.sleep_until(not_before)
        deadline = self._schedule().round_end(round)
        if previous is not None:
            # Our claim describes our anchor: let a sync about to land update it first, as long as
            # matchmaking can still start in time (a stale claim is handled, but costs a check).
            wait([previous], timeout=max(0.0, deadline - self.config.matchmaking_seconds - self.clock.now()))
        bits = self.kind.key_bits(round)
        key = {"key_bits": bits} if bits is not None else {}  # (a backend without sub-groups takes no such argument)
        self.worker.backend.prepare(round=round, scheduled_time=deadline, gather=self.kind.claim(round),
                                    timeout=max(0.0, deadline - self.clock.now()) + self.worker.matchmaking_grace,
                                    **key)

    # -- the round's sync (the sync lane) ------------------------------------------------------------
    def run(self, job: RoundJob) -> SyncResult:
        if job.prepared is not None:
            job.prepared.result()  # the prepare lane's job: it raised only if the backend is broken
        pseudo_grad = self._pseudo_gradient(job)
        weight = float(job.tokens) + self._carried
        extra = self._extra_vector(job.moments)
        sent, averaged, outcome, sync_s = self._exchange(job.round, pseudo_grad, weight, extra)
        robust = self._robust_since_last()
        # Only a group's all-reduce measures lateness: a failed matchmaking ends on its own timeout,
        # and peers with other histories would then stay out of different rounds.
        allreduced = outcome.ok or outcome.partial > 0  # a partial result too: only its outcome is not ours
        lateness_s = self.clock.now() - self._schedule().round_end(job.round) if allreduced else None
        ending = self.kind.end(job.round, outcome, pseudo_grad=pseudo_grad, sent=sent, averaged=averaged,
                               extra=extra, weight=weight, correction_out=job.correction_out)
        self._carried = carried_weight(weight, ending)
        sent_bytes, received_bytes = self._payload(len(outcome.group) if allreduced else 0, extra)
        landed = None
        if job.moments is not None and outcome.ok and ending.conclusion.applied == Applied.AVERAGED:
            landed = job.moments[1]
            if extra is not landed:
                landed.copy_(extra[self.kind.state_numel:])
        return SyncResult(ending.conclusion, ending.correction, sync_s, outcome.allreduce_s, outcome.group,
                          ending.resynced, sent_bytes, received_bytes, lateness_s=lateness_s,
                          rounds_done=self.state.rounds_done, robust=robust, lineage_merged=ending.lineage_merged,
                          reunion=ending.reunion, inner_state=landed)

    def _pseudo_gradient(self, job: RoundJob) -> torch.Tensor:
        """Anchor minus the parameters at the round's end (``job.snapshot``, once its copy landed)."""
        if job.event is not None:
            job.event.synchronize()
        if job.pending_correction is not None:
            job.snapshot.add_(job.pending_correction)  # taken before that merge: as if it had been applied
        return pseudo_gradient(self.state.anchor, job.snapshot, out=self._pseudo_grad)

    def _extra_vector(self, moments: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """What rides the all-reduce beside the pseudo-gradient: the kind's state, then the moments."""
        if self._extra is not None:
            self.kind.pack(self._extra)
            if moments is not None:
                self._extra[self.kind.state_numel:].copy_(moments[0])
            return self._extra
        if moments is not None:
            moments[1].copy_(moments[0])  # averaged in place: the snapshot stays for the landing
            return moments[1]
        return None

    def _exchange(self, round: int, pseudo_grad: torch.Tensor, weight: float,
                  extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, AverageOutcome, float]:
        """The all-reduce of what the codec carries exactly (our full pseudo-gradient stays for a
        local round), ``extra`` in place beside it: (sent, averaged, outcome, sync_s)."""
        started = self.clock.monotonic()
        sent = self.wire.to_send(pseudo_grad)
        averaged = sent.clone()
        timeout = max(0.0, self._schedule().round_end(round) - self.clock.now()) + self.worker.matchmaking_grace
        more = {} if extra is None else {"extra": extra}  # (a backend without extras takes no such argument)
        if self.kind.keep_partial:
            more["keep_partial"] = True
        outcome = self.worker.backend.average(averaged, weight=weight, timeout=timeout + self.worker.allreduce_timeout,
                                              round=round, **more)
        return sent, averaged, outcome, self.clock.monotonic() - started

    def _payload(self, group_size: int, extra: torch.Tensor | None) -> tuple[int, int]:
        """(bytes sent, bytes received) of the round's all-reduce, the extra vector in its own code."""
        sent, received = round_payload(self.layout.numel, group_size, client_mode=self.client_mode,
                                       send_bytes_per_value=self.wire.send_bytes_per_value(),
                                       return_bytes_per_value=self.wire.return_bytes_per_value())
        if extra is not None:
            per_value = bytes_per_value(self.kind.extra_code)
            extra_sent, extra_received = round_payload(extra.numel(), group_size, client_mode=self.client_mode,
                                                       send_bytes_per_value=per_value, return_bytes_per_value=per_value)
            sent, received = sent + extra_sent, received + extra_received
        return sent, received

    def _robust_since_last(self) -> dict[str, int]:
        """What robust aggregation refused since the previous sync (syncs run one at a time, so the
        difference of the backend's cumulative counters belongs to this one), kinds that occurred."""
        counters = self.worker.backend.robustness()
        delta = {kind: count - self._robust_seen.get(kind, 0) for kind, count in counters.items()}
        self._robust_seen = counters
        return {kind: count for kind, count in delta.items() if count}
