"""The built-in byte-level GPT: a small decoder-only transformer that needs no download.

Every peer of a run builds it from the same `ModelConfig` and seed, so all start from
identical weights and their pseudo-gradients are comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from protocols.errors import ConfigError

BYTE_VOCAB_SIZE = 256


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Architecture of the built-in byte-level GPT; every peer of a run must agree on it."""

    vocab_size: int = BYTE_VOCAB_SIZE
    """Tokens are raw bytes, so this is fixed at 256."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    seq_len: int = 64
    """Context length in bytes (size of the learned positional embedding)."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""
    dropout: float = 0.0
    """Dropout on attention, residual and embedding outputs during training."""

    def __post_init__(self) -> None:
        if self.vocab_size != BYTE_VOCAB_SIZE:
            raise ConfigError(
                f"model.vocab_size ({self.vocab_size}) must be {BYTE_VOCAB_SIZE}: "
                "the built-in model is byte-level; remove the setting"
            )
        for name in ("d_model", "n_layer", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name} ({value!r}) must be a positive integer")
        if self.d_model % self.n_head != 0:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head}); "
                "change one of them"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout ({self.dropout}) must be in [0, 1); use 0.0 to disable it")


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
    """Decoder-only transformer over bytes with a learned positional embedding and tied lm_head."""

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
        if targets is None:
            return logits, None
        # Loss in float32 even under bf16 autocast: log-softmax over 256 classes loses
        # precision in bf16 and the loss is what peers compare and report.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(config: ModelConfig, seed: int) -> GPT:
    """Deterministic init on CPU from `seed` — every peer of a run starts from the same weights.

    `fork_rng` restores the global RNG afterwards, so building a model does not perturb
    the caller's data sampling or dropout streams.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
