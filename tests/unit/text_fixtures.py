"""Real tokenizers and dataset files for the tokenizer and document tests, made at test time."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

EOS = "<|endoftext|>"


def sample_text(limit: int = 24_000) -> str:
    """A few KB of real text: the start of some standard-library sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / name).read_text(encoding="utf-8")[: limit // 3] for name in ("json/encoder.py", "heapq.py", "bisect.py")]
    return "\n".join(parts)


def train_tokenizer(directory: Path, *, vocab_size: int = 400, with_template: bool = False) -> Path:
    """A small byte-level BPE trained on ``sample_text``, saved as ``directory/tokenizer.json``.

    ``with_template`` adds a post-processor that wraps every encoding in EOS markers, as many hub
    tokenizers add BOS: shoal must not apply it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([sample_text()], trainer)
    if with_template:
        eos_id = tokenizer.token_to_id(EOS)
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{EOS} $A {EOS}", special_tokens=[(EOS, eos_id)])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def documents(count: int, *, words: int = 6) -> list[str]:
    """Distinct documents, each naming its index, so a test can tell which ended up where."""
    return [f"document {i:04d} says " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words)) + "." for i in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), path)
    return path


def write_arrow(path: Path, texts: list[str], field: str = "text") -> Path:
    """An Arrow IPC stream, the format datasets writes with save_to_disk."""
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({field: texts})
    with pa.ipc.new_stream(str(path), table.schema) as writer:
        writer.write_table(table)
    return path
