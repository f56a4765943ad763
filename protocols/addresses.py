"""Parsing and printing the multiaddrs users type and paste.

Every address from a flag goes through py-multiaddr here, before hivemind sees it: a typo then
fails at startup with one line naming the flag, the address and the fix, instead of a p2pd
traceback or a node that silently never finds the swarm.

Peer ids are checked beyond what py-multiaddr does. It accepts any base58 string that decodes
to a multihash-shaped blob (e.g. an identity hash of ``b"hello"``), and hivemind's
``PeerID.from_base58`` only decodes base58, so both would let p2pd reject the address much
later. libp2p peer ids are either a sha2-256 multihash of a public key or an identity
multihash of a protobuf-encoded public key, so we check exactly that.
"""

from __future__ import annotations

import ipaddress

from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from multiaddr import Multiaddr
from multiaddr.exceptions import StringParseError

from protocols.errors import AddressError

_PEER_EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."
_PEER_FIX = f"copy the full address printed by the other peer, like {_PEER_EXAMPLE}"
_NETWORK_PROTOCOLS = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})
_QUIC_PROTOCOLS = frozenset({"quic", "quic-v1"})
_SHA256_MULTIHASH = (0x12, 32)
_IDENTITY_MULTIHASH_CODE = 0x00
_MAX_IDENTITY_PEER_ID_LEN = 42  # libp2p peer-id spec: larger keys must be sha256-hashed
_MAX_REASON_CHARS = 120


