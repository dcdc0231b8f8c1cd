"""LoRA adapters served unmerged by the engine: read them (or take them read), check them
against the model and the limits, give each a slot of the model's LoRA layers
(:mod:`llama.layers.lora`) and write this rank's slices of its factors there.

Every rank loads the same adapters in the same order, so an adapter has the same slot on
every rank; a request names its adapter (``RequestSettings.lora``), which every rank learns
with the request's admission, and the runner turns each row's adapter into its slot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from torch import nn

from llama.args import ModelArgs
from llama.layers.lora import LORA_PRODUCTS, factor_dtype, use_lora_layers_
from llama.layers.tensor_parallel import full_shapes, holder_region
from llama.lora.adapter import LoraAdapter, LoraFactors, local_factors, read_adapter
from llama.lora.merge import layer_rank_factors
from llama.runtime import distributed

logger = logging.getLogger(__name__)

__all__ = ["ServedAdapters", "load_lora_adapters", "check_lora_options", "DEFAULT_LORA_PRODUCT"]

AdapterSource = Union[str, Path, LoraAdapter]

# The column-parallel layers among those adapters change (each rank holds some output rows); the
# others (wo, w2) are row-parallel
COLUMN = ("wq", "wk", "wv", "w1", "w3")

# How the LoRA layers compute the rows' low-rank products (llama.layers.lora): each row's factors
# gathered for one row, every slot's multiplied and masked for more (measured there).
DEFAULT_LORA_PRODUCT = "auto"


@dataclass
class ServedAdapters:
    """The adapters a model serves unmerged: each one's slot (1..``max_loras``; 0 is the base)
    and the folder it was read from, by name, in the order given (their factors are the LoRA
    layers' alone: the adapters as read are not kept)."""

    slots: dict[str, int] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)
    max_loras: int = 0
    max_lora_rank: int = 0
    load_seconds: float = 0.0  # reading and writing every adapter, in all

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def slot_of(self, name: Optional[str]) -> int:
        """The slot of adapter ``name`` (0 for None: the base); ValueError listing the loaded
        adapters for a name that is not one of them."""
        if name is None:
            return 0
        slot = self.slots.get(name)
        if slot is None:
            loaded = ", ".join(repr(n) for n in self.slots) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}: the adapters loaded are {loaded} "
                             "(Llama.build's lora_adapters, the server's --lora name=path)")
        return slot


def check_lora_options(adapters: Optional[Mapping[str, AdapterSource]], max_loras: Optional[int],
                       max_lora_rank: Optional[int]) -> None:
    """The LoRA options' types and ranges (ValueError/TypeError), before anything is loaded."""
    if adapters is None:
        if max_loras is not None or max_lora_rank is not None:
            raise ValueError("max_loras and max_lora_rank limit the adapters of lora_adapters: give lora_adapters too")
        return
    if not isinstance(adapters, Mapping):
        raise TypeError(f"lora_adapters must be a dict of name -> adapter folder (or LoraAdapter), "
                        f"got {type(adapters).__name__}")
    for name, source in adapters.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_adapters: an adapter's name must be a non-empty str, got {name!r}")
        if not isinstance(source, (str, Path, LoraAdapter)):
            raise TypeError(f"lora_adapters[{name!r}] must be an adapter folder (str or Path) or a LoraAdapter, "
                            f"got {type(source).__name__}")
    for option, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{option} must be an int >= 1, got {value!r}")
    if max_loras is not None and len(adapters) > max_loras:
        raise ValueError(f"{len(adapters)} LoRA adapters given for max_loras={max_loras} slots: give fewer adapters "
                         "or raise max_loras")


def _read(name: str, source: AdapterSource, params: ModelArgs) -> LoraAdapter:
    # Llama 4's routed experts (PEFT's target_parameters) too: served per expert (LoraExperts)
    return source if isinstance(source, LoraAdapter) else read_adapter(source, params, name=name, experts=True)


