"""Worker started by tests under torchrun: an engine sized by kv_cache_memory on each rank
from a fake device whose memory differs by rank; each rank writes what it got.

Usage: torchrun --standalone --nproc_per_node N tests/kv_sizing_worker.py CKPT TOKENIZER OUT_DIR TOTALS \
           [OUT_DIR TOTALS ...]
TOTALS: each rank's device memory in MiB, comma-separated.  A rank writes its pool's tokens,
or the RuntimeError it was refused with, to OUT_DIR/rank{R}.json; each further pair sizes
another engine over the same model, in the same processes.
"""

import gc
import json
import sys
from pathlib import Path

import torch

from llama import Llama
from llama.engine import Engine
from llama.engine.kv_sizing import MemoryReading
from llama.runtime.distributed import model_parallel_rank

MIB = 2**20


class FixedDevice:
    """Readings of a device of ``total`` bytes where this process holds ``weights`` and peaks
    ``activations`` above that and the provisional pool (``provisional`` bytes)."""

    def __init__(self, total: int, weights: int, activations: int, provisional: int) -> None:
        self.total, self.weights, self.peak = total, weights, weights + provisional + activations

    def read(self) -> MemoryReading:
        return MemoryReading(total=self.total, free=self.total - self.weights, reserved=self.weights,
                             peak_reserved=self.peak)

    def reset_peak(self) -> None:
        pass

    def release_cached(self) -> None:
        pass


def main(ckpt: str, tokenizer: str, *runs: str) -> None:
    llama = Llama.build(ckpt, tokenizer, max_seq_len=256, max_batch_size=4, device="cpu", dtype="float32",
                        compile=False)
    rank = model_parallel_rank()
    model = llama.model
    attention = model.layers[0].attention
    per_token = 2 * len(model.layers) * attention.n_local_kv_heads * attention.head_dim * 4
    for out_dir, totals in zip(runs[::2], runs[1::2]):
        device = FixedDevice(int(totals.split(",")[rank]) * MIB, 4 * MIB, 10 * MIB, (1 + 256 // 16) * 16 * per_token)
        try:
            engine = Engine(model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64,
                            kv_cache_memory=0.5, device_memory=device)
            result = {"tokens": engine.kv.capacity, "per_token": per_token}
            del engine
        except RuntimeError as e:
            result = {"error": str(e)}
        gc.collect()  # the last engine's pool
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
