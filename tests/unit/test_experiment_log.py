import errno
import importlib.util
import json
import logging
import math
import os
import struct
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from node.observe.experiment_log import ExperimentLog, MultiLog, open_experiment_logs, round_scalars
from node.observe.metrics import MetricsWriter
from protocols.errors import ConfigError
from tests.rounds import round_record

PEER, RUN = "12D3KooWpeerA", "my-run"
# The `logs` extra; the tests of the errors without it, of the no-op log and of the guard run anyway.
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="needs the tensorboard package (pip install 'shoal[logs]')")


def rounds_as_written(tmp_path: Path, *records) -> list[dict]:
    """The dicts the node gets back from ``write_round`` (what it hands the experiment logs)."""
    with MetricsWriter(tmp_path / "m.jsonl", PEER) as writer:
        return [writer.write_round(record) for record in records]


def test_round_scalars_map_every_numeric_field_under_its_prefix(tmp_path):
    [record] = rounds_as_written(tmp_path, round_record(robust={"refused_parts": 2}, diverged=["x"],
                                                        error="timed out", bytes_sent=1000))
    record["future_field"] = 5  # a field added to RoundStats later still shows up
    scalars = round_scalars(record)
    assert scalars["train/loss"] == 3.25 and scalars["eval/loss"] == 3.5 and scalars["train/lr"] == 1e-3
    assert scalars["train/tokens_per_s"] == pytest.approx(40960 / 9.0)  # the dashboard's rate: per compute second
    assert scalars["train/utilization"] == pytest.approx(0.9)
    assert scalars["sync/group_size"] == 3 and scalars["sync/sync_s"] == 1.5 and scalars["sync/wait_s"] == 0.1
    assert scalars["sync/bytes_sent"] == 1000 and scalars["swarm/peers"] == 4 and scalars["swarm/rounds_done"] == 6
    assert scalars["sync/averaged"] == 1.0 and scalars["sync/failed"] == 1.0 and scalars["sync/diverged"] == 1
    assert scalars["sync/robust/refused_parts"] == 2 and scalars["sync/resynced"] == 0.0
    assert scalars["round/future_field"] == 5
    # the envelope, the step itself and strings are not scalars
    assert not {"round", "time", "round/round", "round/peer", "round/applied", "round/error"} & scalars.keys()
    assert all(tag.split("/")[0] in ("train", "eval", "sync", "swarm", "round") for tag in scalars)


def test_nan_and_missing_values_are_skipped():
    scalars = round_scalars({"round": 3, "loss": math.nan, "eval_loss": None, "sync_s": math.inf, "tokens": 10,
                             "compute_s": 0.0, "wall_s": 0.0})
    assert scalars == {"train/tokens": 10.0, "train/compute_s": 0.0, "train/wall_s": 0.0}  # no rate from 0 s


