"""Pins on the hivemind code shoal wraps or overrides: the sha256 of each function's source, as reviewed.

shoal reaches into hivemind in two places (the DHT protocol in ``protocols.records``, the averager in
``averaging.network.hivemind.pins``); each keeps its own table of what it relies on, and both check
it the same way, here, before they run: a function whose source changed means an override must be
re-derived against the new code, never silently run on it.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Mapping


def source_digest(function: Callable) -> str:
    """sha256 (hex) of ``function``'s source text."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def changed_functions(reviewed: Mapping[str, str], originals: Mapping[str, Callable]) -> list[str]:
    """The names in ``reviewed`` whose function in ``originals`` no longer has the reviewed source."""
    return [name for name, digest in reviewed.items() if source_digest(originals[name]) != digest]
