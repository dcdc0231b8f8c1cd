"""bfloat16/float16 CPU linear layers whose weights are packed for a faster kernel
(:mod:`llama.layers.packing`): their classes, and packing a model's layers and unpacking
them again.

:func:`use_packed_weights_` swaps each packable layer for a :class:`PackedWeight` layer of
the same parallel split, and gives the layers that read the same input (wq, wk, wv; w1,
w3) one shared matrix, multiplied once for all of them (:class:`PackedFusedProjections`).
``state_dict()`` still holds each layer's ``weight`` (unpacked on demand, in its dtype);
:func:`unpack_weights_` swaps the dense layers back, their weights bit for bit.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, cast

import torch
from fairscale.nn.model_parallel import layers as fs_layers
from torch import nn

from llama.layers.packing import (
    OneDnnMatrix,
    PackedMatrix,
    pack_weight,
    packed_linear,
    register_for_compile,
    return_freed_memory,
    unpack_weight,
)
from llama.layers.parallel import ColumnParallel, DenseWeight, ParallelLinear, RowParallel, dense_class
from llama.layers.policy import KernelPolicy
from llama.layers.quantized import FusedProjections

logger = logging.getLogger(__name__)


class PackedWeight:
    """A weight packed for a CPU kernel: ``weight_packed`` (the matrix: this layer's alone, or
    shared with sibling layers, which each use rows ``weight_packed_rows`` of it),
    ``weight_packed_key`` and ``weight_packed_out_features`` (the matrix's key for compiled
    steps and its output features), ``weight_packed_dtype`` and ``weight_packed_shape`` (the
    weight's dtype, the layer's output dtype, and (out, in) shape)."""

    weight_packed: PackedMatrix
    weight_packed_key: int
    weight_packed_out_features: int
    weight_packed_rows: Optional[tuple[int, int]]
    weight_packed_dtype: torch.dtype
    weight_packed_shape: tuple[int, int]
    # The values the packed matrix does not hold exactly (bfloat16 ones below float16's normal
    # range, in fbgemm's float16 matrix): their flat indices in this layer's weight and their
    # values, so that unpacking gives the weight back bit for bit.  None: nothing to restore.
    weight_exact: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = packed_linear(x, self.weight_packed, self.weight_packed_key, self.weight_packed_out_features)
        rows = self.weight_packed_rows
        return out if rows is None else out[..., rows[0] : rows[1]]

    def unpacked_weight(self) -> torch.Tensor:
        """The weight as a tensor again, in its dtype (its own rows of a shared matrix)."""
        weight = unpack_weight(self.weight_packed, self.weight_packed_shape[1])
        rows = self.weight_packed_rows
        if rows is not None:
            weight = weight[rows[0] : rows[1]]
        weight = weight.to(self.weight_packed_dtype)
        if self.weight_exact is not None:
            index, values = self.weight_exact
            weight = weight.contiguous()
            weight.view(-1)[index.long()] = values
        return weight


class PackedColumnParallelLinear(PackedWeight, ColumnParallel, fs_layers.ColumnParallelLinear):
    """ColumnParallelLinear with a packed weight."""


class PackedRowParallelLinear(PackedWeight, RowParallel, fs_layers.RowParallelLinear):
    """RowParallelLinear with a packed weight."""


class PackedFusedProjections(FusedProjections):
    """Packed layers that read the same input, multiplied as one matrix (one call's fixed
    cost a step per group saved)."""

    def __init__(self, packed: PackedMatrix, sizes: list[int], key: int) -> None:
        super().__init__(sizes)
        self.packed = packed
        self.key = key  # the matrix's key for compiled steps

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.key, sum(self.sizes))


def _weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a packed layer: its ``weight`` as a tensor, in its dtype."""
    state_dict[prefix + "weight"] = cast(PackedWeight, module).unpacked_weight()


def _packed_layer(layer: ParallelLinear, packed: PackedMatrix, weight: torch.Tensor,
                  rows: Optional[tuple[int, int]], shared: Optional[tuple[int, int]] = None) -> ParallelLinear:
    """``layer`` (dense) as a packed layer holding ``packed``; ``shared``: (key, output
    features) of a matrix packed with sibling layers."""
    cls: type[PackedColumnParallelLinear | PackedRowParallelLinear] = (
        PackedColumnParallelLinear if isinstance(layer, ColumnParallel) else PackedRowParallelLinear)
    new = layer.swapped_to(cls)
    if shared is None:
        shared = register_for_compile(new, packed, weight.shape[0]), weight.shape[0]
    new.weight_packed = packed
    new.weight_packed_key, new.weight_packed_out_features = shared
    new.weight_packed_dtype = weight.dtype
    new.weight_packed_shape = (weight.shape[0], weight.shape[1])
    new.weight_packed_rows = rows
    new.weight_exact = None if isinstance(packed, OneDnnMatrix) else _values_float16_rounds(weight)
    new._register_state_dict_hook(_weight_in_state_dict)
    return new


