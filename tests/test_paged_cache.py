"""The engine's paged KV cache and its prefix cache, end to end on a random-weight Llama 3
checkpoint (float32, greedy unless said): requests hold blocks for the tokens they have, so many
more run together than slots of max_seq_len would allow; prompts that begin alike share blocks;
a pool too small for everyone preempts and resumes requests; every way a request ends gives its
blocks back.  References: each request run alone on a fresh model."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
from llama.engine import RequestSettings


def build(checkpoint, **kw):
    return helpers.build(checkpoint, **{"max_seq_len": 256, "max_batch_size": 4, "dtype": "float32",
                                        "compile": False, **kw})


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 250) for _ in range(n - 1)]


def solo(checkpoint, prompts, max_new_tokens: int, **settings) -> list[list[int]]:
    """Each prompt's greedy tokens, run alone on a fresh model."""
    out = []
    for p in prompts:
        engine = build(checkpoint).engine
        out.append(engine.submit(p, RequestSettings(max_new_tokens=max_new_tokens, temperature=0, **settings))
                   .result().tokens)
    return out


def all_blocks_back(engine) -> None:
    """No request runs, and every block is free or in the prefix cache, counted once."""
    assert not engine.scheduler.running and not engine.scheduler.preempted
    engine.kv.blocks.check([])
    assert engine.kv.blocks.available == engine.kv.blocks.usable


def run_steps(engine, handles) -> int:
    """Step the engine until every handle has finished; the most requests that ran at once."""
    most = 0
    while not all(h.finished for h in handles):
        engine.step()
        most = max(most, len(engine.scheduler.running))
        engine.kv.blocks.check([engine.kv.block_ids(r) for r in engine.scheduler.running])
    return most


@pytest.mark.slow  # 32 prompts of ~200 tokens, and each alone again: ~15 s
def test_requests_hold_blocks_for_their_tokens_so_many_decode_together(llama3_checkpoint):
    """A budget of 8 x 2048 tokens with max_batch_size 32: 32 requests of ~200 tokens all run at
    once (slots of max_seq_len would have held 8), each with the tokens it gets alone."""
    llama = build(llama3_checkpoint, max_seq_len=2048, max_batch_size=32, kv_cache_tokens=8 * 2048)
    engine = llama.engine
    prompts = [prompt(i, 190 + i) for i in range(32)]
    handles = [engine.submit(p, RequestSettings(max_new_tokens=12, temperature=0)) for p in prompts]
    assert run_steps(engine, handles) == 32
    some = list(range(0, 32, 4))  # each alone again: a sample, for time
    assert [handles[i].result().tokens for i in some] == solo(llama3_checkpoint, [prompts[i] for i in some], 12)
    assert engine.stats()["preemptions_total"] == 0
    all_blocks_back(engine)


@pytest.mark.slow
def test_a_pool_too_small_for_everyone_preempts_and_resumes(llama3_checkpoint):
    """A pool of max_seq_len tokens for four requests that together need twice as many: all
    complete, each with the tokens it gets alone (resumed requests prefill what they had)."""
    llama = build(llama3_checkpoint, kv_cache_tokens=256, kv_block_size=8)
    engine = llama.engine
    prompts = [prompt(10 + i, 40 + 9 * i) for i in range(4)]
    handles = [engine.submit(p, RequestSettings(max_new_tokens=90, temperature=0)) for p in prompts]
    run_steps(engine, handles)
    assert engine.stats()["preemptions_total"] > 0
    assert [h.result().tokens for h in handles] == solo(llama3_checkpoint, prompts, 90)
    all_blocks_back(engine)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_seeded_request_is_the_same_whatever_its_neighbours_and_the_cache(llama3_checkpoint):
    """Sampled with a seed, a request gives the same tokens alone, beside others that preempt it,
    and with its prefix from the cache."""
    settings = RequestSettings(max_new_tokens=60, temperature=1.0, seed=7)
    target = prompt(3, 70)
    alone = build(llama3_checkpoint).engine.submit(target, settings).result().tokens
    engine = build(llama3_checkpoint, kv_cache_tokens=256, kv_block_size=8).engine
    others = [engine.submit(prompt(20 + i, 60), RequestSettings(max_new_tokens=80, temperature=0)) for i in range(3)]
    crowded = engine.submit(target, settings)
    run_steps(engine, others + [crowded])
    assert engine.stats()["preemptions_total"] > 0
    cached = engine.submit(target, settings)
    assert cached.result().tokens == crowded.result().tokens == alone
    # all but the last token: 8 whole blocks of 8, then 5 slots copied from the block after them
    assert cached.result().n_cached_prompt_tokens == 69
    all_blocks_back(engine)


