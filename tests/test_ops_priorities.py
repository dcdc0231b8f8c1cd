"""Priorities and deadlines in the engine (RequestSettings.priority, .timeout_s) on a random-weight
Llama 3 checkpoint: waiting requests start in priority order (lower first, ties by arrival), a
full pool preempts the lowest priority first, and a request past its deadline ends at the next
step, running or waiting, with every block back.  References: the order the rules give, written
out by hand; the same request run without a deadline."""

from __future__ import annotations

import math
import random
import time

import pytest

import helpers
from llama.engine import RequestResult, RequestSettings
from llama.engine.scheduler import priority_key


def build(checkpoint, **kw):
    return helpers.build(checkpoint, **{"max_seq_len": 256, "max_batch_size": 4, "dtype": "float32",
                                        "compile": False, **kw})


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 250) for _ in range(n - 1)]


def all_blocks_back(engine) -> None:
    """No request runs, and every block is free or in the prefix cache, counted once."""
    assert not engine.scheduler.running and not engine.scheduler.preempted and not engine.scheduler.queue
    engine.kv.blocks.check([])
    assert engine.kv.blocks.available == engine.kv.blocks.usable


def small_pool(checkpoint):
    """16 blocks of 8 tokens: three requests of 30-token prompts start together (4 blocks each)
    and run out of blocks after about 10 tokens each."""
    return build(checkpoint, max_seq_len=128, kv_cache_tokens=128, kv_block_size=8).engine


def run_steps(engine, handles) -> None:
    while not all(h.finished for h in handles):
        engine.step()
        engine.kv.blocks.check([engine.kv.block_ids(r) for r in engine.scheduler.running])


@pytest.mark.parametrize("settings,error", [
    (dict(priority=True), TypeError), (dict(priority=1.5), TypeError), (dict(priority="high"), TypeError),
    (dict(timeout_s=0), ValueError), (dict(timeout_s=-1.0), ValueError), (dict(timeout_s=math.inf), ValueError),
    (dict(timeout_s=math.nan), ValueError), (dict(timeout_s="5"), TypeError), (dict(timeout_s=True), TypeError),
])
def test_bad_priorities_and_timeouts_are_refused(settings, error):
    with pytest.raises(error, match="priority" if "priority" in settings else "timeout_s"):
        RequestSettings(max_new_tokens=1, **settings).checked()


def test_the_queue_orders_by_priority_then_arrival(llama3_checkpoint):
    """One row: the requests queued behind the running one start lowest priority value first,
    those of one priority in the order they came."""
    engine = build(llama3_checkpoint, max_batch_size=1).engine
    started: list[str] = []

    def submit(name: str, priority: int):
        def on_event(item, name=name):
            if isinstance(item, RequestResult):
                started.append(name)  # one row: each ends before the next starts
        return engine.submit(prompt(len(started) + priority + 7, 6),
                             RequestSettings(max_new_tokens=1, temperature=0, priority=priority), on_event)

    handles = [submit("first", 3)]
    engine.step()  # it runs: the batch is full
    for name, priority in [("b", 5), ("c", 0), ("d", -1), ("e", 5), ("f", 0)]:
        handles.append(submit(name, priority))
    assert [priority_key(h)[0] for h in engine.scheduler.queue] == [-1, 0, 0, 5, 5]
    run_steps(engine, handles)
    assert started == ["first", "d", "c", "f", "b", "e"]
    all_blocks_back(engine)


def test_preemption_takes_the_lowest_priority_first(llama3_checkpoint):
    """A pool too small for three growing requests: the oldest, of the lowest priority, is
    preempted first (without priorities the newest would be), and resumes once blocks are free."""
    engine = small_pool(llama3_checkpoint)
    low = engine.submit(prompt(1, 30), RequestSettings(max_new_tokens=90, temperature=0, priority=5))
    high = [engine.submit(prompt(2 + i, 30), RequestSettings(max_new_tokens=90, temperature=0)) for i in range(2)]
    while not engine.scheduler.preempted:
        engine.step()
    assert [r.id for r in engine.scheduler.preempted] == [low.id]
    assert set(engine.scheduler.running) == {h.id for h in high}
    high[0].cancel()  # its blocks come back: the preempted one resumes
    engine.step()
    assert low.id in engine.scheduler.running and not engine.scheduler.preempted
    for h in [low, high[1]]:
        h.cancel()
    run_steps(engine, [low] + high)
    all_blocks_back(engine)


def test_same_priority_preempts_the_newest_as_before(llama3_checkpoint):
    engine = small_pool(llama3_checkpoint)
    handles = [engine.submit(prompt(1 + i, 30), RequestSettings(max_new_tokens=90, temperature=0)) for i in range(3)]
    while not engine.scheduler.preempted:
        engine.step()
    assert [r.id for r in engine.scheduler.preempted] == [handles[-1].id]
    for h in handles:
        h.cancel()
    run_steps(engine, handles)
    all_blocks_back(engine)


