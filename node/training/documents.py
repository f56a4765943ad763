"""Training documents read through the datasets library: which files, in which order, which of
them are held out, which shard each of the others belongs to, and the fingerprint peers compare.

The byte corpus (``node.training.data``) treats text as one byte string. This path reads
documents (a text file, a JSONL line, a parquet or arrow row, a hub dataset row) for a real
tokenizer or a real dataset. Every rule here is a pure function of the document order, which is
the same on every peer: files sorted as ``resolve_files`` sorts them, rows in file order.
datasets and pyarrow are imported only when documents are read, never by ``shoal run --help``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from node.training.data import DataConfig, cache_dir_for, resolve_files
from protocols.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

FORMATS = ("text", "jsonl", "parquet", "arrow")
HELD_OUT = -1
"""The shard of a held-out document: none."""

_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet", "arrow": "arrow"}
_SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_FINGERPRINT_VERSION = "shoal-dataset-v1"
_EDGE_BYTES = 1 << 20
"""The fingerprint hashes this much of each file's head and of its tail."""


def uses_documents(config: DataConfig) -> bool:
    """Whether this run reads documents (a tokenizer, a non-text format or a hub dataset) rather
    than the byte corpus of ``node.training.data``."""
    if config.tokenizer != "bytes" or config.dataset:
        return True
    if config.format != "auto":
        return config.format != "text"
    return bool(config.paths) and detect_format(resolve_files(config), "auto") != "text"


def detect_format(files: list[Path], configured: str) -> str:
    """``configured`` unless it is auto; then the files' one format by extension (else text)."""
    if configured != "auto":
        return configured
    by_format: dict[str, list[Path]] = {}
    for path in files:
        by_format.setdefault(_SUFFIX_FORMATS.get(path.suffix.lower(), "text"), []).append(path)
    if len(by_format) > 1:
        found = "; ".join(f"{len(paths)} {fmt} ({paths[0].name}{', ...' if len(paths) > 1 else ''})"
                          for fmt, paths in sorted(by_format.items()))
        raise ConfigError(f"data.paths mixes file formats ({found}); narrow data.paths to one format, "
                          "e.g. '**/*.parquet', or set data.format")
    return next(iter(by_format), "text")


def eval_period(eval_fraction: float) -> int:
    """One document in this many is held out."""
    return max(2, round(1 / eval_fraction))


def document_shards(indices: np.ndarray, period: int, num_shards: int) -> np.ndarray:
    """The shard of each document index, ``HELD_OUT`` for held-out ones.

    Document d is held out when ``d % period == period // 2``: spread over the whole dataset, never
    trained on, the same on every peer. The k-th document that is not held out goes to shard
    ``k % num_shards``, so shards are balanced and each samples the whole dataset."""
    indices = np.asarray(indices, dtype=np.int64)
    phase = period // 2
    held_before = (indices + period - 1 - phase) // period  # held-out documents with a smaller index
    shards = (indices - held_before) % num_shards
    return np.where(indices % period == phase, HELD_OUT, shards)


@dataclass(frozen=True, slots=True)
class DocumentSource:
    """Where documents come from: local ``files`` in one ``format``, or the hub dataset ``dataset``."""

    format: str
    files: tuple[Path, ...]
    text_field: str
    max_bytes: int
    cache_dir: str
    """Where datasets keeps its lock files and hub metadata: inside shoal's cache, not ~/.cache/huggingface."""
    dataset: str = ""
    dataset_config: str = ""
    dataset_split: str = "train"

    @property
    def column(self) -> str:
        # datasets' text builder always names its one column "text".
        return "text" if self.format == "text" and not self.dataset else self.text_field


@dataclass(frozen=True, slots=True)
class DocumentBatch:
    """Consecutive non-empty documents: ``texts[i]`` is document ``first + i``."""

    first: int
    texts: pa.Array
    text_bytes: int

    def __len__(self) -> int:
        return len(self.texts)


def document_source(config: DataConfig) -> DocumentSource:
    """The files (sorted, as the byte corpus sorts them) and format this config reads."""
    cache_dir = str(cache_dir_for(config) / "datasets")
    if config.dataset:
        return DocumentSource(format="hub", files=(), text_field=config.text_field, max_bytes=config.max_corpus_bytes,
                              cache_dir=cache_dir, dataset=config.dataset, dataset_config=config.dataset_config,
                              dataset_split=config.dataset_split)
    if not config.paths and config.format not in ("auto", "text"):
        raise ConfigError(f"data.format = {config.format!r} needs data.paths: the default corpus is text files; "
                          "point data.paths at your files")
    files = resolve_files(config)
    return DocumentSource(format=detect_format(files, config.format), files=tuple(files),
                          text_field=config.text_field, max_bytes=config.max_corpus_bytes, cache_dir=cache_dir)


