"""Every body the server writes is JSON (llama/serve/finite_json.py): no NaN or Infinity in any
response or event, whatever the endpoint, format and options, read with a strict parser.

Before, a constrained reply asked for top_logprobs listed the tokens its grammar forbids with
log-probability -inf: a 500 after the whole generation when not streamed ("Out of range float
values are not JSON compliant"), ``-Infinity`` (not JSON) in streamed chunks.  Now the engine
lists no forbidden token (tests/test_structured_output.py checks which it lists), and the
response class and the event writer replace any non-finite number that gets through (-inf by
-9999.0, NaN and +inf by null) and log it.

Also here, with the real model: a reply constrained to tool calls that max_tokens cuts is the
same message streamed or not (tests/test_serve_api.py checks it at every kind of cut)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading

import pytest

from fake_engine import FakeEngine, served_model
from helpers import REPO
from llama.serve.finite_json import NEGATIVE_INFINITY_STAND_IN, FiniteJSONResponse, dumps
from llama.tokenizer import load_tokenizer
from test_grammar import ARITHMETIC, SCHEMAS, json_schema_format


def strict_json(text: str):
    """``text`` parsed as JSON as RFC 8259 has it: NaN, Infinity and -Infinity are refused
    (Python's json reads them by default), and so is a number no double holds (1e999)."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON: {text[:200]}")

    def finite_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"{literal} is beyond a double: {text[:200]}")
        return value

    return json.loads(text, parse_constant=refuse, parse_float=finite_float)


def sse_events(response) -> list:
    """The ``data:`` payloads of a server-sent-events body, each parsed strictly; it must end with ``[DONE]``."""
    payloads = []
    for block in response.text.replace("\r\n", "\n").split("\n\n"):
        data = [line[len("data:"):].strip() for line in block.split("\n") if line.startswith("data:")]
        if data:
            payloads.append("\n".join(data))
    assert payloads and payloads[-1] == "[DONE]", response.text[-300:]
    return [strict_json(p) for p in payloads[:-1]]


# -- the writer ----------------------------------------------------------------------------


def test_finite_bodies_are_written_as_json_dumps_writes_them():
    body = {"a": [1, -0.5, None, "x\u00e9"], "b": {"c": 1e308, "d": -1e-320}, "e": True}
    assert dumps(body) == json.dumps(body)
    assert dumps(body, separators=(",", ":"), ensure_ascii=False) == json.dumps(body, separators=(",", ":"),
                                                                                  ensure_ascii=False)
    from starlette.responses import JSONResponse

    assert FiniteJSONResponse(body).body == JSONResponse(body).body


def test_non_finite_numbers_are_replaced_and_logged(caplog):
    body = {"choices": [{"logprobs": {"token_logprobs": [-0.5, -math.inf], "top_logprobs": [{"a": math.nan}]}}],
            "x": (math.inf, 2.0)}
    with pytest.raises(ValueError):  # what starlette's JSONResponse does with it: a 500
        json.dumps(body, allow_nan=False)
    for written in (json.dumps(body), '{"a": 1e999}'):  # what an event held: not JSON
        with pytest.raises(ValueError, match="not JSON|beyond a double"):
            strict_json(written)
    with caplog.at_level(logging.WARNING, logger="llama.serve.finite_json"):
        parsed = strict_json(dumps(body))
        assert strict_json(FiniteJSONResponse(body).body.decode()) == parsed
    assert parsed == {"choices": [{"logprobs": {"token_logprobs": [-0.5, NEGATIVE_INFINITY_STAND_IN],
                                                "top_logprobs": [{"a": None}]}}], "x": [None, 2.0]}
    assert body["choices"][0]["logprobs"]["token_logprobs"][1] == -math.inf  # the caller's object is left alone
    (record, _) = [r for r in caplog.records if r.name == "llama.serve.finite_json"]
    message = record.getMessage()
    assert "3 numbers" in message and "$.choices[0].logprobs.token_logprobs[1]=-inf" in message
    assert "$.x[0]=inf" in message


