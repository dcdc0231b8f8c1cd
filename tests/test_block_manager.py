"""The paged KV cache's block accounting (llama.engine.block_manager), on its own: random
interleavings of requests arriving (with prefix-cache hits), growing, writing, finishing and a
failed step, checked after every operation against a shadow record of what each block holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama.engine.block_manager import SCRATCH_BLOCK, BlockManager

BS = 4


class Shadow:
    """Requests as the engine keeps them, and what each block's slots were written with."""

    def __init__(self, manager: BlockManager) -> None:
        self.m = manager
        self.requests: dict[int, dict] = {}
        self.content: dict[int, list] = {}  # block -> the tokens written in it, slot by slot
        self.next_id = 0
        self.finished: list[list[int]] = []  # what each finished request wrote: a next turn goes on from it

    def admit(self, prompt: list[int], scope: str) -> None:
        hits = self.m.match(prompt, scope, len(prompt) - 1)
        for k, block in enumerate(hits):  # a hit holds exactly the prompt's tokens there
            assert self.content[block] == prompt[k * BS : (k + 1) * BS]
        source, n = self.m.match_partial(prompt, scope, hits, len(prompt) - 1)
        k = len(hits)
        if source is None:
            assert n == 0
        else:  # a cached block that goes on as the prompt does, for its first n < BS slots exactly
            assert n < BS and self.content[source][:n] == prompt[k * BS : k * BS + n]
            assert n >= self.m.min_partial or n == len(self.content[source])  # under half a block: all it holds
            assert (n == len(prompt) - 1 - k * BS or n == len(self.content[source])  # the limit; a partial block
                    or self.content[source][n] != prompt[k * BS + n])
            copied = self.content[source][:n]
        # as the engine does: a partly written block the prompt goes on from where it ends, held by
        # no one, is claimed and written on in place; any other match is copied into a new block
        claim = source if n and self.m.claimable(source, n) else None
        table = self.m.take(hits, self.m.blocks_for(len(prompt)) - len(hits) - (claim is not None), claim=claim)
        if table is None:
            return
        if claim is not None:
            assert table[k] == claim and self.m.match_partial(prompt, scope, hits, len(prompt) - 1) != (claim, n)
        if n:
            self.content[table[k]] = list(copied)  # the engine copies those slots into its own block
        self.requests[self.next_id] = {"tokens": list(prompt), "table": table, "written": k * BS + n,
                                       "uids": [], "scope": scope}
        self.next_id += 1

    def write(self, rid: int) -> None:
        """The request's tokens written so far go into its blocks; the full ones are cached."""
        r = self.requests[rid]
        for pos in range(r["written"], len(r["tokens"])):
            block = r["table"][pos // BS]
            slots = self.content.setdefault(block, [])
            if pos % BS == 0:
                slots.clear()
            assert len(slots) == pos % BS, "a shared block written again"
            slots.append(r["tokens"][pos])
        r["written"] = len(r["tokens"])
        self.m.register(r["table"], r["uids"], r["tokens"], r["written"], r["scope"])

    def generate(self, rid: int, token: int) -> None:
        r = self.requests[rid]
        if self.m.grow(r["table"], len(r["tokens"]) + 1):
            r["tokens"].append(token)

    def finish(self, rid: int) -> None:
        """The request ends; what it wrote into a last, partly written block stays cached."""
        r = self.requests.pop(rid)
        self.finished.append(r["tokens"][: r["written"]])
        k, n = divmod(r["written"], BS)
        if n and len(r["uids"]) == k:
            assert self.content[r["table"][k]] == r["tokens"][k * BS : k * BS + n]
            self.m.cache_partial(r["table"][k], r["uids"][k - 1] if k else None, r["tokens"][k * BS : k * BS + n],
                                 r["scope"])
        self.m.release(r["table"])

    def check(self) -> None:
        self.m.check([r["table"] for r in self.requests.values()])


ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=14), st.sampled_from("ab")),
    st.tuples(st.just("write"), st.integers(0, 30)),
    st.tuples(st.just("generate"), st.integers(0, 30), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("fail_step"),),
    # a finished request's next turn: what it wrote, then new tokens
    st.tuples(st.just("next_turn"), st.integers(0, 30), st.lists(st.integers(0, 2), min_size=1, max_size=6),
              st.sampled_from("ab")),
), min_size=20, max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=ops, n_blocks=st.integers(2, 12))
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_random_interleavings_never_leak_or_share_wrongly(ops, n_blocks):
    shadow = Shadow(BlockManager(n_blocks, BS))
    for op in ops:
        ids = sorted(shadow.requests)
        if op[0] == "admit":
            shadow.admit(op[1], op[2])
        elif op[0] == "fail_step":
            shadow.m.forget_all()
        elif op[0] == "next_turn":
            if shadow.finished:
                shadow.admit(shadow.finished[op[1] % len(shadow.finished)] + op[2], op[3])
        elif ids:
            rid = ids[op[1] % len(ids)]
            if op[0] == "write":
                shadow.write(rid)
            elif op[0] == "generate":
                shadow.generate(rid, op[2])
            else:
                shadow.finish(rid)
        shadow.check()
    for rid in list(shadow.requests):
        shadow.finish(rid)
    shadow.check()
    assert shadow.m.available == shadow.m.usable  # every block is back: free or cached


