"""benchmarks/bench_paged.py: FlexAttention's block mask over the paged pool.

On CUDA, Inductor lowers FlexAttention with one query token per row to its flex-decoding
Triton template, which has no configuration for some block sizes; the benchmark's first mask
(Q block 1) fitted none, so the GPU measurement never ran.  The constraints are checked here
without a GPU, against Inductor's own CUDA configuration lists; the CPU kernel is compiled and
checked against the gathered read in the slow test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_paged  # noqa: E402

H100 = (9, 0)  # the GPU the benchmark is for


def _decode_block_ns(head_dim: int, dtype: torch.dtype, monkeypatch) -> set[int]:
    """The BLOCK_N of every configuration Inductor's CUDA heuristic offers the flex-decoding
    template on an H100: the default, and those max-autotune and its exhaustive search add."""
    from torch._inductor import config
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: H100)
    heuristic = CUDAConfigHeuristic()
    block_ns = set()
    for options in ({}, {"max_autotune": True}, {"max_autotune": True, "max_autotune_flex_search_space": "EXHAUSTIVE"}):
        with config.patch(options):
            block_ns |= {c.block_n for c in heuristic.get_flex_decode_configs(head_dim, dtype)}
    return block_ns


def decoding_problems(block_size: tuple[int, int], q_len: int, n_heads: int, n_kv: int, head_dim: int,
                      block_ns: set[int]) -> list[str]:
    """Why Inductor's CUDA lowering of FlexAttention (torch 2.13 / 2.11; line numbers are
    2.13's then 2.11's) would not compile ``q_len`` query tokens of ``n_heads`` heads over
    ``n_kv`` K/V heads with the flex-decoding template, for a block mask of ``block_size``
    (Q, KV) given the template's BLOCK_N candidates ``block_ns``; empty: it would.

    The decoding template is the one chosen (kernel/flex/flex_decoding.py _use_flex_decoding,
    L40-97 / L39-96) for fewer than 128 query tokens, static batch and head counts, a block
    mask with one head (GQA), a power-of-two number of query heads per K/V head; the regular
    template (kernel/flex/flex_attention.py L449-461 / L419-431) needs Q and KV block sizes
    divisible by its BLOCK_M and BLOCK_N (128 and 64 by default on an H100 in bfloat16, head
    dim 128), which the engine's 16-slot pages cannot be.
    """
    q_block, kv_block = block_size
    problems = []
    group = n_heads // n_kv
    if q_len >= 128:
        problems.append(f"{q_len} query tokens: the decoding template takes fewer than 128")
    if group & (group - 1):
        problems.append(f"{group} query heads per K/V head: the decoding template needs a power of two")
    if head_dim < 16:  # kernel/flex/flex_attention.py L157-163 / L139-145
        problems.append(f"head dim {head_dim}: Triton's tl.dot needs at least 16")
    # BLOCK_M: the query tokens times the query heads of one K/V head, to a power of two, at
    # least 16 (flex_decoding.py L279-292 / L273-286); configurations whose Q block size it does
    # not divide are skipped (L330 / L324), and with none left nothing compiles
    block_m = max(16, 1 << max(0, (q_len * group - 1).bit_length()))
    if q_block % block_m:
        problems.append(f"Q block size {q_block} is not a multiple of the decoding template's BLOCK_M {block_m}")
    # BLOCK_N: each configuration's is clamped to the KV block size (L327-328 / L321-322), then
    # configurations whose BLOCK_N does not divide it are skipped (L333 / L327); the template
    # asserts SPARSE_KV_BLOCK_SIZE >= BLOCK_N and divisible (templates/flex_decode.py.jinja L32,
    # both), and tl.dot needs BLOCK_N >= 16 (keys x query rows, then values x probabilities)
    for block_n in sorted(block_ns):
        n = min(block_n, kv_block)
        if kv_block % n or n < 16:
            problems.append(f"KV block size {kv_block} does not fit the configuration of BLOCK_N {block_n} "
                            f"(used as {n})")
    return problems


@pytest.mark.parametrize("shape", sorted(bench_paged.SHAPES))
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_flex_block_mask_fits_cudas_decoding_template(shape, monkeypatch):
    """The CUDA block mask: sizes the flex-decoding template has a configuration for (every
    one Inductor offers an H100), the engine's pages as its KV blocks, its shapes those the
    template indexes, and no full blocks; the first mask's (1, 16) is refused by the same check."""
    n_heads, n_kv, head_dim = bench_paged.SHAPES[shape]
    block_ns = _decode_block_ns(head_dim, torch.bfloat16, monkeypatch)
    assert block_ns and all(n >= 16 for n in block_ns)
    rows, context = 3, 40
    case = bench_paged.Case(bench_paged.SHAPES[shape], rows, context, torch.float32, torch.device("cpu"))
    mask = case.flex_block_mask("cuda")
    pool_slots = case.n_blocks * bench_paged.BLOCK

    assert decoding_problems(mask.BLOCK_SIZE, 1, n_heads, n_kv, head_dim, block_ns) == []
    assert mask.BLOCK_SIZE[1] == bench_paged.BLOCK  # one mask block is one page of the pool
    # the query (B, Hq, 1, D) against the pool (1, Hkv, slots, D): flex_attention's length check
    assert mask.seq_lengths == (1, pool_slots)
    per_row = case.table.shape[1]
    # (B, H, Q tiles, KV blocks): one head for GQA (_use_flex_decoding), one Q tile, every pool block addressable
    assert mask.kv_num_blocks.shape == (rows, 1, 1) and mask.kv_indices.shape == (rows, 1, 1, case.n_blocks)
    assert mask.kv_num_blocks.flatten().tolist() == [per_row] * rows
    assert torch.equal(mask.kv_indices[:, 0, 0, :per_row], case.table.to(torch.int32))  # each row's pages, once
    # full blocks make the decoding template split a row's work by the pool's length
    # (templates/flex_decode.py.jinja L121-127, both), not the row's: most splits idle
    assert mask.full_kv_num_blocks is None and mask.full_kv_indices is None

    # the check has teeth: the first mask, a KV block under BLOCK_N's 16, one that max-autotune's 32 does not divide
    assert any("BLOCK_M 16" in p for p in decoding_problems((1, 16), 1, n_heads, n_kv, head_dim, block_ns))
    assert decoding_problems((128, 8), 1, n_heads, n_kv, head_dim, block_ns)
    assert decoding_problems((128, 48), 1, n_heads, n_kv, head_dim, block_ns)


