"""One request never harms another: a failing request (its seed, its logits processor) ends
alone with a clear error while the requests beside it finish with their solo text, and the
engine goes on.  References: the same requests run alone."""

from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch

from llama import Llama
from llama.engine import RequestSettings

PROMPT = "The quick"
BYSTANDER = "Hello there"


@pytest.fixture(scope="module")
def llama(llama3_checkpoint) -> Llama:
    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    return Llama.build(ckpt, tok, max_seq_len=96, max_batch_size=4, device="cpu")


def solo(llama: Llama, prompt: str, **kw) -> str:
    return llama.text_completion([prompt], max_gen_len=12, **kw)[0]["generation"]


@pytest.mark.parametrize("seed", [2**64, 2**64 - 1, 2**64 + 5, -(2**63) - 1, 10**40, -(10**40)])
def test_any_int_seed_is_taken_modulo_2_64(llama, seed):
    """torch's generators take 64 bits; the engine reduces any int seed to them, so -1 and
    2**64 - 1 (which torch seeds alike) stay the same seed, and two prompts of one call
    (seeds seed and seed + 1) both work at the top of the range."""
    kw = dict(temperature=1.0, top_p=0.95)
    got = llama.text_completion([PROMPT, BYSTANDER], max_gen_len=12, seed=seed, **kw)
    reduced = seed % 2**64
    assert got[0]["generation"] == solo(llama, PROMPT, seed=reduced, **kw)
    assert got[1]["generation"] == solo(llama, BYSTANDER, seed=(reduced + 1) % 2**64, **kw)


def test_seed_minus_one_is_torch_s_2_64_minus_1(llama):
    kw = dict(temperature=1.0, top_p=0.95)
    assert solo(llama, PROMPT, seed=-1, **kw) == solo(llama, PROMPT, seed=2**64 - 1, **kw)


def raises(tokens, logits):
    raise KeyError("the processor's own bug")


def returns_nan(tokens, logits):
    return torch.full_like(logits, float("nan"))


def wrong_shape(tokens, logits):
    return logits[:, :-1]


def not_a_tensor(tokens, logits):
    return logits.tolist()


def bans_everything(tokens, logits):
    return torch.full_like(logits, float("-inf"))


FAULTY = [
    (raises, KeyError, "the processor's own bug"),
    (returns_nan, ValueError, "NaN or \\+inf"),
    (wrong_shape, ValueError, "shape"),
    (not_a_tensor, ValueError, "tensor"),
    (bans_everything, ValueError, "every logit to -inf"),
]


@pytest.mark.parametrize("processor, error, message", FAULTY, ids=[f.__name__ for f, _, _ in FAULTY])
def test_a_failing_logits_processor_fails_its_call_alone(llama, processor, error, message):
    """A concurrent thread's call finishes with its solo text while the faulty call fails with
    its own error (before: the other thread got this thread's error, both calls failed)."""
    expected = solo(llama, BYSTANDER, temperature=0)
    started = threading.Event()
    outcome: dict[str, object] = {}

    def slow_greedy(tokens, logits):
        started.set()
        return logits

    def bystander() -> None:
        try:
            outcome["text"] = llama.text_completion([BYSTANDER], temperature=0, max_gen_len=12,
                                                    logits_processor=slow_greedy)[0]["generation"]
        except BaseException as e:  # reported below
            outcome["error"] = e

    thread = threading.Thread(target=bystander)
    thread.start()
    assert started.wait(60)
    for temperature in (0, 0.8):  # greedy and sampled rows
        with pytest.raises(error, match=message):
            llama.text_completion([PROMPT], temperature=temperature, max_gen_len=12, logits_processor=processor)
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome
    assert outcome["text"] == expected
    # The engine goes on: the same call without the processor gives its solo text.
    assert solo(llama, PROMPT, temperature=0) == solo(llama, PROMPT, temperature=0)
    assert llama.engine.stats()["running"] == 0


def test_a_failing_request_in_the_same_batch_leaves_the_others(llama):
    """Requests decoded in the same steps: one fails at its third token, the others finish."""
    engine = llama.engine
    tok = llama.tokenizer
    expected = [solo(llama, p, temperature=0) for p in (PROMPT, BYSTANDER)]
    calls = []

    def fails_late(tokens, logits):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("third step")
        return logits

    greedy = RequestSettings(max_new_tokens=12, temperature=0)
    handles = [engine.submit(tok.encode(p, bos=True, eos=False), greedy) for p in (PROMPT, BYSTANDER)]
    faulty = engine.submit(tok.encode("A", bos=True, eos=False),
                           RequestSettings(max_new_tokens=12, temperature=0, logits_processor=fails_late))
    with pytest.raises(RuntimeError, match="third step"):
        faulty.result()
    assert [h.result().text for h in handles] == expected


def test_a_logits_processor_calling_back_into_the_llama_is_an_error_not_a_deadlock(llama):
    seen: list[BaseException] = []

    def reentrant(tokens, logits):
        try:
            llama.text_completion(["nested"], max_gen_len=2)
        except RuntimeError as e:
            seen.append(e)
            raise
        return logits

    done = threading.Event()
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            llama.text_completion([PROMPT], temperature=0, max_gen_len=4, logits_processor=reentrant)
        except BaseException as e:
            outcome["error"] = e
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(60), "the re-entrant call deadlocked the engine"
    assert isinstance(outcome.get("error"), RuntimeError)
    assert "inside the engine's step" in str(outcome["error"])
    assert seen and seen[0] is outcome["error"]
    assert solo(llama, BYSTANDER, temperature=0)  # the engine still serves


def test_the_failed_request_s_slot_is_free_and_not_reused(llama):
    engine = llama.engine
    # a prompt no other test's request begins like: what they wrote of it would be reused, rightly
    prompt = llama.tokenizer.encode("Nobody else asks this: a long prompt to reuse", bos=True, eos=False)
    with pytest.raises(KeyError):
        engine.submit(prompt, RequestSettings(max_new_tokens=4, temperature=0, logits_processor=raises)).result()
    assert engine.stats()["slots_in_use"] == 0
    again = engine.submit(prompt, RequestSettings(max_new_tokens=4, temperature=0)).result()
    assert again.n_cached_prompt_tokens == 0


def run_forever_in_thread(engine) -> Callable[[], None]:
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join(30)

    return end


def test_served_engine_survives_a_failing_request(llama3_checkpoint):
    """Server mode (run_forever): a request that fails does not end the loop."""
    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    llama = Llama.build(ckpt, tok, max_seq_len=96, max_batch_size=4, device="cpu")
    end = run_forever_in_thread(llama.engine)
    try:
        prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
        bad = llama.engine.submit(prompt, RequestSettings(max_new_tokens=4, temperature=0, logits_processor=raises))
        with pytest.raises(KeyError):
            bad.result()
        good = llama.engine.submit(prompt, RequestSettings(max_new_tokens=4, temperature=0)).result()
        assert good.finish_reason in ("stop", "length") and good.tokens
    finally:
        end()
