"""hivemind's matchmaking with the ban list, a search that ends before its deadline, and a paced
leader fetch. hivemind has no hook for either class: ``ShoalAverager`` gives the instances it builds
these classes (``averaging.network.hivemind.averager``); the hivemind code they override is pinned in
``averaging.network.hivemind.pins``.

- ``ShoalMatchmaking``: a peer on the ban list is kept out of our groups (we do not ask it to lead
  us, and as a leader we turn it away).
- ``ShoalPotentialLeaders`` declares its search's end ahead of the deadline (``declared_expiration``),
  and fetches the declared leaders at most once per ``REFETCH_S``: hivemind's search refetches in a
  loop once every leader has turned it away (docs/hivemind.md, "Matchmaking and steps").

Runs in the averager process, on its event loop.
"""

from __future__ import annotations

import asyncio
import math

from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS, TimedStorage

from averaging.math.robust import BanList
from protocols import swarm_time


def declared_expiration(now: float, *, scheduled_time: float, min_matchmaking_time: float, search_end: float,
                        margin: float) -> float | None:
    """When we declare our search to end (a leader assembles its group then), or None: too late.
    hivemind 1.1.12 may declare the step's deadline itself, when followers give up waiting, so a
    late group races its followers; ours ends ``margin`` before it, never before the scheduled time."""
    latest = max(scheduled_time, search_end - margin)
    expiration = min(max(scheduled_time, now + min_matchmaking_time), latest)
    return expiration if expiration > now else None


MAX_LEADERS_KEPT = 64  # groups whose leader a follower remembers until the group runs

# The least time between two fetches of the declared leaders from the DHT (one search).
REFETCH_S = 0.25


class ShoalPotentialLeaders(PotentialLeaders):
    """hivemind's search for leaders with ``declared_expiration`` and a paced leader fetch (set up
    by ``ShoalAverager``: an existing instance is given this class and a ``margin``)."""

    margin: float

    async def _update_queue_periodically(self, key_manager) -> None:
        # hivemind's loop (1.1.12, in REVIEWED), paced: once every declared leader turned us away,
        # hivemind refetches the same leaders from the DHT in a tight loop (docs/incidents.md).
        discrepancy = MAX_DHT_TIME_DISCREPANCY_SECONDS
        fetched = -math.inf
        while swarm_time.now() < self.search_end_time:
            wait = min(fetched + REFETCH_S, self.search_end_time) - swarm_time.now()
            if wait > 0:
                await asyncio.sleep(wait)
            fetched = swarm_time.now()
            new_peers = await key_manager.get_averagers(key_manager.current_key, only_active=True)
            self.max_assured_time = max(self.max_assured_time,
                                        swarm_time.now() + self.min_matchmaking_time - discrepancy)
            self.leader_queue.clear()
            for peer, peer_expiration_time in new_peers:
                if peer == self.peer_id or (peer, peer_expiration_time) in self.past_attempts:
                    continue
                self.leader_queue.store(peer, peer_expiration_time, peer_expiration_time)
                self.max_assured_time = max(self.max_assured_time, peer_expiration_time - discrepancy)
            self.update_finished.set()
            await asyncio.wait(
                {asyncio.create_task(self.running.wait()), asyncio.create_task(self.update_triggered.wait())},
                return_when=asyncio.ALL_COMPLETED,
                timeout=self.search_end_time - swarm_time.now() if math.isfinite(self.search_end_time) else None)
            self.update_triggered.clear()

    async def _declare_averager_periodically(self, step, key_manager) -> None:
        # hivemind's loop (1.1.12, in REVIEWED) with our expiration, and an end once it is None.
        async with self.lock_declare:
            try:
                while True:
                    await self.running.wait()
                    expiration = declared_expiration(
                        swarm_time.now(), scheduled_time=step.scheduled_time,
                        min_matchmaking_time=self.min_matchmaking_time, search_end=self.search_end_time,
                        margin=self.margin)
                    if expiration is None:
                        return
                    self.declared_group_key = group_key = key_manager.current_key
                    self.declared_expiration_time = expiration
                    self.declared_expiration.set()
                    await key_manager.declare_averager(group_key, self.peer_id, expiration_time=expiration)
                    await asyncio.sleep(self.declared_expiration_time - swarm_time.now())
                    if self.running.is_set() and len(self.leader_queue) == 0:
                        await key_manager.update_key_on_not_enough_peers()
            finally:
                if self.declared_group_key is not None:  # withdraw what we declared, as hivemind does
                    key, expiration = self.declared_group_key, self.declared_expiration_time
                    self.declared_group_key, self.declared_expiration_time = None, float("inf")
                    self.leader_queue, self.max_assured_time = TimedStorage[PeerID, float](), float("-inf")
                    await key_manager.declare_averager(key, self.peer_id, expiration, looking_for_group=False)


class ShoalMatchmaking(Matchmaking):
    """hivemind's matchmaking without the peers on our ban list (set up by ``ShoalAverager``: an
    existing instance is given this class and a ``ban_list``): in a group, a banned reducer would
    fail the round for every member."""

    ban_list: BanList
    # id(step) -> the group ids that step's matchmaking assembled (``ShoalAverager._step`` pops it
    # when the step ends, to answer late parts for those groups at once).
    matched: dict[int, list[bytes]]
    # group id -> the leader that sent us that group (as a follower)
    leaders: dict[bytes, PeerID]

    async def look_for_group(self, step):
        group = await super().look_for_group(step)
        if group is not None:
            self.matched.setdefault(id(step), []).append(group.group_id)
        return group

    async def follower_assemble_group(self, leader: PeerID, msg):
        # Who relayed the group's metadata: the peer to ban if that metadata was forged
        # (``ShoalAverager._aggregate_with_group`` pops it; bounded in case a step never runs it).
        self.leaders[msg.group_id] = leader
        while len(self.leaders) > MAX_LEADERS_KEPT:
            del self.leaders[next(iter(self.leaders))]
        return await super().follower_assemble_group(leader, msg)

    async def _request_join_group(self, leader: PeerID):
        if self.ban_list.is_banned(str(leader)):
            return None  # hivemind then asks the next potential leader
        return await super()._request_join_group(leader)

    def _check_reasons_to_reject(self, request, context):
        if self.ban_list.is_banned(str(context.remote_id)):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return super()._check_reasons_to_reject(request, context)
