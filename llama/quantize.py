"""Weight-only int8 quantisation of the model's linear layers.

Each weight row (one output feature) is stored as int8 with one float scale:
``W[i, :] ~= scale[i] * q[i, :]``, ``scale[i] = max|W[i, :]| / 127``.  Activations stay
in floating point.  Decoding reads a quarter (vs float32) or half (vs bfloat16) of
the weight bytes, which is what a batch-1 decode step is bound by.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("int8",)


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per row) with symmetric per-output-channel scaling."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale


@torch.no_grad()
def quantize_int8_(model: nn.Module) -> int:
    """Quantise every model-parallel linear layer of ``model`` in place (the
    embedding table stays in float: a step reads one row of it).  Returns the number
    of layers converted."""
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None:
            q, scale = quantize_rows_int8(module.weight)
            # The CPU kernel takes bfloat16 scales; elsewhere they meet the activations' dtype.
            scale_dtype = torch.bfloat16 if module.weight.device.type == "cpu" else module.weight.dtype
            del module.weight
            module.weight = None
            module.register_buffer("weight_int8", q.contiguous())
            module.register_buffer("weight_scale", scale.to(scale_dtype))
            count += 1
    logger.info("quantised %d linear layers to int8 (weight-only, per output channel)", count)
    return count
