"""The engine in a process of its own (``llama-serve --engine_process``), as vLLM v1 runs it.

Two kinds of process, one pipe between them:

* **The API process** (:func:`api_main`, a new interpreter the first rank starts):
  HTTP (uvicorn, FastAPI), API keys, chat templates, tokenising prompts, compiling grammars,
  turning token events into OpenAI's answers and streams, ``/metrics``.  It holds no model.
  Its engine is an :class:`EngineClient`: the interface :class:`~llama.serve.serving.OpenAIServing`
  already uses of :class:`llama.engine.Engine` (``submit`` returning a handle with ``finished`` and
  ``cancel()``, ``on_event`` callbacks, ``stats()``, ``arriving()``, ``run_forever``), so that the
  endpoints are the same code in both designs.
* **The engine processes**: the torchrun ranks (or the one ``llama-serve`` process), scheduling
  and the model, as in the one-process design.  The first rank runs :class:`EngineBridge` beside
  its step loop: it submits what the API process sends and sends back what the engine emits.

The pipe is a Unix socket pair wrapped as a :class:`multiprocessing.connection.Connection`: each
message is one length-prefixed frame holding a pickled tuple whose first item names it
(:func:`encode` / :func:`decode`).  API process -> engine:

* ``("submit", rid, prompt, settings, grammar, images)``: a request, ``rid`` chosen by the API
  process; ``settings`` a :class:`~llama.engine.RequestSettings` without its grammar (an
  llguidance matcher does not pickle), which travels as ``(kind, source)`` in llguidance's JSON
  form and is compiled again on the engine's side (kept by source); ``images``: its
  :class:`~llama.images.prompt.PromptImage` s (pixel tensors pickled);
* ``("cancel", rid)``: end it at the next step (a client went away, a group failed);
* ``("arriving", +1 | -1)``: a request is being read and tokenised / was submitted or refused
  (:meth:`llama.engine.Engine.arriving`: an idle engine waits for such, to start them together);
* ``("stop",)``: end every request left (``EngineStopped``) and stop stepping.

Engine -> API process:

* ``("hello", config)``: first, once: what the API process needs (the tokenizer's file, the image
  layout, the engine's sizes and adapters, the server's options);
* ``("events", [(rid, event), ...], stats)``: every event emitted since the last message, in order
  (a :class:`~llama.engine.TokenEvent`, then the :class:`~llama.engine.RequestResult` or the
  error; a request the engine refused at submission gets its error this way), with the engine's
  ``stats()`` after them.  Events are batched by the sender thread: one message per step under load;
* ``("stopped",)``: last, after the events of the requests ``stop`` ended.

Where this differs from vLLM: the engine still detokenises (its stop strings end a request at
the step they appear, and each request's text is cut there); the API process turns tokens and
text into JSON.

Failures.  The API process reads the pipe on its main thread
(:meth:`EngineClient.run_forever`, where the one-process server steps the engine): end of file,
or its parent process gone, means the engine process died.  It then fails every request in
flight (:class:`EngineDied`: a stream gets an error event, an answer a 500), answers new
requests 503, logs it, and exits with status 1.  The engine's side ends its requests and
exits 1 when the API process goes away.  SIGTERM / SIGINT sent to the first rank are passed
to the API process, which drains as the one-process server does (:mod:`~llama.serve.shutdown`:
the requests in flight finish within ``--shutdown_grace_s``), then sends ``stop``.

Replicas (``--data_parallel N``): the first process starts N - 1 more (:func:`start_replicas`:
``llama-serve`` with the same flags, each serving a connection instead of a port,
:func:`serve_replica`), and hands the API process every connection; there a
:class:`~llama.serve.router.Router` puts the N clients behind the one engine interface.  Each
replica speaks the same protocol (its ``hello`` carries only its engine's part).

Replicas under torchrun (``torchrun --nproc_per_node W -m llama.serve --data_parallel N``, on one
machine or several): the W ranks form N model-parallel groups of W / N consecutive ranks
(:func:`llama.runtime.distributed.plan_replicas`), each stepping on its own groups.  Rank 0 (the
first replica's first rank) starts the API process as above.  The other replicas' first ranks are
torchrun's children, not rank 0's, and may run on other machines, so they cannot inherit a
connection: rank 0 listens (:func:`open_replica_channel`) on a Unix socket in a new private folder
(mode 0700) when every first rank runs on its machine, else on TCP at ``--data_parallel_address``
(default: torchrun's ``MASTER_ADDR``; the flag also forces TCP on one machine), at a port the OS
chooses; it sends the address and a random key to every rank over torch.distributed
(:func:`join_replicas`), accepts each replica's connection, runs
:mod:`multiprocessing.connection`'s HMAC challenge with that key both ways (vLLM's engine
cores on other nodes reach its API server over ZMQ/TCP too, unauthenticated: its security guide
asks for an isolated network),
reads its ``("replica", k)`` and hands the connections, in replica order, to the API process; the
listening socket (and the Unix socket's file) is closed once all are in.  Every step of that has
a time bound (:data:`REPLICA_HANDSHAKE_S`, :data:`REPLICA_CONNECT_S`): a wrong address, a
firewall or a stranger on the port is a one-line error on the ranks concerned, not a hang.
Then each such first rank is served as a replica started by :func:`start_replicas` is
(:func:`serve_replica`), its group's other ranks following it as torchrun's other ranks follow
the first.  The socket carries only this protocol's messages (authenticated, not encrypted: the
prompts and answers cross the network in clear); the tensors of a step travel over
torch.distributed (gloo, NCCL) within each replica.  TCP connections send each frame at once
(``TCP_NODELAY``) and probe an idle peer (keepalive, and on Linux ``TCP_USER_TIMEOUT``), so that
a machine that vanishes ends its replica's requests within about half a minute instead of never.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import logging
import os
import pickle
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    from llama.engine import RequestSettings
    from llama.engine.build import LoadedModel
    from llama.formats.chat import ChatFormat
    from llama.serve.protocols import ServedEngine, ServedModel, ServedRequest
    from llama.structured import StructuredOutputs
    from llama.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Seconds the API process waits for the engine's last events after sending "stop", and the
# first rank for the API process to exit after the engine stopped.
STOP_WAIT_S = 20.0
POLL_S = 0.1
KEPT_GRAMMARS = 64  # grammars kept compiled on the engine's side, by source


class EngineDied(RuntimeError):
    """The engine process ended (killed, crashed) with requests in flight."""


# -- the messages ---------------------------------------------------------------------------------


def encode(message: tuple) -> bytes:
    """One message as the bytes of one frame (a pickled tuple).  An exception among a batch's
    events that does not pickle travels as a ``RuntimeError`` with its text."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        if message[0] != "events":
            raise
        events = [(rid, _portable(item)) for rid, item in message[1]]
        return pickle.dumps((message[0], events, *message[2:]), protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes) -> tuple:
    """The message one frame holds (a frame comes only from the other process of this server)."""
    message = pickle.loads(frame)
    if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
        raise ValueError(f"not a message of the engine's protocol: {type(message).__name__}")
    return message


