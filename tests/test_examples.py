"""The example scripts end to end, on a tiny checkpoint the test writes."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest

import example_runs
import helpers

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(helpers.REPO), "CUDA_VISIBLE_DEVICES": ""}


def run_python(script: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, *args], cwd=helpers.REPO, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def two_shard_llama3(tmp_path_factory, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    return helpers.write_checkpoint(tmp_path_factory.mktemp("two-shard"), params, weights, n_shards=2), tok


@pytest.mark.slow
# The text example in one process: test_model_flags_reach_build's first run (its flags aside,
# the same run, asserted the same way), which made this case's own process a second one; with
# its default flags it runs under torchrun (test_example_under_torchrun_prints_once).
@pytest.mark.parametrize("script", ["example_chat_completion.py"])
def test_example_in_one_process(llama2_checkpoint, script):
    ckpt, tok = llama2_checkpoint.ckpt_dir, llama2_checkpoint.tokenizer_path
    proc = run_python(script, ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok), "--max_gen_len", "8",
                               "--temperature", "0", "--device", "cpu"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("==================================") == 3
    assert proc.stdout.count("> ") >= 3


@pytest.fixture(scope="module")
def torchrun_example(two_shard_llama3):
    """torchrun_example(script): ``script``'s example prompts, run once under torchrun (2 ranks,
    the two-shard Llama 3 model) for every test that reads its output."""
    ckpt, tok = two_shard_llama3
    runs: dict[str, subprocess.CompletedProcess] = {}

    def run(script: str) -> subprocess.CompletedProcess:
        if script not in runs:
            runs[script] = helpers.torchrun(helpers.REPO / script, [
                "--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok), "--max_gen_len", "8", "--temperature", "0",
                "--device", "cpu"])
        return runs[script]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("script", ["example_text_completion.py", "example_chat_completion.py"])
@pytest.mark.multiprocess
def test_example_under_torchrun_prints_once(torchrun_example, script):
    proc = torchrun_example(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("==================================") == 3  # rank 0 only


@pytest.fixture(scope="module")
def interactive_torchrun_chat(llama3_checkpoint, tmp_path_factory) -> subprocess.CompletedProcess:
    """The interactive chat under torchrun (2 ranks, through a pipe): a greeting, /reset, a
    question, /reset, four long messages at max_seq_len=96 (example_runs.CHAT_INPUT)."""
    return example_runs.interactive_chat_under_torchrun(llama3_checkpoint, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_interactive_chat_under_torchrun(interactive_torchrun_chat):
    proc = interactive_torchrun_chat
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    first, second, _ = example_runs.conversations(out)  # "hello there" / "how are you" / the long messages
    # one answer per message, printed by rank 0 only
    assert first.count("Assistant: ") == 1 and second.count("Assistant: ") == 1, out
    assert "(conversation cleared)" in out and out.rstrip().endswith("Bye.")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_interactive_history_is_trimmed_with_a_notice(interactive_torchrun_chat):
    proc = interactive_torchrun_chat
    assert proc.returncode == 0, proc.stderr[-3000:]
    long_messages = example_runs.conversations(proc.stdout)[2]  # four long messages after /reset, max_seq_len 96
    assert long_messages.count("Assistant: ") == 4
    assert "oldest exchange(s) to fit max_seq_len" in long_messages


@pytest.mark.slow
@pytest.mark.multiprocess
def test_interactive_chat_under_torchrun_logs_nothing_by_default(interactive_torchrun_chat, chat_in_locale):
    """Two processes, a two-shard model: standard error holds no INFO line and no torch
    FutureWarning (our gather once called the deprecated all_gather_tensor, which warned on
    every rank); the answers stream on standard output.  The chat (example_runs.CHAT_INPUT:
    six messages, /reset twice, the oldest exchanges dropped to fit max_seq_len) is the one
    the interactive torchrun tests above read.  With --verbose the INFO lines come back: read
    from the C locale's chat of chat_in_locale, which passes --verbose.  (Moved here from
    test_output_order.py, which ran the same torchrun job a second time.)"""
    proc = interactive_torchrun_chat
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [part.count("Assistant: ") for part in example_runs.conversations(proc.stdout)] == [1, 1, 4], proc.stdout
    assert "INFO" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    verbose = chat_in_locale("C")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert b"INFO llama.checkpoint.loader: loaded" in verbose.stderr, verbose.stderr[-3000:]


@pytest.mark.slow
def test_chat_session_keeps_and_trims_history(llama3_checkpoint):
    from llama import Llama
    from llama.formats.session import ChatSession

    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    llama = Llama.build(ckpt, tok, max_seq_len=512, max_batch_size=1, device="cpu")
    session = ChatSession(llama, system_prompt="be brief", reply_room=16)
    first = "".join(session.ask("the cat", temperature=0))
    assert session.history == [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": first}]
    # the second answer is the reply to the whole dialog, as chat_completion gives it
    dialog = [{"role": "system", "content": "be brief"}, *session.history, {"role": "user", "content": "and then"}]
    expected = llama.chat_completion([dialog], temperature=0, max_gen_len=16)[0]["generation"]["content"]
    assert "".join(session.ask("and then", temperature=0)) == expected
    trimmed = []
    for _ in range(4):
        list(session.ask("the cat and the dog " * 12, temperature=0))
        trimmed.append(session.trimmed)
    assert max(trimmed) > 0
    assert len(llama.formatter.encode_dialog_prompt(session._fit("x"))) <= 512 - 16  # leaves the reply room
    with pytest.raises(ValueError, match="needs .* tokens"):
        session.ask("word " * 600)
    session.reset()
    assert session.history == []


# -- the first hour: help, errors, stdin, Ctrl-C, cut replies -----------------------------------

SCRIPTS = ["example_text_completion.py", "example_chat_completion.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_fast_complete_and_plain(script):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", script, "--help"], cwd=helpers.REPO, env=ENV, capture_output=True,
        text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported  # printing help does not pay for torch
    for flag in ("--ckpt_dir", "--tokenizer_path", "--temperature", "--top_p", "--max_seq_len", "--max_gen_len",
                 "--max_batch_size", "--device", "--seed"):
        assert flag in proc.stdout, flag
    assert "Optional[" not in proc.stdout and "Type:" not in proc.stdout


def help_blocks(text: str) -> dict[str, str]:
    """``--help``'s options, each flag's description with its whitespace collapsed, by flag name."""
    blocks: dict[str, str] = {}
    name = None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-[-\w]+)", line)
        if match:
            name = match.group(1).lstrip("-")
            blocks[name] = ""
        if name is not None:
            blocks[name] += " " + line
    return {flag: " ".join(block.split()) for flag, block in blocks.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_every_default(script):
    """Each flag's help says what it is when not given, and a concrete default is the value the
    script really uses (read from its parser, not from the help text)."""
    proc = run_python(script, ["--help"])
    assert proc.returncode == 0, proc.stderr
    blocks = help_blocks(proc.stdout)
    defaults = vars(load_script(script).parse_args([]))
    assert set(blocks) == set(defaults) | {"h"}, blocks.keys()
    for flag, default in defaults.items():
        assert "default" in blocks[flag], blocks[flag]
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert f"(default: {default})" in blocks[flag], blocks[flag]


def load_script(script: str):
    """The example script as a module (importing it runs nothing but its definitions)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), helpers.REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("case", ["device", "ckpt_dir"])
