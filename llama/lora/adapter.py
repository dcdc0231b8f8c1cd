"""A LoRA adapter in this library's terms: low-rank factors keyed by the Meta-named linear
layer they change.

A layer ``y = x @ W.T`` with an adapter becomes ``y = x @ W.T + scale * (x @ A.T) @ B.T``,
with ``A`` of shape ``[r, in_features]`` and ``B`` of shape ``[out_features, r]`` (PEFT's
``lora_A.weight`` and ``lora_B.weight``), ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with rsLoRA).  Merged, ``W' = W + scale * B @ A``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch


@dataclass(frozen=True)
class LoraFactors:
    """One layer's factors, whole (not split over ranks), in Meta's row order (the rows of
    ``wq``'s and ``wk``'s ``B`` already permuted back from Hugging Face's rotary order)."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter read for one base model.

    ``factors`` is keyed by the layer's name in Meta's ``Transformer`` (as
    ``model.named_modules()`` gives it), e.g. ``"layers.0.attention.wq"``,
    ``"layers.3.feed_forward.w2"``; layers the adapter does not target are absent.
    """

    name: str
    path: Path
    rank: int
    scale: float
    factors: dict[str, LoraFactors] = field(default_factory=dict)
    base_model: Optional[str] = None  # adapter_config.json's base_model_name_or_path, if given