def _portable(item: Any) -> Any:
    if not isinstance(item, BaseException):
        return item
    try:
        pickle.loads(pickle.dumps(item))
        return item
    except Exception:
        return RuntimeError(f"{type(item).__name__}: {item}")


def grammar_source(settings: "RequestSettings") -> tuple["RequestSettings", Optional[tuple[str, str]]]:
    """``settings`` as they travel (no grammar, no logits processor) and their grammar as
    ``(kind, source)`` (None: none).  ValueError for a logits processor: code, not data."""
    if settings.logits_processor is not None:
        raise ValueError("a logits_processor cannot be sent to an engine in another process")
    grammar = settings.grammar
    if grammar is None:
        return settings, None
    return dataclasses.replace(settings, grammar=None), (grammar.kind, grammar.source)


# -- the API process's side ------------------------------------------------------------------------


class _RemoteRequest:
    """A request submitted through an :class:`EngineClient` (a ``ServedRequest``)."""

    def __init__(self, client: "EngineClient", rid: int, on_event: Optional[Callable]) -> None:
        self.client = client
        self.id = rid
        self.on_event = on_event
        self.finished = False

    def cancel(self) -> None:
        if not self.finished:
            self.client._send_quietly(("cancel", self.id))


@dataclasses.dataclass
class _Adapters:
    paths: dict[str, str]  # what serving reads of the engine's LoRA adapters


