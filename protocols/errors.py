"""User-facing errors, each with its own process exit code.

Why a separate hierarchy: the CLI catches `ShoalError`, prints its one-line message without a
traceback and exits with `exit_code`, so scripts can tell a bad flag from an unreachable peer.
Anything else that escapes (a ``ValueError`` from an internal check included) is a bug and keeps
its traceback and exit code 1.
"""

from __future__ import annotations


class ShoalError(Exception):
    """A user-facing problem: the message is one line that names what is wrong and how to fix it.

    The CLI prints it without a traceback.
    """

    exit_code: int = 2


class ConfigError(ShoalError, ValueError):
    """A bad config value, flag or environment variable, or data that does not fit the config.

    Also a ``ValueError``: config dataclasses raise it from ``__post_init__``, so library users
    who build them in code catch the usual type.
    """

    exit_code = 2


class AddressError(ShoalError):
    """A multiaddr the user gave cannot be used (malformed, missing transport or peer id)."""

    exit_code = 3


class NetworkError(ShoalError):
    """The swarm cannot be reached, e.g. an unreachable bootstrap peer."""

    exit_code = 4


class CheckpointError(ShoalError):
    """A checkpoint is missing, truncated or corrupt."""

    exit_code = 5


class ProcessDied(ShoalError):
    """One of this peer's own processes (its DHT node, its averager, their p2pd) is gone: killed,
    or crashed. The peer cannot average without it; it leaves (checkpointing the shared model)."""

    exit_code = 6
