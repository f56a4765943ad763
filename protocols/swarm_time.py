"""One swarm time: this machine's clock plus the offset the swarm measured, in every process.

Everything time-bound in a run is in unix seconds compared across machines: the round schedule
(the manifest's start time), matchmaking deadlines (hivemind declares a group's expiration time
and followers pick the leader that expires first), DHT record expirations. Home clocks are seconds
off (a Windows PC syncs about once a week), and one second is enough to break matchmaking: a peer
whose clock is 1 s fast declares expirations the others have not reached yet and, measured at
873d623, never averaged once. So every peer runs on *swarm time*: ``time.time() + offset``, where
the offset is what this peer measured against the others (``estimate_offset``: Cristian's method on
DHT pings to peers it chose, applied only where most of them agree, and slowly once settled).

Whom a peer measures against decides who can set its clock, and a record costs a stranger one DHT
store: measured against every record, five made-up identities that sorted first moved honest peers
by an hour. So a peer measures only against the peers it has averaged with (a random few) and,
before its first fix, the peers its user named (``--initial-peer``); a lone or new peer with
neither keeps its own clock (``node.library.swarm_clock``).

hivemind reads the time only through ``hivemind.utils.get_dht_time``, which is ``time.time`` bound
by name into each of its modules (``from hivemind.utils import get_dht_time``). ``install``
rebinds every such name, in hivemind's modules and ours, to ``now`` *before* the DHT and the
averager fork: their processes inherit the rebinding, and the offset lives in shared memory
(``multiprocessing`` ``RawValue``, mapped into every forked child), so an update here reaches them.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawValue

# The most we trust a measurement with: Cristian's error is half the round trip; a ping slower
# than 2 s (a congested uplink) says too little about the time to be used.
MAX_ERROR_S = 1.0
# Offsets under this are left alone (jitter, not a clock error), and an update smaller than this
# is not applied (so the offset does not wander with each probe's noise).
DEADBAND_S = 0.05
# A measurement is applied only where more than half the peers measured are within this of their
# median: honest answers agree to Cristian's error; a split says too little to act on.
AGREE_S = 0.5
# Once settled, the offset moves at most this far per probe toward the peers': honest clocks drift by
# milliseconds a day, so only an attacker that averaged with us (a majority of those we measure) could
# need more, and then it moves us this far a probe, not an hour at once.
MAX_STEP_S = 0.25
# Past this the clock is wrong enough that the user should fix it, though shoal runs on swarm time.
WARN_S = 1.0
# A peer never moves its clock further than this on others' word: an hour covers any real error
# (a wrong time zone is not one: unix time has none), and more would be an attack.
MAX_OFFSET_S = 3600.0

_OFFSET = RawValue("d", 0.0)  # seconds to add to time.time(); shared with forked children


def now() -> float:
    """Swarm time, unix seconds: what every deadline and expiration in a run is measured in."""
    return time.time() + _OFFSET.value


def offset() -> float:
    """Seconds this machine's clock is *behind* the swarm (negative: ahead)."""
    return _OFFSET.value


def set_offset(seconds: float) -> None:
    if not abs(seconds) <= MAX_OFFSET_S:
        raise ValueError(f"clock offset {seconds!r} s is beyond {MAX_OFFSET_S:g} s")
    _OFFSET.value = float(seconds)


def install() -> int:
    """Rebind ``get_dht_time`` to ``now`` in every loaded module that holds ``time.time`` under that
    name (hivemind's and shoal's). Call before the DHT forks; idempotent. Returns how many modules
    it rebound; modules imported later take ``hivemind.utils.get_dht_time``, already rebound."""
    rebound = 0
    for module in list(sys.modules.values()):
        # The module's own names, not getattr: a module-level __getattr__ (torch's lazy submodules,
        # node.library.deferred_imports' stand-ins) must not import anything for this scan.
        if getattr(module, "__dict__", {}).get("get_dht_time") is time.time:
            module.get_dht_time = now
            rebound += 1
    return rebound


@dataclass(frozen=True, slots=True)
class ClockSample:
    """One ping: our *raw* clock (``time.time()``) when it left and when the answer came, and the
    peer's swarm time in the answer."""

    peer: str
    sent: float
    remote: float
    received: float

    @property
    def offset(self) -> float:
        """The peer's time minus ours, assuming the answer was stamped halfway (Cristian)."""
        return self.remote - (self.sent + self.received) / 2

    @property
    def error(self) -> float:
        """The most ``offset`` can be wrong by: half the round trip."""
        return (self.received - self.sent) / 2


def estimate_offset(samples: list[ClockSample], current: float, *, settled: bool = True) -> float | None:
    """The offset this peer should run on, or None where the peers measured do not agree (more than
    half within ``AGREE_S`` of their median): measure again later. Per distinct peer the offset of
    its most precise sample (smallest round trip); samples with a round trip over ``2 *
    MAX_ERROR_S`` or a non-finite time are dropped. Before the first fix (not ``settled``) the
    peers' median; after it, the median of ``current`` (our own vote, so two peers meet halfway and
    one odd peer moves only itself) and theirs, at most ``MAX_STEP_S`` from ``current``. A change
    under ``DEADBAND_S`` keeps ``current``. Pure: no clock, no network."""
    best: dict[str, ClockSample] = {}
    for s in samples:
        if not (0 <= s.error <= MAX_ERROR_S) or not all(map(_finite, (s.sent, s.remote, s.received))):
            continue
        if s.peer not in best or s.error < best[s.peer].error:
            best[s.peer] = s
    offsets = [s.offset for s in best.values()]
    if not offsets:
        return None
    middle = statistics.median(offsets)
    if 2 * sum(abs(o - middle) <= AGREE_S for o in offsets) <= len(offsets):
        return None
    if settled:
        target = statistics.median([current, *offsets])
        target = current + max(-MAX_STEP_S, min(MAX_STEP_S, target - current))
    else:
        target = middle
    target = max(-MAX_OFFSET_S, min(MAX_OFFSET_S, target))
    return current if abs(target - current) < DEADBAND_S else target


def describe_offset(seconds: float, peers: int) -> str | None:
    """One line for the user when the clock is off by more than ``WARN_S`` (None otherwise)."""
    if abs(seconds) <= WARN_S:
        return None
    side = "ahead of" if seconds < 0 else "behind"
    return (f"this machine's clock is {abs(seconds):.1f}s {side} the swarm's (measured against {peers} peer(s)); "
            "shoal runs on the swarm's time, but fix the clock: enable NTP (timedatectl set-ntp true, or "
            "Windows' 'Set time automatically')")


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and abs(x) < float("inf")
