"""One kernel policy per model: which products and weight layouts it uses, decided once
(:meth:`KernelPolicy.decide`, called by :class:`llama.Llama`) from the device, the dtype,
whether steps are compiled, the ``cpu_packing`` asked for and what the CPU offers
(:class:`~llama.layers.cpu.CpuFeatures`), then handed to every layer that multiplies
(:func:`llama.layers.prepare.prepare_model_`).  Nothing else steers the kernels: tests build
the policies they need.  The measurements behind each choice are in BENCHMARKS.md.
Whether steps are compiled at all, where the caller does not say, is decided here too
(:func:`compile_by_default`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from llama.layers import triton_int8
from llama.layers.cpu import CpuFeatures
from llama.runtime import host
from llama.runtime.options import PACKING_KINDS

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelPolicy:
    """How a model's products run.  The default (``KernelPolicy()``) is torch's plain product
    everywhere, right on any device; :meth:`decide` picks the faster ones."""

    # The kernel bfloat16/float16 linear weights on the CPU are packed for ("onednn",
    # "fbgemm"; llama.layers.packing), or None: torch's own product.
    packing: Optional[str] = None
    # float32 weights on the CPU stored column-major: MKL's matrix-vector products stream
    # them faster (most for tall matrices such as the vocabulary projection).
    column_major: bool = False
    # One-row products on the CPU under torch.compile written as multiply-and-sum, which
    # Inductor fuses into one vectorised reduction reading the weight once (faster than MKL's
    # one-row product where MKL does not take its fast paths: AVX2, AMD).
    one_row_as_reduction: bool = False
    # Eager float32 products of up to ``split_up_to_rows`` rows with a column-major weight
    # split by output columns over torch's threads (where MKL runs them on one thread).
    split_few_rows: bool = False
    # bfloat16/float16 CPU products of ``convert_from_rows`` rows or more through weight
    # blocks converted to float32 (where the CPU has no native bfloat16 products, torch's
    # kernel converts the weight again for every row).
    low_precision_by_blocks: bool = False
    # int8 CPU products of ``int8_convert_from_rows`` rows or more go through weight blocks
    # converted to this dtype: bfloat16 where the CPU multiplies it natively, else float32.
    int8_block_dtype: torch.dtype = torch.float32
    # fbgemm's single-threaded half-precision entry point, for matrices of up to
    # ``fp16_one_thread_up_to`` values in a process running torch on one thread (it skips
    # the threaded entry point's fixed cost per call, which small matrices feel).
    fp16_one_thread: bool = False
    # quantize="w8a8": whether fbgemm's int8 product needs 7-bit input codes here (None:
    # this build has no int8 product).
    int8_activation_reduce_range: Optional[bool] = None
    # int8 and int4 CPU products through our own kernels (llama.layers.cpu_kernels), with the
    # CPU's integer dot products: "avx512_vnni" or "avx2" (the path they take), or None:
    # torch's kernels.  int8 products of fewer than ``int8_convert_from_rows`` rows (decoding
    # steps and batches) take them; int4 products of any number of rows (prompts too: 0.7x
    # torch's int4 kernel's time at 256 rows), from the kernel's layout, which replaces torch's
    # packing (one copy of the weights).  They need a C++ compiler: prepare_model_ builds
    # them (once, cached) and keeps torch's kernels where the build fails.
    cpu_qkernel: Optional[str] = None
    # int8 CPU products of any number of rows (prompts too) through our kernel, not only those
    # of fewer than ``int8_convert_from_rows``: where the kernel is AVX-512 VNNI's and the CPU
    # has no AMX (on Cascade Lake, 256 rows of the 150m's matrices took 0.48x the time of
    # torch's converted blocks; the AVX2 path took 1.5x, and AMX multiplies the converted
    # bfloat16 blocks itself: both keep the blocks).
    int8_qkernel_for_prompts: bool = False
    # Attention of the masked path (decoding and verification: a few query rows over the KV
    # cache) on the CPU under torch.compile written as multiply-and-sum (scores, softmax,
    # weighted sum), which Inductor fuses into vectorised reductions, instead of torch's CPU
    # flash-attention kernel, which is built for many query rows (llama.layers.attention).
    attention_as_reduction: bool = False
    # Under attention_as_reduction, the weighted sum of the values as a matrix product (torch.matmul,
    # the gathered values copied out first) rather than a fused multiply-and-sum: where Inductor
    # writes 256-bit code (AVX2) it vectorised that sum over the cached positions and gathered
    # each vector element by element through the block table (benchmarks/bench_attention.py,
    # the 150m's heads, 8 layers, 1 thread, AMD Zen 4 under ATEN_CPU_CAPABILITY=avx2: 158 -> 106
    # us at 64 positions, 540 -> 219 at 256); at 512 bits the fused sum reads the values in rows
    # and is the faster (60 against 102 us, 114 against 191).
    attention_values_by_matmul: bool = False

    convert_from_rows: int = 8
    split_up_to_rows: int = 8
    int8_convert_from_rows: int = 32  # torch's int8 kernel handles a few rows well, not a prompt
    # int8 products off the CPU (CUDA) of up to this many rows, eager and compiled, through the
    # Triton kernels of llama.layers.triton_int8, which read the int8 weight once for all the
    # rows (N*K bytes); more rows (prompts) convert the weight to the activations' dtype for
    # cuBLAS (5*N*K bytes: read int8, write and read bfloat16), which a prompt's many rows
    # amortise.  64 (triton_int8.MAX_ROWS, whose comment says why): the engine's usual batches
    # stay on the kernels.
    int8_direct_up_to_rows: int = triton_int8.MAX_ROWS
    converted_block_bytes: int = 4 << 20  # one converted block stays in the last-level cache
    fp16_one_thread_up_to: int = 1 << 21

    @staticmethod
    def decide(device: torch.device, dtype: torch.dtype, *, compile: bool = False, cpu_packing: Optional[str] = None,
               quantize: Optional[str] = None, cpu: Optional[CpuFeatures] = None) -> "KernelPolicy":
        """The policy of a model on ``device`` in ``dtype``: on a GPU torch's products; on the
        CPU the kernels this CPU (``cpu``, default: probed) runs fastest.  ``cpu_packing``
        chooses the packing of bfloat16/float16 weights instead of the fastest-decoding one;
        a kind this CPU cannot run, or asked of another dtype or device, is refused
        (ValueError), and so is one asked of a ``quantize``d model (its int8/int4 layers keep
        their own kernels)."""
        check_packing_kind(cpu_packing)
        if device.type != "cpu" or dtype not in LOW_PRECISION:
            if cpu_packing is not None:
                raise ValueError(f"cpu_packing={cpu_packing!r} applies to bfloat16 and float16 models on the CPU, "
                                 f"not to a {dtype} model on {device.type}: leave cpu_packing unset")
        if cpu_packing is not None and quantize is not None:
            raise ValueError(f"cpu_packing={cpu_packing!r} found no bfloat16/float16 linear weight to pack: "
                             f"quantize={quantize!r} layers keep their own kernels; leave cpu_packing unset")
        if device.type != "cpu":
            return KernelPolicy()
        cpu = CpuFeatures.probe() if cpu is None else cpu
        mkl_fast = cpu.mkl_one_row_products_are_fast
        packing = None
        if dtype in LOW_PRECISION and quantize is None:  # a quantised model has no such weight to pack
            if cpu_packing is not None and not kind_runs(cpu_packing, dtype, cpu):
                raise ValueError(_cannot_run(cpu_packing, dtype))
            packing = cpu_packing or fastest_packing(dtype, cpu)
        return KernelPolicy(
            packing=packing,
            column_major=dtype == torch.float32 and (not compile or mkl_fast),
            one_row_as_reduction=not mkl_fast,
            split_few_rows=not mkl_fast,
            low_precision_by_blocks=not cpu.native_bf16,
            int8_block_dtype=torch.bfloat16 if cpu.native_bf16 else torch.float32,
            fp16_one_thread=cpu.fbgemm_fp16_one_thread,
            int8_activation_reduce_range=cpu.int8_activation_reduce_range,
            cpu_qkernel=cpu.int8_dot,
            int8_qkernel_for_prompts=cpu.int8_dot == "avx512_vnni" and not cpu.amx_bf16,
            attention_as_reduction=True,
            attention_values_by_matmul=cpu.capability == "AVX2",
        )


# What the CPU's compiled decoding step (torch.compile) beat the eager one at, wherever it
# was measured (BENCHMARKS.md, compile=True against eager, batch 1, 1 and 2 threads):
# bfloat16 on AMD Zen 3, AMD Zen 4 and an AMX Xeon; int8 on Zen 3 and the Xeon; w8a8 and
# int4 on the Xeon.  Not float32 (slower on Zen 3 at 1 thread: 0.90 against 1.05 of
# llama.cpp's speed) nor float16 (not measured).
COMPILE_PAYS_ON_CPU = ("bfloat16", "int8", "w8a8", "int4")


def compile_by_default(device: torch.device, dtype: torch.dtype, quantize: Optional[str] = None, *,
                       environ: Mapping[str, str] = os.environ, compiler: Optional[str] = "probe") -> bool:
    """Whether decoding steps are compiled when the caller leaves ``compile`` unset:
    ``LLAMA_COMPILE=1`` or ``0`` decides where it is set; otherwise yes on a GPU, and on the
    CPU where a C++ compiler is found (``compiler``; default: looked for) for a model whose
    precision (``quantize``, else ``dtype``) is in :data:`COMPILE_PAYS_ON_CPU`.  Compiling
    costs time at the first start (Inductor's cache, kept on disk, shortens later ones)."""
    forced = environ.get("LLAMA_COMPILE", "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"LLAMA_COMPILE={forced!r}: set it to 1 (compile decoding steps) or 0 (do not), "
                             "or leave it unset")
        return forced == "1"
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    precision = quantize or str(dtype).removeprefix("torch.")
    if precision not in COMPILE_PAYS_ON_CPU:
        return False
    return (host.cpp_compiler() if compiler == "probe" else compiler) is not None


def fastest_packing(dtype: torch.dtype, cpu: CpuFeatures) -> Optional[str]:
    """The packing that decodes ``dtype`` weights fastest on ``cpu``: ``"onednn"`` for
    bfloat16 where the CPU has AMX, else ``"fbgemm"`` for bfloat16 and float16 where torch
    has fbgemm, else None (torch's own kernels).  Measured on three CPUs (BENCHMARKS.md):
    with AMX, oneDNN is as fast for one row and much faster for many; with AVX-512 BF16
    and no AMX, fbgemm's one-row products are faster than oneDNN's and its many-row ones
    slower (decoding chosen over prompts); on AVX2 fbgemm wins both.  float16 stays with
    fbgemm: without AMX-FP16, oneDNN's one-row float16 product was slower."""
    if dtype == torch.bfloat16 and cpu.native_bf16 and cpu.amx_bf16 and cpu.onednn_bf16:
        return "onednn"
    if dtype in LOW_PRECISION and cpu.fbgemm_fp16:
        return "fbgemm"
    return None


def kind_runs(kind: str, dtype: torch.dtype, cpu: CpuFeatures) -> bool:
    """Whether this torch build and CPU run the packed product ``kind`` names for ``dtype``."""
    if kind == "onednn":
        return cpu.onednn_bf16 if dtype == torch.bfloat16 else cpu.onednn_fp16
    return cpu.fbgemm_fp16


def check_packing_kind(kind: Optional[str]) -> Optional[str]:
    """``kind`` if it is None or one of :data:`~llama.runtime.options.PACKING_KINDS`, else a ValueError."""
    if kind is not None and kind not in PACKING_KINDS:
        raise ValueError(f"packing kind must be None or one of {PACKING_KINDS}, got {kind!r}")
    return kind


def _cannot_run(kind: str, dtype: torch.dtype) -> str:
    if kind == "onednn":
        return (f"oneDNN's packed {dtype} product does not run here (torch needs AVX-512 for it): "
                "use cpu_packing='fbgemm' or leave it unset")
    return "this torch build has no fbgemm half-precision product (x86 builds have it): " \
           "use cpu_packing='onednn' or leave it unset"