def test_a_new_request_of_higher_priority_starts_before_a_preempted_one(llama3_checkpoint):
    """A preempted request resumes ahead of new requests of its priority or lower, not of a higher one."""
    engine = small_pool(llama3_checkpoint)
    low = engine.submit(prompt(1, 30), RequestSettings(max_new_tokens=90, temperature=0, priority=5))
    high = [engine.submit(prompt(2 + i, 30), RequestSettings(max_new_tokens=90, temperature=0)) for i in range(2)]
    while not engine.scheduler.preempted:
        engine.step()
    high[0].cancel()  # rows and blocks free up
    urgent = engine.submit(prompt(9, 20), RequestSettings(max_new_tokens=2, temperature=0, priority=-1))
    same = engine.submit(prompt(10, 20), RequestSettings(max_new_tokens=2, temperature=0, priority=5))
    engine.step()
    assert urgent.id in engine.scheduler.running  # admitted past the preempted one
    assert same in engine.scheduler.queue  # waits behind it
    for h in [low, high[1], same]:
        h.cancel()
    run_steps(engine, [low, urgent, same] + high)
    all_blocks_back(engine)


def test_a_deadline_ends_a_running_and_a_waiting_request_with_their_blocks(llama3_checkpoint):
    """One row: a running request and one waiting behind it, both with a deadline. Once it has
    passed, the next step ends both ("timeout"): the running one with the tokens it had (those
    the same request gives without a deadline), the waiting one with none, and every block
    they held is free at once."""
    engine = build(llama3_checkpoint, max_batch_size=1, kv_block_size=8).engine
    p, q = prompt(5, 30), prompt(6, 30)
    running = engine.submit(p, RequestSettings(max_new_tokens=100, temperature=0, timeout_s=0.3))
    waiting = engine.submit(q, RequestSettings(max_new_tokens=100, temperature=0, timeout_s=0.3))
    for _ in range(3):
        engine.step()
    assert running.id in engine.scheduler.running and waiting in engine.scheduler.queue
    held = len(engine.kv.block_ids(running.id))
    # its blocks for the 32 positions fed: the prompt and its first 2 tokens (the 3rd is fed next step)
    assert held == 32 // 8
    time.sleep(max(0.0, running.deadline - time.monotonic()) + 0.01)
    engine.step()
    assert running.finished and waiting.finished
    all_blocks_back(engine)
    first, second = running.result(), waiting.result()
    assert first.finish_reason == second.finish_reason == "timeout"
    assert second.tokens == [] and second.n_prompt_tokens == len(q)
    assert 1 <= len(first.tokens) <= 3
    untimed = engine.submit(p, RequestSettings(max_new_tokens=len(first.tokens), temperature=0)).result()
    assert first.tokens == untimed.tokens
    assert engine.stats()["requests_total"] == 2  # the waiting one never started


def test_a_preempted_request_past_its_deadline_ends_too(llama3_checkpoint):
    engine = small_pool(llama3_checkpoint)
    low = engine.submit(prompt(1, 30), RequestSettings(max_new_tokens=90, temperature=0, priority=5, timeout_s=30))
    high = [engine.submit(prompt(2 + i, 30), RequestSettings(max_new_tokens=90, temperature=0)) for i in range(2)]
    while not engine.scheduler.preempted:
        engine.step()
    low.deadline = time.monotonic()  # (as if 30 s had passed)
    engine.step()
    assert not engine.scheduler.preempted and low.result().finish_reason == "timeout"
    for h in high:
        h.cancel()
    run_steps(engine, high)
    all_blocks_back(engine)


def test_the_python_api_takes_priority_and_timeout_s(llama3_checkpoint):
    """Llama's calls pass both on; a call whose deadline passes raises TimeoutError, its blocks back."""
    llama = build(llama3_checkpoint)

    def slow(tokens, logits):  # every step takes at least 50 ms
        time.sleep(0.05)
        return logits

    with pytest.raises(TimeoutError, match="timeout_s=0.2"):
        llama.text_completion(["Once"], max_gen_len=60, timeout_s=0.2, logits_processor=slow)
    stream = llama.text_completion_stream("Once", max_gen_len=60, timeout_s=0.2, logits_processor=slow)
    with pytest.raises(TimeoutError):
        "".join(stream)
    all_blocks_back(llama.engine)
    with pytest.raises(TypeError, match="priority"):
        llama.text_completion(["Once"], max_gen_len=2, priority="high")
    done = llama.text_completion(["Once"], max_gen_len=2, temperature=0, priority=-1, timeout_s=60)
    assert done == llama.text_completion(["Once"], max_gen_len=2, temperature=0)
