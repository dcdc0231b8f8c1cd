"""Quantised linear layers, each a class with one product: int8 weights with a scale per
output row (:class:`Int8Weight`), int8 weights whose one-row products also quantise their
activations (:class:`W8A8Weight`, ``quantize="w8a8"``), int4 groups (:class:`Int4Weight`);
and the fused product of the layers that read the same input (wq, wk, wv; w1, w3),
:class:`Int8FusedProjections`, :class:`W8A8FusedProjections` and :class:`Int4FusedProjections`.
``state_dict()`` keys stay Meta's names with the quantised tensors' suffixes (``wq.weight_int8``,
``wq.weight_scale``...).  Made by :mod:`llama.layers.quantize`.
"""

from __future__ import annotations

from typing import Optional

import torch
from fairscale.nn.model_parallel import layers as fs_layers
from torch import nn

from llama.layers import cpu_kernels
from llama.layers.packing import Int8ActivationMatrix, packed_linear
from llama.layers.parallel import ColumnParallel, RowParallel
from llama.layers.policy import KernelPolicy
from llama.layers.products import int4_product, int8_product


class Int8Weight:
    """int8 weights ``weight_int8`` (out, in) and a scale per output row ``weight_scale``
    (out,): ``W ~= weight_int8 * weight_scale[:, None]``."""

    weight_int8: torch.Tensor
    weight_scale: torch.Tensor
    policy: KernelPolicy

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.weight_int8, self.weight_scale, self.policy)


class W8A8Weight(Int8Weight):
    """int8's weights, also packed for fbgemm's int8 x int8 product (``int8_packed``, a
    second copy; ``int8_packed_key`` finds it from compiled steps): one row (a decoding step
    at batch 1) goes through it, its activations quantised to 8-bit codes per call, i.e. per
    token (as llama.cpp's Q8_0 does).  More rows keep bfloat16 activations (int8's product):
    one quantisation for many rows would make a row's result depend on the others."""

    int8_packed: Int8ActivationMatrix
    int8_packed_key: int

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() == 1:
            return packed_linear(x, self.int8_packed, self.int8_packed_key, self.weight_int8.shape[0])
        return int8_product(x, self.weight_int8, self.weight_scale, self.policy)


class Int4Weight:
    """4-bit groups of ``int4_group_size`` input columns: ``weight_int4`` (packed by torch for
    the device), ``weight_scales_and_zeros`` (in / group, out, 2); the rows stored are padded
    to a multiple of 16, the layer's ``int4_out_features`` kept.

    Where the policy uses our CPU kernel, :func:`llama.layers.prepare.use_cpu_int4_layout_`
    lays the matrix out in that kernel's layout instead (``int4_kernel_rows``, the same codes,
    scales and offsets; ``int4_in_features`` wide) and drops torch's packing: the layer holds
    one copy, which every product reads (decoding steps and prompts alike).  ``state_dict()``
    still gives ``weight_int4`` and ``weight_scales_and_zeros`` as torch packs them (made again
    from the kernel's layout, exactly), and ``load_state_dict()`` takes them."""

    weight_int4: Optional[torch.Tensor]
    weight_scales_and_zeros: Optional[torch.Tensor]
    int4_group_size: int
    int4_out_features: int
    policy: KernelPolicy
    # None: torch's kernel (and its packing) multiplies.
    int4_kernel_rows: Optional[torch.Tensor] = None
    int4_in_features: int = 0

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = int4_product(x, self.weight_int4, self.weight_scales_and_zeros, self.int4_group_size,
                           self.int4_kernel_rows, self.policy)
        return out if out.shape[-1] == self.int4_out_features else out[..., : self.int4_out_features]

    def _kernel_layout_only(self) -> bool:
        return self.int4_kernel_rows is not None and self.weight_int4 is None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._kernel_layout_only():
            assert self.int4_kernel_rows is not None
            packed, scales_and_zeros = cpu_kernels.torch_int4_from_kernel_layout(
                self.int4_kernel_rows, self.int4_in_features, self.int4_group_size)
            destination[prefix + "weight_int4"] = packed
            destination[prefix + "weight_scales_and_zeros"] = scales_and_zeros

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self._kernel_layout_only():
            names = {"weight_int4": prefix + "weight_int4", "scales_and_zeros": prefix + "weight_scales_and_zeros"}
            found = {name: state_dict[key] for name, key in names.items() if key in state_dict}
            if len(found) == 2:
                rows = cpu_kernels.pack_int4_from_torch(  # laid out as the rows it replaces
                    found["weight_int4"], found["scales_and_zeros"], self.int4_in_features,
                    per_group=cpu_kernels.holds_scale_per_group(self.int4_kernel_rows, self.int4_in_features))
                if rows.shape != self.int4_kernel_rows.shape:
                    error_msgs.append(f"size mismatch for {names['weight_int4']}: the checkpoint's int4 matrix "
                                      f"{tuple(found['weight_int4'].shape)} does not fit this layer's "
                                      f"({self.int4_out_features} x {self.int4_in_features})")
                else:  # in place: the rows may be a view of fused projections' matrix
                    with torch.no_grad():
                        self.int4_kernel_rows.copy_(rows)
            elif strict:
                missing_keys.extend(key for key in names.values() if key not in state_dict)
            state_dict = {k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in names.values()}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)


