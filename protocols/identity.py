"""The two signing keys of a swarm: each peer's libp2p identity and each run's organiser key.

- A peer's **identity** is the RSA key its libp2p peer id is the sha256 multihash of (hivemind
  1.1.12 writes identity files as a protobuf ``PrivateKey{key_type: RSA, data: DER}``; p2pd reads
  the same file). The peer signs its DHT records with it and names itself by the public half in
  the record's subkey, so anyone can check that a record under subkey ``K`` was stored by the
  peer whose id is ``hash(K)``: nobody can write, refresh or freeze another peer's record.
- A run's **organiser key** (Ed25519, 32-byte public key, printed in the join line as
  ``--run-key``) signs the run manifest: nobody but the organiser can rewrite the schedule.

Pure: no DHT, no files except through the caller.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from protocols.errors import ConfigError
from protocols.messages import MessageError

MAX_PUBLIC_KEY_BYTES = 1024  # a protobuf-wrapped 4096-bit RSA key is ~550 bytes
MIN_RSA_BITS = 2048
MAX_RSA_BITS = 4096  # hivemind makes 2048-bit keys; a bigger one only costs its verifiers
RSA_EXPONENT = 65537
RUN_KEY_BYTES = 32
_SHA256_MULTIHASH = b"\x12\x20"


class PeerKey:
    """A peer's libp2p identity key (RSA): signs this peer's DHT records."""

    def __init__(self, private: rsa.RSAPrivateKey):
        self._private = private
        self.public = _encode_public(private.public_key())
        self.peer_id = peer_id_of(self.public)

    @classmethod
    def generate(cls) -> PeerKey:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @classmethod
    def from_identity(cls, data: bytes) -> PeerKey:
        """Load an identity file's bytes; ``ValueError`` if they are not an RSA libp2p private key."""
        try:
            proto = crypto_pb2.PrivateKey.FromString(data)
            private = serialization.load_der_private_key(proto.data, password=None)
        except Exception as e:  # protobuf DecodeError, cryptography ValueError/UnsupportedAlgorithm
            raise ValueError(f"not a libp2p private key ({type(e).__name__})") from None
        if proto.key_type != crypto_pb2.KeyType.RSA or not isinstance(private, rsa.RSAPrivateKey):
            raise ValueError("not an RSA libp2p private key (shoal signs its records with the RSA identity "
                             "hivemind creates)")
        return cls(private)

    def identity_bytes(self) -> bytes:
        """The identity file's contents, in the format hivemind and p2pd read."""
        der = self._private.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                          serialization.NoEncryption())
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data, padding.PKCS1v15(), hashes.SHA256())

    # The DHT process gets a copy of its validators; keep the key picklable whatever the start method.
    def __getstate__(self) -> bytes:
        return self.identity_bytes()

    def __setstate__(self, state: bytes) -> None:
        self.__init__(PeerKey.from_identity(state)._private)


def _rsa_public(public: bytes) -> rsa.RSAPublicKey:
    """The RSA key of a peer's public key as received, refused unless it is the one encoding an
    honest peer produces: libp2p hashes the key's bytes as sent into the peer id, so any other
    encoding of the same key (an unknown protobuf field, fields reordered or repeated, PKCS#1 in
    place of SubjectPublicKeyInfo, non-minimal DER) would be a fresh identity for free."""
    if not isinstance(public, bytes) or not 0 < len(public) <= MAX_PUBLIC_KEY_BYTES:
        raise MessageError("not a public key")
    try:
        proto = crypto_pb2.PublicKey.FromString(public)
        key = serialization.load_der_public_key(proto.data)
    except Exception:  # noqa: BLE001 - anything undecodable from the network is just "not a key"
        raise MessageError("not a libp2p public key") from None
    if proto.key_type != crypto_pb2.KeyType.RSA or not isinstance(key, rsa.RSAPublicKey):
        raise MessageError("not an RSA public key")
    # Bounded before any use: verifying costs ~ bits(e) x bits(n)^2, so a 3072-bit key with a
    # 3070-bit exponent verifies ~150 times slower than an honest one. Every libp2p and hivemind
    # RSA identity has e = 65537 (hivemind 1.1.12 generates 2048-bit keys).
    if key.public_numbers().e != RSA_EXPONENT:
        raise MessageError(f"RSA public exponent is not {RSA_EXPONENT}")
    if not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
        raise MessageError(f"RSA key of {key.key_size} bits, not {MIN_RSA_BITS} to {MAX_RSA_BITS} bits")
    if _encode_public(key) != public:
        raise MessageError("public key is not in its canonical encoding (one key, one peer id)")
    return key


def _encode_public(key: rsa.RSAPublicKey) -> bytes:
    """The canonical libp2p encoding: protobuf ``PublicKey{key_type: RSA, data: DER SPKI}``, as
    hivemind's ``PeerID.from_identity`` and p2pd derive the peer id from a private key."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()


def peer_id_of(public: bytes) -> str:
    """The base58 peer id of a protobuf-encoded RSA public key (libp2p: RSA keys are always hashed)."""
    _rsa_public(public)
    return PeerID(_SHA256_MULTIHASH + hashlib.sha256(public).digest()).to_base58()


def verify_peer_signature(public: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``data`` was made by the identity whose public key is ``public``."""
    try:
        _rsa_public(public).verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, MessageError, TypeError, ValueError):
        return False
    return True


class RunKey:
    """A run's organiser key (Ed25519): signs the run manifest."""

    def __init__(self, private: ed25519.Ed25519PrivateKey):
        self._private = private
        self.public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> RunKey:
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, data: bytes) -> RunKey:
        """A key saved by ``to_bytes``; ``ValueError`` if it is not one."""
        if len(data) != RUN_KEY_BYTES:
            raise ValueError(f"an organiser key file holds {RUN_KEY_BYTES} bytes, this one {len(data)}")
        return cls(ed25519.Ed25519PrivateKey.from_private_bytes(data))

    def to_bytes(self) -> bytes:
        return self._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())

    @property
    def text(self) -> str:
        return format_run_key(self.public)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def format_run_key(public: bytes) -> str:
    """What the join line prints after ``--run-key``: 43 base64url characters."""
    return base64.urlsafe_b64encode(public).rstrip(b"=").decode()


def parse_run_key(text: str, flag: str = "--run-key") -> bytes:
    """A run key as the user pasted it; ``ConfigError`` naming the flag and the fix otherwise."""
    fix = "copy the --run-key printed in the organiser's join line"
    try:
        raw = base64.urlsafe_b64decode(text.strip() + "=" * (-len(text.strip()) % 4))
    except (binascii.Error, ValueError, AttributeError):
        raise ConfigError(f"{flag} {text!r:.60}: not base64url; {fix}") from None
    if len(raw) != RUN_KEY_BYTES:
        raise ConfigError(f"{flag} {text!r:.60}: a run key is {RUN_KEY_BYTES} bytes (43 characters); {fix}")
    return raw


def verify_run_signature(public: bytes, data: bytes, signature: bytes) -> bool:
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, TypeError, ValueError):
        return False
    return True