def _check_shapes(adapter: LoraAdapter, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every factor of ``adapter`` fits its layer of the whole model (``shapes``: Meta's weight
    shapes); ValueError naming the adapter, the layer and the shapes."""
    for name, factors in adapter.factors.items():
        stack = shapes.get(name)  # Llama 4's routed experts: (E, in, out), changed by b @ a per expert
        if stack is not None and len(stack) == 3:
            a, b = factors.a, factors.b
            if a.dim() != 3 or b.dim() != 3 or a.shape[0] != stack[0] or b.shape[0] != stack[0] \
                    or b.shape[1] != stack[1] or a.shape[2] != stack[2] or a.shape[1] != b.shape[2]:
                raise ValueError(f"LoRA adapter {adapter.name!r}: {name}'s factors a {list(a.shape)} and b "
                                 f"{list(b.shape)} do not fit its experts' matrices {list(stack)} (a [E, r, out], b "
                                 "[E, in, r]): an adapter made for another model?")
            continue
        shape = shapes.get(f"{name}.weight")
        if shape is None or len(shape) != 2:
            raise ValueError(f"LoRA adapter {adapter.name!r} changes {name!r}, which this model has no linear layer "
                             "of: an adapter made for another model?")
        out_f, in_f = shape
        a, b = factors.a, factors.b
        # a layer's rank may differ from the adapter's (PEFT's rank_pattern)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {name}'s A {list(a.shape)} and B {list(b.shape)} do not "
                             f"fit its weight {list(shape)} (A [r, in], B [out, r]): an adapter made for another "
                             "model, or a layer this library serves only merged (merge_lora)?")


def largest_rank(adapter: LoraAdapter) -> int:
    """The largest rank of ``adapter``'s layers (its ``r``, or a layer's own from PEFT's
    ``rank_pattern``)."""
    return max([adapter.rank, *(f.a.shape[-2] for f in adapter.factors.values())])  # experts' a: [E, r, out]


def local_slices(name: str, factors: LoraFactors, params: ModelArgs) -> LoraFactors:
    """This rank's slices of one layer's factors (:func:`~llama.lora.adapter.local_factors`): a
    column-parallel layer keeps A whole and its rows of B (its K/V heads' rows, copies where
    ranks outnumber them), a row-parallel one its columns of A and B whole, as the layer's
    weight is split (:func:`~llama.layers.tensor_parallel.holder_region`)."""
    world, rank = distributed.model_parallel_world_size(), distributed.model_parallel_rank()
    if factors.a.dim() == 3:  # Llama 4's routed experts: split as the merge splits them
        return layer_rank_factors(name, factors, params, world, rank)
    full = (factors.b.shape[0], factors.a.shape[1])
    (r0, r1), (c0, c1) = holder_region(f"{name}.weight", full, world, rank, "vocab", params.head_dim)
    column_parallel = name.rsplit(".", 1)[-1] in COLUMN
    region = (r0, r1) if column_parallel else (c0, c1)
    return local_factors(factors, column_parallel=column_parallel, rank=rank, world=world, region=region)


def load_lora_adapters(model: nn.Module, params: ModelArgs, adapters: Mapping[str, AdapterSource], *,
                       max_loras: Optional[int] = None, max_lora_rank: Optional[int] = None,
                       product: str = DEFAULT_LORA_PRODUCT) -> ServedAdapters:
    """Serve ``adapters`` (name -> adapter folder or :class:`~llama.lora.adapter.LoraAdapter`)
    unmerged on ``model``: every adapter read and checked (rank within ``max_lora_rank``, default
    the largest given; at most ``max_loras``, default as many as given; shapes that fit) before
    any LoRA layer is made, then a slot each, in order, and this rank's factors written there."""
    check_lora_options(adapters, max_loras, max_lora_rank)
    if product not in LORA_PRODUCTS:
        raise ValueError(f"LoRA product {product!r}: choose one of {', '.join(LORA_PRODUCTS)}")
    start = time.perf_counter()
    read = {name: _read(name, source, params) for name, source in adapters.items()}
    shapes = full_shapes(params)
    for adapter in read.values():
        _check_shapes(adapter, shapes)
    ranks = {name: largest_rank(adapter) for name, adapter in read.items()}
    rank_limit = max(ranks.values()) if max_lora_rank is None else max_lora_rank
    for name, rank in ranks.items():
        if rank > rank_limit:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank={rank_limit}: "
                             "raise max_lora_rank (--max_lora_rank)")
    n_slots = len(read) if max_loras is None else max_loras
    targets = sorted({layer for adapter in read.values() for layer in adapter.factors})
    layers = use_lora_layers_(model, targets, n_slots + 1, rank_limit, _dtype(model), product)
    served = ServedAdapters(max_loras=n_slots, max_lora_rank=rank_limit)
    for slot, (name, adapter) in enumerate(read.items(), start=1):
        for layer_name, layer in layers.items():
            factors = adapter.factors.get(layer_name)
            if factors is None:
                layer.set_lora_slot(slot, None, None, adapter.scale)
            else:
                local = local_slices(layer_name, factors, params)
                layer.set_lora_slot(slot, local.a, local.b, adapter.scale)
        served.slots[name] = slot
        served.paths[name] = str(adapter.path)
    served.load_seconds = time.perf_counter() - start
    logger.info("serving %d LoRA adapter(s) unmerged (%s; rank up to %d, %d layer(s)) in %.2f s",
                len(read), ", ".join(read), rank_limit, len(layers), served.load_seconds)
    return served


def _dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the LoRA factors of ``model`` (:func:`~llama.layers.lora.factor_dtype` of its
    activations' dtype, its ``dtype``: quantised weights are not)."""
    dtype = getattr(model, "dtype", None)
    device = getattr(model, "device", torch.device("cpu"))
    return factor_dtype(device, dtype if isinstance(dtype, torch.dtype) else torch.float32)

