"""Training text: corpus files, the cached byte-token file, shards, held-out split, batches.

Tokens are raw bytes (uint8), matching the byte-level model, so there is no tokenizer to
download or to agree on. Peers that read the same files get the same corpus, the same
held-out tail and the same shard boundaries.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from node.library.atomic import write_atomically
from protocols.errors import ConfigError

logger = logging.getLogger(__name__)

MIN_EVAL_BLOCKS = 8
"""A small held-out split is cut into at least this many blocks, so it still spans the corpus."""

MIN_CORPUS_BYTES = 16 * 1024
"""Below this a corpus cannot fill a few batches, so a typo in data.paths fails early."""

_CACHE_FORMAT = "shoal-corpus-v1"
"""Bumped when the cache layout changes, so old cache files are never misread."""

_DOC_ROOTS = (Path("/usr/share/doc"),)
_DOC_SUFFIXES = frozenset({".txt", ".md", ".rst"})
_SKIPPED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training text comes from and how it is split between peers."""

    paths: list[str] = field(default_factory=list)
    """Globs of local text files (recursive ** allowed, ~ expanded); empty = default corpus."""
    cache_dir: str = ""
    """Where the token cache lives; "" = $SHOAL_CACHE_DIR or ~/.cache/shoal."""
    max_corpus_bytes: int = 64_000_000
    """Stop reading files once the corpus has this many bytes."""
    eval_fraction: float = 0.01
    """Fraction of the corpus held out for evaluation: every k-th block, spread over the whole corpus."""
    eval_block_bytes: int = 8192
    """Size of one held-out block (a few eval windows long), so eval text is the training distribution."""
    max_eval_bytes: int = 1_000_000
    """Cap on the held-out split, so big corpora do not waste training text."""
    num_shards: int = 16
    """The train split is cut into this many disjoint shards; each peer trains on one."""
    shard_stripe_bytes: int = 4096
    """A shard is every ``num_shards``-th stripe of this many bytes, so each shard samples the whole
    corpus (source and docs alike) instead of one contiguous stretch of it; 4 KiB beat 64 KiB on
    every paired seed of the real swarm (docs/benchmarks.md, Data shards). Above seq_len + 1."""
    batch_size: int = 16
    """Sequences per training batch."""
    heterogeneous: bool = False
    """Peers may train on different text: the corpus fingerprint is then not compared at join (and
    eval losses of different peers measure different text)."""
    tokenizer: str = "bytes"
    """bytes (raw UTF-8 bytes), a tokenizer.json, a local transformers tokenizer directory, or a hub name (online)."""
    format: str = "auto"
    """auto | text | jsonl | parquet | arrow; auto picks by file extension (.jsonl/.json, .parquet, .arrow, else text)."""
    text_field: str = "text"
    """The column holding each document's text in jsonl, parquet, arrow and hub datasets."""
    dataset: str = ""
    """A Hugging Face hub dataset name (online only), read instead of data.paths."""
    dataset_split: str = "train"
    """The split of data.dataset to read."""
    dataset_config: str = ""
    """The subset (config name) of data.dataset; "" = its default."""
    max_eval_tokens: int = 262144
    """Cap on the held-out token file of a tokenized dataset (data.max_eval_bytes is for raw bytes)."""

    def __post_init__(self) -> None:
        if isinstance(self.paths, str) or not all(isinstance(p, str) for p in self.paths):
            raise ConfigError(
                f"data.paths ({self.paths!r}) must be a list of glob strings, e.g. ['~/text/**/*.txt']"
            )
        if not isinstance(self.cache_dir, str):
            raise ConfigError(
                f"data.cache_dir ({self.cache_dir!r}) must be a string path; use '' for the default"
            )
        for name in ("max_corpus_bytes", "max_eval_bytes", "num_shards", "batch_size", "eval_block_bytes",
                     "shard_stripe_bytes", "max_eval_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"data.{name} ({value!r}) must be a positive integer")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ConfigError(f"data.eval_fraction ({self.eval_fraction}) must be in (0, 0.5), e.g. 0.01")
        for name in ("tokenizer", "text_field", "dataset_split"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"data.{name} ({value!r}) must be a non-empty string")
        for name in ("dataset", "dataset_config"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"data.{name} ({getattr(self, name)!r}) must be a string; use '' for none")
        if self.format not in ("auto", "text", "jsonl", "parquet", "arrow"):
            raise ConfigError(f"data.format ({self.format!r}) is unknown; use auto, text, jsonl, parquet or arrow")
        if self.dataset and self.paths:
            raise ConfigError("data.dataset and data.paths are both set; use one: a hub dataset or local files")
        if self.dataset and self.format != "auto":
            raise ConfigError(f"data.format ({self.format!r}) applies to data.paths; leave it \"auto\" with "
                              "data.dataset (the hub knows its format)")


@dataclass(frozen=True, slots=True)
class HeldOut:
    """Which blocks of the corpus are held out: ``count`` blocks of ``block`` bytes, one every
    ``period`` blocks starting at block ``phase``. Spread over the whole corpus (source code and
    docs alike), so the eval loss measures the distribution peers train on; a pure function of the
    corpus length and the config, so every peer holds out the same text."""

    block: int
    period: int
    phase: int
    count: int

    def is_held_out(self, block_index: np.ndarray) -> np.ndarray:
        offset = block_index - self.phase
        return (offset >= 0) & (offset % self.period == 0) & (offset // self.period < self.count)

    def touches(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Which windows ``[start, start + length)`` overlap a held-out block."""
        first, last = starts // self.block, (starts + length - 1) // self.block
        touched = np.zeros(len(starts), dtype=bool)
        for k in range(int((last - first).max(initial=0)) + 1):
            touched |= (first + k <= last) & self.is_held_out(first + k)
        return touched

    def longest_gap(self, lo: int, hi: int) -> int:
        """The longest run of training bytes in ``[lo, hi)``: the longest window a sampler can draw."""
        edges = [lo]
        for start in self.starts():
            if start + self.block > lo and start < hi:
                edges += [max(start, lo), min(start + self.block, hi)]
        edges.append(hi)
        return max(b - a for a, b in zip(edges[::2], edges[1::2]))

    def starts(self) -> np.ndarray:
        """First byte of every held-out block, in corpus order."""
        return (self.phase + self.period * np.arange(self.count, dtype=np.int64)) * self.block


@dataclass(frozen=True, slots=True)
class Split:
    """The corpus, which of its blocks are held out, and the held-out text (concatenated)."""

    tokens: np.ndarray
    held_out: HeldOut
    eval: np.ndarray

    @property
    def train_bytes(self) -> int:
        return len(self.tokens) - len(self.eval)


def default_corpus_files() -> list[Path]:
    """Text every machine with Python has: the stdlib's .py sources plus installed docs.

    Sorted so that two machines with the same Python and docs read the same corpus.
    Test suites and third-party packages are skipped: they are large, noisy and vary
    between installs.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = _walk_files(stdlib, {".py"}, skip_dirs=_SKIPPED_STDLIB_DIRS)
    for root in _DOC_ROOTS:
        files.extend(_walk_files(root, _DOC_SUFFIXES, skip_dirs=frozenset()))
    return sorted(set(files))


def _walk_files(root: Path, suffixes: set[str] | frozenset[str], *, skip_dirs: frozenset[str]) -> list[Path]:
    """Files under `root` with one of `suffixes`; unreadable directories are ignored."""
    found: list[Path] = []
    if not root.is_dir():
        return found
    # os.walk does not follow directory symlinks, so a link loop cannot trap it.
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _err: None):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        found.extend(Path(dirpath, f) for f in filenames if Path(f).suffix in suffixes)
    return found


def resolve_files(config: DataConfig) -> list[Path]:
    """Expand `config.paths` to a sorted, deduplicated list of files (the default corpus if empty)."""
    if not config.paths:
        files = default_corpus_files()
        if not files:
            raise ConfigError(
                "data.paths is empty and no default corpus was found; point data.paths at text files"
            )
        return files
    matched: set[Path] = set()
    for pattern in config.paths:
        for name in glob.glob(os.path.expanduser(pattern), recursive=True):
            path = Path(name)
            if path.is_file():
                matched.add(path)
    if not matched:
        raise ConfigError(f"data.paths: no files match {config.paths!r}; point it at existing text files")
    return sorted(matched)


def cache_dir_for(config: DataConfig) -> Path:
    """The token cache directory: data.cache_dir, else $SHOAL_CACHE_DIR, else ~/.cache/shoal."""
    chosen = config.cache_dir or os.environ.get("SHOAL_CACHE_DIR", "") or "~/.cache/shoal"
    return Path(chosen).expanduser()


def load_corpus(config: DataConfig) -> np.ndarray:
    """All corpus bytes as a read-only uint8 array, built once and then read from a cache file.

    The cache name hashes each file's (path, size, mtime) and max_corpus_bytes, so editing
    a file or the cap rebuilds it. It is written to a temp file and renamed into place, so
    several peers starting at once on one machine never see a half-written cache.
    """
    files = resolve_files(config)
    fingerprint = _fingerprint(files)
    key_material = repr((_CACHE_FORMAT, config.max_corpus_bytes, fingerprint)).encode()
    key = hashlib.sha256(key_material).hexdigest()[:16]
    cache_dir = cache_dir_for(config)
    cache_path = cache_dir / f"corpus-{key}.bin"

    if cache_path.is_file() and cache_path.stat().st_size > 0:
        logger.debug("using cached corpus %s", cache_path)
        return _open_tokens(cache_path)

    corpus = _read_files([Path(path) for path, _, _ in fingerprint], config.max_corpus_bytes)
    if len(corpus) < MIN_CORPUS_BYTES:
        raise ConfigError(
            f"corpus has only {len(corpus)} bytes from {len(fingerprint)} readable file(s), "
            f"need at least {MIN_CORPUS_BYTES}; add more text to data.paths"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(cache_path, corpus)
    logger.info("cached %d corpus bytes from %d files at %s", len(corpus), len(fingerprint), cache_path)
    return _open_tokens(cache_path)


def corpus_fingerprint(tokens: np.ndarray) -> dict[str, int | str]:
    """Size and sha256 of the token bytes: what the run manifest compares, so a peer training on
    other text is refused at join instead of silently pulling the model elsewhere."""
    digest = hashlib.sha256()
    view = np.asarray(tokens)
    for start in range(0, len(view), 1 << 24):
        digest.update(view[start:start + (1 << 24)].tobytes())
    return {"data.corpus_bytes": int(len(view)), "data.corpus_sha256": digest.hexdigest()[:32]}


def _fingerprint(files: list[Path]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of each file that can be stat-ed; broken links are dropped."""
    entries: list[tuple[str, int, int]] = []
    for path in files:
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((str(path), stat.st_size, stat.st_mtime_ns))
    return entries


def _read_files(files: list[Path], max_bytes: int) -> bytes:
    """Concatenate file bytes separated by b"\\n", skipping unreadable or empty files, up to max_bytes."""
    corpus = bytearray()
    for path in files:
        remaining = max_bytes - len(corpus)
        if remaining <= 0:
            break
        try:
            with open(path, "rb") as handle:
                content = handle.read(remaining)
        except OSError:
            logger.debug("skipping unreadable file %s", path)
            continue
        if not content:
            continue
        if corpus:
            corpus += b"\n"
        corpus += content
    return bytes(corpus[:max_bytes])


def _open_tokens(path: Path) -> np.ndarray:
    # memmap read-only: peers on one machine share the page cache instead of each holding a copy.
    return np.memmap(path, dtype=np.uint8, mode="r")


def split_corpus(tokens: np.ndarray, eval_fraction: float, max_eval_bytes: int, *,
                 block_bytes: int = 8192) -> Split:
    """Hold out ``eval_fraction`` of the corpus (at most ``max_eval_bytes``) as blocks of
    ``block_bytes`` spread evenly over it, the middle block of each stretch (smaller blocks when the
    split is small, so it still spans the corpus). Never trained on: ``BatchSampler`` rejects
    windows that touch a held-out block. A pure function of the corpus length and the config, so
    every peer holds out the same text."""
    wanted_bytes = min(int(len(tokens) * eval_fraction), max_eval_bytes)
    block = max(1, min(block_bytes, wanted_bytes // MIN_EVAL_BLOCKS))
    count, n_blocks = wanted_bytes // block, len(tokens) // block
    if count < 1 or n_blocks < 2 * count:
        raise ConfigError(
            f"held-out split of {wanted_bytes} bytes from a {len(tokens)}-byte corpus is unusable; "
            "raise data.eval_fraction or data.max_eval_bytes, or add more data"
        )
    period = n_blocks // count
    held_out = HeldOut(block=block, period=period, phase=period // 2, count=count)
    eval_text = np.concatenate([tokens[start:start + block] for start in held_out.starts()])
    return Split(tokens=tokens, held_out=held_out, eval=eval_text)


def shard_ranges(n_tokens: int, num_shards: int, shard_index: int, stripe_bytes: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` byte ranges of one of ``num_shards`` disjoint shards covering
    ``[0, n_tokens)``: the corpus is cut into stripes of ``stripe_bytes`` (smaller when the corpus
    has fewer than one stripe per shard) and shard i holds stripes i, i + num_shards, ...

    Why stripes: a corpus is files in order (the default one is stdlib sources, then docs), so a
    contiguous shard is one kind of text. Four peers on four contiguous shards of sixteen trained
    on a quarter of the corpus's kinds while the eval spans all of them, and their pseudo-gradients
    pulled apart (non-IID data): in a 4-peer simulation at 100 inner steps a round, striped data
    beat contiguous shards by ~1 nat of eval loss (docs/configuration.md, Data). A pure function of its
    arguments, so every peer cuts the same shards."""
    if num_shards <= 0:
        raise ValueError(f"data.num_shards ({num_shards}) must be a positive integer")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard index {shard_index} is outside [0, {num_shards})")
    if n_tokens < 0:
        raise ValueError(f"n_tokens ({n_tokens}) must be non-negative")
    if stripe_bytes <= 0:
        raise ValueError(f"data.shard_stripe_bytes ({stripe_bytes}) must be a positive integer")
    stripe = max(1, min(stripe_bytes, n_tokens // num_shards))
    return [(start, min(start + stripe, n_tokens))
            for start in range(shard_index * stripe, n_tokens, num_shards * stripe)]


def seed_for_peer(peer_id: str) -> int:
    """This peer's batch-order seed: stable across restarts with the same identity, different
    between peers (so two peers on one shard do not draw the same batches)."""
    return int.from_bytes(hashlib.sha256(b"batches:" + peer_id.encode("utf-8")).digest()[:8], "big")


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors from windows of seq_len+1 bytes at `starts`; y is x shifted by one."""
    # Fancy indexing copies, so the read-only memmap is never handed to torch.
    windows = np.asarray(tokens)[starts[:, None] + np.arange(seq_len + 1)]
    batch = torch.from_numpy(windows.astype(np.int64))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class BatchSampler:
    """Random windows of seq_len+1 bytes from one shard of the corpus (its ``ranges``; a window
    never straddles two of them), never touching held-out text; seeded so a peer's stream is
    reproducible. ``retarget`` moves it to another shard."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int | list[int], *,
                 ranges: list[tuple[int, int]] | None = None, held_out: HeldOut | None = None) -> None:
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        self.tokens, self.seq_len, self.batch_size, self.held_out = tokens, seq_len, batch_size, held_out
        self._rng = np.random.default_rng(seed)
        # Pinned host memory makes .to(device, non_blocking=True) truly asynchronous.
        self._pin = torch.cuda.is_available()
        self.retarget(ranges or [(0, len(tokens))])

    def retarget(self, ranges: list[tuple[int, int]]) -> None:
        """Draw from these ``[start, end)`` ranges from now on; a range too short for a window
        between held-out blocks is left out, and a shard with no usable range is refused."""
        window = self.seq_len + 1
        usable = [(lo, hi) for lo, hi in ranges
                  if (self.held_out.longest_gap(lo, hi) if self.held_out is not None else hi - lo) >= window]
        if not usable:
            size = sum(hi - lo for lo, hi in ranges)
            raise ConfigError(
                f"shard has {size} bytes, but no stretch of seq_len+1 = {window} training bytes in a row between "
                "held-out blocks; use a data.shard_stripe_bytes above it, fewer data.num_shards or more data"
            )
        self.ranges = np.asarray(usable, dtype=np.int64)
        room = self.ranges[:, 1] - self.ranges[:, 0] - self.seq_len  # window starts per range
        self._first = np.concatenate([[0], np.cumsum(room)])  # range k's starts are [first[k], first[k+1])

    def _draw(self, size: int) -> np.ndarray:
        """Window starts uniform over every start that fits inside one of the ranges."""
        flat = self._rng.integers(0, self._first[-1], size=size)
        k = np.searchsorted(self._first, flat, side="right") - 1
        return self.ranges[k, 0] + (flat - self._first[k])

    def next_starts(self) -> np.ndarray:
        """Window starts in the corpus; those touching held-out text are drawn again."""
        starts = self._draw(self.batch_size)
        if self.held_out is not None:
            while (bad := self.held_out.touches(starts, self.seq_len + 1)).any():
                starts[bad] = self._draw(int(bad.sum()))
        return starts

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (batch_size, seq_len) on CPU; y[:, t] is the byte after x[:, t]."""
        x, y = _windows(self.tokens, self.next_starts(), self.seq_len)
        if self._pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed batches of evenly spaced windows, so every peer scores the same held-out text."""
    if seq_len <= 0 or batch_size <= 0 or num_batches <= 0:
        raise ValueError(
            f"seq_len ({seq_len}), batch_size ({batch_size}) and num_batches ({num_batches}) must be positive"
        )
    if len(tokens) < seq_len + 1:
        raise ConfigError(
            f"held-out split has {len(tokens)} bytes but a window needs seq_len+1 = {seq_len + 1}; "
            "raise data.eval_fraction / data.max_eval_bytes or add more data"
        )
    last_start = len(tokens) - seq_len - 1
    starts = np.linspace(0, last_start, num=batch_size * num_batches).astype(np.int64)
    return [
        _windows(tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(num_batches)
    ]
