"""Worker started by the Llama 4 model-parallel tests under torchrun.

Usage: torchrun --standalone --nproc_per_node N tests/llama4_mp_worker.py TOKENIZER OUT_DIR CKPT [CKPT ...]
Builds each checkpoint in turn, runs a fixed workload, saves rank r's results as OUT_DIR/rank{r}.pt.
LLAMA4_WORKER_QUANTIZE=int4:32 (or int8) builds with those quantised weights.
"""

import os
import sys
from pathlib import Path

import torch

from llama import Llama
from llama.layers.moe import Experts
from llama.runtime.distributed import model_parallel_rank


def workload(llama: Llama) -> dict:
    """Logits over several attention chunks, and greedy decoding of a ragged batch past chunk boundaries."""
    vocab = llama.model.vocab_size
    tokens = torch.randint(0, vocab, (2, 30), generator=torch.Generator().manual_seed(0))
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 7)]
    return {
        "logits": llama.model.forward(tokens, 0),
        "greedy": llama.generate(prompts, max_gen_len=20, temperature=0)[0],
        "text": llama.text_completion(["the cat", "Hello there"], max_gen_len=12, temperature=0),
    }


def dequantized_experts(llama: Llama) -> dict[str, torch.Tensor]:
    """Each int4 expert stack of this rank as the kernel sees it, ``"layer.w1"`` -> (E, in, out):
    its product with the identity (every output is one weight value, rounded once)."""
    stacks = [m for m in llama.model.modules() if isinstance(m, Experts) and m.quantized == "int4"]
    out = {}
    with torch.inference_mode():
        for i, experts in enumerate(stacks):
            for name in Experts.matrices:
                if experts.int4_kernel_rows is not None:  # laid out for our CPU kernel (torch's packing dropped)
                    in_features = experts.int4_in_features[name]
                else:
                    in_features = getattr(experts, name + "_scales_and_zeros").shape[1] * experts.int4_group_size
                eye = torch.eye(in_features)
                out[f"{i}.{name}"] = torch.stack([experts.product(name, e, eye) for e in range(experts.num_experts)])
    return out


def main(tokenizer: str, out_dir: str, *ckpts: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    mode, _, group = os.environ.get("LLAMA4_WORKER_QUANTIZE", "").partition(":")
    quantized = dict(quantize=mode, quantize_group_size=int(group) if group else None) if mode else {}
    results = []
    for ckpt in ckpts:
        llama = Llama.build(ckpt, tokenizer, max_seq_len=48, max_batch_size=3, device="cpu", **quantized)
        experts = [m.quantized for m in llama.model.modules() if isinstance(m, Experts)]
        results.append({**workload(llama), "rank": model_parallel_rank(), "experts_quantized": experts,
                        "experts_dequantized": dequantized_experts(llama)})
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
