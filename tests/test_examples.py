"""The example scripts end to end, on a tiny checkpoint the test writes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import helpers

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(helpers.REPO), "CUDA_VISIBLE_DEVICES": ""}


def run_python(script: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, *args], cwd=helpers.REPO, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def two_shard_llama3(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    return helpers.write_checkpoint(tmp_path / "ckpt", params, weights, n_shards=2), tok


@pytest.mark.parametrize("script", ["example_text_completion.py", "example_chat_completion.py"])
def test_example_in_one_process(llama2_checkpoint, script):
    ckpt, tok, _, _ = llama2_checkpoint
    proc = run_python(script, ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok), "--max_gen_len", "8",
                               "--temperature", "0", "--device", "cpu"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("==================================") == 3
    assert proc.stdout.count("> ") >= 3


@pytest.mark.parametrize("script", ["example_text_completion.py", "example_chat_completion.py"])
def test_example_under_torchrun_prints_once(two_shard_llama3, script):
    ckpt, tok = two_shard_llama3
    proc = helpers.torchrun(helpers.REPO / script, ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok),
                                                     "--max_gen_len", "8", "--temperature", "0", "--device", "cpu"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("==================================") == 3  # rank 0 only


def run_interactive(ckpt, tok, stdin: str, nproc: int = 2, extra: tuple = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "example_chat_completion.py", "--interactive", "--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok),
           "--device", "cpu", "--temperature", "0", *extra]
    return subprocess.run(cmd, cwd=helpers.REPO, env=ENV, input=stdin, capture_output=True, text=True, timeout=300)


def test_interactive_chat_under_torchrun(two_shard_llama3):
    ckpt, tok = two_shard_llama3
    proc = run_interactive(ckpt, tok, "hello there\n\n/reset\nhow are you\n", extra=("--max_seq_len", "128"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("Assistant: ") == 2  # one answer per message, printed by rank 0 only
    assert "(conversation cleared)" in out and out.rstrip().endswith("Bye.")


def test_interactive_history_is_trimmed_with_a_notice(two_shard_llama3):
    ckpt, tok = two_shard_llama3
    long_line = "the cat and the dog " * 3
    proc = run_interactive(ckpt, tok, (long_line + "\n") * 4, extra=("--max_seq_len", "96"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Assistant: ") == 4
    assert "oldest exchange(s) to fit max_seq_len" in proc.stdout


def test_chat_session_keeps_and_trims_history(llama3_checkpoint):
    from llama import Llama
    from llama.chat_session import ChatSession

    ckpt, tok, _, _ = llama3_checkpoint
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
