"""Folding a LoRA adapter into the base model's dense weights: ``W += scale * B @ A``.

Each rank folds in its own part (:func:`rank_factors`): a column-parallel layer's rows of B,
a row-parallel layer's columns of A, so ``W_local += scale * B_local @ A_local`` is exactly
this rank's slice of the merged weight.  The product and the sum are taken in float32 and the
result cast back to the weight's dtype, once.

Two ways in: :func:`merged_tensors` changes a stream of (name, tensor) as the loader reads the
checkpoint (``Llama.build(..., lora=path)``: before quantisation, packing or compilation, so an
int8/int4 base quantises the merged weight), and :func:`merge_lora_` changes a model already
loaded in full precision.  ``python -m llama.convert merge_lora`` writes the merged checkpoint
(:func:`llama.convert.commands.merge_lora`).
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
from torch import nn

from llama.args import ModelArgs
from llama.layers.tensor_parallel import full_shapes, holder_region, split_axis, split_of
from llama.lora.adapter import LoraAdapter, LoraFactors, local_factors

logger = logging.getLogger(__name__)


def rank_factors(adapter: LoraAdapter, layer: str, args: ModelArgs, world_size: int, rank: int) -> LoraFactors:
    """The factors of the adapter's ``layer`` (a Meta layer name, ``"layers.0.attention.wk"``, or
    a stack of experts' tensor, ``"layers.1.feed_forward.experts.w1"``) that rank ``rank`` of
    ``world_size`` applies to its slice of the layer: the slice the loader gives it
    (:func:`llama.layers.tensor_parallel.holder_region`: whole heads, K/V heads copied over more
    ranks than there are; the experts' hidden units), by :func:`llama.lora.adapter.local_factors`:
    B's rows where the split axis is the change's second to last, A's columns where it is its last."""
    return layer_rank_factors(layer, adapter.factors[layer], args, world_size, rank)


def layer_rank_factors(layer: str, factors: LoraFactors, args: ModelArgs, world_size: int, rank: int) -> LoraFactors:
    """:func:`rank_factors` of one layer's ``factors``."""
    name = layer if factors.a.dim() == 3 else layer + ".weight"
    full = full_shapes(args)[name]
    region = holder_region(name, full, world_size, rank, "vocab", args.head_dim)
    axis = split_axis(split_of(name), "vocab")
    if axis is None or axis < len(full) - 2:
        raise ValueError(f"internal error: {name!r} is not split along one of its last two axes")
    column = axis == len(full) - 2
    return local_factors(factors, column_parallel=column, rank=rank, world=world_size, region=region[axis])


def delta(factors: LoraFactors, scale: float, device: torch.device) -> torch.Tensor:
    """``scale * B @ A`` in float32 on ``device`` (per expert for 3-D factors)."""
    a = factors.a.to(device=device, dtype=torch.float32)
    b = factors.b.to(device=device, dtype=torch.float32)
    return (b @ a).mul_(scale)


def merged_weight(weight: torch.Tensor, factors: LoraFactors, scale: float) -> torch.Tensor:
    """``weight + scale * B @ A`` (this rank's factors, :func:`rank_factors`), summed in float32,
    in ``weight``'s dtype and device; a stack of experts one expert at a time."""
    if weight.dim() == 3:
        out = torch.empty_like(weight)
        for e in range(weight.shape[0]):
            out[e] = merged_weight(weight[e], LoraFactors(a=factors.a[e], b=factors.b[e]), scale)
        return out
    d = delta(factors, scale, weight.device)
    if d.shape != weight.shape:
        raise ValueError(f"internal error: a LoRA change of shape {list(d.shape)} for a weight of "
                         f"{list(weight.shape)}")
    return (weight.to(torch.float32) + d).to(weight.dtype)


def merged_tensors(tensors: Iterator[tuple[str, torch.Tensor]], adapter: LoraAdapter, args: ModelArgs,
                   world_size: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` ((Meta name, this rank's slice), as the loader reads them) with the adapter
    folded into the weights it changes; RuntimeError at the end if the stream held none of some
    layer the adapter changes."""
    waiting = set(adapter.factors)
    for name, tensor in tensors:
        layer = name.removesuffix(".weight")  # experts' stacks: the tensor's own name
        if layer in waiting:
            tensor = merged_weight(tensor, rank_factors(adapter, layer, args, world_size, rank), adapter.scale)
            waiting.discard(layer)
        yield name, tensor
    if waiting:
        raise RuntimeError(f"internal error: the checkpoint read held no weight for LoRA layers {sorted(waiting)[:5]}")
    logger.info("merged LoRA adapter %r (rank %d, scale %g) into %d layers", adapter.name, adapter.rank,
                adapter.scale, len(adapter.factors))


def merge_memory_bytes(model: nn.Module, adapter: LoraAdapter, dtype: torch.dtype) -> int:
    """The most memory merging ``adapter`` holds at once besides the weights, on this rank's
    ``model`` (built, possibly on the meta device, with its local shapes): for the largest weight
    it changes, :func:`merged_weight`'s float32 copy and change and the result in ``dtype`` (for a
    stack of experts, the result stack and one expert's float32 pair)."""
    state = model.state_dict(keep_vars=True)
    size = torch.empty((), dtype=dtype).element_size()
    most = 0
    for layer, factors in adapter.factors.items():
        weight = state.get(layer + ".weight", state.get(layer))
        if weight is None:
            continue
        if factors.a.dim() == 3:
            one = weight[0].numel()
            most = max(most, weight.numel() * size + one * (8 + size))
        else:
            most = max(most, weight.numel() * (8 + size))
    return most


@torch.no_grad()
def merge_lora_(model: nn.Module, adapter: LoraAdapter, args: ModelArgs, world_size: int = 1, rank: int = 0) -> int:
    """Fold ``adapter`` into ``model`` (Meta's ``Transformer``, this rank's slice, loaded in full
    precision: not yet quantised or packed) in place.  Returns the number of layers changed.
    RuntimeError where a layer the adapter changes is not a plain linear layer any more
    (quantised, packed): merge before those (``Llama.build(..., lora=path)`` does)."""
    state = model.state_dict(keep_vars=True)
    for layer in adapter.factors:
        weight = state.get(layer + ".weight", state.get(layer))
        if not isinstance(weight, torch.Tensor) or weight.dim() != adapter.factors[layer].a.dim() \
                or not weight.is_floating_point():
            raise RuntimeError(f"cannot merge a LoRA adapter into {layer!r}: it is not a full-precision linear layer "
                               "(quantised or packed already?): merge before quantising "
                               "(Llama.build(..., lora=path, quantize=...) does)")
        weight.copy_(merged_weight(weight, rank_factors(adapter, layer, args, world_size, rank), adapter.scale))
    return len(adapter.factors)
