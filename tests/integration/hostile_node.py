"""A whole ``shoal run`` with a hostile twist, for benchmarks.swarm.attacks; lives under tests/ so that
nothing in the CLI can reach it. Each twist patches this process only (and the DHT and averager
processes it forks), before the node starts.

    python -m tests.integration.hostile_node MODE [shoal run options...]

- One of ``hostile_peer.ATTACKS``: the averager is the test-only hostile one, which corrupts its
  all-reduce as ``hostile_peer`` describes.
- ``hijack`` (issue 11, items 5 and 6) lies about its anchor instead, consistently: every claim it
  reports is of a poisoned anchor (its own plus noise of 0.05 RMS) one outer step ahead of its real
  count, and the state it serves to a joiner or a re-syncing peer is that poisoned anchor with a
  matching claim. Its all-reduce parts stay honest.
- ``forged-leader`` (issue 29, item 1): the hijacker, which also makes itself its groups' leader
  (it declares its search to end half a second before everyone else's, so the others join it) and
  sends each follower a group in which the other honest members' claims are forged: their fields
  are the leader's own poisoned claim, their signatures and keys left as they were. Unsigned, each
  follower saw three of four members claim the leader's anchor and re-synced to its state.
- ``donor-scale`` / ``donor-momentum`` (issue 29, item 2): an honest member that serves a poisoned
  state to joiners and re-syncing peers: the true anchor with a claimed scale of 1e300, or the true
  anchor and claim with every other momentum value 1e6.
- ``sybil`` (issue 29, item 3): an honest member that also publishes progress records for
  ``SYBILS`` identities of its own making, each claiming ``sync_late_s = 86400`` (the most a record
  may claim), 1,000 more outer steps than the attacker's and 1e6 tokens/s. Those identities never
  average.
- ``clock`` (issue 54, item 1): an honest member that also runs ``CLOCK_LIARS`` more identities
  (``clock_liars.py``, a child process in its session) whose records' DHT pings answer the time +
  ``CLOCK_LIE_S``. Those identities never average.
- ``far-state`` / ``fake-state`` (sub-groups, ``averaging.target_group_size``): a member whose
  state, as it rides its groups' all-reduce (``averaging.engine.subgroups``), is poisoned: the anchor
  it packs into the extra vector is its own x ``POISON_FACTOR`` (10; the momentum and the
  pseudo-gradient stay honest). ``far-state`` claims that anchor too (the fingerprint attached to
  its rounds' matchmaking; rounds done and scale stay true), so its claim is far from the others'
  and the far-member rule (``averaging.math.fingerprints.far_members``) must give its state
  weight 0 in every reducer. ``fake-state`` keeps its claims honest, so nobody can tell it apart
  before the all-reduce: the reducers' CenteredClip on the extra tensor's parts (around their
  median, no work scaling) must bound its pull, and the members' ``state_problem`` check bounds
  what is left. Its parts stay under ``max_norm_ratio`` (30x) of the others', so no norm check
  refuses them. The state it serves to joiners is its true one.
- ``unsigned``: not hostile: an honest node whose claims travel unsigned and unchecked (the
  backend gets no signer, as in the tests on bare hivemind DHTs), for the cost of signed claims on
  a clean run. Every peer of such a run must be one: a leader that checks claims refuses an
  unsigned join request.
"""

from __future__ import annotations

import copy
import dataclasses
import struct
import subprocess
import sys

import torch
from hivemind.proto import averaging_pb2

from averaging.engine import subgroups
from averaging.engine.subgroups import pack_state
from averaging.math.fingerprints import AnchorClaim, encode_claim, fingerprint
from averaging.network.hivemind import matchmaking as shoal_matchmaking
from averaging.network.hivemind.averager import ShoalAverager
from averaging.network.hivemind.backend import HivemindBackend
from averaging.state.shared_state import SharedState
from node import cli
from node.library import network
from node.library.run_record import DhtDirectory
from protocols import progress, swarm_time
from protocols.identity import PeerKey
from protocols.keys import peers_key
from protocols.messages import ClaimMessage
from protocols.records import ShoalRecordValidator
from protocols.signed_claims import PUBLIC_KEY_FIELD, SIGNATURE_FIELD
from tests.integration.hostile_peer import ATTACK, ATTACKS, HostileBackend

MODES = (*ATTACKS, "hijack", "forged-leader", "donor-scale", "donor-momentum", "sybil", "clock", "far-state", "fake-state",
         "unsigned")
LEAD_BY_S = 0.5  # how much earlier than the others the forged leader declares its search's end
SYBILS = 5  # identities the Sybil publishes records for (the audit's five)
HUGE_SCALE = 1e300
HUGE_MOMENTUM = 1e6
POISON_FACTOR = 10.0  # far-state / fake-state: the anchor sent in a sub-group round is ours x this


# -- hijack: a consistent lie about the anchor -------------------------------------------------------
def poisoned(anchor: torch.Tensor) -> torch.Tensor:
    return anchor + 0.05 * torch.randn(anchor.numel(), generator=torch.Generator().manual_seed(666))


