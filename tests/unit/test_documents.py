"""Document datasets: formats, the held-out and shard rules, the token cache, the fingerprint, errors."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from node.training.data import BatchSampler, DataConfig, eval_batches
from node.training.documents import (
    HELD_OUT,
    check_files,
    dataset_fingerprint,
    document_shards,
    document_source,
    eval_period,
    uses_documents,
)
from node.training.token_cache import TokenizedDataset, token_dtype
from node.training.tokenizer import TextTokenizer, load_tokenizer
from protocols.errors import ConfigError
from tests.unit.text_fixtures import documents, train_tokenizer, write_arrow, write_jsonl, write_parquet

torch.set_num_threads(1)

DOCS = documents(120)  # eval_fraction 0.1: documents 5, 15, ... are held out
SHARDS = 4


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> TextTokenizer:
    return load_tokenizer(str(train_tokenizer(tmp_path_factory.mktemp("bpe"))))


def _config(tmp_path: Path, pattern: str, **overrides) -> DataConfig:
    fields = {"paths": [str(tmp_path / "data" / pattern)], "cache_dir": str(tmp_path / "cache"),
              "eval_fraction": 0.1, "num_shards": SHARDS, **overrides}
    return DataConfig(**fields)


def _jsonl_dataset(tmp_path: Path, tokenizer: TextTokenizer, **overrides) -> TokenizedDataset:
    write_jsonl(tmp_path / "data" / "a.jsonl", DOCS[:70])
    write_jsonl(tmp_path / "data" / "b.jsonl", DOCS[70:])
    return TokenizedDataset(_config(tmp_path, "*.jsonl", **overrides), tokenizer)


def _texts(tokens: np.ndarray, tokenizer: TextTokenizer) -> list[str]:
    """The documents in a token file (each ends with eos)."""
    ids = np.asarray(tokens).tolist()
    assert ids[-1] == tokenizer.eos_id
    pieces, start = [], 0
    for end in [i for i, token in enumerate(ids) if token == tokenizer.eos_id]:
        pieces.append(tokenizer.decode(ids[start:end]))
        start = end + 1
    return pieces


def test_held_out_and_shard_rule_matches_a_plain_loop() -> None:
    period, expected, rank = eval_period(0.1), [], 0
    for d in range(1000):
        if d % period == period // 2:
            expected.append(HELD_OUT)
        else:
            expected.append(rank % SHARDS)
            rank += 1
    assert period == 10 and document_shards(np.arange(1000), period, SHARDS).tolist() == expected
    # Batches are classified independently; the answer cannot depend on where a batch starts.
    assert document_shards(np.arange(377, 1000), period, SHARDS).tolist() == expected[377:]
    assert eval_period(0.49) == 2 and eval_period(0.001) == 1000


def test_shards_are_disjoint_cover_training_documents_and_never_hold_out_text(tmp_path: Path, bpe) -> None:
    dataset = _jsonl_dataset(tmp_path, bpe)
    held_out = {doc for d, doc in enumerate(DOCS) if d % 10 == 5}
    shards = [_texts(dataset.shard_tokens(s), bpe) for s in range(SHARDS)]
    assert dataset.shard_tokens(0).dtype == np.uint16 and isinstance(dataset.shard_tokens(0), np.memmap)
    seen = [doc for shard in shards for doc in shard]
    assert len(seen) == len(set(seen))  # disjoint
    assert set(seen) == set(DOCS) - held_out  # every training document, no held-out one
    assert [len(shard) for shard in shards] == [27, 27, 27, 27]  # balanced: 108 = 4 x 27
    assert shards[1][:2] == [DOCS[1], DOCS[6]]  # ranks 1, 5 -> documents 1, 6 (document 5 is held out)
    assert _texts(dataset.eval_tokens(), bpe) == [doc for d, doc in enumerate(DOCS) if d % 10 == 5]


def test_every_format_reads_the_same_documents(tmp_path: Path) -> None:
    tokenizer = load_tokenizer("bytes")
    for i, doc in enumerate(DOCS):
        (tmp_path / "text" / "data").mkdir(parents=True, exist_ok=True)
        (tmp_path / "text" / "data" / f"{i:04d}.txt").write_text(doc)  # text: one document per file
    write_parquet(tmp_path / "parquet" / "data" / "a.parquet", DOCS[:50])
    write_parquet(tmp_path / "parquet" / "data" / "b.parquet", DOCS[50:])
    write_arrow(tmp_path / "arrow" / "data" / "a.arrow", DOCS)
    write_jsonl(tmp_path / "jsonl" / "data" / "a.jsonl", DOCS)
    results = {}
    for fmt in ("text", "parquet", "arrow", "jsonl"):
        # The byte tokenizer with text files is the byte corpus; format = "text" asks for documents of it.
        config = _config(tmp_path / fmt, "*", tokenizer="bytes", **({"format": "text"} if fmt == "text" else {}))
        dataset = TokenizedDataset(config, tokenizer)
        assert dataset.source.format == fmt
        results[fmt] = (np.asarray(dataset.shard_tokens(2)).tobytes(), np.asarray(dataset.eval_tokens()).tobytes())
    assert len(set(results.values())) == 1
    assert _texts(np.frombuffer(results["text"][0], np.uint16), tokenizer)[0] == DOCS[2]


def test_builds_are_deterministic_and_a_second_open_reuses_the_cache(tmp_path: Path, bpe, monkeypatch) -> None:
    first = _jsonl_dataset(tmp_path, bpe)
    other = TokenizedDataset(_config(tmp_path, "*.jsonl", cache_dir=str(tmp_path / "cache2")), bpe)
    assert first.directory.name == other.directory.name and first.directory != other.directory
    assert np.array_equal(first.shard_tokens(3), other.shard_tokens(3))
    assert np.array_equal(first.eval_tokens(), other.eval_tokens())

    again = TokenizedDataset(_config(tmp_path, "*.jsonl"), bpe)
    monkeypatch.setattr(bpe, "encode_batch", lambda texts: pytest.fail("re-tokenized a cached shard"))
    assert again.is_ready(3) and not again.is_ready(0)
    assert np.array_equal(again.shard_tokens(3), first.shard_tokens(3))
    assert len(again.eval_tokens()) == len(first.eval_tokens())


def test_a_short_cache_file_is_rebuilt_not_trusted(tmp_path: Path, bpe) -> None:
    dataset = _jsonl_dataset(tmp_path, bpe)
    whole = np.array(dataset.shard_tokens(1))
    path = dataset.directory / "shard-00001.bin"
    path.write_bytes(path.read_bytes()[:100])  # a crash or a full disk
    assert not dataset.is_ready(1)
    assert np.array_equal(dataset.shard_tokens(1), whole)
    assert not [p for p in dataset.directory.iterdir() if p.name.endswith(".tmp")]  # no temp file left behind


def test_changing_a_cache_setting_uses_another_cache(tmp_path: Path, bpe) -> None:
    names = {_jsonl_dataset(tmp_path, bpe, **change).directory.name
             for change in ({}, {"max_eval_tokens": 1000}, {"num_shards": 5}, {"max_corpus_bytes": 4000})}
    assert len(names) == 4


def test_max_eval_tokens_and_max_corpus_bytes_cap_what_is_read(tmp_path: Path, bpe) -> None:
    capped = _jsonl_dataset(tmp_path, bpe, max_eval_tokens=50)
    assert len(capped.eval_tokens()) == 50
    # 60 documents of ~50 bytes: documents after the cap are never read; the one crossing it is cut.
    cap = sum(len(doc.encode()) for doc in DOCS[:60]) + 10
    short = _jsonl_dataset(tmp_path, bpe, max_corpus_bytes=cap)
    texts = [doc for s in range(SHARDS) for doc in _texts(short.shard_tokens(s), bpe)]
    texts += _texts(short.eval_tokens(), bpe)
    assert set(texts) == set(DOCS[:60]) | {DOCS[60][:10]}


def test_token_dtype_follows_the_vocabulary(tmp_path: Path) -> None:
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    wide = load_tokenizer("bytes")
    wide.vocab_size = 70_000  # a stand-in for a large vocabulary: ids are still bytes
    write_jsonl(tmp_path / "data" / "a.jsonl", DOCS)
    dataset = TokenizedDataset(_config(tmp_path, "*.jsonl"), wide)
    tokens = dataset.shard_tokens(0)
    assert tokens.dtype == np.uint32 and np.asarray(tokens[: len(DOCS[0])]).tolist() == list(DOCS[0].encode())


def test_cached_arrays_feed_the_batch_sampler_and_eval_batches(tmp_path: Path, bpe) -> None:
    dataset = _jsonl_dataset(tmp_path, bpe)
    tokens = dataset.shard_tokens(0)
    sampler = BatchSampler(tokens, seq_len=16, batch_size=4, seed=0)
    x, y = sampler.next_batch()
    assert x.dtype == torch.int64 and x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    start = int(sampler.ranges[0, 0])  # windows are read from the memmap's values
    assert int(x.max()) < bpe.vocab_size and int(x.min()) >= 0 and start == 0
    batches = eval_batches(dataset.eval_tokens(), seq_len=16, batch_size=2, num_batches=3)
    first = np.asarray(dataset.eval_tokens()[:17], dtype=np.int64)
    assert torch.equal(batches[0][0][0], torch.from_numpy(first[:16])) and torch.equal(batches[0][1][0], torch.from_numpy(first[1:]))


def test_prepare_builds_in_the_background(tmp_path: Path, bpe) -> None:
    dataset = _jsonl_dataset(tmp_path, bpe)
    dataset.prepare(2)
    dataset.prepare(2)  # a second request for a build under way is a no-op
    tokens = dataset.shard_tokens(2)  # waits for the background build
    assert dataset.is_ready(2) and len(tokens) > 0
    assert _texts(tokens, bpe)[0] == DOCS[2]


def test_a_background_build_error_is_raised_by_shard_tokens(tmp_path: Path, bpe) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", DOCS[:12])  # 11 training documents for 16 shards
    dataset = TokenizedDataset(_config(tmp_path, "*.jsonl", num_shards=16), bpe)
    dataset.prepare(13)
    with pytest.raises(ConfigError, match=r"data shard 13 of 16 got no documents.*11 training documents.*fewer data\.num_shards"):
        dataset.shard_tokens(13)
    assert dataset.is_ready(3) is False and len(dataset.shard_tokens(3)) > 0  # other shards still build


def test_fingerprint_covers_names_sizes_heads_and_tails_not_directories(tmp_path: Path, bpe) -> None:
    def fingerprint(directory: str) -> dict:
        return dataset_fingerprint(document_source(_config(tmp_path / directory, "*.jsonl")))

    big = [f"{i:07d} " + "x" * 500 for i in range(5000)]  # ~2.5 MB, so its middle is in neither edge
    for directory in ("one", "two"):
        write_jsonl(tmp_path / directory / "data" / "a.jsonl", big)
        write_jsonl(tmp_path / directory / "data" / "b.jsonl", DOCS)
    base = fingerprint("one")
    assert base == fingerprint("two") and base["data.dataset_files"] == 2 and len(base["data.dataset_sha256"]) == 32
    b = tmp_path / "two" / "data" / "b.jsonl"

    b.write_text(b.read_text() + "\n")  # one byte longer
    assert fingerprint("two") != base
    b.write_text(b.read_text()[:-1].replace("document 0000", "document 9999"))  # same size, new head
    assert fingerprint("two") != base
    a = tmp_path / "two" / "data" / "a.jsonl"
    write_jsonl(tmp_path / "two" / "data" / "b.jsonl", DOCS)
    a.write_text(a.read_text().replace("0002500 ", "0002501 "))  # same size, in the middle: not seen
    assert fingerprint("two") == base
    manifest = TokenizedDataset(_config(tmp_path / "one", "*.jsonl"), bpe).fingerprint()
    assert manifest == {**base, "data.tokenizer_sha256": bpe.sha256, "data.vocab_size": 400}


def test_corrupt_parquet_is_a_config_error_naming_the_file(tmp_path: Path, bpe) -> None:
    write_parquet(tmp_path / "data" / "a.parquet", DOCS)
    (tmp_path / "data" / "b.parquet").write_bytes(os.urandom(3000))
    dataset = TokenizedDataset(_config(tmp_path, "*.parquet"), bpe)
    with pytest.raises(ConfigError, match=r"data\.paths: .*b\.parquet is not a readable parquet file \(.+\); fix or remove it") as error:
        dataset.shard_tokens(0)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_missing_text_field_names_the_columns_the_file_has(tmp_path: Path, bpe, fmt: str) -> None:
    writer = {"jsonl": write_jsonl, "parquet": write_parquet, "arrow": write_arrow}[fmt]
    writer(tmp_path / "data" / f"a.{fmt}", DOCS, field="content")
    dataset = TokenizedDataset(_config(tmp_path, f"*.{fmt}", text_field="body"), bpe)
    columns = "content" if fmt == "arrow" else "content, id"
    wording = rf"data\.text_field 'body' is not a column of .*a\.{fmt} \(it has: {columns}\); set data\.text_field"
    with pytest.raises(ConfigError, match=wording):
        dataset.shard_tokens(0)
    with pytest.raises(ConfigError, match=wording):  # the same, from the files' headers at start
        check_files(dataset.source)
    check_files(_config_source(tmp_path, fmt, text_field="content"))  # the right column: no complaint


def _config_source(tmp_path: Path, fmt: str, **fields):
    return document_source(_config(tmp_path, f"*.{fmt}", **fields))


def test_other_user_errors_are_one_line_config_errors(tmp_path: Path, bpe, monkeypatch) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", DOCS)
    write_parquet(tmp_path / "data" / "b.parquet", DOCS)
    with pytest.raises(ConfigError, match=r"data\.paths mixes file formats \(1 jsonl \(a\.jsonl\); 1 parquet"):
        TokenizedDataset(_config(tmp_path, "*"), bpe)
    with pytest.raises(ConfigError, match=r"data\.paths: no files match"):
        TokenizedDataset(_config(tmp_path, "*.csv"), bpe)
    with pytest.raises(ConfigError, match=r"data\.format = 'parquet' needs data\.paths"):
        TokenizedDataset(DataConfig(format="parquet", cache_dir=str(tmp_path / "cache")), bpe)
    with pytest.raises(ConfigError, match=r"data\.format \('csv'\) is unknown"):
        _config(tmp_path, "*", format="csv")
    with pytest.raises(ConfigError, match=r"data\.dataset and data\.paths are both set"):
        _config(tmp_path, "*", dataset="someone/corpus")
    with pytest.raises(ConfigError, match=r"no held-out documents: the dataset has 3 documents and one in 10"):
        write_jsonl(tmp_path / "few" / "data" / "a.jsonl", DOCS[:3])
        TokenizedDataset(_config(tmp_path / "few", "*.jsonl"), bpe).shard_tokens(0)

    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    hub = TokenizedDataset(DataConfig(dataset="someone/no-such-dataset", cache_dir=str(tmp_path / "cache")), bpe)
    assert hub.fingerprint()["data.dataset_files"] == 0
    with pytest.raises(ConfigError, match=r"data\.dataset 'someone/no-such-dataset' cannot be opened from the Hugging Face hub"):
        hub.shard_tokens(0)


def test_which_runs_read_documents(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", DOCS)
    (tmp_path / "data" / "b.txt").write_text("plain text")
    assert not uses_documents(DataConfig())  # the default corpus: bytes
    assert not uses_documents(_config(tmp_path, "*.txt"))
    assert uses_documents(_config(tmp_path, "*.jsonl"))
    assert uses_documents(_config(tmp_path, "*.txt", format="jsonl"))
    assert uses_documents(_config(tmp_path, "*.txt", tokenizer="gpt2"))
    assert uses_documents(DataConfig(dataset="someone/corpus"))
