"""Attention over the KV cache, by the kernel policy (:mod:`llama.layers.policy`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llama.layers.policy import KernelPolicy


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     policy: KernelPolicy) -> torch.Tensor:
    """``softmax(q keys^T / sqrt(D), masked) values``: q (B, H, R, D), keys and values (B, H, S, D),
    ``mask`` (B or 1, 1, R, S) True where a query may attend; (B, H, R, D) in q's dtype.

    On the CPU under torch.compile with ``policy.attention_as_reduction``: the scores and the
    weighted sum as broadcast multiply-and-sum in float32, which Inductor fuses into
    vectorised reductions reading each key and value once.  torch's CPU flash-attention kernel
    is built for many query rows; for a decoding step's few (1-8 rows of 4 queries) it took
    2.1-3.2x the time (the 150m's and the 1B's heads, 64 to 4,096 cached positions, 1 and 2
    threads: benchmarks/bench_attention.py), and about the same at 32 query rows.  Eager,
    the products would be materialised (R x S x D floats): SDPA."""
    if not (policy.attention_as_reduction and q.device.type == "cpu" and mask.dtype == torch.bool
            and torch.compiler.is_compiling()):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    scores = (q.float().unsqueeze(-2) * keys.float().unsqueeze(-3)).sum(-1) * q.shape[-1] ** -0.5  # (B, H, R, S)
    # A row that may attend to nothing (a padding row) gets zeros, as from SDPA, not NaN (a
    # softmax over -inf alone), which a mixture of experts would spread to the other rows.
    weights = torch.softmax(scores.masked_fill(~mask, torch.finfo(torch.float32).min), dim=-1).masked_fill(~mask, 0)
    if policy.attention_values_by_matmul:  # (see KernelPolicy: Inductor's 256-bit code gathered the values)
        return torch.matmul(weights, values.float()).to(q.dtype)
    return (weights.unsqueeze(-1) * values.float().unsqueeze(-3)).sum(-2).to(q.dtype)
