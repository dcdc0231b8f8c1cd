"""Measure one rank's peak resident memory while Llama.build loads a checkpoint.

Usage: torchrun ... tests/memory_worker.py CKPT TOKENIZER OUT_DIR
Writes rank{R}.json with the peak RSS before and after building, and the bytes of
this rank's weights and KV cache.
"""

import json
import os
import resource
import sys
from pathlib import Path

import torch

from llama import Llama


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(ckpt: str, tokenizer: str, out_dir: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    torch.zeros(1) @ torch.zeros(1)  # load the math libraries before the baseline
    before = peak_rss_bytes()
    llama = Llama.build(ckpt, tokenizer, max_seq_len=16, max_batch_size=1, device="cpu", dtype="bfloat16")
    after = peak_rss_bytes()
    weights = sum(p.numel() * p.element_size() for p in llama.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in llama.model.buffers())
    largest = max(p.numel() * p.element_size() for p in llama.model.parameters())
    result = dict(before=before, after=after, weights=weights, buffers=buffers, largest_local=largest)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