def test_a_shared_prefix_is_held_not_copied_and_scopes_never_share():
    m = BlockManager(10, BS)
    shadow = Shadow(m)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    shadow.admit(system + [9, 9], "a")
    shadow.write(0)
    assert m.cached == 2  # the two full blocks
    shadow.admit(system + [7], "a")  # hits both while the first still runs
    assert shadow.requests[1]["table"][:2] == shadow.requests[0]["table"][:2]
    shadow.admit(system + [7], "b")  # another scope: no hit
    assert not set(shadow.requests[2]["table"]) & set(shadow.requests[0]["table"])
    assert m.match(system + [7], "a", 8) == shadow.requests[0]["table"][:2]
    assert m.match(system, "a", 7) == shadow.requests[0]["table"][:1]  # a limit cuts within a block
    shadow.check()
    for rid in (0, 1, 2):
        shadow.finish(rid)
    assert m.match(system + [0], "a", 8) and m.available == m.usable  # finished: still cached, unheld
    shadow.check()


def test_cached_blocks_are_reused_least_recently_used_first():
    m = BlockManager(4, BS)  # 3 usable blocks
    for tokens in ([1] * BS, [2] * BS, [3] * BS):
        (block,) = m.take((), 1)
        m.register([block], [], tokens, BS, None)
        m.release([block])
    assert m.available == 3 and m.cached == 3
    m.match([1] * BS + [0], None, BS)  # matching alone does not refresh
    (hit,) = m.match([2] * BS + [0], None, BS)
    table = m.take([hit], 0)
    m.release(table)  # [2] is now the most recently used
    new = m.take((), 2)
    assert m.match([2] * BS + [0], None, BS) == [hit] and not m.match([1] * BS + [0], None, BS)
    assert hit not in new and SCRATCH_BLOCK not in new
    assert m.take((), 2) is None and m.take((), 1) is not None  # then the last one, [2]'s block
    with pytest.raises(RuntimeError, match="released more often"):
        m.release([hit, hit, hit])


def test_a_prompt_that_goes_on_mid_block_finds_the_cached_block_that_begins_most_like_it():
    m = BlockManager(10, BS)
    first = m.take((), 2)
    m.register(first, [], [1, 2, 3, 4, 5, 6, 7, 8], 8, "a")
    second = m.take(first[:1], 1)
    m.register(second, [], [1, 2, 3, 4, 5, 6, 0, 0], 8, "a")
    hits = m.match([1, 2, 3, 4, 5, 6, 7, 9, 9], "a", 8)
    assert hits == first[:1]
    assert m.match_partial([1, 2, 3, 4, 5, 6, 7, 9, 9], "a", hits, 8) == (first[1], 3)  # 5 6 7, not 5 6
    assert m.match_partial([1, 2, 3, 4, 5, 6, 0, 9], "a", hits, 8) == (second[1], 3)
    assert m.match_partial([1, 2, 3, 4, 5, 6, 7, 9, 9], "a", hits, 6) == (first[1], 2)  # the limit cuts it
    assert m.match_partial([1, 2, 3, 4, 5, 6, 7, 9, 9], "b", [], 8) == (None, 0)  # another scope
    assert m.match_partial([1, 2, 3, 4, 9, 6, 7], "a", hits, 6) == (None, 0)  # no block begins with 9
    assert m.match_partial([1, 2, 3, 4], "a", hits, 3) == (None, 0)  # nothing left within the limit
    assert m.match_partial([1, 2, 3, 4, 5, 9, 9, 9], "a", hits, 8) == (None, 0)  # 1 slot: under half a block
    (end,) = m.take(hits, 1)[1:]
    m.cache_partial(end, m._uid[hits[0]], [5], "a")  # a request that wrote one token there
    m.release(hits + [end])
    assert m.match_partial([1, 2, 3, 4, 5, 9, 9, 9], "a", hits, 8) == (end, 1)  # all it holds: its next turn
    m.release(first + second)
    m.uncache([first[1]])  # gone from the cache: no longer found
    assert m.match_partial([1, 2, 3, 4, 5, 6, 7, 9, 9], "a", hits, 8) == (second[1], 2)
    m.check([])
