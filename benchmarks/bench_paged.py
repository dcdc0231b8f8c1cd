"""Reading the paged KV cache: which way of attending over blocks is fastest, per device.

    python benchmarks/bench_paged.py                                   # CPU: the 150m layer, bf16, 2 threads
    python benchmarks/bench_paged.py --device cuda --shapes 8b         # a GPU: an 8B layer

One attention layer's read of the KV cache and its attention, for one new token in each of
``rows`` rows with ``context`` cached positions (a decoding step), three ways:

  - ``gather``: what the engine does (:meth:`llama.layers.kv_cache.KVCache.read`, called): each row's
    slots are gathered from the pool of blocks into contiguous (B, Hkv, S, D) keys and values,
    then scaled-dot-product attention under the position mask, query heads stacked per K/V
    head as :class:`llama.model.Attention` does;
  - ``contiguous``: the same attention over rows that are already contiguous (B, Hkv, S, D)
    buffers, read in place: what keeping running rows contiguous (blocks only for storage and
    sharing) would cost at most, its copies into and out of blocks left out;
  - ``flex``: FlexAttention over the pool itself, a block mask listing each row's blocks
    (physical slot -> position through a per-row table), nothing gathered; compiled only
    (eager FlexAttention is a reference implementation that materialises every score).

``gather`` and ``contiguous`` run eager and compiled (``torch.compile`` of the same function).
Blocks are scattered through the pool in random order, as in a pool that has served a while;
row lengths differ by up to a block.  Each cell is the median time of one call, in
milliseconds, over ``reps`` calls in each of ``rounds`` rounds (variants interleaved per
round); the table gives median [min-max] over rounds.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import fire
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import set_threads  # noqa: E402  (benchmarks/common.py)
from llama.layers.kv_cache import KVCache, context_slots  # noqa: E402
from llama.runtime.options import DEFAULT_KV_BLOCK_SIZE  # noqa: E402

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.getLogger("bench_paged")

# One layer's attention heads: (query heads, K/V heads, head dim).
SHAPES = {"150m": (8, 2, 64), "8b": (32, 8, 128)}
BLOCK = DEFAULT_KV_BLOCK_SIZE  # the engine's kv_block_size
FLEX_Q_BLOCK = 128  # the flex block mask's Q block size (see Case.flex_block_mask)


class Case:
    """A pool of blocks holding ``rows`` sequences of about ``context`` positions, and one new
    query token per row."""

    def __init__(self, heads: tuple[int, int, int], rows: int, context: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        n_heads, n_kv, head_dim = heads
        g = torch.Generator().manual_seed(0)
        per_row = -(-context // BLOCK)
        self.n_blocks = 1 + rows * per_row + rows  # scratch, the rows, some free ones
        order = 1 + torch.randperm(self.n_blocks - 1, generator=g)[: rows * per_row]
        self.table = order.view(rows, per_row).to(device)  # logical block -> physical block, per row
        # each row one position past its last cached one; rows differ by up to a block
        self.lengths = (context - torch.randint(0, BLOCK, (rows,), generator=g)).to(device)
        self.cache = KVCache(self.n_blocks, BLOCK, n_kv, head_dim, device, dtype)  # the engine's, one layer
        self.cache.k.copy_(torch.randn(self.cache.k.shape, generator=g))
        self.cache.v.copy_(torch.randn(self.cache.v.shape, generator=g))
        self.q = torch.randn(rows, n_heads, 1, head_dim, generator=g).to(device, dtype)
        self.read_slots = context_slots(self.table, context, BLOCK)  # (B, S)
        positions = torch.arange(context, device=device)
        self.mask = (positions < self.lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
        self.n_rep = n_heads // n_kv
        # the contiguous layout: every row's keys and values in place
        self.k_rows, self.v_rows = (t.contiguous() for t in self.cache.read(self.read_slots))

    def attend(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The model's masked attention: each K/V head meets its n_rep query heads stacked."""
        b, h, _, d = self.q.shape
        q = self.q.view(b, h // self.n_rep, self.n_rep, d)  # one token: (B, Hkv, n_rep, D)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask).view(b, h, 1, d)

    def gather(self) -> torch.Tensor:
        return self.attend(*self.cache.read(self.read_slots))

    def contiguous(self) -> torch.Tensor:
        return self.attend(self.k_rows, self.v_rows)

    def flex_block_mask(self, device_type: str) -> BlockMask:
        """The block mask over the pool: one query tile per row (seq_lengths (1, pool slots)),
        whose KV blocks are the row's pool blocks (``BLOCK`` slots each, logical order), and a
        mask_mod that keeps a slot where it holds one of the row's first ``lengths[b]`` positions.

        Sizes, chosen for Inductor's CUDA flex-decoding template, which FlexAttention lowers one
        query token per row to (torch 2.11 and 2.13; the constraints are listed in
        ``tests/test_bench_paged.py``):
          - KV: ``BLOCK``, the engine's page, so that one mask block is one page and each of a
            row's pages is read once (per K/V head, its query heads packed into one tile).  The
            decoding template clamps its BLOCK_N to the mask's KV block size, so 16 is valid there;
            the regular template's BLOCK_N (64 or 128 by default on an H100) does not divide 16,
            so it must not be chosen (``flex_call`` asks for the decoding template).  A coarser
            KV block (64 or 128 consecutive pool slots) would span 4-8 pages, mostly other rows',
            all read and masked away.  The cost: tiles of 16 keys, where the template would
            otherwise load 64 per step.
          - Q: ``FLEX_Q_BLOCK`` (128), a multiple of the decoding template's BLOCK_M, which is
            max(16, next power of two of query tokens x query heads per K/V head), so 16 for
            one token and 4 query heads per K/V head; 1, as first written, fits no configuration.
            With one query token there is one Q tile whatever its size: nothing is padded.
          - "Full" blocks (read without mask_mod): none on CUDA, where their presence
            (HAS_FULL_BLOCKS) makes the decoding template split each row's work by the length
            of the whole pool instead of the row's blocks, leaving most splits idle; an empty
            set on CPU, whose C++ kernel (torch 2.13) does not compile without one.
        """
        from torch.nn.attention.flex_attention import BlockMask

        rows, per_row = self.table.shape
        device = self.table.device
        logical = torch.full((rows, self.n_blocks), -1, dtype=torch.long, device=device)
        logical.scatter_(1, self.table, torch.arange(per_row, device=device).expand(rows, per_row).contiguous())
        lengths = self.lengths

        def mask_mod(b, h, q_idx, kv_idx):
            block = logical[b, kv_idx // BLOCK]  # the slot's logical block in row b, -1: not the row's
            return (block >= 0) & (block * BLOCK + kv_idx % BLOCK < lengths[b])

        kv_num = torch.full((rows, 1, 1), per_row, dtype=torch.int32, device=device)  # (B, H=1, Q tiles=1)
        kv_indices = torch.zeros((rows, 1, 1, self.n_blocks), dtype=torch.int32, device=device)
        kv_indices[:, 0, 0, :per_row] = self.table.to(torch.int32)
        full = (torch.zeros_like(kv_num), torch.zeros_like(kv_indices)) if device_type == "cpu" else (None, None)
        return BlockMask.from_kv_blocks(kv_num, kv_indices, *full, BLOCK_SIZE=(FLEX_Q_BLOCK, BLOCK),
                                        mask_mod=mask_mod, seq_lengths=(1, self.n_blocks * BLOCK))

    def flex_call(self) -> Callable[[], torch.Tensor]:
        """FlexAttention over the pool in place under :meth:`flex_block_mask`, compiled for
        these static shapes (a dynamic batch would rule out the decoding template)."""
        from torch.nn.attention.flex_attention import flex_attention

        device_type = self.q.device.type
        block_mask = self.flex_block_mask(device_type)
        # the decoding template or a clear error, never the regular one (which has no configuration for these blocks)
        options = {"BACKEND": "TRITON_DECODE"} if device_type == "cuda" else None
        k = self.cache.k.permute(1, 0, 2).unsqueeze(0)  # the pool as (1, Hkv, slots, D), a view
        v = self.cache.v.permute(1, 0, 2).unsqueeze(0)
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda: compiled(self.q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)


def ints(value) -> list[int]:
    """A comma-separated list of ints as fire passes it (a str, an int or a tuple)."""
    if isinstance(value, (tuple, list)):
        return [int(v) for v in value]
    return [int(v) for v in str(value).split(",")]


def timed_ms(fn: Callable[[], torch.Tensor], reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(heads: tuple[int, int, int], n_rows: int, context: int, dtype: torch.dtype, device: torch.device,
            reps: int, rounds: int, flex: bool = True) -> dict[str, Optional[list[float]]]:
    """Each way of reading ``n_rows`` rows of ``context`` positions for a layer of ``heads`` (query
    heads, K/V heads, head dim): ms per call in each round (None: it does not compile).  Every
    way is first checked to give gather's output."""
    case = Case(heads, n_rows, context, dtype, device)
    calls = {"gather": case.gather, "contiguous": case.contiguous,
             # static shapes, as flex_call's: without dynamic=False the second (rows, context) compiled
             # would be a graph for any size (Dynamo's automatic dynamic shapes)
             "gather compiled": torch.compile(case.gather, dynamic=False),
             "contiguous compiled": torch.compile(case.contiguous, dynamic=False)}
    if flex:
        calls["flex compiled"] = case.flex_call()
    reference = case.gather().float()
    failed: dict[str, None] = {}
    with torch.inference_mode():
        for name, call in list(calls.items()):  # compile and warm up; every variant gives the same output
            start = time.perf_counter()
            try:
                out = call().float()
            except torch._dynamo.exc.TorchDynamoException as e:  # (Inductor's errors derive from it)
                logger.warning("%s, %d rows, context %d: does not compile: %s", name, n_rows, context,
                               str(e).splitlines()[0][:200])
                failed[name] = None
                del calls[name]
                continue
            logger.info("%s, %d rows, context %d: first call %.1f s", name, n_rows, context,
                        time.perf_counter() - start)
            err = (out - reference).abs().max().item()
            if err > 2e-2:
                raise RuntimeError(f"{name} differs from gather by {err} ({n_rows} rows, context {context})")
        times: dict[str, list[float]] = {name: [] for name in calls}
        for r in range(rounds):
            order = list(calls)[r % len(calls):] + list(calls)[: r % len(calls)]
            for name in order:
                times[name].append(timed_ms(calls[name], reps, device))
    return {**times, **failed}


def main(device: str = "cpu", shapes: str = "", dtype: str = "bfloat16", threads: int = 2, rows: str = "1,8,32",
         contexts: str = "256,1024,4096", reps: int = 20, rounds: int = 3, flex: bool = True) -> None:
    """Print one table per layer shape: ms per call of each variant, median [min-max] over rounds."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    dev = torch.device(device)
    if dev.type == "cpu":
        set_threads(threads)
    torch_dtype = getattr(torch, dtype)
    torch._dynamo.config.recompile_limit = 64  # one graph per (rows, context): static shapes, as measured
    shape_names = shapes.split(",") if isinstance(shapes, str) and shapes else list(shapes) or \
        ["8b" if dev.type == "cuda" else "150m"]
    row_counts, context_lengths = ints(rows), ints(contexts)
    what = f"{torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"\npaged KV-cache reads, {dtype}, {what}, torch {torch.__version__}; ms per layer call, "
          f"median [min-max] over {rounds} rounds of {reps} calls")
    for shape in shape_names:
        h, hkv, d = SHAPES[shape]
        print(f"\n{shape} layer ({h} query heads, {hkv} K/V heads, head dim {d}), blocks of {BLOCK}:\n")
        names = ["gather", "contiguous", "gather compiled", "contiguous compiled"] + (["flex compiled"] if flex else [])
        print("| rows | context | " + " | ".join(names) + " | gather / contiguous, eager | fastest |")
        print("|---:|---:|" + "---:|" * len(names) + "---:|---|")
        for n_rows in row_counts:
            for context in context_lengths:
                times = measure(SHAPES[shape], n_rows, context, torch_dtype, dev, reps, rounds, flex)
                calls = {name: t for name, t in times.items() if t is not None}
                med = {name: statistics.median(t) for name, t in calls.items()}
                cells = [f"{med[n]:.3f} [{min(times[n]):.3f}-{max(times[n]):.3f}]" if n in calls else "fails to compile"
                         for n in names]
                print(f"| {n_rows} | {context} | " + " | ".join(cells) +
                      f" | {med['gather'] / med['contiguous']:.2f} | {min(med, key=med.get)} |", flush=True)


if __name__ == "__main__":
    fire.Fire(main)
