"""Worker started under torchrun by tests/test_images_ranks.py (Llama 4) and
tests/test_engine_mllama.py (Llama 3.2 Vision).

Usage: torchrun --standalone --nproc_per_node N tests/images_mp_worker.py CKPT OUT_DIR IMAGE [IMAGE ...]
Builds the checkpoint (float32, on the CPU), answers one chat per image (the image, then a
question) and one without, greedily, in one ``chat_completion`` call, and saves rank r's replies
(text, token pieces, log-probabilities) as OUT_DIR/rank{r}.pt.
"""

import os
import sys
from pathlib import Path

import torch

from llama import Llama

QUESTION = "What is in the picture?"
MAX_GEN_LEN = 8


def dialogs(images: list[str]) -> list[list[dict]]:
    with_images = [[{"role": "user", "content": [{"type": "image", "image": Path(p).read_bytes()},
                                                 {"type": "text", "text": QUESTION}]}] for p in images]
    return with_images + [[{"role": "user", "content": QUESTION}]]


def answer(llama: Llama, images: list[str]) -> list[dict]:
    replies = llama.chat_completion(dialogs(images), temperature=0, max_gen_len=MAX_GEN_LEN, logprobs=True)
    return [{"content": r["generation"]["content"], "tokens": r["tokens"], "logprobs": r["logprobs"]}
            for r in replies]


def main(ckpt: str, out_dir: str, *images: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    llama = Llama.build(ckpt, max_seq_len=128, max_batch_size=len(images) + 1, device="cpu", dtype="float32")
    torch.save(answer(llama, list(images)), Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
