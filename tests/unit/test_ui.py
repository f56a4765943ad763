"""The live view draws the figures it is given, in each state a node can be in."""

from __future__ import annotations

import dataclasses
import io
import logging
import time

import pytest
from rich.console import Console

from node.observe.ui import LiveView, NodeStatus, PlainView, human_bytes, sparkline, sync_state
from protocols.progress import ProgressRecord

ME = "12D3KooWNSgyp7Jk9sKE6bQqBHmCKDCX6ayX3cFHpLdcFWUy56Sd"
OTHER = "QmTXBvkP4c7dTFVHy1zWMn2p2GvS6hUgSjtFQyJSTJwmv6"


def progress(peer_id: str, **changes) -> ProgressRecord:
    base = ProgressRecord(
        peer_id=peer_id, round=12, tokens_per_s=3000.0, loss=3.2, eval_loss=None, device="cpu", utilization=0.5,
        bytes_sent=0, bytes_received=0, mode="full", version="0.1.0", tokens=100, time=time.time() - 7, phase="training",
    )
    return dataclasses.replace(base, **changes)


def status(**changes) -> NodeStatus:
    now = time.time()
    base = NodeStatus(
        peer_id=ME, run_id="demo-run", peers=2, round=12, max_rounds=100, phase="training", round_start=now - 4,
        round_end=now + 6, loss=3.25, eval_loss=3.5, tokens_per_s=1000.0, group_size=2, sync_s=1.25,
        last_sync="averaged", rounds_done=11, finished_round=11, utilization=0.93, device="cuda:0",
        peer_records=(progress(ME, tokens_per_s=1000.0, device="cuda:0"), progress(OTHER)),
    )
    return dataclasses.replace(base, **changes)


def draw(view: LiveView) -> str:
    console = Console(file=io.StringIO(), width=100)
    console.print(view.render())
    return console.file.getvalue()


def test_a_training_peer_in_a_swarm_shows_every_section():
    view = LiveView(console=Console(file=io.StringIO(), width=100))
    view.update(status())
    text = draw(view)
    assert "run demo-run" in text and "…Uy56Sd" in text
    assert "2 peers online" in text and "4,000 tokens/s total" in text and "this peer 25%" in text
    assert "12 / 100" in text and "sync: merged" in text and "to deadline" in text
    assert "3.2500" in text and "eval 3.5000" in text
    assert "1,000" in text and "utilization 93%" in text
    assert "group 2" in text and "sync 1.25s" in text and "sub-groups" not in text
    assert "group 2 (one of 4 sub-groups)" in draw_status(status(group_count=4))
    # the peer table: both peers, the fastest first, with how long ago each was seen
    assert text.index("…TJwmv6") < text.index("…Uy56Sd (you)")
    assert "3,000" in text and "7s ago" in text


def tokens_row(text: str) -> str:
    return next(line for line in text.splitlines() if line.lstrip("│ ").startswith("tokens/s"))


def test_this_peers_tokens_per_s_has_the_swarms_beside_it():
    text = draw_status(status())
    assert "1,000 this peer   4,000 swarm (+3,000 from 1 other peer)   utilization 93%" in tokens_row(text)
    # our live rate, not our record's from a heartbeat ago: the swarm row and this row agree
    text = draw_status(status(tokens_per_s=1500.0, peers=3, peer_records=(
        progress(ME, tokens_per_s=1000.0), progress(OTHER), progress("12D3KooW" + "1" * 44, tokens_per_s=500.0))))
    assert "1,500 this peer   5,000 swarm (+3,500 from 2 other peers)" in tokens_row(text)
    assert "5,000 tokens/s total" in text and "this peer 30%" in text
    # alone: the swarm is this peer, nothing to put beside it
    alone = tokens_row(draw_status(status(peers=1, peer_records=(progress(ME),))))
    assert "1,000   utilization 93%" in alone and "swarm" not in alone


def test_sparklines_follow_the_rounds():
    view = LiveView(console=Console(file=io.StringIO(), width=100))
    for round, loss in enumerate((4.0, 3.0, 2.0, 1.0), start=1):
        view.round_done(status(loss=loss, eval_loss=loss + 0.5, finished_round=round))
    assert view.loss_history == (4.0, 3.0, 2.0, 1.0)
    assert "█▆▃▁" in draw(view)


def test_network_shows_the_sync_rate_and_the_totals():
    text = draw_status(status(bytes_sent=8_000_000, bytes_received=2_000_000, sync_bytes_per_s=None))
    assert "total ↑ 8.0 MB ↓ 2.0 MB" in text and "while syncing" not in text
    text = draw_status(status(bytes_sent=8_000_000, bytes_received=2_000_000, sync_bytes_per_s=1_500_000))
    assert "1.5 MB/s while syncing" in text
    network = next(line for line in text.splitlines() if "total ↑" in line)
    assert "round ↑" not in network  # no round finished yet


