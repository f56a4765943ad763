"""The tokenizer a run trains with: raw bytes, a ``tokenizer.json``, or a transformers tokenizer.

Every peer must cut text into the same ids, so a tokenizer is identified by ``sha256``, a hash of
what decides its ids, which the run manifest compares. Documents are encoded without the
tokenizer's own special-token template (no BOS/EOS from its post-processor); shoal appends
``eos_id`` after every document instead, as nanoGPT does, and ``save`` writes the tokenizer so that
transformers encodes exactly like that. tokenizers is imported only for a real tokenizer, and
transformers only for a directory or a hub name, so neither slows ``shoal run --help``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.library.atomic import write_atomically
from protocols.errors import ConfigError

if TYPE_CHECKING:
    import tokenizers

logger = logging.getLogger(__name__)

BYTES = "bytes"
BYTE_EOS = ord("\n")
"""The bytes tokenizer's separator: the byte corpus joins files with a newline, so this matches it."""

_BYTES_SHA256 = hashlib.sha256(b"shoal-bytes-tokenizer-v1").hexdigest()[:32]
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[SEP]")
"""Special tokens taken as the document separator of a bare tokenizer.json, in this order."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TextTokenizer:
    """What the rest of shoal uses: batch encoding of documents, decoding, and a stable identity."""

    def __init__(self, spec: str, backend: tokenizers.Tokenizer | None, eos_id: int | None) -> None:
        # backend None is the bytes tokenizer: ids are UTF-8 bytes, computed without tokenizers.
        self.spec, self._backend, self.eos_id = spec, backend, eos_id
        if backend is None:
            self.vocab_size, self.sha256 = 256, _BYTES_SHA256
        else:
            self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
            canonical = json.dumps(_as_used(backend), sort_keys=True, separators=(",", ":"))
            self.sha256 = hashlib.sha256(f"{canonical}\neos={eos_id}".encode()).hexdigest()[:32]

    def __repr__(self) -> str:
        return f"TextTokenizer({self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (the caller appends ``eos_id``)."""
        if self._backend is None:
            return [list(text.encode("utf-8", errors="replace")) for text in texts]
        # encode_batch_fast skips offsets, which shoal never uses; it encodes the same ids.
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        if self._backend is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._backend.decode(ids, skip_special_tokens=False)

    def save(self, directory: Path) -> list[Path]:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json, so that
        ``transformers.AutoTokenizer.from_pretrained(directory)`` encodes like ``encode_batch``.
        The bytes tokenizer is written as a byte-level BPE without merges whose ids equal the byte
        values, so a model trained on raw bytes is usable with standard tooling."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        backend = self._backend if self._backend is not None else byte_level_tokenizer()
        eos = backend.id_to_token(self.eos_id) if self._backend is not None and self.eos_id is not None else None
        specials = {"eos_token": eos} if eos is not None else {}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  "add_bos_token": False, "add_eos_token": False, **specials}
        contents = {"tokenizer.json": _as_used(backend), "tokenizer_config.json": config,
                    "special_tokens_map.json": specials}
        paths = []
        for name in _HF_FILES:
            write_atomically(directory / name, (json.dumps(contents[name], indent=2, ensure_ascii=False) + "\n").encode())
            paths.append(directory / name)
        return paths


