"""Behaviour logprobs, computed one way everywhere (docs/design.md invariant 6).

The trainer and the transformers engine both call :func:`sampled_token_logprobs`; the vLLM engine is
asked for ``logprobs_mode="processed_logprobs"``, which applies the same temperature (and top-k/top-p
masking) before the log-softmax. Torch is imported lazily so ``bucketrl`` imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Scale by temperature, then mask tokens outside top-k / top-p with -inf (last dim = vocab)."""
    import torch

    scaled = logits.float() / temperature
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass *before* it is < top_p (the top token is always kept).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sampled_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0
) -> torch.Tensor:
    """log p(token) under the processed distribution. logits [..., V], token_ids [...] -> [...]."""
    import torch

    logp = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
