"""How numbers and peer ids are written for people: one definition for the live view, the
plain log lines, ``shoal status`` and ``shoal plot``, so the same figure reads the same everywhere."""

from __future__ import annotations

MISSING = "-"


def number(value: float | None, spec: str = ".4f") -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is unknown (never evaluated, no data)."""
    return MISSING if value is None else format(value, spec)


def human_bytes(count: float) -> str:
    """Decimal units, as network rates are quoted: ``950 B``, ``1.2 MB``."""
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def short_id(peer_id: str) -> str:
    """Peer ids share their first characters (12D3KooW...); the tail tells them apart."""
    return "…" + peer_id[-6:] if len(peer_id) > 6 else peer_id
