"""What every command shares: the one error exit and the one logging set-up.

Exit codes are named once, here and in ``protocols.errors`` (each ``ShoalError`` carries its
own): scripts tell a bad flag (2) from a bad address (3), an unreachable swarm (4) and a broken
checkpoint (5); 1 is a bug (with its traceback), 130 a second Ctrl+C.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import typer

from protocols.errors import ShoalError

EXIT_OK = 0


def fail(error: ShoalError) -> NoReturn:
    """The user's mistake in one line on stderr (no traceback), and its exit code."""
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(error.exit_code)


def configure_logging(ui: bool) -> None:
    """One handler on the root logger: above the live panel (``ui``) or plain lines on stderr.
    hivemind's loggers are routed to it once and quieted to ``SHOAL_HIVEMIND_LOGLEVEL``."""
    from hivemind.utils.logging import use_hivemind_log_handler

    if ui:
        from rich.logging import RichHandler

        from node.observe.ui import CONSOLE

        # The live view's console: log lines are printed above the panel instead of through it.
        handler: logging.Handler = RichHandler(console=CONSOLE, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
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
    # SHOAL_HIVEMIND_LOGLEVEL=INFO or DEBUG (debugging hivemind itself) shows them.
    # datasets logs a broken file itself (its own handler, set up when it is imported) before shoal's
    # one-line error names it.
    os.environ.setdefault("DATASETS_VERBOSITY", "critical" if hivemind_level == "WARNING" else hivemind_level.lower())
    if logging.getLevelName(hivemind_level) in (logging.WARNING, logging.ERROR, logging.CRITICAL):
        logging.getLogger("hivemind.averaging.averager").setLevel("CRITICAL")