class EngineClient:
    """The engine as the API process sees it: :class:`llama.engine.Engine`'s serving interface
    (:class:`~llama.serve.protocols.ServedEngine`) over a connection to the first rank.

    ``submit`` checks what it can here (settings, prompt length and ids, adapter name) and
    raises as the engine would; what only the engine can check comes back as the request's
    error.  ``stats()`` is the engine's last reported one, with the requests waiting and
    running counted here (every request of the engine comes from this process)."""

    def __init__(self, conn: Connection, info: dict, *, parent_pid: Optional[int] = None) -> None:
        self.conn = conn
        self.max_batch_size: int = info["max_batch_size"]
        self.max_seq_len: int = info["max_seq_len"]
        self.n_decodable: int = info["n_decodable"]
        self.image_token: Optional[int] = info.get("image_token")
        self.lora = _Adapters(dict(info["lora"])) if info.get("lora") else None
        self._stats: dict = dict(info.get("stats", {}))
        self._parent_pid = parent_pid
        self._ids = itertools.count()
        self._requests: dict[int, _RemoteRequest] = {}
        self._lock = threading.Lock()  # the requests table; sending
        self._send_lock = threading.Lock()
        self._failed: Optional[BaseException] = None

    # -- the ServedEngine interface --

    def submit(self, prompt_tokens: Sequence[int], settings: "RequestSettings",
               on_event: Optional[Callable] = None, *, images: Sequence[Any] = ()) -> _RemoteRequest:
        from llama.engine import EngineStopped, RequestSettings

        if self._failed is not None:
            raise EngineStopped(f"the engine stopped: {self._failed}")
        prompt = self._check_prompt(prompt_tokens)
        if not isinstance(settings, RequestSettings):
            raise TypeError(f"settings must be a RequestSettings, got {type(settings).__name__}")
        settings = settings.checked()
        if settings.lora is not None and (self.lora is None or settings.lora not in self.lora.paths):
            raise ValueError(f"unknown LoRA adapter {settings.lora!r}")
        sent, grammar = grammar_source(settings)
        with self._lock:
            request = _RemoteRequest(self, next(self._ids), on_event)
            self._requests[request.id] = request
        try:
            self._send(("submit", request.id, prompt, sent, grammar, tuple(images)))
        except (OSError, EOFError) as e:
            with self._lock:
                self._requests.pop(request.id, None)
            raise EngineStopped(f"the engine process is gone: {e}") from None
        return request

    @property
    def failed(self) -> bool:
        """Whether the engine process has died (set before its requests are failed)."""
        return self._failed is not None

    def in_flight(self) -> int:
        """Requests submitted and not yet ended."""
        with self._lock:
            return len(self._requests)

    def stats(self) -> dict:
        stats = dict(self._stats)
        in_flight = self.in_flight()
        running = min(int(stats.get("slots_in_use", 0)), in_flight)
        stats.update(queued=in_flight - running, running=running, slots_in_use=running)
        return stats

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        self._send_quietly(("arriving", 1))
        try:
            yield
        finally:
            self._send_quietly(("arriving", -1))

    def run_forever(self, should_stop: threading.Event) -> None:
        """Read the engine's messages and hand each event to its request's ``on_event``, until
        ``should_stop`` is set (then ask the engine to stop and read its last events); raises
        :class:`EngineDied` (after failing every request in flight) when the engine process
        goes away."""
        try:
            while not should_stop.is_set():
                if self.conn.poll(POLL_S):
                    self._receive()
                elif self._parent_pid is not None and os.getppid() != self._parent_pid:
                    raise EOFError("the first rank's process is gone")
            self._send(("stop",))
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline:
                if self.conn.poll(POLL_S) and self._receive() == "stopped":
                    break
        except (EOFError, OSError) as e:
            error = EngineDied(f"the engine process died ({e or 'end of its connection'})")
            self._failed = error
            self._fail_all(error)
            raise error from None
        finally:
            from llama.engine import EngineStopped

            self._fail_all(EngineStopped("the server is shutting down"))
            with contextlib.suppress(OSError):
                self.conn.close()

    # -- messages --

    def _receive(self) -> str:
        message = decode(self.conn.recv_bytes())
        if message[0] == "events":
            _, events, stats = message
            self._stats = stats
            for rid, item in events:
                self._deliver(rid, item)
        return message[0]

    def _deliver(self, rid: int, item: Any) -> None:
        from llama.engine import TokenEvent

        with self._lock:
            request = self._requests.get(rid)
            if request is None:
                return
            if not isinstance(item, TokenEvent):  # its end
                request.finished = True
                del self._requests[rid]
        if request.on_event is not None:
            try:
                request.on_event(item)
            except Exception:
                logger.exception("on_event callback of request %d failed", rid)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            left = list(self._requests)
        for rid in left:
            self._deliver(rid, error)

    def _send(self, message: tuple) -> None:
        frame = encode(message)
        with self._send_lock:
            self.conn.send_bytes(frame)

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._send(message)
        except (OSError, EOFError):  # the engine is gone: run_forever reports it
            pass

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        """As :meth:`llama.engine.Engine.check_prompt`."""
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TypeError("prompt must be a list of int token ids")
        if not prompt:
            raise ValueError("prompt is empty: give at least one token (e.g. BOS)")
        if len(prompt) > self.max_seq_len:
            raise ValueError(f"prompt has {len(prompt)} tokens, more than max_seq_len={self.max_seq_len}: "
                             "shorten it or build with a larger max_seq_len")
        if not all(0 <= t < self.n_decodable or t == self.image_token for t in prompt):
            raise ValueError(f"prompt holds token ids outside [0, {self.n_decodable}) (the tokenizer's vocabulary)")
        return list(prompt)


@dataclasses.dataclass
class ApiModel:
    """What the API process serves (a :class:`~llama.serve.protocols.ServedModel`): the tokenizer,
    chat format and grammar compiler of the model, and an :class:`EngineClient` as its engine."""

    engine: Any  # an EngineClient, or a Router over several
    tokenizer: "Tokenizer"
    formatter: "ChatFormat"
    structured: "StructuredOutputs"


