"""Worker started by tests under torchrun: serve three in-memory LoRA adapters (the same on every
rank, from fixed seeds) on a test checkpoint, run a mixed batch, save the greedy tokens and the
logits of one forward pass.

Usage: torchrun --standalone --nproc_per_node N tests/lora_serve_mp_worker.py CKPT TOKENIZER OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch

from llama import Llama
from lora_serve_helpers import ALL_TARGETS, mixed_batch, random_adapter, save_on_first_rank


def workload(ckpt: Path, tokenizer: Path) -> tuple[list[list[int]], torch.Tensor]:
    """(the greedy tokens of a mixed batch, the logits of one forward pass of it) with three
    adapters made from fixed seeds (the same on every rank), on this process's share of the model."""
    params = json.loads((ckpt / "params.json").read_text())
    weights = torch.load(ckpt / "consolidated.00.pth")  # a one-shard test checkpoint: the full weights
    n = params["n_layers"]
    adapters = {
        "alpha": random_adapter("alpha", weights, n, 8, ALL_TARGETS, seed=1, scale=2.0),
        "beta": random_adapter("beta", weights, n, 4, ALL_TARGETS[:4], seed=2, scale=0.5),
        "gamma": random_adapter("gamma", weights, n, 16, ("feed_forward.w1", "feed_forward.w2"), seed=3),
    }
    llama = Llama.build(ckpt, tokenizer, max_seq_len=64, max_batch_size=4, device="cpu", compile=False,
                        lora_adapters=adapters)
    names = [None, "alpha", "beta", "gamma"]
    prompts = [[1, 5, 9, 33, 41], [1, 7, 7, 2], [1, 50, 3, 8, 8, 12], [1, 4]]
    return mixed_batch(llama, prompts, names, 7)


def main() -> None:
    ckpt, tokenizer, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    tokens, logits = workload(ckpt, tokenizer)
    save_on_first_rank(out, tokens, logits)


if __name__ == "__main__":
    main()