def read_tensorboard(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


@needs_tensorboard
def test_tensorboard_scalars_text_and_hparams_read_back(tmp_path):
    records = rounds_as_written(tmp_path, round_record(round=1, loss=3.0), round_record(round=2, loss=math.nan),
                                round_record(round=3, loss=2.0, error="group timed out"))
    log = open_experiment_logs(tmp_path / "tb", None, PEER, RUN)
    log.start({"model": {"kind": "tiny", "layers": 2}, "outer": {"lr": 0.7}, "data": None})
    for record in records:
        log.round(record)
    log.event("peer_join", {"other": "12D3KooWpeerB", "peers": 5})
    log.event("resync", {"round": 3, "diverged": ["12D3KooWpeerB", "12D3KooWpeerC"]})
    log.event("peer_join", {"other": "12D3KooWpeerC", "peers": 6})
    log.close()
    log.round(records[0])  # after close: dropped, no error

    events = read_tensorboard(tmp_path / "tb" / RUN / PEER)
    loss = events.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 3.0), (3, 2.0)]  # the NaN round is a gap
    assert [e.wall_time for e in loss] == pytest.approx([records[0]["time"], records[2]["time"]])
    assert [e.step for e in events.Scalars("sync/failed")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("sync/failed")] == [0.0, 0.0, 1.0]
    assert events.Scalars("train/tokens_per_s")[0].value == pytest.approx(40960 / 9.0)
    # events land on the last round; counts run on; a join moves swarm/peers
    assert [(e.step, e.value) for e in events.Scalars("events/peer_join")] == [(3, 1.0), (3, 2.0)]
    assert [e.value for e in events.Scalars("swarm/peers")] == [4.0, 4.0, 4.0, 5.0, 6.0]
    assert [(e.step, e.value) for e in events.Scalars("events/resync/diverged")] == [(3, 2.0)]  # a list: its length
    tensors = events.Tags()["tensors"]
    assert {"config/text_summary", "events/peer_join/text_summary", "sync/error/text_summary"} <= set(tensors)
    text = events.Tensors("events/peer_join/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "12D3KooWpeerB" in text
    assert {"_hparams_/experiment", "_hparams_/session_start_info",
            "_hparams_/session_end_info"} <= set(events.PluginTagToContent("hparams"))


@needs_tensorboard
def test_two_peers_write_two_tensorboard_runs(tmp_path):
    [record] = rounds_as_written(tmp_path, round_record(round=4))
    logs = [open_experiment_logs(tmp_path, None, peer, RUN) for peer in ("peerA", "peerB")]
    for log in logs:
        log.round(record)
        log.close()
    for peer in ("peerA", "peerB"):
        assert [e.step for e in read_tensorboard(tmp_path / RUN / peer).Scalars("train/loss")] == [4]


def test_missing_packages_are_one_line_config_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError) as caught:
        open_experiment_logs(tmp_path, None, PEER, RUN)
    assert str(caught.value) == "--tensorboard needs the tensorboard package: pip install 'shoal[logs]'"
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as caught:
        open_experiment_logs(None, "proj", PEER, RUN)
    assert str(caught.value) == "--wandb needs the wandb package: pip install 'shoal[logs]'"


@needs_tensorboard
def test_unwritable_tensorboard_directory_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match="--tensorboard .*cannot write"):
        open_experiment_logs(tmp_path / "file", None, PEER, RUN)


def test_no_flags_give_a_log_that_does_nothing(tmp_path):
    log = open_experiment_logs(None, None, PEER, RUN)
    assert type(log) is ExperimentLog
    log.start({"a": 1})
    log.round({"round": 1, "loss": 1.0})
    log.event("peer_join", {"peers": 2})
    log.close()
    assert list(tmp_path.iterdir()) == []


class Recording(ExperimentLog):
    def __init__(self, fail_with: Exception | None = None) -> None:
        super().__init__("recording")
        self.fail_with, self.writes, self.closed = fail_with, [], 0

    def _write_scalars(self, scalars, step, walltime):
        if self.fail_with is not None:
            raise self.fail_with
        self.writes.append((step, scalars))

    def _close(self):
        self.closed += 1


def test_a_failing_sink_warns_once_goes_quiet_and_the_others_go_on(caplog):
    broken, healthy = Recording(OSError(errno.ENOSPC, "No space left on device")), Recording()
    log = MultiLog([broken, healthy])
    with caplog.at_level(logging.WARNING, logger="node.observe.experiment_log"):
        for step in (1, 2, 3):
            log.round({"round": step, "loss": 1.0})  # never raises
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "recording" in warnings[0] and "No space left" in warnings[0]
    assert broken.disabled and broken.closed == 1  # released once, on failure
    assert [step for step, _ in healthy.writes] == [1, 2, 3]
    log.close()
    assert broken.closed == 1 and healthy.closed == 1


@needs_tensorboard
def test_a_tensorboard_writer_that_raises_is_disabled(tmp_path, monkeypatch, caplog):
    log = open_experiment_logs(tmp_path, None, PEER, RUN)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log._writer, "add_scalar", full_disk)
    with caplog.at_level(logging.WARNING):
        log.round({"round": 1, "loss": 1.0})
        log.event("peer_leave", {"peers": 1})
    assert log.disabled and sum("No space left" in r.getMessage() for r in caplog.records) == 1
    log.close()


