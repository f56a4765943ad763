"""An optional Prometheus endpoint (``/metrics``) and a liveness probe (``/healthz``) for one node.

The node reports into ``MetricsExporter`` from its own threads (``observe_round`` with the
``RoundRecord`` the metrics file also gets, ``update`` for live figures, ``touch`` to
say "still alive"); a small threaded HTTP server answers scrapes from a snapshot taken under a
lock, so a slow scraper never blocks training. ``/healthz`` answers 200 while the node reported
within ``stale_after`` seconds and 503 otherwise — a hung training loop turns the probe red.

The registry is our own, not prometheus_client's global one: two exporters in one process
(tests, the library API) never clash, and no process/platform collectors leak in.

``shoal health`` (``node.commands.health``) asks ``/healthz`` through ``check_health``; it is
what a container ``HEALTHCHECK`` runs.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from protocols.errors import ConfigError

# prometheus_client, urllib.request and hivemind (via protocols.progress) are imported where they
# are used: this module is imported by the CLI to register `shoal health`, and `shoal --help`
# should not pay for them.
if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from node.observe.metrics import RoundRecord


# name -> help; gauges are omitted from a scrape until known (a null eval_loss is no sample, not 0)
GAUGES = {
    "round": "Last round this peer finished (or is in, between rounds).",
    "loss": "Recent mean inner training loss.",
    "eval_loss": "Held-out loss of the shared model at the last evaluation.",
    "tokens_per_second": "Tokens per second: tokens of the last round / its wall-clock length, or the live rate.",
    "utilization_ratio": "Share of the last round's wall-clock time spent in inner steps (compute_s / wall_s).",
    "peers": "Peers of the run this node sees online.",
    "group_size": "Members of the last all-reduce group.",
    "sync_seconds": "Duration of the last round's sync (sync_s in the metrics file).",
    "allreduce_seconds": "Duration of the last all-reduce alone, from its scheduled start.",
}
LIVE_FIGURES = frozenset({"round", "loss", "eval_loss", "tokens_per_second", "utilization_ratio", "peers",
                          "group_size", "sync_seconds", "allreduce_seconds", "bytes_sent", "bytes_received"})


class MetricsExporter:
    """Serves ``/metrics`` and ``/healthz`` on ``host:port`` (port 0: any free one; see ``.port``)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, stale_after: float = 120.0,
                 peer_id: str = "", run_id: str = "", clock=time.monotonic):
        if stale_after <= 0:
            raise ValueError(f"stale_after ({stale_after}) must be > 0 seconds")
        self.stale_after, self.peer_id, self.run_id = stale_after, peer_id, run_id
        self._clock = clock
        self._lock = threading.Lock()
        self._figures: dict[str, float] = {}
        self._bytes = {"sent": 0, "received": 0}
        self._rounds_by_applied: Counter[str] = Counter()
        self._tokens_total = 0
        self._last_report: float | None = None  # our clock
        self._last_report_unix: float | None = None
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        try:
            self._server = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as e:
            raise ConfigError(f"metrics endpoint: cannot listen on {host}:{port} ({e.strerror or e}); "
                              "pick another --metrics-port, or 0 for any free one") from None
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="shoal-exporter", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- reporting (the node's threads) ----------------------------------------------------------
    def touch(self) -> None:
        """The node is alive (e.g. from the training loop every step or every few seconds)."""
        with self._lock:
            self._last_report, self._last_report_unix = self._clock(), time.time()

    def update(self, **figures: float | int | None) -> None:
        """Set live figures (names in ``LIVE_FIGURES``; ``bytes_*`` are cumulative counts); None = unknown."""
        unknown = set(figures) - LIVE_FIGURES
        assert not unknown, f"unknown exporter figures {sorted(unknown)}; known: {sorted(LIVE_FIGURES)}"
        with self._lock:
            for name, value in figures.items():
                if name.startswith("bytes_"):
                    self._bytes[name.removeprefix("bytes_")] = int(value or 0)
                else:
                    self._set(name, value)
        self.touch()

    def observe_round(self, record: RoundRecord) -> None:
        """One finished round (the same record the metrics file gets)."""
        stats = record.stats
        with self._lock:
            for name, value in (("round", stats.round), ("loss", stats.loss), ("peers", record.peers),
                                ("group_size", stats.group_size), ("sync_seconds", stats.sync_s),
                                ("allreduce_seconds", stats.allreduce_s)):
                self._set(name, value)
            if record.eval_loss is not None:  # not evaluated this round: keep the last evaluation
                self._set("eval_loss", record.eval_loss)
            if stats.wall_s:
                self._set("tokens_per_second", stats.tokens / stats.wall_s)
                self._set("utilization_ratio", min(max(stats.compute_s / stats.wall_s, 0.0), 1.0))
            self._rounds_by_applied[str(stats.applied)] += 1
            self._tokens_total += int(stats.tokens)
        self.touch()

    def _set(self, name: str, value: Any) -> None:
        if value is None or not math.isfinite(float(value)):
            self._figures.pop(name, None)
        else:
            self._figures[name] = float(value)

    # -- reading (the HTTP server's threads) ---------------------------------------------------
    def health(self) -> tuple[bool, str]:
        """(healthy, why): healthy while the last report is at most ``stale_after`` seconds old."""
        with self._lock:
            last = self._last_report
        if last is None:
            return False, "no report from the node yet"
        age = self._clock() - last
        if age > self.stale_after:
            return False, f"stale: last report {age:.0f}s ago (limit {self.stale_after:g}s)"
        return True, "ok"

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"figures": dict(self._figures), "bytes": dict(self._bytes),
                    "rounds": dict(self._rounds_by_applied), "tokens": self._tokens_total,
                    "last_report_unix": self._last_report_unix}

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Collector:
    """Builds the metric families from one consistent snapshot per scrape."""

    def __init__(self, exporter: MetricsExporter):
        self.exporter = exporter

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        from protocols.version import shoal_version

        exporter, snap = self.exporter, self.exporter.snapshot()
        info = InfoMetricFamily("shoal", "This node.")
        info.add_metric([], {"peer_id": exporter.peer_id, "run_id": exporter.run_id, "version": shoal_version()})
        yield info
        for name, help_text in GAUGES.items():
            if name in snap["figures"]:
                yield GaugeMetricFamily(f"shoal_{name}", help_text, value=snap["figures"][name])
        yield CounterMetricFamily("shoal_bytes_sent", "Bytes this node sent (cumulative).", value=snap["bytes"]["sent"])
        yield CounterMetricFamily("shoal_bytes_received", "Bytes this node received (cumulative).",
                                  value=snap["bytes"]["received"])
        rounds = CounterMetricFamily("shoal_rounds", "Rounds finished, by how the update was applied.",
                                     labels=["applied"])
        for applied, count in sorted(snap["rounds"].items()):
            rounds.add_metric([applied], count)
        yield rounds
        yield CounterMetricFamily("shoal_tokens", "Tokens this node trained on in finished rounds.", value=snap["tokens"])
        if snap["last_report_unix"] is not None:
            yield GaugeMetricFamily("shoal_last_report_timestamp_seconds", "Unix time of the node's last report.",
                                    value=snap["last_report_unix"])


def _handler(exporter: MetricsExporter) -> type[BaseHTTPRequestHandler]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(exporter.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                healthy, why = exporter.health()
                self._reply(200 if healthy else 503, f"{why}\n".encode())
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
            pass

    return Handler


def check_health(port: int, *, host: str = "127.0.0.1", timeout: float = 3.0) -> tuple[bool, str]:
    """Ask a node's ``/healthz``: (healthy, one-line message). Never raises for network problems."""
    import urllib.error
    import urllib.request

    url = f"http://{host}:{port}/healthz"
    # No proxies: an http_proxy in the environment must not take a localhost probe elsewhere.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return True, f"healthy: {_first_line(response.read())}"
    except urllib.error.HTTPError as e:
        return False, f"unhealthy: {url} answered {e.code}: {_first_line(e.read())}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return False, f"unhealthy: no node answers on {url} ({reason}); is it running with --metrics-port {port}?"


def _first_line(body: bytes) -> str:
    lines = body.decode("utf-8", "replace").strip().splitlines()
    return lines[0][:200] if lines else "(empty)"
