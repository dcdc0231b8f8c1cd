"""Will the model fit?  This rank's weights (as they will be stored: full precision, or
int8 / int4 / w8a8 as ``quantize`` says), KV cache and the activations of the largest
prefill, against the memory its device has free, checked before loading.

The activation estimate (:func:`prefill_activation_bytes`) counts the tensors alive
at the peak of one transformer layer for a forward pass of ``batch`` rows of
``tokens_per_step`` tokens each; layers run one after another, so one layer's peak
(plus the residual stream and the logits) is the forward pass's peak.  A test measures
the real peak on a small model and checks that this bounds it.  A model that sees (Llama 4
with its vision weights) also encodes images at prefill, before the text model runs: the
encoder's peak for the largest image a request may carry (:data:`MAX_IMAGE_TILES` tiles, the
most the engine encodes in one call) is counted the same way
(:func:`image_activation_bytes`), and the larger of the two peaks is the need.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch
from torch import nn

from llama.args import ModelArgs, VisionArgs
from llama.images.prompt import MAX_IMAGE_TILES
from llama.layers.kv_cache import kv_cache_bytes
from llama.layers.quantize import check_int4_group_size, quantized_weight_bytes
from llama.layers.tensor_parallel import valid_model_parallel_sizes
from llama.runtime import distributed, host
from llama.runtime.options import DEFAULT_INT4_GROUP_SIZE, DEFAULT_KV_BLOCK_SIZE, INT4_GROUP_SIZES

if TYPE_CHECKING:
    from llama.model import CrossAttentionTransformerBlock, Transformer, TransformerBlock

logger = logging.getLogger(__name__)

__all__ = ["MemoryNeed", "check_memory", "image_activation_bytes", "memory_need", "prefill_activation_bytes"]

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


def image_activation_bytes(vision: VisionArgs, text_dim: int, tiles: int, dtype: torch.dtype,
                           world_size: int = 1) -> int:
    """Peak bytes of activations on one rank for encoding ``tiles`` image tiles (one
    ``encode_images`` call: the ViT, the pixel shuffle and adapter, the projection to the text
    width ``text_dim``), the encoder's weights in ``dtype``.

    The ViT runs over ``tiles`` x (grid**2 + 1) tokens (the patches and the class token) of
    width ``dim``, its heads and MLP split over ``world_size`` ranks; like the text model, its
    blocks run one after another, so one block's peak (plus the input tiles and the residual
    stream) is the encoder's.  Its attention is bidirectional and unmasked: SDPA's fused
    kernels (CPU and CUDA) keep no score matrix.
    """
    s = _itemsize(dtype)
    f32 = 4
    size, patch, grid = vision.image_size, vision.patch_size, vision.grid
    n = tiles * (grid**2 + 1)  # tokens through the ViT
    dim = vision.dim
    local = vision.n_heads // world_size * vision.head_dim  # this rank's q / k / v width
    hidden = vision.hidden_dim // world_size
    # Alive throughout: the float32 tiles and their copy in the encoder's dtype, the residual
    # stream in and out and the sum being formed.
    inputs = tiles * 3 * size * size * (f32 + s)
    patches = 2 * tiles * grid**2 * 3 * patch * patch * s + 2 * n * dim * s  # unfolded, laid out; projected, gathered
    stream = 3 * n * dim * s
    norm = n * dim * (f32 + s)  # LayerNorm's float32 working copy, and its output
    attention = (
        norm
        + 3 * n * local * s  # q, k, v
        + 2 * 2 * n * local * f32  # 2-D RoPE of q and k in float32 (real view, complex product)
        + 2 * n * local * s  # rotated q, k
        + 3 * n * local * s  # q, k, v laid out for SDPA
        + 2 * n * local * s  # its output, laid out for wo
        + 2 * n * dim * s  # wo's output, summed over ranks
    )
    mlp = norm + 3 * n * hidden * s + 2 * n * dim * s  # c_fc's output, GELU of it; c_proj's, summed
    # After the blocks: the final norm without the class token, the pixel shuffle's copies,
    # the adapter's two layers with their GELUs, the projection to the text width.
    features = tiles * vision.patches_per_tile
    adapter = (norm + 2 * tiles * grid**2 * dim * s
               + features * (3 * vision.output_dim // world_size + 3 * vision.output_dim) * s
               + 2 * features * text_dim * (s + s))
    return int(ALLOCATOR_SLACK * (inputs + max(patches, stream + max(attention, mlp), adapter)))


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one rank needs, by cause."""

    weights: int  # as stored: quantised linear layers count their quantised bytes
    kv_cache: int  # KV cache and RoPE table: grow with max_batch_size x max_seq_len
    activations: int  # the largest prefill's peak
    # Held besides the weights while loading, before the KV cache exists: a quantised load's
    # one module in full precision and its quantisation's temporaries (0 otherwise).
    loading: int = 0
    # The image encoder's peak for the largest image (MAX_IMAGE_TILES tiles); 0 for a text-only
    # model.  Images are encoded before the prefill's text forward, so the larger peak counts.
    image_activations: int = 0

    @property
    def total(self) -> int:
        return self.weights + max(self.loading, self.kv_cache + max(self.activations, self.image_activations))


