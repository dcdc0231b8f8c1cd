"""Replicas behind one front end (llama.serve.router): fake engines behind real bridges and socket
pairs, a Router over their clients.  A request goes to the replica holding the longest prefix of its
prompt (in its scope), else to the least loaded; round robin ignores prefixes; a replica that dies
fails its own requests while the others serve, and the router gives up once none is left."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest

import helpers
from fake_engine import FakeEngine
from llama.engine import EngineStopped, RequestSettings, TokenEvent
from llama.serve.engine_process import EngineBridge, EngineClient, EngineDied
from llama.serve.router import Router, block_hashes
from llama.tokenizer import load_tokenizer

TIMEOUT_S = 10
BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(helpers.REPO / "demo" / "tokenizer.model")


class Replica:
    def __init__(self, tokenizer) -> None:
        self.engine = FakeEngine(tokenizer, max_batch_size=4, max_seq_len=64, max_queue=16, step_s=0.002)
        self.engine.paused.set()  # requests stay in flight until the test lets them run
        a, b = socket.socketpair()
        self.engine_end, api_end = Connection(a.detach()), Connection(b.detach())
        self.stop = threading.Event()
        self.bridge = EngineBridge(SimpleNamespace(engine=self.engine, tokenizer=tokenizer), self.engine_end, self.stop)
        self.bridge.start()
        self.main = threading.Thread(target=self._run, daemon=True)
        self.main.start()
        self.client = EngineClient(api_end, {"max_batch_size": 4, "max_seq_len": 64,
                                             "n_decodable": tokenizer.n_words, "lora": {}})

    def _run(self) -> None:
        self.engine.run_forever(self.stop)
        self.bridge.close()

    def die(self) -> None:
        socket.socket(fileno=os.dup(self.engine_end.fileno())).shutdown(socket.SHUT_RDWR)


def wait_until(condition, seconds: float) -> None:
    """Check ``condition`` every 50 ms until it holds or ``seconds`` have passed (the caller asserts)."""
    pause = threading.Event()
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        pause.wait(0.05)


class Served:
    def __init__(self, tokenizer, n: int = 2, policy: str = "prefix") -> None:
        self.replicas = [Replica(tokenizer) for _ in range(n)]
        self.router = Router([r.client for r in self.replicas], block_size=BLOCK, policy=policy)
        self.stop = threading.Event()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.router.run_forever(self.stop)
        except BaseException as e:
            self.error.append(e)

    def send(self, prompt: list[int], scope=None) -> tuple[int, list]:
        """Submit; the index of the replica it went to, and the list its events arrive in."""
        before = list(self.router.routed)
        got: list = []
        self.router.submit(prompt, RequestSettings(max_new_tokens=3, temperature=0.0, cache_scope=scope), got.append)
        return next(k for k, (a, b) in enumerate(zip(before, self.router.routed)) if a != b), got

    def close(self) -> None:
        for r in self.replicas:
            r.engine.paused.clear()
        self.stop.set()
        self.thread.join(TIMEOUT_S)
        for r in self.replicas:
            r.stop.set()
            r.main.join(TIMEOUT_S)


def test_block_hashes_chain_whole_blocks():
    a = block_hashes(list(range(10)), None, 4)
    assert len(a) == 2  # two full blocks; the last two tokens fill none
    assert block_hashes(list(range(8)) + [99], None, 4) == a  # the same first blocks
    b = block_hashes([0, 1, 2, 3, 9, 9, 9, 9], None, 4)
    assert b[0] == a[0] and b[1] != a[1]  # a block's hash stands for every token before it
    assert block_hashes(list(range(10)), "key", 4)[0] != a[0]  # another scope shares nothing


def test_requests_go_where_their_prefix_is_cached_else_to_the_least_loaded(tokenizer):
    served = Served(tokenizer)
    try:
        a, b = list(range(1, 13)), list(range(20, 32))  # three blocks each
        assert served.send(a)[0] == 0  # both idle: the first
        assert served.send(b)[0] == 1  # the least loaded
        assert served.send(b[:8] + [50, 51])[0] == 1  # b's first two blocks are cached on replica 1
        assert served.send(a[:4] + [60, 61, 62, 63])[0] == 0  # a's first block, on replica 0 (2 in flight each)
        assert served.send(a + [70])[0] == 0  # the prefix wins over the load (3 in flight there, 2 on replica 1)
        assert served.send([5, 6, 7])[0] == 1  # no whole block in common: the least loaded
        # b's blocks are on replica 1, but not in another scope: the least loaded (3 each: the first)
        assert served.send(b, scope="other key")[0] == 0
        stats = served.router.stats()
        assert [s["queued"] + s["slots_in_use"] for s in stats["replicas"]] == [4, 3]
        assert stats["queued"] + stats["slots_in_use"] == 7
        assert served.router.routed_by_prefix == 3
    finally:
        served.close()
    assert not served.error


def test_round_robin_ignores_prefixes(tokenizer):
    served = Served(tokenizer, policy="round_robin")
    try:
        prompt = list(range(1, 13))
        assert [served.send(prompt)[0] for _ in range(4)] == [0, 1, 0, 1]
    finally:
        served.close()


def test_a_dead_replica_fails_its_requests_and_the_others_serve(tokenizer):
    served = Served(tokenizer)
    try:
        a = list(range(1, 13))
        on_0 = served.send(a)
        on_1 = served.send(list(range(20, 32)))
        assert (on_0[0], on_1[0]) == (0, 1)
        served.replicas[0].die()
        wait_until(lambda: on_0[1] and isinstance(on_0[1][-1], EngineDied), 5)
        assert isinstance(on_0[1][-1], EngineDied)
        # a's prefix was on replica 0: it goes to replica 1 now, and is answered
        k, got = served.send(a)
        assert k == 1
        served.replicas[1].engine.paused.clear()
        wait_until(lambda: got and not isinstance(got[-1], TokenEvent), 10)
        assert got[-1].finish_reason == "length" and on_1[1][-1].finish_reason == "length"
        assert served.router.stats()["replicas"][0] == {} and served.thread.is_alive()
        served.replicas[1].die()
        served.thread.join(TIMEOUT_S)
        assert len(served.error) == 1 and isinstance(served.error[0], EngineDied)
        stats = served.router.stats()
        assert stats["replicas"] == [{}, {}] and stats["queued"] == stats["slots_in_use"] == 0
        with pytest.raises(EngineStopped, match="every engine replica"):
            served.send(a)
    finally:
        served.close()


def test_a_replica_whose_engine_just_died_is_passed_over(tokenizer):
    """Between a replica's engine dying (its client knows, its requests have failed) and the
    router's reader thread marking it, a new request for the prefix it held goes to a live
    replica, rather than failing (it did, now and then, in the test above)."""
    served = Served(tokenizer)
    try:
        a = list(range(1, 13))
        on_0 = served.send(a)
        assert on_0[0] == 0
        served.replicas[0].die()
        wait_until(lambda: on_0[1] and isinstance(on_0[1][-1], EngineDied), 5)
        assert isinstance(on_0[1][-1], EngineDied)
        served.router.replicas[0].alive = True  # as in the window before the reader thread marks it
        k, got = served.send(a)
        assert k == 1
        served.replicas[1].engine.paused.clear()
        wait_until(lambda: got and not isinstance(got[-1], TokenEvent), 10)
        assert got[-1].finish_reason == "length"
    finally:
        served.close()


def test_replicas_started_before_a_failed_build_are_ended(monkeypatch):
    """``llama-serve --data_parallel 2`` starts its other replica before loading its own model;
    when its own load fails, that replica (a session of its own, which nothing else would stop)
    is ended and its connection closed, and the load's error is what the caller gets."""
    from llama.engine import build
    from llama.serve import engine_process, server

    started: dict = {}

    def start_replicas(n, argv):  # a replica still loading: a process that would run for minutes
        procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
                 for _ in range(n)]
        pairs = [socket.socketpair() for _ in range(n)]
        started.update(procs=procs, ends=[ours for ours, _ in pairs], theirs=[theirs for _, theirs in pairs])
        return procs, started["ends"]

    def build_engine(**kwargs):
        raise RuntimeError("not enough memory for the model")

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(engine_process, "start_replicas", start_replicas)
    monkeypatch.setattr(build, "build_engine", build_engine)
    try:
        with pytest.raises(RuntimeError, match="not enough memory"):
            server.main(["--port", str(helpers.free_port()), "--device", "cpu", "--data_parallel", "2"])
        (proc,) = started["procs"]
        assert proc.poll() is not None, "the replica started before the failed build is still running"
        assert started["ends"][0].fileno() == -1  # its connection closed
        assert started["theirs"][0].recv(1) == b""  # (the replica's end sees the API side gone)
    finally:
        for proc in started.get("procs", ()):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for theirs in started.get("theirs", ()):
            theirs.close()