def test_flex_is_compiled_for_static_shapes_and_cpus_mask_keeps_empty_full_blocks(monkeypatch):
    """A batch made dynamic (Dynamo's automatic dynamic shapes, from the second (rows, context)
    on) would rule out CUDA's decoding template: flex_call compiles for static shapes.  The CPU
    mask has an empty set of full blocks, without which torch 2.13's C++ kernel does not compile."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(kwargs) or fn)
    case = bench_paged.Case(bench_paged.SHAPES["150m"], 2, 40, torch.float32, torch.device("cpu"))
    case.flex_call()
    assert compiled == [{"dynamic": False}]
    mask = case.flex_block_mask("cpu")
    assert mask.full_kv_num_blocks is not None and int(mask.full_kv_num_blocks.sum()) == 0


@pytest.mark.slow  # compiles five variants (~1 min on 2 cores)
def test_flex_gives_gathers_attention_on_cpu():
    """FlexAttention over the pool, compiled for the CPU, gives the gathered read's attention
    (measure raises beyond 2e-2 in bfloat16) on rows of different lengths, partial last pages."""
    times = bench_paged.measure(bench_paged.SHAPES["150m"], 3, 40, torch.bfloat16, torch.device("cpu"),
                                reps=1, rounds=1)
    assert times["flex compiled"] is not None, "flex did not compile on the CPU"
    assert set(times) == {"gather", "contiguous", "gather compiled", "contiguous compiled", "flex compiled"}