def test_prompts_that_begin_alike_share_blocks_within_a_scope_only(llama3_checkpoint):
    llama = build(llama3_checkpoint, kv_block_size=8)
    engine = llama.engine
    system = prompt(5, 100)
    first = engine.submit(system + [7, 8], RequestSettings(max_new_tokens=4, temperature=0, cache_scope="a"))
    first.result()
    same = engine.submit(system + [9], RequestSettings(max_new_tokens=4, temperature=0, cache_scope="a")).result()
    other = engine.submit(system + [9], RequestSettings(max_new_tokens=4, temperature=0, cache_scope="b")).result()
    # 12 whole blocks, and the first 4 slots of the 13th (the system prompt's end, before 7 8)
    assert same.n_cached_prompt_tokens == 100 and other.n_cached_prompt_tokens == 0
    assert same.tokens == other.tokens
    stats = engine.stats()
    assert stats["prefix_cache_hits_total"] == 1 and stats["cached_prompt_tokens_total"] == 100
    all_blocks_back(engine)


def test_a_prompt_that_goes_on_mid_block_copies_what_a_cached_block_holds_of_it(llama3_checkpoint):
    """A prompt that leaves a cached prompt part-way through a block (a chat's next turn, a system
    prompt that ends mid-block) takes the matching slots of that block into a block of its own,
    and prefills only the rest: the same tokens as alone, and the cached block is untouched."""
    engine = build(llama3_checkpoint, kv_block_size=8).engine
    history = prompt(11, 61)
    first = engine.submit(history, RequestSettings(max_new_tokens=10, temperature=0)).result()
    k = engine.kv.cache[0].k
    cached = {block: k[block * 8 : (block + 1) * 8].clone() for block in engine.kv.blocks._index.values()}
    branch = history[:45] + [17, 18, 19]  # leaves the first request's tokens inside its 6th block
    out = engine.submit(branch, RequestSettings(max_new_tokens=12, temperature=0)).result()
    assert out.n_cached_prompt_tokens == 45  # 5 whole blocks and 5 slots of the 6th
    for block, slots in cached.items():  # nothing cached was written
        assert torch.equal(k[block * 8 : (block + 1) * 8], slots)
    assert out.tokens == solo(llama3_checkpoint, [branch], 12)[0]
    # the next turn of the first request: its whole history, then a question
    turn = history + first.tokens + [21, 22]
    again = engine.submit(turn, RequestSettings(max_new_tokens=6, temperature=0)).result()
    assert again.n_cached_prompt_tokens == len(history) + len(first.tokens) - 1  # all its first turn wrote
    assert again.tokens == solo(llama3_checkpoint, [turn], 6)[0]
    all_blocks_back(engine)


def test_a_chat_s_next_turn_writes_on_in_the_block_its_history_ends_in(llama3_checkpoint):
    """The last, partly written block a request leaves is taken over by the next turn that goes on
    from where it ends (no copy, nothing cached rewritten): a request alone in a fresh pool holds
    consecutive blocks, turn after turn, and gets the tokens it gets alone."""
    engine = build(llama3_checkpoint, kv_block_size=8).engine
    no_stop = dict(temperature=0, stop_tokens=frozenset())
    history = prompt(15, 29)
    for turn in range(3):
        handle = engine.submit(history, RequestSettings(max_new_tokens=6, **no_stop))
        engine.step()
        assert handle.id in engine.scheduler.running
        blocks = engine.kv.block_ids(handle.id)  # its block table, as the KV-cache manager keeps it
        assert blocks and blocks == list(range(1, len(blocks) + 1))  # the lowest blocks, in order
        out = handle.result()
        assert out.tokens == solo(llama3_checkpoint, [history], 6)[0]
        if turn:
            assert out.n_cached_prompt_tokens == len(history) - 3  # all the turn before wrote
        history = history + out.tokens + [40 + turn, 41 + turn]
    all_blocks_back(engine)


def test_a_copied_block_may_be_the_one_the_pool_hands_out_again(llama3_checkpoint):
    """With every block cached and none free, the block a prompt copies slots from is the least
    recently used one, so it is the first handed out again, here to the same request: the
    copy is made before anything writes it, and the tokens are still those it gets alone."""
    engine = build(llama3_checkpoint, kv_cache_tokens=256, kv_block_size=8).engine  # 32 blocks
    history = prompt(12, 100)
    no_stop = dict(temperature=0, stop_tokens=frozenset())
    # 152 and 104 tokens written: 19 and 13 whole blocks, all of the pool, all cached when they end
    assert len(engine.submit(history, RequestSettings(max_new_tokens=53, **no_stop)).result().tokens) == 53
    assert len(engine.submit(prompt(13, 80), RequestSettings(max_new_tokens=25, **no_stop)).result().tokens) == 25
    assert engine.kv.blocks.cached == engine.kv.blocks.usable and not engine.kv.blocks._free
    branch = history[:21] + [30, 31] + prompt(14, 150)[1:]
    source = engine.kv.blocks.match(history, None, 24)[2]  # holds history[16:24]
    handle = engine.submit(branch, RequestSettings(max_new_tokens=8, temperature=0))
    engine.step()
    assert engine.kv.block_ids(handle.id)[2] == source  # 2 hits, then the copy's own block
    out = handle.result()
    assert out.n_cached_prompt_tokens == 21
    assert out.tokens == solo(llama3_checkpoint, [branch], 8)[0]
    all_blocks_back(engine)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_running_request_s_blocks_are_shared(llama3_checkpoint):
    """A request that starts while another with the same prompt is still decoding reuses the
    blocks that one has written (and what each decodes is its own)."""
    engine = build(llama3_checkpoint, kv_block_size=8).engine
    shared = prompt(6, 80)
    long = engine.submit(shared + [3], RequestSettings(max_new_tokens=40, temperature=0))
    engine.step()
    while engine.scheduler.running[long.id].prefilling:
        engine.step()
    before = engine.kv.blocks.in_use
    short = engine.submit(shared + [4], RequestSettings(max_new_tokens=5, temperature=0))
    engine.step()
    assert engine.kv.blocks.in_use - before <= 2  # its own last block and room for a token
    run_steps(engine, [long, short])
    assert short.result().n_cached_prompt_tokens == 80
    assert long.result().tokens == solo(llama3_checkpoint, [shared + [3]], 40)[0]
    assert short.result().tokens == solo(llama3_checkpoint, [shared + [4]], 5)[0]
    all_blocks_back(engine)


