"""``shoal bootstrap``: a light DHT-only entry peer (no model, no GPU) for a swarm."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import typer

from node.commands.common import EXIT_OK, configure_logging, fail
from node.process.signals import Interrupts
from protocols.errors import ShoalError

logger = logging.getLogger("node.commands.bootstrap")


def bootstrap(
    listen: list[str] = typer.Option([], "--listen", envvar="SHOAL_LISTEN", metavar="MADDR", help="Multiaddr to listen on (repeatable). Default /ip4/0.0.0.0/tcp/31337."),
    announce: list[str] = typer.Option([], "--announce", envvar="SHOAL_ANNOUNCE", metavar="MADDR", help="Public multiaddr to announce, e.g. /ip4/203.0.113.5/tcp/31337 (repeatable)."),
    identity: Path = typer.Option(None, "--identity", envvar="SHOAL_IDENTITY", metavar="PATH", help="Private key file: a stable peer id, so the published address stays valid (created on first use)."),
    initial_peer: list[str] = typer.Option([], "--initial-peer", envvar="SHOAL_INITIAL_PEERS", metavar="MADDR", help="Another entry point of the same swarm (repeatable; @FILE reads addresses from FILE)."),
    address_file: Path = typer.Option(None, "--address-file", envvar="SHOAL_ADDRESS_FILE", metavar="PATH", help="Also write this peer's multiaddrs to FILE (one per line), e.g. for --initial-peer @FILE."),
    bootstrap_timeout: float = typer.Option(30.0, "--bootstrap-timeout", envvar="SHOAL_BOOTSTRAP_TIMEOUT", min=1, metavar="SECONDS", help="Seconds to wait for --initial-peer before giving up."),
    metrics_port: int = typer.Option(None, "--metrics-port", envvar="SHOAL_METRICS_PORT", min=0, max=65535, metavar="PORT", help="Serve Prometheus /metrics (shoal_peers: DHT peers known) and /healthz on this port."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", envvar="SHOAL_METRICS_HOST", metavar="HOST", help="Address for --metrics-port."),
    run_id: list[str] = typer.Option([], "--run-id", envvar="SHOAL_RUN_IDS", metavar="ID", help="A run whose records this entry peer checks fully (schema, owner signature), not only their expiration (repeatable)."),
    swarm_key: Path = typer.Option(None, "--swarm-key", envvar="SHOAL_SWARM_KEY", metavar="FILE", help="Private swarm: store only records sealed with this key file."),
) -> None:
    """Run a light DHT-only entry peer (no model, no GPU) for a swarm; runs until Ctrl+C."""
    from node.library.bootstrap import BootstrapPeer, expand_initial_peers, write_address_file
    from node.library.dht import RecordRules, load_swarm_key
    from protocols.addresses import parse_listen_multiaddr
    from protocols.keys import validate_run_id

    configure_logging(ui=False)
    try:
        peers = expand_initial_peers(initial_peer, timeout=bootstrap_timeout)
        listen_addrs = [parse_listen_multiaddr(a, "--listen") for a in listen] or ["/ip4/0.0.0.0/tcp/31337"]
        announce_addrs = [parse_listen_multiaddr(a, "--announce") for a in announce]
        rules = RecordRules(run_ids=tuple(validate_run_id(r) for r in run_id),
                            swarm_key=load_swarm_key(swarm_key) if swarm_key else None)
    except ShoalError as e:
        fail(e)
    stop = threading.Event()
    Interrupts(stop).install()
    try:
        peer = BootstrapPeer(listen=listen_addrs, announce=announce_addrs, identity=identity,
                             initial_peers=peers, timeout=bootstrap_timeout, rules=rules)
    except ShoalError as e:
        fail(e)
    Interrupts(stop).install()  # hivemind's DHT start may have replaced our handler
    exporter = None
    try:
        if metrics_port is not None:
            from node.observe.exporter import MetricsExporter

            exporter = MetricsExporter(host=metrics_host, port=metrics_port, peer_id=peer.peer_id)
            exporter.touch()
        print(f"bootstrap peer {peer.peer_id} listening on {' '.join(peer.maddrs)}", flush=True)
        print(f"to join: {peer.join_line()}", flush=True)
        if address_file is not None:
            write_address_file(address_file, peer.maddrs)
            logger.info(f"wrote this peer's addresses to {address_file}")
        peer.serve(stop, on_tick=(lambda known: exporter.update(peers=known)) if exporter else None)
    except ShoalError as e:
        fail(e)  # the finally below still closes everything
    finally:
        if exporter is not None:
            exporter.close()
        peer.close()
    raise typer.Exit(EXIT_OK)
