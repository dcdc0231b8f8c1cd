"""Worker started by tests/test_compiled.py in a process of its own: build a checkpoint in
bfloat16 with ``compile=True`` (one row; the thread count OMP_NUM_THREADS gives), look at how
its compiled decoding step reaches the packed weights, and write what it saw.

Usage: python tests/packed_compile_worker.py CKPT TOKENIZER OUT_JSON
Writes OUT_JSON: the model's vocabulary and torch's CPU threads; whether the output projection
and the fused attention projections are packed, and packed as this CPU's kind for that thread
count; how many products an eager and a compiled one-row decoding step asked the
llama::packed_linear operator for (by key), and the relative error of the compiled step's
logits against the eager step's; how many tokens a greedy generation gave, and whether the
model stayed compiled throughout.
"""

import json
import sys

import torch

from helpers import rel_err
from llama import Llama
from llama.layers import packing
from llama.layers.packed import PackedFusedProjections, PackedWeight
from test_packing import packed_kind_is_this_cpus


def main(ckpt: str, tokenizer: str, out_path: str) -> None:
    llama = Llama.build(ckpt, tokenizer, max_seq_len=64, max_batch_size=1, device="cpu", dtype="bfloat16",
                        compile=True)
    model, threads = llama.model, torch.get_num_threads()
    calls: list[int] = []

    class CountingTable(dict):
        def __getitem__(self, key):
            calls.append(key)
            return super().__getitem__(key)

    packing._PACKED_BY_KEY = CountingTable(packing._PACKED_BY_KEY)  # what the operator looks keys up in
    tokens, positions = torch.tensor([[5]]), torch.tensor([[4]])
    with torch.inference_mode():
        model.forward(torch.tensor([[1, 5, 9, 11]]), 0)
        eager = model.decode_logits(tokens, positions, model.params.max_seq_len, model.forward_cache())
        eager_calls = len(calls)  # eager steps call the kernels directly
        step = llama.engine.runner.decode_step
        step(tokens, positions, model.params.max_seq_len, model.forward_cache())
        calls.clear()
        compiled = step(tokens, positions, model.params.max_seq_len, model.forward_cache())
    compiled_calls = len(calls)
    generated = llama.generate([[1, 5, 9]], max_gen_len=5, temperature=0)[0][0]
    result = {
        "vocab": model.vocab_size, "threads": threads, "n_layers": model.n_layers,
        "output_packed": isinstance(model.output, PackedWeight),
        "fused_packed": isinstance(model.layers[0].attention.fused, PackedFusedProjections),
        "kind_is_this_cpus": packed_kind_is_this_cpus([m for m in model.modules() if isinstance(m, PackedWeight)],
                                                      threads),
        "eager_calls": eager_calls, "compiled_calls": compiled_calls,
        "rel_err": rel_err(compiled, eager) if compiled.shape == eager.shape else None,
        "generated": len(generated), "compiled": llama.compiled,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
