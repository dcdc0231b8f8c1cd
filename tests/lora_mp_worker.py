"""Worker started by tests/test_lora_merge.py under torchrun: builds a Meta checkpoint with a
LoRA adapter merged at load (``Llama.build(..., lora=)``) on each rank and saves the first
rank's logits for the tokens in OUT_DIR/tokens.pt.

Usage: torchrun --standalone --nproc_per_node N tests/lora_mp_worker.py CKPT ADAPTER OUT_DIR
"""

import sys
from pathlib import Path

import torch

from llama import Llama
from llama.runtime.distributed import model_parallel_rank


def main(ckpt: str, adapter: str, out: str) -> None:
    llama = Llama.build(ckpt, max_seq_len=64, max_batch_size=3, device="cpu", dtype="float32", lora=adapter)
    tokens = torch.load(Path(out) / "tokens.pt")
    logits = llama.model.forward(tokens, 0)
    if model_parallel_rank() == 0:
        torch.save(logits, Path(out) / "logits.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