def test_bad_device_or_checkpoint_answers_before_torch_is_imported(tmp_path, script, case):
    """A wrong --device or --ckpt_dir is reported in one line without paying for torch."""
    args = ["--device", "tpu"] if case == "device" else ["--ckpt_dir", str(tmp_path / "nope")]
    proc = subprocess.run([sys.executable, "-X", "importtime", script, *args], cwd=helpers.REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    errors = [line for line in lines if line.startswith(f"{script}: error: ")]
    assert len(errors) == 1 and lines == errors, proc.stderr[-2000:]
    assert ("--device" in errors[0] and "tpu" in errors[0]) if case == "device" else "nope" in errors[0]
    assert proc.returncode == (2 if case == "device" else 1)


@pytest.mark.parametrize("script", SCRIPTS)
def test_missing_checkpoint_directory_is_one_line(tmp_path, script):
    proc = run_python(script, ["--ckpt_dir", str(tmp_path / "nope"), "--device", "cpu"])
    assert proc.returncode == 1
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line == f"{script}: error: checkpoint directory {tmp_path / 'nope'} does not exist"
    assert "Traceback" not in proc.stderr and "tokenizer" not in proc.stderr


@pytest.mark.slow  # the script imports torch before it reads the tokenizer: seconds
def test_tokenizer_that_is_a_device_is_one_line(llama2_checkpoint):
    """--tokenizer_path /dev/zero used to say the file does not exist."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    ckpt = llama2_checkpoint.ckpt_dir
    script = "example_text_completion.py"
    proc = run_python(script, ["--ckpt_dir", str(ckpt), "--tokenizer_path", "/dev/zero", "--device", "cpu"])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"{script}: error: tokenizer file /dev/zero is not a regular file"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top_p", "nan"), ("--max_seq_len", "abc"),
                                         ("--max_gen_len", "0"), ("--device", "tpu"), ("--no_such_flag", "1")])
def test_bad_flag_is_one_line(script, flag, value):
    proc = run_python(script, [flag, value])
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and f"{script}: error:" in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_failure_after_loading_is_one_line(llama2_checkpoint):
    ckpt, tok = llama2_checkpoint.ckpt_dir, llama2_checkpoint.tokenizer_path
    proc = run_python("example_text_completion.py", ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok),
                                                     "--device", "cpu", "--max_seq_len", "8", "--max_gen_len", "4"])
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("example_text_completion.py: error: ") and "max_seq_len" in last
    assert "Traceback" not in proc.stderr


# -- errors under torchrun: one line, from the first rank ---------------------------------------


def own_lines(stderr: str, script: str) -> list[str]:
    """The lines of stderr that the script's processes wrote as errors (torchrun's summary
    quotes them indented, after "traceback :")."""
    return [line for line in stderr.splitlines() if line.startswith(script) and "error:" in line]


# The wait of a rank other than the first before it exits on an error (flags.OTHER_RANKS_EXIT_DELAY_S,
# 5 s), shortened in the processes of the tests below that write their own job: what they check
# does not depend on its length.
SHORT_EXIT_DELAY_S = 0.3


@pytest.mark.slow
@pytest.mark.multiprocess
def test_model_parallel_size_error_under_torchrun_is_one_line(tmp_path, llama2_checkpoint):
    """A model of 3 heads cannot be split over 2 processes: each rank finds that, but the first
    rank alone prints it, on a line of its own; torchrun's summary quotes it (from the error
    file the rank leaves it) instead of its link to the docs.  Before, every rank printed it,
    naming its rank.  (It was the demo's 8 heads over 3 processes: a third rank, another
    import of torch, for the same paths.)"""
    params = {**llama2_checkpoint.params, "dim": 48, "n_heads": 3}
    ckpt = helpers.write_checkpoint(tmp_path / "three-heads", params,
                                    helpers.random_weights(params, params["vocab_size"], seed=1))
    script = "example_text_completion.py"
    proc = helpers.torchrun(helpers.REPO / script, ["--ckpt_dir", str(ckpt), "--tokenizer_path",
                                                    str(llama2_checkpoint.tokenizer_path), "--device", "cpu"], nproc=2)
    assert proc.returncode != 0
    lines = own_lines(proc.stderr, script)
    assert len(lines) == 1, proc.stderr[-4000:]
    assert lines[0].startswith(f"{script}: error: this model cannot be split over 2 processes"), lines
    assert "(rank " not in proc.stderr
    assert f"traceback : {lines[0]}" in proc.stderr  # torchrun's summary names the error
    assert "To enable traceback see" not in proc.stderr  # ... for every process it lists


@pytest.mark.slow
# One script: both read their flags with example_parser and end through run_script, and
# test_bad_flag_is_one_line checks each script's flags in one process.  (The text example's
# torchrun job was a second one, of ~4 s, through the same code.)
@pytest.mark.parametrize("script", ["example_chat_completion.py"])
@pytest.mark.multiprocess
def test_bad_flag_under_torchrun_is_one_line(script):
    proc = helpers.torchrun(helpers.REPO / script, ["--temperature", "-1"])
    assert proc.returncode != 0
    lines = own_lines(proc.stderr, script)
    expected = f"{script}: error: argument --temperature: expected a finite number >= 0, got '-1' (see --help)"
    assert lines == [expected], proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_error_met_by_another_rank_alone_is_named_by_torchrun(tmp_path):
    """Quiet other ranks must not hide an error only one of them meets: that rank leaves its
    line in its torchrun error file, and torchrun's summary quotes it."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, time\n"
        "from llama.cli import flags\n"
        "from llama.cli.examples import run_script\n"
        f"flags.OTHER_RANKS_EXIT_DELAY_S = {SHORT_EXIT_DELAY_S}  # the failing rank's wait before it exits\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise FileNotFoundError('shard 1 is missing')\n"
        "    time.sleep(120)  # the first rank is fine, and busy\n"
        "run_script('job.py', main)\n"
    )
    start = time.monotonic()
    proc = helpers.torchrun(script, [])
    assert proc.returncode != 0
    assert time.monotonic() - start < 100  # the failing rank ended the job; nobody waited for the sleeper
    assert "traceback : job.py: error: shard 1 is missing" in proc.stderr, proc.stderr[-4000:]
    assert own_lines(proc.stderr, "job.py") == []  # printed by no process: torchrun reports it


