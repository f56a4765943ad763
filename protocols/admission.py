"""Private-swarm admission on the averaging RPCs: a peer proves it holds the swarm key.

Why: sealing DHT records with the swarm key (``protocols.records.SwarmKeyValidator``) keeps a
keyless peer out of the DHT, so it cannot find a group through matchmaking; but a peer id learnt
elsewhere can still be called directly (join its group, download its state or an outer update).
So every such request carries a proof, ``HMAC(key, "shoal admit" + caller's peer id)``, and the
callee checks it against the caller's libp2p-authenticated peer id: a proof is useless to any
other peer, and proves the key without revealing it. A public swarm (no key) asks for nothing.
Pure functions; the averager wires them (``averaging.network.hivemind.backend``).
"""

from __future__ import annotations

import hashlib
import hmac

PROOF_BYTES = 32


def admission_key(swarm_key: bytes) -> bytes:
    """The key proofs are made with: derived, so it differs from the DHT records' sealing key."""
    return hashlib.sha256(b"shoal admission key\0" + swarm_key).digest()


def make_proof(key: bytes, peer_id: str) -> bytes:
    """What ``peer_id`` attaches to its requests to show it holds the swarm key."""
    return hmac.new(key, b"shoal admit\0" + peer_id.encode(), hashlib.sha256).digest()


def admitted(key: bytes | None, peer_id: str, proof: object) -> bool:
    """Whether a request from ``peer_id`` carrying ``proof`` is admitted (always, without a key)."""
    if key is None:
        return True
    return isinstance(proof, bytes) and len(proof) == PROOF_BYTES and hmac.compare_digest(proof, make_proof(key, peer_id))