def load_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer named by ``data.tokenizer``: "bytes", a tokenizer.json, a local transformers
    tokenizer directory, or a Hugging Face hub name (online only). Problems are one-line ConfigErrors."""
    if spec == BYTES:
        return TextTokenizer(spec, None, BYTE_EOS)
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_file(spec, path)
    if path.is_dir():
        return _from_directory(spec, path)
    if _looks_like_path(spec):
        raise ConfigError(f"data.tokenizer: {spec} does not exist; point it at a tokenizer.json, a tokenizer "
                          "directory, or use \"bytes\"")
    return _from_transformers(spec, spec)


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    """A tokenizers byte-level BPE with no merges and no regex split: one token per byte, id = byte."""
    tokenizers = _tokenizers()
    symbols = _byte_symbols()
    vocab = {symbols[byte]: byte for byte in range(256)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    return backend


def _byte_symbols() -> list[str]:
    """The printable character ByteLevel shows each byte as: printable Latin-1 bytes stand for
    themselves, the other bytes for code points 256, 257, ... in byte order (GPT-2's scheme)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def _looks_like_path(spec: str) -> bool:
    """A hub name is "name" or "org/name"; anything else that does not exist is a missing path."""
    return spec.startswith((".", "/", "~")) or spec.endswith(".json") or spec.count("/") > 1 or "\\" in spec


def _from_file(spec: str, path: Path) -> TextTokenizer:
    tokenizers = _tokenizers()
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except OSError as e:
        raise ConfigError(f"data.tokenizer: cannot read {path} ({e.strerror or e}); check its permissions") from None
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON or an unknown model
        raise ConfigError(f"data.tokenizer: {path} is not a valid tokenizer.json ({_first_line(e)}); point it at a "
                          "tokenizer.json saved by tokenizers or transformers") from None
    eos_id = _eos_beside(path, backend)
    return TextTokenizer(spec, _plain(backend), eos_id if eos_id is not None else _find_eos(backend))


def _from_directory(spec: str, path: Path) -> TextTokenizer:
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"data.tokenizer: directory {path} has no tokenizer (no tokenizer.json or "
                          "tokenizer_config.json); point it at a tokenizer.json or a save_pretrained directory")
    return _from_transformers(spec, str(path))


def _from_transformers(spec: str, source: str) -> TextTokenizer:
    """A tokenizer through transformers (imported here only), which applies a directory's own
    config the way users of the model will."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"data.tokenizer {spec!r} needs transformers; pip install 'shoal[hf]' or point "
                          "data.tokenizer at a tokenizer.json") from None
    try:
        loaded = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # transformers and the hub raise many types (OSError, ValueError, HTTP errors)
        if source == spec and not Path(source).exists():
            raise ConfigError(f"data.tokenizer {spec!r} is not a local path and could not be fetched from the "
                              f"Hugging Face hub ({_first_line(e)}); download it or point data.tokenizer at a "
                              "local tokenizer.json") from None
        raise ConfigError(f"data.tokenizer: transformers cannot load {source} ({_first_line(e)}); point "
                          "data.tokenizer at a tokenizer.json") from None
    backend = getattr(loaded, "backend_tokenizer", None)
    if not isinstance(backend, _tokenizers().Tokenizer):
        raise ConfigError(f"data.tokenizer: {source} has no fast tokenizer (tokenizer.json); convert it with "
                          "transformers (save_pretrained of a fast tokenizer) and point data.tokenizer there")
    backend = _plain(backend)
    eos_id = loaded.eos_token_id if isinstance(loaded.eos_token_id, int) else _find_eos(backend)
    return TextTokenizer(spec, backend, eos_id)


def _plain(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy that never truncates or pads: a document must be encoded whole."""
    backend = _tokenizers().Tokenizer.from_str(backend.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def _as_used(backend: tokenizers.Tokenizer) -> dict[str, Any]:
    """The tokenizer's JSON as shoal encodes with it: no post-processor template, truncation or padding."""
    content = json.loads(backend.to_str())
    content.update(post_processor=None, truncation=None, padding=None)
    return content


def _eos_beside(path: Path, backend: tokenizers.Tokenizer) -> int | None:
    """The eos token named by a tokenizer_config.json next to a tokenizer.json, if any."""
    try:
        config = json.loads((path.parent / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return backend.token_to_id(eos) if isinstance(eos, str) else None


def _find_eos(backend: tokenizers.Tokenizer) -> int | None:
    """A conventional end-of-text special token, else None (documents then run together)."""
    for name in _EOS_NAMES:
        token_id = backend.token_to_id(name)
        if token_id is not None:
            return token_id
    logger.warning("tokenizer has no end-of-text token (%s); documents are concatenated without a separator",
                   ", ".join(_EOS_NAMES))
    return None


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("data.tokenizer other than \"bytes\" needs tokenizers; pip install 'shoal[hf]'") from None
    return tokenizers


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