def run_fail(tmp_path, rank: str, error_file: bool) -> tuple[subprocess.CompletedProcess, Optional[dict], float]:
    """llama.cli.flags.fail as a process of rank ``rank`` of a 2-process job, with or without an
    error file from torchrun (another rank's wait before exiting: SHORT_EXIT_DELAY_S); returns the
    process, what the error file holds and how long the process ran."""
    path = tmp_path / f"error-{rank}-{error_file}.json"
    env = {**ENV, "RANK": rank, "WORLD_SIZE": "2", "TORCHELASTIC_ERROR_FILE": str(path) if error_file else ""}
    code = f"from llama.cli import flags; flags.OTHER_RANKS_EXIT_DELAY_S = {SHORT_EXIT_DELAY_S}; " \
           "flags.fail('prog', 'it broke', 3)"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, (json.loads(path.read_text()) if path.exists() else None), time.monotonic() - start


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fail_in_a_job(tmp_path):
    """Unit level: the first rank prints and records; another waits, then records quietly, or
    prints naming its rank where nothing would record it; all exit with the status asked for."""
    from llama.cli.flags import TORCHRUN_REPORT_NOTE

    proc, recorded, _ = run_fail(tmp_path, "0", error_file=True)
    # The error, then one line saying that torchrun's own report (ChildFailedError) follows.
    assert (proc.returncode, proc.stderr) == (3, "prog: error: it broke\n" + TORCHRUN_REPORT_NOTE + "\n")
    assert "ChildFailedError" in TORCHRUN_REPORT_NOTE
    assert recorded["message"]["message"] == "prog: error: it broke"
    assert recorded["message"]["extraInfo"]["py_callstack"] == "prog: error: it broke"  # what torchrun shows
    proc, recorded, seconds = run_fail(tmp_path, "1", error_file=True)
    assert (proc.returncode, proc.stderr) == (3, "")
    assert recorded["message"]["message"] == "prog: error: it broke"
    assert seconds >= SHORT_EXIT_DELAY_S  # it waited before exiting
    proc, recorded, seconds = run_fail(tmp_path, "1", error_file=False)
    assert (proc.returncode, proc.stderr, recorded) == (3, "prog (rank 1): error: it broke\n", None)
    assert seconds >= SHORT_EXIT_DELAY_S


