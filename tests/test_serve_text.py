"""The server's text against the library's, for both tokenizer families: a real (tiny) model
behind the HTTP app, its engine served on a thread as ``llama.serve`` serves it.

Echo: the text, completion and ``text_offset`` equal what ``text_completion(echo=True)``
gives.  Streaming equals non-streaming in text, finish reason, usage and log-probabilities,
stop strings included (a token inside the stop string is never listed)."""

from __future__ import annotations

import json
import threading

import pytest

from llama import Llama
from llama.serve import create_app
from llama.tokenizer import SentencePieceTokenizer

PROMPTS = ["ROMEO: I am", "The quick brown", "Hello there"]


def same_usage(streamed: dict, whole: dict) -> bool:
    """The same usage, but that the second of two requests with one prompt finds more of it in the
    prefix cache."""
    cached = streamed["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= whole["prompt_tokens_details"]["cached_tokens"] <= cached < streamed["prompt_tokens"]
    strip = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}  # noqa: E731
    return strip(streamed) == strip(whole)


@pytest.fixture(scope="module", params=["llama2", "llama3"])
def served(request):
    ckpt, tok, _, _ = request.getfixturevalue(f"{request.param}_checkpoint")
    llama = Llama.build(ckpt, tok, max_seq_len=96, max_batch_size=4, device="cpu")
    stop = threading.Event()
    thread = threading.Thread(target=llama.engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    from fastapi.testclient import TestClient

    with TestClient(create_app(llama, "tiny")) as client:
        yield llama, client
    stop.set()
    thread.join(30)


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, path: str, body: dict) -> list[dict]:
    r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    payloads = [line[len("data:"):].strip() for line in r.text.splitlines() if line.startswith("data:")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def a_stop_string(text: str) -> str:
    """A few characters from the middle of ``text`` (so that the stop string lands inside it)."""
    middle = len(text) // 2
    return text[middle : middle + 3]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_echo_equals_the_library(served, prompt):
    llama, client = served
    kw = dict(temperature=1.0, top_p=1.0, seed=11)
    # The library echoes as Meta's reference decodes (BOS included: <|begin_of_text|> for
    # Llama 3, nothing for SentencePiece); the server as OpenAI does, without it.
    library = llama.text_completion([prompt], max_gen_len=12, echo=True, **kw)[0]["generation"]
    bos_text = "" if isinstance(llama.tokenizer, SentencePieceTokenizer) else "<|begin_of_text|>"
    assert library.startswith(bos_text)
    library = library[len(bos_text):]
    body = {"prompt": prompt, "max_tokens": 12, **kw, "echo": True}
    assert post(client, "/v1/completions", body)["choices"][0]["text"] == library
    streamed = "".join(c["choices"][0]["text"] for c in stream(client, "/v1/completions", body) if c["choices"])
    assert streamed == library
    with_logprobs = post(client, "/v1/completions", {**body, "logprobs": 2})["choices"][0]
    assert with_logprobs["text"] == library
    check_offsets(llama, with_logprobs["text"], with_logprobs["logprobs"])


def test_echo_is_the_joint_decode(served):
    """Independent of the library: the echo is prompt and completion decoded together
    (SentencePiece keeps the space at the seam), without BOS."""
    llama, client = served
    prompt = PROMPTS[0]
    ids = llama.tokenizer.encode(prompt, bos=True, eos=False)
    tokens, _ = llama.generate([ids], max_gen_len=8, temperature=0)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": True}
    expected = llama.tokenizer.decode(ids[1:] + tokens[0])
    assert post(client, "/v1/completions", body)["choices"][0]["text"] == expected
    # The library's echo is Meta's reference's: every token decoded, BOS included.
    assert llama.text_completion([prompt], max_gen_len=8, temperature=0, echo=True)[0]["generation"] == \
        llama.tokenizer.decode(ids + tokens[0])
    # token ids as the prompt: the same
    assert post(client, "/v1/completions", {**body, "prompt": ids})["choices"][0]["text"] == expected


def same_numbers(a, b) -> bool:
    """Equal structures, floats within 1e-4: the second request reuses the first's cached
    prompt, computed in another grouping, so its log-probabilities differ by float32 rounding
    (the same tokens: sampling draws in vocabulary order, see llama.engine.sampling)."""
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, abs=1e-4)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_numbers(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_numbers(x, y) for x, y in zip(a, b))
    return a == b


def check_offsets(llama, text: str, logprobs: dict) -> None:
    """Every token's text starts at its text_offset (a token whose text begins the text may
    have lost its leading space, and byte pieces of one character share its offset)."""
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and all(o <= len(text) for o in offsets)
    for token, offset in zip(logprobs["tokens"], offsets):
        if offset and token and "\ufffd" not in token:
            assert text[offset:].startswith(token), (token, offset, text)


@pytest.mark.parametrize("with_stop", [False, True])
def test_streamed_completion_equals_the_whole_one(served, with_stop):
    llama, client = served
    body = {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 1.0, "top_p": 1.0, "seed": 5, "logprobs": 3}
    if with_stop:
        free = post(client, "/v1/completions", body)["choices"][0]["text"]
        body["stop"] = [a_stop_string(free)]
    whole = post(client, "/v1/completions", body)
    chunks = stream(client, "/v1/completions", body)
    choice = whole["choices"][0]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in pieces) == choice["text"]
    assert pieces[-1]["finish_reason"] == choice["finish_reason"]
    assert same_usage(chunks[-1]["usage"], whole["usage"])
    listed = {k: [x for p in pieces if p["logprobs"] for x in p["logprobs"][k]] for k in choice["logprobs"]}
    assert same_numbers(listed, choice["logprobs"])
    assert len(listed["tokens"]) == whole["usage"]["completion_tokens"]
    check_offsets(llama, choice["text"], choice["logprobs"])
    if with_stop:
        assert choice["finish_reason"] == "stop" and body["stop"][0] not in choice["text"]


@pytest.mark.parametrize("with_stop", [False, True])
def test_streamed_chat_equals_the_whole_one(served, with_stop):
    llama, client = served
    body = {"messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 24, "temperature": 1.0,
            "top_p": 1.0, "seed": 3, "logprobs": True, "top_logprobs": 2}
    if with_stop:
        free = post(client, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
        body["stop"] = [a_stop_string(free)]
    whole = post(client, "/v1/chat/completions", body)
    chunks = stream(client, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == choice["message"]["content"]
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    assert same_usage(chunks[-1]["usage"], whole["usage"])
    listed = [e for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]]
    assert same_numbers(listed, choice["logprobs"]["content"])
    assert len(listed) == whole["usage"]["completion_tokens"]


def test_the_python_api_caps_stop_strings_as_the_server_does(served):
    """The library's calls refuse what the server refuses (llama.engine.detokenize.check_stop_strings)."""
    llama, client = served
    for stop in (["@"] * 17, ["@" * 257]):
        with pytest.raises(ValueError, match="at most"):
            llama.text_completion(["ROMEO:"], max_gen_len=2, stop=stop)
        with pytest.raises(ValueError, match="at most"):
            llama.chat_completion([[{"role": "user", "content": "Hi"}]], max_gen_len=2, stop=stop)
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2, "stop": stop})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    most = ["@" * 256] * 16
    assert llama.text_completion(["ROMEO:"], max_gen_len=2, stop=most, temperature=0)[0]["generation"] == \
        llama.text_completion(["ROMEO:"], max_gen_len=2, temperature=0)[0]["generation"]
