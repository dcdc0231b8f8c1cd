"""``torchrun --nnodes 2 --nproc_per_node 2 -m llama.serve --data_parallel 2``: two engine
replicas of the demo model, each a model-parallel group of two ranks (gloo), a replica per node
(both nodes on this machine), behind one API process that the second replica's first rank reaches
over TCP.  Each replica answers greedily as the Python
API does, prefix routing sends a prompt that shares a cached prefix to the replica holding it
even when it is the busier one, and SIGTERM ends every process.  A replica's rank killed under
load ends the job without a client left waiting.  The quick tests check the pieces that connect
the replicas' first ranks to rank 0 (Unix socket, TCP, its errors and time bounds)"""

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
CLIENT_TIMEOUT_S = 60  # the clients' own timeout, which a request that hangs would reach
ENDED_WITHIN_S = 45  # after a replica's rank is killed: every client answered, every process ended
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


def _listener(tmp_path: Path) -> Listener:
    """As rank 0 listens: without an authkey (engine_process._accept_replicas authenticates)."""
    return Listener(str(tmp_path / "replicas.sock"), family="AF_UNIX")


def test_replicas_are_accepted_in_replica_order(tmp_path):
    key = os.urandom(32)
    listener = _listener(tmp_path)
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
        conns = engine_process._accept_replicas(listener, 2, key)
        for t in threads:
            t.join(10)
        assert [decode(c.recv_bytes())[1]["index"] for c in conns] == [1, 2]
    finally:
        listener.close()
        for c in ends:
            c.close()


def test_a_replica_with_another_key_or_none_at_all_is_an_error(tmp_path, monkeypatch):
    listener = _listener(tmp_path)

    def intruder() -> None:
        try:
            Client(listener.address, family="AF_UNIX", authkey=b"x" * 32)
        except (AuthenticationError, OSError, EOFError):
            pass

    thread = threading.Thread(target=intruder)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="0 of the 1 other replicas' first ranks connected to rank 0: "):
            engine_process._accept_replicas(listener, 1, b"k" * 32)
    finally:
        thread.join(10)
        listener.close()
    monkeypatch.setattr(engine_process, "REPLICA_CONNECT_S", 0.2)
    listener = Listener(str(tmp_path / "quiet.sock"), family="AF_UNIX")
    try:
        with pytest.raises(RuntimeError, match=r"0 of the 1 other replicas' .* within 0.2 s; see their logs"):
            engine_process._accept_replicas(listener, 1, b"k" * 32)
    finally:
        listener.close()


def test_join_replicas_on_one_machine_uses_a_private_unix_socket_and_leaves_none(tmp_path, monkeypatch):
    """Every first rank on rank 0's machine and no --data_parallel_address: a Unix socket in a new
    folder, removed after; a first rank that cannot reach it (another machine of the same name)
    is told to pass --data_parallel_address.  (First ranks on other machines: test_replicas_nodes.py.)"""
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
    channel = engine_process.ReplicaChannel("AF_UNIX", "/nowhere/replicas.sock", b"k" * 32)
    monkeypatch.setattr(distributed, "replica_index", lambda: 1)
    monkeypatch.setattr(distributed, "share_over_job", lambda obj: channel)
    with pytest.raises(RuntimeError, match=r"^replica 1's first rank cannot connect to rank 0 at "
                                           r"/nowhere/replicas.sock \(No such file or directory\): it must run on "
                                           r"rank 0's machine, or rank 0 must listen on TCP: pass "
                                           r"--data_parallel_address$"):
        engine_process.join_replicas(2)


