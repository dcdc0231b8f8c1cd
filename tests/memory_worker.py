"""Measure one rank's peak resident memory while Llama.build loads a checkpoint.

Usage: torchrun ... tests/memory_worker.py CKPT TOKENIZER OUT_DIR [QUANTIZE]
(or plain python for one rank).  Loads in bfloat16, with ``quantize=QUANTIZE`` if given.
Writes rank{R}.json with the peak RSS before and after loading, the peak rise while
loading (the high-water mark restarted just before, as tests/memory_peak_worker.py does),
the anonymous memory the built model holds, and the bytes of this rank's weights and KV cache.
"""

import json
import os
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

from llama import Llama
from llama.checkpoint.loader import LoadOptions, load_model
from llama.layers.cpu import CpuFeatures
from llama.layers.packed import PackedWeight, packed_bytes
from llama.layers.policy import KernelPolicy
from memory_peak_worker import reset_peak, status_bytes


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_anon_bytes() -> int:
    """Resident anonymous memory now (not counting pages of mapped files)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(ckpt: str, tokenizer: str, out_dir: str, quantize: Optional[str] = None) -> None:
    rank = int(os.environ.get("RANK", 0))
    # Load the math libraries, and the kernels the policy probes, before the baseline
    torch.zeros(1) @ torch.zeros(1)
    CpuFeatures.probe()
    before, anon_before = peak_rss_bytes(), rss_anon_bytes()
    reset_peak()
    base = status_bytes("VmRSS")
    # What Llama.build does, in two steps: load this rank's slices (mapped from the
    # shard), then set the model up for generation (which, in bfloat16 on an x86 CPU,
    # copies the linear weights out of the mapping into a CPU kernel's packed layout).
    options = LoadOptions(max_seq_len=16, max_batch_size=1, device="cpu", dtype="bfloat16", prefill_chunk=512,
                          quantize=quantize)
    model, tok = load_model(ckpt, tokenizer, options, KernelPolicy.decide(options.device, options.dtype,
                                                                          quantize=quantize))
    # The process's high-water mark: the one before the restart, or the one since.
    after = max(before, status_bytes("VmHWM"))
    load_peak = status_bytes("VmHWM") - base
    llama = Llama(model, tok)
    anon_after = rss_anon_bytes()
    # bfloat16 linear weights may be packed for a CPU kernel (not parameters then, same bytes)
    weights = sum(p.numel() * p.element_size() for p in llama.model.parameters()) + packed_bytes(llama.model)
    buffers = sum(b.numel() * b.element_size() for b in llama.model.buffers())
    largest = max([p.numel() * p.element_size() for p in llama.model.parameters()] +
                  [packed_bytes(m) for m in llama.model.modules() if isinstance(m, PackedWeight)])
    result = dict(before=before, after=after, load_peak=load_peak, anon_rise=anon_after - anon_before,
                  packed=packed_bytes(llama.model),
                  weights=weights, buffers=buffers, largest_local=largest)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