def api_main(conn_fd: int, sock_fd: int, replica_fds: Sequence[int] = ()) -> int:
    """The API process: read the first rank's ``hello``, load the tokenizer, serve HTTP on the
    listening socket ``sock_fd`` with an :class:`EngineClient` on ``conn_fd``; with ``replica_fds``
    (``--data_parallel``), the connections of the other replicas too, behind a
    :class:`~llama.serve.router.Router`."""
    from llama.cli.examples import setup_logging
    from llama.formats.chat import chat_format_for
    from llama.serve.server import serve
    from llama.structured.manager import StructuredOutputs
    from llama.tokenizer import load_tokenizer

    setup_logging()
    parent = os.getppid()
    conn = Connection(conn_fd)
    sock = socket.socket(fileno=sock_fd)
    kind, config = decode(conn.recv_bytes())
    if kind != "hello":
        raise RuntimeError(f"the engine's first message was {kind!r}, not 'hello'")
    tokenizer = load_tokenizer(config["tokenizer_path"])
    info = config["engine"]
    if tokenizer.n_words != info["n_words"]:
        raise RuntimeError(f"the API process's tokenizer ({config['tokenizer_path']}) has {tokenizer.n_words} ids, "
                           f"the engine's {info['n_words']}")
    formatter = chat_format_for(tokenizer, vision=config["vision"])
    engine: Any = EngineClient(conn, info, parent_pid=parent)
    if replica_fds:
        from llama.serve.router import Router

        clients = [engine]
        for fd in replica_fds:
            replica = Connection(fd)
            kind, hello = decode(replica.recv_bytes())  # (sent once its engine is built)
            if kind != "hello":
                raise RuntimeError(f"a replica's first message was {kind!r}, not 'hello'")
            clients.append(EngineClient(replica, hello["engine"], parent_pid=parent))
        engine = Router(clients, block_size=info["block_size"], policy=config["routing"])
        logger.info("API process %d: serving %d engine replicas (routing: %s)", os.getpid(), len(clients),
                    config["routing"])
    model = ApiModel(engine=engine, tokenizer=tokenizer, formatter=formatter, structured=StructuredOutputs(tokenizer))
    logger.info("API process %d: serving the engine of process %d", os.getpid(), parent)
    return serve(model, sock, **config["api"])


# -- the first rank's side ----------------------------------------------------------------------------

_CLOSE = object()  # the sender's last item


class EngineBridge:
    """On the first rank: what the API process sends, submitted to ``loaded.engine`` (from a
    reader thread); what the engine emits, sent back in batches (from a sender thread).
    ``stop`` is set when the API process says ``stop`` or goes away (:attr:`api_gone`)."""

    def __init__(self, loaded: "LoadedModel", conn: Connection, stop: threading.Event) -> None:
        self.engine = loaded.engine
        self.tokenizer = loaded.tokenizer
        self.conn = conn
        self.stop = stop
        self.api_gone = False
        self._stop_asked = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._arrivals: list[contextlib.AbstractContextManager] = []
        self._grammars: OrderedDict[str, Any] = OrderedDict()
        self._grammar_tokenizer: Any = None
        self._reader = threading.Thread(target=self._read, name="engine-bridge-in", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="engine-bridge-out", daemon=True)

    def hello(self, config: dict) -> None:
        self.conn.send_bytes(encode(("hello", config)))

    def start(self) -> None:
        self._reader.start()
        self._sender.start()

    def close(self, timeout: float = 10.0) -> None:
        """After the engine stopped: send what is left and ``stopped``, then close."""
        self._outbox.put(_CLOSE)
        self._sender.join(timeout)
        for arrival in self._arrivals:
            arrival.__exit__(None, None, None)
        self._arrivals.clear()
        with contextlib.suppress(OSError):
            self.conn.close()

    def _read(self) -> None:
        try:
            while True:
                self._handle(decode(self.conn.recv_bytes()))
        except (EOFError, OSError):
            if not self._stop_asked:
                self.api_gone = True
                logger.error("the API process went away: stopping the engine")
                self.stop.set()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            self._submit(*message[1:])
        elif kind == "cancel":
            with self._lock:
                handle = self._handles.get(message[1])
            if handle is not None:
                handle.cancel()
        elif kind == "arriving":
            if message[1] > 0:
                arrival = self.engine.arriving()
                arrival.__enter__()
                self._arrivals.append(arrival)
            elif self._arrivals:
                self._arrivals.pop().__exit__(None, None, None)
        elif kind == "stop":
            self._stop_asked = True
            self.stop.set()
        else:
            logger.error("unknown message %r from the API process (ignored)", kind)

    def _submit(self, rid: int, prompt: list[int], settings: "RequestSettings", grammar: Optional[tuple[str, str]],
                images: tuple) -> None:
        try:
            if grammar is not None:
                settings = dataclasses.replace(settings, grammar=self._grammar(*grammar))
            on_event = self._listener(rid)
            handle = (self.engine.submit(prompt, settings, on_event, images=images) if images
                      else self.engine.submit(prompt, settings, on_event))
        except Exception as e:  # refused: the request's error
            self._outbox.put((rid, e))
            return
        with self._lock:
            if not handle.finished:
                self._handles[rid] = handle

    def _listener(self, rid: int) -> Callable[[Any], None]:
        from llama.engine import TokenEvent

        def on_event(item: Any) -> None:  # (on the stepping thread)
            self._outbox.put((rid, item))
            if not isinstance(item, TokenEvent):
                with self._lock:
                    self._handles.pop(rid, None)

        return on_event

    def _grammar(self, kind: str, source: str) -> Any:
        """The grammar the API process compiled (and checked), compiled here again from its source."""
        import llguidance

        from llama.structured.response_format import Grammar
        from llama.structured.vocabulary import GrammarTokenizer

        if source in self._grammars:
            self._grammars.move_to_end(source)
            return self._grammars[source]
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer)
        gt = self._grammar_tokenizer
        limits = llguidance.LLParserLimits(verbose_errors=False)
        grammar = Grammar(kind, source, gt, llguidance.LLMatcher(gt.ll, source, log_level=0, limits=limits))
        self._grammars[source] = grammar
        while len(self._grammars) > KEPT_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def _send_loop(self) -> None:
        closing = False
        while not closing:
            batch = [self._outbox.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._outbox.get_nowait())
            if _CLOSE in batch:
                closing = True
                batch = [item for item in batch if item is not _CLOSE]
            try:
                if batch:
                    self.conn.send_bytes(encode(("events", batch, self.engine.stats())))
                if closing:
                    self.conn.send_bytes(encode(("stopped",)))
            except (OSError, EOFError):  # the API process is gone: the reader says so
                return


