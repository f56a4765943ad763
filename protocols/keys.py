"""DHT keys, all namespaced by the run id so that peers of different runs never meet."""

from __future__ import annotations

import re

from protocols.errors import ConfigError

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"run id {run_id!r} is invalid; use 1-64 letters, digits, '_' or '-' (starting with a letter or digit)"
        )
    return run_id


def run_key(run_id: str) -> str:
    """Where peers publish the run record (round schedule and the config they must share)."""
    return f"shoal.{validate_run_id(run_id)}.run"


def peers_key(run_id: str) -> str:
    """Where every live peer publishes an expiring heartbeat, keyed by its peer id."""
    return f"shoal.{validate_run_id(run_id)}.peers"


def averager_prefix(run_id: str) -> str:
    """hivemind averager prefix: its matchmaking keys live under it (hivemind forbids '.' here)."""
    return f"shoal-{validate_run_id(run_id)}-outer"
