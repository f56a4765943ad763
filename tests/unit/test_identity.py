"""Peer identities on crafted public keys: one RSA key is one peer id (only its canonical encoding
is accepted), keys that cost a verifier more than an honest one are refused, and the ids of real
hivemind identities are the ones libp2p derives."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

from protocols import identity
from protocols.identity import PeerKey, peer_id_of, verify_peer_signature
from protocols.messages import MessageError

KEY = PeerKey.generate()


def encoded(public: rsa.RSAPublicKey, der_format=serialization.PublicFormat.SubjectPublicKeyInfo) -> bytes:
    """A libp2p public key as an honest peer encodes it (or with another DER layout inside)."""
    der = public.public_bytes(serialization.Encoding.DER, der_format)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()


def with_numbers(e: int, n: int) -> bytes:
    return encoded(rsa.RSAPublicNumbers(e, n).public_key())


def odd_modulus(bits: int) -> int:
    """Any odd number of exactly ``bits`` bits: enough to build (not to use) a public key."""
    return (1 << (bits - 1)) | 0xB5A3 | 1


def test_a_generated_identity_keeps_the_peer_id_libp2p_derives():
    assert peer_id_of(KEY.public) == PeerID.from_identity(KEY.identity_bytes()).to_base58() == KEY.peer_id


def test_a_hivemind_identity_file_keeps_the_peer_id_libp2p_derives(tmp_path):
    path = tmp_path / "identity.key"
    P2P.generate_identity(str(path))  # what hivemind writes when it creates an identity itself
    loaded = PeerKey.from_identity(path.read_bytes())
    assert peer_id_of(loaded.public) == PeerID.from_identity(path.read_bytes()).to_base58()


@pytest.mark.parametrize("variant", ["appended field", "fields swapped", "field repeated", "PKCS#1 inside"])
def test_one_rsa_key_has_one_accepted_encoding(variant):
    public = KEY.public
    crafted = {
        "appended field": public + b"\x18\x01",  # an unknown field 3: protobuf parsers skip it
        "fields swapped": public[2:] + public[:2],  # data before key_type: the same message
        "field repeated": b"\x08\x00" + public,  # key_type twice: the last one wins
        "PKCS#1 inside": encoded(KEY._private.public_key(), serialization.PublicFormat.PKCS1),
    }[variant]
    with pytest.raises(MessageError, match="canonical"):
        peer_id_of(crafted)
    signature = KEY.sign(b"data")
    assert verify_peer_signature(public, b"data", signature)
    assert not verify_peer_signature(crafted, b"data", signature)


def test_only_the_exponent_65537_is_accepted():
    n = KEY._private.public_key().public_numbers().n
    assert peer_id_of(with_numbers(65537, n))
    # A 3070-bit exponent made a 3072-bit key's verification ~150 times slower than an honest one.
    huge = (1 << 3069) | 1
    for e in (3, 17, huge):
        with pytest.raises(MessageError, match="65537"):
            peer_id_of(with_numbers(e, odd_modulus(3072) if e == huge else n))


@pytest.mark.parametrize("bits", [1024, 2047, 4097, 6000])
def test_a_key_outside_2048_to_4096_bits_is_refused(bits):
    public = with_numbers(65537, odd_modulus(bits))
    assert len(public) <= identity.MAX_PUBLIC_KEY_BYTES  # refused for its size in bits, not in bytes
    with pytest.raises(MessageError, match="2048 to 4096 bits"):
        peer_id_of(public)


@pytest.mark.parametrize("bits", [2048, 3072, 4096])
def test_keys_of_2048_to_4096_bits_are_accepted(bits):
    assert peer_id_of(with_numbers(65537, odd_modulus(bits)))
