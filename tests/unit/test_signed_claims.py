"""Signed claims (issue 29, item 1): a group's leader relays every member's claim, and can no longer
forge one. The audit's attack: a hostile leader sends each follower a group in which the other
honest members' claims are junk and two members (itself and one more identity) claim its own
anchor, so that every follower believes it alone diverged and re-syncs to the leader's state."""

from __future__ import annotations

import asyncio
import types

import pytest
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from averaging.math.robust import BanList
from averaging.network.hivemind.allreduce import (
    ForgedGroup,
    RobustCounters,
    gathered_signature_problem,
    vet_group,
)
from averaging.network.hivemind.averager import ShoalAverager
from protocols.identity import PeerKey
from protocols.signed_claims import sign_claim, signature_problem

PREFIX = "shoal-test-run.averaging"
KEYS = [PeerKey.generate() for _ in range(4)]  # 3 honest members and the hostile leader (last)
HONEST, LEADER = KEYS[:3], KEYS[3]


def claim(round: int = 7, rounds_done: int = 6, proj: bytes = b"\x00" * 16) -> dict:
    return {"v": 5, "round": round, "rounds_done": rounds_done, "numel": 10, "chunk_len": 8, "k": 1, "proj": proj,
            "scale": b"\x00" * 16}


def entry(user_data: dict, mode: AveragingMode = AveragingMode.NODE) -> bytes:
    return MSGPackSerializer.dumps([None, mode.value, MSGPackSerializer.dumps(user_data)])


def signed(key: PeerKey, data: dict | None = None, mode: AveragingMode = AveragingMode.NODE) -> bytes:
    return entry(sign_claim(data or claim(), key, prefix=PREFIX, mode=mode.value), mode)


def test_a_signed_claim_verifies_and_any_change_breaks_it():
    data = sign_claim(claim(), HONEST[0], prefix=PREFIX, mode=0)
    ok = dict(peer_id=HONEST[0].peer_id, prefix=PREFIX, mode=0)
    assert signature_problem(data, **ok) is None
    assert signature_problem({**data, "admit": b"proof"}, **ok) is None  # the admission proof is its own HMAC
    assert "another peer" in signature_problem(data, **{**ok, "peer_id": HONEST[1].peer_id})
    assert "does not match" in signature_problem(data, **{**ok, "prefix": "another-run.averaging"})
    assert "does not match" in signature_problem(data, **{**ok, "mode": 1})  # a leader cannot make us a client
    for field, value in [("round", 8), ("rounds_done", 5), ("proj", b"\x01" * 16), ("extra", 1)]:
        assert "does not match" in signature_problem({**data, field: value}, **ok), field  # no replay in round 8
    assert "not signed" in signature_problem(claim(), **ok)
    assert "not a map" in signature_problem(b"junk", **ok)
    # A key that is not a libp2p RSA key, or a signature that is not bytes
    assert "refused" in signature_problem({**data, "pub": b"\x08\x00"}, **ok)
    assert "not signed" in signature_problem({**data, "sig": 5}, **ok)


def forged_group(signed_junk: bool) -> GroupInfo:
    """What the hostile leader sends follower 0: its own claim, junk for the two other honest
    members (signed with the leader's own key if ``signed_junk``), and its poisoned anchor claimed
    by itself and by one extra identity."""
    extra = PeerKey.generate()
    poisoned = claim(rounds_done=5, proj=b"\x07" * 16)
    junk = claim(proj=b"\x09" * 16)
    peers = [HONEST[0], HONEST[1], HONEST[2], LEADER, extra]
    forge = (lambda: signed(LEADER, junk)) if signed_junk else (lambda: entry(junk))
    entries = [signed(HONEST[0]), forge(), forge(),
               signed(LEADER, poisoned), signed(extra, poisoned)]
    return GroupInfo(b"group-id", tuple(PeerID.from_base58(k.peer_id) for k in peers), tuple(entries))


def vet(group: GroupInfo, **kwargs):
    return vet_group(group, peer_id=PeerID.from_base58(HONEST[0].peer_id), bandwidth=None, mode=AveragingMode.NODE,
                     max_group_size=8, serializer=MSGPackSerializer, **kwargs)


def test_a_leader_cannot_forge_another_members_claim():
    group = forged_group(signed_junk=False)
    vet(group)  # without signatures (hivemind's relay) the forgery passed: the audit's attack
    with pytest.raises(ForgedGroup, match="is not signed"):
        vet(group, signed_prefix=PREFIX)
    # Junk signed with the leader's own key names the wrong signer
    with pytest.raises(ForgedGroup, match="signed by another peer"):
        vet(forged_group(signed_junk=True), signed_prefix=PREFIX)
    honest = GroupInfo(b"group-id", tuple(PeerID.from_base58(k.peer_id) for k in KEYS),
                       tuple(signed(k) for k in KEYS))
    assert vet(honest, signed_prefix=PREFIX).peer_ids == honest.peer_ids
    # A leader that turns a member into a client (it would reduce nothing) is caught as well
    as_client = list(honest.gathered)
    as_client[1] = MSGPackSerializer.dumps([None, AveragingMode.CLIENT.value,
                                            MSGPackSerializer.loads(honest.gathered[1])[2]])
    with pytest.raises(ForgedGroup, match="does not match"):
        vet(GroupInfo(b"group-id", honest.peer_ids, tuple(as_client)), signed_prefix=PREFIX)


def fake_averager(leader: PeerKey) -> types.SimpleNamespace:
    me = types.SimpleNamespace(
        peer_id=PeerID.from_base58(HONEST[0].peer_id), bandwidth=None, mode=AveragingMode.NODE, _max_group_size=8,
        serializer=MSGPackSerializer, _admission=None, prefix=PREFIX, _signed_claims=True,
        _matchmaking=types.SimpleNamespace(leaders={b"group-id": PeerID.from_base58(leader.peer_id)}),
        _ban_list=BanList(10), robust_counters=RobustCounters())
    return me


def test_the_leader_that_relayed_a_forged_group_is_banned_and_the_round_fails():
    me = fake_averager(LEADER)
    with pytest.raises(MatchmakingException, match="refused the group"):
        asyncio.run(ShoalAverager._aggregate_with_group(me, forged_group(signed_junk=False), 0))
    assert me._ban_list.banned == [LEADER.peer_id]  # and only the leader: the members' claims were its forgery
    assert me.robust_counters.snapshot()["bans"] == 1
    assert me._matchmaking.leaders == {}  # forgotten once the group was judged


def test_a_leader_checks_each_join_request_it_receives():
    good = signed(HONEST[1])
    assert gathered_signature_problem(MSGPackSerializer, good, peer_id=HONEST[1].peer_id, prefix=PREFIX) is None
    assert "another peer" in gathered_signature_problem(MSGPackSerializer, good, peer_id=HONEST[2].peer_id,
                                                        prefix=PREFIX)
    assert "not signed" in gathered_signature_problem(MSGPackSerializer, entry(claim()), peer_id=HONEST[1].peer_id,
                                                      prefix=PREFIX)
    assert "undecodable" in gathered_signature_problem(MSGPackSerializer, b"\xc1", peer_id=HONEST[1].peer_id,
                                                       prefix=PREFIX)
