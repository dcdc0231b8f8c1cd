"""LoRA adapters made in memory for the serving tests: random factors in Meta's names for a test
checkpoint's full weights, and the merged weights ``W + scale * B @ A`` they stand for (the
independent reference: a plain model with those weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from llama.lora.adapter import LoraAdapter, LoraFactors

ALL_TARGETS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def random_adapter(name: str, weights: dict[str, torch.Tensor], n_layers: int, rank: int,
                   targets: Sequence[str] = ALL_TARGETS, seed: int = 0, scale: float = 2.0) -> LoraAdapter:
    """An adapter of ``rank`` changing ``targets`` of every layer, with random A and B (both
    non-zero, unlike PEFT's initial B: a test of them can fail), sized so that the change is of
    the order of the weights' own effect."""
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for i in range(n_layers):
        for target in targets:
            out_f, in_f = weights[f"layers.{i}.{target}.weight"].shape
            a = torch.randn(rank, in_f, generator=g) / in_f**0.5
            b = torch.randn(out_f, rank, generator=g) / (rank**0.5 * scale) * 0.7
            factors[f"layers.{i}.{target}"] = LoraFactors(a, b)
    return LoraAdapter(name=name, path=Path(f"/in-memory/{name}"), rank=rank, scale=scale, factors=factors)


def merged_weights(weights: dict[str, torch.Tensor], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """``weights`` with ``adapter`` folded in: ``W + scale * B @ A`` for every layer it changes
    (in float64, then float32)."""
    out = dict(weights)
    for name, f in adapter.factors.items():
        key = f"{name}.weight"
        out[key] = (weights[key].double() + adapter.scale * f.b.double() @ f.a.double()).float()
    return out