def _one_line(text: str, limit: int = _MAX_REASON_CHARS) -> str:
    """Collapse whitespace so an error built from library text stays a single line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _parse_reason(exc: Exception) -> str:
    # StringParseError.__str__ repeats the whole address and the cause; its .message is the gist.
    if isinstance(exc, StringParseError):
        # py-multiaddr parses /p2p/ values as CIDs; users know them as peer ids.
        return _one_line(exc.message.replace("Invalid CID:", "invalid peer id"))
    return _one_line(f"{type(exc).__name__}: {exc}")


def _parse(text: str, flag: str, fix: str) -> tuple[str, list[tuple[str, str | None]]]:
    """Parse with py-multiaddr; return the normalized string and its (protocol, value) parts."""
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"{flag} {text!r}: empty address; {fix}")
    try:
        maddr = Multiaddr(text.strip())
        parts = [(proto.name, value) for proto, value in maddr.items()]
        normalized = str(maddr)
    except Exception as exc:  # py-multiaddr raises ValueError, LookupError, BinaryParseError, ...
        raise AddressError(f"{flag} {text!r}: not a valid multiaddr ({_parse_reason(exc)}); {fix}") from exc
    return normalized, parts


def _has_transport(names: list[str]) -> bool:
    """A dialable libp2p transport: tcp, or udp carrying quic (bare udp is not one)."""
    if "tcp" in names:
        return True
    return any(name == "udp" and nxt in _QUIC_PROTOCOLS for name, nxt in zip(names, names[1:]))


def _peer_id_problem(value: str | None) -> str | None:
    """Why ``value`` is not a libp2p peer id that p2pd can dial, or None if it is one."""
    if not value:
        return "empty peer id"
    try:
        raw = PeerID.from_base58(value).to_bytes()
    except Exception as exc:
        return f"peer id is not base58 ({_one_line(str(exc), 60)})"
    if len(raw) < 2 or raw[1] != len(raw) - 2:
        return "peer id is not a multihash"
    code, digest_len = raw[0], raw[1]
    if (code, digest_len) == _SHA256_MULTIHASH:
        return None
    if code == _IDENTITY_MULTIHASH_CODE and digest_len <= _MAX_IDENTITY_PEER_ID_LEN:
        key = crypto_pb2.PublicKey()
        try:
            key.ParseFromString(raw[2:])
        except Exception:
            return "peer id does not contain a public key"
        # proto2 parsing of b"" succeeds with nothing set, so check the required fields too.
        if key.HasField("key_type") and key.HasField("data") and key.data:
            return None
        return "peer id does not contain a public key"
    return "peer id is not a sha256 or identity multihash"


def parse_peer_multiaddr(text: str, flag: str = "--initial-peer") -> str:
    """Validate an address to dial (e.g. ``--initial-peer``); return its normalized form.

    It must parse, carry a transport (tcp, or udp/quic) and end with ``/p2p/<peer id>`` that
    libp2p accepts. Raises ``AddressError`` with one line naming the address and the fix.
    """
    normalized, parts = _parse(text, flag, _PEER_FIX)
    names = [name for name, _ in parts]
    if not names or names[-1] != "p2p":
        raise AddressError(f"{flag} {text!r}: has no /p2p/<peer id> part at the end; {_PEER_FIX}")
    if not any(name in _NETWORK_PROTOCOLS for name in names):
        raise AddressError(f"{flag} {text!r}: has no /ip4/, /ip6/ or /dns/ host part; {_PEER_FIX}")
    if not _has_transport(names):
        raise AddressError(f"{flag} {text!r}: has no /tcp/<port> or /udp/<port>/quic transport; {_PEER_FIX}")
    for name, value in parts:
        if name == "p2p" and (problem := _peer_id_problem(value)) is not None:
            raise AddressError(f"{flag} {text!r}: {problem}; {_PEER_FIX}")
    return normalized


def peer_id_of(maddr: str) -> str:
    """The peer id a peer multiaddr (``parse_peer_multiaddr``'s output) ends with."""
    return maddr.rsplit("/p2p/", 1)[-1]


def parse_listen_multiaddr(text: str, flag: str = "--listen") -> str:
    """Validate an address to listen on; return its normalized form.

    It needs a host (ip4/ip6/dns) and a transport (tcp, or udp/quic), and no /p2p/ part: our
    own peer id comes from our key, not from the flag.
    """
    fix = "use a local address like /ip4/0.0.0.0/tcp/31337 (or /ip4/0.0.0.0/tcp/0 for any free port)"
    normalized, parts = _parse(text, flag, fix)
    names = [name for name, _ in parts]
    if not names or names[0] not in _NETWORK_PROTOCOLS:
        raise AddressError(f"{flag} {text!r}: must start with /ip4/, /ip6/ or /dns/; {fix}")
    if not _has_transport(names):
        raise AddressError(f"{flag} {text!r}: has no /tcp/<port> or /udp/<port>/quic transport; {fix}")
    if "p2p" in names:
        raise AddressError(f"{flag} {text!r}: a listen address takes no /p2p/ part; {fix}")
    return normalized


def _host(maddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | str | None:
    """The address's host: an IP address, a DNS name, or None (unparsable, or neither)."""
    try:
        name, value = Multiaddr(maddr).items()[0]
    except Exception:
        return None
    if name.name in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(value)
        except ValueError:
            return None
    return value if name.name in _NETWORK_PROTOCOLS else None


def _is_loopback(maddr: str) -> bool:
    host = _host(maddr)
    return host == "localhost" if isinstance(host, str) else host is not None and host.is_loopback


def is_public(maddr: str) -> bool:
    """Whether ``maddr``'s host is on the public internet: a global IP address, or a DNS name other
    than localhost (where it resolves is not known here). Loopback, private, link-local and
    unspecified addresses are not."""
    host = _host(maddr)
    return host != "localhost" if isinstance(host, str) else host is not None and host.is_global


def format_join_command(maddrs: list[str], extra: str = "") -> str:
    """The ready-to-paste line a peer prints so others can join it.

    Non-loopback addresses come first (what a remote user should try), loopback ones are kept
    after them so a local swarm still works. Duplicates are dropped; order is otherwise kept.
    """
    unique = list(dict.fromkeys(str(m) for m in maddrs))
    if not unique:
        raise ValueError("format_join_command needs at least one address")
    ordered = sorted(unique, key=_is_loopback)  # stable: False (remote) before True (loopback)
    words = ["shoal", "run"]
    for maddr in ordered:
        words += ["--initial-peer", maddr]
    if extra.strip():
        words.append(extra.strip())
    return " ".join(words)
