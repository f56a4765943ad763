"""The token cache of a document dataset: one flat memory-mapped token file per shard, one for eval.

nanoGPT/litgpt style: documents are tokenized once into ``uint16`` (``uint32`` for vocabularies
over 65536) files that every later start, and every peer on the machine, maps read-only. Building
shard i streams every document but tokenizes only shard i's (and the held-out ones, once), so a
peer on 1/16 of a dataset tokenizes 1/16 of it. A peer can ``prepare`` its next shard in the
background and switch when ``is_ready`` says so, without a stall.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from node.library.atomic import write_atomically
from node.training.data import DataConfig, cache_dir_for
from node.training.documents import (
    HELD_OUT,
    DocumentBatch,
    dataset_fingerprint,
    document_shards,
    document_source,
    eval_period,
    read_documents,
)
from node.training.tokenizer import TextTokenizer, load_tokenizer
from protocols.errors import ConfigError

logger = logging.getLogger(__name__)

_CACHE_FORMAT = "shoal-tokens-v1"
"""Bumped when the cache layout changes, so old cache files are never misread."""
_BATCH_ROWS = 512
_LOG_SECONDS = 10.0


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The narrowest dtype of the cache files that holds every id."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


class TokenizedDataset:
    """A document dataset tokenized into the shard and eval files of its cache directory.

    The arrays plug into ``data.BatchSampler(tokens, seq_len, batch_size, seed)`` and
    ``data.eval_batches(tokens, ...)``; held-out text is in no shard, so neither needs ranges or a
    held-out map. Threads: ``prepare`` builds on a daemon thread, one build at a time (builds
    share ``_build_lock``); everything else may be called from the training loop."""

    def __init__(self, config: DataConfig, tokenizer: TextTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        self.source = document_source(config)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self._stats = [_stat(path) for path in self.source.files]
        self._fingerprint = {**dataset_fingerprint(self.source), "data.tokenizer_sha256": self.tokenizer.sha256,
                             "data.vocab_size": self.tokenizer.vocab_size}
        self.directory = cache_dir_for(config) / f"tokens-{self._cache_key()}"
        self._lock = threading.Lock()  # guards _pending and _errors
        self._build_lock = threading.Lock()  # one build at a time, in any thread
        self._pending: dict[int, threading.Event] = {}
        self._errors: dict[int, BaseException] = {}

    def fingerprint(self) -> dict[str, Any]:
        """Manifest fields peers compare at join (see ``documents.dataset_fingerprint`` for what
        the dataset hash covers and what it does not)."""
        return dict(self._fingerprint)

    def eval_tokens(self) -> np.ndarray:
        """The held-out tokens (at most data.max_eval_tokens), built on first use. Call it after
        ``shard_tokens`` on a fresh cache: the shard's build writes it in the same pass."""
        if not self._ready("eval"):
            with self._build_lock:
                if not self._ready("eval"):
                    self._build(None)
        return self._open("eval")

    def shard_tokens(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s tokens, built on first use (waiting for a ``prepare`` of it under way
        and re-raising the error that build hit)."""
        self._check(shard)
        with self._lock:
            pending = self._pending.get(shard)
        if pending is not None:
            pending.wait()
        with self._lock:
            error = self._errors.pop(shard, None)
        if error is not None:
            raise error
        if not self.is_ready(shard):
            with self._build_lock:
                if not self.is_ready(shard):
                    self._build(shard)
        return self._open(_shard_name(shard))

    def is_ready(self, shard: int) -> bool:
        """Whether shard ``shard`` is in the cache, whole, so ``shard_tokens`` returns at once."""
        self._check(shard)
        return self._ready(_shard_name(shard))

    def failed(self, shard: int) -> bool:
        """Whether a background build of ``shard`` failed (``shard_tokens`` re-raises its error)."""
        with self._lock:
            return shard in self._errors

    def prepare(self, shard: int) -> None:
        """Start building shard ``shard`` on a background thread, if it is neither ready nor under way."""
        self._check(shard)
        with self._lock:
            if shard in self._pending or self.is_ready(shard):
                return
            done = self._pending[shard] = threading.Event()
        threading.Thread(target=self._build_in_background, args=(shard, done), daemon=True,
                         name=f"shoal-tokenize-{shard}").start()

    # -- building ------------------------------------------------------------------------------
    def _build_in_background(self, shard: int, done: threading.Event) -> None:
        try:
            with self._build_lock:
                if not self.is_ready(shard):
                    self._build(shard)
        except BaseException as error:  # kept for the next shard_tokens, which re-raises it
            with self._lock:
                self._errors[shard] = error
        finally:
            with self._lock:
                self._pending.pop(shard, None)
            done.set()

    def _build(self, shard: int | None) -> None:
        """One pass over the documents: tokenize shard ``shard``'s (None: none) and, while the eval
        file is missing, the held-out ones. Holds ``_build_lock``."""
        assert self._build_lock.locked()
        config, started = self.config, time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        train = _TokenFile(self._path(_shard_name(shard)), self.dtype) if shard is not None else None
        held_out = _TokenFile(self._path("eval"), self.dtype, limit=config.max_eval_tokens) \
            if not self._ready("eval") else None
        period, documents, trained = eval_period(config.eval_fraction), 0, 0
        files = {name: file for name, file in ((f"shard {shard}/{config.num_shards}", train), ("eval", held_out))
                 if file is not None}
        what = " and ".join(files)
        try:
            with _Progress(f"tokenizing {what}", self._total_bytes()) as progress:
                for batch in read_documents(self.source, _BATCH_ROWS):
                    shards = document_shards(batch.first + np.arange(len(batch)), period, config.num_shards)
                    if train is not None:
                        self._append(train, batch, shards == shard)
                    if held_out is not None and not held_out.full:
                        self._append(held_out, batch, shards == HELD_OUT)
                    documents, trained = documents + len(batch), trained + int((shards != HELD_OUT).sum())
                    progress.update(documents, batch.text_bytes, sum(f.count for f in (train, held_out) if f))
                    if train is None and held_out.full:
                        break  # an eval-only build needs no more documents
            self._check_not_empty(shard, train, held_out, documents, trained, period)
            for file in (held_out, train):
                if file is not None:
                    file.commit()
        finally:
            for file in (held_out, train):
                if file is not None:
                    file.discard()
        logger.info("tokenized %s (%s) in %.1f s, cached in %s", what,
                    ", ".join(f"{name}: {file.count:,} tokens" for name, file in files.items()),
                    time.monotonic() - started, self.directory)

    def _append(self, file: _TokenFile, batch: DocumentBatch, chosen: np.ndarray) -> None:
        indices = np.flatnonzero(chosen)
        if len(indices):
            file.write(self.tokenizer.encode_batch(batch.texts.take(indices).to_pylist()), self.tokenizer.eos_id)

    def _check_not_empty(self, shard: int | None, train: _TokenFile | None, held_out: _TokenFile | None,
                         documents: int, trained: int, period: int) -> None:
        if held_out is not None and held_out.count == 0:
            raise ConfigError(f"no held-out documents: the dataset has {documents} documents and one in {period} "
                              f"is held out, starting with document {period // 2}; raise data.eval_fraction or "
                              "add documents")
        if train is not None and train.count == 0:
            raise ConfigError(f"data shard {shard} of {self.config.num_shards} got no documents: the dataset has "
                              f"{trained} training documents; use fewer data.num_shards or add documents")

    # -- the cache directory -------------------------------------------------------------------
    def _cache_key(self) -> str:
        """Everything that decides the files' content. Local paths and mtimes are in it too (not in
        the fingerprint): a file edited in its middle on this machine rebuilds the cache."""
        local = [(str(path), stat.st_mtime_ns) for path, stat in zip(self.source.files, self._stats)]
        config = self.config
        material = [_CACHE_FORMAT, self._fingerprint, local, config.num_shards, config.eval_fraction,
                    config.max_eval_tokens, config.max_corpus_bytes, np.dtype(self.dtype).name]
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.bin"

    def _ready(self, name: str) -> bool:
        """The file and its count agree (a short or half-written file is rebuilt, never trusted)."""
        path = self._path(name)
        try:
            meta = json.loads(path.with_suffix(".json").read_text())
            size = path.stat().st_size
        except (OSError, ValueError):
            return False
        itemsize = np.dtype(self.dtype).itemsize
        return (isinstance(meta, dict) and meta.get("dtype") == np.dtype(self.dtype).name
                and isinstance(meta.get("tokens"), int) and meta["tokens"] > 0 and size == meta["tokens"] * itemsize)

    def _open(self, name: str) -> np.ndarray:
        # Read-only memmap: peers on one machine share the page cache instead of each holding a copy.
        return np.memmap(self._path(name), dtype=self.dtype, mode="r")

    def _total_bytes(self) -> int | None:
        """A bound on the text to read, for the progress bar: unknown for parquet (compressed) and the hub."""
        if self.source.dataset or self.source.format == "parquet":
            return None
        return min(self.config.max_corpus_bytes, sum(stat.st_size for stat in self._stats))

    def _check(self, shard: int) -> None:
        if not 0 <= shard < self.config.num_shards:
            raise ValueError(f"shard {shard} is outside [0, {self.config.num_shards})")


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as e:
        raise ConfigError(f"data.paths: cannot read {path} ({e.strerror or e}); fix it or remove it from data.paths") from None


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


class _TokenFile:
    """A token file being written: a temp file in the cache directory that ``commit`` fsyncs and
    renames into place, then records its count beside it (readers trust the file only with it)."""

    def __init__(self, path: Path, dtype: type[np.unsignedinteger], *, limit: int | None = None) -> None:
        self.path, self.dtype, self.limit, self.count = path, dtype, limit, 0
        fd, self._temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # caches are read by other users too (mkstemp creates 0600)
        self._handle = os.fdopen(fd, "wb")

    @property
    def full(self) -> bool:
        return self.limit is not None and self.count >= self.limit

    def write(self, documents: list[list[int]], eos_id: int | None) -> None:
        """Append the documents, each followed by ``eos_id``, up to ``limit`` tokens in all."""
        if eos_id is not None:
            for ids in documents:
                ids.append(eos_id)
        total = sum(map(len, documents))
        if self.limit is not None:
            total = min(total, self.limit - self.count)
        tokens = np.fromiter(itertools.chain.from_iterable(documents), dtype=self.dtype, count=total)
        self._handle.write(tokens.tobytes())
        self.count += total

    def commit(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        meta = self.path.with_suffix(".json")
        meta.unlink(missing_ok=True)  # a stale count must never vouch for the new file
        os.replace(self._temp, self.path)
        write_atomically(meta, json.dumps({"tokens": self.count, "dtype": np.dtype(self.dtype).name}).encode())

    def discard(self) -> None:
        """Drop the temp file unless committed (safe to call after ``commit``)."""
        if not self._handle.closed:
            self._handle.close()
        Path(self._temp).unlink(missing_ok=True)


class _Progress:
    """How far a build is: a rich progress line on a terminal (stderr), else a log line every 10 s."""

    def __init__(self, label: str, total_bytes: int | None) -> None:
        self.label, self.total = label, total_bytes
        self.text_bytes, self._live, self._logged = 0, None, time.monotonic()

    def __enter__(self) -> _Progress:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._live = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                  console=Console(stderr=True), transient=True)
            self._live.start()
            self._task = self._live.add_task(self.label, total=self.total, status="")
        else:
            logger.info("%s ...", self.label)
        return self

    def update(self, documents: int, batch_bytes: int, tokens: int) -> None:
        self.text_bytes += batch_bytes
        status = f"{documents:,} docs, {self.text_bytes / 1e6:,.1f} MB, {tokens:,} tokens"
        if self._live is not None:
            self._live.update(self._task, completed=self.text_bytes, status=status)
        elif time.monotonic() - self._logged >= _LOG_SECONDS:
            self._logged = time.monotonic()
            logger.info("%s: %s", self.label, status)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
