"""Text from a trained model: the sampling rule as a pure function, and the loop that feeds it.

The loop runs shoal's own model (either kind), so what ``shoal sample`` prints is what the
checkpoint computes, with no export. The context slides: only the last ``seq_len`` tokens are
fed, as in training (the GPT's learned positions end there).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def next_token(logits: Tensor, *, temperature: float, top_k: int, generator: torch.Generator | None = None) -> int:
    """One token id from a 1-D row of logits.

    ``temperature <= 0`` is greedy (the argmax); otherwise the logits are divided by it and, with
    ``top_k > 0``, all but the ``top_k`` largest are dropped before sampling from the softmax.
    """
    assert logits.dim() == 1, "one row of logits"
    logits = logits.detach().float().cpu()
    if temperature <= 0 or top_k == 1:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if 0 < top_k < scaled.numel():
        threshold = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate(model: nn.Module, prompt: list[int], *, max_new_tokens: int, context_len: int, temperature: float = 0.8,
             top_k: int = 50, vocab_limit: int | None = None, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """The new token ids after ``prompt`` (stopping early at ``eos_id``, which is not returned).

    ``vocab_limit`` keeps the choice among the tokenizer's ids when the model's embedding has more
    rows (padding). No KV cache: each step re-reads the window, which is simple and exact.
    """
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    model.eval()
    device = next(model.parameters()).device
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-context_len:]], dtype=torch.long, device=device)
        logits, _ = model(window)
        token = next_token(logits[0, -1, :vocab_limit], temperature=temperature, top_k=top_k, generator=generator)
        if token == eos_id:
            break
        tokens.append(token)
        new.append(token)
    return new
