"""Export to the Hugging Face format: the built-in GPT is GPT2LMHeadModel exactly, an hf model is
itself; the checkpoint's record rebuilds the model; the output directory is written atomically."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from node.training.model import ModelConfig, build_model
from protocols.errors import CheckpointError, ConfigError

transformers = pytest.importorskip("transformers")

from node.training.export import (  # noqa: E402
    export_hf,
    gpt2_state_dict,
    hf_model,
    load_params,
    model_config_from_meta,
    run_config_meta,
    trained_model,
)

torch.set_num_threads(1)
HAS_TOKENIZER = importlib.util.find_spec("node.training.tokenizer") is not None
needs_tokenizer = pytest.mark.skipif(not HAS_TOKENIZER, reason="node/training/tokenizer.py has not landed yet")
GPT_CONFIG = ModelConfig(d_model=32, n_layer=2, n_head=4, seq_len=16)
LLAMA_CONFIG = ModelConfig(kind="hf", architecture="LlamaForCausalLM", seq_len=16, hf={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2})


def trained_like(config: ModelConfig, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A model whose biases and norms are not their init (zeros/ones would hide a mapping bug)."""
    model = build_model(config, seed=seed, vocab_size=vocab_size)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model.eval()


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def tokens(vocab_size: int, length: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("vocab_size", [256, 300])
def test_the_gpt_is_gpt2_exactly(vocab_size: int) -> None:
    ours = trained_like(GPT_CONFIG, vocab_size)
    theirs = hf_model(params_of(ours), GPT_CONFIG, vocab_size=vocab_size)
    assert isinstance(theirs, transformers.GPT2LMHeadModel)
    assert theirs.lm_head.weight is theirs.transformer.wte.weight
    x = tokens(vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=x).logits, ours(x)[0], atol=1e-5, rtol=1e-5)


def test_gpt2_mapping_refuses_a_checkpoint_of_another_model() -> None:
    params = params_of(trained_like(GPT_CONFIG, 256))
    with pytest.raises(CheckpointError, match=r"lacks blocks\.2\."):
        gpt2_state_dict(params, n_layer=3)
    with pytest.raises(CheckpointError, match=r"holds blocks\.1\..*which the built-in GPT has not"):
        gpt2_state_dict(params, n_layer=1)


def test_an_hf_model_exports_as_itself_with_the_prefix_stripped() -> None:
    ours = trained_like(LLAMA_CONFIG, 260)
    theirs = hf_model(params_of(ours), LLAMA_CONFIG, vocab_size=260, eos_id=259)
    assert isinstance(theirs, transformers.LlamaForCausalLM)
    assert theirs.config.eos_token_id == 259 and theirs.generation_config.eos_token_id == 259
    x = tokens(260)
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=x).logits, ours(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [GPT_CONFIG, LLAMA_CONFIG], ids=["gpt", "llama"])
def test_the_recorded_run_config_rebuilds_the_trained_model(config: ModelConfig) -> None:
    ours = trained_like(config, 260)
    meta = json.loads(json.dumps({"run_config": run_config_meta(config, "bytes", 260)}))  # as meta.json holds it
    rebuilt_config, spec, vocab_size = model_config_from_meta(meta)
    assert (spec, vocab_size, rebuilt_config.kind) == ("bytes", 260, config.kind)
    rebuilt = trained_model(params_of(ours), rebuilt_config, vocab_size)
    x = tokens(260)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x)[0], ours(x)[0], atol=0, rtol=0)


def test_the_record_needs_no_config_file_or_init_directory(tmp_path: Path) -> None:
    pretrained = trained_like(LLAMA_CONFIG, 256)
    pretrained.hf.save_pretrained(tmp_path / "pre")
    config = ModelConfig(kind="hf", architecture="LlamaForCausalLM", seq_len=16, init=str(tmp_path / "pre"))
    record = run_config_meta(config, "bytes", 256)
    assert record["model"]["init"] == "" and record["model"]["config"] == ""
    assert record["model"]["hf"]["hidden_size"] == 32 and record["model"]["hf"]["vocab_size"] == 256
    for file in (tmp_path / "pre").iterdir():
        file.unlink()
    rebuilt = trained_model(params_of(pretrained), *model_config_from_meta({"run_config": record})[::2])
    x = tokens(256)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x)[0], pretrained(x)[0], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({}, r"does not record its model .* pass --config"),
        ({"run_config": {"model": {"d_model": 3, "n_head": 2}, "data": {"tokenizer": "bytes"}, "vocab_size": 256}},
         r"run_config is unusable .*divisible.* pass --config"),
        ({"run_config": {"model": {"colour": "red"}, "data": {"tokenizer": "bytes"}, "vocab_size": 256}},
         r"run_config is unusable"),
        ({"run_config": {"model": {}, "data": {}, "vocab_size": 256}}, r"run_config is unusable"),
        ({"run_config": {"model": {}, "data": {"tokenizer": "bytes"}, "vocab_size": "many"}}, r"no valid tokenizer/vocab_size"),
    ],
)
def test_a_missing_or_broken_record_is_a_checkpoint_error(meta: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as raised:
        model_config_from_meta(meta)
    assert "\n" not in str(raised.value)


def test_load_params_names_the_first_mismatch() -> None:
    model = build_model(GPT_CONFIG, seed=0)
    params = params_of(model)
    with pytest.raises(CheckpointError, match=r"lack tok_emb\.weight"):
        load_params(model, {k: v for k, v in params.items() if k != "tok_emb.weight"})
    with pytest.raises(CheckpointError, match=r"hold extra\.weight"):
        load_params(model, {**params, "extra.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"give pos_emb\.weight shape \(8, 32\), this model \(16, 32\)"):
        load_params(model, {**params, "pos_emb.weight": torch.zeros(8, 32)})


@needs_tokenizer
@pytest.mark.parametrize("config", [GPT_CONFIG, LLAMA_CONFIG], ids=["gpt", "llama"])
def test_export_loads_with_auto_classes_and_computes_shoal_logits(tmp_path: Path, config: ModelConfig) -> None:
    from node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("bytes")
    vocab_size = max(256, tokenizer.vocab_size)
    ours = trained_like(config, vocab_size)
    output = tmp_path / "out"
    written = export_hf(params_of(ours), config, "bytes", output, vocab_size=vocab_size)
    names = {path.name for path in written}
    assert {"config.json", "model.safetensors"} <= names and all(path.parent == output for path in written)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir left beside it
    loaded = transformers.AutoModelForCausalLM.from_pretrained(output)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    x = tokens(vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, ours(x)[0], atol=1e-5, rtol=1e-5)
    prompt = torch.tensor([hf_tokenizer("hello").input_ids])
    generated = loaded.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] <= prompt.shape[1] + 5 and torch.equal(generated[:, :prompt.shape[1]], prompt)


@needs_tokenizer
def test_export_refuses_a_non_empty_output_unless_forced(tmp_path: Path) -> None:
    params = params_of(trained_like(GPT_CONFIG, 256))
    output = tmp_path / "out"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"--output .* is not empty; pass --force"):
        export_hf(params, GPT_CONFIG, "bytes", output, vocab_size=256)
    assert (output / "notes.txt").exists()
    export_hf(params, GPT_CONFIG, "bytes", output, vocab_size=256, force=True)
    assert not (output / "notes.txt").exists() and (output / "model.safetensors").exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"--output .*a-file is a file"):
        export_hf(params, GPT_CONFIG, "bytes", tmp_path / "a-file", vocab_size=256)
