"""Priorities and deadlines through the server: the body's ``priority`` and ``timeout`` (extra fields,
as the official client's ``extra_body`` sends them) and ``--request_timeout_s`` reach the engine; a
request past its deadline answers 504 (code ``request_timeout``, not to be retried), streamed or not,
with its KV-cache blocks back.  The fast checks against the fake engine; the engine's behaviour on a
random-weight Llama 3 checkpoint stepped slowly on a thread (a step every STEP_S), so that a deadline
always falls inside a request."""

from __future__ import annotations

import json
import threading
import time

import pytest

import helpers
from fake_engine import FakeEngine, served_model
from helpers import REPO
from llama.tokenizer import load_tokenizer

MODEL = "tiny"
STEP_S = 0.02


# -- against the fake engine: what reaches the engine --------------------------------------


@pytest.fixture(scope="module")
def fake():
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    engine = FakeEngine(load_tokenizer(REPO / "demo" / "tokenizer.model"))
    with TestClient(create_app(served_model(engine), MODEL, request_timeout_s=30)) as c:
        yield c, engine
    engine.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_priority_and_timeout_reach_the_engine(fake, path, body):
    client, engine = fake
    for extra, priority, timeout in [({}, 0, 30.0), ({"priority": -3, "timeout": 2.5}, -3, 2.5),
                                     ({"priority": 7, "timeout": 90}, 7, 30.0)]:  # the server's caps a longer one
        r = client.post(path, json={**body, **extra})
        assert r.status_code == 200, r.text
        settings = engine.submitted[-1].settings
        assert (settings.priority, settings.timeout_s) == (priority, timeout), extra


@pytest.mark.parametrize("extra,param", [({"priority": "high"}, "priority"), ({"priority": 1.5}, "priority"),
                                         ({"timeout": 0}, "timeout"), ({"timeout": -1}, "timeout"),
                                         ({"timeout": "5"}, "timeout")])
def test_bad_priorities_and_timeouts_are_a_400(fake, extra, param):
    client, _ = fake
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_without_a_server_default_only_requests_that_ask_have_a_deadline():
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    engine = FakeEngine(load_tokenizer(REPO / "demo" / "tokenizer.model"))
    try:
        with TestClient(create_app(served_model(engine), MODEL)) as client:
            for extra, timeout in [({}, None), ({"timeout": 4}, 4.0)]:
                assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra}).status_code == 200
                assert engine.submitted[-1].settings.timeout_s == timeout
    finally:
        engine.close()


# -- the engine behind the server ------------------------------------------------------------


class SlowSteps:
    """Steps ``engine`` on a thread while it has work, one step every ``STEP_S``: as a served
    engine does, slowed down so that a request takes a known minimum of time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.engine.lock:
                has_work = self.engine.scheduler.has_work
            if has_work:
                self.engine.step()
            time.sleep(STEP_S)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(llama3_checkpoint):
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    llama = helpers.build(llama3_checkpoint, max_seq_len=128, max_batch_size=1, dtype="float32", compile=False,
                          kv_block_size=8)
    steps = SlowSteps(llama.engine)
    with TestClient(create_app(llama, MODEL)) as client:
        yield client, llama.engine
    steps.close()


def blocks_all_back(engine, wait_s: float = 5.0) -> None:
    """Once the engine has ended every request: no request holds a block, every block is free or
    cached, counted once."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with engine.lock:
            if not engine.scheduler.has_work:
                break
        time.sleep(STEP_S)
    with engine.lock:
        assert not engine.scheduler.running and not engine.scheduler.preempted and not engine.scheduler.queue
        engine.kv.blocks.check([])
        assert engine.kv.blocks.available == engine.kv.blocks.usable


def check_timeout_error(body: dict, timeout: float) -> None:
    err = body["error"]
    assert err["type"] == "timeout_error" and err["code"] == "request_timeout"
    assert f"{timeout:g} s" in err["message"]


def test_a_request_past_its_deadline_is_a_504_and_frees_its_blocks(served):
    client, engine = served
    # 60 tokens take at least 60 steps of STEP_S (1.2 s); the deadline falls at 0.3 s.
    r = client.post("/v1/completions", json={"prompt": [1, 5, 9, 12], "max_tokens": 60, "temperature": 0,
                                             "timeout": 0.3})
    assert r.status_code == 504, r.text
    assert r.headers["x-should-retry"] == "false"
    check_timeout_error(r.json(), 0.3)
    blocks_all_back(engine)


def test_a_streamed_request_past_its_deadline_ends_with_the_error(served):
    client, engine = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60,
                                                  "temperature": 0, "stream": True, "timeout": 0.3})
    assert r.status_code == 200  # the stream had begun
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    check_timeout_error(json.loads(events[-2]), 0.3)
    tokens = [json.loads(e) for e in events[1:-2]]  # (the first chunk gives the role)
    assert 0 < len(tokens) < 60 and all(t["choices"][0]["finish_reason"] is None for t in tokens)
    blocks_all_back(engine)


def test_a_waiting_request_past_its_deadline_never_runs(served):
    """One row: a long request runs; one behind it with a short deadline ends while it waits."""
    client, engine = served
    before = engine.stats()["requests_total"]
    answers: dict = {}

    def long_one():
        answers["long"] = client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 25, "temperature": 0})

    thread = threading.Thread(target=long_one)
    thread.start()
    while engine.stats()["running"] == 0:
        time.sleep(0.005)
    r = client.post("/v1/completions", json={"prompt": [1, 7], "max_tokens": 5, "timeout": 0.2})
    thread.join(30)
    assert r.status_code == 504, r.text
    assert answers["long"].status_code == 200
    assert answers["long"].json()["choices"][0]["finish_reason"] == "length"
    assert engine.stats()["requests_total"] == before + 1  # the second never started
    blocks_all_back(engine)


@pytest.mark.slow  # importing the openai client takes seconds
def test_through_the_openai_client_extra_body(served):
    """The official client's ``extra_body``: priorities order the requests waiting behind a full
    batch (one row), and a deadline raises the 504 without a retry."""
    openai = pytest.importorskip("openai")
    client, engine = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=2)
    finished: list[str] = []
    lock = threading.Lock()

    def ask(name: str, priority: int, max_tokens: int) -> None:
        api.completions.create(model=MODEL, prompt="a", max_tokens=max_tokens, temperature=0,
                               extra_body={"priority": priority})
        with lock:
            finished.append(name)

    first = threading.Thread(target=ask, args=("first", 0, 20))
    first.start()
    while engine.stats()["running"] == 0:
        time.sleep(0.005)
    others = []
    for name, priority in [("low", 9), ("high", -2), ("mid", 1)]:
        others.append(threading.Thread(target=ask, args=(name, priority, 2)))
        others[-1].start()
        while engine.stats()["queued"] < len(others):  # each queued before the next is sent
            time.sleep(0.005)
    for t in [first] + others:
        t.join(60)
    assert finished == ["first", "high", "mid", "low"]

    submitted = engine.stats()["requests_total"]
    with pytest.raises(openai.InternalServerError) as e:
        api.completions.create(model=MODEL, prompt="a", max_tokens=60, temperature=0, extra_body={"timeout": 0.3})
    assert e.value.status_code == 504 and e.value.code == "request_timeout"
    assert engine.stats()["requests_total"] == submitted + 1  # max_retries=2, yet sent once
    blocks_all_back(engine)
