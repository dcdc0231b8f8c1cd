"""Worker started by tests under torchrun: build from a Hugging Face folder (its own tokenizer),
run a fixed workload, save the results.

Usage: torchrun --standalone --nproc_per_node N tests/hf_mp_worker.py HF_DIR OUT_DIR
"""

import os
import sys
from pathlib import Path

import torch

from llama import Llama


def workload(llama: Llama) -> dict:
    tokens = torch.randint(0, llama.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    prompts = [[300, 5, 9, 40], [300, 12, 13, 14, 15, 16, 17]]
    return {
        "logits": llama.model.forward(tokens, 0),
        "greedy": llama.generate(prompts, max_gen_len=12, temperature=0)[0],
        "text": [c["generation"] for c in llama.text_completion(["the cat", "Hello there"], max_gen_len=10,
                                                                temperature=0)],
    }


def main(ckpt: str, out_dir: str) -> None:
    llama = Llama.build(ckpt, max_seq_len=64, max_batch_size=2, device="cpu")
    torch.save(workload(llama), Path(out_dir) / f"rank{int(os.environ.get('RANK', 0))}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
