"""A standard transformers causal LM (``[model] kind = "hf"``) behind the built-in GPT's interface.

The trainer, the averager and checkpoints see one thing: ``model(idx, targets) -> (logits, loss)``
and ``named_parameters()``. ``HFCausalLM`` gives a transformers model exactly that, so Llama, Qwen2
or GPT-2 train like the GPT does. The architecture is built from a config (``model.config``, the
inline ``[model.hf]`` fields) and never downloaded; ``model.init`` continues a pretrained model
from local files. transformers is imported here only, so the built-in GPT never loads it.
"""

from __future__ import annotations

import difflib
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from node.training.model import CAUSAL_LM_SUFFIXES, ModelConfig, next_token_loss
from protocols.errors import ConfigError

# Shown when a name matches nothing: architectures known to train well from scratch.
COMMON_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
# Written by save_pretrained, not part of the architecture: dropped from the fields a checkpoint records.
_HOUSEKEEPING = ("architectures", "transformers_version", "model_type", "dtype", "torch_dtype", "_name_or_path")


class HFCausalLM(nn.Module):
    """A transformers causal LM (attribute ``hf``) with the GPT's ``forward(idx, targets)``.

    Parameter names are the transformers model's under ``hf.`` (``hf.model.embed_tokens.weight``);
    a tied head shares the embedding's tensor, so ``named_parameters()`` lists it once.
    """

    def __init__(self, hf: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.hf = hf
        self.config = config

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, given already-shifted targets, the mean cross-entropy, as GPT.forward."""
        _, seq = idx.shape
        if seq > self.config.seq_len:
            raise ValueError(f"input length {seq} exceeds model.seq_len ({self.config.seq_len})")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        return logits, None if targets is None else next_token_loss(logits, targets)


def architecture_class(name: str) -> type:
    """The transformers class ``name`` names; a name that is no causal LM is a one-line ConfigError."""
    import transformers

    try:
        found = getattr(transformers, name) if name.endswith(CAUSAL_LM_SUFFIXES) else None
    except AttributeError:
        found = None
    except Exception as e:  # noqa: BLE001 - a model module whose optional dependency is missing
        raise ConfigError(f"model.architecture {name!r} cannot be loaded: {_first_line(e)}") from None
    if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
        return found
    known = [n for n in dir(transformers) if n.endswith(CAUSAL_LM_SUFFIXES) and not n.startswith(("TF", "Flax"))]
    suggestions = dict.fromkeys([*difflib.get_close_matches(name, known, n=2), *COMMON_ARCHITECTURES])
    raise ConfigError(f"model.architecture {name!r} is not a causal LM class of transformers "
                      f"{transformers.__version__}; e.g. {', '.join(suggestions)}")


def transformers_config(config: ModelConfig, *, vocab_size: int | None = None) -> Any:
    """The transformers config a run builds: ``model.config`` (or ``model.init``'s config.json), then
    ``[model.hf]`` over it. The vocabulary defaults to the tokenizer's (``vocab_size``) and the position
    table to ``model.seq_len`` unless [model.hf] pins them: a config.json's own values belong to the
    tokenizer and context it was written for. A pretrained ``init`` keeps its own (its weights have them)."""
    config_class = architecture_class(config.architecture).config_class
    defaults = config_class()
    aliases = dict(getattr(config_class, "attribute_map", {}))
    source = Path(config.init).expanduser() / "config.json" if config.init else config.config
    fields = _read_config_json(Path(source).expanduser(), config_class) if source else {}
    inline = _canonical_fields(config.hf, config_class, defaults, aliases)
    fields.update(inline)
    vocab_key = aliases.get("vocab_size", "vocab_size")
    positions_key = aliases.get("max_position_embeddings", "max_position_embeddings")
    has_positions = hasattr(defaults, positions_key)
    if not config.init:
        if vocab_size is not None and vocab_key not in inline:
            fields[vocab_key] = vocab_size
        if has_positions and positions_key not in inline:
            fields[positions_key] = config.seq_len
        _drop_foreign_token_ids(fields, inline, defaults, fields.get(vocab_key, getattr(defaults, vocab_key, None)))
    try:
        hf_config = config_class.from_dict(fields)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model: {config.architecture}'s config does not accept these fields: {_first_line(e)}") from None
    where = "model.init's config.json" if config.init else "[model.hf]"
    vocab = getattr(hf_config, vocab_key)
    if vocab_size is not None and vocab < vocab_size:
        raise ConfigError(f"{where} vocab_size ({vocab}) is below the tokenizer's vocabulary ({vocab_size}); "
                          "raise it, or remove it to use the tokenizer's")
    if has_positions and getattr(hf_config, positions_key) < config.seq_len:
        raise ConfigError(f"model.seq_len ({config.seq_len}) exceeds {where} {positions_key} "
                          f"({getattr(hf_config, positions_key)}); lower model.seq_len or raise {positions_key}")
    return hf_config


def config_fields(config: ModelConfig, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The resolved transformers config as plain JSON fields (what ``[model.hf]`` alone would need to
    rebuild it, vocab and positions pinned): a checkpoint records these, not paths to files that exist
    on one machine only."""
    hf_config = transformers_config(config, vocab_size=vocab_size)
    fields = {key: value for key, value in hf_config.to_diff_dict().items()
              if key not in _HOUSEKEEPING and not key.startswith("_")}
    aliases = dict(getattr(type(hf_config), "attribute_map", {}))
    for name in ("vocab_size", "max_position_embeddings"):
        key = aliases.get(name, name)
        if hasattr(hf_config, key):
            fields[key] = getattr(hf_config, key)
    return fields


def build_hf_model(config: ModelConfig, seed: int, *, vocab_size: int | None = None) -> HFCausalLM:
    """Random init under ``seed`` on the CPU (the same weights in every process), or ``model.init``'s
    weights; float32 master weights with SDPA attention either way."""
    model_class = architecture_class(config.architecture)
    hf_config = transformers_config(config, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # also what fills weights an init directory lacks
        try:
            if config.init:
                hf = model_class.from_pretrained(Path(config.init).expanduser(), config=hf_config,
                                                 local_files_only=True, attn_implementation="sdpa")
            else:
                hf = model_class._from_config(hf_config, attn_implementation="sdpa")
        except (OSError, ValueError, RuntimeError, TypeError, ImportError) as e:
            what = f"model.init ({config.init}) cannot be loaded" if config.init else f"{config.architecture} cannot be built"
            raise ConfigError(f"{what}: {_first_line(e)}") from None
    return HFCausalLM(hf.float(), config)


def _read_config_json(path: Path, config_class: type) -> dict[str, Any]:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a readable config.json ({type(e).__name__}); point model.config at one") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{path} is not a transformers config (not a JSON object)")
    model_type = fields.get("model_type")
    if model_type and model_type != config_class.model_type:
        raise ConfigError(f"{path} describes a {model_type!r} model, not {config_class.model_type!r}; "
                          "set model.architecture to its class (see its 'architectures' field)")
    return fields


def _canonical_fields(inline: dict[str, Any], config_class: type, defaults: Any,
                      aliases: dict[str, str]) -> dict[str, Any]:
    """[model.hf] under the config's own attribute names; a misspelt field is an error, since
    transformers would keep it as an unused attribute and train another model than the file reads."""
    known = {*vars(defaults), *aliases, *inspect.signature(config_class.__init__).parameters} - {"self", "kwargs"}
    for key in inline:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see the architecture's config class"
            raise ConfigError(f"model.hf.{key} is not a field of {config_class.__name__}; {hint}")
    return {aliases.get(key, key): value for key, value in inline.items()}


def _drop_foreign_token_ids(fields: dict[str, Any], inline: dict[str, Any], defaults: Any, vocab: Any) -> None:
    """A default bos/eos/pad id beyond the vocabulary (GPT-2's 50256 over bytes) names no token of this
    run: None instead of transformers' warning at every build. One set in [model.hf] is kept."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = fields.get(key, getattr(defaults, key, None))
        if key not in inline and isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
            fields[key] = None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
