"""``shoal status``: look at a running swarm from the outside, without joining it.

A client-mode DHT node (outgoing connections only, stores nothing for others) bootstraps from
the given peers, reads the run's manifests (the round schedule) and every peer's progress
record (``protocols.progress``), prints them, and shuts down; ``--watch`` keeps reading until
Ctrl+C, ``--json`` prints one machine-readable snapshot. The DHT is always shut down, so no
p2pd is left behind.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from protocols.errors import ConfigError, ShoalError
from protocols.schedule import RoundSchedule

if TYPE_CHECKING:  # hivemind (and so torch) load only when a command runs, not for `shoal --help`
    from protocols.manifest import RunManifest
    from protocols.progress import ProgressRecord, SwarmSummary

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SwarmSnapshot:
    """What one look at the DHT found; pure data, so it renders and serializes without a network."""

    run_id: str
    time: float  # DHT time of the look
    schedule: RoundSchedule | None  # None: no valid manifest found
    records: dict[str, ProgressRecord] = field(default_factory=dict)
    malformed: int = 0  # progress records ignored as malformed
    malformed_manifests: int = 0

    @property
    def summary(self) -> SwarmSummary:
        from protocols.progress import SwarmSummary

        return SwarmSummary.of(self.records.values())

    @property
    def round(self) -> int | None:
        """The schedule's round now; without a manifest, the round most peers report."""
        return self.schedule.round_at(self.time) if self.schedule is not None else self.summary.round

    def to_json(self) -> dict[str, Any]:
        summary, schedule = self.summary, self.schedule
        peers = sorted(self.records.values(), key=lambda r: (-r.tokens_per_s, r.peer_id))
        return {
            "run_id": self.run_id,
            "time": self.time,
            "round": self.round,
            "round_seconds": schedule.round_seconds if schedule else None,
            "round_ends_in_s": schedule.round_end(self.round) - self.time if schedule and self.round else None,
            "peers": summary.peers,
            "tokens_per_s": summary.tokens_per_s,
            "tokens": summary.tokens,
            "loss": summary.loss,
            "eval_loss": summary.eval_loss,
            "malformed": self.malformed,
            "malformed_manifests": self.malformed_manifests,
            "peer_list": [
                {"peer_id": r.peer_id, "round": r.round, "tokens_per_s": r.tokens_per_s, "loss": r.loss,
                 "eval_loss": r.eval_loss, "device": r.device, "utilization": r.utilization, "mode": r.mode,
                 "phase": r.phase, "version": r.version, "tokens": r.tokens, "bytes_sent": r.bytes_sent,
                 "bytes_received": r.bytes_received, "last_seen_s": max(self.time - r.time, 0.0)}
                for r in peers
            ],
        }

    def render(self) -> Panel:
        from node.ui import peer_table  # the same table as the node's live view

        summary, schedule = self.summary, self.schedule
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", justify="right", no_wrap=True)
        grid.add_column()
        if not self.records:
            grid.add_row("peers", Text(f"no peer of run '{self.run_id}' is online (wrong --run-id?)", style="bold yellow"))
        else:
            grid.add_row("peers", Text(f"{summary.peers} online", style="bold green"))
        if schedule is not None:
            left = schedule.round_end(self.round) - self.time if self.round else schedule.start_time - self.time
            grid.add_row("round", f"{self.round}   ({schedule.round_seconds:g}s rounds, {max(left, 0.0):.0f}s left)")
        elif summary.round is not None:
            grid.add_row("round", f"{summary.round}   (from the peers' records; no run manifest found)")
        grid.add_row("throughput", f"{summary.tokens_per_s:,.0f} tokens/s   {summary.tokens:,} tokens so far")
        grid.add_row("loss", f"{_fmt(summary.loss)}   eval {_fmt(summary.eval_loss)}")
        if self.malformed or self.malformed_manifests:
            grid.add_row("ignored", Text(f"{self.malformed} malformed progress records, "
                                         f"{self.malformed_manifests} malformed manifests", style="yellow"))
        parts: list = [grid]
        if self.records:
            parts.append(peer_table(list(self.records.values()), now=self.time))
        return Panel(Group(*parts), title=f"shoal status · run {self.run_id}", expand=False)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def schedule_of(manifests: Iterable[RunManifest]) -> RoundSchedule | None:
    """The run's schedule as its peers see it: among the manifests of the most common config
    (a stray peer with another config does not decide), the earliest start, like ``join_run``."""
    manifests = list(manifests)
    if not manifests:
        return None
    counts = Counter(m.config_hash for m in manifests)
    best = max(counts, key=lambda h: (counts[h], -min(m.start_time for m in manifests if m.config_hash == h)))
    chosen = [m for m in manifests if m.config_hash == best]
    return RoundSchedule(min(m.start_time for m in chosen), chosen[0].round_seconds)


