"""Worker started by the vision model-parallel test under torchrun.

Usage: torchrun --standalone --nproc_per_node N tests/vision_mp_worker.py CKPT TOKENIZER OUT_DIR
Builds the checkpoint, encodes fixed image tiles, runs a prompt whose ``<|patch|>`` positions
hold their features, and saves rank r's results as OUT_DIR/rank{r}.pt.
"""

import os
import sys
from pathlib import Path

import torch

from llama import Llama
from vision_helpers import IMAGE_TOKEN, pixels, prompt_with_images


def main(ckpt: str, tokenizer: str, out_dir: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    llama = Llama.build(ckpt, tokenizer, max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32")
    model = llama.model
    tiles = pixels(5, seed=1)
    features = model.encode_images(tiles)
    tokens = prompt_with_images([5], model.params.vision_args.patches_per_tile)
    logits = model.forward(tokens, 0, image_features=features, image_positions=tokens == IMAGE_TOKEN)
    torch.save({"features": features, "logits": logits,
                "local_heads": model.vision_embeddings.vision_encoder.transformer.resblocks[0].attn.n_local_heads},
               Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
