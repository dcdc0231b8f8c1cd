"""Streaming output, stop strings and sampling controls."""

from __future__ import annotations

import pytest

from llama import Llama
from llama.engine.detokenize import TextAssembler


@pytest.fixture(params=["llama2", "llama3"], scope="module")
def llama(request):
    ckpt, tok, _, _ = request.getfixturevalue(f"{request.param}_checkpoint")
    return Llama.build(ckpt, tok, max_seq_len=96, max_batch_size=3, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_stream_concatenates_to_the_completion(llama, seed):
    """Random tiny models emit arbitrary tokens: single bytes of multi-byte characters
    (tiktoken), byte-fallback pieces and lone word-boundary pieces (SentencePiece)."""
    kwargs = dict(temperature=1.0, top_p=1.0, max_gen_len=60, seed=seed)
    pieces = list(llama.text_completion_stream("the cat", **kwargs))
    whole = llama.text_completion(["the cat"], **kwargs)[0]["generation"]
    assert "".join(pieces) == whole
    assert len(pieces) > 1


@pytest.mark.slow
def test_chat_stream_concatenates_to_the_reply(llama):
    dialog = [{"role": "user", "content": "Hello there"}]
    kwargs = dict(temperature=1.0, max_gen_len=40, seed=3)
    assert "".join(llama.chat_completion_stream(dialog, **kwargs)) == \
        llama.chat_completion([dialog], **kwargs)[0]["generation"]["content"]


class FakeTokenizer:
    """Each id is one UTF-8 byte: the hardest case for incremental decoding."""

    n_words = 256
    stop_tokens = frozenset()

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["héllo wörld", "東京タワー", "emoji 😀 and 🚀!", "plain ascii"])
def test_assembler_holds_back_partial_characters(text):
    assembler = TextAssembler(FakeTokenizer())
    pieces = [assembler.push(b) for b in text.encode("utf-8")] + [assembler.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # no half character was ever released


@pytest.mark.parametrize("stop", [["wör"], ["ö"], ["ld", "llo"], ["xyz"], ["\ufffd"]])
def test_assembler_stop_strings(stop):
    text = "héllo wörld"
    assembler = TextAssembler(FakeTokenizer(), stop)
    pieces = []
    for b in text.encode("utf-8"):
        pieces.append(assembler.push(b))
        if assembler.stopped:
            break
    pieces.append(assembler.finish())
    hits = [text.find(s) for s in stop if s in text]
    expected = text[: min(hits)] if hits else text
    assert "".join(pieces) == expected == assembler.text


@pytest.mark.slow
def test_stop_strings_end_generation(llama):
    free = llama.text_completion(["the cat"], temperature=0, max_gen_len=40)[0]["generation"]
    assert len(free) > 6
    stop = free[3:6]  # a string the greedy completion contains
    cut = llama.text_completion(["the cat"], temperature=0, max_gen_len=40, stop=[stop], logprobs=True)[0]
    assert cut["generation"] == free[: free.index(stop)]
    # the returned tokens are those lying wholly before the stop string
    full = llama.text_completion(["the cat"], temperature=0, max_gen_len=40, logprobs=True)[0]
    n = len(cut["tokens"])
    assert cut["tokens"] == full["tokens"][:n] and cut["logprobs"] == full["logprobs"][:n]
    ids = llama.generate([llama.tokenizer.encode("the cat", bos=True, eos=False)], 40, temperature=0)[0][0]
    assert cut["generation"].startswith(llama.tokenizer.decode(ids[:n]))
    assert not cut["generation"].startswith(llama.tokenizer.decode(ids[: n + 1]))
    streamed = "".join(llama.text_completion_stream("the cat", temperature=0, max_gen_len=40, stop=[stop]))
    assert streamed == cut["generation"]


@pytest.mark.slow
def test_stop_strings_per_row_in_a_batch(llama):
    prompts = ["the cat", "Hello", "in the"]
    free = [r["generation"] for r in llama.text_completion(prompts, temperature=0, max_gen_len=30)]
    stop = free[1][2:5]
    cut = [r["generation"] for r in llama.text_completion(prompts, temperature=0, max_gen_len=30, stop=[stop])]
    for f, c in zip(free, cut):
        assert c == (f[: f.index(stop)] if stop in f else f)


@pytest.mark.slow
def test_seed_per_call(llama):
    kwargs = dict(temperature=1.0, top_p=1.0, max_gen_len=20)
    a = llama.text_completion(["the cat"], seed=7, **kwargs)
    b = llama.text_completion(["the cat"], seed=7, **kwargs)
    c = llama.text_completion(["the cat"], seed=8, **kwargs)
    assert a == b != c


def test_top_k_one_is_greedy(llama):
    greedy = llama.generate([[1, 5, 9]], max_gen_len=15, temperature=0)[0]
    k1 = llama.generate([[1, 5, 9]], max_gen_len=15, temperature=1.5, top_p=1.0, top_k=1, seed=3)[0]
    assert k1 == greedy


def test_top_k_limits_the_choice():
    import torch

    from llama.engine.sampling import SamplingParams, sample_next_token

    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=2)
    draws = {int(sample_next_token(logits, params, g)) for _ in range(300)}
    assert draws == {0, 1}


def test_streaming_leaves_the_callers_grad_mode_alone(llama):
    import torch

    stream = llama.text_completion_stream("the cat", temperature=0, max_gen_len=8)
    for _ in stream:
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_stream_arguments_are_checked_at_the_call(llama):
    with pytest.raises(TypeError, match="seed must be an int"):
        llama.text_completion_stream("the cat", seed="x")  # before any next()
    with pytest.raises(ValueError, match="top_p"):
        llama.chat_completion_stream([{"role": "user", "content": "hi"}], top_p=2)
