"""Shared fixtures: tokenizers and tiny model configs (all written to temp dirs)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import helpers  # noqa: E402

# Tests build hundreds of models, and a bfloat16 or quantised one would compile its decoding
# steps by default where a C++ compiler is found (seconds each): tests that compile say
# compile=True, and tests of the default itself set the variable their own way.  Inherited
# by the processes tests start.
os.environ.setdefault("LLAMA_COMPILE", "0")
# Triton's interpreter, which runs the int8 kernels of llama.layers.triton_int8 on CPU tensors
# (tests/test_triton_int8.py; where Triton is installed).  Triton reads it once, when imported
# (CPU torch.compile imports it too), so it is set before any test.  Never where CUDA is
# available: it would interpret every Triton kernel, Inductor's included.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every process the tests start carries this mark in its environment (inherited, whatever its
# session or process group), so that the test session can check at its end that none is left
# running: a test that starts a server or torchrun job must end it, on failure too.
SESSION_MARK = "LLAMA_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, str(os.getpid()))
LEFTOVER_GRACE_S = float(os.environ.get("LLAMA_TEST_LEFTOVER_GRACE_S", "15"))

# A Llama 2-shaped config (MHA, theta 1e4) and a Llama 3.1-shaped one (GQA, theta 5e5,
# scaled RoPE).  The scaled config's original context is shortened to 32 so the
# scaling changes angles within the short sequences tests use.
LLAMA2_PARAMS = dict(dim=64, n_layers=2, n_heads=4, multiple_of=32, norm_eps=1e-6, vocab_size=-1)
LLAMA3_PARAMS = dict(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    multiple_of=32,
    ffn_dim_multiplier=1.3,
    norm_eps=1e-5,
    rope_theta=500000.0,
    use_scaled_rope=True,
    rope_scaling_factor=8.0,
    rope_original_context_len=32,
)


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def sp_tokenizer_path(tmp_path_factory) -> Path:
    return helpers.train_sentencepiece(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def codellama_tokenizer_path(tmp_path_factory) -> Path:
    """A SentencePiece model with Code Llama's pieces: infilling (▁<PRE>, ▁<SUF>, ▁<MID>,
    ▁<EOT>, ids 3-6), CodeLlama-70B-Instruct's <step> (7), and the ☺ that Meta's
    infilling encoder puts before a suffix (8)."""
    return helpers.train_sentencepiece(tmp_path_factory.mktemp("codellama-spm"), user_defined_symbols=CODELLAMA_PIECES)


CODELLAMA_PIECES = ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>", "<step>", "\u263a")


@pytest.fixture(scope="session")
def tiny_tiktoken_path(tmp_path_factory) -> Path:
    return helpers.write_tiny_tiktoken(tmp_path_factory.mktemp("tiktoken"))


@pytest.fixture(scope="session")
def mllama_llama3_files(tmp_path_factory):
    """mllama_helpers' tiny random Llama 3.2 Vision model with Llama 3's vocabulary and tokenizer:
    (the transformers model, the folder holding it under ``hf`` and its conversion under ``meta``),
    written once per session for the engine and server tests."""
    import mllama_helpers as mh

    root = tmp_path_factory.mktemp("mllama_llama3")
    hf, _ = mh.write_llama3_vocab_checkpoint(root)
    return hf, root


@pytest.fixture(scope="session")
def llama3_tokenizer_path() -> Path:
    return helpers.llama3_tokenizer_path()


@pytest.fixture(scope="session")
def llama2_checkpoint(tmp_path_factory, sp_tokenizer_path):
    """One shard, Llama 2 layout (embedding split over dim), vocab from the tokenizer."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(sp_tokenizer_path).n_words
    weights = helpers.random_weights(LLAMA2_PARAMS, vocab, seed=2)
    ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("llama2"), LLAMA2_PARAMS, weights, 1, "dim")
    return helpers.Checkpoint(ckpt, sp_tokenizer_path, {**LLAMA2_PARAMS, "vocab_size": vocab}, weights)


