"""Entry-point plumbing: @FILE peer lists, the address file, identity paths, reachability text."""

from __future__ import annotations

import threading
import time

import pytest

from node.library.bootstrap import expand_initial_peers, write_address_file
from node.library.dht import Reachability, prepare_identity
from protocols.errors import AddressError, ConfigError

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWJL9H72hNXUR9C5WppL79Jhh7GTmdgtogAcf1ANSKKCqV"
OTHER = "/ip4/10.0.0.2/tcp/31337/p2p/QmRPP7FXDx7CeWRwwKQmhQmDYnEXEHrCUHZVywYB8hg9bT"


def test_address_file_round_trip(tmp_path):
    path = tmp_path / "shared" / "bootstrap.maddr"
    write_address_file(path, [PEER, OTHER])
    assert path.read_text() == f"{PEER}\n{OTHER}\n"
    assert expand_initial_peers([f"@{path}"], timeout=1) == [PEER, OTHER]
    assert [p.name for p in path.parent.iterdir()] == ["bootstrap.maddr"]  # no temp file left


def test_plain_and_file_peers_mix_without_duplicates(tmp_path):
    path = tmp_path / "peers"
    path.write_text(f"# entry points\n\n{OTHER}\n{PEER}\n")
    assert expand_initial_peers([PEER, f"@{path}"], timeout=1) == [PEER, OTHER]


def test_a_file_that_appears_later_is_waited_for(tmp_path):
    path = tmp_path / "late"
    threading.Timer(0.3, write_address_file, args=(path, [PEER])).start()
    started = time.monotonic()
    assert expand_initial_peers([f"@{path}"], timeout=10) == [PEER]
    assert time.monotonic() - started < 5


def test_a_missing_file_times_out_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="did not appear within 0s; start the bootstrap peer with --address-file"):
        expand_initial_peers([f"@{tmp_path / 'nope'}"], timeout=0.0)


def test_an_empty_file_and_a_bad_address_in_a_file_are_named(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="lists no address"):
        expand_initial_peers([f"@{empty}"], timeout=1)
    bad = tmp_path / "bad"
    bad.write_text("/ip4/1.2.3.4/tcp/99\n")
    with pytest.raises(AddressError, match="@"):
        expand_initial_peers([f"@{bad}"], timeout=1)


def test_identity_paths(tmp_path):
    assert prepare_identity(tmp_path / "a" / "b" / "id.key") == str(tmp_path / "a" / "b" / "id.key")
    assert (tmp_path / "a" / "b").is_dir()
    with pytest.raises(ConfigError, match="is a directory"):
        prepare_identity(tmp_path)
    (tmp_path / "empty.key").write_bytes(b"")
    with pytest.raises(ConfigError, match="is empty; delete it"):
        prepare_identity(tmp_path / "empty.key")


@pytest.mark.parametrize(("reach", "maddrs", "expected"), [
    (Reachability(client_mode=True), [], "client mode"),
    (Reachability(use_relay=True), [PEER], "relay mode"),
    (Reachability(), [PEER, "/ip4/192.168.1.5/tcp/1/p2p/x"], "only on private addresses"),
    (Reachability(), ["/ip4/34.1.2.3/tcp/31337/p2p/x"], "full peer: others connect to it directly"),
])
def test_reachability_tells_the_user_which_mode_and_why(reach, maddrs, expected):
    assert expected in reach.describe(maddrs)
    assert reach.mode in ("client", "relay", "full")