def run_chat_process(ckpt, tok, stdin: bytes, *extra, env=None):
    cmd = [sys.executable, "example_chat_completion.py", "--interactive", "--ckpt_dir", str(ckpt),
           "--tokenizer_path", str(tok), "--device", "cpu", "--temperature", "0", *extra]
    return subprocess.run(cmd, cwd=helpers.REPO, env={**ENV, **(env or {})}, input=stdin, capture_output=True,
                          timeout=300)


@pytest.fixture(scope="module")
def chat_in_locale(llama2_checkpoint):
    """chat_in_locale(locale): the interactive chat in one process, its input piped in under
    that locale: undecodable bytes, then plain words, at max_seq_len=64 (a reply room of 16
    tokens).  Run once per locale for the tests that read it.  The C locale's run passes
    --verbose (its log lines go to standard error, which the locale tests do not read) for
    test_interactive_chat_under_torchrun_logs_nothing_by_default."""
    ckpt, tok = llama2_checkpoint.ckpt_dir, llama2_checkpoint.tokenizer_path
    runs: dict[str, subprocess.CompletedProcess] = {}

    def run(locale: str) -> subprocess.CompletedProcess:
        if locale not in runs:
            stdin = b"caf\xe9 \xff\xfe bad bytes\n\xc3\x28\nplain words\n"
            verbose = ["--verbose"] if locale == "C" else []
            runs[locale] = run_chat_process(ckpt, tok, stdin, "--max_seq_len", "64", *verbose,
                                            env={"LC_ALL": locale, "LANG": locale, "PYTHONIOENCODING": ""})
        return runs[locale]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
