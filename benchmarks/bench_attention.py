"""Attention of a compiled CPU decoding step, 8 layers' worth: torch's CPU flash-attention
kernel (``F.scaled_dot_product_attention`` with a mask, as the model called it) against the
multiply-and-sum a compiled CPU step now uses (llama.layers.attention.masked_attention with
``attention_as_reduction``), both inside one ``torch.compile``d function of 8 calls, as in a
step, and the multiply-and-sum with the values' weighted sum as a matrix product
(``attention_values_by_matmul``, the policy where torch's capability is AVX2).  Shapes as the
model gives them: queries (B, K/V heads, query heads per K/V head x new tokens, head dim)
against keys and values read from a paged KV cache (llama.layers.kv_cache: blocks of 16 in a
shuffled order, gathered through the block table inside the compiled function, as a step reads
them), bfloat16; the mask hides the context's last 10 positions.  Compiled with the options of
the library's CPU steps (the vector width in the cache key: run with and without
``ATEN_CPU_CAPABILITY=avx2`` to compare the two widths).

    python benchmarks/bench_attention.py                  # the 150m's and the 1B's heads, 1 thread
    python benchmarks/bench_attention.py --threads 2 --contexts 64,1024

Each case's two functions are timed in alternating rounds (benchmarks/common.py's timed_rounds:
the median of a round's calls; the median and range over rounds); us per call of the function
(its 8 attentions and the compiled call's own fixed cost, a few tens of us).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import set_threads, timed_rounds  # noqa: E402
from llama.engine.runner import cpu_compile_options  # noqa: E402
from llama.layers.attention import masked_attention  # noqa: E402
from llama.layers.kv_cache import KVCache, context_slots  # noqa: E402
from llama.layers.policy import KernelPolicy  # noqa: E402

LAYERS = 8
BLOCK = 16
POLICIES = {"flash kernel": KernelPolicy(attention_as_reduction=False),
            "multiply-and-sum": KernelPolicy(attention_as_reduction=True),
            "values by matmul": KernelPolicy(attention_as_reduction=True, attention_values_by_matmul=True)}
# (name, batch rows, K/V heads, query rows per K/V head, head dim)
SHAPES = [("150m", 1, 2, 4, 64), ("1B", 1, 8, 4, 64), ("150m, 8 rows", 8, 2, 4, 64),
          ("150m, verifying 8 proposals", 1, 2, 32, 64)]


def cases(contexts: list[int]) -> list[tuple[str, int, int, int, int, int]]:
    return [(name, b, h, r, d, s) for name, b, h, r, d in SHAPES for s in contexts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="64,256,1024,4096", help="cached positions attended to")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="per function and round")
    args = parser.parse_args()
    set_threads(args.threads)

    def steps(policy: KernelPolicy):
        def attend(q, cache, table, context, mask):
            keys, values = cache.read(context_slots(table, context.shape[0], BLOCK))
            return [masked_attention(q, keys, values, mask, policy) for _ in range(LAYERS)]
        return torch.compile(attend, dynamic=False, options=cpu_compile_options())

    print(f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}; us per {LAYERS} attentions")
    print("| heads | context | " + " | ".join(POLICIES) + " | sum / flash | matmul / flash |")
    print("|---|---:|" + "---:|" * (len(POLICIES) + 2))
    generator = torch.Generator().manual_seed(0)
    for name, batch, heads, rows, dim, context in cases([int(c) for c in args.contexts.split(",")]):
        blocks = batch * -(-context // BLOCK)
        cache = KVCache(blocks, BLOCK, heads, dim, dtype=torch.bfloat16)
        cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
        cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
        table = torch.randperm(blocks, generator=generator).view(batch, -1)
        q = torch.randn(batch, heads, rows, dim, generator=generator).bfloat16()
        mask = torch.ones(batch, 1, rows, context, dtype=torch.bool)
        mask[..., context - 10:] = False
        keys, values = cache.read(context_slots(table, context, BLOCK))
        expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        context_ids = torch.empty(context, 0)  # its length only, as the runner passes it
        torch._dynamo.reset()  # each case's graphs its own (the functions share one code object)
        calls = {label: functools.partial(steps(policy), q, cache, table, context_ids, mask)
                 for label, policy in POLICIES.items()}
        for label, call in calls.items():
            error = (call()[0].float() - expected.float()).abs().max().item()
            if error > 0.05:
                raise SystemExit(f"{name}, context {context}: {label} differs from SDPA by {error}")
        seconds = timed_rounds(calls, args.rounds, args.seconds)
        times = {label: [t * 1e6 for t in ts] for label, ts in seconds.items()}
        med = {label: statistics.median(v) for label, v in times.items()}
        cells = [f"{med[k]:.0f} [{min(v):.0f}-{max(v):.0f}]" for k, v in times.items()]
        flash = med["flash kernel"]
        print(f"| {name} | {context} | " + " | ".join(cells) +
              f" | {med['multiply-and-sum'] / flash:.2f} | {med['values by matmul'] / flash:.2f} |")

if __name__ == "__main__":
    main()