def memory_need(
    model: Transformer,
    dtype: torch.dtype,
    prefill_batch: Optional[int] = None,
    prefill_tokens: Optional[int] = None,
    world_size: Optional[int] = None,
    prefill_masked: bool = False,
    *,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    device: torch.device = torch.device("cpu"),
    kv_cache_slots: Optional[int] = None,
) -> MemoryNeed:
    """This rank's need for ``model`` (built on the meta device, or not yet quantised) in
    ``dtype``, its linear layers stored as ``quantize`` says (int4 in groups of
    ``group_size``) on ``device`` (see :func:`llama.layers.quantize.quantized_weight_bytes`).

    The largest prefill defaults to every KV-cache row filled in one pass from position
    0 (``max_batch_size`` rows of ``max_seq_len`` tokens, causal attention); an engine
    that prefills at most ``prefill_tokens`` tokens per row per step, or
    ``prefill_batch`` rows, passes those, and ``prefill_masked=True`` if those chunks
    attend through a mask on CPU (see :func:`prefill_activation_bytes`).
    """
    params: ModelArgs = model.params
    if quantize == "int4" and group_size is None:
        group_size = DEFAULT_INT4_GROUP_SIZE
    weights, loading = quantized_weight_bytes(model, quantize, group_size, device, dtype)
    attention = cast("TransformerBlock", model.layers[0]).attention  # this rank's K/V heads
    if kv_cache_slots is None:  # the engine's default pool
        kv_cache_slots = paged_kv_slots(params.max_batch_size * params.max_seq_len)
    cache = kv_cache_bytes(len(model.layers), kv_cache_slots, attention.n_local_kv_heads, attention.head_dim,
                           dtype)  # the engine's paged cache
    cache += model.freqs_cis.numel() * model.freqs_cis.element_size()  # grows with max_seq_len too
    # Llama 3.2 Vision: the running requests' image K/V (the pool of max_batch_size image slots), and
    # a step's batched copy of it, which the scheduler keeps to the pool's size (ImageContexts.footprint).
    cache += 2 * image_kv_bytes(model, params.max_batch_size, dtype)
    batch = params.max_batch_size if prefill_batch is None else prefill_batch
    tokens = params.max_seq_len if prefill_tokens is None else prefill_tokens
    world_size = distributed.planned_world_size() if world_size is None else world_size
    activations = prefill_activation_bytes(
        params, batch, tokens, dtype, world_size, kv_len=params.max_seq_len, masked=prefill_masked
    )
    images = 0
    if params.vision_args is not None and getattr(model, "vision_embeddings", None) is not None:
        images = image_activation_bytes(params.vision_args, params.dim, MAX_IMAGE_TILES, dtype, world_size)
    return MemoryNeed(weights, cache, activations, loading, images)


def image_kv_bytes(model: Transformer, rows: int, dtype: torch.dtype, images_per_row: int = 1) -> int:
    """This rank's bytes of Llama 3.2 Vision's per-request image K/V (:class:`llama.model.ImageContext`:
    every cross-attention layer's keys and values over an image's tiles, counted at the most,
    ``vision_max_num_chunks``: a smaller image holds those of its real tiles only) for ``rows``
    requests of ``images_per_row`` images each; 0 for other models."""
    if model.vision_model is None or not len(model.cross_attention_layers):
        return 0
    params = model.params
    tokens = images_per_row * params.vision_max_num_chunks * (model.vision_model.vision_encoder.grid**2 + 1)
    attention = cast("CrossAttentionTransformerBlock", model.cross_attention_layers[0]).attention
    return kv_cache_bytes(len(model.cross_attention_layers), rows * tokens, attention.n_local_kv_heads,
                          attention.head_dim, dtype)