def test_interactive_chat_survives_undecodable_input(chat_in_locale, locale):
    proc = chat_in_locale(locale)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(b"Assistant: ") == 3 and proc.stdout.rstrip().endswith(b"Bye.")


@pytest.mark.slow
def test_interactive_reply_cut_at_the_limit_says_so(chat_in_locale):
    """A random model never says EOS: every reply runs to the limit, and the chat says so
    (read from the C.UTF-8 chat of test_interactive_chat_survives_undecodable_input)."""
    proc = chat_in_locale("C.UTF-8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert b"(reply cut at the 16-token limit" in proc.stdout  # ChatSession's reply room: max_seq_len // 4


def as_a_foreground_job() -> None:
    """In a child about to run a command: SIGINT's default action, as a shell gives its
    foreground job.  An ignored signal stays ignored across exec, and Python then keeps
    ignoring SIGINT (it installs its KeyboardInterrupt handler only over the default): a test
    run started in the background of a shell script (``pytest ... &``, which ignores SIGINT
    in what it starts) would otherwise hand that on, and a Ctrl-C sent to the chat would be
    lost: the chat then ended at the end of its input, with status 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_foreground_job_gets_ctrl_c_where_the_test_run_ignores_it():
    """as_a_foreground_job undoes an ignored SIGINT inherited from the test run: the child's
    Python raises KeyboardInterrupt on SIGINT (test_ctrl_c_ends_the_chat_quietly relies on it)."""
    probe = [sys.executable, "-S", "-c",
             "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a test run started with `&` by a script
    try:
        inherited = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        restored = subprocess.run(probe, capture_output=True, text=True, timeout=30, preexec_fn=as_a_foreground_job)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert inherited.stdout.strip() == "False"  # what the flaky runs' chat had: SIGINT ignored
    assert restored.stdout.strip() == "True", restored.stderr


@pytest.mark.slow
def test_ctrl_c_ends_the_chat_quietly(llama2_checkpoint):
    ckpt, tok = llama2_checkpoint.ckpt_dir, llama2_checkpoint.tokenizer_path
    cmd = [sys.executable, "example_chat_completion.py", "--interactive", "--ckpt_dir", str(ckpt),
           "--tokenizer_path", str(tok), "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=as_a_foreground_job)
    out = b""
    deadline = time.monotonic() + 120
    while b"You: " not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1)
        if ready:
            out += os.read(proc.stdout.fileno(), 4096)
    assert b"You: " in out, out
    proc.send_signal(signal.SIGINT)
    out_rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, (out + out_rest)[-300:], err[-2000:])
    assert b"Traceback" not in err and err.strip().splitlines()[-1] == b"interrupted"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_chat_example_shows_a_tool_round_trip_on_llama3(torchrun_example):
    """A Llama 3 checkpoint gets the tool example (a random model rarely calls the tool, so
    what is checked is that the dialog with tools runs and its reply is reported).  Read from
    the chat example's torchrun run (test_example_under_torchrun_prints_once): its Llama 3
    model, at the default max_seq_len (2048), has room for the tool prompt."""
    proc = torchrun_example("example_chat_completion.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[tools: get_weather]" in proc.stdout
    assert "> Assistant (" in proc.stdout  # the reply with its stop reason


def _read_until(fd: int, out: bytearray, marker: bytes, count: int, deadline: float) -> None:
    while out.count(marker) < count and time.monotonic() < deadline:
        if select.select([fd], [], [], 1)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:  # EIO: every process holding the terminal has gone
                return


@pytest.fixture(scope="module")
def terminal_chat(two_shard_llama3) -> dict:
    """A person at a terminal: torchrun (2 ranks) is the terminal's foreground job, as a shell
    would start it, and the chat is typed at it.  A message with a Ctrl-C typed right after it;
    a message with a Ctrl-C typed half a second into its reply; a Ctrl-C at the prompt.  Gives
    the status, everything the terminal showed, and its settings before and after."""
    import fcntl
    import pty
    import termios

    ckpt, tok = two_shard_llama3
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)

    def own_terminal():  # a new session whose controlling terminal is the pty, like a login shell's job
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    # A random model never ends a reply: 2048 positions give a reply room of 512 tokens, seconds long.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "example_chat_completion.py", "--interactive", "--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok),
           "--device", "cpu", "--temperature", "0", "--max_seq_len", "2048"]
    proc = subprocess.Popen(cmd, cwd=helpers.REPO, env={**ENV, "LLAMA_COLLECTIVE_TIMEOUT_S": "120"},
                            stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal)
    out = bytearray()
    try:
        deadline = time.monotonic() + 240
        _read_until(master, out, b"You: ", 1, deadline)
        assert b"You: " in out, out.decode(errors="replace")
        os.write(master, b"hello there\n")  # one line, read at the prompt ...
        os.write(master, b"\x03")  # ... and a Ctrl-C (its own "line" at the terminal), waiting for the reply
        _read_until(master, out, b"You: ", 2, deadline)
        assert out.count(b"You: ") == 2, out.decode(errors="replace")
        os.write(master, b"hello there\n")
        _read_until(master, out, b"Assistant: ", 2, deadline)
        time.sleep(0.5)  # a few pieces into the reply
        os.write(master, b"\x03")
        _read_until(master, out, b"You: ", 3, deadline)
        assert out.count(b"You: ") == 3, out.decode(errors="replace")
        os.write(master, b"\x03")  # at the prompt: the chat ends
        proc.wait(timeout=60)
        after = termios.tcgetattr(slave)
        os.close(slave)  # the terminal's last holder: reading what is left ends at its end (EIO), not at a timeout
        slave = -1
        _read_until(master, out, b"\n", 10**6, time.monotonic() + 2)  # whatever is left
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        if slave != -1:
            os.close(slave)
    return dict(returncode=proc.returncode, text=out.decode(errors="replace").replace("\r\n", "\n"),
                before=before, after=after)


def replies(text: str) -> list[str]:
    """What the terminal showed after each "Assistant: ", up to the next prompt."""
    return [part.split("You: ", 1)[0] for part in text.split("Assistant: ")[1:]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_at_a_terminal_under_torchrun(terminal_chat):
    """Ctrl-C during a reply stops the reply; Ctrl-C at the prompt ends the chat with one line
    and status 0 from every process, and no torchrun traceback.  Before, Ctrl-C reached
    torchrun's agent as SIGINT, which printed its SignalException traceback."""
    text = terminal_chat["text"]
    assert terminal_chat["returncode"] == 0, text[-3000:]
    assert "(reply stopped" in replies(text)[1], text[-3000:]  # the reply the Ctrl-C came half a second into
    assert "(interrupted)" in text
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert terminal_chat["after"] == terminal_chat["before"]  # the terminal's settings are given back


@pytest.mark.slow
@pytest.mark.multiprocess
def test_nothing_is_printed_after_ctrl_c_stops_a_reply(terminal_chat):
    """At a terminal, a Ctrl-C typed while a piece of the reply is decoded stops the reply
    before that piece is printed.  The Ctrl-C is typed right after the message, before the first
    piece exists, so exactly when it is read is known: nothing of the reply may appear.  Before,
    the loop printed each piece and only then looked for the key, so one piece came out after it.
    (The first exchange of terminal_chat: the first rank reads the keys, as a lone process does.)"""
    text = terminal_chat["text"]
    assert terminal_chat["returncode"] == 0, text[-3000:]
    reply = replies(text)[0]
    # "^C" is the terminal's own echo of the key, not the program's output: it shows when the key
    # reaches the terminal before the chat has switched the echo of control keys off for the
    # reply, which a loaded machine makes likely.  Nothing of the reply may appear either way.
    reply = reply.removeprefix("^C")
    assert reply == "\n(reply stopped; this exchange is not kept in the conversation)\n", reply


# -- Llama.build's own options as flags (--dtype --quantize --quantize_group_size --compile --cpu_packing) --


def test_model_flags_offer_what_build_accepts():
    """The flags offer the values of llama.runtime.options (read without importing torch), and
    the library takes each of them: every dtype name means the torch dtype it names, every
    quantisation mode and int4 group size passes Llama.build's checks, every packing kind is
    known to the packing code."""
    import torch

    from llama.cli.examples import example_parser
    from llama.layers import policy, quantize
    from llama.runtime import options
    from llama.runtime.devices import resolve_dtype

    parser = example_parser("prog", "")
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions["quantize"].choices) == options.QUANTIZATION_MODES
    assert tuple(actions["quantize_group_size"].choices) == options.INT4_GROUP_SIZES
    assert tuple(actions["cpu_packing"].choices) == options.PACKING_KINDS
    for alias, name in options.DTYPE_NAMES.items():
        assert resolve_dtype(alias, torch.device("cpu")) is getattr(torch, name), alias
    for mode in options.QUANTIZATION_MODES:
        assert quantize.int4_group_size(mode, None) == (128 if mode == "int4" else None)
    for size in options.INT4_GROUP_SIZES:
        assert quantize.int4_group_size("int4", size) == size
    for kind in options.PACKING_KINDS:
        assert policy.check_packing_kind(kind) == kind
    with pytest.raises(ValueError):
        policy.check_packing_kind("mkl")


def test_model_flags_become_build_arguments():
    from llama.cli.examples import example_parser
    from llama.cli.flags import model_options

    parser = example_parser("prog", "")
    assert model_options(parser.parse_args([])) == dict(dtype=None, quantize=None, quantize_group_size=None,
                                                        compile=None, cpu_packing=None)
    args = parser.parse_args(["--dtype", "BF16", "--quantize", "int4", "--quantize-group-size", "32", "--compile",
                              "--cpu_packing", "fbgemm"])
    assert model_options(args) == dict(dtype="bfloat16", quantize="int4", quantize_group_size=32, compile=True,
                                       cpu_packing="fbgemm")
    assert model_options(parser.parse_args(["--no-compile", "--dtype", "torch.float16"]))["compile"] is False
    assert model_options(parser.parse_args(["--dtype", "torch.float16"]))["dtype"] == "float16"


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag, value", [("--quantize", "int3"), ("--quantize_group_size", "48"), ("--dtype", "bf17"),
                                         ("--cpu_packing", "mkl")])
