"""Long waits made visible: what is being done, how far along it is, and for how long.

Loading a checkpoint and compiling the decoding step can take minutes on a CPU.  A
:class:`Progress` says so while it happens:

* on a terminal (the first rank's standard error is a TTY), one line rewritten in place,
  ``loading weights: 120/291 [=====>    ] 41% 12 s, ~17 s left``, refreshed every second
  even while one step takes long, and erased when the wait is over (the caller's log line
  then says what was done);
* elsewhere (a file, a pipe, a service's journal, another rank), log lines through the
  caller's logger: one when the wait has lasted :data:`LOG_EVERY_S`, then one at most every
  :data:`LOG_EVERY_S` (``announce=True``: one at the start too, for a wait known to be long).

``LLAMA_PROGRESS=0`` turns the terminal line off (log lines instead); ``1`` draws it on a
stream that is not a terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, Optional, TextIO, TypeVar

__all__ = ["Progress", "counted", "draws_on", "LOG_EVERY_S"]

T = TypeVar("T")

LOG_EVERY_S = 2.0  # a wait longer than this says what it is doing
REDRAW_EVERY_S = 0.1  # the terminal line is rewritten at most this often on steps ...
TICK_S = 1.0  # ... and at least this often while a step takes long (its elapsed time runs)
BAR_WIDTH = 20


def _first_rank() -> bool:
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def draws_on(stream: TextIO, environ=os.environ) -> bool:
    """Whether a progress line is drawn on ``stream``: the first rank's terminal, unless
    ``LLAMA_PROGRESS=0`` (``1`` draws on any stream)."""
    forced = environ.get("LLAMA_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1" and _first_rank()
    try:
        return _first_rank() and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class Progress:
    """``total`` steps of ``what`` (``unit``: what a step is, for the line), reported as the
    module says (``announce``: a line that opens the wait, e.g. its expected length).  Use as a
    context manager; :meth:`advance` after each step (``detail``: a word on the step done).
    ``stream`` (default ``sys.stderr``), ``clock`` and ``ticker`` (a background thread
    refreshing the terminal line) are for tests."""

    def __init__(self, what: str, total: int, *, logger: logging.Logger, unit: str = "",
                 announce: Optional[str] = None, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic, ticker: bool = True) -> None:
        self.what, self.total, self.unit, self.logger = what, max(int(total), 0), unit, logger
        self.announce = announce
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.done = 0
        self.detail = ""
        self.draw = draws_on(self.stream)
        self._ticker = ticker and self.draw
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = self._last_draw = self._last_log = 0.0
        self._drawn = False

    # -- the caller's side ------------------------------------------------------------------

    def __enter__(self) -> "Progress":
        self._start = self._last_log = self.clock()
        self._last_draw = float("-inf")
        if self.announce and self.draw:
            self._write_line(self.announce)
        elif self.announce:
            self.logger.info("%s", self.announce)
        if self.draw:
            self._redraw(force=True)
            if self._ticker:
                self._thread = threading.Thread(target=self._tick, name="llama-progress", daemon=True)
                self._thread.start()
        return self

    def advance(self, steps: int = 1, detail: str = "") -> None:
        with self._lock:
            self.done = min(self.done + steps, self.total) if self.total else self.done + steps
            self.detail = detail
            now = self.clock()
            if self.draw:
                self._redraw(now=now)
            elif now - self._last_log >= LOG_EVERY_S:
                self._last_log = now
                self.logger.info("%s", self.status(now))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.draw and self._drawn:
                self.stream.write("\r\x1b[K")  # erased: the caller's log line says what was done
                self.stream.flush()

    @property
    def elapsed(self) -> float:
        return self.clock() - self._start

    def status(self, now: Optional[float] = None) -> str:
        """``what: done/total unit, elapsed, ~left [detail]`` (the log line; the terminal's has a bar)."""
        return self._text(now, bar=False)

    # -- drawing ----------------------------------------------------------------------------

    def _text(self, now: Optional[float], bar: bool) -> str:
        elapsed = (self.clock() if now is None else now) - self._start
        head = f"{self.what}: {self.done}/{self.total}" + (f" {self.unit}" if self.unit else "")
        if bar and self.total:
            filled = BAR_WIDTH * self.done // self.total
            head += f" [{('=' * filled + '>')[:BAR_WIDTH]:<{BAR_WIDTH}}] {100 * self.done // self.total}%"
        timing = _seconds(elapsed)
        if 0 < self.done < self.total:
            timing += f", ~{_seconds(elapsed / self.done * (self.total - self.done))} left"
        return f"{head}, {timing}" + (f", {self.detail}" if self.detail else "")

    def _redraw(self, now: Optional[float] = None, force: bool = False) -> None:
        now = self.clock() if now is None else now
        if not force and now - self._last_draw < REDRAW_EVERY_S and self.done < self.total:
            return
        self._last_draw = now
        self._drawn = True
        self.stream.write("\r\x1b[K" + self._text(now, bar=True))  # one write: nothing cuts into it
        self.stream.flush()

    def _write_line(self, line: str) -> None:
        self.stream.write("\r\x1b[K" + line + "\n")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                if not self._stop.is_set():
                    self._redraw(force=True)


def counted(items: Iterable[T], progress: Progress) -> Iterator[T]:
    """``items`` as they come, each counted as a step of ``progress`` once the caller has it."""
    for item in items:
        yield item
        progress.advance()