class _HasFileno(Protocol):
    def fileno(self) -> int: ...

    def close(self) -> None: ...


def start_api_process(sock: socket.socket, replicas: Sequence[_HasFileno] = ()
                      ) -> tuple[subprocess.Popen, Connection]:
    """The API process, started on the listening socket ``sock`` (and the other replicas'
    connections, ``replicas``); the connection to it."""
    ours, theirs = socket.socketpair()
    fds = (theirs.fileno(), sock.fileno())
    extra = tuple(r.fileno() for r in replicas)
    code = ("import sys; from llama.serve.engine_process import api_main; "
            f"sys.exit(api_main({fds[0]}, {fds[1]}, {extra!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code],
                            pass_fds=fds + extra, stdin=subprocess.DEVNULL, start_new_session=True)
    for s in (theirs, sock, *replicas):  # the API process holds them now
        s.close()
    return proc, Connection(ours.detach())


# Set in a replica's environment (--data_parallel): the file descriptor of its connection to the API process.
REPLICA_FD_ENV = "LLAMA_SERVE_REPLICA_FD"


def start_replicas(n: int, argv: Sequence[str]) -> tuple[list[subprocess.Popen], list[socket.socket]]:
    """``n`` more engine replicas (``python -m llama.serve`` with the same flags, told by
    :data:`REPLICA_FD_ENV` to serve a connection instead of a port), each loading the model
    while this process loads its own; their processes and the API process's ends of their
    connections."""
    procs, ends = [], []
    for k in range(n):
        ours, theirs = socket.socketpair()
        env = {**os.environ, REPLICA_FD_ENV: str(theirs.fileno()), "LLAMA_SERVE_REPLICA_INDEX": str(k + 1)}
        procs.append(subprocess.Popen([sys.executable, "-m", "llama.serve", *argv], env=env,
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      start_new_session=True))
        theirs.close()
        ends.append(ours)
    return procs, ends


def stop_started_replicas(procs: Sequence[subprocess.Popen], ends: Sequence[socket.socket]) -> None:
    """End replicas from :func:`start_replicas` that were never served (this process's own model
    failed to build): close their connections, SIGTERM them (they are still loading: no drain to
    wait for), and SIGKILL any still running after ``STOP_WAIT_S``.  They run in sessions of their
    own, so nothing else would stop them."""
    for end in ends:
        end.close()
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_replica(loaded: "LoadedModel", conn: Union[int, Connection], *, grace_s: Optional[float] = None) -> int:
    """A replica started by :func:`start_replicas` (``conn``: its connection's file descriptor) or
    the first rank of a replica under torchrun (``conn``: the connection :func:`join_replicas`
    made): its engine's loop with an :class:`EngineBridge` on the connection until the API process
    says ``stop`` or goes away.  SIGTERM: stop now; with ``grace_s`` (under torchrun, where every
    rank gets torchrun's SIGTERM at once), the API process drains first and says ``stop``: this
    process only exits by itself if that takes past ``grace_s`` and the shutdown deadlines.
    Returns the exit status."""
    from llama.serve.shutdown import EXIT_DEADLINE_S, _exit_now

    conn = Connection(conn) if isinstance(conn, int) else conn
    stop = threading.Event()
    bridge = EngineBridge(loaded, conn, stop)
    bridge.hello({"engine": engine_config(loaded, "", {})["engine"]})
    bridge.start()
    if grace_s is None:
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    else:
        signalled = threading.Event()

        def on_signal(signum: int, frame: Any = None) -> None:
            if not signalled.is_set():
                signalled.set()
                deadline = threading.Timer(grace_s + 3 * EXIT_DEADLINE_S, _exit_now,
                                           args=(1, "the API process did not stop this replica in time"))
                deadline.daemon = True
                deadline.start()

        signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first replica's API process decides when to stop
    if grace_s is None:
        index = os.environ.get("LLAMA_SERVE_REPLICA_INDEX", "?")
    else:
        from llama.runtime import distributed

        index = str(distributed.replica_index())
    logger.info("replica %s (process %d) serving", index, os.getpid())
    code = 0
    try:
        loaded.engine.run_forever(stop)
    except BaseException as e:
        logger.error("the engine stopped on an error, exiting: %s", e)
        code = 1
    bridge.close()
    return 1 if bridge.api_gone else code


