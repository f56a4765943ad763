"""Sampling (the pure rule and the sliding loop), and the ``shoal sample`` / ``shoal export`` /
``shoal --version`` commands on checkpoints written by node.library.checkpoint."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from node.cli import app
from node.library.checkpoint import MODEL_FILE, round_dir_name, save_checkpoint
from node.training.model import ModelConfig, build_model
from node.training.sampling import generate, next_token

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
GPT_CONFIG = ModelConfig(d_model=32, n_layer=2, n_head=4, seq_len=16)
GPT_TOML = "[model]\nd_model = 32\nn_layer = 2\nn_head = 4\nseq_len = 16\n"
needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("node.training.tokenizer") is None,
                                     reason="node/training/tokenizer.py has not landed yet")


# -- the sampling rule -------------------------------------------------------------------------
def test_zero_temperature_and_top_1_are_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, temperature=0.0, top_k=50) == 1
    generator = torch.Generator().manual_seed(0)
    assert {next_token(logits, temperature=5.0, top_k=1, generator=generator) for _ in range(50)} == {1}


def test_top_k_samples_among_the_k_likeliest_only() -> None:
    logits = torch.tensor([1.0, 0.0, 3.0, 2.9, -5.0])
    generator = torch.Generator().manual_seed(0)
    drawn = {next_token(logits, temperature=2.0, top_k=2, generator=generator) for _ in range(300)}
    assert drawn == {2, 3}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature: float) -> None:
    logits = torch.tensor([0.0, 1.0, 2.0])
    generator = torch.Generator().manual_seed(1)
    draws = torch.tensor([next_token(logits, temperature=temperature, top_k=0, generator=generator) for _ in range(4000)])
    frequencies = torch.bincount(draws, minlength=3).float() / len(draws)
    torch.testing.assert_close(frequencies, torch.softmax(logits / temperature, dim=0), atol=0.03, rtol=0)


def test_the_same_seed_draws_the_same_tokens() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    def draw(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [next_token(logits, temperature=1.0, top_k=20, generator=generator) for _ in range(30)]
    assert draw(4) == draw(4) != draw(5)


class Counter(nn.Module):
    """Predicts last token + 1 (mod vocab), except that ``vocab - 1`` scores highest of all; records windows."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.weight, self.windows = vocab, nn.Parameter(torch.zeros(1)), []

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.windows.append(idx.shape[1])
        logits = torch.full((*idx.shape, self.vocab), -10.0)
        logits[..., self.vocab - 1] = 10.0
        logits.scatter_(2, ((idx + 1) % (self.vocab - 1)).unsqueeze(-1), 5.0)
        return logits, None


def test_generate_slides_the_context_stops_at_eos_and_stays_in_the_vocabulary() -> None:
    model = Counter(vocab=33)
    new = generate(model, list(range(10)), max_new_tokens=5, context_len=4, temperature=0.0, top_k=0, vocab_limit=32)
    assert new == [10, 11, 12, 13, 14] and max(model.windows) == 4
    assert generate(Counter(33), [5], max_new_tokens=9, context_len=4, temperature=0.0, top_k=0, vocab_limit=32,
                    eos_id=8) == [6, 7]
    assert generate(Counter(33), [5], max_new_tokens=2, context_len=4, temperature=0.0, top_k=0) == [32, 32]
    with pytest.raises(ValueError, match="at least one token"):
        generate(Counter(33), [], max_new_tokens=1, context_len=4)


# -- the commands --------------------------------------------------------------------------------
def write_checkpoint(directory: Path, config: ModelConfig, *, record: bool = True, round: int = 3, seed: int = 0) -> dict:
    from node.training.export import run_config_meta

    model = build_model(config, seed=seed, vocab_size=256)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    meta = {"run_id": "test", **({"run_config": run_config_meta(config, "bytes", 256)} if record else {})}
    save_checkpoint(directory, round=round, params=params, outer_state={}, meta=meta)
    return params


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def expected_text(config: ModelConfig, params: dict, prompt: str, **options) -> str:
    from node.training.export import trained_model
    from node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("bytes")
    model = trained_model(params, config, 256)
    new = generate(model, tokenizer.encode_batch([prompt])[0], context_len=config.seq_len, vocab_limit=256,
                   generator=torch.Generator().manual_seed(options.pop("seed")), **options)
    return tokenizer.decode(new)


@needs_tokenizer
def test_sample_prints_what_the_checkpoints_model_generates(tmp_path: Path) -> None:
    params = write_checkpoint(tmp_path, GPT_CONFIG)
    args = ["sample", "--checkpoint-dir", str(tmp_path), "--prompt", "the quick brown fox", "--max-new-tokens", "40",
            "--seed", "2", "--device", "cpu"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert result.stdout == expected_text(GPT_CONFIG, params, "the quick brown fox", max_new_tokens=40, seed=2,
                                          temperature=0.8, top_k=50) + "\n"
    assert invoke(*args).stdout == result.stdout
    greedy = invoke(*args, "--temperature", "0")
    assert greedy.stdout == expected_text(GPT_CONFIG, params, "the quick brown fox", max_new_tokens=40, seed=0,
                                          temperature=0.0, top_k=50) + "\n"


@needs_tokenizer
def test_sample_and_export_an_hf_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config = ModelConfig(kind="hf", architecture="LlamaForCausalLM", seq_len=16, hf={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})
    write_checkpoint(tmp_path / "ckpt", config)
    result = invoke("sample", "--checkpoint-dir", str(tmp_path / "ckpt"), "--prompt", "hi", "--max-new-tokens", "30")
    assert result.exit_code == 0, result.output
    assert 0 < len(result.stdout.encode()) <= 30 * 3 + 1  # 30 bytes, each at most one replacement char
    exported = invoke("export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"))
    assert exported.exit_code == 0, exported.output
    assert "model.safetensors" in exported.stdout and "AutoModelForCausalLM.from_pretrained(" in exported.stdout


