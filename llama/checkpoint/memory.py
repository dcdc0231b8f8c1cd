"""Will the model fit?  This rank's weights, KV cache and the activations of the
largest prefill, against the memory its device has free, checked before loading.

The activation estimate (:func:`prefill_activation_bytes`) counts the tensors alive
at the peak of one transformer layer for a forward pass of ``batch`` rows of
``tokens_per_step`` tokens each; layers run one after another, so one layer's peak
(plus the residual stream and the logits) is the forward pass's peak.  A test measures
the real peak on a small model and checks that this bounds it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from llama.runtime import distributed

from llama.runtime import host
from llama.checkpoint.params import ModelArgs
from llama.layers.kv_cache import kv_cache_bytes

logger = logging.getLogger(__name__)

__all__ = ["MemoryNeed", "check_memory", "memory_need", "prefill_activation_bytes"]

GIB = 2**30
# Memory an allocator holds beyond the live tensors (freed blocks not yet reused or
# returned): measured peaks on CPU vary by up to ~20% from run to run.
ALLOCATOR_SLACK = 1.25


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def prefill_activation_bytes(
    args: ModelArgs,
    batch: int,
    tokens_per_step: int,
    dtype: torch.dtype,
    world_size: int = 1,
    kv_len: Optional[int] = None,
    masked: bool = True,
) -> int:
    """Peak bytes of activations on one rank for one forward pass of ``batch`` rows of
    ``tokens_per_step`` tokens each, attending to ``kv_len`` cache slots (default
    ``tokens_per_step``), with logits for the last position of each row.

    ``masked``: attention through an explicit mask (a prefill that is not a whole new
    context from position 0, e.g. a chunk after cached tokens) on CPU, whose SDPA then
    may materialise float32 scores (batch, local heads, tokens, kv_len): measured, one
    such matrix at a time.  Causal attention without a mask, and CUDA's
    memory-efficient kernels with one, keep no such matrix.
    """
    s = _itemsize(dtype)
    f32 = 4
    n = batch * tokens_per_step  # tokens in the pass
    kv_len = tokens_per_step if kv_len is None else kv_len
    heads = max(args.n_heads // world_size, 1)
    kv_heads = max(args.n_kv_heads // world_size, 1)
    hd = args.head_dim
    hidden = args.ffn_hidden_dim // world_size
    dim = args.dim

    # Alive through every layer: the residual stream in and out, and the sum being
    # formed; the gathered RoPE rotations (complex64); the mask (bool).
    stream = 3 * n * dim * s + n * (hd // 2) * 8 + (batch * tokens_per_step * kv_len if masked else 0)
    norm = n * dim * (f32 + s)  # RMSNorm's float32 copy, and its output
    attention = (
        norm
        + n * (heads + 2 * kv_heads) * hd * s  # q, k, v
        + 2 * n * (heads + kv_heads) * hd * f32  # RoPE in float32 (real view, complex product)
        + n * (heads + kv_heads) * hd * s  # rotated q, k
        + 2 * n * heads * hd * s  # queries laid out for SDPA, and its output
        + 2 * n * heads * hd * s  # K/V repeated per query head (grouped-query attention, some kernels)
        + n * heads * hd * s  # the output laid out for wo
        + (batch * heads * tokens_per_step * kv_len * f32 if masked else 0)  # float32 scores
        + n * dim * s  # wo's output
    )
    # SwiGLU: w1's output, silu of it, w3's output, their product, then w2's output.
    # Measured peaks are near 4.2 hidden-wide tensors (the allocator does not reuse
    # each freed one at once); 5 keeps the estimate a bound.
    feed_forward = norm + 5 * n * hidden * s + n * dim * s
    logits = batch * args.vocab_size * (s + f32)  # output layer (gathered), then float32
    return int(ALLOCATOR_SLACK * (stream + max(attention, feed_forward) + logits))


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one rank needs, by cause."""

    weights: int
    kv_cache: int  # KV cache and RoPE table: grow with max_batch_size x max_seq_len
    activations: int  # the largest prefill's peak

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def memory_need(
    model: nn.Module,
    dtype: torch.dtype,
    prefill_batch: Optional[int] = None,
    prefill_tokens: Optional[int] = None,
    world_size: Optional[int] = None,
    prefill_masked: bool = False,
) -> MemoryNeed:
    """This rank's need for ``model`` (built on the meta device, or real) in ``dtype``.

    The largest prefill defaults to every KV-cache row filled in one pass from position
    0 (``max_batch_size`` rows of ``max_seq_len`` tokens, causal attention); an engine
    that prefills at most ``prefill_tokens`` tokens per row per step, or
    ``prefill_batch`` rows, passes those, and ``prefill_masked=True`` if those chunks
    attend through a mask on CPU (see :func:`prefill_activation_bytes`).
    """
    params: ModelArgs = model.params
    itemsize = _itemsize(dtype)
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    attention = model.layers[0].attention  # this rank's K/V heads
    cache = kv_cache_bytes(len(model.layers), params.max_batch_size, params.max_seq_len,
                           attention.n_local_kv_heads, attention.head_dim, dtype)  # the engine's cache
    cache += model.freqs_cis.numel() * model.freqs_cis.element_size()  # grows with max_seq_len too
    batch = params.max_batch_size if prefill_batch is None else prefill_batch
    tokens = params.max_seq_len if prefill_tokens is None else prefill_tokens
    world_size = distributed.planned_world_size() if world_size is None else world_size
    activations = prefill_activation_bytes(
        params, batch, tokens, dtype, world_size, kv_len=params.max_seq_len, masked=prefill_masked
    )
    return MemoryNeed(weights, cache, activations)