def test_records_from_two_threads_all_arrive():
    log = Recording()

    def report(offset: int) -> None:
        for step in range(200):
            log.round({"round": offset + step, "loss": 1.0})
            log.event("peer_join", {"peers": 2})

    threads = [threading.Thread(target=report, args=(offset,)) for offset in (0, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(log.writes) == 800
    # the count is never lost to a race
    assert max(scalars.get("events/peer_join", 0) for _, scalars in log.writes) == 400


# --- Weights & Biases -------------------------------------------------------------------------

@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """A fresh wandb session with its env, home and files in tmp_path (wandb reads env at setup)."""
    wandb = pytest.importorskip("wandb")
    saved = dict(os.environ)
    wandb.teardown()
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # workspace settings (./wandb/settings) are tmp_path's
    yield wandb
    wandb.teardown()
    os.environ.clear()  # wandb.setup() writes to os.environ too
    os.environ.update(saved)


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a run's ``.wandb`` file (a LevelDB-style log of 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, position, pending = [], 7, b""  # after the 7-byte file header
    while position + 7 <= len(data):
        if (room := 32768 - position % 32768) < 7:  # a block's tail too small for a chunk header
            position += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@needs_tensorboard
def test_wandb_offline_runs_per_peer_hold_the_history(wandb_env, tmp_path):
    os.environ["WANDB_MODE"] = "offline"  # read when the first log opens (wandb.setup)
    records = rounds_as_written(tmp_path, round_record(round=5, loss=3.0), round_record(round=6, loss=math.nan),
                                round_record(round=8, loss=2.0))
    both = open_experiment_logs(tmp_path / "tb", "proj", "peerA", RUN)  # TensorBoard and W&B: fanned out
    other = open_experiment_logs(None, "proj", "peerB", RUN)  # a second peer in this process: its own run
    assert isinstance(both, MultiLog) and len(both.logs) == 2
    for log in (both, other):
        log.start({"model": {"kind": "tiny"}})
        for record in records:
            log.round(record)
        log.event("peer_join", {"other": "x", "peers": 5})
        log.close()
    # finish() may return before wandb's service has written the run file; teardown waits for it,
    # as the atexit hook does when the node exits.
    wandb_env.teardown()

    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2
    by_peer = {}
    for path in runs:
        content = read_wandb_records(path)
        kinds = [r.WhichOneof("record_type") for r in content]
        assert kinds.count("run") == 1, (path, path.stat().st_size, kinds)
        [run] = [r.run for r in content if r.WhichOneof("record_type") == "run"]
        assert run.project == "proj" and run.run_group == RUN
        by_peer[run.display_name] = content
    assert set(by_peer) == {"peerA", "peerB"}
    for content in by_peer.values():
        history = [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
                   for r in content if r.WhichOneof("record_type") == "history"]
        losses = [(json.loads(row["round"]), json.loads(row["train/loss"])) for row in history if "train/loss" in row]
        assert losses == [(5, 3.0), (8, 2.0)]  # the NaN round logged no loss
        assert [json.loads(row["round"]) for row in history if "events/peer_join" in row] == [8]
        config_keys = {u.key for r in content if r.WhichOneof("record_type") == "config" for u in r.config.update}
        config_keys |= {u.key for r in content if r.WhichOneof("record_type") == "run" for u in r.run.config.update}
        assert {"model", "peer_id", "run_id"} <= config_keys
        assert any(r.WhichOneof("record_type") == "exit" for r in content)  # finished


def test_wandb_online_without_credentials_is_refused_at_once(wandb_env, tmp_path):
    os.environ["WANDB_MODE"] = "online"
    with pytest.raises(ConfigError) as caught:
        open_experiment_logs(None, "proj", PEER, RUN)
    message = str(caught.value)
    assert "\n" not in message and "wandb login" in message and "WANDB_MODE=offline" in message
    assert not (tmp_path / "wandb").exists()  # no run was started


def test_wandb_credentials_are_found_where_wandb_looks(wandb_env, tmp_path):
    from node.observe.experiment_sinks import _has_credentials

    os.environ["WANDB_MODE"] = "online"
    settings = wandb_env.setup().settings
    assert not _has_credentials(wandb_env, settings)
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine {urlsplit(settings.base_url).netloc}\n  login user\n  password {'a' * 40}\n")
    netrc.chmod(0o600)
    os.environ["NETRC"] = str(netrc)  # what `wandb login` writes
    assert _has_credentials(wandb_env, settings)
    del os.environ["NETRC"]
    os.environ["WANDB_API_KEY"] = "b" * 40
    assert _has_credentials(wandb_env, settings)