def test_other_errors_of_json_dumps_still_raise():
    with pytest.raises(TypeError):
        dumps({"a": object()})
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular"):
        dumps(loop)


# -- the guard, through the server: numbers the engine should never give -----------------


class NonFiniteEngine(FakeEngine):
    """The fake engine, with log-probabilities that are not numbers JSON can hold: -inf for the
    chosen tokens, NaN and +inf among the alternatives, -inf for the prompt's."""

    def _emit(self, req, item):
        if isinstance(item, BaseException) or req.on_event is None:
            return super()._emit(req, item)
        if hasattr(item, "top_logprobs"):  # a TokenEvent
            if item.token is not None:
                item = dataclasses.replace(item, logprob=-math.inf if item.logprob is not None else None,
                                           top_logprobs=[(item.token, math.nan), (0, math.inf)]
                                           if item.top_logprobs else None)
        else:  # the RequestResult
            item = dataclasses.replace(item, logprobs=item.logprobs and [-math.inf] * len(item.logprobs),
                                       prompt_logprobs=item.prompt_logprobs and [-math.inf] * len(item.prompt_logprobs))
        return super()._emit(req, item)


@pytest.fixture
def guarded_client():
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    tokenizer = load_tokenizer(REPO / "demo" / "tokenizer.model")
    engine = NonFiniteEngine(tokenizer, max_batch_size=4, max_seq_len=256)
    llama = served_model(engine)
    with TestClient(create_app(llama, "fake"), raise_server_exceptions=False) as c:
        yield c
    engine.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "logprobs": 2, "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "logprobs": True, "top_logprobs": 2}),
])
def test_numbers_json_cannot_hold_never_reach_a_client(guarded_client, path, body, caplog):
    """A non-finite log-probability, however it came, is sent as -9999.0 (-inf) or null
    (NaN, +inf) in a 200 whose body and events all parse strictly; the server says so in its log."""
    with caplog.at_level(logging.WARNING, logger="llama.serve.finite_json"):
        r = guarded_client.post(path, json=body)
        assert r.status_code == 200, r.text
        whole = strict_json(r.text)
        if not body.get("echo"):
            r = guarded_client.post(path, json={**body, "stream": True})
            assert r.status_code == 200
            chunks = sse_events(r)
            assert any(c["choices"] and c["choices"][0]["logprobs"] for c in chunks)
    lp = whole["choices"][0]["logprobs"]
    if "content" in lp:
        assert {e["logprob"] for e in lp["content"]} == {NEGATIVE_INFINITY_STAND_IN}
        assert all([t["logprob"] for t in e["top_logprobs"]] == [None, None] for e in lp["content"])
    else:
        assert set(lp["token_logprobs"]) <= {NEGATIVE_INFINITY_STAND_IN, None}  # None: an echoed first token
        assert all(set(t.values()) == {None} for t in lp["top_logprobs"] if t)
    assert any("numbers JSON cannot hold" in r.getMessage() for r in caplog.records)


# -- every endpoint and format of a real model --------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
FORMATS = {
    "free": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": json_schema_format(SCHEMAS["enum_and_array"])},
    "grammar": {"response_format": {"type": "grammar", "grammar": ARITHMETIC}},
    "regex": {"response_format": {"type": "regex", "regex": "(yes|no|maybe)"}},
    "tool_choice": {"tools": [TOOL], "tool_choice": "required"},
}
K = 20  # top_logprobs asked for: more than most grammar steps allow