def paged_kv_slots(kv_cache_tokens: int, block_size: int = DEFAULT_KV_BLOCK_SIZE) -> int:
    """Token slots of the engine's paged KV cache of ``kv_cache_tokens`` tokens: whole
    blocks, and the scratch block."""
    return (1 + -(-kv_cache_tokens // block_size)) * block_size


def check_memory(
    model: Transformer,
    dtype: torch.dtype,
    device: torch.device,
    *,
    prefill_batch: Optional[int] = None,
    prefill_tokens: Optional[int] = None,
    prefill_masked: bool = False,
    available: Optional[int] = None,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    kv_cache_slots: Optional[int] = None,
    merge_bytes: int = 0,
) -> MemoryNeed:
    """Refuse (``RuntimeError``) to start loading what cannot fit on ``device``; the
    message gives the need by cause and only the advice that addresses the cause, each
    piece of which passes this check (a smaller dtype, int8 or int4 are suggested only
    where they fit, int4 only where its kernels take this model's shapes).

    ``available`` overrides :func:`llama.runtime.host.available_memory` (tests).  See
    :func:`memory_need` for the prefill and quantisation arguments.  ``merge_bytes``: held
    besides the weights while a LoRA adapter is merged into them as they load
    (:func:`llama.lora.merge.merge_memory_bytes`), counted with the load's other temporaries.
    Returns the need.
    """
    masked = prefill_masked and device.type == "cpu"

    def need_for(dtype: torch.dtype, quantize: Optional[str], group_size: Optional[int]) -> MemoryNeed:
        need = memory_need(model, dtype, prefill_batch, prefill_tokens, prefill_masked=masked,
                           quantize=quantize, group_size=group_size, device=device, kv_cache_slots=kv_cache_slots)
        return replace(need, loading=need.loading + merge_bytes) if merge_bytes else need

    need = need_for(dtype, quantize, group_size)
    params: ModelArgs = model.params
    world = distributed.planned_world_size()

    def fits_over(processes: int) -> bool:
        """Whether this rank's share fits with the model split over ``processes`` instead (each
        with ``available``), within 5 %: the split tensors shrink, the cache by K/V heads."""
        rope = model.freqs_cis.numel() * model.freqs_cis.element_size()
        kv_heads = cast("TransformerBlock", model.layers[0]).attention.n_local_kv_heads
        cache = (need.kv_cache - rope) * max(params.n_kv_heads // processes, 1) // kv_heads + rope
        activations = prefill_activation_bytes(
            params, params.max_batch_size if prefill_batch is None else prefill_batch,
            params.max_seq_len if prefill_tokens is None else prefill_tokens, dtype, processes,
            kv_len=params.max_seq_len, masked=masked)
        images = (image_activation_bytes(params.vision_args, params.dim, MAX_IMAGE_TILES, dtype, processes)
                  if need.image_activations and params.vision_args is not None else 0)
        share = MemoryNeed(need.weights * world // processes, cache, activations, need.loading * world // processes,
                           images)
        return share.total <= 0.95 * cast(int, available)  # called once available is known
    if available is None:
        available = host.available_memory(device)
    logger.debug("memory per rank: weights %.2f GiB (%s) + KV cache %.2f GiB + activations %.2f GiB (encoding "
                 "the largest image: %.2f GiB); %.2f GiB more while loading", need.weights / GIB, quantize or dtype,
                 need.kv_cache / GIB, need.activations / GIB, need.image_activations / GIB, need.loading / GIB)
    if available is None or need.total <= available:
        return need
    images = (f" (encoding the largest image, {MAX_IMAGE_TILES} tiles, takes {need.image_activations / GIB:.2f} "
              "GiB: the larger of the two counts)" if need.image_activations else "")
    peak = max(need.activations, need.image_activations)
    loading = (f"; while loading, {need.loading / GIB:.2f} GiB beside the weights (one layer in full precision "
               f"as it is quantised)" if need.loading > need.kv_cache + peak else "")
    raise RuntimeError(
        f"not enough memory on {device}: this rank needs {need.total / GIB:.2f} GiB (weights "
        f"{need.weights / GIB:.2f} GiB{f' as {quantize}' if quantize else ''} + KV cache and RoPE table "
        f"{need.kv_cache / GIB:.2f} GiB for max_batch_size={params.max_batch_size} x "
        f"max_seq_len={params.max_seq_len} + activations of the largest prefill {need.activations / GIB:.2f} GiB"
        f"{images}{loading}) but {available / GIB:.2f} GiB is available. "
        + _advice(model, need, available, dtype, device, quantize, group_size, need_for, fits_over)
    )


def _advice(model: Transformer, need: MemoryNeed, available: int, dtype: torch.dtype, device: torch.device,
            quantize: Optional[str], group_size: Optional[int],
            need_for: Callable[[torch.dtype, Optional[str], Optional[int]], MemoryNeed],
            fits_over: Callable[[int], bool]) -> str:
    """What would help, by cause: only the weights' share shrinks with more processes, a
    smaller dtype or quantised weights; the KV cache and activations shrink with the batch
    and length.  A smaller dtype or a quantisation is named only where this rank's need with
    it fits ``available`` (``need_for(dtype, quantize, group_size)`` gives that need), and
    more processes only where some process count the model splits into would fit
    (``fits_over(processes)``)."""
    weights_alone = need.weights + need.loading > available
    smaller = []
    if _itemsize(dtype) > 2 and need_for(torch.bfloat16, quantize, group_size).total <= available:
        smaller.append("use a smaller dtype (bfloat16)")
    for mode in _smaller_modes(quantize):
        group = _group_size(model, mode, device)
        if mode == "int4" and group is None:
            continue  # torch's int4 kernels do not take this model's shapes
        if need_for(dtype, mode, group).total <= available:
            smaller.append(f"{mode} weights (quantize='{mode}'"
                           + (f", quantize_group_size={group}" if mode == "int4" and group != DEFAULT_INT4_GROUP_SIZE
                              else "") + ")")
            break  # the least lossy one that fits
    world = distributed.planned_world_size()
    sizes = [m for m in valid_model_parallel_sizes(model.params) if m > world and fits_over(m)]
    more = (f"run more processes ({sizes[0]}: torchrun --nproc_per_node, on more GPUs or machines; this model "
            f"splits over {[m for m in valid_model_parallel_sizes(model.params) if m > world]})") if sizes else ""
    tips = []
    if weights_alone:
        ways = [t for t in [more] + smaller if t]
        tips.append("The weights alone do not fit, whatever the batch size or sequence length"
                    + (": " + _either(ways) + "." if ways else
                       f"; no smaller dtype or quantisation of them fits in {available / GIB:.2f} GiB on {device}."))
    else:
        if need.kv_cache + max(need.activations, need.image_activations) > need.weights \
            or need.weights + need.kv_cache > available:
            tips.append("Lower max_batch_size or max_seq_len (the KV cache and the largest prefill grow with both).")
        ways = [t for t in [more] + smaller if t]
        if ways:
            tips.append("Or " + _either(ways) + ".")
    return " ".join(tips)


def _smaller_modes(quantize: Optional[str]) -> list[str]:
    """The quantisations that store the weights in fewer bytes than ``quantize``, least lossy first."""
    return {None: ["int8", "int4"], "int8": ["int4"], "w8a8": ["int8", "int4"]}.get(quantize, [])


def _group_size(model: nn.Module, mode: Optional[str], device: torch.device) -> Optional[int]:
    """The int4 group size to suggest for ``model`` on ``device`` (the default where it fits,
    else the largest that does), or None where none does; None for other modes too."""
    if mode != "int4":
        return None
    for group in (DEFAULT_INT4_GROUP_SIZE, *sorted(INT4_GROUP_SIZES, reverse=True)):
        try:
            check_int4_group_size(model, group, device)
        except ValueError:
            continue
        return group
    return None


def _either(ways: list[str]) -> str:
    return ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + " or " + ways[-1]
