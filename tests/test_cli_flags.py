"""What every command line shares (the examples, ``python -m llama.serve``, ``python -m
llama.convert``): both spellings of every flag, one default ``--max_seq_len`` rule stated in
--help, ``--device cuda`` refused before the model loads where there is no GPU, and the text
example's ``--prompt``."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch

from helpers import REPO

# The entry points' setup_logging sets the root logger's level: given back after each test.
pytestmark = pytest.mark.usefixtures("root_logger_kept")

def load_script(script: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parsers() -> dict[str, argparse.ArgumentParser]:
    from llama.convert.cli import build_parser as convert_parser
    from llama.serve.server import _parser as serve_parser

    found = {"example_text_completion.py": load_script("example_text_completion.py").build_parser(),
             "example_chat_completion.py": load_script("example_chat_completion.py").build_parser(),
             "llama.serve": serve_parser()}
    convert = convert_parser()
    for action in convert._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"llama.convert {name}"] = sub
    return found


def long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


@pytest.mark.parametrize("command", sorted(parsers()))
def test_every_flag_takes_dashes_and_underscores(command):
    """``--ckpt-dir`` as vLLM and llama.cpp users type it, ``--ckpt_dir`` as Meta's scripts do:
    both name the same option, in every command."""
    options = long_options(parsers()[command])
    assert options
    for spelling, action in options.items():
        if isinstance(action, argparse.BooleanOptionalAction) and spelling.startswith("--no-"):
            continue  # its negation: read in both spellings by the parser (test_the_server_reads_...)
        for twin in (spelling.replace("_", "-"), "--" + spelling[2:].replace("-", "_")):
            assert twin in options, f"{command}: {spelling} has no twin {twin}"
            assert options[twin].dest == action.dest


def test_the_server_reads_a_dashed_checkpoint_flag():
    from llama.serve.server import _parser

    args = _parser().parse_args(["--ckpt-dir", "x", "--max-seq-len", "64", "--shutdown-grace-s", "1"])
    assert (args.ckpt_dir, args.max_seq_len, args.shutdown_grace_s) == ("x", 64, 1.0)
    assert _parser().parse_args(["--no_compile"]).compile is False
    assert _parser().parse_args(["--compile"]).compile is True
    assert _parser().parse_args([]).compile is None
    assert _parser().parse_args(["--no-compile"]).compile is False


def test_convert_takes_dashed_commands(tmp_path):
    from llama.convert.cli import build_parser

    assert build_parser().parse_args(["hf-to-meta", "a", "b", "--model-parallel-size", "2"]).model_parallel_size == 2


# -- one default --max_seq_len ----------------------------------------------------------------

def test_one_max_seq_len_rule(tmp_path):
    """The checkpoint's stated context, capped at MAX_SEQ_LEN_CAP; a Meta checkpoint states
    none: the cap.  The demo model states its training length."""
    from llama.cli.examples import DEMO_MAX_SEQ_LEN, MAX_SEQ_LEN_CAP, resolve_lengths

    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "params.json").write_text("{}")
    short, long = tmp_path / "short", tmp_path / "long"
    for folder, context in ((short, 1024), (long, 131072)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    assert resolve_lengths(None, None) == DEMO_MAX_SEQ_LEN == 256
    assert resolve_lengths(str(meta), None) == MAX_SEQ_LEN_CAP == 2048
    assert resolve_lengths(str(short), None) == 1024
    assert resolve_lengths(str(long), None) == MAX_SEQ_LEN_CAP
    assert resolve_lengths(str(long), 99) == 99


@pytest.mark.parametrize("command", ["example_text_completion.py", "example_chat_completion.py", "llama.serve"])
def test_every_command_states_the_same_rule(command):
    from llama.cli.examples import MAX_SEQ_LEN_HELP

    action = long_options(parsers()[command])["--max_seq_len"]
    assert action.default is None and MAX_SEQ_LEN_HELP in action.help
    assert "2048" in MAX_SEQ_LEN_HELP and "256" in MAX_SEQ_LEN_HELP


# -- --device cuda without a GPU ------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
@pytest.mark.parametrize("script", ["example_text_completion.py", "example_chat_completion.py"])
def test_device_cuda_without_a_gpu_is_refused_before_loading(script, monkeypatch):
    from llama import Llama

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Llama, "build", staticmethod(must_not_load))
    module = load_script(script)
    with pytest.raises(RuntimeError) as e:
        module.main(module.parse_args(["--device", "cuda"]))
    assert str(e.value).startswith("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_the_server_refuses_device_cuda_before_loading(monkeypatch):
    from llama.engine import build
    from llama.serve import server

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(build, "build_engine", must_not_load)
    monkeypatch.setattr(server, "bind_socket", lambda *a: pytest.fail("the port was taken"))
    with pytest.raises(RuntimeError, match=r"^--device cuda:1: no CUDA device here"):
        server.main(["--device", "cuda:1"])


# -- --prompt -------------------------------------------------------------------------------------

def test_prompts_from_flags_and_stdin():
    module = load_script("example_text_completion.py")
    args = module.parse_args(["--prompt", "one", "--prompt", "-", "--prompt", "three"])
    assert module.read_prompts(args.prompt, stdin=io.StringIO("two\nlines\n")) == ["one", "two\nlines", "three"]
    assert module.read_prompts(module.parse_args([]).prompt) == module.PROMPTS
    with pytest.raises(ValueError, match="once"):
        module.read_prompts(["-", "-"], stdin=io.StringIO("x"))
    with pytest.raises(ValueError, match="empty prompt"):
        module.read_prompts(["-"], stdin=io.StringIO(""))


def test_the_text_example_completes_the_given_prompts(monkeypatch, capsys):
    """``--prompt`` replaces the example prompts, in order (a stand-in model echoes the prompt)."""
    from llama import Llama

    class Stub:
        def text_completion_stream(self, prompt, **kwargs):
            yield f"<{prompt.upper()}>"

    monkeypatch.setattr(Llama, "build", staticmethod(lambda *a, **k: Stub()))
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    module = load_script("example_text_completion.py")
    module.main(module.parse_args(["--prompt", "first", "--prompt", "-"]))
    out = capsys.readouterr().out
    assert "first\n> <FIRST>" in out and "from stdin\n> <FROM STDIN>" in out
    assert "To be, or not to be" not in out
