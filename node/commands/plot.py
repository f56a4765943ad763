"""``shoal plot``: loss and utilization per peer from metrics files, as one PNG."""

from __future__ import annotations

from pathlib import Path

import typer

from node.commands.common import fail
from node.observe.plot import draw, load_rounds
from protocols.errors import ConfigError


def plot(
    files: list[Path] = typer.Argument(..., help="Metrics files of one or more peers (shoal run --metrics-file)."),
    output: Path = typer.Option(Path("shoal-metrics.png"), "-o", "--output", envvar="SHOAL_PLOT_OUTPUT", help="The PNG to write."),
) -> None:
    """Plot loss vs time and vs tokens, and utilization per peer, from metrics files (needs matplotlib)."""
    try:
        peers, origin = load_rounds(files)
        written = draw(peers, origin, output)
    except ConfigError as e:
        fail(e)
    rounds = sum(len(p.rounds) for p in peers)
    typer.echo(f"wrote {written} ({len(peers)} peer{'s' * (len(peers) != 1)}, {rounds} rounds)")