@needs_tokenizer
def test_export_writes_once_and_replaces_only_with_force(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    write_checkpoint(tmp_path / "ckpt", GPT_CONFIG)
    args = ["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert f"wrote {tmp_path / 'out'} from {tmp_path / 'ckpt' / round_dir_name(3)} (round 3)" in first.stdout
    again = invoke(*args)
    assert again.exit_code == 2 and "is not empty; pass --force" in again.output and "Traceback" not in again.output
    assert invoke(*args, "--force").exit_code == 0


def test_a_missing_empty_or_corrupt_checkpoint_dir_is_one_line_and_exit_5(tmp_path: Path) -> None:
    missing = invoke("sample", "--checkpoint-dir", str(tmp_path / "nope"), "--prompt", "x")
    assert missing.exit_code == 5 and "is not a directory" in missing.output
    empty = invoke("export", "--checkpoint-dir", str(tmp_path), "--output", str(tmp_path / "out"))
    assert empty.exit_code == 5 and "no checkpoint in" in empty.output
    write_checkpoint(tmp_path / "ckpt", GPT_CONFIG)
    model_file = tmp_path / "ckpt" / round_dir_name(3) / MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[:100])
    corrupt = invoke("sample", "--checkpoint-dir", str(tmp_path / "ckpt"), "--prompt", "x")
    assert corrupt.exit_code == 5 and "no valid checkpoint" in corrupt.output and "truncated" in corrupt.output
    for result in (missing, empty, corrupt):
        assert result.output.count("\n") == 1 and result.output.startswith("error: ")


@needs_tokenizer
def test_a_newer_broken_checkpoint_is_skipped_with_a_line(tmp_path: Path) -> None:
    params = write_checkpoint(tmp_path, GPT_CONFIG, round=3)
    write_checkpoint(tmp_path, GPT_CONFIG, round=4, seed=9)
    (tmp_path / round_dir_name(4) / MODEL_FILE).write_bytes(b"garbage")
    result = invoke("sample", "--checkpoint-dir", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "10",
                    "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert "skipped: checkpoint" in result.stderr
    assert result.stdout == expected_text(GPT_CONFIG, params, "ab", max_new_tokens=10, seed=0, temperature=0.0,
                                          top_k=50) + "\n"


@needs_tokenizer
def test_a_checkpoint_without_its_model_needs_config(tmp_path: Path) -> None:
    params = write_checkpoint(tmp_path / "ckpt", GPT_CONFIG, record=False)
    without = invoke("sample", "--checkpoint-dir", str(tmp_path / "ckpt"), "--prompt", "ab")
    assert without.exit_code == 5 and "pass --config" in without.output
    (tmp_path / "run.toml").write_text(GPT_TOML)
    with_config = invoke("sample", "--checkpoint-dir", str(tmp_path / "ckpt"), "--prompt", "ab", "--config",
                         str(tmp_path / "run.toml"), "--max-new-tokens", "10", "--temperature", "0")
    assert with_config.exit_code == 0, with_config.output
    assert with_config.stdout == expected_text(GPT_CONFIG, params, "ab", max_new_tokens=10, seed=0, temperature=0.0,
                                               top_k=50) + "\n"
    (tmp_path / "other.toml").write_text(GPT_TOML.replace("n_layer = 2", "n_layer = 3"))
    wrong = invoke("sample", "--checkpoint-dir", str(tmp_path / "ckpt"), "--prompt", "ab", "--config",
                   str(tmp_path / "other.toml"))
    assert wrong.exit_code == 5 and "lack blocks.2." in wrong.output


def test_version_lists_what_a_bug_report_needs() -> None:
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    names = [line.split(" ", 1)[0] for line in result.stdout.splitlines()]
    assert names[:6] == ["shoal", "protocol", "python", "torch", "cuda", "hivemind"]
    from protocols.version import PROTOCOL_VERSION

    assert f"protocol {PROTOCOL_VERSION}\n" in result.stdout and f"torch {torch.__version__}\n" in result.stdout
    assert ("transformers" in names) == (subprocess.run([sys.executable, "-c", "import transformers"],
                                                        capture_output=True).returncode == 0)


def test_help_loads_neither_torch_nor_transformers() -> None:
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom node.cli import app\n"
            "for args in (['--help'], ['run', '--help'], ['sample', '--help'], ['export', '--help']):\n"
            "    assert CliRunner().invoke(app, args).exit_code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'tokenizers', 'wandb', 'tensorboard')"
            " if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