class Int8ColumnParallelLinear(Int8Weight, ColumnParallel, fs_layers.ColumnParallelLinear):
    """ColumnParallelLinear with int8 weights."""


class Int8RowParallelLinear(Int8Weight, RowParallel, fs_layers.RowParallelLinear):
    """RowParallelLinear with int8 weights."""


class W8A8ColumnParallelLinear(W8A8Weight, ColumnParallel, fs_layers.ColumnParallelLinear):
    """ColumnParallelLinear with int8 weights and, for one row, int8 activations."""


class W8A8RowParallelLinear(W8A8Weight, RowParallel, fs_layers.RowParallelLinear):
    """RowParallelLinear with int8 weights and, for one row, int8 activations."""


class Int4ColumnParallelLinear(Int4Weight, ColumnParallel, fs_layers.ColumnParallelLinear):
    """ColumnParallelLinear with int4 weights."""


class Int4RowParallelLinear(Int4Weight, RowParallel, fs_layers.RowParallelLinear):
    """RowParallelLinear with int4 weights."""


class FusedProjections(nn.Module):
    """The layers that read the same input (an attention layer's wq, wk, wv; a feed-forward
    layer's w1, w3) multiplied as one matrix: one product gives all their outputs, fewer,
    larger calls than one per layer.  Each layer keeps working on its own, and keeps its
    weights in ``state_dict()`` (this module has no tensors of its own).  A module, so that
    torch.compile guards on its attributes: a step compiled for one model is not reused for
    another."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = sizes  # each layer's output features, in order

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """All the layers' outputs side by side, (..., sum(sizes)), in the layers' order."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, dim=-1)


class Int8FusedProjections(FusedProjections):
    """int8 layers that read the same input as one weight (the layers' ``weight_int8`` and
    ``weight_scale`` are views of its rows: no second copy) and one product.  Each output is
    the same sum as in the layer's own product."""

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, sizes: list[int], policy: KernelPolicy) -> None:
        super().__init__(sizes)
        self.weight_int8 = weight_int8  # plain attributes, not buffers: the layers' views are the state
        self.weight_scale = scale
        self.policy = policy

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.weight_int8, self.weight_scale, self.policy)


class Int4FusedProjections(FusedProjections):
    """int4 layers laid out for our CPU kernel that read the same input, as one matrix in the
    kernel's layout (the layers' ``int4_kernel_rows`` are views of its rows: no second copy;
    made by :func:`llama.layers.prepare.use_cpu_int4_layout_`) and one product: one call, the
    input quantised once for all of them.  The kernel's rows are independent, so each output
    is exactly what the layer's own product gives."""

    def __init__(self, kernel_rows: torch.Tensor, sizes: list[int], group_size: int, policy: KernelPolicy) -> None:
        super().__init__(sizes)
        self.int4_kernel_rows = kernel_rows  # a plain attribute, not a buffer: the layers' views are the state
        self.int4_group_size = group_size
        self.policy = policy

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return int4_product(x, None, None, self.int4_group_size, self.int4_kernel_rows, self.policy)


class W8A8FusedProjections(FusedProjections):
    """w8a8 layers that read the same input, packed as one matrix for fbgemm's int8 x int8
    product, which one-row inputs (decoding steps at batch 1) take: the row is quantised once
    for all of them, and each layer's outputs are exactly what its own product would give
    (code products summed in integers, one scale per output row).  Inputs of more rows go
    through ``rows``, int8's fused product, with bfloat16 activations."""

    def __init__(self, packed: Int8ActivationMatrix, key: int, rows: Int8FusedProjections) -> None:
        super().__init__(rows.sizes)
        self.packed = packed
        self.key = key  # the matrix's key for compiled steps
        self.rows = rows

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() == 1:
            return packed_linear(x, self.packed, self.key, sum(self.sizes))
        return self.rows.product(x)