def test_bad_model_flag_is_one_line(script, flag, value):
    proc = run_python(script, [flag, value])
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{script}: error: argument {flag}" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_model_flags_reach_build(llama2_checkpoint):
    """What the flags ask for is what Llama.build gets: an int4 bfloat16 model generates;
    a group size the model's widths cannot take, and a packing a float32 model cannot
    have, are Llama.build's own errors, as one line.  (Both scripts read the flags with
    example_parser and pass model_options; each runs a part, to keep the suite short.)"""
    ckpt, tok = llama2_checkpoint.ckpt_dir, llama2_checkpoint.tokenizer_path
    base = ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok), "--device", "cpu", "--max_gen_len", "4",
            "--temperature", "0"]
    script = "example_text_completion.py"
    proc = run_python(script, [*base, "--dtype", "bf16", "--quantize", "int4", "--quantize_group_size", "32"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the text example in one process (test_example_in_one_process's checks): three prompts, answered
    assert proc.stdout.count("==================================") == 3
    assert proc.stdout.count("> ") >= 3
    assert "int4" in proc.stderr  # the loader's log line names the weights it holds
    proc = run_python(script, [*base, "--dtype", "bf16", "--quantize", "int4", "--quantize_group_size", "256"])
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and "group size" in last and "256" in last, last
    script = "example_chat_completion.py"
    proc = run_python(script, [*base, "--cpu_packing", "fbgemm"])  # float32: the CPU's default dtype
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"{script}: error: cpu_packing='fbgemm' applies to bfloat16 and float16 models on the CPU, "
                    "not to a torch.float32 model on cpu: leave cpu_packing unset"), last

# -- docs/checkpoints.md's word on comparing with transformers ------------------------------


@pytest.mark.slow
def test_transformers_matches_the_cpu_default_with_float32_as_the_readme_says(tmp_path):
    """docs/checkpoints.md, "Converting": the converted demo's config.json says bfloat16 (its weights' dtype),
    which transformers' default run computes in; ``dtype=torch.float32`` matches this library's
    CPU default (float32)."""
    transformers = pytest.importorskip("transformers", reason="compares with Hugging Face transformers "
                                       "(pip install -r requirements-test.txt)")
    import torch

    from llama import Llama
    from llama.convert import meta_to_hf

    demo = helpers.REPO / "demo"
    meta_to_hf(demo, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    ours = Llama.build(demo, demo / "tokenizer.model", max_seq_len=256, max_batch_size=1, device="cpu")
    assert next(ours.model.parameters()).dtype == torch.float32
    ids = torch.tensor([ours.tokenizer.encode("ROMEO:\nBut soft, what light", bos=True, eos=False)])
    with torch.no_grad():
        expected = ours.model.forward(ids, 0).float()
        default = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
        float32 = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        assert default.dtype == torch.bfloat16 and float32.dtype == torch.float32
        assert (default(ids).logits.float() - expected).abs().max() > 1e-2  # bfloat16's rounding shows
        assert (float32(ids).logits - expected).abs().max() < 1e-4

