"""Worker started by tests/test_compiled.py in a process of its own: build a checkpoint in
bfloat16 with ``compile=True`` (one row; the thread count OMP_NUM_THREADS gives), look at how
its compiled decoding step reaches the packed weights, and write what it saw.

Usage: python tests/packed_compile_worker.py CKPT TOKENIZER OUT_JSON
Writes OUT_JSON: the model's vocabulary and torch's CPU threads; whether the output projection
and the fused attention projections are packed, and packed as this CPU's kind for that thread
count; how many products an eager and a compiled one-row decoding step (on the engine's
cache) asked the llama::packed_linear operator for (by key), how many graphs the compiled one
made (the warm-up's should serve it), and the relative error of its logits against the eager
step's; how many tokens a greedy generation gave, and whether the
model stayed compiled throughout.
"""

import json
import sys

import torch

from helpers import rel_err
from llama import Llama
from llama.engine.runner import _compiled_graphs
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
    # On the engine's own cache and block table, in the shapes the warm-up compiled (inputs made
    # under inference mode and contiguous, as the runner's: the graph's guards check both)
    runner = llama.engine.runner
    kv, context, graphs = runner.kv, runner.context_buckets[0], _compiled_graphs()
    with torch.inference_mode():
        table = kv.whole_sequences(1, model.device)
        model.hidden_states(torch.tensor([[1, 5, 9, 11]]), torch.arange(4).expand(1, 4), 4, kv.cache,
                            from_start=True, block_table=table)
        tokens, positions = torch.tensor([[5]]), torch.tensor([[4]])
        eager = model.decode_logits(tokens, positions, context, kv.cache, table)
        eager_calls = len(calls)  # eager steps call the kernels directly
        compiled = runner.decode_step(tokens, positions, context, kv.cache, table)
    compiled_calls, graphs_made = len(calls), _compiled_graphs() - graphs
    generated = llama.generate([[1, 5, 9]], max_gen_len=5, temperature=0)[0][0]
    result = {
        "vocab": model.vocab_size, "threads": threads, "n_layers": model.n_layers,
        "output_packed": isinstance(model.output, PackedWeight),
        "fused_packed": isinstance(model.layers[0].attention.fused, PackedFusedProjections),
        "kind_is_this_cpus": packed_kind_is_this_cpus([m for m in model.modules() if isinstance(m, PackedWeight)],
                                                      threads),
        "eager_calls": eager_calls, "compiled_calls": compiled_calls, "graphs_made": graphs_made,
        "rel_err": rel_err(compiled, eager) if compiled.shape == eager.shape else None,
        "generated": len(generated), "compiled": llama.compiled,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
