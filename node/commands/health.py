"""``shoal health``: exit 0 if the local node reported recently (its ``/healthz`` says ok), else 1."""

from __future__ import annotations

import typer

from node.observe.exporter import check_health

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1


def health(
    port: int = typer.Option(..., "--port", "--metrics-port", envvar="SHOAL_METRICS_PORT", min=1, max=65535,
                             help="The node's --metrics-port."),
    host: str = typer.Option("127.0.0.1", "--host", envvar="SHOAL_METRICS_HOST", help="Where the node serves its metrics."),
    timeout: float = typer.Option(3.0, "--timeout", min=0.1, help="Seconds to wait for an answer."),
) -> None:
    """Exit 0 if the local node reported recently (its /healthz says ok), else 1: for container health checks."""
    healthy, message = check_health(port, host=host, timeout=timeout)
    typer.echo(message, err=not healthy)
    raise typer.Exit(EXIT_HEALTHY if healthy else EXIT_UNHEALTHY)
