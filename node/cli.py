"""The ``shoal`` command: one typer app, one module per command under ``node/commands``.

Thin on purpose (parse → build → run → close lives in each command). Command modules import
hivemind, torch, prometheus_client and matplotlib only when their command runs, so
``shoal --help`` stays fast.
"""

from __future__ import annotations

import typer

from node.commands.bootstrap import bootstrap
from node.commands.export import export
from node.commands.health import health
from node.commands.plot import plot
from node.commands.run import run
from node.commands.sample import sample
from node.commands.status import status

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="shoal: train one model together with other people's GPUs, over the internet.")


def version_lines() -> list[str]:
    """``name version`` per line: what a bug report needs (imports only what it reports)."""
    import platform
    from importlib import metadata

    import torch

    from protocols.version import PROTOCOL_VERSION, shoal_version

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = f"{gpus} GPU{'s' * (gpus != 1)} visible" + (f": {torch.cuda.get_device_name(0)}" if gpus else "")
    lines = [f"shoal {shoal_version()}", f"protocol {PROTOCOL_VERSION}", f"python {platform.python_version()}",
             f"torch {torch.__version__}", f"cuda {torch.version.cuda or 'none'} ({visible})"]
    for package, required in (("hivemind", True), ("transformers", False)):
        try:
            lines.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            if required:
                lines.append(f"{package} not installed")
    return lines


def _print_version(value: bool) -> None:
    if value:
        typer.echo("\n".join(version_lines()))
        raise typer.Exit()


@app.callback()
def _shoal(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the versions of shoal, its wire protocol, torch, CUDA, hivemind and transformers, and exit."),
) -> None:
    """shoal: train one model together with other people's GPUs, over the internet."""


app.command("run")(run)
app.command("bootstrap")(bootstrap)
app.command("status")(status)
app.command("plot")(plot)
app.command("health")(health)
app.command("export")(export)
app.command("sample")(sample)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
