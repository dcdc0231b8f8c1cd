"""Grammar compiles bounded in time: each grammar is first compiled in a worker process,
which is killed when it takes longer than the budget, and only a grammar that compiled
there in time is compiled again where it is used.

Why a process: llguidance's own limits (``LLParserLimits``: lexer fuel, Earley items,
lexer states, grammar size) count units of work whose cost varies by orders of
magnitude, and none of them stops the worst grammars.  Measured with Llama 3's
vocabulary and llguidance 1.9 (the work is in the first mask, where the lexer walks the
vocabulary): ``x{100000}`` compiles in 8.9 s and ``a{300}{300}`` in 4 s within the default
limits; ``a{1000}{1000}`` was still compiling after 30 s, with the default step fuel or a
tenth of it.  Lowered to 10,000, ``initial_lexer_fuel`` stops those, but leaves them a
matcher that fails at its second mask, and refuses a 40,000-value enum that compiles in
0.3 s.  A compile cannot be interrupted from Python, and a thread cannot be killed: a
thread left compiling after its request was refused would burn a core for as long as the
grammar takes.  A process can be killed, and a grammar that crashes llguidance (a stack
overflow, an abort) ends the worker, not the server.

The cost: a grammar is compiled twice (a typical schema compiles in milliseconds), and
each worker holds the vocabulary (built once, in about a second for 128k ids).

* :class:`GrammarCompiler`: set as a :class:`~llama.structured.GrammarTokenizer`'s
  ``compiler``, it bounds every compile for that tokenizer
  (:func:`~llama.structured.response_format.compile_grammar` calls :meth:`~GrammarCompiler.check`):
  a compile past ``timeout_s`` is a ``ValueError`` naming the field, its worker killed
  (and a new one started); when every worker stays busy for ``timeout_s``,
  :class:`GrammarCompilerBusy`.
* :func:`abandon_when`: a compile whose caller left (a server's client that
  disconnected) stops at its next check, its worker killed, with :class:`CompileAbandoned`.

Workers are shared by every compiler of the same vocabulary in a process (at most
``processes`` of them), and end with it.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import hashlib
import logging
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator, Optional, cast  # the worker's pipes: Popen(PIPE) makes both

from llama.structured import compile_worker

if TYPE_CHECKING:
    from llama.structured.vocabulary import GrammarTokenizer

logger = logging.getLogger(__name__)

__all__ = ["COMPILE_TIMEOUT_S", "CompileAbandoned", "CompileRefused", "GrammarCompiler", "GrammarCompilerBusy",
           "abandon_when"]

# How long one grammar may take to compile (its worker's trial): generous for real schemas
# (a 40,000-value enum: 2 s), far below the grammars that never finish.
COMPILE_TIMEOUT_S = 5.0
# Worker processes per vocabulary: grammars compiled at once.
COMPILE_PROCESSES = 2
# Starting a worker: Python, llguidance, and the vocabulary (about a second for 128k ids).
WORKER_START_TIMEOUT_S = 120.0
# How often a waiting compile looks at its abandon event.
POLL_S = 0.05

WORKER_SCRIPT = Path(compile_worker.__file__)


class CompileRefused(ValueError):
    """A grammar refused for what compiling it costs (longer than the budget, or it crashed the
    compiler), not for what it says."""


class GrammarCompilerBusy(RuntimeError):
    """Every compiler worker stayed busy for the whole budget: retry later (the grammar itself
    may be fine)."""


class CompileAbandoned(RuntimeError):
    """The compile's caller left (:func:`abandon_when`): it was stopped, with no result."""


_ABANDON: contextvars.ContextVar[Optional[threading.Event]] = contextvars.ContextVar("grammar_abandon", default=None)


@contextlib.contextmanager
def abandon_when(event: threading.Event) -> Iterator[None]:
    """Within this block (on this thread), every bounded compile stops once ``event`` is set:
    its worker is killed and :class:`CompileAbandoned` raised, at the latest
    :data:`POLL_S` later (or after the in-process compile under way, which the worker's
    trial bounded)."""
    token = _ABANDON.set(event)
    try:
        yield
    finally:
        _ABANDON.reset(token)


