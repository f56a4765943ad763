"""Signed claims: every member signs the claim it attaches to an all-reduce with its libp2p key.

hivemind 1.1.12 relays each member's gathered metadata (``[bandwidth, mode, user data]``, the user
data being our claim) through the group's leader, unsigned: a follower takes the leader's
``gathered`` as sent (``Matchmaking.follower_assemble_group``). A hostile leader could therefore
write any claim for any member, make every follower believe it alone diverged, and have it
re-sync to the leader's own state (docs/security.md). Signed, a claim is bound to its member's
peer id, the run's averaging prefix, the member's averaging mode and the claim's round: a leader
can relay or drop a member's claim, never forge or change one. Replaying a member's claim within
its round repeats what that member said anyway; the round stops a replay into a later round.

The signature covers a canonical encoding of the claim's fields (msgpack of the sorted items,
without the signature, the public key and a private swarm's admission proof), so it survives
hivemind's decode and re-encode on the way. Pure: no network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from protocols.identity import PeerKey, peer_id_of, verify_peer_signature
from protocols.messages import MessageError

SIGNATURE_FIELD = "sig"
PUBLIC_KEY_FIELD = "pub"
# Fields outside the signature: the signature itself, the key it is checked with (bound to the
# peer id instead), and the admission proof (an HMAC of its own, over the peer id).
UNSIGNED_FIELDS = frozenset({SIGNATURE_FIELD, PUBLIC_KEY_FIELD, "admit"})
MAX_SIGNATURE_BYTES = 1024  # an RSA-4096 signature is 512 bytes
_DOMAIN = b"shoal-claim/1\0"


def signed_bytes(claim: Mapping[str, Any], *, prefix: str, peer_id: str, mode: int) -> bytes:
    """What a member signs: the domain, the run's averaging prefix, its peer id and mode, and the
    claim's own fields in a canonical encoding."""
    fields = sorted((key, value) for key, value in claim.items() if key not in UNSIGNED_FIELDS)
    return _DOMAIN + msgpack.packb([prefix, peer_id, int(mode), fields], use_bin_type=True)


def sign_claim(claim: Mapping[str, Any], key: PeerKey, *, prefix: str, mode: int) -> dict[str, Any]:
    """``claim`` with our signature and public key added (the claim this peer gathers)."""
    data = signed_bytes(claim, prefix=prefix, peer_id=key.peer_id, mode=mode)
    return {**claim, SIGNATURE_FIELD: key.sign(data), PUBLIC_KEY_FIELD: key.public}


def signature_problem(claim: Any, *, peer_id: str, prefix: str, mode: int) -> str | None:
    """Why ``claim`` (as gathered for ``peer_id``) was not signed by that peer, or None if it was."""
    if not isinstance(claim, Mapping):
        return "the claim is not a map"
    public, signature = claim.get(PUBLIC_KEY_FIELD), claim.get(SIGNATURE_FIELD)
    if not isinstance(public, bytes) or not isinstance(signature, bytes) or len(signature) > MAX_SIGNATURE_BYTES:
        return "the claim is not signed"
    try:
        owner = peer_id_of(public)
    except MessageError as e:
        return f"the claim's key is refused ({e})"
    if owner != peer_id:
        return f"the claim is signed by another peer ({owner})"
    try:
        data = signed_bytes(claim, prefix=prefix, peer_id=peer_id, mode=mode)
    except (TypeError, ValueError, OverflowError):  # a field msgpack cannot encode: not one we sent
        return "the claim has fields no peer signs"
    if not verify_peer_signature(public, data, signature):
        return "the claim's signature does not match it"
    return None
