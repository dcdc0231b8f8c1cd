"""The engine's paged KV cache: the pool of blocks, each request's block table, and the
prefix cache shared by every request (:mod:`llama.engine.block_manager`).

A request holds blocks for the tokens it has, not ``max_seq_len``; a new request's prompt
reuses every cached block it begins with, written by any earlier or running request of
its scope (``RequestSettings.cache_scope`` and its LoRA adapter: ``RequestSettings.prefix_scope``),
and prefills only the rest.  A block that holds
an image's positions is keyed by the image's digest too
(:func:`llama.engine.requests.keyed_tokens`): the same text with another image shares none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, cast

import numpy as np
import torch
from torch import nn

from llama.engine.block_manager import SCRATCH_BLOCK, BlockManager
from llama.engine.requests import RunningRequest

if TYPE_CHECKING:
    from llama.layers.kv_cache import KVCache


@dataclass
class _Table:
    """One request's blocks, as the manager keeps them."""

    blocks: list[int]  # its block table: the blocks of its positions, in order
    uids: list[int] = field(default_factory=list)  # the prefix-cache ids of its full blocks' contents
    n_hit: int = 0  # its first blocks, found in the prefix cache when it started


class KVCacheManager:
    """Owns the engine's KV cache (``cache``: one :class:`~llama.layers.kv_cache.KVCache` per
    layer, a pool of ``n_blocks`` blocks of ``block_size`` tokens, block 0 the scratch
    block) and who holds which blocks: each request's block table, kept here under its id (as
    vLLM's manager keeps them), never on the request.  Every rank makes the same calls in the
    same order and so holds the same tables."""

    def __init__(self, cache: nn.ModuleList, n_blocks: int, block_size: int, max_seq_len: int) -> None:
        self.cache = cache
        self.block_size = block_size
        self.blocks = BlockManager(n_blocks, block_size)
        # A table's width: every position up to the scratch position max_seq_len, whose
        # entry (beyond any request's blocks) is the scratch block.
        self.table_width = max_seq_len // block_size + 1
        self._tables: dict[int, _Table] = {}  # by request id: the requests that hold blocks

    @property
    def capacity(self) -> int:
        """Tokens the pool holds (the scratch block aside)."""
        return self.blocks.usable * self.block_size

    def start(self, request: RunningRequest, reuse: bool) -> Optional[int]:
        """Give ``request`` blocks for what it must feed before its next token (its
        context, :meth:`RunningRequest.context`), reusing what the prefix cache holds of its
        context (all but its last token, whose logits are needed) when ``reuse``: the
        cached blocks it begins with, then the first slots of a cached block that goes on
        as it does, copied into its own next block (or that block itself, where it is the
        partly written last block of a request the context continues, and no one holds it).
        Returns how many tokens of its context the blocks hold already; None (holding
        nothing) when there are not enough blocks."""
        context = request.cache_keyed(request.context())
        scope, limit = request.settings.prefix_scope, len(context) - 1
        hits = self.blocks.match(context, scope, limit) if reuse else []
        source, n_copied = self.blocks.match_partial(context, scope, hits, limit) if reuse else (None, 0)
        n_new = self.blocks.blocks_for(len(context) + 1) - len(hits)
        # A partly written block that the context goes on from where it ends (its chat's next
        # turn), held by no one, becomes this request's own to write on in place: no copy, and
        # the request's blocks stay consecutive where they were.
        claim = source if source is not None and n_copied and self.blocks.claimable(source, n_copied) else None
        blocks = self.blocks.take(hits, n_new - (claim is not None), claim=claim)
        if blocks is None:
            return None
        if n_copied and claim is None:
            # Copied now, before any forward pass writes a slot: even if take() just handed the
            # source block out again (evicted, least recently used), it still holds them.
            bs = self.block_size
            for layer_cache in cast("Iterable[KVCache]", self.cache):
                layer_cache.copy_slots(cast(int, source) * bs, blocks[len(hits)] * bs, n_copied)  # n_copied: a source
        table = self._tables[request.id] = _Table(blocks, n_hit=len(hits))
        n_cached = len(hits) * self.block_size + n_copied
        self.blocks.register(blocks, table.uids, context, n_cached, scope)
        return n_cached

    def grow(self, request_id: int, n_tokens: int) -> bool:
        """Give the request blocks for ``n_tokens`` tokens; False if there are not enough."""
        return self.blocks.grow(self._tables[request_id].blocks, n_tokens)

    def trim(self, request_id: int, n_tokens: int) -> None:
        """Give back the request's blocks beyond those its first ``n_tokens`` tokens take: after
        a step that verified proposals, the blocks that hold only positions it did not keep
        (never in the prefix cache: a block enters it once all of its tokens are kept)."""
        table = self._tables[request_id]
        keep = self.blocks.blocks_for(n_tokens)
        if len(table.blocks) > keep:
            if len(table.uids) > keep:
                raise RuntimeError(f"request {request_id}: a block it entered in the prefix cache was to be trimmed")
            extra = table.blocks[keep:]
            del table.blocks[keep:]
            self.blocks.release(extra)

    def held(self, request_id: int) -> int:
        """How many blocks the request holds."""
        table = self._tables.get(request_id)
        return len(table.blocks) if table is not None else 0

    def cache_blocks(self, request: RunningRequest) -> None:
        """``request``'s first ``n_fed`` tokens are in its blocks: enter the full ones in the
        prefix cache (the tokens are gathered only when a block has just filled: every
        block_size-th step)."""
        table = self._tables[request.id]
        if request.n_fed // self.block_size > len(table.uids):
            self.blocks.register(table.blocks, table.uids, request.cache_keyed(request.tokens_so_far()), request.n_fed,
                                 request.settings.prefix_scope)

    def free(self, request: RunningRequest, keep: bool = True) -> None:
        """``request`` holds its blocks no more (if it held any): its full ones stay cached and,
        with ``keep``, so does what it wrote into its last block, for a prompt that goes on the
        same way (its chat's next turn; itself, resumed after a preemption)."""
        table = self._tables.pop(request.id, None)
        if table is None:
            return
        bs, n = self.block_size, request.n_fed
        if keep and n % bs and len(table.uids) == n // bs and len(table.blocks) > n // bs:
            k = n // bs  # the partly written block: the request's own (hits are whole blocks)
            self.blocks.cache_partial(table.blocks[k], table.uids[k - 1] if k else None,
                                      request.cache_keyed(request.tokens_so_far())[k * bs : n],
                                      request.settings.prefix_scope)
        self.blocks.release(table.blocks)

    def fail(self, request: RunningRequest) -> None:
        """``request`` failed: what it wrote is not trusted (its keys and values may not be
        finite), so the blocks it entered in the prefix cache leave it; it holds none."""
        table = self._tables.get(request.id)
        if table is not None:
            self.blocks.uncache(table.blocks[table.n_hit :])
        self.free(request, keep=False)

    def block_ids(self, request_id: int) -> list[int]:
        """The request's block table: its blocks, in the order of its positions (a copy;
        empty where it holds none)."""
        table = self._tables.get(request_id)
        return list(table.blocks) if table is not None else []

    def next_block_key(self, request: RunningRequest) -> Optional[tuple]:
        """The prefix-cache key of the first block of ``request``'s context it has not
        entered in the cache, if its context fills that block (None: it does not)."""
        table = self._tables.get(request.id)
        if table is None:
            return None
        context, bs, k = request.cache_keyed(request.context()), self.block_size, len(table.uids)
        if (k + 1) * bs > len(context):
            return None
        return self.blocks.key_after(table.uids[-1] if k else None, context[k * bs : (k + 1) * bs],
                                     request.settings.prefix_scope)

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
        tables = self._tables
        rows = []
        for r in requests:
            blocks = tables[r.id].blocks if r is not None else []
            rows.append(blocks + [SCRATCH_BLOCK] * (width - len(blocks)))
        return torch.tensor(rows, dtype=torch.long).view(-1, width).to(device)  # made at once from lists

    def write_block_table(self, requests: Sequence[Optional[RunningRequest]], out: np.ndarray) -> None:
        """:meth:`block_table`'s tables written into ``out`` (len(requests), table_width) int64,
        in place (a view of a pinned buffer: :mod:`llama.engine.staging`)."""
        out.fill(SCRATCH_BLOCK)
        for row, request in enumerate(requests):
            if request is not None and (blocks := self._tables[request.id].blocks):
                out[row, : len(blocks)] = blocks
