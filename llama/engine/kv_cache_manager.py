"""The engine's paged KV cache: the pool of blocks, each request's block table, and the
prefix cache shared by every request (:mod:`llama.engine.block_manager`).

A request holds blocks for the tokens it has, not ``max_seq_len``; a new request's prompt
reuses every cached block it begins with, written by any earlier or running request of
its scope (``RequestSettings.cache_scope``), and prefills only the rest.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from llama.engine.block_manager import SCRATCH_BLOCK, BlockManager
from llama.engine.requests import RunningRequest


class KVCacheManager:
    """Owns the engine's KV cache (``cache``: one :class:`~llama.layers.kv_cache.KVCache` per
    layer, a pool of ``n_blocks`` blocks of ``block_size`` tokens, block 0 the scratch
    block) and who holds which blocks.  Every rank makes the same calls in the same order
    and so holds the same tables."""

    def __init__(self, cache: nn.ModuleList, n_blocks: int, block_size: int, max_seq_len: int) -> None:
        self.cache = cache
        self.block_size = block_size
        self.blocks = BlockManager(n_blocks, block_size)
        # A table's width: every position up to the scratch position max_seq_len, whose
        # entry (beyond any request's blocks) is the scratch block.
        self.table_width = max_seq_len // block_size + 1

    @property
    def capacity(self) -> int:
        """Tokens the pool holds (the scratch block aside)."""
        return self.blocks.usable * self.block_size

    def start(self, request: RunningRequest, reuse: bool) -> bool:
        """Give ``request`` blocks for what it must feed before its next token (its
        context, :meth:`RunningRequest.context`), reusing what the prefix cache holds of its
        context (all but its last token, whose logits are needed) when ``reuse``: the
        cached blocks it begins with, then the first slots of a cached block that goes on
        as it does, copied into its own next block (or that block itself, where it is the
        partly written last block of a request the context continues, and no one holds it).
        Sets its ``blocks`` and ``n_fed``.
        False (holding nothing) when there are not enough blocks."""
        context = request.context()
        scope, limit = request.settings.cache_scope, len(context) - 1
        hits = self.blocks.match(context, scope, limit) if reuse else []
        source, n_copied = self.blocks.match_partial(context, scope, hits, limit) if reuse else (None, 0)
        n_new = self.blocks.blocks_for(len(context) + 1) - len(hits)
        # A partly written block that the context goes on from where it ends (its chat's next
        # turn), held by no one, becomes this request's own to write on in place: no copy, and
        # the request's blocks stay consecutive where they were.
        claim = source if n_copied and self.blocks.claimable(source, n_copied) else None
        table = self.blocks.take(hits, n_new - (claim is not None), claim=claim)
        if table is None:
            return False
        if n_copied and claim is None:
            # Copied now, before any forward pass writes a slot: even if take() just handed the
            # source block out again (evicted, least recently used), it still holds them.
            bs = self.block_size
            for layer_cache in self.cache:
                layer_cache.copy_slots(source * bs, table[len(hits)] * bs, n_copied)
        request.blocks, request.block_uids = table, []
        request.n_fed = len(hits) * self.block_size + n_copied
        request.n_hit_blocks = len(hits)
        self.blocks.register(table, request.block_uids, context, request.n_fed, request.settings.cache_scope)
        return True

    def grow(self, request: RunningRequest, n_tokens: int) -> bool:
        """Give ``request`` blocks for ``n_tokens`` tokens; False if there are not enough."""
        return self.blocks.grow(request.blocks, n_tokens)

    def written(self, request: RunningRequest) -> None:
        """``request``'s first ``n_fed`` tokens are in its blocks: enter the full ones in the
        prefix cache (the tokens are gathered only when a block has just filled: every
        block_size-th step)."""
        if request.n_fed // self.block_size > len(request.block_uids):
            self.blocks.register(request.blocks, request.block_uids, request.tokens_so_far(), request.n_fed,
                                 request.settings.cache_scope)

    def release(self, request: RunningRequest, keep: bool = True) -> None:
        """``request`` holds its blocks no more: its full ones stay cached and, with ``keep``,
        so does what it wrote into its last block, for a prompt that goes on the same way
        (its chat's next turn; itself, resumed after a preemption)."""
        bs, n = self.block_size, request.n_fed
        if keep and n % bs and len(request.block_uids) == n // bs and len(request.blocks) > n // bs:
            k = n // bs  # the partly written block: the request's own (hits are whole blocks)
            self.blocks.cache_partial(request.blocks[k], request.block_uids[k - 1] if k else None,
                                      request.tokens_so_far()[k * bs : n], request.settings.cache_scope)
        self.blocks.release(request.blocks)
        request.blocks, request.block_uids = [], []

    def fail(self, request: RunningRequest) -> None:
        """``request`` failed: what it wrote is not trusted (its keys and values may not be
        finite), so the blocks it entered in the prefix cache leave it; it holds none."""
        self.blocks.uncache(request.blocks[request.n_hit_blocks:])
        self.release(request, keep=False)

    def forget_all(self) -> None:
        """Nothing cached is trusted (a step failed part-way)."""
        self.blocks.forget_all()

    def whole_sequences(self, rows: int, device: torch.device) -> torch.Tensor:
        """Block tables (rows, table_width) giving each of ``rows`` sequences blocks for all of
        ``max_seq_len``, one after another, outside the books (for checks and benchmarks that
        drive the model directly; the engine's requests must not run meanwhile)."""
        per_row = self.table_width - 1
        if 1 + rows * per_row > self.blocks.n_blocks:
            raise ValueError(f"{rows} whole sequences need {rows * per_row} blocks; the pool has {self.blocks.usable}")
        table = torch.full((rows, self.table_width), SCRATCH_BLOCK, dtype=torch.long)
        table[:, :per_row] = 1 + torch.arange(rows * per_row).view(rows, per_row)
        return table.to(device)

    def block_table(self, requests: Sequence[Optional[RunningRequest]], device: torch.device) -> torch.Tensor:
        """The block tables (len(requests), table_width) of ``requests`` (None: a padding
        row, all scratch)."""
        width = self.table_width
        rows = [[SCRATCH_BLOCK] * width if r is None else r.blocks + [SCRATCH_BLOCK] * (width - len(r.blocks))
                for r in requests]
        return torch.tensor(rows, dtype=torch.long).view(-1, width).to(device)  # made at once from lists

    def write_block_table(self, requests: Sequence[Optional[RunningRequest]], out: np.ndarray) -> None:
        """:meth:`block_table`'s tables written into ``out`` (len(requests), table_width) int64,
        in place (a view of a pinned buffer: :mod:`llama.engine.staging`)."""
        out.fill(SCRATCH_BLOCK)
        for row, request in enumerate(requests):
            if request is not None and request.blocks:
                out[row, : len(request.blocks)] = request.blocks
