"""Our DHT node: start it (with a clear error when nobody answers), how it is reachable, stop it.

hivemind's ``DHT`` is a forked process (plus its p2pd daemon) that we talk to through a pipe;
after start-up all our DHT calls happen on one thread at a time (the peer monitor's), because
that pipe is not safe to write from several threads at once (docs/hivemind.md).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hivemind import DHT

from node.library.cleanup import close_hivemind, hivemind_sockets
from protocols import records, safe_decoding, swarm_time
from protocols.errors import ConfigError, NetworkError
from protocols.identity import PeerKey

MIN_SWARM_KEY_BYTES = 16

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Reachability:
    """How this peer can be reached (``--client-mode``, ``--use-relay``), told to the user at start."""

    client_mode: bool = False
    use_relay: bool = False

    @property
    def mode(self) -> str:
        return "client" if self.client_mode else "relay" if self.use_relay else "full"

    def describe(self, maddrs: list[str]) -> str:
        if self.client_mode:
            return ("client mode (--client-mode): outgoing connections only; this peer trains and averages "
                    "but nobody can connect to it, so it serves no state to newcomers")
        if self.use_relay:
            return ("relay mode (--use-relay): reachable through other peers' libp2p relays, for a NAT or "
                    "firewall without port forwarding")
        if maddrs and all(_is_private(m) for m in maddrs):
            return ("full peer, but only on private addresses: peers outside this network cannot reach it; "
                    "forward the port and pass --announce /ip4/<public ip>/tcp/<port>, or use --use-relay "
                    "or --client-mode")
        return "full peer: others connect to it directly"


def _is_private(maddr: str) -> bool:
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        address = ipaddress.ip_address(parts[2])
    except ValueError:
        return False
    return address.is_private or address.is_loopback or address.is_link_local


@dataclass(frozen=True, slots=True)
class RecordRules:
    """What our DHT node validates (``protocols.records``): the records of these runs fully, and
    with a swarm key, only records sealed with it (a private swarm)."""

    run_ids: tuple[str, ...] = ()
    pinned_run_key: bytes | None = None  # --run-key: manifests signed by another key are refused
    swarm_key: bytes | None = None  # --swarm-key FILE's contents


def load_swarm_key(path: Path) -> bytes:
    """``--swarm-key FILE``: the file's bytes are the key (e.g. ``head -c 32 /dev/urandom | base64``)."""
    path = Path(path).expanduser()
    try:
        data = path.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"--swarm-key {path}: cannot read it ({e.strerror}); pass the swarm's key file") from None
    if len(data) < MIN_SWARM_KEY_BYTES:
        raise ConfigError(f"--swarm-key {path}: holds {len(data)} bytes, a swarm key needs at least "
                          f"{MIN_SWARM_KEY_BYTES}; make one with: head -c 32 /dev/urandom | base64 > {path}")
    return data


# hivemind's value cache, off. With it (hivemind's default) every node that reads a key keeps a
# copy and serves it to every later lookup that passes by, and every lookup, a store's included
# (hivemind's store first looks for the key's nearest nodes with the same RPC that returns values),
# takes the copy of each node it visits: in a swarm whose every peer reads every peer's progress
# record each heartbeat, each read came back with up to 20 copies of all N records, N^2 per peer.
# Without it a lookup meets the key's 5 replicas only (benchmarks/results/dht_load.md).
CACHE_VALUES = False


