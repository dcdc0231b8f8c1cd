"""What this CPU and this torch build offer the model's products: a :class:`CpuFeatures`
record, probed once per process (:func:`CpuFeatures.probe`) and read by the kernel policy
(:mod:`llama.layers.policy`).  Tests build records by hand instead of probing.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class CpuFeatures:
    """The facts the CPU kernel choices depend on."""

    vendor: str  # "intel", "amd" or "" (unknown): MKL picks its code paths by vendor
    capability: str  # the vector instructions torch's kernels use here: "AVX2", "AVX512", ...
    amx_bf16: bool  # AMX bfloat16 tiles: oneDNN's one-row products stream at memory speed
    native_bf16: bool  # oneDNN multiplies bfloat16 natively (AVX-512 BF16 or AMX)
    onednn_bf16: bool  # oneDNN's product on a packed bfloat16 weight runs here
    onednn_fp16: bool  # ... on a packed float16 weight
    fbgemm_fp16: bool  # fbgemm's half-precision packed product (x86 builds of torch)
    fbgemm_fp16_one_thread: bool  # and its single-threaded entry point
    # fbgemm's int8 x int8 product (quantize="w8a8"): None where this build has none, else
    # whether it needs 7-bit input codes here (reduce_range: AVX2 without VNNI).
    int8_activation_reduce_range: Optional[bool]
    # The integer dot product instructions our int8/int4 kernels (llama.layers.cpu_kernels)
    # can use here: "avx512_vnni" (AVX-512 F/BW/VL/DQ with VNNI), "avx2" (AVX2 and FMA), or
    # None (neither: not x86, or an older CPU).
    int8_dot: Optional[str] = None

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def probe() -> "CpuFeatures":
        """This process's CPU and torch build (cached)."""
        features = _torch_cpu_probe()
        return CpuFeatures(
            vendor=cpu_vendor(),
            capability=torch.backends.cpu.get_cpu_capability(),
            amx_bf16=bool(features.get("amx_bf16", True)) if features else True,
            native_bf16=_native_bf16(),
            onednn_bf16=_onednn_packing_runs(torch.bfloat16),
            onednn_fp16=_onednn_packing_runs(torch.float16),
            fbgemm_fp16=_fbgemm_fp16_runs(),
            fbgemm_fp16_one_thread=_fbgemm_fp16_one_thread_runs(),
            int8_activation_reduce_range=_int8_activation_reduce_range(),
            int8_dot=int8_dot_of(features, torch.backends.cpu.get_cpu_capability()),
        )

    @property
    def mkl_one_row_products_are_fast(self) -> bool:
        """Whether MKL's few-row float32 products run on all of torch's threads and stream the
        weight at memory speed by themselves.  On an Intel CPU where torch dispatches to
        AVX-512 kernels they do (there, splitting them over threads, or compiling them as
        multiply-and-sum, made decoding slower); on AMD CPUs, where MKL does not take its Intel
        code paths, they do not, with AVX-512 or AVX2 (measurements in BENCHMARKS.md)."""
        return self.capability == "AVX512" and self.vendor != "amd"


def _torch_cpu_probe() -> dict:
    """What torch's CPU probe (pytorch/cpuinfo) reports: instruction-set flags such as
    ``amx_bf16`` and ``avx512_bf16``, and ``cpu_name``; empty where this build has none."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError, TypeError):
        return {}


def int8_dot_of(features: dict, capability: str = "AVX512") -> Optional[str]:
    """The best integer dot product path torch's CPU probe ``features`` allow:
    ``"avx512_vnni"``, ``"avx2"`` or None -- and no wider than the vector instructions torch
    itself uses (``capability``, from ``torch.backends.cpu.get_cpu_capability()``): setting
    ``ATEN_CPU_CAPABILITY=avx2`` keeps our kernels on their AVX2 path too (to run as an
    AVX2-only CPU would, or where AVX-512 is unwelcome), and ``default`` keeps torch's kernels."""
    level = capability.upper()
    if level == "AVX512" and all(
            features.get(f) for f in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_vnni")):
        return "avx512_vnni"
    if level in ("AVX512", "AVX2") and features.get("avx2") and features.get("fma3"):
        return "avx2"
    return None


def cpu_vendor() -> str:
    """``"intel"``, ``"amd"`` or ``""`` (unknown): Linux's /proc/cpuinfo ``vendor_id``, else
    the CPU's name as torch's probe gives it."""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    return vendor_of(cpuinfo, str(_torch_cpu_probe().get("cpu_name", "")))


def vendor_of(cpuinfo: str, cpu_name: str) -> str:
    """The vendor named by /proc/cpuinfo's text (its first ``vendor_id`` line), else by the
    CPU's name: ``"intel"``, ``"amd"`` or ``""``."""
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id") and ":" in line:
            return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(line.split(":", 1)[1].strip(), "")
    name = cpu_name.lower()
    return "intel" if "intel" in name else "amd" if "amd" in name else ""


def _native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _onednn_packing_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's product on a packed ``dtype`` weight runs (torch refuses bfloat16 on
    CPUs without AVX-512)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none", [], "")
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _fbgemm_fp16_runs() -> bool:
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.zeros(8, 8), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.zeros(1, 8), packed)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _fbgemm_fp16_one_thread_runs() -> bool:
    """fbgemm's single-threaded half-precision product (deprecated by torch, so it may go)."""
    try:
        with warnings.catch_warnings():  # both warn once per process that they are deprecated
            warnings.simplefilter("ignore")
            packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.zeros(8, 8))
            torch.fbgemm_linear_fp16_weight_fp32_activation(torch.zeros(1, 8), packed, None)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _int8_activation_reduce_range() -> Optional[bool]:
    """None where this build has no fbgemm int8 product (not x86, or torch dropped its
    deprecated quantised tensors); else the ``reduce_range`` it needs here: False where 8-bit
    input codes give exact int32 sums (CPUs with VNNI accumulate code products in int32),
    True where they would not (AVX2 without VNNI sums pairs of products in 16 bits, which
    8-bit codes overflow: 255 * 127 * 2 > 32767).  Found by a product that overflows 16 bits
    if anything does: every input code 255, every weight 127."""
    try:
        with warnings.catch_warnings():  # quantised tensors are deprecated (torch 2.13)
            warnings.simplefilter("ignore")
            weight = torch.full((16, 64), 127, dtype=torch.int8)
            codes = torch._make_per_channel_quantized_tensor(
                weight, torch.ones(16, dtype=torch.double), torch.zeros(16, dtype=torch.long), 0)
            packed = torch.ops.quantized.linear_prepack(codes, None)
            out = torch.ops.quantized.linear_dynamic(torch.ones(1, 64), packed, False)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    exact = 64 * 127.0  # codes of the input 1.0 (scale 1/255) times 127, times the scales
    return not torch.allclose(out, torch.full_like(out, exact), rtol=1e-4)
