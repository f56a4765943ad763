import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest

from node.observe.metrics import ROUND_FIELDS, MetricsWriter, read_metrics
from tests.rounds import round_record


def test_lines_are_strict_json_with_envelope(tmp_path):
    path = tmp_path / "deep" / "dir" / "metrics.jsonl"  # parent dirs are created
    before = time.time()
    with MetricsWriter(path, peer_id="12D3KooWpeer") as writer:
        returned = writer.write("start", model="tiny", lr=0.7)
        writer.write_round(round_record())
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert records[0] == returned
    assert records[0]["event"] == "start" and records[0]["peer"] == "12D3KooWpeer"
    assert before <= records[0]["time"] <= time.time()
    assert list(records[1])[:3] == ["event", "peer", "time"]
    assert list(records[1])[3:3 + len(ROUND_FIELDS)] == list(ROUND_FIELDS)


def test_nan_and_inf_become_null_even_nested(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path, peer_id="p")
    record = writer.write(
        "round", loss=math.nan, grad=math.inf, per_peer={"a": -math.inf, "b": [1.0, math.nan]}
    )
    writer.close()
    line = path.read_text().strip()
    for bad in ("NaN", "Infinity"):
        assert bad not in line
    # parse_constant fires only on NaN/Infinity tokens: strict parsers (jq, JS) would choke on those.
    parsed = json.loads(line, parse_constant=lambda token: pytest.fail(f"non-strict JSON token {token}"))
    assert parsed["loss"] is None and parsed["grad"] is None
    assert parsed["per_peer"] == {"a": None, "b": [1.0, None]}
    assert record["loss"] is None


def test_appends_across_writers(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, peer_id="p") as writer:
        writer.write("a")
    with MetricsWriter(path, peer_id="p") as writer:
        writer.write("b")
    assert [r["event"] for r in read_metrics(path)] == ["a", "b"]


def test_reserved_field_names_are_refused(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl", peer_id="p") as writer:
        with pytest.raises(ValueError, match="reserved"):
            writer.write("x", peer="someone-else")


def test_none_path_is_a_no_op_writer(tmp_path):
    writer = MetricsWriter(None, peer_id="p")
    record = writer.write("round", loss=math.nan)
    writer.close()
    assert record["event"] == "round" and record["loss"] is None
    assert list(tmp_path.iterdir()) == []


def test_writes_after_close_are_dropped(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path, peer_id="p")
    writer.write("kept")
    writer.close()
    writer.write("dropped")
    writer.close()  # idempotent
    assert [r["event"] for r in read_metrics(path)] == ["kept"]


def test_each_line_is_on_disk_before_close(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path, peer_id="p")
    writer.write("first", value=1)
    assert read_metrics(path) and read_metrics(path)[0]["value"] == 1  # a crash now loses nothing
    writer.close()


def test_a_round_line_carries_the_contract_fields_first_then_every_figure(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, peer_id="p") as writer:
        writer.write_round(round_record(eval_loss=None, peers=3, lr=2e-3, round=9, error="timeout"))
    (line,) = read_metrics(path)
    assert list(line)[:3 + len(ROUND_FIELDS)] == ["event", "peer", "time", *ROUND_FIELDS]
    assert line["event"] == "round" and line["round"] == 9 and line["eval_loss"] is None
    # every other figure of the engine's RoundStats and the process's extras, by name
    assert line["applied"] == "averaged" and line["peers"] == 3 and line["lr"] == 2e-3
    assert line["error"] == "timeout" and line["group"] == ["a", "b", "c"] and line["allreduce_s"] == 0.75


def test_concurrent_writes_produce_whole_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    threads_n, per_thread = 8, 200
    # Long, many-part lines and frequent thread switches make an interleaved line likely
    # if a write were ever split into pieces without the lock (e.g. json.dump to the file).
    payload = [f"item-{k}" for k in range(200)]
    old_interval = sys.getswitchinterval()
    writer = MetricsWriter(path, peer_id="p")
    barrier = threading.Barrier(threads_n)

    def work(thread_id: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            writer.write("tick", thread=thread_id, i=i, payload=payload)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    writer.close()

    lines = path.read_text().split("\n")
    assert lines[-1] == ""
    records = [json.loads(line) for line in lines[:-1]]
    assert len(records) == threads_n * per_thread
    for t in range(threads_n):
        assert [r["i"] for r in records if r["thread"] == t] == list(range(per_thread))


def test_read_metrics_skips_only_a_truncated_final_line(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, peer_id="p") as writer:
        writer.write("a")
        writer.write("b")
    with open(path, "a") as f:
        f.write('{"event": "c", "pe')  # crash mid-write
    assert [r["event"] for r in read_metrics(path)] == ["a", "b"]

    path.write_text('{"event": "a"}\n{broken\n{"event": "c"}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


def test_a_full_disk_drops_lines_and_never_raises(tmp_path, caplog):
    """/dev/full answers every write with ENOSPC: the writer says so once and goes on."""
    writer = MetricsWriter(Path("/dev/full"), peer_id="p")
    with caplog.at_level("ERROR"):
        for round in range(3):
            assert writer.write("round", round=round)["round"] == round
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records)) == 1
    assert "No space left on device" in caplog.records[0].message
    writer.close()


def test_a_line_torn_by_a_full_disk_is_cut_and_the_file_stays_readable(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path, peer_id="p")
    writer.write("round", round=1)
    real = writer._file

    class HalfFull:  # the disk takes 10 bytes of the next line, then is full
        def write(self, data):
            return real.write(data[:10])

        def fileno(self):
            return real.fileno()

    writer._file = HalfFull()
    writer.write("round", round=2)
    writer._file = real  # space again
    writer.write("round", round=3)
    writer.close()
    assert [r["round"] for r in read_metrics(path)] == [1, 3]
