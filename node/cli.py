"""The ``shoal`` command. Thin on purpose: parse → build → run → close."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import typer

from protocols.errors import ConfigError, ShoalError

EXIT_OK = 0
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="shoal: train one model together with other people's GPUs, over the internet.")
logger = logging.getLogger("node.cli")


@app.callback()
def _shoal() -> None:
    """shoal: train one model together with other people's GPUs, over the internet."""


def _configure_logging(ui: bool) -> None:
    from hivemind.utils.logging import use_hivemind_log_handler

    if ui:
        from rich.logging import RichHandler

        from node.ui import CONSOLE

        # The live view's console: log lines are printed above the panel instead of through it.
        handler: logging.Handler = RichHandler(console=CONSOLE, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    use_hivemind_log_handler("nowhere")  # hivemind's records reach our handler, once
    hivemind_level = os.environ.get("SHOAL_HIVEMIND_LOGLEVEL", "WARNING")
    logging.getLogger("hivemind").setLevel(hivemind_level)
    # p2p connections torn down while a peer leaves make asyncio log tracebacks in hivemind's
    # processes; they are noise unless one is debugging hivemind itself.
    logging.getLogger("asyncio").setLevel(hivemind_level if hivemind_level != "WARNING" else "CRITICAL")
    # A failed averaging step is expected (a lone peer, a peer that left) and shoal reports it
    # itself, in one line and in the metrics; hivemind would log it with a traceback.
    logging.getLogger("hivemind.averaging.averager").setLevel("CRITICAL")


class Interrupts:
    """Ctrl+C once: finish the current step, leave, checkpoint. Twice: exit now (children too)."""

    def __init__(self, stop: threading.Event):
        self.stop, self.count = stop, 0
        self.pid = os.getpid()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)

    def __call__(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            # A forked hivemind child inherited this handler. Ctrl+C reaches the whole process
            # group: the child ignores it and lets the parent shut it down in order. SIGTERM keeps
            # its default (hivemind ends a stuck child with it; it must not be swallowed).
            if signum == signal.SIGINT:
                signal.signal(signum, signal.SIG_IGN)
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.count += 1
        if self.count == 1:
            self.stop.set()
            # Ctrl+C also reached p2pd (same process group), which exits at once: hivemind then
            # logs errors about its closed socket and a slow DHT shutdown. Expected now, so muted.
            for name in ("hivemind.p2p.p2p_daemon", "hivemind.dht.dht"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
            logger.warning("stopping after the current step; press Ctrl+C again to exit immediately")
            return
        _kill_children()
        os._exit(EXIT_INTERRUPTED)


def _kill_children() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def _fail(error: ShoalError) -> None:
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(error.exit_code)


@app.command()
def run(
    config: Path = typer.Option(None, "--config", envvar="SHOAL_CONFIG", metavar="PATH", help="Run config (TOML). Default: the tiny example config (examples/configs/tiny.toml)."),
    initial_peer: list[str] = typer.Option([], "--initial-peer", envvar="SHOAL_INITIAL_PEERS", metavar="MADDR", help="Multiaddr of a peer in the swarm (repeatable). None: start a new swarm."),
    listen: list[str] = typer.Option([], "--listen", envvar="SHOAL_LISTEN", metavar="MADDR", help="Multiaddr to listen on (repeatable). Default /ip4/0.0.0.0/tcp/0."),
    announce: list[str] = typer.Option([], "--announce", envvar="SHOAL_ANNOUNCE", metavar="MADDR", help="Public multiaddr to announce, e.g. behind NAT (repeatable)."),
    run_id: str = typer.Option(None, "--run-id", envvar="SHOAL_RUN_ID", metavar="ID", help="Run to join (overrides the config's run_id)."),
    device: str = typer.Option(None, "--device", envvar="SHOAL_DEVICE", metavar="DEVICE", help="auto | cpu | cuda | cuda:N"),
    round_seconds: float = typer.Option(None, "--round-seconds", envvar="SHOAL_ROUND_SECONDS", metavar="SECONDS", help="Round length in seconds (overrides round.seconds of the config)."),
    max_rounds: int = typer.Option(None, "--max-rounds", envvar="SHOAL_MAX_ROUNDS", min=1, metavar="N", help="Leave cleanly and exit 0 after global round N."),
    checkpoint_dir: Path = typer.Option(None, "--checkpoint-dir", envvar="SHOAL_CHECKPOINT_DIR", metavar="DIR", help="Write checkpoints here (every few rounds and at exit)."),
    metrics_file: Path = typer.Option(None, "--metrics-file", envvar="SHOAL_METRICS_FILE", metavar="PATH", help="Append one JSON object per line (round, start, peers, errors, exit)."),
    no_ui: bool = typer.Option(False, "--no-ui", envvar="SHOAL_NO_UI", help="Plain log lines instead of the live status panel."),
    sync_mode: str = typer.Option(None, "--sync-mode", envvar="SHOAL_SYNC_MODE", metavar="MODE", help="overlap (default: average in the background while training) | blocking (fixed inner steps, then wait: the OpenDiLoCo baseline)."),
    throttle: float = typer.Option(None, "--throttle", envvar="SHOAL_THROTTLE", metavar="FACTOR", help="Stretch each inner step to FACTOR x its compute time (a stand-in for a slower GPU)."),
    bootstrap_timeout: float = typer.Option(30.0, "--bootstrap-timeout", envvar="SHOAL_BOOTSTRAP_TIMEOUT", min=1, metavar="SECONDS", help="Seconds to wait for an initial peer before giving up."),
    identity: Path = typer.Option(None, "--identity", envvar="SHOAL_IDENTITY", metavar="PATH", help="Private key file that keeps this peer's id across restarts (created on first use)."),
    client_mode: bool = typer.Option(False, "--client-mode", envvar="SHOAL_CLIENT_MODE", help="Behind NAT without port forwarding: outgoing connections only (trains and averages, serves no state)."),
    use_relay: bool = typer.Option(False, "--use-relay", envvar="SHOAL_USE_RELAY", help="Behind NAT: become reachable through other peers' libp2p relays."),
    metrics_port: int = typer.Option(None, "--metrics-port", envvar="SHOAL_METRICS_PORT", min=0, max=65535, metavar="PORT", help="Serve Prometheus /metrics and a /healthz probe on this port (0: any free port)."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", envvar="SHOAL_METRICS_HOST", metavar="HOST", help="Address for --metrics-port (0.0.0.0 to let another machine or container scrape it)."),
) -> None:
    """Join (or start) a swarm and train."""
    from node.bootstrap import expand_initial_peers
    from protocols.addresses import parse_listen_multiaddr

    ui = not no_ui and sys.stdout.isatty()
    _configure_logging(ui)
    try:
        if client_mode and use_relay:
            raise ConfigError("--client-mode and --use-relay exclude each other; pick one (see README: NAT)")
        peers = expand_initial_peers(initial_peer, timeout=bootstrap_timeout)
        listen_addrs = [parse_listen_multiaddr(a, "--listen") for a in listen]
        announce_addrs = [parse_listen_multiaddr(a, "--announce") for a in announce]
        overrides = {"run_id": run_id, "train.device": device, "round.seconds": round_seconds,
                     "round.sync_mode": sync_mode, "train.throttle": throttle}
        from node.config import load_config

        run_config = load_config(config, {k: v for k, v in overrides.items() if v is not None})
    except ShoalError as e:
        _fail(e)

    from node.node import Node, NodeOptions

    options = NodeOptions(initial_peers=peers, listen=listen_addrs, announce=announce_addrs, max_rounds=max_rounds,
                          checkpoint_dir=checkpoint_dir, metrics_file=metrics_file, ui=ui,
                          bootstrap_timeout=bootstrap_timeout, identity=identity, client_mode=client_mode,
                          use_relay=use_relay, metrics_port=metrics_port, metrics_host=metrics_host)
    stop = threading.Event()
    interrupts = Interrupts(stop)
    interrupts.install()
    node, reason, error = None, "crash", None
    try:
        node = Node(run_config, options, stop)
        interrupts.install()  # hivemind's averager set SIGINT to ignored when it started
        node.train()
        reason = "interrupted" if stop.is_set() else "max_rounds"
    except ShoalError as e:
        reason, error = "error", e
    except ValueError as e:  # config checks that only fail once data or devices are known
        reason, error = "error", ConfigError(str(e))
    finally:  # anything else is a bug: it keeps its traceback, after leaving cleanly
        if node is not None:
            node.close(reason)
    if error is not None:
        _fail(error)
    raise typer.Exit(EXIT_OK)


@app.command()
def bootstrap(
    listen: list[str] = typer.Option([], "--listen", envvar="SHOAL_LISTEN", metavar="MADDR", help="Multiaddr to listen on (repeatable). Default /ip4/0.0.0.0/tcp/31337."),
    announce: list[str] = typer.Option([], "--announce", envvar="SHOAL_ANNOUNCE", metavar="MADDR", help="Public multiaddr to announce, e.g. /ip4/203.0.113.5/tcp/31337 (repeatable)."),
    identity: Path = typer.Option(None, "--identity", envvar="SHOAL_IDENTITY", metavar="PATH", help="Private key file: a stable peer id, so the published address stays valid (created on first use)."),
    initial_peer: list[str] = typer.Option([], "--initial-peer", envvar="SHOAL_INITIAL_PEERS", metavar="MADDR", help="Another entry point of the same swarm (repeatable; @FILE reads addresses from FILE)."),
    address_file: Path = typer.Option(None, "--address-file", envvar="SHOAL_ADDRESS_FILE", metavar="PATH", help="Also write this peer's multiaddrs to FILE (one per line), e.g. for --initial-peer @FILE."),
    bootstrap_timeout: float = typer.Option(30.0, "--bootstrap-timeout", envvar="SHOAL_BOOTSTRAP_TIMEOUT", min=1, metavar="SECONDS", help="Seconds to wait for --initial-peer before giving up."),
    metrics_port: int = typer.Option(None, "--metrics-port", envvar="SHOAL_METRICS_PORT", min=0, max=65535, metavar="PORT", help="Serve Prometheus /metrics (shoal_peers: DHT peers known) and /healthz on this port."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", envvar="SHOAL_METRICS_HOST", metavar="HOST", help="Address for --metrics-port."),
) -> None:
    """Run a light DHT-only entry peer (no model, no GPU) for a swarm; runs until Ctrl+C."""
    from node.bootstrap import BootstrapPeer, expand_initial_peers, write_address_file
    from protocols.addresses import parse_listen_multiaddr

    _configure_logging(ui=False)
    try:
        peers = expand_initial_peers(initial_peer, timeout=bootstrap_timeout)
        listen_addrs = [parse_listen_multiaddr(a, "--listen") for a in listen] or ["/ip4/0.0.0.0/tcp/31337"]
        announce_addrs = [parse_listen_multiaddr(a, "--announce") for a in announce]
    except ShoalError as e:
        _fail(e)
    stop = threading.Event()
    Interrupts(stop).install()
    try:
        peer = BootstrapPeer(listen=listen_addrs, announce=announce_addrs, identity=identity,
                             initial_peers=peers, timeout=bootstrap_timeout)
    except ShoalError as e:
        _fail(e)
    Interrupts(stop).install()  # hivemind's DHT start may have replaced our handler
    exporter = None
    try:
        if metrics_port is not None:
            from node.exporter import MetricsExporter

            exporter = MetricsExporter(host=metrics_host, port=metrics_port, peer_id=peer.peer_id)
            exporter.touch()
        print(f"bootstrap peer {peer.peer_id} listening on {' '.join(peer.maddrs)}", flush=True)
        print(f"to join: {peer.join_line()}", flush=True)
        if address_file is not None:
            write_address_file(address_file, peer.maddrs)
            logger.info(f"wrote this peer's addresses to {address_file}")
        peer.serve(stop, on_tick=(lambda known: exporter.update(peers=known)) if exporter else None)
    except ShoalError as e:
        _fail(e)  # the finally below still closes everything
    finally:
        if exporter is not None:
            exporter.close()
        peer.close()
    raise typer.Exit(EXIT_OK)


# -- Commands that look at a swarm or a node from outside (issue 5). Their modules import hivemind,
# prometheus_client and matplotlib only when the command runs, so `shoal run --help` stays light.
from node.exporter import health  # noqa: E402
from node.plot import plot  # noqa: E402
from node.swarm_status import status  # noqa: E402

app.command("status")(status)
app.command("plot")(plot)
app.command("health")(health)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
