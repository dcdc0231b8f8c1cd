"""Runs of the example scripts that tests of several files assert on.

Each run starts once per test process (the session, or one pytest-xdist worker) and its
result is kept: a torchrun job costs seconds, and its output answers several questions.
"""

from __future__ import annotations

import os
import subprocess
import sys

import helpers

# One interactive chat under torchrun, through a pipe (not a terminal): a greeting, a blank
# line (skipped), /reset, a question; /reset again, then four long messages that overflow
# max_seq_len=96, so that the oldest exchanges are dropped with a notice.  The segments of
# its output between the "(conversation cleared)" lines are the three conversations.
CHAT_LONG_LINE = "the cat and the dog " * 3
CHAT_INPUT = "hello there\n\n/reset\nhow are you\n/reset\n" + (CHAT_LONG_LINE + "\n") * 4
CHAT_MAX_SEQ_LEN = 96

_runs: dict[tuple, subprocess.CompletedProcess] = {}


def interactive_chat_under_torchrun(llama3_checkpoint, tmp_path_factory) -> subprocess.CompletedProcess:
    """``example_chat_completion.py --interactive`` (no --verbose) as 2 torchrun processes on a
    two-shard copy of the ``llama3_checkpoint`` fixture's model, given :data:`CHAT_INPUT`."""
    key = ("interactive-chat-torchrun", str(llama3_checkpoint.ckpt_dir))
    if key not in _runs:
        _, tok, params, weights = llama3_checkpoint
        ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("two-shard-llama3"), params, weights, n_shards=2)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(helpers.REPO)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "example_chat_completion.py", "--interactive", "--ckpt_dir", str(ckpt), "--tokenizer_path", str(tok),
               "--device", "cpu", "--temperature", "0", "--max_seq_len", str(CHAT_MAX_SEQ_LEN)]
        _runs[key] = subprocess.run(cmd, cwd=helpers.REPO, env=env, input=CHAT_INPUT, capture_output=True, text=True,
                                    timeout=300)
    return _runs[key]


def conversations(stdout: str) -> list[str]:
    """The chat's output cut at each "(conversation cleared)" line."""
    return stdout.split("(conversation cleared)")
