"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

from typing import Optional

import torch


def sample_top_p(probs: torch.Tensor, p: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sample from the smallest set of most likely tokens whose probability reaches ``p``.

    probs (B, V), rows summing to 1; returns token ids (B,).
    """
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    probs_sorted = probs_sorted.masked_fill(mass_before > p, 0.0)  # the top token always stays
    choice = torch.multinomial(probs_sorted, num_samples=1, generator=generator)
    return torch.gather(order, -1, choice).squeeze(-1)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next token ids (B,) from float logits (B, V).  ``temperature == 0`` is greedy (argmax)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return sample_top_p(probs, top_p, generator)
