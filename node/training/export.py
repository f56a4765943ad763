"""A trained model in the Hugging Face format, and shoal's own model rebuilt from a checkpoint.

``export_hf`` writes a directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load with no shoal installed: an hf model as itself, the
built-in GPT as the ``GPT2LMHeadModel`` it is (pre-LN blocks, learned positions, tied head,
biases, exact GELU), so the exported logits are shoal's. A checkpoint records what is needed to
rebuild its model (``run_config_meta``) without the config file or a pretrained directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from node.training.model import ModelConfig, build_model
from protocols.errors import CheckpointError, ConfigError

RUN_CONFIG_KEY = "run_config"  # the checkpoint meta.json key run_config_meta fills
_HF_PREFIX = "hf."  # HFCausalLM's transformers model
_GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


TOKENIZER_COPY = "tokenizer"  # <checkpoint-dir>/tokenizer: the run's tokenizer, kept beside its checkpoints


def run_config_meta(model_config: ModelConfig, tokenizer_spec: str, vocab_size: int) -> dict[str, Any]:
    """What a checkpoint's meta.json keeps under ``run_config`` so export and sample rebuild its model:
    every ModelConfig field (an hf model's transformers config inlined, so no path is needed) and the
    tokenizer."""
    model = self_contained(model_config, vocab_size)
    return {"model": {f.name: getattr(model, f.name) for f in fields(model)},
            "data": {"tokenizer": tokenizer_spec}, "vocab_size": vocab_size}


def model_config_from_meta(meta: dict[str, Any]) -> tuple[ModelConfig, str, int]:
    """(model config, tokenizer spec, vocab size) from a checkpoint's meta.json; CheckpointError when
    it has none (only ``shoal run`` records it, not a library user's checkpoint) or it does not parse."""
    recorded = meta.get(RUN_CONFIG_KEY)
    if recorded is None:
        raise CheckpointError("the checkpoint does not record its model (only shoal run's checkpoints do); "
                              "pass --config with the run's config file")
    try:
        model_config = ModelConfig(**recorded["model"])
        tokenizer_spec, vocab_size = recorded["data"]["tokenizer"], recorded["vocab_size"]
    except (KeyError, TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"the checkpoint's run_config is unusable ({e}); "
                              "pass --config with the run's config file") from None
    if not isinstance(tokenizer_spec, str) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise CheckpointError("the checkpoint's run_config has no valid tokenizer/vocab_size; "
                              "pass --config with the run's config file")
    return model_config, tokenizer_spec, vocab_size


def self_contained(model_config: ModelConfig, vocab_size: int) -> ModelConfig:
    """The same model, built from its record alone: the GPT's vocabulary as built, an hf model's
    transformers config resolved into ``hf`` (vocab and positions pinned), so no config.json or init
    directory is read again and another transformers version's defaults cannot change it (a
    checkpoint's weights replace init's)."""
    if model_config.kind == "gpt":
        return replace(model_config, vocab_size=vocab_size)
    from node.training.hf_model import config_fields

    return replace(model_config, config="", init="", hf=config_fields(model_config, vocab_size=vocab_size))


def trained_model(params: dict[str, Tensor], model_config: ModelConfig, vocab_size: int) -> nn.Module:
    """shoal's model (what ``shoal run`` trained) holding a checkpoint's parameters, on the CPU."""
    model = build_model(self_contained(model_config, vocab_size), seed=0, vocab_size=vocab_size)
    load_params(model, params)
    return model.eval()


def load_params(model: nn.Module, params: dict[str, Tensor]) -> None:
    """Copy ``params`` (by ``named_parameters`` name, tied weights once) into ``model``; a checkpoint
    of another model is a CheckpointError naming the first mismatch."""
    named = dict(model.named_parameters())
    problem = None
    if missing := sorted(set(named) - set(params)):
        problem = f"lack {missing[0]}"
    elif unexpected := sorted(set(params) - set(named)):
        problem = f"hold {unexpected[0]}, which this model has not"
    elif shaped := [n for n in named if named[n].shape != params[n].shape]:
        problem = f"give {shaped[0]} shape {tuple(params[shaped[0]].shape)}, this model {tuple(named[shaped[0]].shape)}"
    if problem is not None:
        raise CheckpointError(f"the checkpoint's parameters {problem}; pass --config with the config the run trained")
    with torch.no_grad():
        for name, param in named.items():
            param.copy_(params[name])


def export_hf(params: dict[str, Tensor], model_config: ModelConfig, tokenizer_spec: str, output: Path, *,
              vocab_size: int, force: bool = False) -> list[Path]:
    """Write config.json, model.safetensors and the tokenizer's files into ``output``; return them.

    Built in a temp dir beside ``output`` and renamed into place, so ``output`` is never half written;
    a non-empty ``output`` is replaced only with ``force``.
    """
    from node.training.tokenizer import load_tokenizer

    output = Path(output).expanduser()
    _check_output(output, force)
    tokenizer = load_tokenizer(tokenizer_spec)
    hf = hf_model(params, model_config, vocab_size=vocab_size, eos_id=end_of_text(tokenizer))
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the model from other users
        hf.save_pretrained(staging)
        tokenizer.save(staging)
        for path in staging.iterdir():
            os.chmod(path, 0o644)  # safetensors writes 0600: an export is for others to load
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted(output.iterdir())


def end_of_text(tokenizer: Any) -> int | None:
    """The id that ends a generated text: the tokenizer's separator, unless that is an ordinary
    character (the bytes tokenizer separates documents with a newline, which text is full of)."""
    from node.training.tokenizer import BYTES

    return None if tokenizer.spec == BYTES else tokenizer.eos_id


def hf_model(params: dict[str, Tensor], model_config: ModelConfig, *, vocab_size: int,
             eos_id: int | None = None) -> nn.Module:
    """The transformers model of a checkpoint: an hf model as itself, the GPT as GPT2LMHeadModel."""
    if model_config.kind == "hf":
        hf = trained_model(params, model_config, vocab_size).hf
    else:
        from transformers import GPT2LMHeadModel

        with torch.random.fork_rng(devices=[]):  # its random init is overwritten; the caller's RNG is not
            hf = GPT2LMHeadModel(gpt2_config(model_config, vocab_size=vocab_size))
        hf.load_state_dict(gpt2_state_dict(params, model_config.n_layer), strict=True)
    _set_token_ids(hf, eos_id)
    return hf.eval()


def gpt2_config(model_config: ModelConfig, *, vocab_size: int) -> Any:
    """The GPT2Config that computes exactly what the built-in GPT does."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size, n_positions=model_config.seq_len, n_embd=model_config.d_model,
        n_layer=model_config.n_layer, n_head=model_config.n_head, n_inner=model_config.mlp_ratio * model_config.d_model,
        activation_function="gelu",  # exact erf GELU (F.gelu), not GPT-2's tanh "gelu_new"
        layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )


def gpt2_state_dict(params: dict[str, Tensor], n_layer: int) -> dict[str, Tensor]:
    """The built-in GPT's parameters under GPT2LMHeadModel's names. GPT-2's Conv1D keeps a weight as
    (in, out), nn.Linear as (out, in): those are transposed. q, k, v are fused in the same order."""
    renamed = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
               "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    layer_parts = {"ln_1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "ln_2": "ln_2",
                   "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    for i in range(n_layer):
        for ours, theirs in layer_parts.items():
            for kind in ("weight", "bias"):
                renamed[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    if unknown := sorted(set(params) - set(renamed)):
        raise CheckpointError(f"the checkpoint holds {unknown[0]}, which the built-in GPT has not; "
                              "pass --config with the config the run trained")
    if missing := sorted(set(renamed) - set(params)):
        raise CheckpointError(f"the checkpoint lacks {missing[0]}; pass --config with the config the run trained")
    state = {}
    for ours, theirs in renamed.items():
        tensor = params[ours].detach().to("cpu", torch.float32)
        state[theirs] = tensor.t().contiguous() if theirs.endswith(_GPT2_TRANSPOSED) else tensor
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied, as in shoal's GPT
    return state


def _set_token_ids(hf: nn.Module, eos_id: int | None) -> None:
    """The run's tokenizer decides what ends a text; ids beyond the vocabulary name no token."""
    vocab = hf.config.vocab_size
    for target in (hf.config, getattr(hf, "generation_config", None)):
        if target is None:
            continue
        if eos_id is not None:
            target.eos_token_id = eos_id
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(target, key, None)
            if isinstance(value, int) and not 0 <= value < vocab:
                setattr(target, key, eos_id if key != "eos_token_id" and eos_id is not None else None)


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file; give a directory to write the model into")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ConfigError(f"--output {output} is not empty; pass --force to replace it, or choose another directory")


def _publish(staging: Path, output: Path) -> None:
    """Rename into place; an existing ``output`` is moved aside first (rename cannot replace a
    non-empty directory) and removed once the new one is there."""
    displaced = None
    if output.exists():
        displaced = output.with_name(f".{output.name}.old-{time.monotonic_ns()}")
        os.rename(output, displaced)
    os.rename(staging, output)
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