def lie_about_the_anchor() -> None:
    """Patch ``SharedState`` so that its claims and shared state describe a poisoned anchor, one
    outer step ahead."""
    def claim(self: SharedState) -> AnchorClaim:  # never cached: SharedState caches the honest one
        return AnchorClaim(fingerprint(poisoned(self.anchor)), self.scale.clone(), self.rounds_done + 1)

    honest_shared_state = SharedState.shared_state

    def shared_state(self: SharedState):
        metadata, (anchor, momentum) = honest_shared_state(self)
        lie = claim(self)
        metadata = {**metadata, "rounds_done": lie.rounds_done,
                    "claim": encode_claim(lie, round=metadata["round"]).encode()}
        return metadata, [poisoned(anchor), momentum]

    SharedState._current_claim = claim
    SharedState.shared_state = shared_state


# -- forged-leader: a leader that rewrites the claims it relays --------------------------------------
def forged_gathered(serializer, peer_ids: list[bytes], gathered: list[bytes], *, leader: bytes,
                    follower: bytes) -> list[bytes]:
    """What the leader sends ``follower``: its own entry and the follower's as they are, every other
    member's claim replaced by the leader's (poisoned) claim under that member's signature."""
    leader_entry = serializer.loads(gathered[peer_ids.index(leader)])
    leader_claim = serializer.loads(leader_entry[2])
    forged = []
    for peer, raw in zip(peer_ids, gathered):
        if peer in (leader, follower):
            forged.append(raw)
            continue
        bandwidth, mode, user_data = serializer.loads(raw)
        theirs = serializer.loads(user_data)
        lie = {**leader_claim, SIGNATURE_FIELD: theirs.get(SIGNATURE_FIELD), PUBLIC_KEY_FIELD: theirs.get(PUBLIC_KEY_FIELD)}
        forged.append(serializer.dumps([bandwidth, mode, serializer.dumps(lie)]))
    return forged


class ForgingMatchmaking(shoal_matchmaking.ShoalMatchmaking):
    serializer: object

    async def rpc_join_group(self, request, context):
        async for message in super().rpc_join_group(request, context):
            if message.code == averaging_pb2.BEGIN_ALLREDUCE and len(message.gathered) > 2:
                forged = forged_gathered(self.serializer, list(message.ordered_peer_ids), list(message.gathered),
                                         leader=self.peer_id.to_bytes(), follower=context.remote_id.to_bytes())
                del message.gathered[:]
                message.gathered.extend(forged)
            yield message


class ForgingAverager(ShoalAverager):
    _rpc_handlers = None  # hivemind caches RPC tables per class (see ShoalAverager)
    _stub_type = None

    @property
    def _matchmaking(self):
        return ShoalAverager._matchmaking.fget(self)

    @_matchmaking.setter
    def _matchmaking(self, matchmaking) -> None:
        ShoalAverager._matchmaking.fset(self, matchmaking)
        matchmaking.__class__ = ForgingMatchmaking
        matchmaking.serializer = self.serializer


# As hostile_peer's: honest peers reach RPC handlers by the honest class's name.
ForgingAverager.__name__ = ForgingAverager.__qualname__ = ShoalAverager.__name__


class ForgingBackend(HivemindBackend):
    averager_class = ForgingAverager


def lead_every_group() -> None:
    """Declare our search's end ``LEAD_BY_S`` before the honest peers' (same scheduled time), so that
    each of them ranks us first among its potential leaders and asks to join us."""
    honest = shoal_matchmaking.declared_expiration

    def eager(now: float, **kwargs) -> float | None:
        expiration = honest(now, **kwargs)
        if expiration is None or expiration - LEAD_BY_S <= now:  # too late to go first: as honest peers do
            return expiration
        return expiration - LEAD_BY_S

    shoal_matchmaking.declared_expiration = eager


# -- donor-scale / donor-momentum: a poisoned state served to joiners --------------------------------
def serve_poisoned_state(what: str) -> None:
    honest_shared_state = SharedState.shared_state

    def shared_state(self: SharedState):
        metadata, (anchor, momentum) = honest_shared_state(self)
        if what == "scale":
            huge = torch.full((len(self.scale),), HUGE_SCALE, dtype=torch.float64)
            lie = AnchorClaim(fingerprint(anchor), huge, metadata["rounds_done"])
            metadata = {**metadata, "scale": struct.pack(f"<{len(huge)}d", *huge.tolist()),
                        "claim": encode_claim(lie, round=metadata["round"]).encode()}
        else:
            momentum = momentum.clone()
            momentum[::2] = HUGE_MOMENTUM
        return metadata, [anchor, momentum]

    SharedState.shared_state = shared_state


