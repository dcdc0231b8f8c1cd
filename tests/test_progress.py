"""Long waits say what they do and how far along they are (llama.runtime.progress): a line
rewritten in place on a terminal, log lines elsewhere; loading a checkpoint and compiling
every shape of the decoding step report through it; and the examples compile only where
their run is long enough to gain from it."""

from __future__ import annotations

import io
import logging
import re

import pytest

from helpers import REPO, build
from llama.runtime.progress import LOG_EVERY_S, Progress

# The entry points' setup_logging sets the root logger's level: given back after each test.
pytestmark = pytest.mark.usefixtures("root_logger_kept")

logger = logging.getLogger("test_progress")


def load_script(script: str):
    """An example script as a module (importing it runs nothing but its definitions)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_gets_one_line_rewritten_then_erased(monkeypatch):
    monkeypatch.delenv("LLAMA_PROGRESS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    stream, clock = Terminal(), Clock()
    with Progress("compiling", 4, unit="shapes", logger=logger, stream=stream, clock=clock, ticker=False) as p:
        for _ in range(4):
            clock.now += 3.0
            p.advance()
    frames = stream.getvalue().split("\r\x1b[K")
    assert "\n" not in stream.getvalue()  # never a new line: each frame overwrites the last
    assert frames[-1] == ""  # the last write erases the line
    drawn = [f for f in frames if f]
    assert drawn[0].startswith("compiling: 0/4 shapes")
    assert [re.match(r"compiling: (\d)/4", f).group(1) for f in drawn] == ["0", "1", "2", "3", "4"]
    # After 1 of 4 steps in 3 s, 3 steps are left at the same pace: ~9 s.
    assert "25%, 3 s, ~9 s left" in drawn[1]
    assert "100%, 12 s" in drawn[-1]


def test_elsewhere_log_lines_once_the_wait_is_long(monkeypatch, caplog):
    monkeypatch.delenv("LLAMA_PROGRESS", raising=False)
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="test_progress"):
        with Progress("loading", 10, unit="tensors", logger=logger, stream=io.StringIO(), clock=clock) as p:
            for _ in range(10):
                clock.now += LOG_EVERY_S / 4
                p.advance()
    # 10 steps of a quarter of LOG_EVERY_S: a line after every 4th step, none before.
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["loading: 4/10 tensors", "loading: 8/10 tensors"]


def test_quick_waits_say_nothing(monkeypatch, caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="test_progress"):
        with Progress("loading", 3, logger=logger, stream=io.StringIO(), clock=clock) as p:
            for _ in range(3):
                p.advance()
    assert caplog.records == []


def test_the_environment_turns_the_line_off(monkeypatch):
    monkeypatch.setenv("LLAMA_PROGRESS", "0")
    stream = Terminal()
    with Progress("x", 2, logger=logger, stream=stream, ticker=False) as p:
        p.advance()
    assert stream.getvalue() == ""


def test_the_ticker_keeps_a_long_step_moving(monkeypatch):
    """A step that takes long (one shape compiling for a minute) still shows its time running."""
    import time

    import llama.runtime.progress as progress

    monkeypatch.setattr(progress, "TICK_S", 0.01)
    monkeypatch.delenv("LLAMA_PROGRESS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    stream = Terminal()
    with Progress("x", 2, logger=logger, stream=stream):
        time.sleep(0.2)
    assert stream.getvalue().count("x: 0/2") >= 3


def test_loading_and_compiling_report_their_steps(llama3_checkpoint, monkeypatch, capsys):
    """A build reports each tensor it loads and each shape it compiles, i of N (the compiled
    step is replaced by a counting one: compiling itself is tested elsewhere)."""
    from llama.engine.runner import ModelRunner

    calls = []

    def fake_compile(runner):
        def step(tokens, positions, kv_len, cache, block_table=None, lora_slots=None):
            calls.append((tokens.shape[0], kv_len))
            return runner.model.decode_logits(tokens, positions, kv_len, cache, block_table, lora_slots)
        runner.use_compiled_step(step)

    monkeypatch.setattr(ModelRunner, "compile", fake_compile)
    monkeypatch.setenv("LLAMA_PROGRESS", "1")
    monkeypatch.delenv("RANK", raising=False)
    llama = build(llama3_checkpoint, compile=True, max_batch_size=3, max_seq_len=64)
    err = capsys.readouterr().err
    shapes = len(llama.engine.runner.row_buckets) * len(llama.engine.runner.context_buckets)
    assert sorted(set(calls)) == sorted((r, c) for r in (1, 2, 3) for c in (64,))
    assert f"compiling the decoding step: {shapes}/{shapes} shapes" in err
    assert f"compiling the decoding step for {shapes} shape(s) before the first request" in err  # the announcement
    tensors = len(llama.model.state_dict())
    assert re.search(rf"loading weights from 1 shard\(s\): {tensors}/{tensors} tensors", err)


@pytest.mark.parametrize("flag, long_lived, environ, expected", [
    (None, False, {}, False),  # the example prompts: eager
    (None, True, {}, None),  # interactive chat: Llama.build's default (compile where it pays)
    (True, False, {}, True),
    (False, True, {}, False),
    (None, False, {"LLAMA_COMPILE": "1"}, None),  # the environment decides, as everywhere
])
def test_the_examples_compile_only_where_it_pays(flag, long_lived, environ, expected):
    from llama.cli.examples import compile_choice

    assert compile_choice(flag, long_lived, environ) is expected


def test_the_example_prompts_decode_eagerly(monkeypatch):
    """A bfloat16 run of example_text_completion.py asks Llama.build for eager steps; an
    interactive chat leaves the choice to it."""
    from llama import Llama

    example_text_completion = load_script("example_text_completion.py")
    example_chat_completion = load_script("example_chat_completion.py")

    seen = []

    class Stop(Exception):
        pass

    def fake_build(*args, **kwargs):
        seen.append(kwargs["compile"])
        raise Stop

    monkeypatch.setattr(Llama, "build", staticmethod(fake_build))
    monkeypatch.delenv("LLAMA_COMPILE", raising=False)
    with pytest.raises(Stop):
        example_text_completion.main(example_text_completion.parse_args(["--dtype", "bfloat16"]))
    with pytest.raises(Stop):
        example_chat_completion.main(example_chat_completion.parse_args(["--dtype", "bfloat16"]))
    with pytest.raises(Stop):
        example_chat_completion.main(example_chat_completion.parse_args(["--dtype", "bfloat16", "--interactive"]))
    with pytest.raises(Stop):
        example_text_completion.main(example_text_completion.parse_args(["--compile"]))
    assert seen == [False, False, None, True]
