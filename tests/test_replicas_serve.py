"""``llama-serve --data_parallel 2``: two engine replicas of the demo model (one process each)
behind one API process.  Each replica answers as the Python API does (greedy), /metrics has each
replica's series, and a replica killed under load fails its own stream while the other replica's
stream and new requests go on; SIGTERM then ends every process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import helpers

pytestmark = pytest.mark.slow  # server processes (seconds each)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

DEMO = helpers.REPO / "demo"
MAX_SEQ_LEN = 1024
START_TIMEOUT_S = 180
PROMPT = "ROMEO:\nBut soft, what light"
LONG = "KING HENRY:\n"  # greedy, the demo model writes past 990 tokens from it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = helpers.free_port()
    log_path = tmp_path_factory.mktemp("replicas") / "server.log"
    log = open(log_path, "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "llama.serve", "--port", str(port), "--device", "cpu",
                             "--max_seq_len", str(MAX_SEQ_LEN), "--data_parallel", "2", "--shutdown_grace_s", "2"],
                            env=env, cwd=helpers.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    s = type("S", (), {})()
    s.proc, s.url, s.log_path = proc, f"http://127.0.0.1:{port}", log_path
    s.tail = lambda: (log.flush(), log_path.read_text(errors="replace"))[1][-8000:]
    if not helpers.wait_until_healthy(proc, s.url, START_TIMEOUT_S, s.tail):
        pytest.fail(f"no answer within {START_TIMEOUT_S} s:\n{s.tail()}")
    text = log_path.read_text()
    s.replica_pid = int(re.search(r"replica 1 \(process (\d+)\) serving", text).group(1))
    s.api_pid = int(re.search(r"API process (\d+): serving 2 engine replicas", text).group(1))
    yield s
    for pid in (proc.pid, s.replica_pid, s.api_pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
    log.close()


@pytest.fixture(scope="module")
def reference():
    return helpers.demo_llama(MAX_SEQ_LEN)


def client(server, timeout: float = 60):
    return helpers.openai_client(server.url, timeout)


def series(server, name: str) -> dict[str, float]:
    """``name``'s samples by their ``replica`` label (or "" where there is none)."""
    return helpers.metric_by_label(server.url, name)


def test_each_replica_answers_as_the_python_api(server, reference):
    c = client(server)
    busy = c.completions.create(model="demo", prompt=LONG, max_tokens=MAX_SEQ_LEN - 32, temperature=0, stream=True)
    next(iter(busy))  # replica 0 (both idle: the first) is busy with it
    assert series(server, "llama_replica_requests_running") == {"0": 1.0, "1": 0.0}
    on_1 = c.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0)  # the least loaded
    busy.close()
    expected = reference.text_completion([PROMPT], temperature=0, max_gen_len=16)[0]["generation"]
    assert on_1.choices[0].text == expected
    deadline = time.monotonic() + 20
    while sum(series(server, "llama_replica_requests_running").values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    other = "JULIET:\nO Romeo, Romeo"
    on_0 = c.completions.create(model="demo", prompt=other, max_tokens=16, temperature=0)  # both idle: the first
    assert on_0.choices[0].text == reference.text_completion([other], temperature=0, max_gen_len=16)[0]["generation"]
    assert series(server, "llama_replica_up") == {"0": 1.0, "1": 1.0}


def test_a_replica_killed_under_load(server):
    """Runs last: it ends the module's server."""
    c = client(server, timeout=30)
    first = iter(c.completions.create(model="demo", prompt=LONG, max_tokens=MAX_SEQ_LEN - 32, temperature=0,
                                      stream=True))
    next(first)
    # (shorter than a block: no cached prefix draws it to replica 0; the least loaded takes it)
    second = iter(c.completions.create(model="demo", prompt=LONG, max_tokens=MAX_SEQ_LEN - 32, temperature=0,
                                       stream=True))
    next(second)
    assert series(server, "llama_replica_requests_running") == {"0": 1.0, "1": 1.0}
    os.kill(server.replica_pid, signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in second:
            pass
    for _ in range(20):  # replica 0's stream goes on
        assert next(first).choices is not None
    r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert series(server, "llama_replica_up") == {"0": 1.0, "1": 0.0}
    assert "replica 1 stopped on an error" in server.tail()
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("the server was still running 60 s after SIGTERM:\n" + server.tail())
    deadline = time.monotonic() + 20
    while helpers.process_alive(server.api_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not helpers.process_alive(server.api_pid)
