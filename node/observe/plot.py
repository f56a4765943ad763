"""``shoal plot``: draw one or many peers' metrics files (``--metrics-file``) into a PNG.

Three panels: loss vs wall-clock time, loss vs tokens this peer trained on (train loss solid,
eval loss of the shared model dashed, one colour per peer), and utilization (compute_s /
wall_s) per round. It reads the ``round`` records of the format in ``node.observe.metrics``.

matplotlib is optional (``pip install 'shoal[plot]'``) and imported only here, only when the
command runs; it draws through the Agg canvas directly, never through pyplot's global state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from node.observe.fmt import short_id
from node.observe.metrics import read_metrics
from protocols.errors import ConfigError

ROUND_KEYS = ("round", "time", "tokens", "compute_s", "wall_s")


@dataclass(frozen=True, slots=True)
class PeerRounds:
    """One peer's round records, in order, with the file they came from."""

    peer: str
    rounds: tuple[dict, ...]

    @property
    def label(self) -> str:
        return short_id(self.peer)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_rounds(paths: list[Path]) -> tuple[list[PeerRounds], float]:
    """The round records of every peer in ``paths`` and the run's earliest time (the x origin).

    Problems are one-line ``ConfigError``s naming the file: missing, unreadable, not a metrics
    file, or no finished round yet.
    """
    if not paths:
        raise ConfigError("shoal plot needs at least one metrics file (written by shoal run --metrics-file)")
    by_peer: dict[str, list[dict]] = {}
    origin = math.inf
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"metrics file {path} does not exist" if not path.exists() else f"{path} is not a file")
        try:
            records = read_metrics(path)
        except ValueError as e:
            raise ConfigError(f"{e}; is {path} a shoal --metrics-file?") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read metrics file {path}: {e}") from None
        if not records:
            raise ConfigError(f"metrics file {path} is empty")
        rounds = 0
        for number, record in enumerate(records, start=1):
            if not isinstance(record, dict) or not isinstance(record.get("event"), str):
                raise ConfigError(f"{path}: record {number} is not a shoal metrics record; is it a --metrics-file?")
            if _number(record.get("time")):  # a round record is written at its end: its start is earlier
                wall_s = record.get("wall_s") if record["event"] == "round" and _number(record.get("wall_s")) else 0.0
                origin = min(origin, record["time"] - wall_s)
            if record["event"] != "round":
                continue
            bad = [key for key in ROUND_KEYS if not _number(record.get(key))]
            bad += [key for key in ("loss", "eval_loss") if record.get(key) is not None and not _number(record.get(key))]
            if bad:
                raise ConfigError(f"{path}: round record {number} has no valid {', '.join(bad)}")
            peer = str(record.get("peer") or path.stem)
            by_peer.setdefault(peer, []).append(record)
            rounds += 1
        if rounds == 0:
            raise ConfigError(f"metrics file {path} has no round records yet (a peer writes one per finished round)")
    peers = [PeerRounds(peer, tuple(sorted(records, key=lambda r: r["time"])))
             for peer, records in sorted(by_peer.items())]
    return peers, origin


def _loss(value: float | None) -> float:
    return math.nan if value is None else float(value)  # NaN: a gap in the line


def draw(peers: list[PeerRounds], origin: float, output: Path) -> Path:
    """Write the PNG; returns its path."""
    output = Path(output)
    if not output.parent.is_dir():  # before the (slow) drawing
        raise ConfigError(f"cannot write {output}: folder {output.parent} does not exist")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("shoal plot needs matplotlib; install with pip install 'shoal[plot]'") from None

    span = max((r["time"] for p in peers for r in p.rounds), default=origin) - origin
    scale, unit = (60.0, "min") if span > 600 else (1.0, "s")
    figure = Figure(figsize=(16, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    by_time, by_tokens, utilization = figure.subplots(1, 3)
    colors = [f"C{i % 10}" for i in range(len(peers))]
    for peer, color in zip(peers, colors):
        times = [(r["time"] - origin) / scale for r in peer.rounds]
        tokens, total = [], 0
        for r in peer.rounds:
            total += r["tokens"]
            tokens.append(total)
        losses = [_loss(r.get("loss")) for r in peer.rounds]
        evals = [(x, t, _loss(r.get("eval_loss"))) for x, t, r in zip(times, tokens, peer.rounds)
                 if r.get("eval_loss") is not None]
        for axis, xs in ((by_time, times), (by_tokens, tokens)):
            axis.plot(xs, losses, color=color, marker=".", label=f"{peer.label} train")
            if evals:
                eval_x = [e[0] for e in evals] if axis is by_time else [e[1] for e in evals]
                axis.plot(eval_x, [e[2] for e in evals], color=color, linestyle="--", marker="o", markersize=3,
                          label=f"{peer.label} eval")
        ratios = [min(r["compute_s"] / r["wall_s"], 1.0) if r["wall_s"] > 0 else math.nan for r in peer.rounds]
        finite = [x for x in ratios if not math.isnan(x)]
        mean = sum(finite) / len(finite) if finite else math.nan
        utilization.plot([r["round"] for r in peer.rounds], ratios, color=color, marker=".",
                         label=f"{peer.label} (mean {mean:.0%})")
    by_time.set(title="loss vs wall-clock", xlabel=f"time since start ({unit})", ylabel="loss")
    by_tokens.set(title="loss vs tokens", xlabel="tokens trained by the peer", ylabel="loss")
    utilization.set(title="utilization (compute / wall-clock)", xlabel="round", ylabel="utilization", ylim=(0, 1.05))
    for axis in (by_time, by_tokens, utilization):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    try:
        figure.savefig(output, format="png", dpi=110)
    except OSError as e:
        raise ConfigError(f"cannot write {output}: {e.strerror or e}") from None
    return output
