"""Worker started by tests under torchrun: build each checkpoint with ``compile=True``, serve
requests in changing batch sizes, and save what torch.compile did.

Usage: torchrun --standalone --nproc_per_node N tests/compile_worker.py TOKENIZER OUT_DIR CKPT [CKPT ...]
Writes OUT_DIR/rankR.json: per checkpoint, the graph breaks and graphs made while building
(the warm-up) and after it, and the greedy tokens of each batch.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from llama import Llama

BATCHES = [[[1, 5, 9]], [[1, 5, 9], [1, 2], [3, 4, 5, 6, 7]], [[1, 2], [7, 7, 7, 7]], [[1, 5, 9]]]


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def breaks() -> int:
    return sum(counters["graph_break"].values())


def main(tokenizer: str, out_dir: str, *ckpts: str) -> None:
    results = []
    for ckpt in ckpts:
        torch._dynamo.reset()
        counters.clear()
        llama = Llama.build(ckpt, tokenizer, max_seq_len=600, max_batch_size=4, device="cpu", compile=True)
        at_build = {"graphs": graphs(), "breaks": breaks()}
        # prompts past the first context bucket (256) too
        long_prompt = [[1] + [5 + i % 50 for i in range(300)]]
        tokens = [llama.generate(batch, max_gen_len=12, temperature=0)[0] for batch in BATCHES + [long_prompt]]
        results.append({"at_build": at_build, "graphs_after": graphs() - at_build["graphs"],
                        "breaks_after": breaks() - at_build["breaks"], "compiled": llama.compiled,
                        "tokens": tokens})
    Path(out_dir, f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