# Seconds rank 0 waits for the other replicas' first ranks to connect (they have loaded their
# model by then: the address is sent after every rank has built its engine).
REPLICA_CONNECT_S = 120.0
# Seconds a connection between rank 0 and a replica's first rank may take to open, and each side
# to authenticate the other and introduce itself: rank 0 listens before it sends the address, so
# only a wrong address, a firewall that drops packets or another program on the port takes longer.
REPLICA_HANDSHAKE_S = 30.0
# TCP keepalive on the replicas' connections (seconds idle, seconds between probes, probes), and
# on Linux a bound on data left unacknowledged (TCP_USER_TIMEOUT, which also covers a connection
# with a message in flight, where keepalive does not probe): a machine that vanishes without
# closing its connection is noticed within about half a minute.
KEEPALIVE = (10, 5, 3)
UNACKNOWLEDGED_S = 30


@dataclasses.dataclass(frozen=True)
class ReplicaChannel:
    """Where the replicas' first ranks connect to rank 0, as rank 0 sends it over torch.distributed:
    ``family`` ``"AF_UNIX"`` (``address``: a socket's path; every first rank on rank 0's machine)
    or ``"AF_INET"`` / ``"AF_INET6"`` (``address``: rank 0's ``(ip, port)``, the port chosen by the
    OS); ``authkey``: the random key of :mod:`multiprocessing.connection`'s HMAC challenge, which
    each side makes the other answer before any message."""

    family: str
    address: Union[str, tuple[str, int]]
    authkey: bytes = dataclasses.field(repr=False)

    def where(self) -> str:
        if isinstance(self.address, str):
            return self.address
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def this_machine() -> str:
    """What tells machines apart: the host name and, where Linux gives it, this boot's id (two
    containers of one name on two hosts differ by it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def open_replica_channel(address: Optional[str], *, remote: bool) -> tuple[Listener, ReplicaChannel, str]:
    """Rank 0's listening socket for the replicas' first ranks, what they need to connect, and the
    private folder to remove after (``""``: none).  A Unix socket in a new folder of mode 0700
    where every first rank runs on this machine and ``address`` (``--data_parallel_address``) is
    not given; else TCP on ``address``, or on ``MASTER_ADDR`` (torchrun's rank-0 address), at a
    port the OS chooses.  RuntimeError, saying what to pass, where that cannot work."""
    authkey = os.urandom(32)
    if address is None and not remote:
        folder = tempfile.mkdtemp(prefix="llama-serve-")  # mode 0700: only this user may connect
        listener = Listener(os.path.join(folder, "replicas.sock"), family="AF_UNIX")
        return listener, ReplicaChannel("AF_UNIX", listener.address, authkey), folder
    given = "--data_parallel_address" if address else "MASTER_ADDR"
    host = address or os.environ.get("MASTER_ADDR", "")
    fix = "pass --data_parallel_address with an address of rank 0's machine that the other machines reach"
    if not host:
        raise RuntimeError(f"the replicas' first ranks run on other machines than rank 0 and MASTER_ADDR is not set: "
                           f"{fix}")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise RuntimeError(f"{given} {host!r} is not an address this machine knows ({e}): {fix}") from None
    ip = str(sockaddr[0])
    if remote and ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        raise RuntimeError(f"{given} {host} is a loopback address ({ip}), which the replicas' first ranks on other "
                           f"machines cannot reach: {fix}")
    try:
        listener = Listener((ip, 0), family="AF_INET6" if family == socket.AF_INET6 else "AF_INET")
    except OSError as e:
        raise RuntimeError(f"rank 0 cannot listen on {given} {host} ({ip}) for the replicas: {e.strerror or e}; "
                           "give an address of rank 0's machine") from None
    channel = ReplicaChannel("AF_INET6" if family == socket.AF_INET6 else "AF_INET", (ip, int(listener.address[1])),
                             authkey)
    return listener, channel, ""


def _socket_options(conn: Connection, io_timeout_s: float) -> None:
    """Bound ``conn``'s reads and writes to ``io_timeout_s`` seconds (0: no bound; a read past it
    raises ``BlockingIOError``); on TCP, send each frame at once (no Nagle delay: one small
    message a step), probe an idle peer (:data:`KEEPALIVE`) and give up on one that acknowledges
    nothing for :data:`UNACKNOWLEDGED_S`."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        timeval = struct.pack("ll", int(io_timeout_s), int(io_timeout_s % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
                if hasattr(socket, name):  # (Linux; macOS has the last two)
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            if hasattr(socket, "TCP_USER_TIMEOUT"):  # (Linux)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKNOWLEDGED_S * 1000)
    finally:
        sock.detach()  # (the connection keeps its file descriptor)