def _abandoned(event: Optional[threading.Event]) -> None:
    if event is not None and event.is_set():
        raise CompileAbandoned("the grammar's compile was abandoned: its caller left")


class _TimedOut(Exception):
    pass


class _Crashed(Exception):
    pass


class _Worker:
    """One worker process, between trials idle and waiting on its standard input."""

    def __init__(self, spec: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)  # no terminal's Ctrl-C
        try:
            compile_worker.write_frame(cast(IO[bytes], self.proc.stdin), spec)
            if not self._wait_readable(time.monotonic() + WORKER_START_TIMEOUT_S, None):
                raise RuntimeError(f"the grammar compiler worker did not start in {WORKER_START_TIMEOUT_S:g} s")
            if compile_worker.read_frame(cast(IO[bytes], self.proc.stdout)) != "ready":
                raise RuntimeError(f"the grammar compiler worker failed to start (exit status {self.proc.poll()}); "
                                   "see its error above")
        except BaseException:
            self.kill()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _wait_readable(self, deadline: float, abandon: Optional[threading.Event]) -> bool:
        """Wait until the worker has answered (or died: its pipe then reads the end); False at
        ``deadline``; :class:`CompileAbandoned` once ``abandon`` is set."""
        fd = cast(IO[bytes], self.proc.stdout).fileno()
        while True:
            _abandoned(abandon)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if select.select([fd], [], [], min(left, POLL_S))[0]:
                return True

    def trial(self, source: str, limits: dict, timeout_s: float, abandon: Optional[threading.Event]) -> float:
        """Compile ``source`` here; its seconds.  ``_TimedOut`` past ``timeout_s``, ``_Crashed``
        if the worker died, :class:`CompileAbandoned`; after any of them the worker is killed."""
        try:
            try:
                compile_worker.write_frame(cast(IO[bytes], self.proc.stdin), (source, limits))
            except (BrokenPipeError, OSError):
                raise _Crashed() from None
            if not self._wait_readable(time.monotonic() + timeout_s, abandon):
                raise _TimedOut()
            seconds = compile_worker.read_frame(cast(IO[bytes], self.proc.stdout))
            if seconds is None:
                raise _Crashed()
            return seconds
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (cast(IO[bytes], self.proc.stdin), cast(IO[bytes], self.proc.stdout)):
            with contextlib.suppress(OSError):
                stream.close()

    def exit_status(self) -> str:
        code = self.proc.poll()
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"signal {signal.Signals(-code).name}"
        return f"exit status {code}"


