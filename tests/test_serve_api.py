"""The server's HTTP layer (llama/serve/app.py, llama/serve/openai_api.py) against a fake engine: request
checking, response shapes, streaming, errors, metrics.  Fast: no model, no torchrun (those are
in test_serve.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

import helpers
from fake_engine import SCRIPT, FakeEngine, served_model
from helpers import REPO
from llama.engine import EngineStopped, RequestSettings
from llama.formats.chat import B_INST, E_INST, Llama2ChatFormat
from llama.serve.openai_api import token_piece
from llama.tokenizer import load_tokenizer

MODEL = "demo-test"
MAX_QUEUE = 3


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(REPO / "demo" / "tokenizer.model")


@pytest.fixture
def engine(tokenizer):
    engine = FakeEngine(tokenizer, max_batch_size=4, max_seq_len=256, max_queue=8)
    yield engine
    engine.close()


@pytest.fixture
def client(engine, tokenizer):
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    llama = served_model(engine)
    with TestClient(create_app(llama, MODEL, max_queue=MAX_QUEUE)) as c:
        yield c


def script_text(tokenizer, n: int) -> str:
    """What the fake engine generates in ``n`` tokens."""
    return tokenizer.decode(tokenizer.encode(SCRIPT, bos=False, eos=False)[:n])


def sse_payloads(response) -> list:
    """The ``data:`` payloads of a server-sent-events body, parsed independently of the server."""
    out = []
    for block in response.text.replace("\r\n", "\n").split("\n\n"):
        data = [line[len("data:"):].strip() for line in block.split("\n") if line.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def check_error(r, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_models_list(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]


def test_completion_text_usage_and_length(client, tokenizer):
    prompt = "The quick brown fox"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == script_text(tokenizer, 5)
    assert choice["finish_reason"] == "length"
    n_prompt = len(tokenizer.encode(prompt, bos=True, eos=False))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_default_max_tokens_is_16(client, tokenizer):
    body = client.post("/v1/completions", json={"prompt": "Hi", "temperature": 0}).json()
    assert body["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("prompt", ["Hi", [1, 2, 3]])
def test_completion_max_tokens_null_is_the_default(client, prompt):
    """``"max_tokens": null`` (the API allows it) is as if it were not given: 16 tokens, not an
    internal error (it once reached the context check as None: a 500, found by the type checker)."""
    response = client.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": None})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16


def test_completion_prompt_list_and_token_ids(client, tokenizer):
    ids = tokenizer.encode("Hello", bos=True, eos=False)
    r = client.post("/v1/completions", json={"prompt": ["a", "bb"], "max_tokens": 2, "temperature": 0, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("a", bos=True, eos=False)) + len(
        tokenizer.encode("bb", bos=True, eos=False))
    assert body["usage"]["completion_tokens"] == 8
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_completion_to_stop_token(client, tokenizer):
    messages = [{"role": "user", "content": "Tell me a story"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": SCRIPT}
    assert choice["finish_reason"] == "stop"
    # Llama 2's template written out by hand: BOS "[INST] {user} [/INST]"
    n_prompt = len(tokenizer.encode(f"{B_INST} Tell me a story {E_INST}", bos=True, eos=False))
    n_script = len(tokenizer.encode(SCRIPT, bos=False, eos=False))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_script,
                             "total_tokens": n_prompt + n_script, "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_concatenates_to_the_full_text(client, tokenizer):
    req = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 9}
    full = client.post("/v1/chat/completions", json=req).json()
    r = client.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"] == script_text(tokenizer, 9)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_completion_stream_with_n(client, tokenizer):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0, "n": 2,
                                             "stream": True})
    texts = {0: "", 1: ""}
    for p in sse_payloads(r)[:-1]:
        for c in json.loads(p)["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: script_text(tokenizer, 4), 1: script_text(tokenizer, 4)}


def echoed(tokenizer, prompt: str, n: int) -> str:
    """What an echo of ``prompt`` followed by ``n`` script tokens reads: the prompt (without BOS)
    and the tokens decoded together, as text_completion(echo=True) gives it.  (Until 2026-11 the
    server decoded them apart, and SentencePiece dropped the space at the seam: "HelloOnce".)"""
    script = tokenizer.encode(SCRIPT, bos=False, eos=False)[:n]
    return tokenizer.decode(tokenizer.encode(prompt, bos=False, eos=False) + script)


def test_completion_stream_echo_and_usage(client, tokenizer):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "echo": True,
                                             "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echoed(tokenizer, "Hello", 3)
    assert echoed(tokenizer, "Hello", 3).startswith("Hello Once")
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_developer_and_tool_roles_map_to_llama_roles(client, engine, tokenizer):
    # "developer" is OpenAI's newer name for "system": the prompt is the one a system message makes
    req = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
           "max_tokens": 1}
    client.post("/v1/chat/completions", json=req)
    expected = Llama2ChatFormat(tokenizer).encode_dialog_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert engine.submitted[-1].prompt_tokens == expected
    # content given as a list of text parts
    client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}], "max_tokens": 1})
    assert engine.submitted[-1].prompt_tokens == Llama2ChatFormat(tokenizer).encode_dialog_prompt(
        [{"role": "user", "content": "Hi"}])


def test_stop_strings(client):
    for stop in ("little", ["village", "girl"]):
        body = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stop": stop}).json()
        first = min(SCRIPT.find(s) for s in ([stop] if isinstance(stop, str) else stop))
        assert body["choices"][0]["message"]["content"] == SCRIPT[:first]
        assert body["choices"][0]["finish_reason"] == "stop"


def test_stop_strings_are_capped(client, engine):
    """At most 16 stop strings of at most 256 characters (OpenAI allows 4): they are looked for
    after every token inside the engine's step, so 20,000 of 500 characters made every request
    in the batch wait (a bystander's 30 tokens took 10 s instead of 0.04)."""
    from llama.engine.detokenize import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, check_stop_strings
    from llama.serve import limits

    assert (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS) == (16, 256)  # as docs/serving.md says
    assert (limits.MAX_STOP_STRINGS, limits.MAX_STOP_STRING_CHARS) == (16, 256)  # as --help says (the same names)
    n_submitted = len(engine.submitted)
    for stop, says in ((["@"] * 17, "17 strings; at most 16"), (["@" * 257], "257 characters; at most 256"),
                       (["@" * 10] * 20_000, "20000 strings; at most 16")):
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            err = check_error(client.post(path, json={**body, "stop": stop}), 400, param="stop")
            assert says in err["message"], err
        with pytest.raises(ValueError, match=re.escape(says)):  # the Python API's own check
            check_stop_strings(stop)
    assert len(engine.submitted) == n_submitted
    most = [f"\u00a7{i}" + "@" * (MAX_STOP_STRING_CHARS - 2 - len(str(i))) + "\u00a7" for i in range(16)]
    assert max(map(len, most)) == 256
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "temperature": 0, "stop": most})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == script_text(engine.tokenizer, 5)


