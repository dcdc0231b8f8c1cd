"""Attention of a compiled CPU decoding step, 8 layers' worth: torch's CPU flash-attention
kernel (``F.scaled_dot_product_attention`` with a mask, as the model called it) against the
multiply-and-sum a compiled CPU step now uses (llama.layers.attention.masked_attention with
``attention_as_reduction``), both inside one ``torch.compile``d function of 8 calls, as in a
step.  Shapes as the model gives them: queries (B, K/V heads, query heads per K/V head x new
tokens, head dim) against the cache's keys and values (B, K/V heads, context, head dim),
bfloat16; the mask hides the context's last 10 positions.

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
from llama.layers.attention import masked_attention  # noqa: E402
from llama.layers.policy import KernelPolicy  # noqa: E402

LAYERS = 8
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
    flash, reductions = KernelPolicy(attention_as_reduction=False), KernelPolicy(attention_as_reduction=True)

    def steps(policy: KernelPolicy):
        def attend(q, keys, values, mask):
            return [masked_attention(q, keys, values, mask, policy) for _ in range(LAYERS)]
        return torch.compile(attend, dynamic=False)

    print(f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; us per {LAYERS} attentions")
    print("| heads | context | flash kernel | multiply-and-sum | ratio |")
    print("|---|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for name, batch, heads, rows, dim, context in cases([int(c) for c in args.contexts.split(",")]):
        q = torch.randn(batch, heads, rows, dim, generator=generator).bfloat16()
        keys = torch.randn(batch, heads, context, dim, generator=generator).bfloat16()
        values = torch.randn(batch, heads, context, dim, generator=generator).bfloat16()
        mask = torch.ones(batch, 1, rows, context, dtype=torch.bool)
        mask[..., context - 10:] = False
        expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        torch._dynamo.reset()  # each case's graphs its own (the functions share one code object)
        calls = {"flash": steps(flash), "reductions": steps(reductions)}
        error = (calls["reductions"](q, keys, values, mask)[0].float() - expected.float()).abs().max().item()
        if error > 0.05:
            raise SystemExit(f"{name}, context {context}: the two differ by {error}")
        seconds = timed_rounds({name: functools.partial(call, q, keys, values, mask) for name, call in calls.items()},
                               args.rounds, args.seconds)
        times = {name: [t * 1e6 for t in ts] for name, ts in seconds.items()}
        a, b = statistics.median(times["flash"]), statistics.median(times["reductions"])
        span = {k: f"{statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]" for k, v in times.items()}
        print(f"| {name} | {context} | {span['flash']} | {span['reductions']} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