def check_memory(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    *,
    prefill_batch: Optional[int] = None,
    prefill_tokens: Optional[int] = None,
    prefill_masked: bool = False,
    available: Optional[int] = None,
) -> MemoryNeed:
    """Refuse (``RuntimeError``) to start loading what cannot fit on ``device``; the
    message gives the need by cause and only the advice that addresses the cause.

    ``available`` overrides :func:`llama.runtime.host.available_memory` (tests).  See
    :func:`memory_need` for the prefill arguments.  Returns the need.
    """
    need = memory_need(
        model, dtype, prefill_batch, prefill_tokens, prefill_masked=prefill_masked and device.type == "cpu"
    )
    if available is None:
        available = host.available_memory(device)
    logger.debug("memory per rank: weights %.2f GiB + KV cache %.2f GiB + activations %.2f GiB",
                 need.weights / GIB, need.kv_cache / GIB, need.activations / GIB)
    if available is None or need.total <= available:
        return need
    params: ModelArgs = model.params
    raise RuntimeError(
        f"not enough memory on {device}: this rank needs {need.total / GIB:.2f} GiB (weights "
        f"{need.weights / GIB:.2f} GiB + KV cache and RoPE table {need.kv_cache / GIB:.2f} GiB for max_batch_size="
        f"{params.max_batch_size} x max_seq_len={params.max_seq_len} + activations of the largest prefill "
        f"{need.activations / GIB:.2f} GiB) but {available / GIB:.2f} GiB is available. "
        + _advice(need, available, dtype)
    )


def _advice(need: MemoryNeed, available: int, dtype: torch.dtype) -> str:
    """What would help, by cause: only the weights' share shrinks with more processes or
    a smaller dtype alone; the KV cache and activations shrink with the batch and length."""
    tips = []
    if need.weights > available:
        tips.append(
            "The weights alone do not fit, whatever the batch size or sequence length: run more processes "
            "(torchrun --nproc_per_node, on more GPUs or machines)"
            + (", use a smaller dtype (bfloat16)" if _itemsize(dtype) > 2 else "")
            + " or int8 weights (quantize='int8')."
        )
    else:
        if need.kv_cache + need.activations > need.weights or need.weights + need.kv_cache > available:
            tips.append("Lower max_batch_size or max_seq_len (the KV cache and the largest prefill grow with both).")
        tips.append(
            "Or run more processes (torchrun --nproc_per_node)"
            + (", or use a smaller dtype (bfloat16)" if _itemsize(dtype) > 2 else "")
            + "."
        )
    return " ".join(tips)