def test_seed_per_choice(client, engine):
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "temperature": 1, "seed": 7, "n": 2})
    assert [r.settings.seed for r in engine.submitted] == [7, 8]


def test_settings_reach_the_engine(client, engine):
    client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.3, "top_p": 0.5, "top_k": 7,
        "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "stop": "x"})
    s = engine.submitted[-1].settings
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.logprobs, s.top_logprobs, s.stop) == (
        0.3, 0.5, 7, 3, True, 2, ("x",))


def test_chat_logprobs(client, tokenizer):
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 6,
        "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    ids = tokenizer.encode(SCRIPT, bos=False, eos=False)[:6]
    assert [e["logprob"] for e in content] == pytest.approx([-(k + 1) / 10 for k in range(6)])
    assert [e["token"] for e in content] == [tokenizer.sp_model.id_to_piece(i).replace("\u2581", " ") for i in ids]
    assert "".join(e["token"] for e in content).lstrip() == body["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in content)
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in content)


def test_completion_logprobs_and_echo(client, tokenizer):
    prompt = "Hello there"
    body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                 "logprobs": 1, "echo": True}).json()
    c = body["choices"][0]
    assert c["text"] == echoed(tokenizer, prompt, 3)
    n_prompt = len(tokenizer.encode(prompt, bos=True, eos=False))
    lp = c["logprobs"]
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:n_prompt] == [-1.0] * (n_prompt - 1)
    assert lp["token_logprobs"][n_prompt:] == pytest.approx([-0.1, -0.2, -0.3])
    # Each token's text starts at its offset in the text (BOS and the first word, whose space
    # SentencePiece drops at the start of a text, at 0).
    assert lp["text_offset"][:2] == [0, 0]
    for token, offset in list(zip(lp["tokens"], lp["text_offset"]))[2:]:
        assert c["text"][offset:].startswith(token), (token, offset)


def test_token_piece_round_trip(tokenizer):
    ids = tokenizer.encode("café\nnaïve 😀", bos=False, eos=False)
    assert b"".join(token_piece(tokenizer, i)[1] for i in ids).decode().lstrip() == "café\nnaïve 😀"


# -- bad requests --


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({}, "messages"),
])
def test_bad_chat_requests_get_400(client, body, param):
    check_error(client.post("/v1/chat/completions", json=body), 400, param=param)


@pytest.mark.parametrize("body, param", [
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": []}, "prompt"),
])
def test_bad_completion_requests_get_400(client, body, param):
    check_error(client.post("/v1/completions", json=body), 400, param=param)


