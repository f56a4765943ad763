"""``shoal status`` without a network: the snapshot's JSON and table, the schedule it picks, and
the argument errors that come before any DHT starts."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from node.commands.status import status
from node.library.snapshot import SwarmSnapshot, schedule_of
from node.observe.status_view import render_snapshot
from protocols.manifest import RunManifest
from protocols.progress import ProgressRecord
from protocols.schedule import RoundSchedule

A = "12D3KooWNSgyp7Jk9sKE6bQqBHmCKDCX6ayX3cFHpLdcFWUy56Sd"
B = "QmTXBvkP4c7dTFVHy1zWMn2p2GvS6hUgSjtFQyJSTJwmv6"
NOW = 10_000.0


def progress(peer_id: str, **changes) -> ProgressRecord:
    base = ProgressRecord(
        peer_id=peer_id, round=7, tokens_per_s=1000.0, loss=3.0, eval_loss=None, device="cpu", utilization=0.8,
        bytes_sent=5, bytes_received=6, mode="full", version="0.1.0", tokens=100, time=NOW - 2.0, phase="training",
    )
    return dataclasses.replace(base, **changes)


def snapshot(**changes) -> SwarmSnapshot:
    base = SwarmSnapshot(
        run_id="demo", time=NOW, schedule=RoundSchedule(start_time=NOW - 65.0, round_seconds=10.0),
        records={A: progress(A, tokens_per_s=3000.0, loss=2.0, eval_loss=2.5, device="cuda:0"),
                 B: progress(B, round_bytes_sent=3, round_bytes_received=4, sync_late_s=14.5, rounds_done=6)},
        malformed=2,
    )
    return dataclasses.replace(base, **changes)


def test_json_has_the_documented_keys():
    out = snapshot().to_json()
    assert json.loads(json.dumps(out, allow_nan=False)) == out  # strict JSON
    assert out["run_id"] == "demo" and out["round"] == 7 and out["round_seconds"] == 10.0
    assert out["round_ends_in_s"] == pytest.approx(5.0)
    assert out["peers"] == 2 and out["tokens_per_s"] == 4000.0 and out["tokens"] == 200
    assert out["loss"] == pytest.approx(2.5) and out["eval_loss"] == 2.5 and out["malformed"] == 2
    first, second = out["peer_list"]  # fastest first
    assert first["peer_id"] == A and second["peer_id"] == B
    assert first == {"peer_id": A, "round": 7, "tokens_per_s": 3000.0, "loss": 2.0, "eval_loss": 2.5,
                     "device": "cuda:0", "utilization": 0.8, "mode": "full", "phase": "training", "version": "0.1.0",
                     "tokens": 100, "bytes_sent": 5, "bytes_received": 6, "shard": None, "round_bytes_sent": None,
                     "round_bytes_received": None, "sync_late_s": None, "rounds_done": None, "clock_offset_s": None, "group_count": None,
                     "last_seen_s": 2.0}
    assert second["round_bytes_sent"] == 3 and second["round_bytes_received"] == 4
    assert second["sync_late_s"] == 14.5 and second["rounds_done"] == 6
    assert out["progress_shards"] == 1 and snapshot(progress_shards=8).to_json()["progress_shards"] == 8


def test_without_a_manifest_the_round_comes_from_the_peers():
    out = snapshot(schedule=None).to_json()
    assert out["round"] == 7 and out["round_seconds"] is None and out["round_ends_in_s"] is None
    empty = snapshot(schedule=None, records={}, malformed=0).to_json()
    assert (empty["round"], empty["peers"], empty["loss"], empty["peer_list"]) == (None, 0, None, [])


def test_the_table_shows_the_figures():
    console = Console(file=io.StringIO(), width=100)
    console.print(render_snapshot(snapshot()))
    text = console.file.getvalue()
    assert "2 online" in text and "round  7   (10s rounds, 5s left)" in text
    assert "4,000 tokens/s" in text and "2 malformed progress records" in text
    assert "…Uy56Sd" in text and "cuda:0" in text and "2s ago" in text
    assert "DHT keys" not in text  # one key: nothing to say
    console = Console(file=io.StringIO(), width=100)
    console.print(render_snapshot(snapshot(records={}, malformed=0)))
    assert "no peer of run 'demo' is online" in console.file.getvalue()
    console = Console(file=io.StringIO(), width=100)
    console.print(render_snapshot(snapshot(progress_shards=4)))
    assert "2 online   (records under 4 DHT keys)" in console.file.getvalue()
    assert "sub-groups" not in text  # no record publishes a count: one group of everybody
    console = Console(file=io.StringIO(), width=120)
    console.print(render_snapshot(snapshot(records={A: progress(A, group_count=4), B: progress(B, group_count=4)})))
    assert "2 online   (averaging in 4 sub-groups a round)" in console.file.getvalue()


def test_a_peer_whose_syncs_outlast_the_round_gets_the_round_length_to_use():
    console = Console(file=io.StringIO(), width=160)
    console.print(render_snapshot(snapshot(records={A: progress(A, sync_late_s=14.5), B: progress(B, sync_late_s=3.0)})))
    text = console.file.getvalue()
    # 14.5 s late in 10 s rounds: a quarter more plus a second of room, whole seconds.
    assert "syncs end 14.5s after the deadline, longer than a round (10s): use --round-seconds 20" in text
    assert text.count("--round-seconds") == 1  # the peer whose syncs fit gets no advice


def test_a_peer_with_a_wrong_clock_is_named_with_the_fix():
    console = Console(file=io.StringIO(), width=200)
    console.print(render_snapshot(snapshot(records={A: progress(A, clock_offset_s=-5.04), B: progress(B, clock_offset_s=0.3)})))
    text = console.file.getvalue()
    assert "clock 5.0s ahead of the swarm's" in text and "NTP" in text
    assert text.count("NTP") == 1  # a clock 0.3 s off is not worth a line
    assert snapshot(records={A: progress(A, clock_offset_s=-5.04)}).to_json()["peer_list"][0]["clock_offset_s"] == -5.04


def manifest(start: float, d_model: int = 64) -> RunManifest:
    return RunManifest.create("demo", {"model.d_model": d_model}, start_time=start, round_seconds=10.0)


def test_schedule_follows_the_majority_config_and_its_earliest_start():
    assert schedule_of([]) is None
    chosen = schedule_of([manifest(500.0), manifest(400.0), manifest(100.0, d_model=32)])
    assert chosen == RoundSchedule(400.0, 10.0)  # the stray config's earlier start does not decide


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "needs --initial-peer"),
        (["--initial-peer", "/ip4/127.0.0.1/tcp/1"], "/p2p/<peer id>"),
        (["--initial-peer", f"/ip4/127.0.0.1/tcp/1/p2p/{A}", "--run-id", "no spaces"], "run id"),
        (["--initial-peer", f"/ip4/127.0.0.1/tcp/1/p2p/{A}", "--watch", "--json"], "do not combine"),
    ],
)
def test_bad_arguments_fail_before_any_network(args, needle, monkeypatch):
    import node.library.dht

    monkeypatch.setattr(node.library.dht, "open_client_dht", lambda *a: pytest.fail("started a DHT"))
    import typer

    app = typer.Typer()
    app.command()(status)
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (2, 3) and needle in result.output
