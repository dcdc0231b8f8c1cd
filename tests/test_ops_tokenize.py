"""``/tokenize`` and ``/detokenize`` (vLLM's paths and shapes) against a fake engine: the ids are
the tokenizer's and the chat format's own (computed here independently of the server), a chat's
count is the prompt_tokens a chat request's usage reports, bad input is an OpenAI error object,
and both routes are behind the API key."""

from __future__ import annotations

import pytest

import helpers
from fake_engine import FakeEngine, served_model
from helpers import REPO
from llama.formats.chat import Llama2ChatFormat
from llama.tokenizer import load_tokenizer

MODEL = "demo-test"
KEY = "key-of-ops"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(REPO / "demo" / "tokenizer.model")


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = FakeEngine(tokenizer, max_batch_size=4, max_seq_len=256, max_queue=8)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    with TestClient(create_app(served_model(engine), MODEL, api_keys=[KEY])) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c


def check_error(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_tokenize_a_prompt(client, tokenizer):
    text = "Hello world, a prompt of a few words."
    r = client.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tokenizer.encode(text, bos=True, eos=False)  # as /v1/completions encodes it: BOS first
    assert body == {"count": len(expected), "max_model_len": 256, "tokens": expected, "token_strs": None}
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == expected[1:]
    # each token's own text: joined, the SentencePiece text with its leading space
    assert len(body["token_strs"]) == body["count"] and "".join(body["token_strs"]) == " " + text


def test_tokenize_messages_is_the_chat_prompt(client, engine, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a llama?"}]
    r = client.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    # The Llama 2 template, applied here without the server.
    assert tokens == Llama2ChatFormat(tokenizer).encode_dialog(messages).tokens
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"] == len(tokens)
    assert engine.submitted[-1].prompt_tokens == tokens  # what the engine was given


def test_detokenize_round_trip(client, tokenizer):
    text = "Once upon a time, ünïcode too."
    ids = tokenizer.encode(text, bos=False, eos=False)
    r = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),  # both
    ("/tokenize", {"model": MODEL}, None),  # neither
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": "x"}]}, "messages"),  # the template refuses it
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # Llama 2 has none
    ("/detokenize", {"tokens": [1, 4096]}, "tokens"),  # the demo vocabulary has 4,096 ids
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400(client, path, body, param):
    err = check_error(client.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_a_message_says_what_was_wrong(client, tokenizer):
    assert tokenizer.n_words == 4096
    err = check_error(client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
                      400)
    assert "not both" in err["message"]
    err = check_error(client.post("/detokenize", json={"tokens": [5, 99999]}), 400)
    assert "99999" in err["message"] and "[0, 4096)" in err["message"]


def test_unknown_model_is_a_404(client):
    check_error(client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "model")
    check_error(client.post("/detokenize", json={"model": "other", "tokens": [1]}), 404, "model")


def test_behind_the_api_key(client):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"


def test_in_the_openapi_document(client):
    schema = client.get("/openapi.json").json()
    for path in ("/tokenize", "/detokenize"):
        assert "requestBody" in schema["paths"][path]["post"], path


@pytest.mark.slow  # Meta's Llama 3 tokenizer: a second to load
def test_tokenize_messages_with_tools_is_the_chat_prompt(engine):
    """Llama 3's format declares a request's tools in the prompt: /tokenize counts them as a chat does."""
    from fastapi.testclient import TestClient

    from llama.formats.chat import chat_format_for
    from llama.serve import create_app

    tokenizer = load_tokenizer(helpers.llama3_tokenizer_path())
    engine3 = FakeEngine(tokenizer, max_batch_size=2, max_seq_len=2048)
    try:
        formatter = chat_format_for(tokenizer)
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}, "required": ["city"]}}}]
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        with TestClient(create_app(served_model(engine3, formatter), MODEL)) as c:
            r = c.post("/tokenize", json={"messages": messages, "tools": tools})
            chat = c.post("/v1/chat/completions", json={"messages": messages, "tools": tools, "max_tokens": 1})
            plain = c.post("/tokenize", json={"messages": messages, "tools": tools, "tool_choice": "none"})
        assert r.status_code == chat.status_code == plain.status_code == 200, (r.text, chat.text, plain.text)
        assert r.json()["tokens"] == engine3.submitted[-1].prompt_tokens
        assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
        assert plain.json()["tokens"] == formatter.encode_dialog(messages).tokens  # "none": no tools declared
        assert plain.json()["count"] < r.json()["count"]
    finally:
        engine3.close()
