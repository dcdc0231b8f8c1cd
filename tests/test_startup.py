"""What a process pays to start: importing the library, building a model and generating eagerly
must not import ``torch._dynamo`` (1-3 s of every process's start on a 2-CPU machine; every
torchrun rank, server and example pays it), which only a compiled step needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_EAGER_RUN = """
import sys
import llama, llama.generation, llama.serve.app, llama.cli.examples
from llama import Llama
generator = Llama.build(sys.argv[1], max_seq_len=64, max_batch_size=2, device="cpu", compile=False)
assert generator.text_completion(["To be"], max_gen_len=4)[0]["generation"]
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


@pytest.mark.slow
def test_an_eager_process_never_imports_the_compiler():
    run = subprocess.run([sys.executable, "-c", _EAGER_RUN, str(REPO / "demo")], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "dynamo imported: False"
