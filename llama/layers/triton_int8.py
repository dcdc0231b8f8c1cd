"""``x @ (weight_int8 * scale[:, None]).T`` for few rows (decoding steps and batches) on a GPU,
in Triton: each int8 weight byte is read once, never expanded to a bfloat16 copy.

    out[m, n] = sum_k x[m, k] * weight_int8[n, k] * scale[n]

``x`` bfloat16/float16 (M, K); ``weight_int8`` (N, K) row-major; ``scale`` (N,) in ``x``'s dtype
or float32.  Products are summed in float32 (each one exact: a bfloat16 times an int8 fits
float32's 24-bit significand), times the scale in float32, rounded once to ``x``'s dtype.

It is the custom op ``torch.ops.llama.int8_weight_mm`` (:func:`int8_weight_mm`), with a fake
implementation, so eager code and ``torch.compile`` graphs (CUDA graphs included) call the
same kernels: Inductor keeps the op as an opaque call.  :func:`llama.layers.products.int8_product_off_cpu`
sends it products of up to :data:`MAX_ROWS` rows.  Triton is imported when the kernels are
first built (the op's first call), never by importing this module: CPU-only installs need none.

Two kernels, chosen by :func:`kernel_config`, each a grid of (output tiles of ``BLOCK_N``
weight rows) x (``split`` slices of K); every program streams its weight tile through K once:

* one row (``"reduce"``): the tile (BLOCK_N, BLOCK_K) times the row, accumulated elementwise
  in float32 registers and summed over K once at the end.  Tensor cores would multiply 15
  rows of padding for nothing, and small BLOCK_N (8) is allowed here, which gives
  a 4,096-row matrix 512 programs for 132 SMs without splitting K;
* 2 to ``MAX_ROWS`` rows (``"dot"``): ``tl.dot(weight tile as x's dtype, x tile transposed)``,
  i.e. outᵀ = W xᵀ: the weight is the dot's first operand, whose row count (BLOCK_N) can be
  large while the rows of ``x`` are padded to BLOCK_M = 16, 32 or 64 (tl.dot's minimum is
  16).  A product of a few rows is memory-bound, so the padding costs no time; every row of
  ``x`` shares each weight tile, so the weight is read once for all of them.

Where the output tiles are too few to keep the SMs streaming (N = 4,096 with BLOCK_N = 64
gives 64 tiles for 132 SMs), K is split: each slice writes float32 partial sums to a buffer
and a second small kernel adds them in a fixed order (deterministic, unlike atomic adds),
applies the scale and rounds.

int8 -> float conversion (``fast_convert``): the exponent trick (the int8 added to the bit
pattern of 1.5 * 2**23, the float minus 1.5 * 2**23: exact, an integer and a float add) rather
than the integer-to-float instruction (I2F) that Triton's cast to float32 compiles to, which
CUDA's throughput table gives 16 results a clock per SM on compute capability 8.x and 9.0:
streaming int8 at an H100's 3.35 TB/s over 132 SMs at 1.76 GHz needs ~14 conversions a clock
per SM, nearly all of it.  Triton's cast to bfloat16/float16 (the dot's operand) needs no I2F.
What the compiler makes of each configuration for sm_90 (registers, spills, shared memory,
instructions) can be read without a GPU: ``benchmarks/bench_int8.py --compile_only``.

Configurations are fixed heuristics by shape (:func:`kernel_config`), not ``triton.autotune``:
tuning would time every configuration on each process's first call of each shape (compile
time on every start, and a device sync that must never happen during CUDA-graph capture).
``benchmarks/bench_int8.py --sweep`` times the alternatives on a GPU, to set the heuristics by.
Nothing in a call synchronises the device or allocates other than through torch's caching
allocator (the output and, with K split, the partial sums), so calls can be captured in CUDA
graphs once each shape has run once (Triton compiles on a shape's first call; the engine warms
every shape up before capturing).  The row count is not a specialisation of the kernels: a new
one compiles only where it changes BLOCK_M or whether K is split.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

# Rows up to which int8 products take these kernels (KernelPolicy.int8_direct_up_to_rows).  Up
# to here a product is memory-bound on an H100 even for cuBLAS: 64 rows do 64 flops per byte of
# a bfloat16 weight, where its tensor cores only become the limit at ~300 (990 Tflop/s over
# 3.35 TB/s).  So reading the weight once as int8 (N*K bytes) beats converting it first (read
# N*K, write and read again 2*N*K each: 5*N*K).  Further on, cuBLAS's share of the time grows
# less than the kernels' (the dot's tiles would reach 128 x 256) and prompts' hundreds of rows
# amortise a conversion.  The engine's batches (powers of two up to its maximum) stay below.
# Where exactly the conversion starts to win is not measured (bench_int8.py --rows 64,128,256).
MAX_ROWS = 64

# Declared for the type checker only (no value: the names are bound by _kernels, on first use).
triton: Any
tl: Any


@dataclass(frozen=True)
class KernelConfig:
    """One launch of the kernels: ``kind`` "reduce" (one row) or "dot"; the weight tile
    (``block_n`` rows x ``block_k`` columns), ``block_m`` the rows of x padded for tl.dot,
    ``split`` slices of K, and Triton's ``num_warps`` / ``num_stages``."""

    kind: str
    block_n: int
    block_k: int
    block_m: int = 16
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fast_convert: bool = True


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def split_for(tiles: int, k: int, block_k: int, programs: int, most: int) -> int:
    """The smallest power of two splitting K so that ``tiles`` output tiles times the split
    reach ``programs`` programs, each slice keeping at least 4 blocks of ``block_k``, and at
    most ``most`` slices."""
    split = 1
    while tiles * split < programs and k // (2 * split) >= 4 * block_k and 2 * split <= most:
        split *= 2
    return split


