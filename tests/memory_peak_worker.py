"""Measure the peak resident memory of one prefill on a small model (a fresh process,
so that the peak RSS is this prefill's own).

Usage: python tests/memory_peak_worker.py JSON_CONFIG [JSON_CONFIG ...]
Prints a JSON object per config, one a line, in order: measured (bytes the resident size
peaked above its value just before the prefill) and estimate
(llama.checkpoint.memory.prefill_activation_bytes for the same pass).  Each config is
measured in a child forked from this process, which has only imported its modules: as fresh
as a new process, without importing torch again for each.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from llama.args import ModelArgs
from llama.checkpoint.memory import prefill_activation_bytes
from llama.model import Transformer
from llama.runtime import distributed


def status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its high-water mark) from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(field)


def reset_peak() -> None:
    """Restart the high-water mark from the current resident size (Linux: clear_refs 5),
    so an earlier peak (building the model) cannot hide this one."""
    Path("/proc/self/clear_refs").write_text("5")


def main(config: dict) -> None:
    batch, tokens, masked = config.pop("batch"), config.pop("tokens"), config.pop("masked")
    dtype = getattr(torch, config.pop("dtype"))
    distributed.init_model_parallel(torch.device("cpu"))
    args = ModelArgs(**config, max_batch_size=batch, max_seq_len=tokens)
    model = Transformer(args)
    model.to(dtype)  # weights; the cache and the RoPE table are made next
    model.setup_rope()
    cache = model.new_kv_cache()
    with torch.inference_mode():
        def prefill(b: int, t: int) -> None:
            ids = torch.randint(0, args.vocab_size, (b, t))
            positions = torch.arange(t).expand(b, t)
            model.logits(model.hidden_states(ids, positions, t, cache, from_start=not masked)[:, -1])

        prefill(1, 8)  # load kernels and libraries before the baseline
        reset_peak()
        before = status_bytes("VmRSS")
        prefill(batch, tokens)
        measured = status_bytes("VmHWM") - before
    estimate = prefill_activation_bytes(args, batch, tokens, dtype, masked=masked)
    print(json.dumps({"measured": measured, "estimate": estimate}))


def in_fresh_child(config: dict) -> None:
    """``main(config)`` in a child forked now; fails if the child does."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            main(config)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"measuring {config} failed (exit status {os.waitstatus_to_exitcode(status)})")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        in_fresh_child(json.loads(arg))