def dataset_fingerprint(source: DocumentSource) -> dict[str, Any]:
    """What peers compare at join instead of hashing terabytes: the format, the text column, and
    each file's basename, size and the sha256 of its first and last MiB, in document order.

    Not covered: a file edited in its middle without changing its size, and directories (basenames
    only, so peers may keep the files in different places). For a hub dataset it covers the name,
    subset and split only, not the rows (a dataset updated on the hub is not noticed)."""
    entry: dict[str, Any] = {"v": _FINGERPRINT_VERSION, "format": source.format,
                             "text_field": source.column if source.format != "text" else ""}
    if source.dataset:
        entry["hub"] = [source.dataset, source.dataset_config, source.dataset_split]
    entry["files"] = [_file_entry(path) for path in source.files]
    digest = hashlib.sha256(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {"data.dataset_sha256": digest[:32], "data.dataset_files": len(source.files)}


def _file_entry(path: Path) -> list[Any]:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(0)
            head = hashlib.sha256(handle.read(_EDGE_BYTES)).hexdigest()
            handle.seek(max(0, size - _EDGE_BYTES))
            tail = hashlib.sha256(handle.read(_EDGE_BYTES)).hexdigest()
    except OSError as e:
        raise ConfigError(f"data.paths: cannot read {path} ({e.strerror or e}); fix its permissions or "
                          "remove it from data.paths") from None
    return [path.name, size, head, tail]


def read_documents(source: DocumentSource, batch_rows: int = 512) -> Iterator[DocumentBatch]:
    """The source's non-empty documents in order, until ``source.max_bytes`` bytes of text were
    read (the document that crosses the cap is cut there, so every peer stops at the same byte).
    Read errors become one-line ConfigErrors that name the file."""
    pc = _import("pyarrow.compute", "pyarrow")
    rows = iter(_open(source).with_format("arrow").iter(batch_size=batch_rows))
    first, text_bytes, nulls = 0, 0, 0
    while text_bytes < source.max_bytes:
        try:
            table = next(rows)
        except StopIteration:
            break
        except ConfigError:
            raise
        except Exception as e:  # datasets and pyarrow raise many types; all mean "this data cannot be read"
            raise _read_error(source, e) from None
        texts = _text_column(table, source)
        nulls += texts.null_count
        texts = texts.filter(pc.fill_null(pc.greater(pc.binary_length(texts), 0), False))
        if len(texts) == 0:
            continue
        texts, size = _cap(texts, source.max_bytes - text_bytes)
        yield DocumentBatch(first=first, texts=texts, text_bytes=size)
        first, text_bytes = first + len(texts), text_bytes + size
    if nulls:
        logger.warning("skipped %d rows with no %r value; check that every file has that column", nulls, source.column)


def _cap(texts: pa.Array, room: int) -> tuple[pa.Array, int]:
    """The documents that start within ``room`` bytes, the last one cut to fit, and their size."""
    pa = _import("pyarrow", "pyarrow")
    lengths = _import("pyarrow.compute", "pyarrow").binary_length(texts).to_numpy(zero_copy_only=False)
    ends = np.cumsum(lengths, dtype=np.int64)
    if ends[-1] <= room:
        return texts, int(ends[-1])
    keep = int(np.searchsorted(ends, room, side="left")) + 1  # the first document that reaches the cap
    start = int(ends[keep - 1] - lengths[keep - 1])
    last = texts[keep - 1].as_py().encode("utf-8")[:room - start].decode("utf-8", errors="ignore")
    if not last:  # the cap fell inside the first character: no document is left
        return texts.slice(0, keep - 1), start
    kept = pa.concat_arrays([texts.slice(0, keep - 1), pa.array([last], type=texts.type)])
    return kept, start + len(last.encode("utf-8"))


def _open(source: DocumentSource):
    """A streaming datasets ``IterableDataset`` of the source's rows, in order."""
    datasets = _import("datasets", "datasets")
    if source.dataset:
        try:
            return datasets.load_dataset(source.dataset, source.dataset_config or None, split=source.dataset_split,
                                         streaming=True, cache_dir=source.cache_dir)
        except Exception as e:  # offline: ConnectionError; unknown name: DatasetNotFoundError; bad split: ValueError
            raise ConfigError(f"data.dataset {source.dataset!r} cannot be opened from the Hugging Face hub "
                              f"({_first_line(e)}); check the name, subset and split, or download it and point "
                              "data.paths at its files") from None
    if not source.files:
        raise ConfigError("data.paths matches no files; point it at existing files")
    try:
        return _load_files(source, source.files)
    except Exception as e:
        raise _read_error(source, e) from None


def _load_files(source: DocumentSource, files: tuple[Path, ...]):
    datasets = _import("datasets", "datasets")
    options: dict[str, Any] = {"sample_by": "document", "encoding_errors": "replace"} if source.format == "text" else {}
    return datasets.load_dataset(_BUILDERS[source.format], data_files=[str(path) for path in files], split="train",
                                 streaming=True, cache_dir=source.cache_dir, **options)


def _text_column(table: pa.Table, source: DocumentSource) -> pa.Array:
    pa = _import("pyarrow", "pyarrow")
    if source.column not in table.column_names:
        raise _read_error(source, KeyError(source.column))
    column = table.column(source.column).combine_chunks()
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ConfigError(f"data.text_field {source.column!r} holds {column.type}, not text; set data.text_field "
                          f"to the column with the text (columns: {', '.join(table.column_names)})")
    return column


def _read_error(source: DocumentSource, error: BaseException) -> ConfigError:
    """A one-line error naming the culprit: the first file that cannot be read on its own or
    lacks the text column (found only now, so the common path opens all files at once)."""
    if source.dataset:
        if isinstance(error, KeyError):
            return ConfigError(f"data.text_field {source.column!r} is not a column of data.dataset {source.dataset!r}; "
                               "set data.text_field to the column with the text")
        return ConfigError(f"data.dataset {source.dataset!r} cannot be read ({_first_line(error)}); check the name, "
                           "subset and split, or download it and point data.paths at its files")
    for path in source.files:
        problem = _file_problem(source, path)
        if problem is not None:
            return ConfigError(problem)
    return ConfigError(f"data.paths: the {source.format} files cannot be read ({_first_line(error)}); fix or remove "
                       "the file named in the log above")


def check_files(source: DocumentSource) -> None:
    """A ``ConfigError`` naming the first file that cannot be read or lacks the text column, found
    from each file's header alone (a parquet footer, an arrow schema, a JSONL file's first row), so
    a broken dataset fails at start, before the peer joins a swarm, even with thousands of files."""
    if source.dataset or source.format == "text":
        return
    pa = _import("pyarrow", "pyarrow")
    for path in source.files:
        try:
            columns = _header_columns(source.format, path, pa)
        except Exception as e:  # pyarrow's ArrowInvalid, OSError, a JSON error: the file is named either way
            raise ConfigError(f"data.paths: {path} is not a readable {source.format} file ({_first_line(e)}); "
                              "fix or remove it") from None
        if columns is not None and source.column not in columns:
            raise ConfigError(f"data.text_field {source.column!r} is not a column of {path} (it has: "
                              f"{', '.join(columns)}); set data.text_field to the column with the text")


def _header_columns(format: str, path: Path, pa) -> list[str] | None:
    """The column names a file declares; None for an empty JSONL file (no row to judge)."""
    if format == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    if format == "arrow":
        with pa.OSFile(str(path), "rb") as handle:
            try:
                return list(pa.ipc.open_stream(handle).schema.names)
            except pa.ArrowInvalid:  # the random-access file format, which datasets also reads
                handle.seek(0)
                return list(pa.ipc.open_file(handle).schema.names)
    with open(path, encoding="utf-8") as handle:
        first = next((line for line in handle if line.strip()), None)
    if first is None:
        return None
    row = json.loads(first)
    if not isinstance(row, dict):
        raise ValueError("its first row is not a JSON object")
    return list(row)


def _file_problem(source: DocumentSource, path: Path) -> str | None:
    try:
        table = next(iter(_load_files(source, (path,)).with_format("arrow").iter(batch_size=16)), None)
    except Exception as e:
        return f"data.paths: {path} is not a readable {source.format} file ({_first_line(e)}); fix or remove it"
    if table is not None and source.column not in table.column_names:
        return (f"data.text_field {source.column!r} is not a column of {path} (it has: "
                f"{', '.join(table.column_names)}); set data.text_field to the column with the text")
    return None


def _import(module: str, package: str):
    """An optional dependency, or a one-line ConfigError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"reading documents needs {package}; pip install 'shoal[hf]'") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