def look(dht, run_id: str) -> SwarmSnapshot:
    """One read of the run's manifests and progress records."""
    from hivemind.utils import get_dht_time

    from node.swarm import read_manifests
    from protocols.keys import peers_key
    from protocols.progress import read_records

    manifests, malformed_manifests = read_manifests(dht, run_id)
    found = dht.get(peers_key(run_id), latest=True)
    now = get_dht_time()
    records, malformed = read_records(found.value if found is not None else None, now)
    return SwarmSnapshot(run_id=run_id, time=now, schedule=schedule_of(manifests), records=records,
                         malformed=malformed, malformed_manifests=malformed_manifests)


def open_client_dht(initial_peers: list[str], timeout: float):
    """A client-mode DHT node bootstrapped from ``initial_peers`` (``NetworkError`` if none answers)."""
    from node.swarm import Reachability, start_dht

    return start_dht(initial_peers=initial_peers, listen=[], announce=[], timeout=timeout,
                     reachability=Reachability(client_mode=True))


def close_dht(dht) -> None:
    from node.sockets import hivemind_sockets, remove_stale

    before = hivemind_sockets()
    try:
        dht.shutdown()
    finally:
        if dht.is_alive():
            dht.terminate()
        remove_stale(hivemind_sockets() - before)


def status(
    initial_peer: list[str] = typer.Option([], "--initial-peer", envvar="SHOAL_INITIAL_PEERS", help="Multiaddr of any peer of the swarm (repeatable; @FILE reads addresses from FILE)."),
    run_id: str = typer.Option(None, "--run-id", envvar="SHOAL_RUN_ID", help="The run to look at. Default: the default config's run_id."),
    watch: bool = typer.Option(False, "--watch", help="Keep refreshing until Ctrl+C."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON snapshot (run_id, round, peers, tokens_per_s, loss, malformed, peer_list) and exit."),
    interval: float = typer.Option(2.0, "--interval", min=0.5, help="Seconds between refreshes with --watch."),
    bootstrap_timeout: float = typer.Option(30.0, "--bootstrap-timeout", envvar="SHOAL_BOOTSTRAP_TIMEOUT", min=1, help="Seconds to wait for an initial peer before giving up."),
) -> None:
    """Show a running swarm: peers, throughput, round, loss (without joining it)."""
    # 1. Parse: every problem is one line and an exit code, before any network process starts.
    logging.getLogger("hivemind").setLevel(os.environ.get("SHOAL_HIVEMIND_LOGLEVEL", "ERROR"))
    try:
        if watch and as_json:
            raise ConfigError("--watch and --json do not combine; run --json repeatedly to poll")
        if not initial_peer:
            raise ConfigError("shoal status needs --initial-peer MADDR (the address any peer of the swarm printed)")
        from node.bootstrap import expand_initial_peers
        from protocols.keys import validate_run_id

        peers = expand_initial_peers(initial_peer, timeout=bootstrap_timeout)
        if run_id is None:
            from node.config import load_config

            run_id = load_config(None).run_id
        validate_run_id(run_id)
        # 2. Connect (forks hivemind's DHT process and p2pd).
        dht = open_client_dht(peers, bootstrap_timeout)
    except ShoalError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(e.exit_code) from None
    # 3. Look, print, and always leave.
    try:
        if as_json:
            typer.echo(json.dumps(look(dht, run_id).to_json(), allow_nan=False))
        elif watch:
            _watch(dht, run_id, interval)
        else:
            Console().print(look(dht, run_id).render())
    finally:
        close_dht(dht)


def _watch(dht, run_id: str, interval: float) -> None:
    from rich.live import Live

    console = Console()
    try:
        with Live(look(dht, run_id).render(), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(look(dht, run_id).render(), refresh=True)
    except KeyboardInterrupt:  # Ctrl+C is how --watch ends: leave quietly (the caller shuts the DHT down)
        pass
