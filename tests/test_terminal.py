"""Reading the user's lines at a terminal, where Ctrl-C is a key (llama/terminal.py), on a
real pseudo-terminal: the line discipline does the work, so it is what the test uses."""

from __future__ import annotations

import io
import os
import pty
import signal
import termios

import pytest

from llama.cli.terminal import INTERRUPTED, StreamInput, TerminalInput, open_input


@pytest.fixture
def terminal():
    master, slave = pty.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def test_lines_ctrl_c_and_ctrl_d_at_a_terminal(terminal, capsys):
    master, slave = terminal
    before = termios.tcgetattr(slave)
    assert before[3] & termios.ISIG  # a fresh terminal turns Ctrl-C into SIGINT
    with TerminalInput(slave) as user:
        assert not termios.tcgetattr(slave)[3] & termios.ISIG
        os.write(master, b"caf\xc3\xa9 \xff\n")
        assert user.read_line("You: ") == "café \ufffd"  # undecodable bytes replaced, never an error
        os.write(master, b"half a line\x03")  # Ctrl-C mid-line ends the line: what was typed is dropped
        assert user.read_line("You: ") is INTERRUPTED
        os.write(master, b"\x04")  # Ctrl-D at the start of a line: end of input
        assert user.read_line("You: ") is None
        assert user.read_line("You: ") is None  # and it stays ended
    assert termios.tcgetattr(slave) == before  # settings restored on the way out
    assert capsys.readouterr().out == "You: " * 4


def test_ctrl_c_during_a_reply_keeps_lines_typed_after_it(terminal):
    master, slave = terminal
    with TerminalInput(slave) as user:
        assert not user.interrupt_typed()  # nothing typed: answers at once, does not wait
        os.write(master, b"typed ahead\n")
        assert not user.interrupt_typed()
        assert user.read_line("") == "typed ahead"  # kept for the next prompt
        os.write(master, b"dropped\n")
        os.write(master, b"\x03")
        os.write(master, b"kept\n")
        assert user.interrupt_typed()
        assert not user.interrupt_typed()  # each Ctrl-C counts once
        assert user.read_line("") == "kept"


def test_sigterm_restores_the_terminal(terminal):
    """The process dies of SIGTERM as before, but the terminal gets its settings back."""
    master, slave = terminal
    before = termios.tcgetattr(slave)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            TerminalInput(slave)
            os.kill(os.getpid(), signal.SIGTERM)
            import time
            time.sleep(30)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert termios.tcgetattr(slave) == before


def test_open_input_reads_pipes_as_lines():
    user = open_input(io.BytesIO(b"one\n\xff two\n"))
    assert isinstance(user, StreamInput) and not isinstance(user, TerminalInput)
    assert user.read_line("") == "one" and user.read_line("") == "\ufffd two" and user.read_line("") is None
    assert not user.interrupt_typed()


def test_open_input_takes_a_terminal(terminal):
    master, slave = terminal
    with os.fdopen(os.dup(slave), "rb", buffering=0) as stream:
        user = open_input(stream)
        try:
            assert isinstance(user, TerminalInput)
        finally:
            user.close()
