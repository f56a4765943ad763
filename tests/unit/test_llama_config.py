"""examples/configs/llama-150m.toml is OpenDiLoCo's 150m Llama with its DiLoCo settings; the
estimates in its header are recomputed from the model it builds; and its data section reads a
FineWeb-Edu-like parquet file with a byte-level BPE trained as examples/join_public_run.md trains one."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from averaging.math.codecs import bytes_per_value
from node.process.config import EXAMPLES_DIR, load_config
from node.training.hf_model import transformers_config
from node.training.model import build_model, count_parameters
from node.training.token_cache import TokenizedDataset
from node.training.tokenizer import load_tokenizer
from protocols.errors import ConfigError

LLAMA = EXAMPLES_DIR / "llama-150m.toml"
COUNT = 266_888_192  # OpenDiLoCo's configs/config_150m.json shapes as transformers' LlamaForCausalLM
VOCAB = 32_000  # Llama 2's (and Mistral-7B-v0.1's, which OpenDiLoCo's scripts load) tokenizer


@pytest.fixture(scope="module")
def model():
    # On the meta device: the real architecture and parameter count without allocating 1 GB.
    with torch.device("meta"):
        return build_model(load_config(LLAMA).model, seed=0, vocab_size=VOCAB)


def test_it_is_opendiloco_150m_with_its_diloco_settings():
    config = load_config(LLAMA)
    assert (config.model.kind, config.model.architecture, config.model.seq_len) == ("hf", "LlamaForCausalLM", 1024)
    assert config.model.hf == {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12,
                               "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": VOCAB,
                               "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    inner, outer = config.inner, config.outer
    assert (inner.lr, inner.beta1, inner.beta2, inner.weight_decay, inner.grad_clip) == (4e-4, 0.9, 0.95, 0.1, 1.0)
    assert (outer.lr, outer.momentum, outer.nesterov) == (0.7, 0.9, True)
    assert config.round.inner_steps == 500  # H, for --sync-mode blocking
    # OpenDiLoCo's 1,000 warmup and 88,000 total steps, counted in outer steps of H = 500.
    assert (inner.warmup_rounds, inner.total_rounds) == (1000 / 500, 88_000 / 500)
    assert (config.data.format, config.data.text_field) == ("parquet", "text")
    assert config.data.tokenizer.endswith("tokenizer.json") and config.data.paths


def test_it_builds_the_stated_llama(model):
    hf = model.hf.config
    assert count_parameters(model) == COUNT
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.intermediate_size) == (1024, 12, 16, 4096)
    assert (hf.vocab_size, hf.max_position_embeddings, hf.rms_norm_eps, hf.tie_word_embeddings) == (VOCAB, 1024, 1e-5, False)
    assert model.hf.lm_head.weight is not model.hf.model.embed_tokens.weight
    assert f"({COUNT:,}, computed" in LLAMA.read_text()


def test_header_estimates_match_its_model(model):
    """The header's numbers come from formulas; recompute them from the model the file builds, so
    that editing [model], batch_size or the round without updating the comments fails here."""
    config = load_config(LLAMA)
    text = " ".join(line.lstrip("# ") for line in LLAMA.read_text().splitlines())  # comments joined across lines
    params = count_parameters(model)
    width, layers, seq = model.hf.config.hidden_size, model.hf.config.num_hidden_layers, config.model.seq_len
    batch, gb = config.data.batch_size, 1e9
    attention = 12 * layers * seq * width  # FLOPs per token beyond 6N
    upload = bytes_per_value(config.averaging.compression) * 2 * params  # int4 sends + int4 returns
    expected = {
        "GPU states (16 B/param)": f"= {16 * params / gb:.2f} GB",
        "activations (60 x seq x batch x width per block)": f"= {60 * seq * batch * width * layers / gb:.2f} GB",
        "logit values": f"{batch * seq * VOCAB:,} values",
        "logits (bf16 + 3 fp32 copies)": f"= {14 * batch * seq * VOCAB / gb:.2f} GB",
        "bf16 weight copies": f"({2 * params / gb:.2f} GB)",
        "anchor + momentum (8 B/param)": f"= {8 * params / gb:.2f} GB",
        "snapshot": f"({4 * params / gb:.2f} GB)",
        "4090, 6N at 66 TFLOPS": f"~{round(66e12 / (6 * params) / 1e3)}k tokens/s",
        "4090, with attention": f"~{round(66e12 / (6 * params + attention) / 1e3)}k tokens/s",
        "A100, 6N at 125 TFLOPS": f"~{round(125e12 / (6 * params) / 1e3)}k tokens/s",
        "A100, with attention": f"~{round(125e12 / (6 * params + attention) / 1e3)}k with attention",
        "tokens per step": f"{batch * seq:,} tokens",
        "fp16 pseudo-gradient": f"{round(2 * params / 1e6)} MB in fp16",
        "int4 each way": f"~{round(upload / 1e6)} MB each way",
        "20 Mbit/s": f"~{round(upload * 8 / 20e6)} s on a 20 Mbit/s",
        "share of the round": f"({round(100 * upload * 8 / 20e6 / config.round.seconds)}% of the {config.round.seconds:.0f} s round)",
        "fp16 upload": f"({round(4 * params / 1e6):,} MB, ~{round(4 * params * 8 / 20e6)} s",
    }
    missing = {what: value for what, value in expected.items() if value not in text}
    assert not missing, f"update the estimates in {LLAMA.name}: {missing}"
    # The point of the round length: int4 on a 20 Mbit/s uplink is a small share of a round, and fits in it.
    assert upload * 8 / 20e6 < 0.15 * config.round.seconds
    assert config.averaging.allreduce_timeout < config.round.seconds
    assert config.train.precision == "bf16" and config.train.device == "cuda"


def test_the_pinned_vocabulary_takes_a_smaller_tokenizer_and_refuses_a_larger_one():
    model = load_config(LLAMA).model
    assert transformers_config(model, vocab_size=300).vocab_size == VOCAB  # every peer builds the same shapes
    with pytest.raises(ConfigError, match="below the tokenizer's vocabulary"):
        transformers_config(model, vocab_size=VOCAB + 1)


def test_its_data_section_reads_fineweb_like_parquet_with_a_trained_bpe(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    rows = [f"Lesson {i}: the {'water cycle' if i % 2 else 'cell'} explained, with {i} examples." for i in range(200)]
    table = pa.table({"text": rows, "id": [f"<urn:uuid:{i}>" for i in range(200)], "score": [3.1] * 200})
    shard_dir = tmp_path / "fineweb-edu" / "sample" / "10BT"
    shard_dir.mkdir(parents=True)
    pq.write_table(table, shard_dir / "000_00000.parquet")

    # Trained as the guide trains one (there on the first million documents, to 32,000 ids).
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((t for batch in pq.ParquetFile(shard_dir / "000_00000.parquet").iter_batches(columns=["text"])
                             for t in batch.column("text").to_pylist()), trainer=trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))

    pattern = str(LLAMA.read_text().split('paths = ["')[1].split('"')[0])
    assert re.fullmatch(r"~/shoal-data/fineweb-edu/sample/10BT/\*\.parquet", pattern)
    config = load_config(LLAMA, {
        "data.paths": [str(tmp_path / pattern.removeprefix("~/shoal-data/"))],
        "data.tokenizer": str(tmp_path / "tokenizer.json"), "data.cache_dir": str(tmp_path / "cache"),
        # 200 documents: hold out 1 in 20 (the file's 1 in 10,000 needs a real sample) over 4 shards.
        "data.eval_fraction": 0.05, "data.num_shards": 4})
    tokenizer = load_tokenizer(config.data.tokenizer)
    assert tokenizer.eos_id == bpe.token_to_id("<|endoftext|>")
    assert tokenizer.vocab_size <= transformers_config(config.model, vocab_size=tokenizer.vocab_size).vocab_size
    dataset = TokenizedDataset(config.data, tokenizer)
    shard, held_out = np.asarray(dataset.shard_tokens(0)), np.asarray(dataset.eval_tokens())
    # One end-of-text after every document: 10 held out, 190 dealt over 4 shards (shard 0 gets 48).
    assert (held_out == tokenizer.eos_id).sum() == 200 // 20
    assert (shard == tokenizer.eos_id).sum() == -(-(200 - 200 // 20) // 4)
    assert tokenizer.decode(held_out[: list(held_out).index(tokenizer.eos_id)].tolist()).startswith("Lesson ")