# -- sybil: records of identities that never average --------------------------------------------------
def publish_sybil_records(count: int) -> None:
    """Make ``count`` identities (before the DHT forks: its validator signs their records) and publish
    a record for each beside our own."""
    keys = [PeerKey.generate() for _ in range(count)]
    by_subkey = {ShoalRecordValidator([], key)._own_subkey: key for key in keys}
    honest_sign = ShoalRecordValidator.sign_value

    def sign_value(self: ShoalRecordValidator, record) -> bytes:
        key = by_subkey.get(record.subkey)
        if key is None:
            return honest_sign(self, record)
        as_sybil = copy.copy(self)  # our own signing code, with the Sybil's key
        as_sybil._identity, as_sybil._own_subkey = key, record.subkey
        return honest_sign(as_sybil, record)

    honest_publish = DhtDirectory.publish_progress

    def publish_progress(self: DhtDirectory, record, *, ttl: float) -> None:
        honest_publish(self, record, ttl=ttl)
        for key in keys:
            lie = dataclasses.replace(record, peer_id=key.peer_id, sync_late_s=progress.MAX_LATENESS,
                                      rounds_done=(record.rounds_done or 0) + 1000, tokens_per_s=1e6,
                                      addrs=None)
            self.dht.store(peers_key(self.run_id), subkey=key.public, value=progress.encode(lie),
                           expiration_time=swarm_time.now() + ttl)

    ShoalRecordValidator.sign_value = sign_value
    DhtDirectory.publish_progress = publish_progress


# -- far-state / fake-state: a poisoned state in sub-group rounds ------------------------------------
def poisoned_anchor(anchor: torch.Tensor) -> torch.Tensor:
    """The anchor a ``far-state`` or ``fake-state`` member sends (and ``far-state`` claims)."""
    return anchor * POISON_FACTOR


def send_poisoned_state(*, claim_it: bool) -> None:
    """Patch the round engine's ``pack_state`` (the name ``SubGroups.pack`` calls) so the
    anchor we pack into a sub-group round's extra vector is ``poisoned_anchor``; with ``claim_it``,
    ``SharedState.claim_message`` too (the claim attached to matchmaking, signed as any), so the
    group sees that anchor in our claim. Our own state, and the claim ``state_problem`` checks the
    group's mean against, stay true."""
    subgroups.pack_state = poisoned_pack_state
    if claim_it:
        SharedState.claim_message = poisoned_claim_message


def poisoned_pack_state(state: SharedState, out: torch.Tensor) -> None:
    """``subgroups.pack_state``, with ``poisoned_anchor`` in place of our anchor."""
    pack_state(state, out)
    out[:state.layout.numel] = poisoned_anchor(out[:state.layout.numel])


def poisoned_claim_message(state: SharedState, *, round: int, with_momentum: bool = False) -> ClaimMessage:
    """``SharedState.claim_message`` of ``poisoned_anchor``: our true scale, steps and momentum."""
    with state._lock:
        honest = state._current_claim()
        lie = AnchorClaim(fingerprint(poisoned_anchor(state.anchor)), honest.scale.clone(), honest.rounds_done)
        momentum = fingerprint(state.momentum) if with_momentum else None
    return encode_claim(lie, round=round, momentum=momentum)


# -- unsigned: an honest node without signed claims ---------------------------------------------------
class UnsignedBackend(HivemindBackend):
    def __init__(self, *args, signer=None, **kwargs):
        super().__init__(*args, signer=None, **kwargs)


# -- clock: identities whose pings lie about the time ---------------------------------------------------
CLOCK_LIARS, CLOCK_LIE_S = 5, 3000.0


def start_clock_liars(argv: list[str]) -> None:
    """``clock_liars.py`` for this node's run, through its first initial peer, in our session (it
    ends with the node's process group)."""
    run_id = argv[argv.index("--run-id") + 1]
    initial = argv[argv.index("--initial-peer") + 1]
    subprocess.Popen([sys.executable, "-m", "tests.integration.clock_liars", run_id, initial, str(CLOCK_LIARS),
                      str(CLOCK_LIE_S)])


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in MODES:
        raise SystemExit(f"usage: python -m tests.integration.hostile_node {{{','.join(MODES)}}} [shoal run options]")
    mode = argv[0]
    if mode in ATTACKS:
        ATTACK.value = mode.encode()  # before the averager forks: it reads the shared value
        network.HivemindBackend = HostileBackend  # the one place a node builds its backend
    elif mode in ("hijack", "forged-leader"):
        lie_about_the_anchor()
        if mode == "forged-leader":
            lead_every_group()
            network.HivemindBackend = ForgingBackend
    elif mode.startswith("donor-"):
        serve_poisoned_state(mode.removeprefix("donor-"))
    elif mode == "sybil":
        publish_sybil_records(SYBILS)
    elif mode == "clock":
        start_clock_liars(argv)
    elif mode in ("far-state", "fake-state"):
        send_poisoned_state(claim_it=mode == "far-state")
    elif mode == "unsigned":
        network.HivemindBackend = UnsignedBackend
    sys.argv = ["shoal", "run", *argv[1:]]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