def test_network_and_peer_table_show_the_last_rounds_payload():
    text = draw_status(status(round_bytes_sent=1_560_000, round_bytes_received=1_540_000,
                              peer_records=(progress(ME, round_bytes_sent=1_560_000), progress(OTHER))))
    assert "round ↑ 1.6 MB ↓ 1.5 MB" in text
    rows = [line for line in text.splitlines() if "…Uy56Sd" in line or "…TJwmv6" in line]
    assert any("1.6 MB" in row for row in rows) and any(" - " in row for row in rows)  # older peers: unknown


def test_what_robust_aggregation_refused_is_shown_only_when_something_was():
    assert "refused" not in draw_status(status())
    text = draw_status(status(robust={"refused_parts": 3, "refused_returns": 0, "bans": 1}))
    row = next(line for line in text.splitlines() if "refused" in line)
    assert "3 parts" in row and "1 peers banned" in row and "returned" not in row and "the log" in row


def test_a_wrong_clock_gets_its_line_only_when_off():
    from protocols.swarm_time import describe_offset

    assert "NTP" not in draw_status(status())
    text = draw_status(status(clock_advice=describe_offset(-5.0, 2)))
    assert "clock" in text and "5.0s ahead of" in text and "NTP" in text


def test_alone_is_said_plainly():
    text = draw_status(status(peers=1, peer_records=(progress(ME),), last_sync="local", group_size=1))
    assert "alone: waiting for other peers to join" in text
    assert "peers online" not in text and "…TJwmv6" not in text
    assert "sync: alone" in text


def test_joining_shows_the_download_progress():
    text = draw_status(status(phase="joining", download_fraction=0.45, peer_records=()))
    assert "joining: downloading state 45%" in text
    assert "to deadline" not in text


def test_averaging_and_missed_sync_states():
    assert sync_state(status(phase="training + averaging")) == "averaging"
    assert sync_state(status(last_sync="local (failed)")) == "missed (own update)"
    assert sync_state(status(last_sync="folded (stayed out)")) == "stayed out (work carried over)"
    assert sync_state(status(finished_round=0)) == "-"


def test_peer_strings_are_not_rich_markup():
    hostile = progress(OTHER, device="[red]pwn[/red]", phase="[link=x]y")
    text = draw_status(status(peer_records=(hostile,)))
    assert "[red]pwn[/red]" in text and "[link=x]y" in text


def test_long_device_names_are_cut_and_columns_stay_aligned():
    long = progress(OTHER, device="NVIDIA GeForce RTX 4090 Laptop GPU", tokens_per_s=9000.0)
    lines = [line for line in draw_status(status(peer_records=(long, progress(ME)))).splitlines() if "ago" in line]
    assert "NVIDIA GeForce …" in lines[0]
    assert lines[0].index("ago") == lines[1].index("ago")


def test_many_peers_are_cut_to_a_few_rows():
    peers = tuple(progress(f"12D3KooW{i:044d}", tokens_per_s=float(i)) for i in range(20))
    text = draw_status(status(peer_records=peers))
    assert "… and 12 more" in text


def draw_status(s: NodeStatus) -> str:
    view = LiveView(console=Console(file=io.StringIO(), width=100))
    view.round_done(s)
    return draw(view)


def test_the_refresh_thread_draws_while_the_loop_swaps_snapshots():
    out = io.StringIO()
    view = LiveView(console=Console(file=out, width=100, force_terminal=True))
    view.start()
    try:
        for i in range(200):
            view.update(status(loss=float(i)))
            if i % 50 == 0:
                view.round_done(status(loss=float(i)))
        time.sleep(0.3)
    finally:
        view.stop()
    assert "2 peers online" in out.getvalue()


def test_plain_view_logs_one_line_per_round(caplog):
    view = PlainView()
    with caplog.at_level(logging.INFO, logger="node.observe.ui"):
        view.update(status())
        view.round_done(status())
    assert len(caplog.records) == 1
    assert "round 11" in caplog.text and "tokens/s=1,000 swarm_tokens/s=4,000 utilization=93%" in caplog.text


@pytest.mark.parametrize("values, expected", [((), ""), ((1.0, 1.0), "▅▅"), ((0.0, 1.0), "▁█"), ((2.0, float("nan"), 1.0), "█▁")])
def test_sparkline(values, expected):
    assert sparkline(values) == expected


def test_human_bytes():
    assert [human_bytes(v) for v in (12, 1_500, 2_000_000, 3e12)] == ["12 B", "1.5 kB", "2.0 MB", "3000.0 GB"]