@pytest.fixture(scope="module")
def served(llama3_checkpoint):
    """A random-weight Llama 3 model behind the app, its engine run on a thread as the server runs it."""
    from fastapi.testclient import TestClient

    from llama import Llama
    from llama.serve import create_app

    llama = Llama.build(llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path, max_seq_len=2048,
                        max_batch_size=4, device="cpu")
    stop = threading.Event()
    thread = threading.Thread(target=llama.engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    with TestClient(create_app(llama, "tiny"), raise_server_exceptions=False) as client:
        yield client
    stop.set()
    thread.join(30)


def check_alternatives(entries, ordered: bool) -> None:
    """Listed alternatives: at most K, each a log-probability (<= 0), most likely first where
    ``ordered`` (a completion's are a dict by token text, in which tokens of one text collide)."""
    for values in entries:
        assert len(values) <= K and all(v <= 0 for v in values), values
        assert not ordered or values == sorted(values, reverse=True), values


def request(path: str, name: str, stream: bool) -> dict:
    fmt = FORMATS[name]
    if path == "/v1/completions":
        body = {"prompt": "the", "logprobs": K, "echo": not stream}
    else:
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "logprobs": True, "top_logprobs": K}
    body = {**body, **fmt, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


CASES = [(p, name, stream) for p in ("/v1/completions", "/v1/chat/completions") for name in FORMATS
         for stream in (False, True) if not (name == "tool_choice" and p == "/v1/completions")]
CASE_IDS = [f"{'chat' if 'chat' in p else 'completions'}-{n}-{'stream' if s else 'whole'}" for p, n, s in CASES]


@pytest.mark.parametrize("path, name, stream", CASES, ids=CASE_IDS)
def test_every_response_is_json(served, path, name, stream):
    """Each endpoint, each format, streamed or not, with log-probabilities and the most
    alternatives (completions: echoed prompt's log-probabilities too when not streamed; usage;
    n=2): a 200 whose body, or every event, a strict JSON parser reads."""
    r = served.post(path, json=request(path, name, stream))
    assert r.status_code == 200, r.text
    bodies = sse_events(r) if stream else [strict_json(r.text)]
    assert bodies[-1]["usage"]["completion_tokens"] > 0
    listed = []
    for body in bodies:
        for choice in body["choices"]:
            lp = choice.get("logprobs")
            if not lp:
                continue
            if path == "/v1/completions":
                listed += [list(t.values()) for t in lp["top_logprobs"] if t is not None]
            else:
                listed += [[t["logprob"] for t in e["top_logprobs"]] for e in lp["content"]]
    check_alternatives(listed, ordered=path != "/v1/completions")
    if not (name == "tool_choice" and stream):  # (calls streamed as deltas come without log-probabilities)
        assert listed


def assembled_calls(chunks: list[dict]) -> list[dict]:
    """The tool calls a client puts together from streamed deltas."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d["function"].get("name") or ""
            call["arguments"] += d["function"].get("arguments") or ""
    return [calls[k] for k in sorted(calls)]


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_required_reply_cut_by_max_tokens_is_the_same_streamed_or_not(served):
    """A real model's reply constrained to calls, sampled with a seed and cut by max_tokens at
    several places: the streamed deltas put together are the non-streamed message (the calls
    announced before the cut, or the text while none is), finish_reason "length" either way."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool], "tool_choice": "required",
            "temperature": 1.0, "seed": 3}
    r = served.post("/v1/chat/completions", json={**body, "max_tokens": 300})
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    n = r.json()["usage"]["completion_tokens"]
    kinds = set()
    for max_tokens in (n // 2, n * 7 // 10, n * 17 // 20, n - 1):
        r = served.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        (choice,) = strict_json(r.text)["choices"]
        r = served.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens, "stream": True})
        chunks = sse_events(r)
        message = choice["message"]
        whole = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in message.get("tool_calls") or []]
        assert assembled_calls(chunks) == whole, max_tokens
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert content == (message["content"] or ""), max_tokens
        assert choice["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == "length"
        kinds.add((len(whole), bool(whole and whole[-1]["arguments"])))
    assert kinds >= {(0, False), (1, False), (1, True)}  # cut before the call, in its head, in its arguments