def _authenticate(conn: Connection, authkey: bytes, *, rank0: bool) -> None:
    """multiprocessing.connection's challenge each way (as ``Listener`` / ``Client`` with an
    ``authkey`` do), each read and write bounded by :data:`REPLICA_HANDSHAKE_S`, which stays in
    force until :func:`_socket_options` lifts it."""
    _socket_options(conn, REPLICA_HANDSHAKE_S)
    if rank0:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    else:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)


def _reason(e: BaseException) -> str:
    if isinstance(e, (BlockingIOError, socket.timeout)):
        return f"no answer within {REPLICA_HANDSHAKE_S:g} s"
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def connect_to_rank0(channel: ReplicaChannel, index: int) -> Connection:
    """A replica's first rank: its connection to rank 0 (then to the API process), authenticated,
    and introduced as ``("replica", index)``.  RuntimeError, with what to check, when it cannot be
    made within :data:`REPLICA_HANDSHAKE_S`."""
    where = channel.where()
    try:
        if isinstance(channel.address, str):  # (AF_UNIX)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(REPLICA_HANDSHAKE_S)
            try:
                sock.connect(channel.address)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(channel.address, timeout=REPLICA_HANDSHAKE_S)
    except OSError as e:
        hint = ("it must run on rank 0's machine, or rank 0 must listen on TCP: pass --data_parallel_address"
                if channel.family == "AF_UNIX" else
                "check that this machine reaches that address and port (a firewall must let it through: "
                "docs/serving.md) and see rank 0's log")
        raise RuntimeError(f"replica {index}'s first rank cannot connect to rank 0 at {where} ({_reason(e)}): "
                           f"{hint}") from None
    sock.settimeout(None)  # (blocking: a Connection reads its file descriptor as such)
    conn = Connection(sock.detach())
    try:
        _authenticate(conn, channel.authkey, rank0=False)
        _socket_options(conn, 0)
        conn.send_bytes(encode(("replica", index)))
    except (OSError, EOFError, AuthenticationError) as e:
        conn.close()
        raise RuntimeError(f"replica {index}'s first rank reached rank 0 at {where} but the two could not "
                           f"authenticate each other ({_reason(e)}): is another program on that port? See rank "
                           "0's log") from None
    return conn


def join_replicas(replicas: int, address: Optional[str] = None) -> tuple[list[Connection], Optional[Connection]]:
    """Connect the replicas' first ranks to rank 0 (``--data_parallel`` under torchrun; see the
    module's docstring), over TCP on ``address`` (``--data_parallel_address``) when given, or on
    MASTER_ADDR when a first rank runs on another machine than rank 0, else over a Unix socket
    (:func:`open_replica_channel`).  Collective: every rank of the job calls it, after building
    its engine.  Returns, on rank 0, the other replicas' connections in replica order (and None);
    on another replica's first rank, ``[]`` and its connection; on any other rank, ``[]`` and
    None.  RuntimeError on every rank when rank 0 cannot listen; on rank 0 when a replica does
    not connect within :data:`REPLICA_CONNECT_S`; on a first rank that cannot connect."""
    from llama.runtime import distributed

    index = distributed.replica_index()
    first = distributed.model_parallel_rank() == 0
    machines = distributed.gather_over_job(this_machine() if first else None)
    listener: Optional[Listener] = None
    folder = ""
    shared: Union[ReplicaChannel, RuntimeError, None] = None
    if index == 0 and first:
        remote = any(m is not None and m != machines[0] for m in machines)
        try:
            listener, shared, folder = open_replica_channel(address, remote=remote)
        except RuntimeError as e:  # (told to every rank, so that all stop with it)
            shared = e
        else:
            if shared.family != "AF_UNIX":
                logger.info("the replicas' first ranks connect to %s over TCP (authenticated with a random key, "
                            "not encrypted)", shared.where())
    shared = distributed.share_over_job(shared)
    if isinstance(shared, RuntimeError):
        raise RuntimeError(str(shared)) from None
    assert isinstance(shared, ReplicaChannel)
    if listener is None:
        return ([], connect_to_rank0(shared, index)) if first else ([], None)
    try:
        return _accept_replicas(listener, replicas - 1, shared.authkey), None
    finally:
        listener.close()
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def _accept_replicas(listener: Listener, n: int, authkey: bytes) -> list[Connection]:
    """``n`` connections from ``listener`` (made without an ``authkey``: each is authenticated
    here with ``authkey``, within :data:`REPLICA_HANDSHAKE_S`), each having said
    ``("replica", k)``, ordered by k; RuntimeError past :data:`REPLICA_CONNECT_S`, or when a
    connection fails to authenticate or introduce itself."""
    found: dict[int, Connection] = {}
    failure: list[BaseException] = []

    def accept() -> None:
        try:
            while len(found) < n:
                conn = listener.accept()
                try:
                    _authenticate(conn, authkey, rank0=True)
                    kind, index = decode(conn.recv_bytes(256))
                    if kind != "replica" or index not in range(1, n + 1) or index in found:
                        raise RuntimeError(f"a replica introduced itself as {(kind, index)!r}")
                    _socket_options(conn, 0)
                except BaseException as e:
                    conn.close()
                    peer = listener.last_accepted
                    raise RuntimeError(f"{_reason(e)} (a connection from {peer or 'this machine'})") from None
                found[index] = conn
        except BaseException as e:  # (authentication failed, a bad message, the listener closed)
            failure.append(e)

    thread = threading.Thread(target=accept, name="replicas-accept", daemon=True)
    thread.start()
    thread.join(REPLICA_CONNECT_S)
    if failure or len(found) < n:
        why = f": {failure[0]}" if failure else f" within {REPLICA_CONNECT_S:g} s"
        raise RuntimeError(f"{len(found)} of the {n} other replicas' first ranks connected to rank 0{why}; "
                           "see their logs")
    return [found[k] for k in sorted(found)]


