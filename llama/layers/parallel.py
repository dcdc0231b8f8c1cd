"""fairscale's model-parallel layers, built without their full-size initial weight, with
products that follow the model's kernel policy.

fairscale's constructors allocate a CPU tensor with the legacy ``torch.Tensor(...)`` call
(which ignores ``torch.device(...)`` contexts) and initialise a full, unsharded "master"
weight on every rank before slicing it.  For inference the weights come from a
checkpoint, so that work is wasted memory and time.  The classes here *are* fairscale's
classes (same collectives, ``isinstance`` holds; :mod:`llama.layers.collectives` makes them
traceable by ``torch.compile``) with a constructor that allocates only
this rank's slice, on the current default device: ``with torch.device("meta"): ...``
allocates nothing at all.

A linear layer's rank-local product is its class's :meth:`ParallelLinear.local_matmul`:
a dense weight here; int8 / int4 / w8a8 weights (:mod:`llama.layers.quantized`) and
weights packed for a CPU kernel (:mod:`llama.layers.packed`) are layers of their own
classes, swapped in for these (:meth:`ParallelLinear.swapped_to`) and swapped back.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, TypeVar

import torch
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel import layers as fs_layers
from torch import nn

from llama.layers.collectives import enter_parallel_region, gather_last_dim, sum_over_ranks
from llama.layers.policy import KernelPolicy
from llama.layers.products import dense_product

logger = logging.getLogger(__name__)

Layer = TypeVar("Layer", bound="ParallelLinear")

# What a parallel linear layer is, besides its weight: copied when a layer is swapped.
_SHAPE_ATTRIBUTES = ("in_features", "out_features", "world_size", "gather_output", "input_is_parallel",
                     "output_size_per_partition", "input_size_per_partition", "policy")


def split_size(total: int, what: str) -> int:
    """``total`` split evenly over the model-parallel ranks (ValueError where it cannot be)."""
    world = fs_init.get_model_parallel_world_size()
    if total % world:
        raise ValueError(f"{what}={total} cannot be split evenly over {world} model-parallel processes")
    return total // world


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ParallelLinear(nn.Module):
    """What every parallel linear layer has: its parallel shape attributes, the kernel
    ``policy`` its products follow (:mod:`llama.layers.policy`; torch's plain products
    until the model's is set), and one rank-local product."""

    policy: KernelPolicy = KernelPolicy()
    # fairscale's attributes (set by _init_linear and the constructors), typed for the type checker
    weight: torch.Tensor  # a dense layer's; the other kinds hold their own (quantized.py, packed.py)
    in_features: int
    out_features: int
    world_size: int
    master_weight: Optional[torch.Tensor]
    gather_output: bool
    input_is_parallel: bool
    output_size_per_partition: int
    input_size_per_partition: int

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` with this rank's slice of the weight."""
        raise NotImplementedError

    def swapped_to(self, cls: type[Layer]) -> Layer:
        """A layer of class ``cls`` with this one's shape, parallel split and policy, holding
        no weight yet (the caller gives it its own kind of weight)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        for name in _SHAPE_ATTRIBUTES:
            if name in self.__dict__:
                setattr(layer, name, self.__dict__[name])
        layer.register_parameter("bias", None)
        layer.master_weight = None
        return layer


class ColumnParallel(ParallelLinear):
    """``y = x @ W.T`` with W's output rows split over ranks (each rank holds ``out/world`` rows)."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out = self.local_matmul(enter_parallel_region(input_))
        return gather_last_dim(out) if self.gather_output else out


class RowParallel(ParallelLinear):
    """``y = x @ W.T`` with W's input columns split over ranks; partial outputs are summed (all-reduce)."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out = self.local_matmul(input_)
        return sum_over_ranks(out)


class DenseWeight:
    """A layer's product with a dense (out, in) ``weight`` (:func:`~llama.layers.products.dense_product`)."""

    weight: torch.Tensor  # an nn.Parameter
    policy: KernelPolicy

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return dense_product(x, self.weight, self.policy)


def _init_linear(layer: ParallelLinear, in_features: int, out_features: int, local_shape: tuple[int, int]) -> None:
    """What fairscale's linear constructors set, with this rank's ``local_shape`` slice of the
    weight allocated on the current default device (nothing on ``meta``)."""
    nn.Module.__init__(layer)
    layer.in_features = in_features
    layer.out_features = out_features
    layer.world_size = fs_init.get_model_parallel_world_size()
    layer.weight = _weight(*local_shape)
    layer.register_parameter("bias", None)
    layer.master_weight = None


class ColumnParallelLinear(DenseWeight, ColumnParallel, fs_layers.ColumnParallelLinear):
    """fairscale's ColumnParallelLinear with this rank's dense slice of the weight."""

    def __init__(self, in_features: int, out_features: int, *, gather_output: bool) -> None:
        self.output_size_per_partition = split_size(out_features, "output features")
        _init_linear(self, in_features, out_features, (self.output_size_per_partition, in_features))
        self.gather_output = gather_output


class RowParallelLinear(DenseWeight, RowParallel, fs_layers.RowParallelLinear):
    """fairscale's RowParallelLinear with this rank's dense slice of the weight."""

    def __init__(self, in_features: int, out_features: int) -> None:
        self.input_size_per_partition = split_size(in_features, "input features")
        _init_linear(self, in_features, out_features, (out_features, self.input_size_per_partition))
        self.input_is_parallel = True


def dense_class(layer: ParallelLinear) -> type[ParallelLinear]:
    """The dense class of ``layer``'s parallel split (what unpacking swaps back to)."""
    return ColumnParallelLinear if isinstance(layer, ColumnParallel) else RowParallelLinear


def replace_module_(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where ``old`` is in ``model`` (under the same attribute name)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise ValueError("the module to replace is not part of the model")


def _init_embedding_attributes(module: Any, num_embeddings: int, embedding_dim: int) -> None:
    """What fairscale's embedding constructors set besides the weight (torch.nn.Embedding's defaults)."""
    nn.Module.__init__(module)
    module.num_embeddings = num_embeddings
    module.embedding_dim = embedding_dim
    module.padding_idx = None
    module.max_norm = None
    module.norm_type = 2.0
    module.scale_grad_by_freq = False
    module.sparse = False
    module._weight = None


class ParallelEmbedding(fs_layers.ParallelEmbedding):
    """Embedding table split along the embedding dimension (Llama 2 checkpoints)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        _init_embedding_attributes(self, num_embeddings, embedding_dim)
        self.embedding_dim_per_partition = split_size(embedding_dim, "embedding dim")
        self.weight = _weight(num_embeddings, self.embedding_dim_per_partition)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(torch.nn.functional.embedding(input_, self.weight))


class VocabParallelEmbedding(fs_layers.VocabParallelEmbedding):
    """Embedding table split along the vocabulary (Llama 3 checkpoints)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        _init_embedding_attributes(self, num_embeddings, embedding_dim)
        per_rank = split_size(num_embeddings, "vocab_size")
        self.vocab_start_index = fs_init.get_model_parallel_rank() * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.num_embeddings_per_partition = per_rank
        self.weight = _weight(per_rank, embedding_dim)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # fairscale's forward masks with boolean indexing, which makes the host wait
        # for the device on every call; ``where`` keeps everything on the device.
        local = input_ - self.vocab_start_index
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        embedded = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return sum_over_ranks(embedded)