def _values_float16_rounds(weight: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(flat indices, values) of the nonzero values of ``weight`` below float16's normal range
    (2**-14 in magnitude), which a float16 matrix holds only to within 2**-25; None if none.
    In a bfloat16 weight of scale 0.02 about one value in 400 (6 bytes each kept: under 1% of
    the weight's bytes)."""
    if weight.dtype != torch.bfloat16:
        return None  # float16 weights are held exactly
    flat = weight.reshape(-1)
    magnitude = flat.abs()
    index = torch.nonzero((magnitude < 2.0 ** -14) & (magnitude > 0)).flatten()
    if index.numel() == 0:
        return None
    values = flat[index].clone()
    return (index.to(torch.int32) if flat.numel() < 2**31 else index), values


def _packable(module: nn.Module) -> bool:
    """A dense parallel linear layer with a bfloat16/float16 CPU weight."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, DenseWeight) and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"
            and weight.dtype in (torch.bfloat16, torch.float16))


def use_packed_weights_(model: nn.Module, policy: KernelPolicy) -> int:
    """Swap every bfloat16/float16 dense parallel linear layer on the CPU for a packed layer
    of the kernel ``policy.packing`` names (the same two bytes per value; see
    :func:`llama.layers.packing.packed_linear`).  A weight the kernel cannot hold (fbgemm:
    beyond float16's range) stays as it is.  The layers a module names in
    ``packable_input_projections`` share one matrix, set as its ``fused`` product.  Returns
    the number of weights packed; 0 where the policy packs nothing."""
    kind = policy.packing
    if kind is None:
        return 0
    one_thread_up_to = policy.fp16_one_thread_up_to if policy.fp16_one_thread else 0
    count = kept = 0
    for module in list(model.modules()):
        names = getattr(module, "packable_input_projections", ())
        siblings = [getattr(module, name) for name in names]
        if siblings and all(_packable(layer) for layer in siblings):
            weights = [layer.weight.detach() for layer in siblings]
            if len({(w.dtype, w.shape[1]) for w in weights}) == 1:
                packed = pack_weight(torch.cat(weights), kind, one_thread_up_to)
                if packed is not None:
                    out_features = sum(w.shape[0] for w in weights)
                    key = register_for_compile(module, packed, out_features)
                    start = 0
                    for name, layer, weight in zip(names, siblings, weights):
                        rows = (start, start + weight.shape[0])
                        setattr(module, name, _packed_layer(layer, packed, weight, rows, (key, out_features)))
                        start += weight.shape[0]
                    module.fused = PackedFusedProjections(packed, [w.shape[0] for w in weights], key)
                    count += len(siblings)
    for parent in list(model.modules()):
        for name, layer in list(parent.named_children()):
            if not _packable(layer):
                continue
            dense = cast(ParallelLinear, layer)  # _packable: a DenseWeight, which only ParallelLinear classes have
            packed = pack_weight(dense.weight, kind, one_thread_up_to)
            if packed is None:
                kept += 1
                continue
            setattr(parent, name, _packed_layer(dense, packed, dense.weight.detach(), None))
            count += 1
    if count:
        return_freed_memory()
    if kept:
        logger.info("%d weight(s) with values beyond float16's range left to torch's kernels", kept)
    return count


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the weights packed by :func:`use_packed_weights_` (two per value, and the few
    values kept for exact unpacking; they are not parameters or buffers, so ``parameters()``
    and ``buffers()`` do not count them)."""
    # Layers packed together each count their own rows: the sum is the shared matrix's size.
    return sum(2 * math.prod(m.weight_packed_shape) + _exact_bytes(m) for m in model.modules()
               if isinstance(m, PackedWeight))


def _exact_bytes(layer: PackedWeight) -> int:
    if layer.weight_exact is None:
        return 0
    return sum(t.numel() * t.element_size() for t in layer.weight_exact)


def unpack_weights_(model: nn.Module) -> int:
    """Undo :func:`use_packed_weights_`: every packed layer is swapped back for a dense one
    holding its weight (bit for bit), and packed fused products are dropped (for code that
    changes weights in place).  Quantised layers and their fused products (int8's, w8a8's)
    are not packed layers and stay as they are.  Returns the number unpacked."""
    count = 0
    for parent in list(model.modules()):
        if isinstance(getattr(parent, "fused", None), PackedFusedProjections):
            parent.fused = None  # type: ignore[assignment]  # torch types a module attribute as a Tensor or Module
        for name, layer in list(parent.named_children()):
            if isinstance(layer, PackedWeight):
                packed = cast(PackedColumnParallelLinear | PackedRowParallelLinear, layer)  # the packed classes
                dense = packed.swapped_to(dense_class(packed))
                dense.weight = nn.Parameter(layer.unpacked_weight(), requires_grad=False)
                setattr(parent, name, dense)
                count += 1
    return count