def test_invalid_json_gets_400(client):
    r = client.post("/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    check_error(r, 400)


def post_raw(client, path: str, body: bytes, content_type: str = "application/json"):
    return client.post(path, content=body, headers={"Content-Type": content_type})


@pytest.mark.parametrize("body, says", [
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "more than 64 levels deep"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not a JSON value"),
    (b'{"prompt": "x", "top_p": Infinity}', "Infinity is not a JSON value"),
    (b'["prompt", "x"]', "must be a JSON object"),
    (b"", "not valid JSON"),
], ids=["invalid UTF-8", "100,000 levels deep", "5,000 digits", "NaN", "Infinity", "an array", "empty"])
def test_malformed_bodies_get_openai_error_objects(client, body, says):
    """Until 2026-11 these got FastAPI's {"detail": ...} instead of an OpenAI error object."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert says in check_error(post_raw(client, path, body), 400)["message"]


def test_nesting_up_to_64_levels_is_accepted(client):
    def body(levels: int) -> bytes:  # the object holding "user" is the first level
        return b'{"prompt": "x", "max_tokens": 1, "user": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"

    assert post_raw(client, "/v1/completions", body(64)).status_code == 200
    check_error(post_raw(client, "/v1/completions", body(65)), 400)


def test_a_body_that_is_not_json_gets_400(client):
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        err = check_error(post_raw(client, "/v1/completions", b'{"prompt": "x"}', content_type), 400)
        assert "Content-Type: application/json" in err["message"]
    assert post_raw(client, "/v1/completions", b'{"prompt": "x", "max_tokens": 1}',
                    "application/json; charset=utf-8").status_code == 200


def test_unknown_routes_and_methods_get_openai_error_objects(client):
    for method, path in (("get", "/nothing"), ("post", "/v1/nothing"), ("get", "/v1/chat")):
        assert "/v1/completions" in check_error(getattr(client, method)(path), 404, code="not_found")["message"]
    r = client.get("/v1/completions")
    assert "POST" in check_error(r, 405, code="method_not_allowed")["message"] and r.headers["allow"] == "POST"
    check_error(client.delete("/health"), 405)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", rb'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["ok", "\udfff"]}', "prompt.1"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\udbff"}]}', "messages.0.content"),
    ("/v1/completions", rb'{"prompt": "x", "stop": ["\ud800"]}', "stop.0"),
])
def test_a_lone_surrogate_is_a_400(client, path, body, param):
    """A lone surrogate (a JSON escape only) is not Unicode text: 400, where a completions prompt
    holding one was a 500 (the tokenizer refused it after the request was checked)."""
    err = check_error(post_raw(client, path, body), 400, param=param)
    assert "lone surrogate" in err["message"]


def test_a_surrogate_pair_is_text(client, engine, tokenizer):
    r = post_raw(client, "/v1/completions", rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].prompt_tokens == tokenizer.encode("\U0001F600", bos=True, eos=False)


def test_a_request_that_can_never_fit_is_a_400(client, engine):
    """n x prompts above the slots plus --max_queue: 429 told the client to retry, forever."""
    capacity = engine.max_batch_size + MAX_QUEUE
    err = check_error(client.post("/v1/completions", json={"prompt": ["a"] * capacity, "n": 2, "max_tokens": 1}),
                      400, param="n", code="too_many_generations")
    assert f"{engine.max_batch_size} running + {MAX_QUEUE} queued" in err["message"]
    check_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "n": capacity + 1}), 400, param="n")
    r = client.post("/v1/completions", json={"prompt": ["a"] * capacity, "max_tokens": 1})  # just fits
    assert r.status_code == 200 and len(r.json()["choices"]) == capacity


def test_dialog_the_template_refuses_gets_400(client):
    # Llama 2's format needs user/assistant alternation ending with a user message
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "hi"}]})
    check_error(r, 400, param="messages")


def test_unknown_model_gets_404(client):
    r = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    check_error(r, 404, param="model", code="model_not_found")


def test_context_length_exceeded(client, engine):
    long_prompt = "word " * 300  # more than the fake's 256-token context
    check_error(client.post("/v1/completions", json={"prompt": long_prompt}), 400,
                code="context_length_exceeded")
    check_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 255}), 400,
                param="max_tokens", code="context_length_exceeded")
    check_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 256}), 400,
        param="max_completion_tokens", code="context_length_exceeded")
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10}).status_code == 200


def test_full_queue_gets_429_with_retry_after(client, engine):
    """Requests beyond the free slots plus max_queue wait nowhere: 429, and the others are served."""
    import threading
    import time

    engine.paused.set()  # nothing is admitted: every request waits
    n_fit = engine.max_batch_size + MAX_QUEUE
    results = []
    threads = [threading.Thread(target=lambda: results.append(client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1}))) for _ in range(n_fit)]
    for t in threads:
        t.start()
    deadline = time.time() + 10
    while engine.stats()["queued"] < n_fit and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats()["queued"] == n_fit
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    check_error(r, 429, code="queue_full")
    assert int(r.headers["Retry-After"]) >= 1
    engine.paused.clear()
    for t in threads:
        t.join(10)
    assert [x.status_code for x in results] == [200] * n_fit


def test_engine_busy_gets_429(client, engine):
    engine.max_queue = 1
    engine.paused.set()
    engine.submit([1, 2], RequestSettings(max_new_tokens=1))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 1})
    check_error(r, 429, code="queue_full")
    assert r.headers["Retry-After"]
    engine.paused.clear()


def test_engine_failure_mid_stream_ends_with_an_error_event(client, engine):
    engine.paused.set()
    import threading

    threading.Timer(0.3, engine.fail_all, args=(RuntimeError("rank 1 died"),)).start()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    assert "rank 1 died" in json.loads(payloads[-2])["error"]["message"]


def test_stopping_engine_answers_503(client, engine):
    engine.paused.set()
    import threading

    threading.Timer(0.3, engine.stop_all).start()
    r = client.post("/v1/completions", json={"prompt": "x"})
    check_error(r, 503, code="shutting_down")
    assert isinstance(EngineStopped("x"), RuntimeError)


def test_tools_on_a_format_without_tools_get_400(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
    err = check_error(r, 400, param="tools")
    assert "Llama 3.1" in err["message"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def llama3_tokenizer():
    """Meta's Llama 3 tokenizer, and the structured-output manager of the module's fake Llama 3
    servers (which builds the tokenizer as grammars see it, seconds for 128k ids, once)."""
    from llama.structured import StructuredOutputs

    tokenizer = load_tokenizer(helpers.llama3_tokenizer_path())
    return tokenizer, StructuredOutputs(tokenizer, compile_timeout_s=None)  # (as fake_engine.served_model's)


@pytest.fixture
def llama3_server(llama3_tokenizer):
    """A fake engine behind a Llama 3 chat format whose "model" answers with a JSON tool call."""
    from fastapi.testclient import TestClient

    from llama.formats.chat import chat_format_for
    from llama.serve import create_app

    tokenizer, structured = llama3_tokenizer
    engine = FakeEngine(tokenizer, max_batch_size=2, max_seq_len=2048)
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    engine.script = tokenizer.encode(call, bos=False, eos=False) + [tokenizer.eot_id]
    formatter = chat_format_for(tokenizer)
    llama = served_model(engine, formatter)
    llama.structured = structured
    with TestClient(create_app(llama, MODEL)) as c:
        yield c, engine, formatter
    engine.close()


def test_tool_calls(llama3_server):
    client, engine, formatter = llama3_server
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL],
                                                     "temperature": 0}).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"] is None
    prompt = engine.submitted[-1].prompt_tokens
    assert prompt == formatter.encode_dialog_prompt(messages, tools=[WEATHER_TOOL])
    assert prompt != formatter.encode_dialog_prompt(messages)  # the tools were declared
    assert engine.submitted[-1].settings.stop_tokens == formatter.stop_tokens

    # streamed: the call arrives as one tool_calls delta, then finish_reason "tool_calls"
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL], "stream": True,
                                                  "temperature": 0})
    chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "get_weather" and calls[0][0]["index"] == 0
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    # the next turn: the assistant's call and the tool's answer go back into the dialog
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": call["function"]}]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]
    r = client.post("/v1/chat/completions", json={"messages": follow, "tools": [WEATHER_TOOL], "max_tokens": 2})
    assert r.status_code == 200, r.text
    library_dialog = messages + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"call_id": call["id"], "tool_name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"role": "ipython", "content": '{"temperature": 21}'}]
    assert engine.submitted[-1].prompt_tokens == formatter.encode_dialog_prompt(library_dialog, tools=[WEATHER_TOOL])
    bad = [{**follow[1], "tool_calls": [{"id": "x", "type": "function",
                                          "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    check_error(client.post("/v1/chat/completions", json={"messages": messages + bad + follow[2:],
                                                          "tools": [WEATHER_TOOL]}), 400,
                param="messages.1.tool_calls.0")


@pytest.mark.parametrize("extra, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes", "tools": [WEATHER_TOOL]}, "tool_choice", "must be one of"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tool_choice": "required", "tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}},
     "tool_choice", "one or the other"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "format": "bogus"}}}}}]},
     "tools", "tools[0].function.parameters"),
    ({"tool_choice": "required", "tools": [{"type": "nope"}]}, "tools", "tools[0] must be"),
    ({"tool_choice": "required", "tools": [WEATHER_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", None),
])
def test_a_tool_choice_that_cannot_be_honoured_is_a_400(llama3_server, extra, param, message):
    client, engine, _ = llama3_server
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}
    n_submitted = len(engine.submitted)
    err = check_error(client.post("/v1/chat/completions", json=body), 400, param=param)
    assert message is None or message in err["message"]
    assert len(engine.submitted) == n_submitted


def test_tool_choice_none_leaves_the_tools_out(llama3_server):
    """"none": the model is not told of the tools, and a reply that looks like a call is content."""
    client, engine, formatter = llama3_server
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL],
                                                     "tool_choice": "none"}).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert json.loads(choice["message"]["content"])["name"] == "get_weather"
    assert engine.submitted[-1].prompt_tokens == formatter.encode_dialog_prompt(messages)
    assert engine.submitted[-1].settings.grammar is None


def test_tool_choice_auto_and_none_without_tools(llama3_server):
    client, _, _ = llama3_server
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL],
                                                     "tool_choice": "auto"}).json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    for extra in ({"tool_choice": "none"}, {"tool_choice": "auto"}):
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, **extra})
        assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


PARIS_CALLS = ('{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
               '{"type": "function", "name": "get_weather", "parameters": {"city": "Oslo", "days": 5}}')


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_reply_streams_its_calls_as_deltas(llama3_server, tool_choice):
    """The calls come as OpenAI's tool-call deltas while the model writes them (id and name,
    then argument fragments), and put together they are the non-streamed calls."""
    client, engine, formatter = llama3_server
    tok = formatter.tokenizer
    tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    choice, chunks = scripted_reply(client, engine, tok.encode(PARIS_CALLS, bos=False, eos=False) + [tok.eot_id],
                                    [tool], tool_choice=tool_choice)
    assert engine.submitted[-1].settings.grammar is not None
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        {"city": "Paris", "days": 2}, {"city": "Oslo", "days": 5}]
    with_calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert len(with_calls) >= 6  # two announcements and two fragments each (then the closing braces)
    assembled: dict[int, dict] = {}
    for deltas in with_calls:
        for d in deltas:
            call = assembled.setdefault(d["index"],
                                        {"id": d.get("id"), "name": d["function"].get("name"), "arguments": ""})
            call["arguments"] += d["function"].get("arguments", "")
    assert [(c["name"], c["arguments"]) for c in assembled.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert all(c["id"] for c in assembled.values())
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


def scripted_reply(client, engine, script: list[int], tools, **extra) -> tuple[dict, list[dict]]:
    """(non-streamed choice, streamed chunks) of a chat request whose "model" writes ``script``."""
    engine.script = script
    body = {"messages": [{"role": "user", "content": "Go"}], "tools": tools, "temperature": 0, **extra}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    return choice, [json.loads(p) for p in sse_payloads(r)[:-1]]


@pytest.mark.parametrize("ending", ["stop token", "stop string", "length"])
def test_literal_python_tag_text_is_never_a_call(llama3_server, ending):
    """``<|python_tag|>print(42)`` written as characters, ended by a stop token, a stop string or
    max_tokens: content, finish_reason stop/length, never a code_interpreter call (before, a stop
    string or the length limit parsed the decoded text and returned one)."""
    client, engine, formatter = llama3_server
    tok = formatter.tokenizer
    literal = tok.encode("<|python_tag|>print(42)", bos=False, eos=False)
    extra: dict = {}
    if ending == "stop token":
        script = literal + [tok.eom_id]
    elif ending == "stop string":
        script, extra = literal + tok.encode(" END", bos=False, eos=False), {"stop": ["END"]}
    else:
        script, extra = literal + tok.encode(" more words", bos=False, eos=False), {"max_tokens": len(literal)}
    choice, chunks = scripted_reply(client, engine, script, [WEATHER_TOOL], **extra)
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"].strip() == "<|python_tag|>print(42)"
    assert choice["finish_reason"] == ("length" if ending == "length" else "stop")
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_a_real_call_cut_by_max_tokens_is_length_with_its_text(llama3_server):
    client, engine, formatter = llama3_server
    tok = formatter.tokenizer
    call = tok.encode('{"name": "get_weather", "parameters": {"city": "Paris"}}', bos=False, eos=False)
    choice, chunks = scripted_reply(client, engine, call + [tok.eot_id], [WEATHER_TOOL], max_tokens=len(call) - 2)
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == tok.decode(call[:-2])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


CUT_CALLS = {
    "json": PARIS_CALLS,
    "python_list": '[get_weather(city="Paris", days=2), get_weather(city="Oslo", days=5)]',
}


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("tool_prompt_format", sorted(CUT_CALLS))
def test_a_required_reply_cut_by_max_tokens_is_the_same_streamed_or_not(llama3_tokenizer, tool_prompt_format):
    """A reply constrained to calls (tool_choice "required") that max_tokens cuts, here and there:
    finish_reason "length" either way, and the same message: the text as content while no call
    is announced yet, else (as OpenAI cuts a call) the calls announced so far with the arguments
    completed before the cut, content null.  Before, the stream announced a call (with empty or
    partial arguments) while the whole reply gave the text as content."""
    from fastapi.testclient import TestClient

    from llama.formats.chat import chat_format_for
    from llama.serve import create_app

    tokenizer, structured = llama3_tokenizer
    engine = FakeEngine(tokenizer, max_batch_size=2, max_seq_len=2048, step_s=0.0005)
    tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    script = tokenizer.encode(CUT_CALLS[tool_prompt_format], bos=False, eos=False)
    llama = served_model(engine, chat_format_for(tokenizer))
    llama.structured = structured
    seen = set()
    try:
        with TestClient(create_app(llama, MODEL, tool_prompt_format=tool_prompt_format)) as client:
            for cut in sorted({*range(1, len(script), 3), len(script)}):  # (every token: 3 s more)
                choice, chunks = scripted_reply(client, engine, script + [tokenizer.eot_id], [tool],
                                                tool_choice="required", max_tokens=cut)
                message = choice["message"]
                assert choice["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == "length"
                deltas = [c["choices"][0]["delta"] for c in chunks]
                content = "".join(d.get("content") or "" for d in deltas)
                streamed: dict[int, dict] = {}
                for d in (t for d in deltas for t in d.get("tool_calls") or []):
                    call = streamed.setdefault(d["index"], {"name": "", "arguments": ""})
                    call["name"] += d["function"].get("name") or ""
                    call["arguments"] += d["function"].get("arguments") or ""
                whole = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in message.get("tool_calls") or []]
                assert [streamed[k] for k in sorted(streamed)] == whole, cut
                assert content == (message["content"] or ""), cut
                if whole:
                    assert message["content"] is None and all(c["id"] for c in message["tool_calls"])
                else:
                    assert message["content"] == tokenizer.decode(script[:cut])
                seen.add((len(whole), bool(whole and whole[-1]["arguments"])))
    finally:
        engine.close()
    assert seen >= {(0, False), (1, False), (1, True), (2, False), (2, True)}  # every kind of cut happened


def test_calls_to_undeclared_tools_stay_text(llama3_server):
    client, engine, formatter = llama3_server
    tok = formatter.tokenizer
    for text in ('{"name": "launch_missiles", "parameters": {"when": "now"}}', 'brave_search.call(query="x")',
                 '[get_weather(city="Paris"), launch_missiles(when="now")]'):
        choice, _ = scripted_reply(client, engine, tok.encode(text, bos=False, eos=False) + [tok.eot_id],
                                   [WEATHER_TOOL])
        assert "tool_calls" not in choice["message"] and choice["message"]["content"] == text
        assert choice["finish_reason"] == "stop"
    code = [tok.python_tag_id] + tok.encode("print(42)", bos=False, eos=False) + [tok.eom_id]
    choice, _ = scripted_reply(client, engine, code, [WEATHER_TOOL])  # code_interpreter is not declared
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


# -- the rest --


def test_health_metrics_and_page(client, tokenizer):
    assert client.get("/health").json() == {"status": "ok"}  # nothing about other requests
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
    client.post("/v1/completions", json={"prompt": 5})
    metrics = client.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert samples[("llama_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert samples[("llama_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
    assert samples[("llama_generation_tokens_total", ())] == 3
    assert samples[("llama_time_to_first_token_seconds_count", ())] == 1
    assert samples[("llama_slots_total", ())] == 4
    assert ("llama_queue_depth", ()) in samples and ("llama_slots_in_use", ()) in samples
    docs = client.get("/openapi.json").json()  # the bodies read by hand are still documented
    completion = docs["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "prompt" in docs["components"]["schemas"][completion["$ref"].rsplit("/", 1)[1]]["properties"]
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text


def test_the_fake_and_the_real_engine_meet_the_servers_contract():
    """The server is written against llama.serve.protocols.ServedEngine: the engine and the fake
    take the arguments it passes, under the same names (any further ones have defaults)."""
    import inspect

    from llama.engine import Engine
    from llama.serve.protocols import ServedEngine

    for name in ("submit", "stats", "arriving", "run_forever"):
        wanted = list(inspect.signature(getattr(ServedEngine, name)).parameters)
        for impl in (Engine, FakeEngine):
            params = inspect.signature(getattr(impl, name)).parameters
            assert list(params)[: len(wanted)] == wanted, (impl, name)
            assert all(p.default is not p.empty for p in list(params.values())[len(wanted):]), (impl, name)


ACCESS_LINE = re.compile(r'^(\S+) "(\S+) (\S+)" (\d+) prompt_tokens=(\S+) completion_tokens=(\S+) (\d+\.\d+)s$')


def test_one_access_log_line_per_request(client, tokenizer, caplog):
    """Method, path, status, prompt and generated tokens (as the answer's usage says) and the
    seconds taken; never the prompt's text."""
    import logging

    secret = "the launch codes are 0000"
    caplog.set_level(logging.INFO, logger="llama.serve.access")
    usages = [
        client.post("/v1/completions", json={"prompt": secret, "max_tokens": 3, "temperature": 0}).json()["usage"],
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": secret}], "n": 2,
                                                  "max_tokens": 4, "temperature": 0}).json()["usage"],
    ]
    stream = client.post("/v1/completions", json={"prompt": secret, "max_tokens": 5, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    usages.append(json.loads(sse_payloads(stream)[-2])["usage"])
    client.post("/v1/completions", json={"prompt": secret, "temperature": "hot"})
    client.get("/nowhere")
    client.get("/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "llama.serve.access"]
    assert not any("launch codes" in line for line in lines)
    parsed = [ACCESS_LINE.match(line) for line in lines]
    assert all(parsed), lines
    got = [m.groups()[1:6] for m in parsed]
    assert got == [
        ("POST", "/v1/completions", "200", str(usages[0]["prompt_tokens"]), "3"),
        ("POST", "/v1/chat/completions", "200", str(usages[1]["prompt_tokens"]), "8"),
        ("POST", "/v1/completions", "200", str(usages[2]["prompt_tokens"]), "5"),
        ("POST", "/v1/completions", "400", "-", "-"),
        ("GET", "/nowhere", "404", "-", "-"),
        ("GET", "/health", "200", "-", "-"),
    ], lines
    assert usages[0]["prompt_tokens"] == len(tokenizer.encode(secret, bos=True, eos=False))
    assert all(0 <= float(m.group(7)) < 10 for m in parsed)


def test_repeated_log_messages_are_written_once_per_interval():
    """The RepeatFilter the server puts on its log handlers (llama/serve/logs.py)."""
    import logging

    from llama.serve.logs import RepeatFilter

    f = RepeatFilter(interval_s=0.2)

    def record(name: str, msg: str, *args) -> logging.LogRecord:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)

    passed = [r for r in (record("uvicorn.error", "bad request from %s", i) for i in range(1000)) if f.filter(r)]
    assert [r.getMessage() for r in passed] == ["bad request from 0"]
    assert f.filter(record("uvicorn.error", "another message"))  # another kind
    assert f.filter(record("llama.serve.errors", "bad request from %s", 1))  # another logger
    assert all(f.filter(record("llama.serve.access", "GET / 200")) for _ in range(10))  # never filtered
    time.sleep(0.25)
    later = record("uvicorn.error", "bad request from %s", 1000)
    assert f.filter(later) and later.getMessage() == \
        "bad request from 1000 (999 more like this within 0.2 s were not logged)"
    assert not f.filter(record("uvicorn.error", "bad request from %s", 1001))
    assert not f.filter(record("uvicorn.error", "bad request from %s", 1002))
    (pending,) = f.flush()
    assert pending.getMessage() == "bad request from 1002 (1 more like this within 0.2 s were not logged)"
    assert f.flush() == []


def test_help_is_fast():
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "llama.serve", "--help"], capture_output=True, text=True, timeout=60,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and "--ckpt_dir" in r.stdout and "--max_queue" in r.stdout
    assert time.monotonic() - start < 30


def run_serve(*args: str) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """``python -m llama.serve ARGS`` (with -X importtime): the result, its wall time, the modules it imported."""
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "llama.serve", *args], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    took = time.monotonic() - start
    imported = [line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    r.stderr = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("import time:"))
    return r, took, imported


