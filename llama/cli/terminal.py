"""The user's lines for interactive chat, with Ctrl-C as a key rather than a signal.

Under ``torchrun`` the workers run in sessions of their own: a Ctrl-C typed at the
terminal reaches only torchrun's agent, which reports the signal with a long traceback
and kills the workers.  So when standard input is a terminal, :class:`TerminalInput`
switches off the terminal's signal keys (``ISIG``) and makes Ctrl-C end a line
(``VEOL``) while the chat runs: the first rank then *reads* a Ctrl-C, either at the
prompt (the chat ends, every rank exits 0, one line) or between the pieces of a reply
(the reply stops).  The terminal's settings are restored on every way out, SIGTERM and
SIGHUP included.  Without a terminal (a pipe, a file) :class:`StreamInput` reads lines
as before and Ctrl-C stays a signal.

Both read bytes and decode them as UTF-8 with undecodable bytes replaced, so no input
and no locale can end the chat with a UnicodeDecodeError.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import deque
from typing import Any, BinaryIO, Callable, Optional, Union

CTRL_C = b"\x03"


class Interrupted:
    """What :meth:`read_line` returns for a Ctrl-C typed at the prompt."""

    def __repr__(self) -> str:
        return "INTERRUPTED"


INTERRUPTED = Interrupted()
Line = Union[str, None, Interrupted]  # a line, end of input, or Ctrl-C


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")


class StreamInput:
    """Lines from a byte stream that is not a terminal; Ctrl-C stays SIGINT."""

    def __init__(self, stream: Optional[BinaryIO] = None) -> None:
        self.stream = stream if stream is not None else sys.stdin.buffer

    def read_line(self, prompt: str) -> Line:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        raw = self.stream.readline()
        return _decode(raw) if raw else None

    def interrupt_typed(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def __enter__(self) -> "StreamInput":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TerminalInput(StreamInput):
    """Lines from the terminal on ``fd``, with Ctrl-C read as a key (see the module's doc).

    ``interrupt_typed()`` may be called while a reply is printed: it reads, without
    waiting, whatever lines are complete, keeps them for :meth:`read_line`, and says
    whether a Ctrl-C was among them (what was typed before that Ctrl-C is dropped).
    """

    def __init__(self, fd: int) -> None:
        import termios

        self.fd = fd
        self._termios = termios
        self._saved: Optional[list[Any]] = termios.tcgetattr(fd)
        self._pending: deque[Line] = deque()
        self._partial = b""
        self._at_end = False
        self._saved_handlers: dict[int, Any] = {}
        changed = termios.tcgetattr(fd)
        changed[3] &= ~termios.ISIG  # lflag: Ctrl-C, Ctrl-\ and Ctrl-Z become characters
        changed[6][termios.VEOL] = CTRL_C  # ... and Ctrl-C ends the line being typed
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._saved_handlers[sig] = signal.signal(sig, self._restore_and_die)
        termios.tcsetattr(fd, termios.TCSANOW, changed)

    def _restore_and_die(self, signum: int, frame: Any) -> None:
        self.close()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Give the terminal its settings back (idempotent)."""
        if self._saved is None:
            return
        try:
            self._termios.tcsetattr(self.fd, self._termios.TCSANOW, self._saved)
        except self._termios.error:
            pass  # the terminal is gone (hung up)
        self._saved = None
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers = {}

    def _read_some(self) -> None:
        """One read: in canonical mode it returns at most one line (ended by Enter or Ctrl-C)."""
        data = os.read(self.fd, 65536)
        if not data:  # Ctrl-D at the start of a line, or the terminal closed
            if self._partial:
                self._pending.append(_decode(self._partial))
                self._partial = b""
            self._pending.append(None)
            self._at_end = True
            return
        self._partial += data
        while True:
            cut = [i for i in (self._partial.find(b"\n"), self._partial.find(CTRL_C)) if i >= 0]
            if not cut:
                return
            i = min(cut)
            if self._partial[i:i + 1] == CTRL_C:
                self._pending.append(INTERRUPTED)
            else:
                self._pending.append(_decode(self._partial[:i]))
            self._partial = self._partial[i + 1:]

    def read_line(self, prompt: str) -> Line:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while not self._pending:
            if self._at_end:
                return None
            self._read_some()
        return self._pending.popleft()

    def interrupt_typed(self) -> bool:
        import select

        while not self._at_end and select.select([self.fd], [], [], 0)[0]:
            self._read_some()
        if INTERRUPTED not in self._pending:
            return False
        while self._pending.popleft() is not INTERRUPTED:  # drop what was typed up to the Ctrl-C
            pass
        return True


def open_input(stream: Optional[BinaryIO] = None) -> StreamInput:
    """A :class:`TerminalInput` when ``stream`` (default standard input) is a terminal
    whose settings can be changed, else a :class:`StreamInput`."""
    stream = stream if stream is not None else sys.stdin.buffer
    try:
        fd = stream.fileno()
        is_terminal = os.isatty(fd)
    except (AttributeError, OSError, ValueError):
        return StreamInput(stream)  # no file descriptor
    if not is_terminal:
        return StreamInput(stream)
    try:
        import termios
    except ImportError:  # Windows
        return StreamInput(stream)
    try:
        return TerminalInput(fd)
    except termios.error:  # a terminal whose settings we may not change
        return StreamInput(stream)


def watch_ctrl_c(on_ctrl_c: Callable[[], None], stream: Optional[BinaryIO] = None) -> Optional[StreamInput]:
    """Where ``stream`` (default standard input) is a terminal: switch its signal keys off
    (:class:`TerminalInput`) and call ``on_ctrl_c`` from a daemon thread each time Ctrl-C is
    typed, so that a process under torchrun ends itself cleanly instead of torchrun's agent
    taking the SIGINT (and printing its SignalException traceback).  End of input (Ctrl-D)
    stops the watch.  Returns the input to close when done (it gives the terminal its
    settings back), or None where there is no terminal to watch."""
    user_input = open_input(stream)
    if not isinstance(user_input, TerminalInput):
        return None

    def watch() -> None:
        while True:
            try:
                line = user_input.read_line("")
            except (OSError, ValueError):  # the terminal is gone, or closed under us
                return
            if line is None:
                return
            if line is INTERRUPTED:
                on_ctrl_c()

    threading.Thread(target=watch, name="ctrl-c", daemon=True).start()
    return user_input
