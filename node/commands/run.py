"""``shoal run``: join (or start) a swarm and train. Parse → build → run → close; the process
itself is ``node.process.peer``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import typer

from node.commands.common import EXIT_OK, configure_logging, fail
from node.process.options import PeerOptions
from protocols.errors import ConfigError, ShoalError


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
    run_key: str = typer.Option(None, "--run-key", envvar="SHOAL_RUN_KEY", metavar="KEY", help="The run organiser's public key (printed in its join line): only manifests it signed are followed."),
    tensorboard: Path = typer.Option(None, "--tensorboard", envvar="SHOAL_TENSORBOARD", metavar="DIR", help="Also write the round records as TensorBoard event files under DIR/<run id>/<peer id> (needs shoal[logs])."),
    wandb: str = typer.Option(None, "--wandb", envvar="SHOAL_WANDB", metavar="PROJECT", help="Also log the round records to this Weights & Biases project (needs shoal[logs]; WANDB_MODE=offline logs locally)."),
    swarm_key: Path = typer.Option(None, "--swarm-key", envvar="SHOAL_SWARM_KEY", metavar="FILE", help="Private swarm: only peers with this key file are admitted (every DHT record is sealed with it)."),
) -> None:
    """Join (or start) a swarm and train."""
    ui = not no_ui and sys.stdout.isatty()
    configure_logging(ui)
    # 1. Parse: every mistake is one line and an exit code, before any network process starts.
    try:
        if client_mode and use_relay:
            raise ConfigError("--client-mode and --use-relay exclude each other; pick one (see README: NAT)")
        for flag, wanted, package in (("--tensorboard", tensorboard, "tensorboard"), ("--wandb", wandb, "wandb")):
            if wanted is not None and importlib.util.find_spec(package) is None:  # before any network process
                raise ConfigError(f"{flag} needs the {package} package: pip install 'shoal[logs]'")
        from node.library.bootstrap import expand_initial_peers
        from node.library.dht import load_swarm_key
        from node.process.config import load_config
        from protocols.addresses import parse_listen_multiaddr
        from protocols.identity import parse_run_key

        options = PeerOptions(
            initial_peers=expand_initial_peers(initial_peer, timeout=bootstrap_timeout),
            listen=[parse_listen_multiaddr(a, "--listen") for a in listen],
            announce=[parse_listen_multiaddr(a, "--announce") for a in announce],
            max_rounds=max_rounds, checkpoint_dir=checkpoint_dir, metrics_file=metrics_file, ui=ui,
            bootstrap_timeout=bootstrap_timeout, identity=identity, client_mode=client_mode,
            use_relay=use_relay, metrics_port=metrics_port, metrics_host=metrics_host,
            run_key=parse_run_key(run_key) if run_key else None,
            swarm_key=load_swarm_key(swarm_key) if swarm_key else None,
            tensorboard=tensorboard, wandb_project=wandb,
        )
        overrides = {"run_id": run_id, "train.device": device, "round.seconds": round_seconds,
                     "round.sync_mode": sync_mode, "train.throttle": throttle}
        run_config = load_config(config, {k: v for k, v in overrides.items() if v is not None})
    except ShoalError as e:
        fail(e)
    # 2. Build, train, close. Only the project's own errors are the user's; anything else is a
    # bug and keeps its traceback and exit code 1 (after the peer has left cleanly).
    from node.process.peer import run_peer

    try:
        run_peer(run_config, options)
    except ShoalError as e:
        fail(e)
    raise typer.Exit(EXIT_OK)
