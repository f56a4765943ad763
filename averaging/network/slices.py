"""A joiner's state download, spread over several donors in slices.

Why: one donor serving the whole state is a choke point (hivemind issue #169) and a single point of
failure. The flat fp32 state is cut into ``count`` slices; each donor serves at most one at a time,
a donor that fails, stalls or lies is dropped and its slice goes to another, and slices are
assembled only when all come from one state (one round, donors whose fingerprints agree).

Pure: no hivemind, no processes; the fetch of one slice is a callable the caller supplies. The
donor-side cutting lives here too, so both ends share one definition of "slice i of n".

Threads: ``download_slices`` runs in the caller's thread and calls ``progress`` there; ``fetch``
runs in a pool with one thread per donor. All bookkeeping (``_Book``) stays in the caller's thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from averaging.math.fingerprints import chunk_length
from averaging.math.wire import STATE_BYTES_PER_VALUE
from averaging.network.interface import Progress
from averaging.state.served import CheckSlice
from protocols.messages import MAX_ROUND, MessageError, bounded_int
from protocols.state_slices import MAX_SLICES

logger = logging.getLogger(__name__)

MIN_DONOR_BYTES_PER_S = 128 * 1024  # a donor slower than 1 Mbit/s over a whole slice is dropped

# fetch(donor, index, count) -> (metadata, flat fp32 slice); raises on any failure.
Fetch = Callable[[str, int, int], tuple[Any, torch.Tensor]]
# same_state(metadata_a, metadata_b): whether two donors' slices of one round describe one state.
SameState = Callable[[Any, Any], bool]


# -- what "slice i of n" means, on both ends -------------------------------------------------------
def slice_bounds(total: int, index: int, count: int, align: int = 1) -> tuple[int, int]:
    """``[start, stop)`` of slice ``index`` of ``count`` over ``total`` values, every boundary but the
    end a multiple of ``align`` (the anchor's fingerprint chunk: ``slice_alignment``)."""
    assert 0 <= index < count and total >= 0 and align >= 1
    units = slice_units(total, align)
    return min(total, units * index // count * align), min(total, units * (index + 1) // count * align)


def slice_alignment(anchor_numel: int) -> int:
    """Where a state is cut, by donor and joiner alike: at the fingerprint chunks of its first
    tensor (the anchor), so that every slice of the anchor is whole chunks (``slice_bounds``)."""
    return chunk_length(anchor_numel) if anchor_numel > 0 else 1


def slice_units(total: int, align: int = 1) -> int:
    """How many non-empty slices ``total`` values can be cut into at ``align``."""
    return -(-total // align)


def flat_slice(tensors: Sequence[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Values ``[start, stop)`` of the flattened ``tensors``' concatenation, without building it;
    fp32 only (the joiner expects exact values)."""
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError(f"state tensors must be float32, got {sorted({str(t.dtype) for t in tensors})}")
    pieces, offset = [], 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        low, high = max(start - offset, 0), min(stop - offset, flat.numel())
        if low < high:
            pieces.append(flat[low:high])
        offset += flat.numel()
    if not 0 <= start <= stop <= offset:
        raise ValueError(f"slice [{start}, {stop}) outside a state of {offset} values")
    if not pieces:
        return torch.empty(0, dtype=torch.float32)
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)


# -- checks and choices on the joiner's side ------------------------------------------------------
def slice_problem(metadata: Any, tensor: Any, expected_numel: int, max_round: int = MAX_ROUND) -> str | None:
    """Why a received slice must not be used, or None. Everything from a donor is untrusted: a
    round past ``max_round`` (the schedule's) is a lie that would otherwise win the round vote."""
    if not isinstance(metadata, dict):
        return "no state metadata"
    try:
        bounded_int(metadata, "round", 0, max_round)
    except MessageError as e:
        return f"bad round ({e})"
    if not isinstance(tensor, torch.Tensor):
        return f"slice is a {type(tensor).__name__}, not a tensor"
    if tensor.dtype != torch.float32:
        return f"slice of dtype {tensor.dtype}, expected float32"
    if tensor.dim() != 1 or tensor.numel() != expected_numel:
        return f"slice of shape {tuple(tensor.shape)}, expected ({expected_numel},)"
    if not torch.isfinite(tensor).all():
        return "non-finite values"
    return None


def choose_round(rounds: Iterable[int]) -> int | None:
    """The round most donors serve; ties go to the highest (the newest state). None if no votes."""
    votes = Counter(rounds)
    if not votes:
        return None
    return max(votes, key=lambda round: (votes[round], round))


# A state a donor serves: its round and lineage (the first state of that round it agrees with).
StateKey = tuple[int, int]


def choose_state(keys: Iterable[StateKey]) -> StateKey | None:
    """The state most donors serve (ties: the newest round, then the lineage seen first), so that no
    single donor picks it; None if no votes."""
    votes = Counter(keys)
    if not votes:
        return None
    return max(votes, key=lambda key: (votes[key], key[0], -key[1]))


def default_slice_count(donors: int, total: int, align: int = 1) -> int:
    """Two slices per donor: a dropped donor's work is redone by the others in halves (requests
    within a few seconds share one copy of a donor's state, so more slices cost it little)."""
    return max(1, min(2 * donors, MAX_SLICES, slice_units(total, align)))


def slice_deadline_s(stall_timeout: float, slice_bytes: int) -> float:
    """How long one slice may take: ``stall_timeout`` to start plus the slice at the slowest rate we
    accept. Without it, a donor trickling one message per ``stall_timeout`` could hold a slice forever."""
    return stall_timeout + slice_bytes / MIN_DONOR_BYTES_PER_S


def default_max_fetches(count: int, donors: int) -> int:
    """Enough for a full pass, a full refetch after the swarm moved on a round, and one failure per
    donor; bounded so donors that keep changing rounds cannot keep us looping."""
    return 3 * count + 2 * donors


@dataclass(frozen=True, slots=True)
class Assembled:
    """A complete state, every slice from the same round. Not yet validated beyond the slices."""

    metadata: dict  # metadata of the donor of slice 0 (all slices share its round)
    tensors: list[torch.Tensor]  # the flat vector split at ``lengths``; views of one buffer
    served: dict[str, int]  # donor -> slices of this state it served


class _Book:
    """Who fetches what, and which state each slice's region of the buffer holds. Owned by the
    thread running ``download_slices``. A slice is pending when it is not in flight and its region
    does not hold the target state (derived, not queued: failures and a new target need no code)."""

    def __init__(self, donors: list[str], lengths: Sequence[int], count: int, same_state: SameState | None = None,
                 max_round: int = MAX_ROUND, align: int = 1, check: CheckSlice | None = None):
        self.lengths = list(lengths)
        self.same_state, self.max_round, self.check = same_state, max_round, check
        self.total = sum(self.lengths)
        self.count = count
        self.bounds = [slice_bounds(self.total, i, count, align) for i in range(count)]
        self.buffer = torch.empty(self.total, dtype=torch.float32)
        self.held: list[StateKey | None] = [None] * count  # the state whose data each slice's region holds
        self.held_by: list[str | None] = [None] * count
        self.metadata: list[dict | None] = [None] * count
        self.live = list(donors)  # donors not dropped, in the caller's order
        self.donor_state: dict[str, StateKey] = {}  # the state of the last valid slice each donor sent
        self.lineages: list[tuple[int, Any]] = []  # (round, metadata) of the first donor of each lineage
        self.busy: dict[str, int] = {}  # donor -> slice in flight (at most one each)
        self.issued: Counter[str] = Counter()

    def target(self) -> StateKey | None:
        """The state to assemble: the live donors' vote; if none has voted yet, the held slices'."""
        votes = [self.donor_state[d] for d in self.live if d in self.donor_state]
        return choose_state(votes or [k for k in self.held if k is not None])

    def _key(self, round: int, metadata: Any) -> StateKey:
        """The state ``metadata`` describes: its round and lineage (``StateKey``)."""
        if self.same_state is None:
            return round, 0
        for lineage, (first_round, first) in enumerate(self.lineages):
            if first_round == round and self.same_state(first, metadata):
                return round, lineage
        self.lineages.append((round, metadata))
        return round, len(self.lineages) - 1

    def pending(self, target: StateKey | None) -> list[int]:
        in_flight = set(self.busy.values())
        stale = [i for i, r in enumerate(self.held) if r is None or r != target]
        return [i for i in stale if i not in in_flight]

    def assign(self, limit: int) -> list[tuple[str, int]]:
        """Pair idle donors with pending slices. A donor known to serve another state than the
        target is left idle: its slices would be discarded. Least-used donors go first."""
        target = self.target()
        idle = [d for d in self.live if d not in self.busy and self.donor_state.get(d, target) == target]
        idle.sort(key=lambda d: self.issued[d])  # stable: ties keep the caller's order
        pairs = list(zip(idle, self.pending(target)))[: max(limit, 0)]
        for donor, index in pairs:
            self.busy[donor] = index
            self.issued[donor] += 1
        return pairs

    def accept(self, donor: str, index: int, metadata: Any, tensor: Any) -> str | None:
        """Take a fetched slice; returns why it was refused (the donor is then dropped), or None."""
        assert self.busy.get(donor) == index
        del self.busy[donor]
        start, stop = self.bounds[index]
        problem = slice_problem(metadata, tensor, stop - start, self.max_round)
        if problem is not None:
            self.drop(donor)
            return problem
        problem = self.check(start, stop, metadata, tensor) if self.check is not None else None
        if problem is not None:
            self.drop(donor)
            return problem
        key = self._key(metadata["round"], metadata)
        self.donor_state[donor] = key
        target = self.target()
        if key == target:  # else: stale, ahead of the vote or another lineage: its region stays pending
            self.buffer[start:stop].copy_(tensor)
            self.held[index], self.held_by[index], self.metadata[index] = key, donor, metadata
        elif key[0] == target[0]:
            others = [d for d, k in self.donor_state.items() if k == target and d in self.live]
            logger.warning(f"slice {index}/{self.count} from {donor}: serves another state of round {key[0]} than "
                           f"{', '.join(others)} (their anchors diverged; slices of both would make a state neither "
                           "holds): not used while more donors serve the other")
        return None

    def fail(self, donor: str, index: int) -> None:
        assert self.busy.get(donor) == index
        del self.busy[donor]
        self.drop(donor)

    def drop(self, donor: str) -> None:
        if donor in self.live:
            self.live.remove(donor)

    def complete(self) -> bool:
        return None not in self.held and set(self.held) == {self.target()}

    def done_bytes(self) -> int:
        target = self.target()
        values = sum(stop - start for (start, stop), r in zip(self.bounds, self.held) if r == target)
        return STATE_BYTES_PER_VALUE * values

    def assembled(self) -> Assembled:
        assert self.complete()
        metadata = self.metadata[0]
        assert metadata is not None
        return Assembled(metadata=metadata, tensors=list(self.buffer.split(self.lengths)),
                         served=dict(Counter(d for d in self.held_by if d is not None)))


def download_slices(
    donors: Sequence[str],
    *,
    lengths: Sequence[int],
    count: int,
    fetch: Fetch,
    progress: Progress | None = None,
    slice_timeout: float | None = None,
    max_fetches: int | None = None,
    same_state: SameState | None = None,
    max_round: int = MAX_ROUND,
    align: int = 1,
    check: CheckSlice | None = None,
) -> Assembled | None:
    """Fetch the state (tensors of ``lengths`` fp32 values, concatenated) as ``count`` slices from
    ``donors``, at most one fetch in flight per donor; None if it cannot be completed.

    A fetch that raises, runs past ``slice_timeout``, serves a round past ``max_round`` or a slice
    that ``check`` refuses drops its donor, and its slice goes to another. With ``same_state`` the
    lineage most donors serve is assembled (``choose_state``). ``progress(done_bytes, total_bytes)``
    never goes backwards and ends at total_bytes."""
    donors = list(dict.fromkeys(donors))  # a donor listed twice must not get two slices at once
    total = sum(lengths)
    if any(length < 0 for length in lengths) or not 1 <= count <= min(MAX_SLICES, max(slice_units(total, align), 1)):
        raise ValueError(f"cannot cut {total} values into {count} slices (1..{MAX_SLICES}, at most one per "
                         f"{align} values)")
    if not donors:
        return None
    book = _Book(donors, lengths, count, same_state, max_round, align, check)
    fetches = _Fetches(fetch, count, workers=len(donors), slice_timeout=slice_timeout,
                       budget=default_max_fetches(count, len(donors)) if max_fetches is None else max_fetches)
    progress_bytes = _MonotoneProgress(progress, STATE_BYTES_PER_VALUE * total)
    try:
        while not book.complete():
            if not fetches.issue(book):
                logger.warning(f"state download gave up: {len(book.live)} of {len(donors)} donors left, "
                               f"{fetches.issued} of {fetches.budget} fetches used, target round {book.target()}")
                return None
            for future, donor, index in fetches.wait_any():
                _settle(book, future, donor, index)
                progress_bytes(book.done_bytes())
            for donor, index in fetches.abandon_expired():
                book.fail(donor, index)
                logger.warning(f"slice {index}/{count} from {donor}: timed out after {slice_timeout:.1f}s;"
                               " donor dropped")
        progress_bytes.finish()
        result = book.assembled()
        logger.info(f"state of round {result.metadata['round']} assembled from {count} slices: {result.served}")
        return result
    finally:
        fetches.close()


class _Fetches:
    """The fetches in flight, one per donor at most (so one thread per donor), within a budget."""

    def __init__(self, fetch: Fetch, count: int, *, workers: int, slice_timeout: float | None, budget: int):
        self.fetch, self.count, self.slice_timeout, self.budget = fetch, count, slice_timeout, budget
        self.issued = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shoal-slice")
        self._in_flight: dict[Future, tuple[str, int, float]] = {}

    def issue(self, book: _Book) -> bool:
        """Give every idle donor that serves the target round a pending slice; False when nothing
        is in flight any more (no donor, slice or budget left)."""
        for donor, index in book.assign(limit=self.budget - self.issued):
            self._in_flight[self._pool.submit(self.fetch, donor, index, self.count)] = (donor, index, time.monotonic())
            self.issued += 1
        return bool(self._in_flight)

    def wait_any(self) -> list[tuple[Future, str, int]]:
        """Wait for the first fetch to end, or for the oldest one to run out of time."""
        wait_s = None
        if self.slice_timeout is not None:
            oldest = min(started for _, _, started in self._in_flight.values())
            wait_s = max(0.0, oldest + self.slice_timeout - time.monotonic())
        finished, _ = wait(self._in_flight, timeout=wait_s, return_when=FIRST_COMPLETED)
        return [(future, *self._in_flight.pop(future)[:2]) for future in finished]

    def abandon_expired(self) -> list[tuple[str, int]]:
        """Fetches past their time: forgotten (their threads finish on their own, results ignored)."""
        if self.slice_timeout is None:
            return []
        now, expired = time.monotonic(), []
        for future, (donor, index, started) in list(self._in_flight.items()):
            if now - started >= self.slice_timeout:
                del self._in_flight[future]
                expired.append((donor, index))
        return expired

    def close(self) -> None:
        # Hazard: never wait here for a fetch we abandoned; it may still be hanging (interpreter exit
        # will wait for its thread, so a fetch must be bounded by its own timeout, as HivemindBackend's is).
        self._pool.shutdown(wait=False, cancel_futures=True)


class _MonotoneProgress:
    """``progress(done_bytes, total_bytes)`` from 0 to the total, never backwards."""

    def __init__(self, progress: Progress | None, total_bytes: int):
        self.progress, self.total_bytes, self.reported = progress, total_bytes, 0
        _report(progress, 0, total_bytes)

    def __call__(self, done: int) -> None:
        if done > self.reported:
            self.reported = done
            _report(self.progress, done, self.total_bytes)

    def finish(self) -> None:
        if self.reported < self.total_bytes:
            _report(self.progress, self.total_bytes, self.total_bytes)


def _settle(book: _Book, future: Future, donor: str, index: int) -> None:
    """Record how one finished fetch went (in the scheduler's thread)."""
    error = future.exception()
    if error is None:
        try:
            metadata, tensor = future.result()
        except (TypeError, ValueError):  # fetch returned something that is not a pair
            metadata, tensor = None, None
        problem = book.accept(donor, index, metadata, tensor)
    else:
        book.fail(donor, index)
        problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        logger.warning(f"slice {index}/{book.count} from {donor}: {problem}; donor dropped")


def _report(progress: Progress | None, done: int, total: int) -> None:
    # Hazard: progress is the caller's code (a progress bar); its failure must not fail the download.
    if progress is None:
        return
    try:
        progress(done, total)
    except Exception as e:  # noqa: BLE001 - logged and ignored on purpose
        logger.warning(f"state download progress callback failed: {e!r}")