def failing_processor(tokens, logits):
    if tokens.shape[-1] > 40:
        raise ValueError("this processor fails")
    return logits


@pytest.mark.parametrize("ending", ["finish", "stop string", "cancel queued", "cancel running", "error", "length",
                                    pytest.param("preempted then cancelled", marks=pytest.mark.slow)])
def test_every_ending_gives_the_blocks_back(llama3_checkpoint, ending):
    engine = build(llama3_checkpoint, kv_cache_tokens=256, kv_block_size=8).engine
    p = prompt(30, 36)
    extra = {}
    if ending == "stop string":
        first = engine.submit(p, RequestSettings(max_new_tokens=20, temperature=0)).result()
        extra = {"stop": (first.text[5:9],)} if len(first.text) > 9 else {}
    if ending == "error":
        extra = {"logits_processor": failing_processor}
    new = {"length": 3, "preempted then cancelled": 200}.get(ending, 20)
    handles = [engine.submit(p, RequestSettings(max_new_tokens=new, temperature=0, **extra))]
    if ending == "preempted then cancelled":
        handles += [engine.submit(prompt(31 + i, 60), RequestSettings(max_new_tokens=150, temperature=0))
                    for i in range(3)]
        while not engine.scheduler.preempted:
            engine.step()
        engine.scheduler.preempted[-1].handle.cancel()
    elif ending == "cancel queued":
        handles[0].cancel()
    elif ending == "cancel running":
        for _ in range(3):
            engine.step()
        handles[0].cancel()
    for h in handles:
        try:
            h.result()
        except ValueError:
            assert ending == "error"
    all_blocks_back(engine)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(1, 40), st.booleans()),
                min_size=1, max_size=7), st.randoms(use_true_random=False))
def test_random_traffic_keeps_the_books_straight(llama3_checkpoint, requests, rng):
    """Requests of random lengths arriving and being cancelled at random steps in a small pool:
    the pool's books balance after every step, and every block is back at the end."""
    engine = build(llama3_checkpoint, kv_cache_tokens=256, kv_block_size=8).engine
    handles = []
    for family, n, new, cancel in requests:
        handles.append(engine.submit(prompt(family, n), RequestSettings(max_new_tokens=new, temperature=0)))
        for _ in range(rng.randrange(3)):
            engine.step()
            engine.kv.blocks.check([engine.kv.block_ids(r) for r in engine.scheduler.running])
        if cancel:
            rng.choice(handles).cancel()
    run_steps(engine, handles)
    all_blocks_back(engine)


def test_kv_cache_tokens_is_checked():
    from llama.runtime.options import check_kv_cache_tokens

    assert check_kv_cache_tokens(None, 4, 256) == 1024
    with pytest.raises(ValueError, match="cannot hold one request of max_seq_len=256"):
        check_kv_cache_tokens(255, 4, 256)
    with pytest.raises(TypeError):
        check_kv_cache_tokens(2.5, 4, 256)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_requests_arriving_together_with_one_prompt_prefix_compute_it_once(llama3_checkpoint):
    """Sixteen clients send prompts that begin with the same system prompt at once: the first
    writes its blocks, the others wait for them and reuse them (each still gets its own tokens)."""
    engine = build(llama3_checkpoint, max_batch_size=16, kv_block_size=8).engine
    system = prompt(8, 120)
    prompts = [system + [10 + i, 11 + i] for i in range(16)]
    handles = [engine.submit(p, RequestSettings(max_new_tokens=4, temperature=0)) for p in prompts]
    run_steps(engine, handles)
    cached = [h.result().n_cached_prompt_tokens for h in handles]
    assert cached == [0] + [120] * 15
    assert [h.result().tokens for h in handles[:3]] == solo(llama3_checkpoint, prompts[:3], 4)
    all_blocks_back(engine)