def test_a_wrong_checkpoint_directory_is_told_before_torch_is_imported():
    """It took 6 s on a busy machine: torch was imported before the path was looked at."""
    r, took, imported = run_serve("--ckpt_dir", "/nowhere/Llama-3-8B", "--device", "cpu")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "llama-serve: error: checkpoint directory /nowhere/Llama-3-8B not found: check --ckpt_dir"], r.stderr
    assert "torch" not in imported and "llama.serve" in imported
    assert took < 5, took  # (0.2 s here; the margin is for a busy machine)


@pytest.mark.parametrize("args, says", [
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--device", "cuda:one"], "argument --device: expected cpu, cuda or cuda:N, got 'cuda:one'"),
    (["--max_batch_size", "0"], "argument --max_batch_size: expected a positive whole number, got '0'"),
    (["--max_seq_len", "0"], "argument --max_seq_len: expected a positive whole number, got '0'"),
    (["--max_queue", "0"], "argument --max_queue: expected a positive whole number, got '0'"),
    (["--max_request_bytes", "-1"], "argument --max_request_bytes: expected a positive whole number, got '-1'"),
    (["--shutdown_grace_s", "nan"], "argument --shutdown_grace_s: expected a finite number >= 0, got 'nan'"),
    (["--kv_cache_memory", "1"],
     "argument --kv_cache_memory: expected a number between 0 and 1, both excluded (e.g. 0.9), got '1'"),
    (["--kv_cache_memory", "0"],
     "argument --kv_cache_memory: expected a number between 0 and 1, both excluded (e.g. 0.9), got '0'"),
])
def test_bad_flags_are_one_line_in_our_words(args, says):
    """--device tpu appended torch's list of 20 device types; a size of 0 ended in a bare SystemExit message."""
    r, _, imported = run_serve(*args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"llama-serve: error: {says} (see --help)"], r.stderr
    assert "torch" not in imported


