"""The server with its engine in a process of its own (``--engine_process``) against the one-process
server (``--no-engine_process``), both serving a random-weight Llama 3 model: the same answers
(greedy tokens identical) for completions, chat, streams, tools, structured output, /tokenize and
the same metrics; then the engine's process killed mid-stream (the client gets an error, the API
process exits, nothing hangs).  With the bundled demo model (which writes long greedy replies):
SIGTERM lets the requests in flight finish, as in one process."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

import helpers

pytestmark = pytest.mark.slow  # server processes (seconds each)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MAX_SEQ_LEN = 1024
START_TIMEOUT_S = 150
SHUTDOWN_GRACE_S = 4
PROMPT = "The king said"
MODEL = "llama3"  # (the checkpoint directory's name)


class Server:
    """``python -m llama.serve`` (one rank; the demo model unless ``args`` say), in a session of its own."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = helpers.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama.serve", "--port", str(self.port), "--device", "cpu", "--max_seq_len",
             str(MAX_SEQ_LEN), "--shutdown_grace_s", str(SHUTDOWN_GRACE_S), *args],
            env=env, cwd=helpers.REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        if helpers.wait_until_healthy(self.proc, self.url, START_TIMEOUT_S, self.tail):
            return
        self.kill()
        pytest.fail(f"the server did not answer /health within {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def api_pid(self) -> Optional[int]:
        found = re.search(r"API process (\d+): serving the engine of process (\d+)", self.tail(10**6))
        return int(found.group(1)) if found else None

    def client(self, timeout: float = 60):
        return helpers.openai_client(self.url, timeout)

    def kill(self) -> None:
        api = self.api_pid()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if api is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(api, signal.SIGKILL)
        self.log.close()


def llama3_server(tmp_path_factory, checkpoint, *args: str) -> "Server":
    """A random-weight Llama 3 model (it declares tools, as the demo's Llama 2 format does not)."""
    return Server(tmp_path_factory.mktemp("llama3") / "server.log", "--ckpt_dir", str(checkpoint.ckpt_dir),
                  "--tokenizer_path", str(checkpoint.tokenizer_path), "--model_name", MODEL, "--max_batch_size", "4",
                  *args)


@pytest.fixture(scope="module")
def two(tmp_path_factory, llama3_checkpoint):
    s = llama3_server(tmp_path_factory, llama3_checkpoint, "--engine_process")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def one(tmp_path_factory, llama3_checkpoint):
    s = llama3_server(tmp_path_factory, llama3_checkpoint, "--no-engine_process")
    yield s
    s.kill()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}]


def answers(server) -> dict:
    """What one client asks both servers, greedy, as comparable data."""
    client = server.client()
    out: dict = {}
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
    out["completion"] = (c.choices[0].text, c.choices[0].logprobs.tokens, c.usage.completion_tokens)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    out["completion_stream"] = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    messages = [{"role": "user", "content": "Tell me of the king."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    out["chat"] = (chat.choices[0].message.content, chat.usage.prompt_tokens, chat.usage.completion_tokens)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                              stream=True)
    out["chat_stream"] = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    tools = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0)
    calls = tools.choices[0].message.tool_calls or []
    out["tools"] = [(call.function.name, call.function.arguments) for call in calls]
    structured = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                               response_format={"type": "json_object"})
    out["json_object"] = structured.choices[0].message.content
    n = client.completions.create(model=MODEL, prompt=[PROMPT, "Once"], max_tokens=8, temperature=0.8, seed=3, n=2)
    out["n_seeded"] = sorted((ch.index, ch.text) for ch in n.choices)
    tokenized = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()
    out["tokenize"] = tokenized["tokens"]
    out["detokenize"] = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]},
                                   timeout=30).json()
    return out


