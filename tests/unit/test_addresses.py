import base58
import pytest

from protocols.addresses import (
    format_join_command,
    parse_listen_multiaddr,
    parse_peer_multiaddr,
)
from protocols.errors import AddressError, ShoalError

ED25519_ID = "12D3KooWNSgyp7Jk9sKE6bQqBHmCKDCX6ayX3cFHpLdcFWUy56Sd"  # identity multihash of a key
RSA_ID = "QmTXBvkP4c7dTFVHy1zWMn2p2GvS6hUgSjtFQyJSTJwmv6"  # sha256 multihash
# Decodes to a well-formed identity multihash of b"hello": py-multiaddr and PeerID.from_base58
# both accept it, but it holds no public key, so p2pd could never dial it.
NOT_A_KEY_ID = base58.b58encode(b"\x00\x05hello").decode()


def assert_one_line_error(excinfo: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message
    return message


@pytest.mark.parametrize(
    "maddr",
    [
        f"/ip4/127.0.0.1/tcp/31337/p2p/{ED25519_ID}",
        f"/ip4/203.0.113.5/tcp/4001/p2p/{RSA_ID}",
        f"/ip6/::1/tcp/4001/p2p/{ED25519_ID}",
        f"/dns/peer.example.com/tcp/4001/p2p/{ED25519_ID}",
        f"/ip4/203.0.113.5/udp/4001/quic/p2p/{ED25519_ID}",
        f"/ip4/203.0.113.5/udp/4001/quic-v1/p2p/{ED25519_ID}",
        f"/ip4/203.0.113.5/tcp/4001/p2p/{RSA_ID}/p2p-circuit/p2p/{ED25519_ID}",
    ],
)
def test_good_peer_addresses_round_trip(maddr):
    assert parse_peer_multiaddr(maddr) == maddr


def test_peer_address_is_normalized_and_stripped():
    text = f"  ip4/127.0.0.1//tcp/31337/p2p/{ED25519_ID}\n"
    assert parse_peer_multiaddr(text) == f"/ip4/127.0.0.1/tcp/31337/p2p/{ED25519_ID}"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("/ip4/1.2.3/tcp/1", "not a valid multiaddr"),
        ("garbage", "not a valid multiaddr"),
        (f"/ip4/127.0.0.1/tcp/99999/p2p/{ED25519_ID}", "not a valid multiaddr"),
        ("/ip4/127.0.0.1/tcp/4001", "no /p2p/<peer id>"),
        (f"/ip4/127.0.0.1/tcp/4001/p2p/{ED25519_ID}/tcp/5", "no /p2p/<peer id>"),
        (f"/p2p/{ED25519_ID}", "no /ip4/, /ip6/ or /dns/"),
        (f"/ip4/127.0.0.1/udp/4001/p2p/{ED25519_ID}", "transport"),
        (f"/ip4/127.0.0.1/tcp/4001/p2p/{ED25519_ID[:-1]}", "invalid peer id"),
        ("/ip4/127.0.0.1/tcp/4001/p2p/not0a0peer0id", "invalid peer id"),
        (f"/ip4/127.0.0.1/tcp/4001/p2p/{NOT_A_KEY_ID}", "public key"),
    ],
)
def test_bad_peer_addresses_rejected_with_one_line(text, reason):
    with pytest.raises(AddressError) as excinfo:
        parse_peer_multiaddr(text)
    message = assert_one_line_error(excinfo, "--initial-peer", repr(text), reason)
    assert "copy the full address printed by the other peer" in message


@pytest.mark.parametrize("text", ["", "   ", "/"])
def test_empty_peer_address_rejected(text):
    # py-multiaddr parses "" and "/" as a valid empty multiaddr; we must not.
    with pytest.raises(AddressError) as excinfo:
        parse_peer_multiaddr(text)
    assert_one_line_error(excinfo, "--initial-peer")


def test_multiline_garbage_still_gives_one_line():
    with pytest.raises(AddressError) as excinfo:
        parse_peer_multiaddr("/ip4/1.2.3.4\n/tcp/1\n/p2p/x")
    assert_one_line_error(excinfo, "--initial-peer")


def test_address_error_has_its_exit_code():
    with pytest.raises(ShoalError) as excinfo:
        parse_peer_multiaddr("nope")
    assert excinfo.value.exit_code == 3


@pytest.mark.parametrize(
    "maddr",
    ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/31337", "/ip4/127.0.0.1/udp/0/quic", "/dns/localhost/tcp/1"],
)
def test_good_listen_addresses(maddr):
    assert parse_listen_multiaddr(maddr) == maddr


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty"),
        ("/ip4/0.0.0.0", "transport"),
        ("/tcp/31337", "must start with"),
        ("/ip4/0.0.0.0/udp/1", "transport"),
        (f"/ip4/0.0.0.0/tcp/0/p2p/{ED25519_ID}", "no /p2p/"),
        ("/ip4/300.0.0.0/tcp/0", "not a valid multiaddr"),
    ],
)
def test_bad_listen_addresses_name_the_flag(text, reason):
    with pytest.raises(AddressError) as excinfo:
        parse_listen_multiaddr(text, flag="--announce")
    assert_one_line_error(excinfo, "--announce", repr(text), reason)


def test_join_command_puts_remote_addresses_first_and_keeps_loopback():
    loop4 = f"/ip4/127.0.0.1/tcp/31337/p2p/{ED25519_ID}"
    loop6 = f"/ip6/::1/tcp/31337/p2p/{ED25519_ID}"
    lan = f"/ip4/192.168.1.7/tcp/31337/p2p/{ED25519_ID}"
    public = f"/ip4/203.0.113.5/tcp/31337/p2p/{ED25519_ID}"
    line = format_join_command([loop4, lan, loop6, public, lan], extra="--run-id foo")
    assert line == (
        f"shoal run --initial-peer {lan} --initial-peer {public}"
        f" --initial-peer {loop4} --initial-peer {loop6} --run-id foo"
    )


def test_join_command_output_parses_back():
    maddr = f"/ip4/127.0.0.1/tcp/31337/p2p/{ED25519_ID}"
    words = format_join_command([maddr]).split()
    assert words == ["shoal", "run", "--initial-peer", maddr]
    assert parse_peer_multiaddr(words[3]) == maddr


def test_join_command_needs_an_address():
    with pytest.raises(ValueError):
        format_join_command([])