def _outbound_ip() -> str | None:
    """An address of this machine other than loopback (the one its default route leaves from), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # (UDP: nothing is sent)
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def _join_as_rank0(monkeypatch, machines: list, address: str | None = None):
    """join_replicas on rank 0 of a job whose replicas' first ranks run on ``machines`` (by
    replica), in a thread; returns the thread, the channel rank 0 sent and a list that receives
    join's result or error."""
    import queue

    sent: queue.SimpleQueue = queue.SimpleQueue()
    out: list = []
    monkeypatch.setattr(distributed, "model_parallel_rank", lambda: 0)
    monkeypatch.setattr(distributed, "replica_index", lambda: 0)
    monkeypatch.setattr(distributed, "gather_over_job", lambda obj: [obj, *machines[1:]])
    monkeypatch.setattr(distributed, "share_over_job", lambda obj: (sent.put(obj), obj)[1])

    def run() -> None:
        try:
            out.append(engine_process.join_replicas(len(machines), address))
        except BaseException as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, sent.get(timeout=10), out


def _tcp_options(conn) -> tuple[int, int, bytes]:
    import socket

    s = socket.socket(fileno=conn.fileno())
    try:
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # (Linux: 30 s unacknowledged and the peer is gone)
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000
        return (s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
                s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
    finally:
        s.detach()


def test_data_parallel_address_makes_rank_0_listen_on_tcp_even_on_one_machine(monkeypatch):
    """--data_parallel_address 127.0.0.1 (the two-node test's setting): TCP at that address, a
    port the OS chose; the replica's first rank and rank 0 authenticate each other and talk, each
    end sending frames at once (TCP_NODELAY), probing an idle peer (keepalive), and reading
    without a time bound once in."""
    thread, channel, out = _join_as_rank0(monkeypatch, [None, engine_process.this_machine()], "127.0.0.1")
    assert channel.family == "AF_INET" and channel.address[0] == "127.0.0.1" and channel.address[1] > 0
    replica = engine_process.connect_to_rank0(channel, 1)
    thread.join(10)
    (conns, none), = out
    assert none is None and len(conns) == 1
    replica.send_bytes(encode(("hello", {"index": 1})))
    assert decode(conns[0].recv_bytes()) == ("hello", {"index": 1})
    conns[0].send_bytes(encode(("stop",)))
    assert decode(replica.recv_bytes()) == ("stop",)
    for end in (replica, conns[0]):
        assert _tcp_options(end) == (1, 1, bytes(16))
        end.close()
    with pytest.raises(ConnectionRefusedError):  # the listening socket is closed once all are in
        import socket

        socket.create_connection(channel.address, timeout=5).close()


def test_a_first_rank_on_another_machine_makes_rank_0_listen_on_tcp_at_master_addr(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    thread, error, out = _join_as_rank0(monkeypatch, [None, "elsewhere/boot"])
    thread.join(10)
    fix = "pass --data_parallel_address with an address of rank 0's machine that the other machines reach"
    assert isinstance(error, RuntimeError) and isinstance(out[0], RuntimeError)  # (sent to every rank, raised by all)
    assert str(out[0]) == ("MASTER_ADDR 127.0.0.1 is a loopback address (127.0.0.1), which the replicas' first "
                           f"ranks on other machines cannot reach: {fix}")
    ip = _outbound_ip()
    if ip is None:
        pytest.skip("this machine has no address but loopback")
    monkeypatch.setenv("MASTER_ADDR", ip)
    thread, channel, out = _join_as_rank0(monkeypatch, [None, "elsewhere/boot"])
    assert (channel.family, channel.address[0]) == ("AF_INET", ip)
    replica = engine_process.connect_to_rank0(channel, 1)
    thread.join(10)
    assert len(out[0][0]) == 1
    out[0][0][0].close()
    replica.close()


def test_rank_0_refuses_addresses_it_cannot_listen_on(monkeypatch):
    fix = "pass --data_parallel_address with an address of rank 0's machine that the other machines reach"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match=f"^the replicas' first ranks run on other machines than rank 0 and "
                                           f"MASTER_ADDR is not set: {fix}$"):
        engine_process.open_replica_channel(None, remote=True)
    with pytest.raises(RuntimeError, match=r"^rank 0 cannot listen on --data_parallel_address 198.51.100.7 "
                                           r"\(198.51.100.7\) for the replicas: .*; give an address of rank 0's "
                                           r"machine$"):
        engine_process.open_replica_channel("198.51.100.7", remote=True)  # (TEST-NET-2: no machine's)
    with pytest.raises(RuntimeError, match=r"^--data_parallel_address 'no-such-host.invalid' is not an address this "
                                           r"machine knows"):
        engine_process.open_replica_channel("no-such-host.invalid", remote=False)


def test_a_first_rank_that_cannot_reach_rank_0_or_meets_a_stranger_fails_within_the_bound(monkeypatch):
    import socket

    monkeypatch.setattr(engine_process, "REPLICA_HANDSHAKE_S", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    channel = engine_process.ReplicaChannel("AF_INET", ("127.0.0.1", port), b"k" * 32)
    with pytest.raises(RuntimeError, match=rf"^replica 1's first rank cannot connect to rank 0 at 127.0.0.1:{port} "
                                           r"\(Connection refused\): check that this machine reaches"):
        engine_process.connect_to_rank0(channel, 1)
    with socket.create_server(("127.0.0.1", 0)) as stranger:  # accepts (the kernel's backlog), never speaks
        channel = engine_process.ReplicaChannel("AF_INET", stranger.getsockname()[:2], b"k" * 32)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^replica 1's first rank reached rank 0 at 127.0.0.1:\d+ but the two "
                                               r"could not authenticate each other \(no answer within 0.3 s\)"):
            engine_process.connect_to_rank0(channel, 1)
        assert time.monotonic() - start < 5


def _intrude(address) -> None:
    """Connect to ``address`` with a wrong key (multiprocessing's own client)."""
    try:
        Client(address, authkey=b"x" * 32)
    except (AuthenticationError, OSError, EOFError):
        pass


def test_rank_0_fails_a_stranger_on_its_port_within_the_bound(monkeypatch):
    """Something that connects to rank 0's TCP port and says nothing, or answers with another key:
    a one-line error on rank 0 within REPLICA_HANDSHAKE_S, not a wait for REPLICA_CONNECT_S."""
    import socket

    monkeypatch.setattr(engine_process, "REPLICA_HANDSHAKE_S", 0.3)
    for intrude in ("silent", "another key"):
        listener, channel, folder = engine_process.open_replica_channel("127.0.0.1", remote=False)
        assert folder == ""
        if intrude == "silent":
            peer = socket.create_connection(channel.address, timeout=5)
        else:
            peer = None
            threading.Thread(target=_intrude, args=(channel.address,), daemon=True).start()
        start = time.monotonic()
        try:
            with pytest.raises(RuntimeError, match=r"^0 of the 1 other replicas' first ranks connected to rank 0: .*"
                                                   r"\(a connection from \('127.0.0.1', \d+\)\); see their logs$"):
                engine_process._accept_replicas(listener, 1, channel.authkey)
            assert time.monotonic() - start < 5
        finally:
            listener.close()
            if peer is not None:
                peer.close()


def test_a_failure_of_rank_0_is_raised_on_every_rank(monkeypatch):
    monkeypatch.setattr(distributed, "gather_over_job", lambda obj: [obj])
    monkeypatch.setattr(distributed, "share_over_job", lambda obj: RuntimeError("rank 0 cannot listen"))
    for rank_in_group in (0, 1):  # a replica's first rank, and another of its ranks
        monkeypatch.setattr(distributed, "model_parallel_rank", lambda r=rank_in_group: r)
        monkeypatch.setattr(distributed, "replica_index", lambda: 1)
        with pytest.raises(RuntimeError, match="^rank 0 cannot listen$"):
            engine_process.join_replicas(2)


def test_llama_serve_refuses_data_parallel_address_without_torchrun(monkeypatch):
    from llama.serve.server import main

    monkeypatch.setattr(distributed, "planned_world_size", lambda: 1)
    with pytest.raises(ValueError, match=r"^--data_parallel_address is where replicas under torchrun"):
        main(["--data_parallel", "2", "--data_parallel_address", "127.0.0.1", "--device", "cpu"])


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


def start_job(log_path: Path, serve_flags: list[str], *, nodes: int, nproc_per_node: int) -> list[subprocess.Popen]:
    """``torchrun ... -m llama.serve --device cpu --max_seq_len 256 SERVE_FLAGS`` on this machine,
    writing to ``log_path``: one agent with ``nodes=1`` (``--standalone``), else one agent per node
    meeting at a static rendezvous on 127.0.0.1 (as two machines would), each a session of its own.
    Returns the agents, node 0's first."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LLAMA_COLLECTIVE_TIMEOUT_S": "30",
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
    serve = ["-m", "llama.serve", "--device", "cpu", "--max_seq_len", str(MAX_SEQ_LEN), *serve_flags]
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nodes == 1:
        commands = [[*run, "--standalone", *serve]]
    else:
        rendezvous = ["--nnodes", str(nodes), "--master_addr", "127.0.0.1", "--master_port", str(helpers.free_port())]
        commands = [[*run, *rendezvous, "--node_rank", str(k), *serve] for k in range(nodes)]
    with open(log_path, "w") as log:
        return [subprocess.Popen(c, env=env, cwd=helpers.REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True) for c in commands]


def end_job(agents: list[subprocess.Popen], pids: list) -> None:
    """SIGKILL whatever is left of a job: its agents' process groups, then ``pids`` (the API
    process and the ranks, which torchrun may have left)."""
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    for pid in pids:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for agent in agents:
        agent.wait(10)


# The module's server: two nodes of two ranks each (a replica of 2 ranks per node), rank 0 listening
# on TCP as it does when the replicas' first ranks are on other machines (--data_parallel_address
# forces it, both nodes being this machine).  One job covers both the "2 replicas of 2 ranks"
# and the multi-machine path; the one-machine Unix socket's joining is checked by the quick tests
# above (the engine messages over it are the same as over TCP).
LAYOUTS = {
    "two_nodes_2x2_tcp": dict(nodes=2, nproc_per_node=2, flags=["--data_parallel_address", "127.0.0.1"]),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, tmp_path_factory):
    layout = LAYOUTS[request.param]
    port = helpers.free_port()
    log_path = tmp_path_factory.mktemp("replicas_torchrun") / "server.log"
    agents = start_job(log_path, ["--port", str(port), "--data_parallel", "2", "--shutdown_grace_s", "2",
                                  *layout["flags"]], nodes=layout["nodes"], nproc_per_node=layout["nproc_per_node"])
    s = type("S", (), {})()
    s.layout, s.agents, s.url, s.log_path = request.param, agents, f"http://127.0.0.1:{port}", log_path
    s.tail = lambda: log_path.read_text(errors="replace")[-8000:]
    try:
        if not helpers.wait_until_healthy(agents[0], s.url, START_TIMEOUT_S, s.tail):
            pytest.fail(f"no answer within {START_TIMEOUT_S} s:\n{s.tail()}")
        log = log_path.read_text()
        found = re.search(r"API process (\d+): serving 2 engine replicas", log)
        assert found, s.tail()
        s.api_pid = int(found.group(1))
        s.ranks = [pid for agent in agents for pid in children(agent.pid)]
        assert len(s.ranks) == layout["nodes"] * layout["nproc_per_node"], s.ranks
        tcp = re.search(r"the replicas' first ranks connect to 127.0.0.1:\d+ over TCP \(authenticated", log)
        assert bool(tcp) == (layout["nodes"] > 1), s.tail()
        yield s
    finally:
        end_job(agents, [getattr(s, "api_pid", None), *getattr(s, "ranks", ())])


@pytest.fixture(scope="module")
def reference():
    return helpers.demo_llama(MAX_SEQ_LEN)


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
def test_each_replica_answers_as_the_python_api(server, reference):
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
    for agent in server.agents:  # (on several machines: each node's torchrun, as a cluster's scheduler stops a job)
        agent.send_signal(signal.SIGTERM)
    for agent in server.agents:
        try:
            agent.wait(60)  # (torchrun's own status after a SIGTERM is 1, whatever its workers did)
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


def rank_of(pid: int) -> int:
    """The torchrun rank of process ``pid`` (its environment's RANK)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


@pytest.mark.slow
def test_a_replica_killed_under_load_ends_the_job_and_leaves_no_client_waiting(tmp_path):
    """2 replicas of 1 rank under torchrun, four clients streaming requests one after another;
    SIGKILL the second replica's rank.  Torchrun stops the job (it does when a rank dies); until
    then the API process serves on the first replica.  Every request ends in a finished answer
    or an error well within the clients' own timeout (none times out: nothing hangs), and every
    process ends."""
    port = helpers.free_port()
    log_path = tmp_path / "server.log"
    agents = start_job(log_path, ["--port", str(port), "--data_parallel", "2", "--shutdown_grace_s", "10"],
                       nodes=1, nproc_per_node=2)
    url = f"http://127.0.0.1:{port}"
    tail = lambda: log_path.read_text(errors="replace")[-8000:]  # noqa: E731
    pids: list = []
    try:
        if not helpers.wait_until_healthy(agents[0], url, START_TIMEOUT_S, tail):
            pytest.fail(f"no answer within {START_TIMEOUT_S} s:\n{tail()}")
        found = re.search(r"API process (\d+): serving 2 engine replicas", log_path.read_text())
        assert found, tail()
        ranks = {rank_of(pid): pid for pid in children(agents[0].pid)}
        assert sorted(ranks) == [0, 1], ranks
        pids = [int(found.group(1)), *ranks.values()]
        killed_at: list[float] = []
        outcomes: list[tuple[str, str, float]] = []  # (what, detail, when) of each request

        def stream_requests() -> None:
            c = helpers.openai_client(url, timeout=CLIENT_TIMEOUT_S)
            while True:  # until the server stops answering
                try:
                    chunks = list(c.completions.create(model="demo", prompt=LONG, max_tokens=200, temperature=0,
                                                       stream=True))
                    outcomes.append(("finished", str(chunks[-1].choices[0].finish_reason), time.monotonic()))
                except Exception as e:  # noqa: BLE001 (every error is an outcome: which is asserted below)
                    outcomes.append(("error", type(e).__name__, time.monotonic()))
                    if killed_at:
                        return

        clients = [threading.Thread(target=stream_requests, daemon=True) for _ in range(4)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and min(helpers.metric_by_label(url, "llama_replica_requests_running")
                                                   .values(), default=0) < 1:
            time.sleep(0.02)
        os.kill(ranks[1], signal.SIGKILL)  # (both replicas streaming)
        killed_at.append(time.monotonic())
        for t in clients:
            t.join(max(0.0, killed_at[0] + ENDED_WITHIN_S - time.monotonic()))
        assert not [t for t in clients if t.is_alive()], f"clients still waiting {ENDED_WITHIN_S} s after the kill"
        for agent in agents:
            agent.wait(max(1.0, killed_at[0] + ENDED_WITHIN_S - time.monotonic()))
        assert agents[0].returncode != 0  # (torchrun reports the failed rank)
        while any(helpers.process_alive(p) for p in pids) and time.monotonic() < killed_at[0] + ENDED_WITHIN_S:
            time.sleep(0.05)
        assert not [p for p in pids if helpers.process_alive(p)], tail()
        print([(what, detail, round(when - killed_at[0], 2)) for what, detail, when in outcomes])
        assert not [o for o in outcomes if o[0] == "error" and "Timeout" in o[1]], outcomes  # none hung
        assert all(o[1] == "length" for o in outcomes if o[0] == "finished"), outcomes  # (200 tokens: none cut)
        after = [(what, detail) for what, detail, when in outcomes if when >= killed_at[0]]
        assert ("error", "APIError") in after, after  # the second replica's streams: an error event each
        assert ("finished", "length") in after, after  # the first's: served to the end
        log = tail()
        assert re.search(r"replica 1 stopped on an error \(.*\): its requests failed; 1 replica\(s\) left", log), log
    finally:
        end_job(agents, pids)