def kernel_config(m: int, n: int, k: int, sm_count: int = 132) -> KernelConfig:
    """The configuration of an (m, k) x (n, k) product on a GPU of ``sm_count`` SMs.  Starting
    points chosen from the arithmetic below, not yet timed on a GPU (``benchmarks/bench_int8.py
    --sweep`` times them against the alternatives and shows the best of each shape):

    * one row: the reduce kernel on tiles of 8 weight rows x 1,024 columns, 4 warps: 8 KB of
      int8 a step, 64 bytes (four 16-byte loads) a thread, 117 registers.  Its loads are not
      software-pipelined (Triton pipelines loads that feed tl.dot), so the bytes in flight are
      those the resident programs have asked for: the 8B's narrowest matrices (N = 4,096) make
      512 programs, ~4 per SM of an H100 (all resident), 32 KB in flight per SM, about what
      3.35 TB/s needs at ~1 us of latency under load (Little's law); 512 columns would halve it;
    * 2 to 64 rows: tl.dot with BLOCK_M the rows padded to a power of two from 16 and BLOCK_N =
      2 x BLOCK_M (32, 64, 128), so that the x tile a program reads (from L2: every program
      reads all of x) is at most the weight tile it streams from memory (2 * M / BLOCK_N bytes
      of x a weight byte); 128 columns a step, 4 pipeline stages (cp.async loads prefetched
      three steps ahead), 4 warps; Triton's own int8 -> bfloat16 cast (packed integer and
      half-precision operations, no integer-to-float instruction) for BLOCK_M = 16, where its
      compiled kernel has fewer instructions than the exponent trick's, the trick above;
    * K split (the second kernel adds the slices) until the grid holds 2 programs per SM for the
      reduce kernel, 1 for the dot (pipelined: one program keeps 3 steps of loads in flight),
      each slice at least 4 steps long, and into at most K / (16 * M) slices: the partial sums
      (written and read again, 8 bytes per row, column and slice) then cost at most half the
      weight's bytes.  One row is never split on the 8B's shapes; more rows split its narrower
      matrices (wqkv, wo, w2) in 2 to 8.
    """
    most = max(1, k // (16 * m))
    if m == 1:
        block_n, block_k = 8, 1024
        return KernelConfig("reduce", block_n, block_k,
                            split=split_for(math.ceil(n / block_n), k, block_k, 2 * sm_count, most))
    block_m = max(16, _pow2_at_least(m))
    block_n, block_k = 2 * block_m, 128
    return KernelConfig("dot", block_n, block_k, block_m=block_m, num_stages=4, fast_convert=block_m > 16,
                        split=split_for(math.ceil(n / block_n), k, block_k, sm_count, most))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # Triton's interpreter (tests): an H100's count, so splits happen as they would there


@functools.lru_cache(maxsize=None)
def _kernels() -> dict[str, Any]:
    """The Triton kernels, built on first use (Triton imported here, not at module import).
    Triton's interpreter (``TRITON_INTERPRET=1``) is chosen when they are built."""
    # Module globals once imported: the interpreter looks for triton.language among the
    # kernels' globals, and the kernels below find ``tl`` there.
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def int8_mm_reduce(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TO_PARTIAL: tl.constexpr,
                       FAST_CONVERT: tl.constexpr):
        # One row of x (M == 1): the weight tile times the row, summed over K at the end.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        rows = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        row_ok = rows < N - n0
        w_tile = w_ptr + n0.to(tl.int64) * stride_wn + rows[:, None] * stride_wn + cols[None, :]
        # k_per_split is a multiple of BLOCK_K (and so of 16, which Triton sees: it specialises
        # integer arguments on divisibility by 16), K too for the 8B's shapes: the masks are then
        # constant over 16 columns and the loads vectorised.  The last slice may run a few
        # iterations past K, masked whole.
        k_start = pid_k * k_per_split
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(k_start, k_start + k_per_split, BLOCK_K):
            k_ok = k + cols < K
            w = tl.load(w_tile + k, mask=row_ok[:, None] & k_ok[None, :], other=0)
            xk = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            if FAST_CONVERT:
                # int8 -> float32 exactly without the integer-to-float instruction: 0x4B400000 is
                # 1.5 * 2**23, whose float has unit spacing; the int8 added to its bits gives the
                # float 1.5 * 2**23 + w
                wf = (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            else:
                wf = w.to(tl.float32)
            acc += wf * xk[None, :]
        total = tl.sum(acc, axis=1)  # (BLOCK_N,)
        if TO_PARTIAL:
            tl.store(out_ptr + pid_k * N + n0 + rows, total, mask=row_ok)
        else:
            scale = tl.load(scale_ptr + n0 + rows, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + n0 + rows, (total * scale).to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit(do_not_specialize=["M"])
    def int8_mm_dot(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    TO_PARTIAL: tl.constexpr, FAST_CONVERT: tl.constexpr, INTERPRETED: tl.constexpr):
        # outᵀ tile (BLOCK_N, BLOCK_M) = weight tile (BLOCK_N, BLOCK_K) @ x tileᵀ (BLOCK_K, BLOCK_M)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        rows = tl.arange(0, BLOCK_N)
        ms = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_K)
        row_ok = rows < N - n0
        m_ok = ms < M
        w_tile = w_ptr + n0.to(tl.int64) * stride_wn + rows[:, None] * stride_wn + cols[None, :]
        x_tile = x_ptr + ms[None, :] * stride_xm + cols[:, None]  # (BLOCK_K, BLOCK_M): x transposed
        k_start = pid_k * k_per_split  # as in int8_mm_reduce
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_start, k_start + k_per_split, BLOCK_K):
            k_ok = k + cols < K
            w = tl.load(w_tile + k, mask=row_ok[:, None] & k_ok[None, :], other=0)
            xt = tl.load(x_tile + k, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            if FAST_CONVERT:  # as in int8_mm_reduce
                w = (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            if INTERPRETED:
                # Triton's interpreter keeps bfloat16 as its uint16 bits, multiplies those in
                # tl.dot and casts integers to bfloat16 wrongly; in float32 the products are the
                # same exact values
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
            else:
                acc = tl.dot(w.to(xt.dtype), xt, acc)  # int8 values are exact in bfloat16 and float16
        if TO_PARTIAL:
            at = out_ptr + pid_k * M * N + ms[None, :] * N + n0 + rows[:, None]
            tl.store(at, acc, mask=row_ok[:, None] & m_ok[None, :])
        else:
            scale = tl.load(scale_ptr + n0 + rows, mask=row_ok, other=0.0).to(tl.float32)
            at = out_ptr + ms[None, :] * N + n0 + rows[:, None]
            tl.store(at, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def add_splits(partial_ptr, scale_ptr, out_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        # out (M, N) = sum over the splits of partial (SPLIT, M, N), in order, times the scale
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(partial_ptr + s * M * N + offs, mask=ok, other=0.0)
        scale = tl.load(scale_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)

    return {"reduce": int8_mm_reduce, "dot": int8_mm_dot, "add_splits": add_splits}


def check_operands(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless ``x`` (M, K) bfloat16/float16, ``weight`` (N, K) int8 with unit stride
    along K, ``scale`` (N,) in x's dtype or float32, all on one device."""
    if x.dim() != 2 or weight.dim() != 2 or scale.dim() != 1:
        raise ValueError(f"int8_weight_mm takes x (M, K), weight (N, K) and scale (N,), got shapes "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(scale.shape)}: "
                         "flatten x's leading dimensions")
    if x.shape[1] != weight.shape[1] or scale.shape[0] != weight.shape[0]:
        raise ValueError(f"int8_weight_mm: x {tuple(x.shape)}, weight {tuple(weight.shape)} and scale "
                         f"{tuple(scale.shape)} do not match: x (M, K) needs weight (N, K) and scale (N,)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int8_weight_mm multiplies bfloat16 or float16 activations, got {x.dtype}: convert x first")
    if weight.dtype != torch.int8 or scale.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"int8_weight_mm needs an int8 weight and a scale in {x.dtype} or float32, got "
                         f"{weight.dtype} and {scale.dtype}")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError("int8_weight_mm needs a row-major weight (unit stride along K): pass weight.contiguous() "
                         "once, when the model is loaded")
    if not (x.device == weight.device == scale.device):
        raise ValueError(f"int8_weight_mm: x, weight and scale are on {x.device}, {weight.device}, {scale.device}: "
                         "move them to one device")


def partial_sums(split: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The float32 buffer (split, m, n) of a product whose K is split: every element is written
    by the first kernel before the second reads it."""
    return torch.empty(split, m, n, dtype=torch.float32, device=device)


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: Optional[KernelConfig] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The product on ``x``'s device with ``config`` (default: :func:`kernel_config`'s), into
    ``out`` (M, N) contiguous in x's dtype if given; the op's implementation.  Tests and
    benchmarks pass other configurations."""
    check_operands(x, weight, scale)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({m}, {n}) {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()  # a few rows: a cheap copy that lets the kernel load x in vectors
    scale = scale.contiguous()
    config = config or kernel_config(m, n, k, _sm_count(x.device))
    if config.kind not in ("reduce", "dot"):
        raise ValueError(f"KernelConfig.kind is 'reduce' or 'dot', got {config.kind!r}")
    if config.kind == "reduce" and m != 1:
        raise ValueError(f"the reduce kernel multiplies one row, got {m}")
    if config.kind == "dot" and config.block_m < m:
        raise ValueError(f"block_m={config.block_m} holds fewer than the {m} rows")
    kernels = _kernels()
    k_per_split = math.ceil(math.ceil(k / config.split) / config.block_k) * config.block_k
    split = math.ceil(k / k_per_split)  # the slices that hold any of K
    target = out if split == 1 else partial_sums(split, m, n, x.device)
    grid = (math.ceil(n / config.block_n), split)
    common = dict(TO_PARTIAL=split > 1, FAST_CONVERT=config.fast_convert, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    if config.kind == "reduce":
        kernels["reduce"][grid](x, weight, scale, target, m, n, k, x.stride(0), weight.stride(0), k_per_split,
                                BLOCK_N=config.block_n, BLOCK_K=config.block_k, **common)
    else:
        kernels["dot"][grid](x, weight, scale, target, m, n, k, x.stride(0), weight.stride(0), k_per_split,
                             BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                             INTERPRETED=x.device.type == "cpu", **common)
    if split > 1:
        block = 1024
        kernels["add_splits"][(math.ceil(m * n / block),)](target, scale, out, m, n, SPLIT=split, BLOCK=block,
                                                            num_warps=4)
    return out


@torch.library.custom_op("llama::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` for x (M, K) bfloat16/float16, weight (N, K) int8,
    scale (N,) in x's dtype or float32: (M, N) in x's dtype, by the Triton kernels (on CUDA,
    or on CPU tensors under Triton's interpreter).  Meant for M up to :data:`MAX_ROWS`."""
    return launch(x, weight, scale)


@int8_weight_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    check_operands(x, weight, scale)
    return x.new_empty(x.shape[0], weight.shape[0])


# Whether Triton is installed, found without importing it (CPU processes never import it).
TRITON_FOUND = importlib.util.find_spec("triton") is not None
# Triton's interpreter, which runs Triton kernels on CPU tensors (tests): Triton decides on it
# once, when imported, and so does this module.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether :func:`int8_weight_mm` runs on ``device``: CUDA where Triton is installed, CPU
    tensors only under Triton's interpreter, and the meta device (shapes only, through the
    fake implementation).  Reads only constants: torch.compile traces it for free."""
    if device.type == "meta":
        return True
    if device.type == "cuda":
        return TRITON_FOUND
    return device.type == "cpu" and INTERPRETED and TRITON_FOUND


# Llama 3 8B's int8 products (N, K), with the fused projections the model multiplies as one.
LLAMA_8B_SHAPES = {
    "wqkv": (6144, 4096),
    "wo": (4096, 4096),
    "w13": (28672, 4096),
    "w2": (4096, 14336),
    "output": (128256, 4096),
}