def start_dht(*, initial_peers: list[str], listen: list[str], announce: list[str], timeout: float,
              identity: Path | None = None, reachability: Reachability = Reachability(),
              rules: RecordRules = RecordRules(), cache_values: bool = CACHE_VALUES) -> DHT:
    """Start our DHT node; an unreachable bootstrap peer is a one-line error after ``timeout`` s.
    ``cache_values``: hivemind's value cache (``CACHE_VALUES``; on only to measure what it cost).
    hivemind's decoders are bounded first: the DHT process and the averager, forked later, inherit it.

    Our identity key is loaded (or made) here, before the DHT forks, because its validator signs
    our records with it; without ``identity`` a fresh key lives in a private temp file only until
    p2pd has read it. The key is kept as ``dht.shoal_key`` (``PeerKey``)."""
    safe_decoding.install()
    records.install()
    swarm_time.install()
    if reachability.client_mode and not initial_peers:
        raise ConfigError("--client-mode needs --initial-peer: a peer nobody can connect to cannot start a swarm")
    temp_dir = None
    if identity is not None:
        identity_path = prepare_identity(identity)
        fresh = not Path(identity_path).exists()
    else:
        temp_dir = tempfile.mkdtemp(prefix="shoal-identity-")
        identity_path, fresh = os.path.join(temp_dir, "identity.key"), True
    if fresh:
        peer_key = PeerKey.generate()
        fd = os.open(identity_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as handle:
            handle.write(peer_key.identity_bytes())
    else:
        try:
            peer_key = PeerKey.from_identity(Path(identity_path).read_bytes())
        except (OSError, ValueError) as e:
            raise ConfigError(f"identity file {identity_path} cannot be used ({e}); delete it to create a new one "
                              "(this peer's id will change)") from None
    validators = [records.ShoalRecordValidator(rules.run_ids, peer_key, pinned_run_key=rules.pinned_run_key),
                  records.SwarmKeyValidator(rules.swarm_key)]
    sockets_before = hivemind_sockets()
    try:
        try:
            dht = _start(initial_peers, listen, announce, timeout, identity_path, reachability, validators,
                         sockets_before, check_identity=not fresh, cache_values=cache_values)
        except _ClockSkew as e:
            # hivemind refuses to bootstrap when an initial peer's time is more than 3 s from ours;
            # its error gives both times, so we start again on the peer's (the first estimate of
            # swarm time; the monitor's probes refine it). Once: a second refusal is reported.
            if abs(swarm_time.offset() + e.skew) > swarm_time.MAX_OFFSET_S:
                raise e.error from None
            swarm_time.set_offset(swarm_time.offset() + e.skew)
            logger.warning(f"this machine's clock is {abs(e.skew):.1f}s {'ahead of' if e.skew < 0 else 'behind'} "
                           "its initial peer's: starting again on the peer's time (enable NTP to fix the clock)")
            try:
                dht = _start(initial_peers, listen, announce, timeout, identity_path, reachability, validators,
                             sockets_before, check_identity=False, cache_values=cache_values)
            except _ClockSkew as again:
                raise again.error from None
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    dht.shoal_key = peer_key
    return dht


def _start(initial_peers, listen, announce, timeout, identity_path, reachability, validators, sockets_before,
           *, check_identity: bool, cache_values: bool) -> DHT:
    dht = DHT(
        initial_peers=initial_peers or None,
        host_maddrs=listen or ["/ip4/0.0.0.0/tcp/0"],
        announce_maddrs=announce or None,
        identity_path=identity_path,
        client_mode=reachability.client_mode,
        use_relay=True,  # hivemind's default: we may dial peers that are reachable only via relays
        use_auto_relay=reachability.use_relay,
        record_validators=validators,
        # A key made a moment ago cannot be in use elsewhere: skip hivemind's probe (another p2pd).
        check_if_identity_free=check_identity,
        cache_locally=cache_values,
        cache_nearest=1 if cache_values else 0,
        start=False,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
        return dht
    except BaseException as e:
        shutdown_dht(dht, sockets_before)
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if check_identity and "already taken" in reason:
            raise ConfigError(f"another peer is already running with the identity in {identity_path}; stop it or "
                              "pass a different --identity") from None
        if check_identity and ("unmarshal" in reason or "proto" in reason.lower()):
            raise ConfigError(f"identity file {identity_path} is not a libp2p private key; delete it to create a "
                              "new one (this peer's id will change)") from None
        if initial_peers and (skew := bootstrap_skew(str(e))) is not None:
            raise _ClockSkew(skew, NetworkError(
                f"the initial peers' clocks disagree with this machine's by {abs(skew):.1f}s and with each other; "
                "enable NTP on this machine (timedatectl set-ntp true) and try again")) from None
        if initial_peers:
            raise NetworkError(
                f"could not reach any initial peer ({', '.join(initial_peers)}) within {timeout:.0f}s ({reason[:160]}); "
                "check that the peer is running and that its address and port are reachable from here"
            ) from None
        raise NetworkError(f"could not start the DHT on {', '.join(listen) or 'the default address'}: {reason[:200]}; "
                           "check --listen (is the port free?)") from None


class _ClockSkew(Exception):
    """The bootstrap was refused for our clock: ``skew`` seconds behind the peer's (negative: ahead)."""

    def __init__(self, skew: float, error: NetworkError):
        super().__init__(str(error))
        self.skew, self.error = skew, error


# hivemind's ping validation error: "local time must be within 3 seconds  of others(local: <t>, peer: <t>)"
_SKEW = re.compile(r"local time must be within .*local: (-?[0-9.]+), peer: (-?[0-9.]+)")


def bootstrap_skew(reason: str) -> float | None:
    """Seconds the initial peer's clock is ahead of ours, from hivemind's refusal (None: another error)."""
    found = _SKEW.search(reason)
    return float(found.group(2)) - float(found.group(1)) if found else None


def prepare_identity(path: Path) -> str:
    """The identity file for ``--identity``: hivemind creates it on first use; we make its folder
    and refuse a path that cannot hold a key (a folder, an empty file) with a fix."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"--identity {path} is a directory; pass a file path, e.g. {path / 'identity.key'}")
    if path.exists() and path.stat().st_size == 0:
        raise ConfigError(f"identity file {path} is empty; delete it to create a new one (this peer's id will change)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the folder for --identity {path}: {e.strerror}") from None
    return str(path)


def shutdown_dht(dht: DHT, sockets_before: set[str] | None = None) -> None:
    """Stop a DHT we started: a clean shutdown if it is alive, SIGTERM if that fails, then
    whatever of its process tree (p2pd) is left is killed and its stale sockets removed."""
    close_hivemind([lambda: stop_dht(dht)], [dht.pid],
                   hivemind_sockets() if sockets_before is None else sockets_before)


def stop_dht(dht: DHT) -> None:
    """A clean shutdown if the DHT process is alive, SIGTERM if that fails (the one way to stop it;
    callers reap what is left with ``close_hivemind``)."""
    try:
        if dht.is_alive():
            dht.shutdown()
    finally:
        if dht.is_alive():
            dht.terminate()


def open_client_dht(initial_peers: list[str], timeout: float, rules: RecordRules = RecordRules()) -> DHT:
    """A client-mode DHT node bootstrapped from ``initial_peers`` (``NetworkError`` if none answers);
    ``rules`` must name the run it reads, or its signed records are not unwrapped."""
    return start_dht(initial_peers=initial_peers, listen=[], announce=[], timeout=timeout,
                     reachability=Reachability(client_mode=True), rules=rules)


def dht_peer_count(dht: DHT) -> int:
    """How many peers our DHT node knows (its routing table): an entry point's health figure."""
    return int(dht.run_coroutine(_routing_table_size))


async def _routing_table_size(_dht: DHT, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)
