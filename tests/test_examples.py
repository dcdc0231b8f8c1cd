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
