"""One look at a running swarm from the DHT: the run's schedule and every peer's progress record.

``shoal status`` takes it through a client-mode DHT node without joining the run; the result is
pure data, so it renders (``node.observe.status_view``) and serializes without a network.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocols.schedule import RoundSchedule

if TYPE_CHECKING:  # hivemind (and so torch) load only when a command runs, not for `shoal --help`
    from protocols.manifest import RunManifest
    from protocols.progress import ProgressRecord, SwarmSummary

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SwarmSnapshot:
    """What one look at the DHT found; pure data, so it renders and serializes without a network."""

    run_id: str
    time: float  # DHT time of the look
    schedule: RoundSchedule | None  # None: no valid manifest found
    records: dict[str, ProgressRecord] = field(default_factory=dict)
    malformed: int = 0  # progress records ignored as malformed
    malformed_manifests: int = 0
    progress_shards: int = 1  # the DHT keys the records were read from (``averaging.progress_shards``)

    @property
    def summary(self) -> SwarmSummary:
        from protocols.progress import SwarmSummary

        return SwarmSummary.of(self.records.values())

    @property
    def round(self) -> int | None:
        """The schedule's round now; without a manifest, the round most peers report."""
        return self.schedule.round_at(self.time) if self.schedule is not None else self.summary.round

    def to_json(self) -> dict[str, Any]:
        summary, schedule = self.summary, self.schedule
        peers = sorted(self.records.values(), key=lambda r: (-r.tokens_per_s, r.peer_id))
        return {
            "run_id": self.run_id,
            "time": self.time,
            "round": self.round,
            "round_seconds": schedule.round_seconds if schedule else None,
            "round_ends_in_s": schedule.round_end(self.round) - self.time if schedule and self.round else None,
            "peers": summary.peers,
            "tokens_per_s": summary.tokens_per_s,
            "tokens": summary.tokens,
            "loss": summary.loss,
            "eval_loss": summary.eval_loss,
            "malformed": self.malformed,
            "malformed_manifests": self.malformed_manifests,
            "progress_shards": self.progress_shards,
            "peer_list": [
                {"peer_id": r.peer_id, "round": r.round, "tokens_per_s": r.tokens_per_s, "loss": r.loss,
                 "eval_loss": r.eval_loss, "device": r.device, "utilization": r.utilization, "mode": r.mode,
                 "phase": r.phase, "version": r.version, "tokens": r.tokens, "bytes_sent": r.bytes_sent,
                 "bytes_received": r.bytes_received, "round_bytes_sent": r.round_bytes_sent,
                 "round_bytes_received": r.round_bytes_received, "shard": r.shard, "sync_late_s": r.sync_late_s,
                 "rounds_done": r.rounds_done, "clock_offset_s": r.clock_offset_s, "group_count": r.group_count,
                 "last_seen_s": max(self.time - r.time, 0.0)}
                for r in peers
            ],
        }


def _chosen(manifests: Iterable[RunManifest]) -> list[RunManifest]:
    """The manifests of the most common config (a stray peer with another config does not decide)."""
    manifests = list(manifests)
    if not manifests:
        return []
    counts = Counter(m.config_hash for m in manifests)
    best = max(counts, key=lambda h: (counts[h], -min(m.start_time for m in manifests if m.config_hash == h)))
    return [m for m in manifests if m.config_hash == best]


def schedule_of(manifests: Iterable[RunManifest]) -> RoundSchedule | None:
    """The run's schedule as its peers see it: among the manifests of the most common config, the
    earliest start, like ``join_run``."""
    chosen = _chosen(manifests)
    if not chosen:
        return None
    return RoundSchedule(min(m.start_time for m in chosen), chosen[0].round_seconds)


def look(dht, run_id: str) -> SwarmSnapshot:
    """One read of the run's manifests and progress records."""
    from node.library.run_record import DhtDirectory
    from protocols.manifest import progress_shards
    from protocols.messages import MessageError

    directory = DhtDirectory(dht, run_id)
    manifests, malformed_manifests = directory.manifests()
    chosen = _chosen(manifests)
    try:  # the records are where the run's own manifest says (one key, or its progress shards)
        directory.use_progress_shards(progress_shards(chosen[0]) if chosen else 1)
    except MessageError:
        malformed_manifests += 1
    records, malformed = directory.progress()
    return SwarmSnapshot(run_id=run_id, time=directory.now(), schedule=schedule_of(manifests), records=records,
                         malformed=malformed, malformed_manifests=malformed_manifests,
                         progress_shards=directory.read_shards)
