"""The products ``x @ W.T`` a linear layer computes, by the kind of weight it holds (dense,
int8, int4) and the kernel policy (:mod:`llama.layers.policy`).  Pure functions: the
layers that call them are in :mod:`llama.layers.parallel` and :mod:`llama.layers.quantized`.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F

from llama.layers import cpu_kernels, triton_int8
from llama.layers.policy import KernelPolicy


def dense_product(x: torch.Tensor, weight: torch.Tensor, policy: KernelPolicy) -> torch.Tensor:
    """``x @ weight.T``, by the kernel that is fastest for the shape on the CPU (the
    measurements are in BENCHMARKS.md, "CPU kernel findings"):

    * one row under torch.compile with ``policy.one_row_as_reduction``: multiply-and-sum,
      which Inductor fuses into one vectorised reduction reading the weight once (and the
      ops around it fuse too);
    * bfloat16/float16 with ``convert_from_rows`` rows or more (prefill, batches) and
      ``low_precision_by_blocks``: :func:`linear_by_blocks`.  Torch's own kernel converts the
      weight again for every row, so 256 rows cost 256 one-row products; converted once per
      block they cost a few times less;
    * float32 with a column-major weight, up to ``split_up_to_rows`` rows and two or more
      threads, with ``split_few_rows``: :func:`linear_split_over_threads` (MKL runs such a
      product on one thread on AVX2 and AMD CPUs; split, it uses them all);
    * otherwise ``F.linear``.
    """
    if x.device.type != "cpu":
        return F.linear(x, weight)
    rows = x.shape[:-1].numel()
    if torch.compiler.is_compiling():
        if rows == 1 and policy.one_row_as_reduction:
            return (x.float().unsqueeze(-2) * weight.float()).sum(-1).to(x.dtype)
        return F.linear(x, weight)
    if weight.dtype in (torch.bfloat16, torch.float16):
        if rows >= policy.convert_from_rows and policy.low_precision_by_blocks:
            return linear_by_blocks(x, weight, block_bytes=policy.converted_block_bytes)
    elif weight.dtype == torch.float32 and rows <= policy.split_up_to_rows and weight.stride(0) == 1 \
            and policy.split_few_rows:
        parts = torch.get_num_threads()
        if parts > 1 and weight.shape[0] % parts == 0 and weight.shape[0] >= 64 * parts:
            return linear_split_over_threads(x, weight, parts)
    return F.linear(x, weight)


_scratch = threading.local()


def _scratch_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` buffer of at least ``numel`` elements, reused by this thread."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def linear_by_blocks(x: torch.Tensor, weight: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                     block_bytes: int = 4 << 20, block_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ weight.T`` (times ``row_scale`` per output column, for int8 weights) for a
    low-precision (out, in) weight on the CPU: blocks of weight rows are converted to
    ``block_dtype`` into one reused buffer (about ``block_bytes``, so it stays in cache)
    and multiplied by a product made for many rows: MKL's for float32, oneDNN's for
    bfloat16 (AMX or AVX-512 BF16; ``x`` is then rounded to bfloat16, and each block's
    product to bfloat16 before the scale).  Accumulation is in float32 as in torch's own
    kernels; the result is rounded to ``x.dtype`` at the end."""
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features).to(block_dtype)
    out = torch.empty(flat.shape[0], out_features, dtype=block_dtype, device=x.device)
    block_rows = max(1, min(out_features, block_bytes // (block_dtype.itemsize * in_features)))
    scratch = _scratch_buffer(block_rows * in_features, block_dtype)
    for start in range(0, out_features, block_rows):
        end = min(out_features, start + block_rows)
        block = scratch[: (end - start) * in_features].view(end - start, in_features)
        block.copy_(weight[start:end])
        out[:, start:end] = flat @ block.t()
    if row_scale is not None:
        out = out.float() * row_scale.float()
    return out.to(x.dtype).view(*x.shape[:-1], out_features)


def linear_split_over_threads(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``x @ weight.T`` for a column-major float32 (out, in) weight, as ``parts`` products
    of one batched call, each over a slice of the output columns (a strided view of the
    same weight: nothing is copied)."""
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features)
    by_part = weight.t().view(in_features, parts, out_features // parts).transpose(0, 1)  # (parts, in, out/parts)
    out = torch.bmm(flat.expand(parts, *flat.shape), by_part)  # (parts, rows, out/parts)
    return out.transpose(0, 1).reshape(*x.shape[:-1], out_features)


def int8_product(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor,
                 policy: Optional[KernelPolicy] = None) -> torch.Tensor:
    """``x @ (weight_int8 * scale[:, None]).T`` with PyTorch's own kernels.

    On CPU, with ``policy.cpu_qkernel``, products of fewer than ``policy.int8_convert_from_rows``
    rows (of any number with ``policy.int8_qkernel_for_prompts``) go through our kernel
    (:func:`llama.layers.cpu_kernels.q8_linear`: activations quantised to int8 in blocks of
    32, integer dot products), where the width is a multiple of 32 and the kernel is built.
    Otherwise
    ``torch._weight_int8pack_mm`` multiplies bfloat16 activations by the int8
    weight directly (the weight is never expanded); from ``policy.int8_convert_from_rows``
    rows (prefill) the weight goes through converted blocks instead (see
    :func:`linear_by_blocks`), in ``policy.int8_block_dtype``: bfloat16 blocks through
    oneDNN where the CPU multiplies bfloat16 natively (faster than float32 blocks there),
    float32 blocks through MKL elsewhere.  Off the CPU (CUDA) see :func:`int8_product_off_cpu`.
    """
    policy = policy or KernelPolicy()
    if x.device.type == "cpu":
        rows = x.shape[:-1].numel()
        if policy.cpu_qkernel is not None \
                and (rows < policy.int8_convert_from_rows or policy.int8_qkernel_for_prompts) \
                and weight_int8.shape[-1] % cpu_kernels.BLOCK == 0 and cpu_kernels.ready():
            return cpu_kernels.q8_linear(x, weight_int8, scale, policy.cpu_qkernel)
        if rows >= policy.int8_convert_from_rows and not torch.compiler.is_compiling():
            # Prefill and batches: the kernel below handles each row as its own product.
            return linear_by_blocks(x, weight_int8, row_scale=scale, block_bytes=policy.converted_block_bytes,
                                    block_dtype=policy.int8_block_dtype)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, weight_int8, scale)
        return out.to(x.dtype).view(*x.shape[:-1], -1)
    return int8_product_off_cpu(x, weight_int8, scale, policy)


def int8_product_off_cpu(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor,
                         policy: KernelPolicy) -> torch.Tensor:
    """``x @ (weight_int8 * scale[:, None]).T`` on a GPU, without a full-precision copy of the
    weight for decoding steps and batches:

    * up to ``policy.int8_direct_up_to_rows`` rows of bfloat16/float16, eager or compiled:
      :func:`llama.layers.triton_int8.int8_weight_mm` (the custom op
      ``torch.ops.llama.int8_weight_mm``, opaque to torch.compile), Triton kernels that read
      each int8 weight byte once and sum in float32 for all the rows at once;
    * more rows (prompts): the weight cast to ``x.dtype`` for torch's tensor-core product, a
      copy the many rows amortise, then the scale.

    Where the Triton kernels cannot run (no Triton installed; CPU tensors outside Triton's
    interpreter: see :func:`~llama.layers.triton_int8.runs_on`), and for float32 activations,
    every row count takes the second way.
    """
    rows = x.shape[:-1].numel()
    if rows <= policy.int8_direct_up_to_rows and triton_int8.runs_on(x.device) \
            and x.dtype in (torch.bfloat16, torch.float16):
        out = triton_int8.int8_weight_mm(x.reshape(-1, x.shape[-1]), weight_int8, scale)
        return out.view(*x.shape[:-1], -1)
    return F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)


def int4_product(x: torch.Tensor, packed: Optional[torch.Tensor], scales_and_zeros: Optional[torch.Tensor],
                 group_size: int, kernel_rows: Optional[torch.Tensor] = None,
                 policy: Optional[KernelPolicy] = None) -> torch.Tensor:
    """``x @ W.T`` with W stored as 4-bit groups (see :func:`llama.layers.quantize.int4_matrix`),
    through torch's int4 kernels: the weight is never expanded.  Activations meet the
    weight in the scales' dtype (bfloat16), the result is rounded to ``x.dtype``.  Where the
    layer holds its matrix in our CPU kernel's layout (``kernel_rows``, made by
    :func:`llama.layers.prepare.use_cpu_int4_layout_` under ``policy.cpu_qkernel``, which
    drops torch's packing: ``packed`` and ``scales_and_zeros`` None), every product, of one
    row or many, goes through that kernel (:func:`llama.layers.cpu_kernels.q4_linear`)."""
    if kernel_rows is not None and x.device.type == "cpu":
        if policy is not None and policy.cpu_qkernel is not None and cpu_kernels.ready():
            return cpu_kernels.q4_linear(x, kernel_rows, x.shape[-1], policy.cpu_qkernel)
        if packed is None:
            raise RuntimeError("this int4 layer holds its matrix in llama's CPU kernel layout only, but its policy "
                               "does not use that kernel (or the kernel is not loaded): prepare the model with "
                               "llama.layers.prepare.prepare_model_ under the policy it was laid out for")
    if packed is None or scales_and_zeros is None:
        raise RuntimeError("this int4 layer holds no matrix torch's int4 kernel can read (it was laid out for "
                           "llama's CPU kernel): run it on the CPU under the policy it was prepared with")
    flat = x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype)
    if x.device.type == "cpu":
        out = torch._weight_int4pack_mm_for_cpu(flat, packed, group_size, scales_and_zeros)
    else:
        out = torch._weight_int4pack_mm(flat, packed, group_size, scales_and_zeros)
    return out.to(x.dtype).view(*x.shape[:-1], -1)
