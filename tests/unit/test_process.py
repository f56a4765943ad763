"""``shoal run``'s process in-process: two ``Peer``s as threads over the local network, the whole
lifecycle (build, train, checkpoint, close) and the metrics file it writes; and the CLI's error
contract: the user's mistakes are one line and exit 2, a bug keeps its traceback and exit 1."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from typer.testing import CliRunner

from averaging.math.groups import balanced_groups
from node.cli import app
from node.library.checkpoint import list_checkpoints
from node.library.local_network import LocalNetwork, LocalSwarmHub
from node.observe.metrics import ROUND_FIELDS, read_metrics
from node.process.config import load_config
from node.process.options import PeerOptions
from node.process.peer import Peer, run_peer
from protocols.errors import ConfigError

# In-process swarms on real rounds: run beside the CPU-bound unit tests (scripts/run-suite.sh).
pytestmark = pytest.mark.wall_clock

# The first AdamW a process builds takes seconds (torch's lazy imports): pay it before any round clock runs.
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # some text to learn\n" for i in range(900))


@pytest.fixture
def config_for(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)

    def make(**overrides):
        return load_config(None, {"data.paths": [str(corpus)], "data.num_shards": 2, "round.seconds": 1.0,
                                  "averaging.matchmaking_seconds": 0.4, "averaging.request_timeout": 0.2,
                                  "averaging.allreduce_timeout": 5.0, "train.eval_batches": 1,
                                  "run_id": "process-test", **overrides})
    return make


def start_organiser_first(threads: list[threading.Thread], hub: LocalSwarmHub) -> None:
    """Start the first peer, wait until it has published the run's manifest, then the others: peers
    started at the same instant could each organise a run of their own (``join_run``'s random pause
    makes that rare; in-process, under load, seen once in four runs) and never meet."""
    threads[0].start()
    deadline = time.monotonic() + 60
    while not hub.read("process-test", "manifest") and time.monotonic() < deadline and threads[0].is_alive():
        time.sleep(0.05)
    for t in threads[1:]:
        t.start()


def test_two_peers_train_average_checkpoint_and_leave(tmp_path, config_for):
    hub = LocalSwarmHub()
    config = config_for()
    reasons: dict[str, str] = {}

    def peer(name: str) -> None:
        options = PeerOptions(max_rounds=6, ui=False, metrics_file=tmp_path / f"{name}.jsonl",
                              checkpoint_dir=tmp_path / f"ckpt-{name}",
                              tensorboard=tmp_path / "tb" if name == "a" else None)
        reasons[name] = run_peer(config, options, handle_signals=False, network=LocalNetwork(hub, name))

    threads = [threading.Thread(target=peer, args=(name,)) for name in ("a", "b")]
    start_organiser_first(threads, hub)
    for t in threads:
        t.join(timeout=60)
    assert reasons == {"a": "max_rounds", "b": "max_rounds"}
    for name in ("a", "b"):
        records = read_metrics(tmp_path / f"{name}.jsonl")
        events = [r["event"] for r in records]
        assert events[0] == "start" and events[-1] == "exit" and records[-1]["reason"] == "max_rounds"
        rounds = [r for r in records if r["event"] == "round"]
        assert rounds and all(set(ROUND_FIELDS) <= set(r) for r in rounds)
        assert any(r["applied"] == "averaged" and r["group_size"] == 2 and r["peers"] == 2 for r in rounds), rounds
        assert any(r["eval_loss"] is not None for r in rounds) and all(r["lr"] > 0 for r in rounds)
        assert "checkpoint" in events and list_checkpoints(tmp_path / f"ckpt-{name}")
        start = records[0]
        assert start["config_hash"] and start["sync_mode"] == "overlap" and start["parameters"] > 0
    # --tensorboard: a's round records as TensorBoard scalars, one step per round it finished.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a_rounds = [r for r in read_metrics(tmp_path / "a.jsonl") if r["event"] == "round"]
    (events_dir,) = {p.parent for p in (tmp_path / "tb" / "process-test").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events_dir))
    accumulator.Reload()
    losses = accumulator.Scalars("train/loss")
    assert [e.step for e in losses] == [r["round"] for r in a_rounds]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in a_rounds], rel=1e-6)
    # Each peer ends on its own shard (2 shards, 2 peers): a shared one is resolved by the larger id moving.
    final = {}
    for name in ("a", "b"):
        records = read_metrics(tmp_path / f"{name}.jsonl")
        final[name] = [r["shard"] for r in records if r["event"] in ("start", "shard")][-1]
    assert sorted(final.values()) == [0, 1], final


def test_four_peers_average_in_rotating_sub_groups(tmp_path, config_for):
    """``averaging.target_group_size = 2``: four peers plan two groups a round from each other's
    records, meet under their groups' keys, take their group's state (no re-sync ever), and
    publish the count."""
    hub = LocalSwarmHub()
    config = config_for(**{"averaging.target_group_size": 2})
    reasons: dict[str, str] = {}
    names = ("a", "b", "c", "d")

    def peer(name: str) -> None:
        options = PeerOptions(max_rounds=8, ui=False, metrics_file=tmp_path / f"{name}.jsonl",
                              checkpoint_dir=tmp_path / f"ckpt-{name}")
        reasons[name] = run_peer(config, options, handle_signals=False, network=LocalNetwork(hub, name))

    threads = [threading.Thread(target=peer, args=(name,)) for name in names]
    start_organiser_first(threads, hub)
    for t in threads:
        t.join(timeout=90)
    assert reasons == dict.fromkeys(names, "max_rounds")
    split = 0
    ids = [next(r["peer"] for r in read_metrics(tmp_path / f"{name}.jsonl") if r["event"] == "start")
           for name in names]
    for name in names:
        rounds = [r for r in read_metrics(tmp_path / f"{name}.jsonl") if r["event"] == "round"]
        assert not any(r["resynced"] or r["caught_up"] for r in rounds), rounds
        for r in rounds:
            if r["applied"] == "averaged" and 1 < r["group_size"] < 4 and r["round"] >= 3:
                # a sub-group (once the peers have read each other's records: before, each counts
                # fewer live peers): each member's group is its rank's in the round's hash order of
                # the live peers it had records of, all four (two groups of two) or, on a loaded
                # machine, three (a record not seen yet: seen once in the suite)
                views = [ids] + [[p for p in ids if p != gone] for gone in ids]
                plausible = [{balanced_groups(view, r["round"], 2, salt="process-test")[m]
                              for view in views if m in view} for m in r["group"]]
                assert set.intersection(*plausible), r
                groups = balanced_groups(ids, r["round"], 2, salt="process-test")
                split += {groups[p] for p in r["group"]} == {groups[r["peer"]]} and r["group_size"] == 2
    assert split >= 4, f"{split} peer-rounds averaged in sub-groups cut from all four records"
    assert all(record.group_count == 2 for record in hub_records(hub, "process-test")), hub_records(hub, "process-test")


class ForgetfulNetwork(LocalNetwork):
    """A peer that skips matchmaking in every round divisible by ``every`` (as if it found no group):
    it folds that round and is one outer step behind the others at the next."""

    def __init__(self, hub: LocalSwarmHub, name: str, every: int):
        super().__init__(hub, name)
        self.every = every

    def backend(self, **kwargs):
        backend = super().backend(**kwargs)
        prepare = backend.prepare

        def forgetful_prepare(*, round: int, **rest) -> None:
            if round % self.every:
                prepare(round=round, **rest)  # else no step for this round: average() finds none, the round folds

        backend.prepare = forgetful_prepare
        return backend


def test_a_peer_that_missed_a_round_replays_the_step_instead_of_downloading_the_state(tmp_path, config_for, caplog):
    """Three peers, one of which misses the matchmaking of every third round: each next round it is
    one outer step behind its group; the fingerprints say so, it replays the step it missed (the
    others serve it their applied update) and averages, never re-syncing, and the three end on one
    anchor. (With real processes and hivemind, a peer whose syncs run late replays the rounds it
    stayed out of: tests/integration/test_slow_sync.py.)"""
    hub = LocalSwarmHub()
    reasons: dict[str, str] = {}
    names = ("a", "b", "forgetful")
    config = config_for()

    def peer(name: str) -> None:
        options = PeerOptions(max_rounds=9, ui=False, metrics_file=tmp_path / f"{name}.jsonl",
                              checkpoint_dir=tmp_path / f"ckpt-{name}")
        network = ForgetfulNetwork(hub, name, 3) if name == "forgetful" else LocalNetwork(hub, name)
        reasons[name] = run_peer(config, options, handle_signals=False, network=network)

    threads = [threading.Thread(target=peer, args=(name,)) for name in names]
    with caplog.at_level(logging.INFO, logger="averaging.engine.recover"):
        start_organiser_first(threads, hub)
        for t in threads:
            t.join(timeout=90)
    assert reasons == dict.fromkeys(names, "max_rounds")
    per_peer = {name: {r["round"]: r for r in read_metrics(tmp_path / f"{name}.jsonl") if r["event"] == "round"}
                for name in names}
    # From the first missed round on, nobody re-syncs. (Before it, on a loaded machine, a peer that
    # starts a round late can find the first one already stepped alone and re-sync once as it joins:
    # the joining path, not what this test is about; seen once in the suite.)
    assert not any(r["resynced"] for rounds in per_peer.values() for n, r in rounds.items() if n >= 3), per_peer
    rounds = per_peer["forgetful"]
    missed = [r for r in rounds if r % 3 == 0 and rounds[r]["applied"] == "folded"]
    assert missed, {r: (x["applied"], x["error"]) for r, x in rounds.items()}
    replayed = [r + 1 for r in missed if r + 1 in rounds and rounds[r + 1]["applied"] == "averaged"]
    # (one step, or two when a round of the others' also came back partial for it)
    assert replayed and all(rounds[r]["caught_up"] in (1, 2) for r in replayed), rounds
    assert "missed outer step(s) from" in caplog.text
    # the others averaged without it in its missed rounds, and with it, one anchor, in the next
    last = max(replayed)
    for name in ("a", "b"):
        assert per_peer[name][missed[0]]["applied"] == "averaged" and per_peer[name][last]["applied"] == "averaged"
    # ...and only then was anyone found apart: the forgetful peer, in the rounds it replayed (each
    # member's check lists it; it then replays, and matches, instead of re-syncing)
    forgetful = rounds[replayed[0]]["peer"]
    for name, peer_rounds in per_peer.items():
        for n, record in peer_rounds.items():
            if n >= 3:
                assert set(record["diverged"]) <= ({forgetful} if n - 1 in missed else set()), (name, n, record)


def hub_records(hub: LocalSwarmHub, run_id: str) -> list:
    """The progress records the peers left in the in-process hub."""
    from protocols.progress import decode

    return [decode(peer, stored.value) for peer, stored in hub.read(run_id, "progress").items()]


def test_a_data_mistake_is_a_config_error_before_any_network(tmp_path, config_for):
    config = config_for(**{"data.paths": [str(tmp_path / "nothing-here" / "*.txt")]})
    hub = LocalSwarmHub()
    with pytest.raises(ConfigError, match="data.paths: no files match"):
        run_peer(config, PeerOptions(ui=False), handle_signals=False, network=LocalNetwork(hub, "a"))
    assert hub.read("process-test", "manifest") == {}  # it never joined


@pytest.fixture(autouse=True)
def keep_pytest_logging(monkeypatch):
    """``shoal run`` takes over the root logger; in-process that would unhook pytest's capture."""
    import node.commands.run

    monkeypatch.setattr(node.commands.run, "configure_logging", lambda ui: None)


