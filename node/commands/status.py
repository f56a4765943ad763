"""``shoal status``: look at a running swarm from the outside, without joining it.

A client-mode DHT node (outgoing connections only, stores nothing for others) bootstraps from
the given peers, reads the run's manifests (the round schedule) and every peer's progress
record, prints them, and shuts down; ``--watch`` keeps reading until Ctrl+C, ``--json`` prints
one machine-readable snapshot. The DHT is always shut down, so no p2pd is left behind.
hivemind (and so torch) load only when the command runs, not for ``shoal --help``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import typer
from rich.console import Console

from node.commands.common import fail
from protocols.errors import ConfigError, ShoalError


def status(
    initial_peer: list[str] = typer.Option([], "--initial-peer", envvar="SHOAL_INITIAL_PEERS", help="Multiaddr of any peer of the swarm (repeatable; @FILE reads addresses from FILE)."),
    run_id: str = typer.Option(None, "--run-id", envvar="SHOAL_RUN_ID", help="The run to look at. Default: the default config's run_id."),
    watch: bool = typer.Option(False, "--watch", help="Keep refreshing until Ctrl+C."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON snapshot (run_id, round, peers, tokens_per_s, loss, malformed, peer_list) and exit."),
    interval: float = typer.Option(2.0, "--interval", min=0.5, help="Seconds between refreshes with --watch."),
    bootstrap_timeout: float = typer.Option(30.0, "--bootstrap-timeout", envvar="SHOAL_BOOTSTRAP_TIMEOUT", min=1, help="Seconds to wait for an initial peer before giving up."),
    swarm_key: Path = typer.Option(None, "--swarm-key", envvar="SHOAL_SWARM_KEY", metavar="FILE", help="A private swarm's key file (the swarm refuses peers without it)."),
) -> None:
    """Show a running swarm: peers, throughput, round, loss (without joining it)."""
    # 1. Parse: every problem is one line and an exit code, before any network process starts.
    logging.getLogger("hivemind").setLevel(os.environ.get("SHOAL_HIVEMIND_LOGLEVEL", "ERROR"))
    try:
        if watch and as_json:
            raise ConfigError("--watch and --json do not combine; run --json repeatedly to poll")
        if not initial_peer:
            raise ConfigError("shoal status needs --initial-peer MADDR (the address any peer of the swarm printed)")
        from node.library.bootstrap import expand_initial_peers
        from protocols.keys import validate_run_id

        peers = expand_initial_peers(initial_peer, timeout=bootstrap_timeout)
        if run_id is None:
            from node.process.config import load_config

            run_id = load_config(None).run_id
        validate_run_id(run_id)
        # 2. Connect (forks hivemind's DHT process and p2pd).
        from node.library.dht import RecordRules, load_swarm_key, open_client_dht

        rules = RecordRules(run_ids=(run_id,), swarm_key=load_swarm_key(swarm_key) if swarm_key else None)
        dht = open_client_dht(peers, bootstrap_timeout, rules)
    except ShoalError as e:
        fail(e)
    # 3. Look, print, and always leave.
    from node.library.dht import shutdown_dht
    from node.library.snapshot import look
    from node.observe.status_view import render_snapshot

    try:
        if as_json:
            typer.echo(json.dumps(look(dht, run_id).to_json(), allow_nan=False))
        elif watch:
            _watch(dht, run_id, interval)
        else:
            Console().print(render_snapshot(look(dht, run_id)))
    finally:
        shutdown_dht(dht)


def _watch(dht, run_id: str, interval: float) -> None:
    from rich.live import Live

    from node.library.snapshot import look
    from node.observe.status_view import render_snapshot

    console = Console()
    try:
        with Live(render_snapshot(look(dht, run_id)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(render_snapshot(look(dht, run_id)), refresh=True)
    except KeyboardInterrupt:  # Ctrl+C is how --watch ends: leave quietly (the caller shuts the DHT down)
        pass
