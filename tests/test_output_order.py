"""Log lines go to standard error and never land inside a streamed answer: an example holds
a record logged while an answer's line is open until that line ends; interactive chat logs
warnings only unless --verbose; and no deprecation warning of torch's comes from our calls."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

import pytest

import example_runs
import helpers
from helpers import REPO


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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_interactive_chat_under_torchrun_logs_nothing_by_default(tmp_path_factory, llama3_checkpoint):
    """Two processes, a two-shard model: standard error holds no INFO line and no torch
    FutureWarning (our gather once called the deprecated all_gather_tensor, which warned on
    every rank); the answers stream on standard output.  The chat (example_runs.CHAT_INPUT:
    six messages, /reset twice, the oldest exchanges dropped to fit max_seq_len) is the one
    test_examples.py's interactive torchrun tests read, run once per test process."""
    proc = example_runs.interactive_chat_under_torchrun(llama3_checkpoint, tmp_path_factory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [part.count("Assistant: ") for part in example_runs.conversations(proc.stdout)] == [1, 1, 4], proc.stdout
    assert "INFO" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("ckpt"), params, weights, n_shards=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    script = ["example_chat_completion.py", "--interactive", "--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok),
              "--device", "cpu", "--temperature", "0", "--max_seq_len", "128"]
    verbose = subprocess.run([sys.executable, *script, "--verbose"], cwd=REPO, env=env, input="hello there\n",
                             capture_output=True, text=True, timeout=240)
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "INFO llama.checkpoint.loader: loaded" in verbose.stderr
