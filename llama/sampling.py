"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .checks import scale_by_temperature


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.  Checked on creation (``ValueError``/``TypeError``)."""

    temperature: float = 0.6  # 0 = greedy (argmax)
    top_p: float = 0.9  # keep the smallest set of tokens whose probability reaches top_p
    top_k: Optional[int] = None  # keep only the k most likely tokens (None: all)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
                raise TypeError(f"top_k must be an int or None, got {type(self.top_k).__name__}")
            if self.top_k < 1:
                raise ValueError(f"top_k must be >= 1 (or None for no limit), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
    logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Next token ids (B,) from float logits (B, V)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    logits = scale_by_temperature(logits, params.temperature)  # cannot overflow, whatever the temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p >= 1.0:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return sample_top_p(probs, params.top_p, generator)
