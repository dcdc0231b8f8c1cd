"""Worker started by tests under torchrun: serve PEFT adapters of a tiny Llama 4 (its Hugging
Face folder) unmerged, run a mixed batch, save the greedy tokens and the logits of one forward
pass.

Usage: torchrun --standalone --nproc_per_node N tests/lora_llama4_mp_worker.py HF_DIR OUT_DIR NAME=ADAPTER_DIR...
"""

import sys
from pathlib import Path

import torch

from llama import Llama
from lora_serve_helpers import mixed_batch, save_on_first_rank

NAMES = [None, "experts", "down"]
PROMPTS = [[9, 10, 11], [5, 6, 7, 8, 9], [40, 3, 17, 2, 23, 8]]


def workload(hf: Path, adapters: dict[str, Path]) -> tuple[list[list[int]], torch.Tensor]:
    """(the greedy tokens of a mixed batch of the base and the adapters ``experts`` and ``down``,
    the logits of one forward pass of such a batch), on this process's share of the model."""
    llama = Llama.build(hf, max_seq_len=64, max_batch_size=3, device="cpu", dtype="float32", compile=False,
                        lora_adapters=adapters)
    return mixed_batch(llama, PROMPTS, NAMES, 11)


def main() -> None:
    hf, out = Path(sys.argv[1]), Path(sys.argv[2])
    adapters = {name: Path(folder) for name, folder in (arg.split("=", 1) for arg in sys.argv[3:])}
    tokens, logits = workload(hf, adapters)
    save_on_first_rank(out, tokens, logits)


if __name__ == "__main__":
    main()
