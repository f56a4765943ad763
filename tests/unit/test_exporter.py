"""The Prometheus endpoint: what a scrape shows, /healthz going stale, the port freed on close."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from averaging.state.verdict import Applied
from node.commands.health import health
from node.observe.exporter import MetricsExporter, check_health
from protocols.version import shoal_version
from tests.rounds import round_record


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def exporter():
    exp = MetricsExporter(port=0, stale_after=30.0, peer_id="12D3KooWpeer", run_id="demo", clock=FakeClock())
    yield exp
    exp.close()


def test_a_scrape_shows_the_round_figures(exporter):
    exporter.observe_round(round_record())
    exporter.observe_round(round_record(round=8, applied=Applied.LOCAL, tokens=20480, eval_loss=None, loss=3.0))
    exporter.update(bytes_sent=123_456, bytes_received=654_321)
    status, text = get(f"{exporter.url}/metrics")
    assert status == 200
    found = samples(text)
    assert found[("shoal_round", ())] == 8
    assert found[("shoal_loss", ())] == 3.0
    assert found[("shoal_eval_loss", ())] == 3.5  # round 8 was not evaluated: the last evaluation stays
    assert found[("shoal_tokens_per_second", ())] == pytest.approx(2048.0)
    assert found[("shoal_utilization_ratio", ())] == pytest.approx(0.9)
    assert found[("shoal_peers", ())] == 4 and found[("shoal_group_size", ())] == 3
    assert found[("shoal_sync_seconds", ())] == 1.5 and found[("shoal_allreduce_seconds", ())] == 0.75
    assert found[("shoal_rounds_total", (("applied", "averaged"),))] == 1
    assert found[("shoal_rounds_total", (("applied", "local"),))] == 1
    assert found[("shoal_tokens_total", ())] == 40960 + 20480
    assert found[("shoal_bytes_sent_total", ())] == 123_456
    assert found[("shoal_bytes_received_total", ())] == 654_321
    assert found[("shoal_info", (("peer_id", "12D3KooWpeer"), ("run_id", "demo"), ("version", shoal_version())))] == 1
    assert ("shoal_last_report_timestamp_seconds", ()) in found


def test_unknown_figures_are_absent_not_zero(exporter):
    _, text = get(f"{exporter.url}/metrics")
    names = {name for name, _ in samples(text)}
    assert "shoal_loss" not in names and "shoal_eval_loss" not in names and "shoal_round" not in names
    exporter.update(loss=2.5, peers=3, round=4)
    exporter.update(loss=None)  # a diverged / unknown loss is dropped, not exported as 0 or NaN
    found = samples(get(f"{exporter.url}/metrics")[1])
    assert ("shoal_loss", ()) not in found and found[("shoal_peers", ())] == 3


def test_healthz_is_ok_while_the_node_reports_and_503_when_stale(exporter):
    clock = exporter._clock
    assert get(f"{exporter.url}/healthz") == (503, "no report from the node yet\n")
    exporter.touch()
    assert get(f"{exporter.url}/healthz") == (200, "ok\n")
    clock.now += 30.0
    assert get(f"{exporter.url}/healthz")[0] == 200  # exactly at the limit: still fine
    clock.now += 1.0
    code, body = get(f"{exporter.url}/healthz")
    assert code == 503 and "stale: last report 31s ago" in body
    exporter.observe_round(round_record())  # any report makes it healthy again
    assert get(f"{exporter.url}/healthz")[0] == 200
    assert get(f"{exporter.url}/nope")[0] == 404


def test_check_health_and_the_command(exporter):
    assert check_health(exporter.port) == (False, f"unhealthy: {exporter.url}/healthz answered 503: no report from the node yet")
    exporter.touch()
    assert check_health(exporter.port) == (True, "healthy: ok")
    runner = CliRunner()
    result = runner.invoke(_app(), ["--port", str(exporter.port)])
    assert result.exit_code == 0 and "healthy: ok" in result.output
    exporter._clock.now += 100
    result = runner.invoke(_app(), [], env={"SHOAL_METRICS_PORT": str(exporter.port)})
    assert result.exit_code == 1 and "stale" in result.output


def test_close_frees_the_port_and_health_then_fails():
    exporter = MetricsExporter(port=0)
    port = exporter.port
    exporter.close()
    exporter.close()  # idempotent
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # would raise if still held
    healthy, message = check_health(port, timeout=1)
    assert not healthy and "no node answers" in message and "\n" not in message


def test_a_taken_port_is_a_one_line_config_error(exporter):
    from protocols.errors import ConfigError

    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{exporter.port}"):
        MetricsExporter(port=exporter.port)


def _app():
    import typer

    app = typer.Typer()
    app.command()(health)
    return app