class _Pool:
    """``size`` workers of one vocabulary, started in the background when the pool is made; a
    worker killed or dead is replaced in the background, so that no compile waits for a
    start unless every worker is starting."""

    def __init__(self, spec: dict, size: int) -> None:
        self.spec = spec
        self.size = size
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy = 0  # workers running a trial
        self._starting = 0
        self._start_error: Optional[BaseException] = None
        self._closed = False
        with self._cond:
            for _ in range(size):
                self._start_in_background()

    def take(self, wait_s: float, abandon: Optional[threading.Event]) -> _Worker:
        """An idle worker: waiting for one at most ``wait_s`` while they are all busy
        (:class:`GrammarCompilerBusy` then), as long as it takes while one is starting."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                _abandoned(abandon)
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        self._busy += 1
                        return worker
                    worker.kill()
                    self._start_in_background()
                now = time.monotonic()
                if self._starting == 0 and self._busy < self.size:  # a start failed
                    if self._busy == 0 and self._start_error is not None:
                        error, self._start_error = self._start_error, None  # the next call tries again
                        raise RuntimeError(f"the grammar compiler's worker processes fail to start: {error}")
                    self._start_in_background()
                if self._starting:
                    deadline = max(deadline, now + POLL_S)
                elif now >= deadline:
                    raise GrammarCompilerBusy(
                        f"all {self.size} grammar compilers stayed busy for {wait_s:g} s: retry shortly")
                self._cond.wait(min(deadline - now, POLL_S))

    def give(self, worker: _Worker) -> None:
        """``worker`` finished its trial: idle again, or (killed, dead) replaced."""
        with self._cond:
            self._busy -= 1
            if worker.alive() and not self._closed:
                self._idle.append(worker)
            else:
                worker.kill()
                self._start_in_background()
            self._cond.notify_all()

    def _start_in_background(self) -> None:
        """(Under the lock.)"""
        if self._closed:
            return
        self._starting += 1
        threading.Thread(target=self._start_one, name="grammar-compiler-start", daemon=True).start()

    def _start_one(self) -> None:
        worker = None
        try:
            worker = _Worker(self.spec)
        except Exception as e:
            logger.exception("starting a grammar compiler worker failed")
            self._start_error = e
        with self._cond:
            self._starting -= 1
            if worker is not None:
                if self._closed:
                    worker.kill()
                else:
                    self._idle.append(worker)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_POOLS: dict[tuple[str, int], _Pool] = {}
_POOLS_LOCK = threading.Lock()


def _pool_for(spec: dict, size: int) -> _Pool:
    digest = hashlib.sha256(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)).hexdigest()
    with _POOLS_LOCK:
        pool = _POOLS.get((digest, size))
        if pool is None:
            pool = _POOLS[(digest, size)] = _Pool(spec, size)
        return pool


@atexit.register
def _close_pools() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        pool.close()


class GrammarCompiler:
    """Bounds the compiles of grammars for one tokenizer: ``timeout_s`` each, at most
    ``processes`` at once (set it as ``GrammarTokenizer.compiler``; see the module).

    A compile that waits for a worker waits at most ``timeout_s`` too
    (:class:`GrammarCompilerBusy`), and stops when its caller leaves (:func:`abandon_when`).
    """

    def __init__(self, tokenizer: GrammarTokenizer, *, timeout_s: float = COMPILE_TIMEOUT_S,
                 processes: int = COMPILE_PROCESSES) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes!r}")
        self.timeout_s = float(timeout_s)
        self.processes = processes
        self._pool = _pool_for(tokenizer.worker_spec(), processes)

    def check(self, source: str, param: str, limits: dict) -> float:
        """Compile ``source`` (llguidance's JSON form, with ``LLParserLimits(**limits)``) in a
        worker within the budget; its seconds there.  :class:`CompileRefused` (a ``ValueError``
        starting with ``param``) past the budget or where the compile crashed the worker."""
        abandon = _ABANDON.get()
        worker = self._pool.take(self.timeout_s, abandon)
        start = time.perf_counter()
        try:
            seconds = worker.trial(source, limits, self.timeout_s, abandon)
        except _TimedOut:
            logger.warning("%s: refused a grammar that took longer than %g s to compile", param, self.timeout_s)
            raise CompileRefused(
                f"{param}: the grammar takes longer than {self.timeout_s:g} s to compile, this server's limit: "
                "simplify it (large or nested repetition counts such as a{1000}{1000} or x{100000}, or a very "
                "large schema, are what takes long)") from None
        except _Crashed:
            status = worker.exit_status()
            logger.warning("%s: a grammar crashed its compiler worker (%s)", param, status)
            raise CompileRefused(f"{param}: the grammar crashed the grammar compiler ({status}): simplify it "
                             "(a very deep or long chain of rules or references is the usual cause)") from None
        finally:
            self._pool.give(worker)  # idle again, or (killed) replaced
        _abandoned(abandon)
        logger.debug("%s: trial compile in %.1f ms (%.1f ms with the round trip)", param, 1e3 * seconds,
                     1e3 * (time.perf_counter() - start))
        return seconds


def worker_pids() -> list[int]:
    """The process ids of the idle workers (for tests)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    return [w.proc.pid for pool in pools for w in list(pool._idle)]

