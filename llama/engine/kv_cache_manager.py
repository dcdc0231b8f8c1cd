"""The KV cache's slots and what each holds.

The engine's cache has one row per slot (``max_batch_size``).  A running request holds a
slot; a free slot keeps the tokens its row still holds, so that a later request whose
prompt starts with them (the next turn of a chat, a shared system prompt) prefills only
the rest.  Prefixes are shared only within a *scope* (``RequestSettings.cache_scope``):
requests of different scopes never reuse each other's tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn


class KVCacheManager:
    """Owns the engine's KV cache (``cache``: one :class:`~llama.layers.kv_cache.KVCache`
    per layer, a row per slot) and the record of each row's tokens and scope."""

    def __init__(self, cache: nn.ModuleList, n_slots: int) -> None:
        self.cache = cache
        self.n_slots = n_slots
        self._tokens: list[list[int]] = [[] for _ in range(n_slots)]  # what each row holds, in order
        self._scope: list[Optional[str]] = [None] * n_slots  # whose tokens they are

    def choose_slot(self, prompt: Sequence[int], scope: Optional[str], free: Sequence[int],
                    reuse: bool = True) -> tuple[int, int]:
        """(slot, prompt tokens to reuse) for a request: the free slot of its scope whose row
        holds the longest prefix of ``prompt`` (reusing all of it but the prompt's last
        token, whose logits are needed); when none helps (or ``reuse`` is False), the lowest
        free slot that holds nothing, else the lowest (keeping the decoded rows
        contiguous while sparing what other slots hold for later requests)."""
        empty = [slot for slot in free if not self._tokens[slot]]
        best_slot, best = min(empty or free), 0
        if reuse:
            for slot in free:
                if self._scope[slot] != scope:
                    continue
                n = 0
                for a, b in zip(self._tokens[slot], prompt):
                    if a != b:
                        break
                    n += 1
                n = min(n, len(prompt) - 1)
                if n > best:
                    best_slot, best = slot, n
        return best_slot, best

    def assign(self, slot: int, reused: int, scope: Optional[str]) -> None:
        """``slot`` now belongs to a request of ``scope`` that keeps its first ``reused`` tokens."""
        self._tokens[slot] = self._tokens[slot][:reused]
        self._scope[slot] = scope

    def record(self, slot: int, tokens: Sequence[int], start: int) -> None:
        """``tokens`` were written to ``slot``'s row from position ``start``."""
        held = self._tokens[slot]
        del held[start:]
        held.extend(tokens)

    def forget(self, slot: int) -> None:
        """``slot``'s row holds nothing to reuse (its request failed: the row is not trusted)."""
        self._tokens[slot] = []

    def forget_all(self) -> None:
        """No row holds anything to reuse (a step failed part-way)."""
        self._tokens = [[] for _ in range(self.n_slots)]
