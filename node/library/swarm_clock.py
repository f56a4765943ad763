"""Measuring this peer's clock against the swarm's: DHT pings to live peers, and the offset kept.

hivemind's DHT already stamps every ping answer with the answerer's time (``PingResponse.dht_time``,
its ``get_dht_time()``, which ``protocols.swarm_time.install`` makes swarm time), so a probe is a
few pings the DHT would make anyway, sent from inside its process with our raw clock read around
each one (Cristian's method). ``ClockKeeper`` chooses whom to ask (the peers we averaged with; before
the first fix also those the user named), turns the answers into the offset every process of this
peer runs on (``protocols.swarm_time``), keeps swarm time steady when this machine's own clock is
stepped (NTP, a user setting it), and says the one line a user with a wrong clock sees.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from functools import partial

from protocols import swarm_time
from protocols.swarm_time import ClockSample

logger = logging.getLogger(__name__)

PINGS_PER_PEER = 3  # the most precise of three (the smallest round trip) is kept
MAX_PEERS = 8  # distinct peers per probe (a random sample): enough for a median that a few liars cannot move
PING_TIMEOUT_S = 2.0


def probe(dht, peer_ids: list[str]) -> list[ClockSample]:
    """Ping ``peer_ids`` (at most ``MAX_PEERS``) through our DHT node; unanswered pings are left out."""
    answers = dht.run_coroutine(partial(_ping_times, peer_ids=list(peer_ids)[:MAX_PEERS]))
    return [ClockSample(peer=p, sent=s, remote=r, received=e) for p, s, r, e in answers]


async def _ping_times(_dht, node, *, peer_ids: list[str]) -> list[tuple[str, float, float, float]]:
    """In the DHT's process: ``(peer, sent, their time, received)`` per answered ping, ``sent`` and
    ``received`` on the raw clock (``time.time``, not swarm time: we measure our own error)."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    async def one(peer_id: str) -> list[tuple[str, float, float, float]]:
        out = []
        try:
            stub = node.protocol.get_stub(PeerID.from_base58(peer_id))
        except Exception:  # noqa: BLE001 - a record with an odd id is just not probed
            return out
        for _ in range(PINGS_PER_PEER):
            try:
                sent = time.time()
                # An empty NodeInfo: the peer answers without adding us to its routing table again.
                answer = await stub.rpc_ping(dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(), validate=False),
                                             timeout=PING_TIMEOUT_S)
                received = time.time()
            except Exception:  # noqa: BLE001 - unreachable now: no sample
                break
            if answer.dht_time:
                out.append((peer_id, sent, float(answer.dht_time), received))
        return out

    results = await asyncio.gather(*(one(p) for p in peer_ids))
    return [sample for per_peer in results for sample in per_peer]


class ClockKeeper:
    """Applies each probe's estimate to this process tree's swarm time; logs when it moves and
    when it is off by more than ``swarm_time.WARN_S`` (once per change of a second or more).

    ``trusted``: the peer ids the user named (``--initial-peer``), measured until the first fix. A
    fix hivemind's bootstrap already made from them (``node.library.dht``) counts as the first."""

    def __init__(self, trusted: Iterable[str] = ()) -> None:
        self.trusted = list(dict.fromkeys(trusted))
        self.settled = swarm_time.offset() != 0.0
        self.peers_measured = 0  # distinct peers in the last probe that answered
        self.advice: str | None = None  # the user-facing line while the clock is off
        self._warned_at: float | None = None
        self._raw_minus_monotonic = time.time() - time.monotonic()

    def chosen(self, voices: list[str]) -> list[str]:
        """Whom to probe: up to ``MAX_PEERS`` of ``voices`` (peers we averaged with lately) at
        random, and before the first fix the trusted peers too."""
        peers = random.sample(voices, min(MAX_PEERS, len(voices)))
        return peers if self.settled else list(dict.fromkeys([*self.trusted, *peers]))

    def follow_steps(self) -> float:
        """This machine's clock was stepped (raw time moved against the monotonic clock): move the
        offset the other way, so swarm time runs on (our own reading, no one else's word); returns
        the step. Call each heartbeat."""
        raw_minus_monotonic = time.time() - time.monotonic()
        step = raw_minus_monotonic - self._raw_minus_monotonic
        if abs(step) < swarm_time.DEADBAND_S:
            return 0.0
        self._raw_minus_monotonic = raw_minus_monotonic
        current = swarm_time.offset()
        new = max(-swarm_time.MAX_OFFSET_S, min(swarm_time.MAX_OFFSET_S, current - step))
        swarm_time.set_offset(new)
        logger.info(f"swarm time: this machine's clock was stepped by {step:+.3f}s; the offset follows ({new:+.3f}s)")
        return step

    def update(self, samples: list[ClockSample]) -> float:
        current = swarm_time.offset()
        peers = len({s.peer for s in samples})
        if peers:
            self.peers_measured = peers
        new = swarm_time.estimate_offset(samples, current, settled=self.settled)
        if new is None:
            if peers:
                logger.info(f"swarm time: the {peers} peer(s) measured disagree; the offset stays {current:+.3f}s")
            new = current
        else:
            self.settled = True
        if new != current:
            swarm_time.set_offset(new)
            logger.info(f"swarm time: this clock is {new:+.3f}s off the swarm's ({peers} peer(s) measured)")
        self.advice = swarm_time.describe_offset(new, self.peers_measured)
        if self.advice and (self._warned_at is None or abs(new - self._warned_at) >= 1.0):
            self._warned_at = new
            logger.warning(self.advice)
        return new