def write_config(tmp_path, **data) -> str:
    path = tmp_path / "run.toml"
    lines = [f"{key} = {value!r}".replace("'", '"') for key, value in data.items()]
    path.write_text("[data]\n" + "\n".join(lines) + "\n")
    return str(path)


def test_the_cli_prints_a_user_mistake_in_one_line_with_exit_2(tmp_path):
    config = write_config(tmp_path, paths=[str(tmp_path / "missing" / "*.txt")])
    result = CliRunner().invoke(app, ["run", "--config", config, "--no-ui"])
    assert result.exit_code == 2, result.output
    assert "error: " in result.output and "data.paths: no files match" in result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(("name", "content", "needle"), [
    ("broken.parquet", b"PAR1 this is not a parquet file", "broken.parquet"),
    ("rows.jsonl", b'{"body": "a document without the text field"}\n', "text_field"),
])
def test_a_broken_dataset_file_is_one_line_with_exit_2(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    config = write_config(tmp_path, paths=[str(tmp_path / name)], cache_dir=str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["run", "--config", config, "--no-ui"])
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("error: ") and needle in line, line
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_the_cli_keeps_a_bug_as_a_bug(tmp_path, monkeypatch):
    import node.process.peer

    def broken_model(*args, **kwargs):
        raise ValueError("an internal check failed")  # a ValueError that is not the user's mistake

    monkeypatch.setattr(node.process.peer, "build_model", broken_model)
    config = write_config(tmp_path, paths=[str(tmp_path / "corpus.txt")])
    (tmp_path / "corpus.txt").write_text(TEXT)
    result = CliRunner().invoke(app, ["run", "--config", config, "--no-ui"])
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError) and not isinstance(result.exception, ConfigError)
    assert "internal check failed" in str(result.exception)


