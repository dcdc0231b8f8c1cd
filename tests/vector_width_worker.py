"""Worker started by tests/test_compiled.py in a process of its own, under the
``ATEN_CPU_CAPABILITY`` and ``TORCHINDUCTOR_CACHE_DIR`` the test gives: build a checkpoint in
float32 with and without ``compile=True`` and decode greedily with both.

Usage: python tests/vector_width_worker.py CKPT TOKENIZER OUT_JSON
Writes OUT_JSON: the vector width (bits) Inductor generates C++ for in this process, torch's
CPU capability, and the greedy tokens of the eager and the compiled model.  A compiled step
whose C++ was generated for another width aborts the process (a corrupted heap) or raises on
NaN logits before anything is written.
"""

import json
import sys

import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa

from llama import Llama

PROMPT = [1, 5, 9, 13, 2, 7]


def main(ckpt: str, tokenizer: str, out_path: str) -> None:
    tokens = {}
    for compiled in (False, True):
        llama = Llama.build(ckpt, tokenizer, max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32",
                            compile=compiled)
        out, _ = llama.generate([PROMPT], max_gen_len=12, temperature=0.0)
        tokens["compiled" if compiled else "eager"] = out[0]
    with open(out_path, "w") as f:
        json.dump({"width": pick_vec_isa().bit_width(), "capability": torch.backends.cpu.get_cpu_capability(),
                   **tokens}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
