"""Whose self-claimed figures steer this peer: the peers it has averaged with, not every record.

A progress record costs a stranger one DHT store, and identities are cheap (a key each), so
records alone must not decide anything swarm-wide: five records claiming ``sync_late_s = 86400``
moved the median that sets the sync period from 1 to 1,440 rounds, kept ``_alone`` from ever
firing (a lone honest peer then folded every round), and could herd ``choose_shard``. A peer that
has run an all-reduce with us in the last ``MET_WINDOW`` rounds has paid for its voice in
bandwidth and compute; a newcomer counts for ``GRACE_ROUNDS`` rounds after we first see it (it
has had no chance to meet us yet: a swarm forming must not step alone around its own members),
and only where a newcomer's presence matters (``present``), never in medians (``voices``).

Bookkeeping only: the owner (``DiLoCoSwarm``) feeds it the live records (its monitor thread) and
the groups it met (its sync worker), and reads it from the training thread; one lock guards both
tables, since trimming one to ``MAX_REMEMBERED`` scans it while another thread may insert.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

MET_WINDOW = 20  # rounds after an all-reduce together that a peer's figures still count
GRACE_ROUNDS = 3  # rounds a newly seen peer counts as present before it must have met us
MAX_REMEMBERED = 4096  # peers remembered (beyond this, the oldest are forgotten: Sybil churn)


class Acquaintances:
    """Who we met in a group (and when), and when we first saw each live record."""

    def __init__(self, *, met_window: int = MET_WINDOW, grace_rounds: int = GRACE_ROUNDS):
        self.met_window, self.grace_rounds = met_window, grace_rounds
        self._met: dict[str, int] = {}  # peer -> the last round we averaged with it
        self._first_seen: dict[str, int] = {}  # peer -> the round its record first appeared
        self._lock = threading.Lock()

    def saw(self, peers: Iterable[str], round: int) -> None:
        """The live records at ``round``. A peer is first seen once: one whose record lapses and
        returns gets no second grace (a record that never meets us cannot stay "new")."""
        with self._lock:
            for peer in peers:
                self._first_seen.setdefault(peer, round)
            _bound(self._first_seen)

    def met(self, group: Iterable[str], round: int) -> None:
        """We ran ``round``'s all-reduce with ``group``."""
        with self._lock:
            for peer in group:
                self._met[peer] = max(round, self._met.get(peer, round))
            _bound(self._met)

    def voices(self, peers: Iterable[str], round: int) -> list[str]:
        """Of ``peers``, those whose claimed figures count in swarm-wide medians at ``round``."""
        with self._lock:
            return [p for p in peers if round - self._met.get(p, -10**18) <= self.met_window]

    def present(self, peers: Iterable[str], round: int) -> list[str]:
        """Of ``peers``, those that count as other members of the swarm (``voices`` plus newcomers)."""
        peers = list(peers)
        voices = set(self.voices(peers, round))
        with self._lock:
            return [p for p in peers if p in voices or round - self._first_seen.get(p, round) <= self.grace_rounds]


def _bound(table: dict[str, int]) -> None:
    while len(table) > MAX_REMEMBERED:
        del table[min(table, key=table.__getitem__)]