def test_a_peer_with_other_text_is_refused_naming_the_corpus(tmp_path, config_for):
    hub = LocalSwarmHub()
    other = tmp_path / "other.txt"
    other.write_text(TEXT.replace("function", "procedure"))
    first = Peer(config_for(), PeerOptions(ui=False), threading.Event(), network=LocalNetwork(hub, "a"))
    try:
        with pytest.raises(ConfigError, match=r"data\.corpus_\w+=.*point data.paths at the same files"):
            Peer(config_for(**{"data.paths": [str(other)]}), PeerOptions(ui=False), threading.Event(),
                 network=LocalNetwork(hub, "b"))
    finally:
        first.close("max_rounds")


def test_a_heterogeneous_run_accepts_other_text(tmp_path, config_for):
    hub = LocalSwarmHub()
    other = tmp_path / "other.txt"
    other.write_text(TEXT.replace("function", "procedure"))
    peers = [Peer(config_for(**{"data.heterogeneous": True, **({"data.paths": [str(other)]} if i else {})}),
                  PeerOptions(ui=False), threading.Event(), network=LocalNetwork(hub, name))
             for i, name in enumerate("ab")]
    try:
        assert peers[0].swarm.manifest.config_hash == peers[1].swarm.manifest.config_hash
        assert "data.corpus_sha256" not in peers[0].swarm.manifest.fields
    finally:
        for peer in peers:
            peer.close("max_rounds")


