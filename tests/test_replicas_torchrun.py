"""``torchrun --nproc_per_node 4 -m llama.serve --data_parallel 2``: two engine replicas of the
demo model, each a model-parallel group of two ranks (gloo), behind one API process.  Each
replica answers greedily as the Python API does, prefix routing sends a prompt that shares a
cached prefix to the replica holding it even when it is the busier one, and SIGTERM ends every
process.  The quick tests check the pieces that connect the replicas' first ranks to rank 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Client, Listener
from pathlib import Path

import pytest

import helpers
from llama.runtime import distributed
from llama.serve import engine_process
from llama.serve.engine_process import decode, encode

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

DEMO = helpers.REPO / "demo"
MAX_SEQ_LEN = 256
START_TIMEOUT_S = 180
PROMPT = "ROMEO:\nBut soft, what light"
OTHER = "JULIET:\nO Romeo, Romeo"
LONG = "KING HENRY:\n"  # greedy, the demo model writes on from it (shorter than a block: no prefix to route by)
# Two full KV-cache blocks (16 tokens) of the demo tokenizer's (37 tokens with BOS); greedy, the demo
# model writes 150 tokens or more after it + "KING HENRY:\n" and + "GLOUCESTER:\n".
SHARED = ("FIRST CITIZEN:\nBefore we proceed any further, hear me speak.\n\nALL:\nSpeak, speak.\n\n"
          "FIRST CITIZEN:\nYou are all resolved rather to die than to famish?\n\n")


# -- quick: the pieces ---------------------------------------------------------------------------------


def test_plan_replicas_refuses_a_split_that_is_not_even(monkeypatch):
    monkeypatch.setattr(distributed, "planned_world_size", lambda: 4)
    monkeypatch.setattr(distributed, "_replicas", 1)  # (restored after the test)
    for n in (3, 8, 0, True):
        with pytest.raises(ValueError, match="cannot split 4 process"):
            distributed.plan_replicas(n)
    assert distributed.planned_model_parallel_size() == 4


def test_llama_serve_refuses_replicas_that_do_not_divide_torchruns_ranks(monkeypatch):
    from llama.serve.server import main

    monkeypatch.setattr(distributed, "planned_world_size", lambda: 2)  # as under torchrun --nproc_per_node 2
    monkeypatch.setattr(distributed, "_replicas", 1)
    with pytest.raises(ValueError, match=r"^--data_parallel 3: 3 replicas cannot split 2 process\(es\) evenly"):
        main(["--data_parallel", "3", "--device", "cpu"])


def _listener(tmp_path: Path, key: bytes) -> Listener:
    return Listener(str(tmp_path / "replicas.sock"), family="AF_UNIX", authkey=key)


def test_replicas_are_accepted_in_replica_order(tmp_path):
    key = os.urandom(32)
    listener = _listener(tmp_path, key)
    ends = []

    def replica(index: int) -> None:
        conn = Client(listener.address, family="AF_UNIX", authkey=key)
        conn.send_bytes(encode(("replica", index)))
        conn.send_bytes(encode(("hello", {"index": index})))
        ends.append(conn)

    threads = [threading.Thread(target=replica, args=(k,)) for k in (2, 1)]  # the second, likely, connects first
    threads[0].start()
    time.sleep(0.1)
    threads[1].start()
    try:
        conns = engine_process._accept_replicas(listener, 2)
        for t in threads:
            t.join(10)
        assert [decode(c.recv_bytes())[1]["index"] for c in conns] == [1, 2]
    finally:
        listener.close()
        for c in ends:
            c.close()


def test_a_replica_with_another_key_or_none_at_all_is_an_error(tmp_path, monkeypatch):
    listener = _listener(tmp_path, b"k" * 32)

    def intruder() -> None:
        try:
            Client(listener.address, family="AF_UNIX", authkey=b"x" * 32)
        except (AuthenticationError, OSError, EOFError):
            pass

    thread = threading.Thread(target=intruder)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="0 of the 1 other replicas' first ranks connected to rank 0: "):
            engine_process._accept_replicas(listener, 1)
    finally:
        thread.join(10)
        listener.close()
    monkeypatch.setattr(engine_process, "REPLICA_CONNECT_S", 0.2)
    listener = Listener(str(tmp_path / "quiet.sock"), family="AF_UNIX", authkey=b"k" * 32)
    try:
        with pytest.raises(RuntimeError, match=r"0 of the 1 other replicas' .* within 0.2 s; see their logs"):
            engine_process._accept_replicas(listener, 1)
    finally:
        listener.close()


def test_join_replicas_refuses_a_first_rank_on_another_machine_and_leaves_no_socket(tmp_path, monkeypatch):
    made: list[Path] = []

    def mkdtemp(prefix: str) -> str:
        made.append(tmp_path / f"{prefix}x")
        made[-1].mkdir(0o700)
        return str(made[-1])

    monkeypatch.setattr(engine_process.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(distributed, "model_parallel_rank", lambda: 0)
    monkeypatch.setattr(distributed, "replica_index", lambda: 0)
    monkeypatch.setattr(distributed, "share_over_job", lambda obj: obj)
    assert engine_process.join_replicas(1) == ([], None)  # rank 0 with no other replica to wait for
    assert len(made) == 1 and not made[0].exists()  # its folder and socket removed
    monkeypatch.setattr(distributed, "replica_index", lambda: 1)
    monkeypatch.setattr(distributed, "share_over_job", lambda obj: ("/nowhere/replicas.sock", b"k" * 32, "elsewhere"))
    with pytest.raises(RuntimeError, match=r"replica 1's first rank runs on .*, rank 0 on elsewhere: .* must run on "
                                           r"rank 0's machine"):
        engine_process.join_replicas(2)


# -- slow: the server under torchrun -------------------------------------------------------------------


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = helpers.free_port()
    log_path = tmp_path_factory.mktemp("replicas_torchrun") / "server.log"
    log = open(log_path, "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LLAMA_COLLECTIVE_TIMEOUT_S": "30",
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                             "-m", "llama.serve", "--port", str(port), "--device", "cpu", "--max_seq_len",
                             str(MAX_SEQ_LEN), "--data_parallel", "2", "--shutdown_grace_s", "2"],
                            env=env, cwd=helpers.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    s = type("S", (), {})()
    s.proc, s.url, s.log_path = proc, f"http://127.0.0.1:{port}", log_path
    s.tail = lambda: (log.flush(), log_path.read_text(errors="replace"))[1][-8000:]
    try:
        if not helpers.wait_until_healthy(proc, s.url, START_TIMEOUT_S, s.tail):
            pytest.fail(f"no answer within {START_TIMEOUT_S} s:\n{s.tail()}")
        found = re.search(r"API process (\d+): serving 2 engine replicas", log_path.read_text())
        assert found, s.tail()
        s.api_pid = int(found.group(1))
        s.ranks = children(proc.pid)
        assert len(s.ranks) == 4, s.ranks
        yield s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in (getattr(s, "api_pid", None), *getattr(s, "ranks", ())):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def reference():
    from llama import Llama

    return Llama.build(ckpt_dir=DEMO, tokenizer_path=DEMO / "tokenizer.model", max_seq_len=MAX_SEQ_LEN,
                       max_batch_size=2, device="cpu")


def client(server, timeout: float = 60):
    return helpers.openai_client(server.url, timeout)


def running(server) -> dict[str, float]:
    """``llama_replica_requests_running`` by replica."""
    return helpers.metric_by_label(server.url, "llama_replica_requests_running")


def wait_idle(server) -> None:
    deadline = time.monotonic() + 20
    while sum(running(server).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sum(running(server).values())


def greedy(reference, prompt: str, n: int) -> str:
    return reference.text_completion([prompt], temperature=0, max_gen_len=n)[0]["generation"]


@pytest.mark.slow
def test_each_two_rank_replica_answers_as_the_python_api(server, reference):
    c = client(server)
    busy = c.completions.create(model="demo", prompt=LONG, max_tokens=200, temperature=0, stream=True)
    next(iter(busy))  # replica 0 (both idle: the first) is busy with it
    assert running(server) == {"0": 1.0, "1": 0.0}
    on_1 = c.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0)  # the least loaded
    busy.close()
    assert on_1.choices[0].text == greedy(reference, PROMPT, 16)
    wait_idle(server)
    on_0 = c.completions.create(model="demo", prompt=OTHER, max_tokens=16, temperature=0)  # both idle: the first
    assert on_0.choices[0].text == greedy(reference, OTHER, 16)


@pytest.mark.slow
def test_a_shared_prompt_goes_to_the_replica_that_caches_it(server, reference):
    wait_idle(server)
    c = client(server)
    first = c.completions.create(model="demo", prompt=SHARED + "KING HENRY:\n", max_tokens=150, temperature=0,
                                 stream=True)
    next(iter(first))  # both idle: replica 0 takes it, and caches SHARED's blocks
    assert running(server) == {"0": 1.0, "1": 0.0}
    second = c.completions.create(model="demo", prompt=SHARED + "GLOUCESTER:\n", max_tokens=150, temperature=0,
                                  stream=True)
    next(iter(second))
    assert running(server) == {"0": 2.0, "1": 0.0}  # the busier replica, for its cached prefix
    first.close()  # (the server sees the client go and ends them)
    second.close()
    wait_idle(server)
    answer = c.completions.create(model="demo", prompt=SHARED + "ROMEO:\n", max_tokens=8, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens == 32  # SHARED's two blocks, in replica 0's cache
    assert answer.choices[0].text == greedy(reference, SHARED + "ROMEO:\n", 8)


@pytest.mark.slow
def test_sigterm_ends_every_process(server):
    """Runs last: it ends the module's server."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(60)  # (torchrun's own status after a SIGTERM is 1, whatever its workers did)
    except subprocess.TimeoutExpired:
        pytest.fail("torchrun was still running 60 s after SIGTERM:\n" + server.tail())
    pids = [server.api_pid, *server.ranks]
    deadline = time.monotonic() + 20
    while any(helpers.process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if helpers.process_alive(p)], server.tail()
    log = server.tail()
    assert "SIGTERM: no requests in flight: exiting" in log, log
    assert "exiting now" not in log and "ERROR" not in log, log
