"""Log lines go to standard error and never land inside a streamed answer: an example holds
a record logged while an answer's line is open until that line ends; interactive chat logs
warnings only unless --verbose; and no deprecation warning of torch's comes from our calls."""

from __future__ import annotations

import contextlib
import logging

import pytest


class Captured:
    """What the test wrote so far on each stream (pytest's capsys, read cumulatively)."""

    def __init__(self, capsys) -> None:
        self.capsys, self.out, self.err = capsys, "", ""

    def read(self) -> tuple[str, str]:
        out, err = self.capsys.readouterr()
        self.out += out
        self.err += err
        return self.out, self.err


@pytest.fixture
def streams(capsys, monkeypatch):
    """What the test writes, and a root logger as a command's process starts with (no
    handlers; pytest's own are put back after)."""
    monkeypatch.delenv("RANK", raising=False)
    root = logging.getLogger()
    level = root.level
    yield Captured(capsys)
    for handler in [h for h in root.handlers if type(h).__name__ == "_LineAwareHandler"]:
        root.removeHandler(handler)
    root.setLevel(level)


@contextlib.contextmanager
def bare_root_logger():
    """The root logger without pytest's handlers (a command's process starts with none)."""
    root = logging.getLogger()
    handlers = root.handlers[:]
    root.handlers.clear()
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.handlers[:] = handlers


def test_a_log_line_waits_for_the_streamed_line_to_end(streams):
    from llama.cli.examples import say, setup_logging

    with bare_root_logger():
        held_until_the_line_ends(streams, setup_logging, say)


def held_until_the_line_ends(streams, setup_logging, say):
    setup_logging()
    log = logging.getLogger("llama.engine.cpu_threads")
    say("Assistant: ", end="")
    say("I will", end="")
    log.info("CPU threads: 1 instead of 2")
    assert streams.read()[1] == ""  # held: the answer's line is open
    say(" answer.", end="")
    say("")
    out, err = streams.read()
    assert out == "Assistant: I will answer.\n"  # nothing inside it
    assert err == "INFO llama.engine.cpu_threads: CPU threads: 1 instead of 2\n"
    log.info("between answers")
    assert streams.read()[1].endswith("INFO llama.engine.cpu_threads: between answers\n")  # at once


def test_quiet_logging_keeps_warnings(streams):
    from llama.cli.examples import setup_logging

    with bare_root_logger():
        setup_logging(verbose=False)
        logging.getLogger("quiet.x").info("hidden")  # (conftest sets "llama" itself to INFO)
        logging.getLogger("quiet.x").warning("shown")
        assert streams.read()[1] == "WARNING quiet.x: shown\n"


@pytest.mark.parametrize("argv, level", [(["--interactive"], logging.WARNING),
                                         (["--interactive", "--verbose"], logging.INFO),
                                         ([], logging.INFO)])
def test_interactive_chat_logs_warnings_unless_verbose(argv, level, streams, monkeypatch):
    from llama import Llama
    from test_cli_flags import load_script

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(Llama, "build", staticmethod(stop))
    module = load_script("example_chat_completion.py")
    with pytest.raises(Stop):
        module.main(module.parse_args(argv))
    assert logging.getLogger().level == level


# The torchrun chat's standard error (no INFO line, no FutureWarning; INFO lines with --verbose):
# test_examples.py::test_interactive_chat_under_torchrun_logs_nothing_by_default, which reads the
# torchrun chat that file's other tests read (one job instead of two).