# -- a transformers model on tokenized documents ---------------------------------------------------
LLAMA = {"model.kind": "hf", "model.architecture": "LlamaForCausalLM", "model.seq_len": 32,
         "model.hf": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "num_key_value_heads": 1}}


@pytest.fixture
def documents_config(tmp_path, config_for):
    from tests.unit.text_fixtures import documents, train_tokenizer, write_parquet

    tokenizer = train_tokenizer(tmp_path / "bpe")
    write_parquet(tmp_path / "data" / "part-0.parquet", documents(400, words=40))

    def make(**overrides):
        return config_for(**{**LLAMA, "data.tokenizer": str(tokenizer), "data.paths": [str(tmp_path / "data" / "*.parquet")],
                             "data.cache_dir": str(tmp_path / "cache"), **overrides})
    return make


def test_a_llama_on_parquet_refuses_a_joiner_with_another_tokenizer_or_dataset(tmp_path, documents_config):
    from tests.unit.text_fixtures import documents, train_tokenizer, write_jsonl

    hub = LocalSwarmHub()
    first = Peer(documents_config(), PeerOptions(ui=False, checkpoint_dir=tmp_path / "ckpt"), threading.Event(),
                 network=LocalNetwork(hub, "a"))
    try:
        # It trains a transformers model on its shard of the tokenized documents, and records the
        # run's model and tokenizer in the checkpoints' meta (what `shoal export` rebuilds from).
        assert type(first.trainer.model.hf).__name__ == "LlamaForCausalLM"
        x, y = first.sampler.next_batch()
        assert x.shape == (16, 32) and int(x.max()) < first.vocab_size == 400
        assert first.shared["data.vocab_size"] == 400 and first.shared["model.hf.hidden_size"] == 32
        assert float(first.trainer.inner_step(x, y, 1e-3)) > 0
        assert first._run_config_meta["run_config"]["data"]["tokenizer"] == str(tmp_path / "bpe" / "tokenizer.json")
        # The checkpoints carry the tokenizer too: exported on a machine without data.tokenizer's file.
        first.save_checkpoint()
        (tmp_path / "bpe").rename(tmp_path / "bpe-elsewhere")
        exported = CliRunner().invoke(app, ["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--output",
                                            str(tmp_path / "exported")])
        assert exported.exit_code == 0, exported.output
        assert "using the copy in" in exported.output and (tmp_path / "exported" / "tokenizer.json").is_file()
        (tmp_path / "bpe-elsewhere").rename(tmp_path / "bpe")
        other_tokenizer = train_tokenizer(tmp_path / "bpe-512", vocab_size=512)
        with pytest.raises(ConfigError, match=r"data\.tokenizer_sha256=.*point data\.tokenizer at the run's"):
            Peer(documents_config(**{"data.tokenizer": str(other_tokenizer)}), PeerOptions(ui=False),
                 threading.Event(), network=LocalNetwork(hub, "b"))
        write_jsonl(tmp_path / "other" / "part-0.jsonl", documents(300, words=40))
        with pytest.raises(ConfigError, match=r"data\.dataset_sha256=.*point data\.paths \(or data\.dataset\)"):
            Peer(documents_config(**{"data.paths": [str(tmp_path / "other" / "*.jsonl")]}), PeerOptions(ui=False),
                 threading.Event(), network=LocalNetwork(hub, "c"))
        # Continued pre-training: the init weights are compared by their hash, never by their path.
        from node.training.model import build_model

        inits = []
        for seed in (1, 2):
            init = tmp_path / f"init-{seed}"
            build_model(documents_config().model, seed=seed, vocab_size=400).hf.save_pretrained(init)
            inits.append(str(init))
        no_hf = {"model.hf": {}}  # the init directory's config.json gives the shapes
        pretrained = Peer(documents_config(**no_hf, run_id="continued", **{"model.init": inits[0]}),
                          PeerOptions(ui=False), threading.Event(), network=LocalNetwork(hub, "e"))
        try:
            assert pretrained.shared["model.init_sha256"] and "model.init" not in pretrained.shared
            with pytest.raises(ConfigError, match=r"model\.init_sha256=.*point model\.init at the same pretrained"):
                Peer(documents_config(**no_hf, run_id="continued", **{"model.init": inits[1]}), PeerOptions(ui=False),
                     threading.Event(), network=LocalNetwork(hub, "f"))
        finally:
            pretrained.close("max_rounds")
        with pytest.raises(ConfigError, match=r"model\.hf\.intermediate_size=64 \(this peer: 96\)"):
            Peer(documents_config(**{"model.hf": {**LLAMA["model.hf"], "intermediate_size": 96}}), PeerOptions(ui=False),
                 threading.Event(), network=LocalNetwork(hub, "d"))
    finally:
        first.close("max_rounds")
