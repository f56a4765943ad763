"""The models a run trains: the built-in byte-level GPT, or a standard transformers causal LM.

Every peer of a run builds it from the same `ModelConfig` and seed, so all start from
identical weights and their pseudo-gradients are comparable. The GPT needs no download and no
transformers; ``kind = "hf"`` builds a transformers architecture from its config (or continues a
pretrained one) behind the same ``model(x, y) -> (logits, loss)`` (see ``node.training.hf_model``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protocols.errors import ConfigError

BYTE_VOCAB_SIZE = 256
MODEL_KINDS = ("gpt", "hf")
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # transformers' names for decoder LMs with a head
_HF_ONLY = ("architecture", "config", "hf", "init")
_GPT_SIZES = ("vocab_size", "d_model", "n_layer", "n_head", "mlp_ratio")
_GPT_ONLY = (*_GPT_SIZES, "dropout")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The architecture every peer of a run builds; every peer must agree on it."""

    kind: str = "gpt"
    """gpt: the built-in byte GPT | hf: a transformers causal LM built from a config (never downloaded)."""
    architecture: str = ""
    """hf: the transformers class, e.g. LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel."""
    config: str = ""
    """hf: path to a transformers config.json giving the architecture's shape."""
    hf: dict[str, Any] = field(default_factory=dict)
    """hf: the transformers config's own fields inline ([model.hf]), applied over ``config``."""
    init: str = ""
    """hf: a pretrained model directory (save_pretrained) to continue from, read from local files only."""
    vocab_size: int = BYTE_VOCAB_SIZE
    """gpt: rows of the embedding; at least the tokenizer's vocabulary (256 for bytes)."""
    d_model: int = 64
    """gpt: width of the residual stream."""
    n_layer: int = 2
    """gpt: number of transformer blocks."""
    n_head: int = 4
    """gpt: attention heads per block; must divide d_model."""
    seq_len: int = 64
    """Training context in tokens, for both kinds (gpt: the size of its learned positional embedding)."""
    mlp_ratio: int = 4
    """gpt: hidden width of the MLP as a multiple of d_model."""
    dropout: float = 0.0
    """gpt: dropout on attention, residual and embedding outputs during training."""

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ConfigError(f"model.kind ({self.kind!r}) must be one of {', '.join(MODEL_KINDS)}")
        for name in ("seq_len", *(_GPT_SIZES if self.kind == "gpt" else ())):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name} ({value!r}) must be a positive integer")
        if self.kind == "gpt":
            self._check_gpt()
        else:
            self._check_hf()

    def _check_gpt(self) -> None:
        for name in _HF_ONLY:
            if getattr(self, name):
                raise ConfigError(f"model.{name} applies to kind 'hf' only; set model.kind = 'hf' or remove model.{name}")
        if self.d_model % self.n_head != 0:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head}); "
                "change one of them"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout ({self.dropout}) must be in [0, 1); use 0.0 to disable it")

    def _check_hf(self) -> None:
        # Silently ignoring the GPT's fields would train another model than the file reads.
        defaults = ModelConfig()
        for name in _GPT_ONLY:
            if getattr(self, name) != getattr(defaults, name):
                raise ConfigError(f"model.{name} applies to kind 'gpt' only; set the transformers field in "
                                  f"[model.hf] instead (e.g. hidden_size, num_hidden_layers, vocab_size)")
        if not self.architecture:
            raise ConfigError("model.kind = 'hf' needs model.architecture, e.g. 'LlamaForCausalLM' or 'GPT2LMHeadModel'")
        if not self.architecture.isidentifier():  # the class itself is looked up when the model is built
            raise ConfigError(f"model.architecture ({self.architecture!r}) must name a transformers causal LM class "
                              "(…ForCausalLM or …LMHeadModel), e.g. 'LlamaForCausalLM'")
        if not isinstance(self.hf, dict) or not all(isinstance(key, str) for key in self.hf):
            raise ConfigError("model.hf must be a table of the transformers config's fields, e.g. hidden_size = 256")
        if self.config and not Path(self.config).expanduser().is_file():
            raise ConfigError(f"model.config ({self.config}) is not a file; point it at a transformers config.json "
                              "or give the fields in [model.hf]")
        if self.init:
            if self.config:
                raise ConfigError("model.config and model.init are both set; the init directory holds its own "
                                  "config.json, remove model.config")
            if not (Path(self.init).expanduser() / "config.json").is_file():
                raise ConfigError(f"model.init ({self.init}) is not a model directory with a config.json; point it "
                                  "at a directory written by save_pretrained or shoal export")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and the past."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (B, T, C) -> (B, H, T, C/H): heads become a batch dimension for SDPA.
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: normalising before each sublayer keeps deep stacks stable."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over tokens (bytes by default) with a learned positional embedding and tied lm_head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Weight tying: one tensor, registered under tok_emb first, so named_parameters()
        # (which deduplicates by identity) lists it once — averaging must not send it twice.
        self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init; residual projections shrink with depth so the stream's variance stays bounded."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_proj = name.endswith("attn.proj") or name.endswith("mlp.proj")
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual_proj else 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return logits of shape (B, T, vocab) and, given targets, the mean cross-entropy loss."""
        _, seq = idx.shape
        if seq > self.config.seq_len:
            raise ValueError(f"input length {seq} exceeds model.seq_len ({self.config.seq_len})")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, None if targets is None else next_token_loss(logits, targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, vocab) logits against already-shifted targets, for every model
    shoal trains. In float32 even under bf16 autocast: log-softmax over the vocabulary loses
    precision in bf16, and the loss is what peers compare and report."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(config: ModelConfig, seed: int, *, vocab_size: int | None = None) -> nn.Module:
    """Deterministic init on CPU from `seed` — every peer of a run starts from the same weights.

    ``vocab_size`` is the tokenizer's: the GPT's embedding rows (over ``config.vocab_size``), an hf
    model's unless [model.hf] pins it. `fork_rng` restores the global RNG afterwards, so building a
    model does not perturb the caller's data sampling or dropout streams.
    """
    if config.kind == "hf":
        from node.training.hf_model import build_hf_model  # transformers loads only for hf models

        return build_hf_model(config, seed, vocab_size=vocab_size)
    if vocab_size is not None:
        config = replace(config, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def model_fingerprint(model: nn.Module) -> str:
    """32 hex digits over every tensor's name, shape, dtype and bytes: peers continuing a pretrained
    model (``model.init``) compare it to know they hold the same weights before they average."""
    # Persistent buffers only: one recomputed at build (RoPE's inv_freq) may differ by an ulp between CPUs.
    persistent = model.state_dict().keys()
    tensors = {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if n in persistent}}
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    return digest.hexdigest()[:32]


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
