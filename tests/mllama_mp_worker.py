"""Worker started by the Llama 3.2 Vision model-parallel test under torchrun.

Usage: torchrun --standalone --nproc_per_node N tests/mllama_mp_worker.py CKPT TOKENIZER OUT_DIR
Builds the checkpoint, runs the fixed prompts of ``test_mllama_model.PROMPTS`` with their images
(logits over the prompt, then greedy tokens), saves rank r's results as OUT_DIR/rank{r}.pt.
"""

import os
import sys
from pathlib import Path

import torch

import mllama_helpers as mh
from llama import Llama
from test_mllama_model import PROMPTS, greedy


def main(ckpt: str, tokenizer: str, out_dir: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    llama = Llama.build(ckpt, tokenizer, max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    model = llama.model
    results = {"local_heads": model.cross_attention_layers[0].attention.n_local_heads,
               "vision_local_heads": model.vision_model.vision_encoder.transformer.resblocks[0].attn.n_local_heads}
    for name, (tokens, canvases) in PROMPTS.items():
        values, ids = mh.pixels(canvases)
        t = torch.tensor([tokens])
        results[name] = {"logits": model.forward(t, 0, images=model.image_context(values, ids, t)),
                         "greedy": greedy(model, tokens, values, ids, 8)}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