def engine_config(loaded: "LoadedModel", tokenizer_path: str, api_options: dict) -> dict:
    """The ``hello`` message's config: what the API process needs of this model and server."""
    from llama.engine.core import mllama_image_token

    engine = loaded.engine
    lora = getattr(engine, "lora", None)
    return {
        "tokenizer_path": str(tokenizer_path),
        "vision": getattr(loaded.formatter, "image_layout", None),
        "engine": {"max_batch_size": engine.max_batch_size, "max_seq_len": engine.max_seq_len,
                   "n_decodable": engine.n_decodable, "n_words": loaded.tokenizer.n_words,
                   "block_size": engine.kv.block_size,
                   "image_token": mllama_image_token(loaded.model),
                   "lora": dict(lora.paths) if lora is not None else {}, "stats": engine.stats()},
        "api": api_options,
    }


def serve_with_api_process(loaded: "LoadedModel", sock: socket.socket, tokenizer_path: str, api_options: dict, *,
                           grace_s: float, replicas: Sequence[subprocess.Popen] = (),
                           replica_ends: Sequence[_HasFileno] = (), routing: str = "prefix") -> int:
    """The first rank of ``--engine_process``: start the API process on ``sock``, then run the
    engine's loop with an :class:`EngineBridge` until the API process says ``stop`` or goes
    away.  SIGTERM and SIGINT are passed to the API process (which drains, then says ``stop``).
    Returns the exit status: 0 after a clean stop, 1 after a failure of either process."""
    from llama.serve import logs
    from llama.serve.shutdown import EXIT_DEADLINE_S, _exit_now

    proc, conn = start_api_process(sock, replica_ends)
    stop = threading.Event()
    bridge = EngineBridge(loaded, conn, stop)
    repeats = logs.install()
    bridge.hello({**engine_config(loaded, tokenizer_path, api_options), "routing": routing})
    bridge.start()
    signalled = threading.Event()

    def on_signal(signum: int, frame: Any = None) -> None:
        if not signalled.is_set():
            signalled.set()  # then the API process has its grace period and EXIT_DEADLINE_S to say stop
            deadline = threading.Timer(grace_s + 2 * EXIT_DEADLINE_S, _exit_now, args=(1, "shutdown took too long"))
            deadline.daemon = True
            deadline.start()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    terminal = None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from llama.cli.terminal import watch_ctrl_c

        terminal = watch_ctrl_c(lambda: on_signal(signal.SIGINT))
    code = 0
    try:
        loaded.engine.run_forever(stop)
    except BaseException as e:  # a failed step: a rank died, a collective timed out
        logger.error("the engine stopped on an error, exiting: %s", e)
        code = 1
    bridge.close()
    if bridge.api_gone:
        code = 1
    try:
        api_code = proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        logger.error("the API process did not exit: ending it")
        proc.kill()
        api_code = proc.wait()
    for replica in replicas:  # (they stop when the API process says so, or goes)
        try:
            replica.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            replica.kill()
            replica.wait()
    logs.uninstall(repeats)
    if terminal is not None:
        terminal.close()
    return code or (1 if api_code else 0)


def _meets_the_protocols(client: EngineClient, model: ApiModel,
                         request: _RemoteRequest) -> tuple["ServedEngine", "ServedModel", "ServedRequest"]:
    """(Read by the type checker: the API process's engine, model and requests are what the
    server's endpoints are written against.)"""
    return client, model, request