def test_help_shows_every_default():
    from llama.serve.server import _parser

    parser = _parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 20
    for action in options:
        assert "default" in (action.help or ""), action.option_strings
    text = parser.format_help()
    assert "at most 16 stop strings of at most 256 characters" in text


def test_the_demo_is_served_with_its_own_context_length(monkeypatch):
    """Without --max_seq_len the bundled demo model gets 256 tokens of context, as the examples give
    it (it was 2048, which the demo model was never trained for); a --ckpt_dir gets 2048."""
    import llama.engine.build
    import llama.serve.server as server

    built = []

    class Built(Exception):
        pass

    def build(**kwargs):
        built.append(kwargs)
        raise Built

    monkeypatch.setattr(llama.engine.build, "build_engine", build)
    monkeypatch.setattr(server, "bind_socket", lambda host, port: None)
    for argv, expected in (([], 256), (["--max_seq_len", "100"], 100), (["--ckpt_dir", str(REPO / "demo")], 2048)):
        with pytest.raises(Built):
            server.main(argv + ["--device", "cpu"])
        assert built[-1]["max_seq_len"] == expected, argv


def test_cli_ends_as_the_example_scripts_do(monkeypatch, capsys):
    """llama-serve's console script: Ctrl-C before serving (while the model loads) ends in one
    line and status 130, a bad input in one ``llama-serve: error:`` line and status 1, and the
    server's own exit status comes through.  (The real SIGINT path through run_script is
    exercised by the chat example's Ctrl-C test.)"""
    import llama.serve.server as serve

    def interrupted():
        raise KeyboardInterrupt

    def bad_checkpoint():
        raise FileNotFoundError("checkpoint directory /nowhere not found: check --ckpt_dir")

    for main, status, last_line in ((interrupted, 130, "interrupted"),
                                    (bad_checkpoint, 1, "llama-serve: error: checkpoint directory /nowhere not found"),
                                    (lambda: 3, 3, None), (lambda: 0, 0, None)):
        monkeypatch.setattr(serve, "main", main)
        with pytest.raises(SystemExit) as ended:
            serve.cli()
        assert ended.value.code == status
        err = capsys.readouterr().err
        assert "Traceback" not in err
        if last_line:
            assert err.strip().splitlines()[-1].startswith(last_line), err


