"""``/v1/responses`` (OpenAI's Responses API, the subset a chat client needs) against the fake engine,
whose "model" writes a fixed script: the prompt the engine gets is the chat format's own for the
messages the request stands for (built here without the server), the output and its usage are the
script's, streamed as the Responses API's events; ``previous_response_id`` carries a conversation on,
per API key.  Through the official client's ``responses.create`` and ``responses.parse`` too (slow:
importing the client takes seconds)."""

from __future__ import annotations

import json

import pytest

import helpers
from fake_engine import SCRIPT, FakeEngine, served_model
from helpers import REPO
from llama.formats.chat import Llama2ChatFormat
from llama.tokenizer import load_tokenizer

MODEL = "demo-test"
KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(REPO / "demo" / "tokenizer.model")


@pytest.fixture(scope="module")
def served(tokenizer):
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    engine = FakeEngine(tokenizer, max_batch_size=4, max_seq_len=512)
    with TestClient(create_app(served_model(engine), MODEL, api_keys=KEYS)) as c:
        c.headers["Authorization"] = f"Bearer {KEYS[0]}"
        yield c, engine
    engine.close()


def script_text(tokenizer, n: int) -> str:
    return tokenizer.decode(tokenizer.encode(SCRIPT, bos=False, eos=False)[:n])


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_response_is_the_chat_reply(served, tokenizer):
    client, engine = served
    r = client.post("/v1/responses", json={"model": MODEL, "input": "Who art thou?", "instructions": "Be brief.",
                                           "max_output_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = Llama2ChatFormat(tokenizer).encode_dialog(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]).tokens
    assert engine.submitted[-1].prompt_tokens == prompt
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == MODEL
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["text"] == script_text(tokenizer, 5)
    assert body["usage"]["input_tokens"] == len(prompt) and body["usage"]["output_tokens"] == 5
    assert body["usage"]["total_tokens"] == len(prompt) + 5


def test_a_streamed_response_sends_openai_s_events(served, tokenizer):
    client, _ = served
    r = client.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me"}]}], "stream": True})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == SCRIPT  # the whole script, to its EOS
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == len(tokenizer.encode(SCRIPT, bos=False, eos=False))


def test_previous_response_id_carries_the_conversation_per_key(served, tokenizer):
    client, engine = served
    first = client.post("/v1/responses", json={"input": "Hello", "instructions": "Only here.",
                                               "max_output_tokens": 3}).json()
    r = client.post("/v1/responses", json={"input": "And then?", "previous_response_id": first["id"],
                                           "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    # The first turn and its reply, then the new input; the first's instructions are not carried over.
    expected = Llama2ChatFormat(tokenizer).encode_dialog([
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": script_text(tokenizer, 3)},
        {"role": "user", "content": "And then?"}]).tokens
    assert engine.submitted[-1].prompt_tokens == expected
    other = client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]},
                        headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert other.status_code == 400 and other.json()["error"]["code"] == "previous_response_not_found"
    unstored = client.post("/v1/responses", json={"input": "x", "store": False, "max_output_tokens": 1}).json()
    r = client.post("/v1/responses", json={"input": "x", "previous_response_id": unstored["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({}, "input"),
])
def test_bad_requests_are_a_400(served, body, param):
    client, _ = served
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_behind_the_api_key(served):
    client, _ = served
    r = client.post("/v1/responses", json={"input": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


# -- the official client -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3(tokenizer):
    """A fake engine behind Llama 3's chat format (which declares tools), its script set per test."""
    from fastapi.testclient import TestClient

    from llama.formats.chat import chat_format_for
    from llama.serve import create_app

    tokenizer3 = load_tokenizer(helpers.llama3_tokenizer_path())
    engine = FakeEngine(tokenizer3, max_batch_size=2, max_seq_len=2048)
    formatter = chat_format_for(tokenizer3)
    with TestClient(create_app(served_model(engine, formatter), MODEL)) as c:
        yield c, engine, formatter
    engine.close()


def api(client):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEYS[0], http_client=client, max_retries=0)


@pytest.mark.slow
def test_the_openai_client_creates_and_streams(served, tokenizer):
    client, _ = served
    responses = api(client).responses
    reply = responses.create(model=MODEL, input="Who art thou?", max_output_tokens=6)
    assert reply.output_text == script_text(tokenizer, 6) and reply.status == "incomplete"
    assert reply.usage.output_tokens == 6
    events = list(responses.create(model=MODEL, input="Who art thou?", stream=True))
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == SCRIPT
    assert events[-1].response.output_text == SCRIPT


@pytest.mark.slow
def test_the_openai_client_parses_structured_output(llama3):
    pydantic = pytest.importorskip("pydantic")
    client, engine, _ = llama3
    tokenizer = engine.tokenizer

    class City(pydantic.BaseModel):
        name: str
        population: int

    engine.script = tokenizer.encode('{"name": "Paris", "population": 2100000}', bos=False, eos=False) + \
        [tokenizer.eot_id]
    parsed = api(client).responses.parse(model=MODEL, input="A city?", text_format=City)
    assert parsed.output_parsed == City(name="Paris", population=2100000)
    assert engine.submitted[-1].settings.grammar is not None  # text.format reached the engine as a grammar


@pytest.mark.slow
def test_the_openai_client_calls_a_function_and_sends_its_result(llama3):
    client, engine, formatter = llama3
    tokenizer = engine.tokenizer
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    engine.script = tokenizer.encode('{"name": "get_weather", "parameters": {"city": "Paris"}}', bos=False,
                                     eos=False) + [tokenizer.eom_id]
    responses = api(client).responses
    reply = responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    engine.script = tokenizer.encode("Sunny.", bos=False, eos=False) + [tokenizer.eot_id]
    answer = responses.create(model=MODEL, previous_response_id=reply.id, tools=tools, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
    assert answer.output_text == "Sunny."
    # The second prompt holds the call and its result as Llama 3 writes them.
    expected = formatter.encode_dialog([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"call_id": call.call_id, "tool_name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"role": "ipython", "content": '{"sky": "clear"}'}], tools=[
        {"type": "function", "function": {k: tools[0][k] for k in ("name", "description", "parameters")}}]).tokens
    assert engine.submitted[-1].prompt_tokens == expected


def test_a_failure_part_way_ends_the_stream_with_an_error_event(served):
    """The engine fails while the response streams: its last event is an ``error`` holding the
    OpenAI error object (what the official client raises as an APIError)."""
    import threading
    import time

    client, engine = served
    engine.paused.set()
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=client.post(
        "/v1/responses", json={"input": "x", "stream": True})))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not engine.stats()["queued"] and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.fail_all(RuntimeError("the step failed"))
    finally:
        engine.paused.clear()
        thread.join(10)
    events = sse_events(answer["r"].text)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    error = events[-1]["error"]
    assert error["type"] == "server_error" and "the step failed" in error["message"]