@pytest.fixture(scope="session")
def llama3_checkpoint(tmp_path_factory, tiny_tiktoken_path):
    """One shard, Llama 3 layout (embedding split over the vocabulary), a tiny tiktoken tokenizer."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(tiny_tiktoken_path).n_words
    params = {**LLAMA3_PARAMS, "vocab_size": vocab}
    weights = helpers.random_weights(params, vocab, seed=3)
    ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("llama3"), params, weights, 1, "vocab")
    return helpers.Checkpoint(ckpt, tiny_tiktoken_path, params, weights)


def pytest_configure(config):
    logging.getLogger("llama").setLevel(logging.INFO)
    if os.environ.get("LLAMA_WAITING_CENSUS"):
        # Per-test wall / CPU / children's CPU into a TSV (tests/waiting_census.py); off by default.
        import waiting_census
        waiting_census.pytest_configure(config)
    # pytest-xdist's --dist loadfile hands out files with the most tests first, which leaves
    # the files of a few long tests (compiling, torchrun jobs, servers) to the end, one worker
    # running them while the other waits.  Files go out in collection order instead, which
    # pytest_collection_modifyitems below makes the heaviest first.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_weight(items: list) -> float:
    """A rough cost of a file's tests for ordering them: a compiling or multi-process test
    costs most, another slow test less, a quick one little."""
    def cost(item) -> float:
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("compile"):
            return 8.0
        return 2.0 if item.get_closest_marker("slow") else 0.05
    return sum(cost(item) for item in items)


def pytest_collection_modifyitems(config, items):
    """Tests marked multiprocess or compile are slow too, so that the quick subset
    (-m "not slow") never starts torchrun jobs or compiles.  Tests marked cuda are skipped,
    saying why, where torch sees no CUDA device.  Files are ordered heaviest first."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False here")
    for item in items:
        if (item.get_closest_marker("multiprocess") or item.get_closest_marker("compile")) \
                and not item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked multiprocess or compile but not slow")
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(no_cuda)
    # The heaviest files first (each file's tests in their order), so that two workers
    # (-n 2 --dist loadfile) end close together.
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    items[:] = [item for _, group in sorted(by_file.items(), key=lambda kv: -_file_weight(kv[1])) for item in group]


@pytest.fixture
def root_logger_kept():
    """The root logger's level and handlers, given back after the test (the entry points'
    setup_logging sets them)."""
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


def _processes_left(mark: bytes, proc: str = "/proc") -> tuple[dict[int, str], set[int]]:
    """Processes other than this one whose environment holds ``mark`` (pid -> command line), and
    the pids of this process's descendants that cannot be told yet: a process in the middle of
    ``execve`` shows an empty environment until its new one is laid out, and ``Popen`` returns
    before that (under 99 % CPU pressure, a third of the reads right after ``Popen(["sleep",
    "5"])`` returned found it empty); a session whose last test had just started one missed it.
    (Only descendants: init, kernel threads and other sessions' processes may have no
    environment for good.)"""
    found, empty, parent = {}, set(), {}
    me = os.getpid()
    for entry in os.listdir(proc):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            parent[pid] = int(ppid)
            if state == b"Z":
                continue  # dead, awaiting its parent
            with open(f"{proc}/{entry}/environ", "rb") as f:
                environ = f.read()
            if not environ:
                empty.add(pid)
                continue
            if mark not in environ.split(b"\0"):
                continue
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if "crashpad" not in cmd:  # Chromium's crash reporter outlives the browser by design
            found[pid] = cmd

    def descends_from_me(pid: int) -> bool:
        seen = set()
        while pid in parent and pid not in seen:
            seen.add(pid)
            pid = parent[pid]
            if pid == me:
                return True
        return False

    return found, {pid for pid in empty if descends_from_me(pid)}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The process that set the mark (pytest-xdist's controller, after its workers; never a
    worker, nor a pytest run a test starts, which inherit it) checks that no process a test
    started outlives the tests: any left is named, killed, and fails
    the session.  The library's own grammar-compiler workers, which it ends when the process
    exits, are ended first."""
    if os.environ.get(SESSION_MARK) != str(os.getpid()) or not os.path.isdir("/proc"):
        return  # not the session that set the mark: an xdist worker, or a pytest run a test started
    compiler = sys.modules.get("llama.structured.compiler")
    if compiler is not None:
        compiler._close_pools()
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    start = time.monotonic()
    deadline = start + LEFTOVER_GRACE_S  # workers and their children are still exiting
    # Looked at again while any is left, or cannot be told yet (in the middle of execve: a
    # moment; 2 s at most, lest a descendant that has no environment for good hold every session).
    told_by = start + min(LEFTOVER_GRACE_S, 2.0)
    left, pending = _processes_left(mark)
    while (left or (pending and time.monotonic() < told_by)) and time.monotonic() < deadline:
        time.sleep(0.1)
        left, pending = _processes_left(mark)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = "\n".join(f"  {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (f"{len(left)} process(es) started by the tests were still running {LEFTOVER_GRACE_S:g} s after "
               f"the last test (killed now): a test must end what it starts, on failure too\n{lines}")
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
