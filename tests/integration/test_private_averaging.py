"""A private swarm's averaging RPCs (issue 11, admission): real hivemind averagers on loopback. A
donor holding the swarm key serves its state and its outer updates to a peer that proves the key
(and averages with it), and refuses a peer without it (or with another key) — a state download, an update request and a
join request alike, naming the peer in its log — even though that peer can reach it directly."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from averaging.math.wire import WireFormat
from averaging.network.hivemind.backend import HivemindBackend
from averaging.state.served import AppliedUpdate
from protocols.admission import admission_key
from tests.integration.averagers import loopback_averagers

# A few averagers, mostly waiting on matchmaking: run beside the unit tests (scripts/run-suite.sh).
pytestmark = [pytest.mark.integration, pytest.mark.wall_clock]

NUMEL = 10_000
KEY = admission_key(b"our private swarm")


def state() -> tuple[dict, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return {"v": 1, "numel": NUMEL, "round": 4, "rounds_done": 4}, [torch.randn(NUMEL, generator=generator),
                                                                   torch.randn(NUMEL, generator=generator)]


def update_after(rounds_done: int) -> AppliedUpdate | None:
    return AppliedUpdate(4, 4, torch.ones(NUMEL, dtype=torch.float16)) if rounds_done == 3 else None


class Caller:
    """The RPC context of a request from ``peer`` (libp2p authenticates the remote peer id)."""

    def __init__(self, peer: str):
        self.remote_id = PeerID.from_base58(peer)


def join_answer(leader: HivemindBackend, joiner: HivemindBackend) -> int:
    """The first code ``leader`` answers ``joiner``'s join request with (called in this process:
    a refusal needs nothing of the averager process; an admitted request would go on to hivemind)."""
    averager = leader._averager
    serializer = averager.serializer  # as hivemind's matchmaking sends it: [bandwidth, mode, user data]
    gather = serializer.dumps([None, 0, serializer.dumps({"admit": joiner._averager.proof()})])

    async def first() -> int:
        async for message in averager.rpc_join_group(averaging_pb2.JoinRequest(gather=gather),
                                                     Caller(joiner.peer_id)):
            return message.code
        return -1

    return asyncio.run(first())


@pytest.mark.timeout(120)
def test_only_peers_proving_the_swarm_key_get_the_state_an_update_or_a_group(tmp_path):
    log_path = tmp_path / "donor.log"
    handler = logging.FileHandler(log_path)
    backend_logger = logging.getLogger("averaging.network.hivemind")  # the averager and its backend
    backend_logger.addHandler(handler)  # before the averagers fork: they inherit it
    backend_logger.setLevel(logging.INFO)
    prefix = f"private-{uuid.uuid4().hex[:6]}"
    keys = (KEY, KEY, None, admission_key(b"another swarm"))  # donor, member, stranger, other swarm

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=NUMEL, prefix=prefix, state_provider=state, update_provider=update_after,
                               wire=WireFormat.of("fp32"), admission=keys[i], allreduce_timeout=10.0)

    try:
        with loopback_averagers(len(keys), make) as backends:
            donor, member, stranger, other = backends

            # A member of the swarm gets the state and the update, and may join.
            got = member.download_state([donor.peer_id], timeout=10.0)
            assert got is not None and torch.equal(got.tensors[0], state()[1][0])
            update = member.fetch_update([donor.peer_id], rounds_done=3, numel=NUMEL, timeout=10.0)
            assert update is not None and update.rounds_done == 4
            # ...and the two average together: each one's gather carries its proof, each vets the group.
            scheduled = time.time() + 3.0
            for peer in (donor, member):
                peer.prepare(round=1, scheduled_time=scheduled, gather={"round": 1}, timeout=20.0)
            with ThreadPoolExecutor(2) as pool:
                outcomes = list(pool.map(lambda peer: peer.average(torch.ones(NUMEL), weight=1.0, timeout=30.0, round=1),
                                         (donor, member)))
            assert all(outcome.ok and len(outcome.group) == 2 for outcome in outcomes), outcomes
            # Peers without the key (or with another) get nothing: the download and the fetch fail.
            for outsider in (stranger, other):
                assert outsider.download_state([donor.peer_id], timeout=5.0) is None
                assert outsider.fetch_update([donor.peer_id], rounds_done=3, numel=NUMEL, timeout=5.0) is None
                assert join_answer(donor, outsider) == averaging_pb2.PROTOCOL_VIOLATION
    finally:
        backend_logger.removeHandler(handler)
        handler.close()
    log = log_path.read_text()
    for outsider in (stranger, other):
        assert f"refused a state download from {outsider.peer_id}" in log, log[-2000:]
        assert f"refused an outer update request from {outsider.peer_id}" in log, log[-2000:]
        assert f"refused a join request from {outsider.peer_id}" in log, log[-2000:]
    assert f"from {member.peer_id}" not in log