def metric(server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not on /metrics")


def test_two_processes_answer_as_one(two, one):
    got, expected = answers(two), answers(one)
    assert got == expected
    assert got["completion_stream"] == got["completion"][0] and got["chat_stream"] == got["chat"][0]
    assert got["tools"] and got["tools"][0][0] == "get_weather"  # "required": the grammar reached the engine
    for name in ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"]:
        assert metric(two, name) == metric(one, name) > 0, name
    assert metric(two, "vllm:num_requests_running") == metric(two, "vllm:num_requests_waiting") == 0


def test_sigterm_lets_requests_in_flight_finish(tmp_path):
    """As test_serve.py's test of one process."""
    two = Server(tmp_path / "server.log", "--engine_process")
    try:
        sigterm_drains(two)
    finally:
        two.kill()


def sigterm_drains(two: Server) -> None:
    client = two.client()
    long_sent = time.monotonic()
    long = client.completions.create(model="demo", prompt="KING HENRY:\n", max_tokens=MAX_SEQ_LEN - 32,
                                     temperature=0, stream=True)
    long_chunks = iter(long)
    next(long_chunks)
    short_tokens = helpers.tokens_lasting(long_chunks, 1.0, long_sent)  # in flight at the signal, done well within 4 s
    short = client.completions.create(model="demo", prompt="KING HENRY:\n", max_tokens=short_tokens,
                                      temperature=0, stream=True)
    short_chunks = iter(short)
    short_text = next(short_chunks).choices[0].text
    api = two.api_pid()
    sent = time.monotonic()
    two.proc.send_signal(signal.SIGTERM)  # to the engine's process: it passes it to the API process
    time.sleep(0.3)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=1)
    assert refused.value.status_code == 503
    finish = None
    for chunk in short_chunks:
        if chunk.choices:
            short_text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length", (finish, short_text)
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in long_chunks:
            pass
    ended = time.monotonic() - sent
    assert SHUTDOWN_GRACE_S - 0.5 < ended < SHUTDOWN_GRACE_S + 10, ended
    try:
        assert two.proc.wait(30) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the server was still running 30 s after its grace period:\n" + two.tail())
    assert api is not None and not helpers.process_alive(api)
    log = two.tail(20_000)
    assert f"SIGTERM: taking no new requests; waiting up to {SHUTDOWN_GRACE_S} s for the 2 in flight" in log, log
    assert "shutdown: 1 of the 2 requests in flight finished in" in log and "ending the other 1 with an error" in log
    assert "exiting now" not in log


def test_two_ranks_under_torchrun_behind_an_api_process(tmp_path):
    """The engine processes are torchrun's ranks (the model split in two); the first starts the API
    process.  Greedy text as the Python API's in this process; SIGTERM ends every process."""
    from llama import Llama

    port = helpers.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LLAMA_COLLECTIVE_TIMEOUT_S": "30",
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 "-m", "llama.serve", "--port", str(port), "--device", "cpu", "--max_seq_len", "256",
                                 "--engine_process"], env=env, cwd=helpers.REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.05)
        text = log_path.read_text()
        found = re.search(r"API process (\d+): serving the engine of process (\d+)", text)
        assert found, text[-4000:]
        api, rank0 = int(found.group(1)), int(found.group(2))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
        demo = helpers.REPO / "demo"
        reference = Llama.build(ckpt_dir=demo, tokenizer_path=demo / "tokenizer.model", max_seq_len=256,
                                max_batch_size=1, device="cpu")
        assert got == reference.text_completion([PROMPT], temperature=0, max_gen_len=16)[0]["generation"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)  # (torchrun's own status after a SIGTERM is 1, whatever its workers did)
        deadline = time.monotonic() + 20
        while (helpers.process_alive(api) or helpers.process_alive(rank0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not helpers.process_alive(api) and not helpers.process_alive(rank0)
        assert "SIGTERM: no requests in flight: exiting" in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_the_engine_process_killed_mid_stream(two):
    """Runs last: it ends the module's engine-process server (test_two_processes_answer_as_one's,
    which it had a demo server of its own for: ~5 s of start-up; any model streams long enough,
    the random one never says its end of text)."""
    api = two.api_pid()
    assert api is not None and helpers.process_alive(api), two.tail()
    stream = two.client(timeout=30).completions.create(
        model=MODEL, prompt="KING HENRY:\n", max_tokens=MAX_SEQ_LEN - 32, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    killed_at = time.monotonic()
    os.kill(two.proc.pid, signal.SIGKILL)  # the engine: the process llama-serve started as
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in chunks:
            pass
    deadline = killed_at + 30
    while helpers.process_alive(api) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not helpers.process_alive(api), "the API process outlived its engine by 30 s:\n" + two.tail()
    with pytest.raises(httpx.HTTPError):
        httpx.get(two.url + "/health", timeout=2)
    log = two.tail()
    assert "the engine stopped on an error, exiting: the engine process died" in log, log
