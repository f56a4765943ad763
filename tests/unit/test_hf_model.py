"""``[model] kind = "hf"``: config checks, the transformers config a run builds, the GPT-shaped
wrapper, deterministic init across processes, continuing a pretrained directory, the fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from node.training.model import GPT, ModelConfig, build_model, model_fingerprint

transformers = pytest.importorskip("transformers")

from node.training.hf_model import HFCausalLM, config_fields, transformers_config  # noqa: E402

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
LLAMA_FIELDS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "tie_word_embeddings": True}


def llama(**overrides) -> ModelConfig:
    return ModelConfig(**{"kind": "hf", "architecture": "LlamaForCausalLM", "seq_len": 16,
                          "hf": dict(LLAMA_FIELDS), **overrides})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "bert"}, r"model\.kind \('bert'\) must be one of gpt, hf"),
        ({"kind": "hf"}, r"needs model\.architecture"),
        ({"architecture": "LlamaForCausalLM"}, r"model\.architecture applies to kind 'hf' only"),
        ({"hf": {"hidden_size": 8}}, r"model\.hf applies to kind 'hf' only"),
        ({"init": "/x"}, r"model\.init applies to kind 'hf' only"),
        ({"kind": "hf", "architecture": "Llama For"}, r"must name a transformers causal LM class"),
        ({"kind": "hf", "architecture": "LlamaForCausalLM", "d_model": 128}, r"model\.d_model applies to kind 'gpt'"),
        ({"kind": "hf", "architecture": "LlamaForCausalLM", "config": "/nowhere/config.json"}, r"model\.config .* is not a file"),
        ({"kind": "hf", "architecture": "LlamaForCausalLM", "init": "/nowhere"}, r"model\.init .* not a model directory"),
        ({"kind": "hf", "architecture": "LlamaForCausalLM", "seq_len": 0}, r"model\.seq_len"),
    ],
)
def test_config_rejects_misplaced_or_missing_fields(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_gpt_takes_any_positive_vocab_and_build_model_overrides_it() -> None:
    assert ModelConfig(vocab_size=50257).vocab_size == 50257
    with pytest.raises(ValueError, match=r"model\.vocab_size"):
        ModelConfig(vocab_size=0)
    model = build_model(ModelConfig(d_model=32, n_head=4, seq_len=16), seed=0, vocab_size=300)
    assert isinstance(model, GPT) and model.tok_emb.weight.shape == (300, 32) and model.config.vocab_size == 300


@pytest.mark.parametrize(
    ("name", "suggested"),
    [("LlamaForCausalLm", "LlamaForCausalLM"), ("BertModel", "BertLMHeadModel"), ("NoSuchForCausalLM", "GPT2LMHeadModel")],
)
def test_unknown_architecture_is_one_line_with_valid_names(name: str, suggested: str) -> None:
    with pytest.raises(ValueError, match=rf"model\.architecture '{name}' is not a causal LM class") as raised:
        build_model(llama(architecture=name, hf={}), seed=0, vocab_size=256)
    assert "\n" not in str(raised.value)
    assert suggested in str(raised.value) and "LlamaForCausalLM" in str(raised.value)


def test_a_misspelt_hf_field_is_named_with_the_likely_one() -> None:
    with pytest.raises(ValueError, match=r"model\.hf\.hiden_size is not a field of LlamaConfig; did you mean hidden_size"):
        transformers_config(llama(hf={"hiden_size": 32}), vocab_size=256)


def test_vocab_and_positions_default_to_the_tokenizer_and_seq_len() -> None:
    built = transformers_config(llama(), vocab_size=300)
    assert built.vocab_size == 300 and built.max_position_embeddings == 16
    pinned = transformers_config(llama(hf={**LLAMA_FIELDS, "vocab_size": 512, "max_position_embeddings": 64}), vocab_size=300)
    assert pinned.vocab_size == 512 and pinned.max_position_embeddings == 64
    with pytest.raises(ValueError, match=r"vocab_size \(100\) is below the tokenizer's vocabulary \(300\)"):
        transformers_config(llama(hf={**LLAMA_FIELDS, "vocab_size": 100}), vocab_size=300)
    with pytest.raises(ValueError, match=r"model\.seq_len \(16\) exceeds \[model\.hf\] max_position_embeddings \(8\)"):
        transformers_config(llama(hf={**LLAMA_FIELDS, "max_position_embeddings": 8}), vocab_size=300)


def test_gpt2_positions_use_its_own_name_and_its_aliases_are_accepted() -> None:
    gpt2 = ModelConfig(kind="hf", architecture="GPT2LMHeadModel", seq_len=16,
                       hf={"hidden_size": 32, "n_layer": 1, "num_attention_heads": 4})
    built = transformers_config(gpt2, vocab_size=256)
    assert (built.n_positions, built.n_embd, built.n_head, built.vocab_size) == (16, 32, 4, 256)
    assert built.bos_token_id is None and built.eos_token_id is None  # GPT-2's 50256 names no byte
    with pytest.raises(ValueError, match=r"exceeds \[model\.hf\] n_positions \(8\)"):
        transformers_config(ModelConfig(kind="hf", architecture="GPT2LMHeadModel", seq_len=16, hf={"n_positions": 8}))


def test_config_json_is_the_base_and_inline_fields_win(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    transformers.LlamaConfig(**{**LLAMA_FIELDS, "num_hidden_layers": 3, "vocab_size": 32000}).to_json_file(path)
    built = transformers_config(llama(config=str(path), hf={"num_hidden_layers": 1}), vocab_size=256)
    assert (built.num_hidden_layers, built.hidden_size, built.vocab_size) == (1, 32, 256)
    with pytest.raises(ValueError, match=r"describes a 'llama' model, not 'qwen2'"):
        transformers_config(llama(architecture="Qwen2ForCausalLM", config=str(path), hf={}), vocab_size=256)


def test_wrapper_matches_the_gpt_interface_and_lists_a_tied_head_once() -> None:
    model = build_model(llama(), seed=0, vocab_size=260)
    assert isinstance(model, HFCausalLM) and model.hf.config._attn_implementation == "sdpa"
    names = [name for name, _ in model.named_parameters()]
    assert names[0] == "hf.model.embed_tokens.weight" and "hf.lm_head.weight" not in names
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    idx, targets = torch.randint(0, 260, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 260) and loss.dtype == torch.float32
    expected = F.cross_entropy(model.hf(input_ids=idx).logits.float().reshape(-1, 260), targets.reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert model(idx)[1] is None
    with pytest.raises(ValueError, match=r"input length 17 exceeds model\.seq_len \(16\)"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_wrapper_trains() -> None:
    model = build_model(llama(), seed=0, vocab_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    first = None
    for _ in range(20):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < first - 1.0


def test_init_is_deterministic_by_seed_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_model(llama(), seed=5, vocab_size=256)
    assert torch.equal(torch.rand(3), expected)
    b, c = build_model(llama(), seed=5, vocab_size=256), build_model(llama(), seed=6, vocab_size=256)
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(c)
    assert len(model_fingerprint(a)) == 32 and int(model_fingerprint(a), 16) >= 0


def test_init_is_the_same_in_another_process() -> None:
    code = ("from node.training.model import ModelConfig, build_model, model_fingerprint\n"
            f"config = ModelConfig(kind='hf', architecture='LlamaForCausalLM', seq_len=16, hf={LLAMA_FIELDS!r})\n"
            "print(model_fingerprint(build_model(config, seed=5, vocab_size=256)))\n")
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert other.stdout.strip() == model_fingerprint(build_model(llama(), seed=5, vocab_size=256))


def test_fingerprint_sees_one_changed_element() -> None:
    model = build_model(ModelConfig(d_model=32, n_head=4, seq_len=16), seed=0)
    before = model_fingerprint(model)
    with torch.no_grad():
        model.blocks[1].mlp.fc.bias[3] += 1e-3
    assert model_fingerprint(model) != before


def test_init_continues_a_pretrained_directory(tmp_path: Path) -> None:
    pretrained = build_model(llama(), seed=3, vocab_size=256)
    pretrained.hf.save_pretrained(tmp_path / "pre")
    continued = build_model(ModelConfig(kind="hf", architecture="LlamaForCausalLM", seq_len=16, init=str(tmp_path / "pre")),
                            seed=0, vocab_size=256)
    assert model_fingerprint(continued) == model_fingerprint(pretrained)
    assert continued.hf.config.vocab_size == 256  # the pretrained model's, not overridden
    with pytest.raises(ValueError, match=r"model\.init's config\.json vocab_size \(256\) is below the tokenizer's"):
        build_model(ModelConfig(kind="hf", architecture="LlamaForCausalLM", seq_len=16, init=str(tmp_path / "pre")),
                    seed=0, vocab_size=300)
    with pytest.raises(ValueError, match=r"model\.config and model\.init are both set"):
        ModelConfig(kind="hf", architecture="LlamaForCausalLM", init=str(tmp_path / "pre"),
                    config=str(tmp_path / "pre" / "config.json"))


def test_config_fields_rebuild_the_same_model_without_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    transformers.LlamaConfig(**LLAMA_FIELDS).to_json_file(path)
    from_file = llama(config=str(path), hf={})
    fields = json.loads(json.dumps(config_fields(from_file, vocab_size=300)))
    assert fields["vocab_size"] == 300 and fields["max_position_embeddings"] == 16
    inline = llama(hf=fields)
    path.unlink()
    assert model_fingerprint(build_model(inline, seed=1, vocab_size=300)) == model_fingerprint(
        build_model(llama(), seed=1, vocab_size=300))
