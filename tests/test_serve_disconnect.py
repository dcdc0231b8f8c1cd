"""A client that goes away cancels what it asked for, streamed or not, at the engine's next step;
and the gate in front of the routes (API keys, shutdown) with what it guards.

The application is driven here as the HTTP server drives it (its ASGI ``receive`` answers
``http.disconnect`` once the client has gone, at once and ever after, as uvicorn's does), with
the fake engine (tests/fake_engine.py) behind it: fast, no sockets.  The same through a real
server and model: test_serve.py (slow)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from fake_engine import FakeEngine, served_model
from helpers import REPO
from llama.tokenizer import load_tokenizer

KEY = "key-of-the-test"
COMPLETION = ("/v1/completions", {"prompt": "x", "max_tokens": 200})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(REPO / "demo" / "tokenizer.model")


@pytest.fixture
def engine(tokenizer):
    engine = FakeEngine(tokenizer, max_batch_size=2, max_seq_len=256, max_queue=8, step_s=0.005)
    engine.script = engine.script[:-1] * 20  # long answers, no EOS: only a cancellation ends them early
    yield engine
    engine.close()


def make_app(engine, tokenizer, **kw):
    from llama.serve import create_app

    llama = served_model(engine)
    return create_app(llama, "fake", **kw)


class Call:
    """One HTTP request to the ASGI app, from a client that may go away (``leave``)."""

    def __init__(self, app, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> None:
        self.gone = asyncio.Event()
        self.messages: list[dict] = []
        head = [(b"host", b"test")] + [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                       for k, v in (headers or {}).items()]
        if body:
            head += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": head, "client": ("127.0.0.1", 40000), "server": ("test", 80), "state": {}}
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.gone.wait()  # (no suspension once set: uvicorn answers at once, ever after)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            self.messages.append(message)

        self.task = asyncio.ensure_future(app(scope, receive, send))

    def leave(self) -> None:
        self.gone.set()

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    def json(self) -> dict:
        return json.loads(b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body"))


async def request(app, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> Call:
    call = Call(app, method, path, json.dumps(body).encode() if body is not None else b"", headers)
    await asyncio.wait_for(call.task, 5)
    return call


async def until(condition, timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.002)


def requests_counted(app, path: str, status: str) -> float:
    value = app.state.metrics.registry.get_sample_value(
        "llama_requests_total", {"endpoint": path, "status": status})
    return value or 0.0


@pytest.mark.parametrize("endpoint", [COMPLETION, CHAT], ids=["completions", "chat"])
def test_a_client_that_leaves_a_running_request_cancels_it_at_the_next_step(engine, tokenizer, endpoint, caplog):
    """Not streamed: the answer is one JSON body at the end, so nothing is sent that could fail;
    the server must notice the ``http.disconnect`` itself (it used not to: the request ran all
    its 200 tokens)."""
    path, body = endpoint
    app = make_app(engine, tokenizer)
    caplog.set_level(logging.INFO, logger="llama.serve.access")

    async def scenario():
        call = Call(app, "POST", path, json.dumps(body).encode())
        await until(lambda: engine.submitted and len(engine.submitted[-1].tokens) >= 3)
        req = engine.submitted[-1]
        call.leave()
        at_leave = len(req.tokens)
        await asyncio.wait_for(call.task, 3)
        await until(lambda: req.finished and not engine.stats()["running"], 1.0)  # (the fake's list: after its step)
        return req, at_leave

    req, at_leave = asyncio.run(scenario())
    assert req.cancelled and req.outcome.finish_reason == "cancelled"
    assert len(req.tokens) - at_leave <= 2, (at_leave, len(req.tokens))  # a step or two, not 200 tokens
    assert engine.stats()["running"] == 0 and engine.stats()["queued"] == 0
    assert requests_counted(app, path, "499") == 1 and requests_counted(app, path, "200") == 0
    access = [r.getMessage() for r in caplog.records if r.name == "llama.serve.access"]
    assert len(access) == 1 and f'"POST {path}" 499' in access[0], access


@pytest.mark.parametrize("endpoint", [COMPLETION, CHAT], ids=["completions", "chat"])
def test_a_client_that_leaves_while_queued_never_runs(engine, tokenizer, endpoint):
    path, body = endpoint
    app = make_app(engine, tokenizer)
    engine.paused.set()  # nothing is admitted: the request waits in the queue

    async def scenario():
        call = Call(app, "POST", path, json.dumps({**body, "n": 2}).encode())
        await until(lambda: engine.stats()["queued"] == 2)
        call.leave()
        await asyncio.wait_for(call.task, 3)
        engine.paused.clear()
        await until(lambda: all(r.finished for r in engine.submitted) and not engine.stats()["running"], 1.0)

    asyncio.run(scenario())
    assert [r.outcome.finish_reason for r in engine.submitted] == ["cancelled", "cancelled"]
    assert [len(r.tokens) for r in engine.submitted] == [0, 0]
    assert engine.stats()["running"] == 0 and engine.stats()["queued"] == 0
    assert requests_counted(app, path, "499") == 1


def test_a_client_that_left_before_its_request_was_submitted_cancels_it_at_once(engine, tokenizer):
    """Gone while its prompt was read and tokenised: the request is cancelled as soon as it is
    submitted (the disconnect is still there to read)."""
    app = make_app(engine, tokenizer)

    async def scenario():
        call = Call(app, "POST", "/v1/completions", json.dumps(COMPLETION[1]).encode())
        call.leave()
        await asyncio.wait_for(call.task, 3)
        await until(lambda: engine.submitted and engine.submitted[-1].finished, 1.0)
        return call

    call = asyncio.run(scenario())
    (req,) = engine.submitted
    assert req.outcome.finish_reason == "cancelled" and len(req.tokens) <= 2, len(req.tokens)
    assert call.status == 499 and requests_counted(app, "/v1/completions", "499") == 1


def test_a_client_that_stays_gets_its_whole_answer(engine, tokenizer):
    """The watch for a disconnect does not end requests whose client is still there."""
    app = make_app(engine, tokenizer)
    call = asyncio.run(request(app, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 30}))
    assert call.status == 200 and call.json()["usage"]["completion_tokens"] == 30
    assert engine.submitted[-1].outcome.finish_reason == "length" and not engine.submitted[-1].cancelled


# -- the gate --


def test_every_route_but_the_page_and_health_needs_the_key(engine, tokenizer):
    """/docs, /openapi.json (and the docs' OAuth redirect page) answered without the key before."""
    app = make_app(engine, tokenizer, api_keys=[KEY])

    async def scenario():
        out = {}
        for path in ("/docs", "/openapi.json", "/docs/oauth2-redirect", "/metrics", "/v1/models", "/nowhere", "/",
                     "/health"):
            out[path] = [(await request(app, method, path, headers=headers)).status
                         for method in ("GET", "HEAD")
                         for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}"})]
        return out

    got = asyncio.run(scenario())
    for path in ("/docs", "/openapi.json", "/docs/oauth2-redirect", "/metrics", "/v1/models"):
        assert got[path][:2] == [401, 401] and got[path][3:5] == [401, 401], (path, got[path])
        assert got[path][2] == 200, (path, got[path])
    assert got["/nowhere"][:2] == [401, 401] and got["/nowhere"][2] == 404, got["/nowhere"]
    assert got["/"][:3] == [200, 200, 200] and got["/health"][:3] == [200, 200, 200], got


def test_without_keys_docs_and_schema_stay_open(engine, tokenizer):
    app = make_app(engine, tokenizer)

    async def scenario():
        return [(await request(app, "GET", path)).status for path in ("/docs", "/openapi.json")]

    assert asyncio.run(scenario()) == [200, 200]


def test_the_key_reaches_the_request_and_shutdown_answers_503(engine, tokenizer):
    """The gate's other duties, as before: the request's key scopes its prefix cache; once the
    server stops accepting, /v1 answers 503 (after the key check) while /health says stopping."""
    from llama.serve.auth import cache_scope

    app = make_app(engine, tokenizer, api_keys=[KEY])
    auth = {"Authorization": f"Bearer {KEY}"}

    async def scenario():
        ok = await request(app, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, auth)
        app.state.accepting = False
        unkeyed = await request(app, "POST", "/v1/completions", {"prompt": "x"})
        keyed = await request(app, "POST", "/v1/completions", {"prompt": "x"}, auth)
        health = await request(app, "GET", "/health")
        return ok, unkeyed, keyed, health

    ok, unkeyed, keyed, health = asyncio.run(scenario())
    assert ok.status == 200
    assert engine.submitted[-1].settings.cache_scope == cache_scope(KEY.encode(), None)
    assert unkeyed.status == 401 and unkeyed.json()["error"]["code"] == "invalid_api_key"
    assert keyed.status == 503 and keyed.json()["error"] == {
        "message": "the server is shutting down", "type": "server_error", "param": None, "code": "shutting_down"}
    assert health.status == 503


# -- one shutdown message --


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_ended_by_shutdown_says_so_once(engine, tokenizer, stream):
    """It read "the server is shutting down: the server is shutting down" (the engine's message
    after the server's), streamed or not."""
    from llama.engine import EngineStopped

    app = make_app(engine, tokenizer)
    engine.paused.set()

    async def scenario():
        call = Call(app, "POST", "/v1/completions", json.dumps({"prompt": "x", "stream": stream}).encode())
        await until(lambda: engine.stats()["queued"] == 1)
        engine.fail_all(EngineStopped("the server is shutting down"))
        await asyncio.wait_for(call.task, 3)
        return call

    call = asyncio.run(scenario())
    if stream:
        events = b"".join(m.get("body", b"") for m in call.messages if m["type"] == "http.response.body").decode()
        error = json.loads([line for line in events.splitlines() if line.startswith("data: {")][-1][6:])["error"]
    else:
        assert call.status == 503
        error = call.json()["error"]
    assert error["message"] == "the server is shutting down" and error["code"] == "shutting_down", error
