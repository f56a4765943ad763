"""The ``shoal`` command: one typer app, one module per command under ``node/commands``.

Thin on purpose (parse → build → run → close lives in each command). Command modules import
hivemind, torch, prometheus_client and matplotlib only when their command runs, so
``shoal --help`` stays fast.
"""

from __future__ import annotations

import typer

from node.commands.bootstrap import bootstrap
from node.commands.health import health
from node.commands.plot import plot
from node.commands.run import run
from node.commands.status import status

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="shoal: train one model together with other people's GPUs, over the internet.")


@app.callback()
def _shoal() -> None:
    """shoal: train one model together with other people's GPUs, over the internet."""


app.command("run")(run)
app.command("bootstrap")(bootstrap)
app.command("status")(status)
app.command("plot")(plot)
app.command("health")(health)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
