"""The KV cache: one attention layer's keys and values, in blocks of token slots.

A cache holds ``n_blocks`` blocks of ``block_size`` token slots.  Which blocks hold a
sequence's positions is its *block table*: row ``b`` of a ``(B, W)`` table lists the
blocks of batch row ``b``, position ``p`` living in slot ``p % block_size`` of block
``table[b, p // block_size]``.  Two layouts use it:

* one block per sequence (``block_size = max_seq_len + 1``, table ``[[row]]``): what
  ``Transformer.forward`` (Meta's call, without an engine) keeps, a row per sequence whose
  last slot (position ``max_seq_len``) is the *scratch* slot that padding tokens write;
* a pool of small blocks shared by every request (the engine's paged cache,
  :mod:`llama.engine.block_manager`): a request holds blocks for the tokens it has, and
  full blocks are shared between requests whose tokens begin the same way.  Block 0 is
  the scratch block: table entries a request does not use point to it, so padding tokens
  write there and never touch a request's positions.

Whoever runs the model owns its caches and passes them in.  :func:`cache_slots` turns a
block table and positions into slot indices, once per forward pass; each layer's
:meth:`KVCache.write` and :meth:`KVCache.read` then index its buffers with them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of one attention layer: ``k`` and ``v`` (n_blocks * block_size, Hkv, D),
    one row per token slot."""

    k: torch.Tensor  # buffers (register_buffer), typed for the type checker
    v: torch.Tensor

    def __init__(self, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.n_blocks = n_blocks
        self.block_size = block_size
        shape = (n_blocks * block_size, n_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k and v (B, T, Hkv, D) of tokens in ``slots`` (B, T)."""
        self.k[slots] = k
        self.v[slots] = v

    def copy_slots(self, source: int, dest: int, n: int) -> None:
        """Copy the keys and values of slots ``source .. source + n - 1`` to ``dest ..``."""
        self.k[dest : dest + n] = self.k[source : source + n]
        self.v[dest : dest + n] = self.v[source : source + n]

    def read(self, slots: torch.Tensor, start: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, Hkv, S, D) of ``slots`` (B, S), gathered; or, given ``start``
        (:func:`consecutive_start`: one row, its slots start, start + 1, ...), read in place."""
        if start is not None:
            n = slots.shape[1]
            return self.k[start : start + n].unsqueeze(0).transpose(1, 2), \
                self.v[start : start + n].unsqueeze(0).transpose(1, 2)
        # Rows gathered from a 2-D view, (slots, Hkv * D), by index_select: on the CPU indexing
        # with the (B, S) slots (``k[slots]``) took 1.3-7.6x as long for 1 to 15 rows of 192 to
        # 1,016 positions (BENCHMARKS.md, "Paged KV cache").
        flat, shape = slots.reshape(-1), (*slots.shape, *self.k.shape[1:])
        keys = self.k.view(self.k.shape[0], -1).index_select(0, flat).view(shape)
        values = self.v.view(self.v.shape[0], -1).index_select(0, flat).view(shape)
        return keys.transpose(1, 2), values.transpose(1, 2)


def cache_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots (same shape as ``positions``, (B, T)) of ``positions`` in the blocks of
    ``block_table`` (B, W)."""
    return block_table.gather(1, positions // block_size) * block_size + positions % block_size


def context_slots(block_table: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    """The slots (B, kv_len) of positions ``0 .. kv_len - 1`` of each row of ``block_table``."""
    positions = torch.arange(kv_len, device=block_table.device)
    return block_table[:, positions // block_size] * block_size + positions % block_size


def consecutive_start(slots: torch.Tensor) -> Optional[int]:
    """The first of ``slots`` (1, S) where they are consecutive (a request alone in the pool holds
    consecutive blocks: :mod:`llama.engine.block_manager` hands out the lowest free block
    first), so that :meth:`KVCache.read` reads them in place instead of gathering them (on the
    CPU, gathering a context of 1,024 to 4,096 positions took 2.1x the time of attention over
    it read in place: BENCHMARKS.md, "Paged KV cache").  None for several rows, slots that are
    not consecutive, or where the check would wait for the device or break a compiled graph:
    there the slots are gathered."""
    if slots.shape[0] != 1 or slots.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    start = int(slots[0, 0])
    return start if torch.equal(slots[0], torch.arange(start, start + slots.shape[1])) else None


def kv_cache_bytes(n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of a model's caches of ``n_slots`` token slots (every layer's K and V)."""
    return 2 * n_layers * n_slots * n_kv_heads * head_dim * dtype.itemsize
