"""The KV cache: one attention layer's keys and values, as a module of two buffers.

A cache has ``rows`` sequences of ``max_seq_len`` positions plus one *scratch* position
(index ``max_seq_len``): the padding tokens of a ragged step are written there, so they
never touch a row's real positions.  Whoever runs the model owns its caches and passes
them in: the engine one set with a row per slot (:meth:`llama.model.Transformer.new_kv_cache`),
``Transformer.forward`` (Meta's call, without an engine) a set of its own, made on first use.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of one attention layer: ``k`` and ``v`` (rows, Hkv, max_seq_len + 1, D)."""

    def __init__(self, rows: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        shape = (rows, n_kv_heads, max_seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rows: Optional[torch.Tensor] = None) -> None:
        """Store k and v (B, T, Hkv, D) of tokens at ``positions`` (B, T) in cache rows ``rows``
        (B,) (default 0..B-1).  Indexing (B, Hkv, S, D) with rows (B, 1) and positions (B, T)
        around the head slice addresses a (B, T, Hkv, D) block: k's own layout, no transpose."""
        index = (torch.arange(k.shape[0], device=k.device) if rows is None else rows).unsqueeze(1)
        self.k[index, :, positions] = k
        self.v[index, :, positions] = v

    def read(self, batch: int, kv_len: int, rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, Hkv, kv_len, D) of positions [0, kv_len): of rows 0..batch-1 (a
        view, no copy), or of ``rows`` (B,) gathered (a copy)."""
        if rows is None:
            return self.k[:batch, :, :kv_len], self.v[:batch, :, :kv_len]
        return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]


def kv_cache_bytes(n_layers: int, rows: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes of a model's caches (every layer's K and V, scratch position included)."""
    return 2 * n_layers * rows * (max_seq_len + 1) * n_kv_heads * head_dim * dtype.itemsize
