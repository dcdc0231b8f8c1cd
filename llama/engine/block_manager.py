"""The paged KV cache's blocks: which are free, which each request holds, and the prefix cache.

The cache is a pool of blocks of ``block_size`` token slots (:mod:`llama.layers.kv_cache`);
block 0 is the scratch block, never handed out.  A request holds a *block table*: the
blocks of its positions in order, as many as its tokens need, growing as it generates.

A block whose ``block_size`` tokens are all written is *full*, and its contents are
known exactly by the tokens before and in it.  Full blocks are entered in the prefix
cache under a key of (the key of the block before, its tokens, the request's cache
scope), as vLLM's prefix caching does: a new request whose prompt begins with the same
tokens, in the same scope, holds those blocks too instead of computing them again,
whether the request that wrote them is still running or long finished.  A full block is
never written again, so sharing needs no copies.  When no request holds a cached block
it stays cached, and is reused for new tokens only when no block is free, least
recently used first.  Requests of different scopes (``cache_salt``, API keys) never
share a block.

Where a prompt goes on past its last whole cached block with some of the tokens of a
cached block that follows it (clients whose shared system prompt ends mid-block; a chat's
next turn, whose history ends in the last, partly written block of the request that
answered it, kept in the cache when that request ended: :meth:`BlockManager.cache_partial`),
those tokens' keys and values are *copied* from that block into the request's own new
block (:meth:`BlockManager.match_partial`) instead of being computed again, as SGLang's
token-granular radix cache reuses them.  A next turn that goes on from exactly where such a
last block ends, with no one else holding it, takes the block over instead (``claim`` in
:meth:`BlockManager.take`): it leaves the cache, and the turn writes on in it.  Nothing is
ever written while it is cached.

Every rank keeps its own manager and makes the same calls in the same order, so every
rank holds the same tables; nothing here reads the device.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict
from typing import Hashable, Optional, Sequence, cast

logger = logging.getLogger(__name__)

__all__ = ["BlockManager", "SCRATCH_BLOCK"]

SCRATCH_BLOCK = 0
# The key of the block "before" a sequence's first block.
_ROOT = 0


class BlockManager:
    """Free blocks, reference counts and the prefix cache of a pool of ``n_blocks`` blocks
    (block 0, the scratch block, included and never handed out)."""

    def __init__(self, n_blocks: int, block_size: int) -> None:
        if n_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is scratch), got {n_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.n_blocks = n_blocks
        self.block_size = block_size
        # Blocks that hold nothing worth keeping, as a heap: the lowest is handed out first, so
        # that a request alone in the pool holds consecutive blocks, which the model reads in
        # place rather than gathered (llama.model.Transformer.hidden_states).
        self._free: list[int] = list(range(1, n_blocks))
        self._refs = [0] * n_blocks  # requests holding each block
        self._key: list[Optional[tuple]] = [None] * n_blocks  # a cached block's prefix-cache key
        self._uid = [0] * n_blocks  # a cached block's contents' id: what the key of the next block names
        self._index: dict[tuple, int] = {}  # prefix-cache key -> block
        # (parent uid, scope, first token) -> the cached blocks under that key prefix: where
        # match_partial looks for a block that begins as a prompt goes on
        self._children: dict[tuple, dict[int, None]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by no request; oldest first
        self._uids = itertools.count(1)
        self.hits = 0  # blocks handed out from the cache (statistics)
        # The fewest slots match_partial copies: half a block.  Most prompts begin alike for a
        # token or two (BOS, a chat header): copying those would save next to nothing, yet
        # make nearly every request a prefix-cache hit in the statistics.
        self.min_partial = max(1, block_size // 2)

    # -- what there is -------------------------------------------------------------------

    @property
    def usable(self) -> int:
        """Blocks a request may hold (all but the scratch block)."""
        return self.n_blocks - 1

    @property
    def available(self) -> int:
        """Blocks that can be handed out now: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def free(self) -> int:
        """Blocks that hold nothing worth keeping (handed out before any cached one)."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Blocks some request holds."""
        return self.usable - self.available

    @property
    def cached(self) -> int:
        """Blocks in the prefix cache (held or not)."""
        return len(self._index)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that ``n_tokens`` tokens take."""
        return -(-n_tokens // self.block_size)

    # -- the prefix cache ------------------------------------------------------------------

    def _key_of(self, parent_uid: int, tokens: Sequence[int], scope: Hashable) -> tuple:
        return (parent_uid, tuple(tokens), scope)

    def match(self, tokens: Sequence[int], scope: Hashable, limit: int) -> list[int]:
        """The cached blocks holding the longest run of whole blocks that ``tokens`` begins
        with (at most ``limit`` tokens), in ``scope``; none are taken yet."""
        blocks: list[int] = []
        parent = _ROOT
        bs = self.block_size
        for k in range(min(limit, len(tokens)) // bs):
            block = self._index.get(self._key_of(parent, tokens[k * bs : (k + 1) * bs], scope))
            if block is None:
                break
            blocks.append(block)
            parent = self._uid[block]
        return blocks

    def match_partial(self, tokens: Sequence[int], scope: Hashable, hits: Sequence[int],
                      limit: int) -> tuple[Optional[int], int]:
        """A cached block whose first tokens are the most of those that ``tokens`` goes on with
        after its cached blocks ``hits`` (:meth:`match`), within ``limit`` tokens, in ``scope``:
        ``(block, n)``, its first ``n`` slots holding what ``tokens`` would compute there
        (``(None, 0)``: no cached block begins that way).  ``n`` < ``block_size``, else it
        would have been a hit; ``n`` >= :attr:`min_partial` (fewer is not worth a copy), unless
        ``tokens`` goes on from where a partly written block (:meth:`cache_partial`) ends."""
        k, bs = len(hits), self.block_size
        want = tokens[k * bs : min(limit, len(tokens), (k + 1) * bs)]
        if not want:
            return None, 0
        parent = self._uid[hits[-1]] if hits else _ROOT
        best, best_n, best_whole = None, 0, False
        for block in self._children.get((parent, scope, want[0]), ()):
            cached = cast(tuple, self._key[block])[1]  # block_size tokens, or fewer (cache_partial)
            n, most = 1, min(len(want), len(cached))
            while n < most and cached[n] == want[n]:
                n += 1
            whole = n == len(cached)
            if n > best_n or (n == best_n and whole and not best_whole):
                best, best_n, best_whole = block, n, whole
        # (all of a partly written block: its writer's next turn, whatever its length)
        return (best, best_n) if best_n >= self.min_partial or best_whole else (None, 0)

    def next_key(self, tokens: Sequence[int], scope: Hashable, hits: Sequence[int], limit: int) -> Optional[tuple]:
        """The prefix-cache key of the block of ``tokens`` after its cached blocks ``hits``
        (:meth:`match`), if that block is whole within ``limit`` tokens; else None."""
        k, bs = len(hits), self.block_size
        if (k + 1) * bs > min(limit, len(tokens)):
            return None
        return self.key_after(self._uid[hits[-1]] if hits else None, tokens[k * bs : (k + 1) * bs], scope)

    def key_after(self, parent_uid: Optional[int], tokens: Sequence[int], scope: Hashable) -> tuple:
        """The prefix-cache key of a block holding ``tokens`` after the block whose contents'
        id is ``parent_uid`` (None: the first block)."""
        return self._key_of(_ROOT if parent_uid is None else parent_uid, tokens, scope)

    def register(self, table: Sequence[int], uids: list[int], tokens: Sequence[int], n_written: int,
                 scope: Hashable) -> None:
        """Enter the blocks of ``table`` that ``n_written`` written tokens (of ``tokens``, the
        sequence's) fill, beyond the ``len(uids)`` entered before, in the prefix cache.
        ``uids`` (the sequence's: the contents' id of each full block, in order) grows by
        one per block.  A block whose contents are cached already (another request wrote
        the same tokens) is left out; the cached one's id stands for it."""
        bs = self.block_size
        for k in range(len(uids), n_written // bs):
            block = table[k]
            key = self._key_of(uids[k - 1] if k else _ROOT, tokens[k * bs : (k + 1) * bs], scope)
            existing = self._index.get(key)
            if existing is not None:
                uids.append(self._uid[existing])
                continue
            if self._key[block] is not None:  # a block from the cache: already entered, under this key
                uids.append(self._uid[block])
                continue
            self._key[block], self._uid[block] = key, next(self._uids)
            self._index[key] = block
            self._children.setdefault(_family(key), {})[block] = None
            uids.append(self._uid[block])

    def cache_partial(self, block: int, parent_uid: Optional[int], tokens: Sequence[int], scope: Hashable) -> None:
        """Enter ``block``, whose first ``len(tokens)`` (< block_size) slots hold ``tokens``
        after the block whose contents' id is ``parent_uid`` (None: the first block), where
        :meth:`match_partial` finds it: what a request wrote into its last block before it
        ended, for a prompt that goes on the same way (a chat's next turn).  It is never a
        hit for :meth:`match` (only whole blocks are); it is cached, unheld once released, and
        evicted or claimed (:meth:`take`) like any cached block.  Left out where the same is
        cached already."""
        if not 0 < len(tokens) < self.block_size:
            raise ValueError(f"a partly written block holds 1 to {self.block_size - 1} tokens, not {len(tokens)}")
        key = self.key_after(parent_uid, tokens, scope)
        if key in self._index or self._key[block] is not None:
            return
        self._key[block], self._uid[block] = key, next(self._uids)
        self._index[key] = block
        self._children.setdefault(_family(key), {})[block] = None

    # -- holding blocks --------------------------------------------------------------------

    def take(self, hits: Sequence[int], n_new: int, claim: Optional[int] = None) -> Optional[list[int]]:
        """Hold the cached blocks ``hits``, then ``claim`` (a cached block no request holds,
        which leaves the cache to be written in; None: none), then ``n_new`` new ones; None
        (holding nothing) if there are not enough.  New blocks come from the free ones, lowest
        first, then from the cached ones no request holds, least recently used first (leaving
        the cache)."""
        hits = list(hits)
        reusable = sum(1 for b in hits if self._refs[b] == 0)  # evictable now, held after
        if claim is not None:
            if self._refs[claim] or claim not in self._evictable or claim in hits:
                raise RuntimeError(f"block {claim} is not a cached block free to claim")
            reusable += 1
        if n_new > self.available - reusable:
            return None
        for block in hits:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        self.hits += len(hits)
        if claim is not None:
            del self._evictable[claim]
            self._drop_key(claim)
            self._refs[claim] = 1
            hits.append(claim)
        return hits + [self._new_block() for _ in range(n_new)]

    def _new_block(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            self._drop_key(block)
        self._refs[block] = 1
        return block

    def claimable(self, block: int, n_matched: int) -> bool:
        """Whether a prompt that matched ``n_matched`` tokens of the cached ``block``
        (:meth:`match_partial`) may take it over (``claim`` in :meth:`take`): it is a partly
        written block the prompt goes on from where it ends, and no request holds it."""
        return self._refs[block] == 0 and n_matched == len(cast(tuple, self._key[block])[1])  # a cached block

    def grow(self, table: list[int], n_tokens: int) -> bool:
        """Extend ``table`` with new blocks until it holds ``n_tokens`` tokens; False (and
        ``table`` unchanged) if there are not enough blocks."""
        need = self.blocks_for(n_tokens) - len(table)
        if need <= 0:
            return True
        new = self.take((), need)
        if new is None:
            return False
        table.extend(new)
        return True

    def release(self, table: Sequence[int]) -> None:
        """A request holds the blocks of ``table`` no more: cached ones stay cached (most
        recently used last), the others are free."""
        for block in table:
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} released more often than it was taken")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._key[block] is not None:
                    self._evictable[block] = None
                else:
                    heapq.heappush(self._free, block)

    def uncache(self, blocks: Sequence[int]) -> None:
        """Take ``blocks`` out of the prefix cache (what they hold is not trusted); those no
        request holds are free."""
        for block in blocks:
            self._drop_key(block)
            if block in self._evictable:
                del self._evictable[block]
                heapq.heappush(self._free, block)

    def forget_all(self) -> None:
        """Empty the prefix cache (a step failed part-way: what the blocks hold is not
        trusted); held blocks stay held."""
        for block in list(self._index.values()):
            self._drop_key(block)
        for block in list(self._evictable):
            del self._evictable[block]
            heapq.heappush(self._free, block)

    def _drop_key(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            del self._index[key]
            self._key[block] = None
            family = self._children[_family(key)]
            del family[block]
            if not family:
                del self._children[_family(key)]

    # -- checks ----------------------------------------------------------------------------

    def check(self, tables: Sequence[Sequence[int]]) -> None:
        """Raise AssertionError unless the pool is consistent with ``tables`` (every
        request's): each block is free, cached and unheld, or held as often as the tables
        list it; the scratch block is never anywhere.  For tests."""
        held: dict[int, int] = {}
        for table in tables:
            for block in table:
                held[block] = held.get(block, 0) + 1
        assert SCRATCH_BLOCK not in held and SCRATCH_BLOCK not in self._free and SCRATCH_BLOCK not in self._evictable
        assert len(set(self._free)) == len(self._free), "a block is free twice"
        for block in range(1, self.n_blocks):
            refs = held.get(block, 0)
            assert self._refs[block] == refs, f"block {block}: {self._refs[block]} holders counted, {refs} hold it"
            where = (block in self._free) + (block in self._evictable) + (refs > 0)
            assert where == 1, f"block {block} is in {where} places (free / cached unheld / held)"
            assert (block in self._evictable) <= (self._key[block] is not None)
            assert (block in self._free) <= (self._key[block] is None)
        for key, block in self._index.items():
            assert self._key[block] == key
            assert block in self._children[_family(key)]
        assert sum(map(len, self._children.values())) == len(self._index), "a stale entry in the children index"


def _family(key: tuple) -> tuple:
    """Where a block of prefix-cache ``key`` is listed for :meth:`BlockManager.match_partial`:
    its parent, its scope and its first token."""
    parent, tokens, scope = key
    return parent, scope, tokens[0]