@pytest.mark.parametrize("reply, calls", [
    ("The weather in Paris is mild today; take a light coat.", 0),
    ('Let me check.\n<function=get_weather>{"city": "Paris"}</function>', 1),
    ('Let me check. <function=launch>{"when": "now"}</function>', 0),  # undeclared: all of it is text
])
def test_an_auto_reply_streams_its_text_as_it_is_written(llama3_server, reply, calls):
    """Under tool_choice "auto" a reply may be calls or text: the text that no ending can take
    back streams as it comes (a plain answer as it is written, not held back to the end); the
    calls, and the rest, come at the end; put together it is the non-streamed reply."""
    client, engine, formatter = llama3_server
    tok = formatter.tokenizer
    choice, chunks = scripted_reply(client, engine, tok.encode(reply, bos=False, eos=False) + [tok.eot_id],
                                    [WEATHER_TOOL])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(content) == (choice["message"]["content"] or "")
    streamed_calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert len(streamed_calls) == calls == len(choice["message"].get("tool_calls") or [])
    if calls:
        first_call = next(k for k, d in enumerate(deltas) if d.get("tool_calls"))
        before = [d["content"] for d in deltas[:first_call] if d.get("content")]
        assert len(before) > 1 and "".join(before) == "Let me check."  # sent before the reply ended
        assert streamed_calls[0]["function"] == choice["message"]["tool_calls"][0]["function"]
    else:
        assert len(content) >= 4  # token by token, not one piece at the end
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
