"""The continuous-batching engine: requests join and leave a running batch, each with
its own settings and seed; threads, suspended streams, prefix reuse, chunked prefill,
cancellation and server mode.  References: the same request run alone on a fresh
model, and token-by-token full forwards."""

from __future__ import annotations

import threading

import pytest
import torch

import helpers
from llama import Llama
from llama.engine import EngineBusy, EngineStopped, RequestSettings
from llama.formats.session import ChatSession


def build(checkpoint, **kw) -> Llama:
    return helpers.build(checkpoint, **{"max_seq_len": 96, "max_batch_size": 4, **kw})


@pytest.fixture
def checkpoint(llama3_checkpoint):
    """Token-level behaviour does not depend on the family: one is enough."""
    return llama3_checkpoint


@pytest.fixture(params=["llama2", "llama3"])
def both_families(request):
    """Text-level behaviour (detokenisation) differs per tokenizer: both."""
    return request.getfixturevalue(f"{request.param}_checkpoint")


PROMPTS = [[1, 5, 9], [1, 12, 13, 14, 15, 16, 17], [1, 40], [1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]


def greedy_reference(llama: Llama, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards of the whole sequence (no cache reuse)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(llama.model.forward(torch.tensor([seq], device=llama.model.device), 0)[0, -1].argmax()))
        if seq[-1] in llama.tokenizer.stop_tokens:
            return seq[len(prompt) : -1]
    return seq[len(prompt) :]


@pytest.mark.parametrize("device", helpers.DEVICES)
def test_greedy_batched_equals_alone_and_full_forward(checkpoint, device):
    # float32, eager: rows of a batch are computed as alone up to the kernels' summation order
    # (bfloat16 would round those differences to flipped near-ties on a random model)
    llama = build(checkpoint, device=device, dtype="float32", compile=False)
    batched, _ = llama.generate(PROMPTS, max_gen_len=10, temperature=0)
    alone = [llama.generate([p], max_gen_len=10, temperature=0)[0][0] for p in PROMPTS]
    assert batched == alone
    assert batched == [greedy_reference(llama, p, 10) for p in PROMPTS]


def test_seeded_request_ignores_its_neighbours(both_families):
    llama = build(both_families)
    alone = llama.text_completion(["Hello"], temperature=1.0, top_p=0.95, max_gen_len=12, seed=7)[0]["generation"]
    # Same request (row 0 gets the call's seed) beside other prompts, sampled too.
    crowded = llama.text_completion(["Hello", "The quick", "A"], temperature=1.0, top_p=0.95, max_gen_len=12, seed=7)
    assert crowded[0]["generation"] == alone
    # And submitted while other requests are already decoding.
    engine = llama.engine
    settings = RequestSettings(max_new_tokens=12, temperature=1.0, top_p=0.95)
    others = [engine.submit([1, 9, 9, 9], settings), engine.submit([1, 3], settings)]
    next(others[0].events())  # the others are running now
    hello = llama.tokenizer.encode("Hello", bos=True, eos=False)
    late = engine.submit(hello, RequestSettings(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=7))
    assert late.result().text == alone
    assert all(h.result().finish_reason in ("stop", "length") for h in others)


def test_threads_share_one_llama(checkpoint):
    llama = build(checkpoint, max_batch_size=2)  # fewer slots than threads: some wait in the queue
    expected = [llama.generate([p], max_gen_len=12, temperature=0)[0][0] for p in PROMPTS]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = llama.generate([PROMPTS[i]], max_gen_len=12, temperature=0)[0][0]
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [results[i] for i in range(len(PROMPTS))] == expected


def test_call_while_a_stream_is_suspended(both_families):
    llama = build(both_families)
    kw = dict(temperature=0, max_gen_len=16)
    solo_stream = "".join(llama.text_completion_stream("The quick", **kw))
    solo_call = llama.text_completion(["Hello there"], **kw)[0]["generation"]
    stream = llama.text_completion_stream("The quick", **kw)
    first = next(stream)
    middle = llama.text_completion(["Hello there"], **kw)[0]["generation"]  # the stream is suspended meanwhile
    assert middle == solo_call
    assert first + "".join(stream) == solo_stream


def test_prefix_reuse_skips_the_cached_prefix_and_changes_nothing(checkpoint):
    llama = build(checkpoint, kv_block_size=4)
    engine = llama.engine
    first = engine.submit(PROMPTS[1], RequestSettings(max_new_tokens=8, temperature=0)).result()
    follow_up = PROMPTS[1] + first.tokens + [5, 6, 7]  # the next turn: history + new tokens
    second = engine.submit(follow_up, RequestSettings(max_new_tokens=8, temperature=0)).result()
    fed = len(PROMPTS[1]) + len(first.tokens) - 1  # the first request's K/V: all but its last token
    # all it wrote: its whole blocks of 4, then the slots of its last, partly written one
    assert fed % 4 >= engine.kv.blocks.min_partial and second.n_cached_prompt_tokens == fed
    cold = build(checkpoint).engine.submit(follow_up, RequestSettings(max_new_tokens=8, temperature=0)).result()
    assert cold.n_cached_prompt_tokens == 0
    assert second.tokens == cold.tokens
    assert engine.stats()["cached_prompt_tokens_total"] == second.n_cached_prompt_tokens


def test_model_forward_leaves_the_engine_s_cache_alone(checkpoint):
    """Transformer.forward (Meta's call) keeps a KV cache of its own: calling it between two
    turns neither spoils the engine's cached prefix nor needs the engine to be told."""
    llama = build(checkpoint, kv_block_size=4)
    engine = llama.engine
    first = engine.submit(PROMPTS[1], RequestSettings(max_new_tokens=8, temperature=0)).result()
    llama.model.forward(torch.randint(3, 100, (4, 30), generator=torch.Generator().manual_seed(0)), 0)
    follow_up = PROMPTS[1] + first.tokens + [5, 6, 7]
    second = engine.submit(follow_up, RequestSettings(max_new_tokens=8, temperature=0)).result()
    assert second.n_cached_prompt_tokens > 0
    cold = build(checkpoint).engine.submit(follow_up, RequestSettings(max_new_tokens=8, temperature=0)).result()
    assert second.tokens == cold.tokens
    assert not hasattr(llama.model, "cache_overwrites")


def test_chat_session_turns_reuse_the_cache(llama2_checkpoint):
    llama = build(llama2_checkpoint, max_seq_len=256)
    chat = ChatSession(llama, reply_room=16)
    "".join(chat.ask("Hello there", temperature=0))
    before = llama.engine.stats()["cached_prompt_tokens_total"]
    "".join(chat.ask("Tell me more", temperature=0))
    reused = llama.engine.stats()["cached_prompt_tokens_total"] - before
    # The second turn's prompt starts with the whole first exchange; all of the first
    # prompt's whole blocks at least are reused (the reply may re-tokenise differently at its seam).
    first_prompt = llama.formatter.encode_dialog_prompt([{"role": "user", "content": "Hello there"}])
    block = llama.engine.kv.block_size
    assert reused >= (len(first_prompt) - 1) // block * block > 0


def test_a_stopped_chat_answer_is_cancelled_and_not_kept(llama2_checkpoint):
    """What Ctrl-C during a reply does: closing the answer cancels the request at once
    (the slot is free when close() returns) and leaves the history as it was."""
    llama = build(llama2_checkpoint, max_seq_len=256)
    chat = ChatSession(llama, reply_room=64)
    answer = chat.ask("Hello there", temperature=0)
    next(answer)
    answer.close()
    assert chat.last_finish_reason == "cancelled" and chat.history == []
    assert llama.engine.stats()["slots_in_use"] == 0
    whole = "".join(chat.ask("Hello there", temperature=0))
    assert whole == "".join(ChatSession(build(llama2_checkpoint, max_seq_len=256), reply_room=64)
                            .ask("Hello there", temperature=0))
    assert chat.history[-1] == {"role": "assistant", "content": whole}


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_chunked_prefill_gives_the_same_tokens_and_does_not_stall_decoding(checkpoint):
    reference = build(checkpoint)
    expected = [reference.generate([p], max_gen_len=10, temperature=0)[0][0] for p in PROMPTS]
    llama = build(checkpoint)
    llama.engine.prefill_chunk = 3
    assert llama.generate(PROMPTS, max_gen_len=10, temperature=0)[0] == expected
    # A request decoding while a long prompt is prefilled 3 tokens per step gets a
    # token on every one of those steps.
    engine = llama.engine
    running = engine.submit(PROMPTS[0], RequestSettings(max_new_tokens=30, temperature=0))
    events = running.events()
    next(events)
    long_prompt = [1] + [7] * 40
    late = engine.submit(long_prompt, RequestSettings(max_new_tokens=2, temperature=0))
    steps_to_prefill = -(-len(long_prompt) // 3)
    for _ in range(steps_to_prefill):
        next(events)  # one token per step: each step decoded while prefilling
    assert late.result().tokens == reference.generate([long_prompt], max_gen_len=2, temperature=0)[0][0]
    assert running.result().tokens == reference.generate([PROMPTS[0]], max_gen_len=30, temperature=0)[0][0]


def test_cancel_frees_the_slot(checkpoint):
    llama = build(checkpoint, max_batch_size=1)
    stream = llama.text_completion_stream("Hello", temperature=0, max_gen_len=40)
    next(stream)
    stream.close()  # cancels
    done = llama.generate([[1, 5]], max_gen_len=3, temperature=0)  # needs the only slot
    assert done[0][0] == build(checkpoint).generate([[1, 5]], max_gen_len=3, temperature=0)[0][0]
    assert llama.engine.stats()["running"] == 0


def test_logits_processor_is_applied_every_step(checkpoint):
    llama = build(checkpoint)
    free = llama.generate([PROMPTS[0]], max_gen_len=8, temperature=0)[0][0]
    banned = free[0]
    calls = []

    def ban(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        calls.append(tokens.shape)
        logits[:, banned] = float("-inf")
        return logits

    out = llama.generate([PROMPTS[0]], max_gen_len=8, temperature=0, logits_processor=ban)[0][0]
    assert banned not in out and out != free
    assert calls[0] == (1, len(PROMPTS[0])) and calls[1] == (1, len(PROMPTS[0]) + 1)  # tokens so far
    forced = 17

    def force(tokens, logits):
        return torch.where(torch.arange(logits.shape[-1]) == forced, 0.0, float("-inf")).expand_as(logits).clone()

    sampled = llama.generate([PROMPTS[0]], max_gen_len=5, temperature=0.8, logits_processor=force)[0][0]
    assert sampled == [forced] * 5


def test_tiny_temperature_is_greedy(checkpoint):
    llama = build(checkpoint)
    greedy = llama.generate([PROMPTS[1]], max_gen_len=8, temperature=0)[0]
    assert llama.generate([PROMPTS[1]], max_gen_len=8, temperature=1e-38)[0] == greedy


def test_non_finite_logits_are_an_error_naming_the_cause(checkpoint):
    llama = build(checkpoint)
    with torch.no_grad():
        llama.model.norm.weight[0] = float("nan")
    with pytest.raises(RuntimeError, match=r"NaN and \d+ infinite logit\(s\) at the step choosing token 1 of request"):
        llama.generate([PROMPTS[0]], max_gen_len=4, temperature=0)


def test_server_mode_runs_requests_from_other_threads(checkpoint):
    llama = build(checkpoint)
    expected = [llama.generate([p], max_gen_len=10, temperature=0)[0][0] for p in PROMPTS]
    engine = llama.engine
    engine.max_queue = 2
    stop = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stop,))
    loop.start()
    try:
        seen: list[object] = []
        handles = [engine.submit(p, RequestSettings(max_new_tokens=10, temperature=0), on_event=seen.append)
                   for p in PROMPTS[:2]]
        assert [h.result().tokens for h in handles] == expected[:2]
        assert seen[-1] is not None and any(getattr(e, "token", None) is not None for e in seen)
        # A full queue refuses instead of growing: 4 slots take 4 requests, 2 more may wait.
        with engine.lock:  # hold the engine still so the queue cannot drain
            queued = [engine.submit(p,
                                    RequestSettings(max_new_tokens=10, temperature=0)) for p in PROMPTS + PROMPTS[:2]]
            with pytest.raises(EngineBusy):
                engine.submit([1], RequestSettings(max_new_tokens=1))
        assert [h.result().tokens for h in queued] == expected + expected[:2]
        pending = engine.submit([1, 2, 3], RequestSettings(max_new_tokens=80, temperature=0))
    finally:
        stop.set()
        loop.join(timeout=60)
    assert not loop.is_alive()
    with pytest.raises(EngineStopped):
        pending.result()


def record_prefill_steps(engine) -> list[list[int]]:
    """The ids of the requests each step prefills, as the runner is given them."""
    steps: list[list[int]] = []
    run = engine.runner.run

    def recording(plan):
        steps.append([chunk.request.id for chunk in plan.prefill])
        return run(plan)

    engine.runner.run = recording
    return steps


def test_an_idle_served_engine_starts_requests_announced_together_in_one_step(checkpoint):
    """Requests sent together reach the engine one by one (each read and tokenised first): an idle
    engine waits for the ones announced by ``arriving()`` (at most ``arrival_wait_s``), so that they
    start in one step instead of the first alone and the others a step later; a request that was not
    announced, or an announcement that never submits, holds nothing up past the wait."""
    import contextlib
    import time

    llama = build(checkpoint)
    expected = [llama.generate([p], max_gen_len=4, temperature=0)[0][0] for p in PROMPTS[:3]]
    engine = llama.engine
    engine.arrival_wait_s = 30.0
    steps = record_prefill_steps(engine)
    settings = RequestSettings(max_new_tokens=4, temperature=0)
    stop = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    loop.start()
    try:
        with contextlib.ExitStack() as second_arriving:
            with engine.arriving():
                second_arriving.enter_context(engine.arriving())
                first = engine.submit(PROMPTS[0], settings)
            time.sleep(0.3)
            assert steps == []  # the first waits for the second, announced
            second = engine.submit(PROMPTS[1], settings)
        assert [first.result().tokens, second.result().tokens] == expected[:2]
        assert steps[0] == [first.id, second.id]

        # Not announced: started at once, whatever the wait allowed
        start = time.monotonic()
        assert engine.submit(PROMPTS[2], settings).result().tokens == expected[2]
        assert time.monotonic() - start < 10

        # An announcement that never submits holds the others up for arrival_wait_s only
        engine.arrival_wait_s = 0.2
        with engine.arriving():
            late = engine.submit(PROMPTS[0], settings)
            with engine.arriving():
                assert late.result().tokens == expected[0]  # (within the announcement that never submits)
    finally:
        stop.set()
        loop.join(timeout=60)
    assert not loop.is_alive()
    from llama.engine import Engine

    for bad in (-0.1, float("nan"), "1", None):
        with pytest.raises(ValueError, match="arrival_wait_s must be a number of seconds >= 0"):
            Engine(llama.model, llama.tokenizer, generator=torch.Generator(), arrival_wait_s=bad)


def test_padded_vocabulary_never_yields_ids_the_tokenizer_lacks(tmp_path, tiny_tiktoken_path):
    """Some checkpoints pad their vocabulary beyond the tokenizer's ids; those rows of
    the output layer must never be chosen (here they are made to win every argmax)."""
    import helpers
    from conftest import LLAMA3_PARAMS
    from llama.tokenizer import load_tokenizer

    n_words = load_tokenizer(tiny_tiktoken_path).n_words
    vocab = n_words + 12
    params = {**LLAMA3_PARAMS, "vocab_size": vocab}
    weights = helpers.random_weights(params, vocab, seed=5)
    weights["output.weight"][n_words:] = 50.0 * weights["output.weight"][n_words:].sign()
    ckpt = helpers.write_checkpoint(tmp_path / "padded", params, weights)
    llama = Llama.build(ckpt, tiny_tiktoken_path, max_seq_len=32, max_batch_size=2, device="cpu")
    raw = llama.model.forward(torch.tensor([[1, 2, 3]]), 0)[0, -1]
    assert int(raw.argmax()) >= n_words  # unmasked, a padding id would win
    for temperature in (0, 1.0):
        tokens = llama.generate([[1, 2, 3]], max_gen_len=10, temperature=temperature, top_p=1.0)[0][0]
        assert tokens and all(t < n_words for t in tokens)
    assert isinstance(llama.text_completion(["the"], max_gen_len=5)[0]["generation"], str)
    # Nor are they taken in a prompt: refused before anything is generated (they used to pass
    # and fail when the reply was decoded, or end in the server's 500).
    with pytest.raises(ValueError, match=f"outside \\[0, {n_words}\\)"):
        llama.generate([[1, 2, n_words + 3]], max_gen_len=2)
    with pytest.raises(ValueError, match="tokenizer's vocabulary"):
        llama.engine.submit([1, n_words], RequestSettings(max_new_tokens=1))


def test_a_request_cancelled_while_queued_never_runs(checkpoint):
    llama = build(checkpoint, max_batch_size=1)
    engine = llama.engine
    running = engine.submit(PROMPTS[0], RequestSettings(max_new_tokens=6, temperature=0))
    queued = engine.submit(PROMPTS[1], RequestSettings(max_new_tokens=6, temperature=0))
    queued.cancel()
    assert running.result().finish_reason == "length"
    result = queued.result()
    assert result.finish_reason == "cancelled" and result.tokens == []
    assert engine.stats()["requests_total"] == 1  # only the first ever took a slot
