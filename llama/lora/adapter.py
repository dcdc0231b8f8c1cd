"""A LoRA adapter in this library's terms: low-rank factors keyed by the Meta-named linear
layer they change.

A layer ``y = x @ W.T`` with an adapter becomes ``y = x @ W.T + scale * (x @ A.T) @ B.T``,
with ``A`` of shape ``[r, in_features]`` and ``B`` of shape ``[out_features, r]`` (PEFT's
``lora_A.weight`` and ``lora_B.weight``), ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with rsLoRA).  Merged, ``W' = W + scale * B @ A``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from llama.args import ModelArgs


@dataclass(frozen=True)
class LoraFactors:
    """One layer's factors, whole (not split over ranks), in Meta's row order (the rows of
    ``wq``'s and ``wk``'s ``B`` already permuted back from Hugging Face's rotary order)."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter read for one base model.

    ``factors`` is keyed by the layer's name in Meta's ``Transformer`` (as
    ``model.named_modules()`` gives it), e.g. ``"layers.0.attention.wq"``,
    ``"layers.3.feed_forward.w2"``; layers the adapter does not target are absent.
    """

    name: str
    path: Path
    rank: int
    scale: float
    factors: dict[str, LoraFactors] = field(default_factory=dict)
    base_model: Optional[str] = None  # adapter_config.json's base_model_name_or_path, if given


def read_adapter(path: Union[str, Path], params: ModelArgs, name: Optional[str] = None, *,
                 experts: bool = False) -> LoraAdapter:
    """The Hugging Face PEFT LoRA adapter in folder ``path`` (``adapter_config.json`` and
    ``adapter_model.safetensors`` or ``adapter_model.bin``), read for the base model of
    ``params``: its factors keyed by Meta's layer names, ``wq``'s and ``wk``'s B rows in Meta's
    order, the scale from ``lora_alpha`` and ``r`` (rsLoRA's ``lora_alpha / sqrt(r)`` with
    ``use_rslora``), per-layer ranks and alphas (``rank_pattern`` / ``alpha_pattern``) folded
    into B so that every layer's change is ``scale * B @ A``.  ``name``: the adapter's name
    (default: the folder's).

    ``experts``: also read Llama 4's routed experts where the adapter changes them (PEFT's
    ``target_parameters``: ``feed_forward.experts.gate_up_proj`` / ``down_proj``), as 3-D
    factors keyed by Meta's tensor names ``"layers.{i}.feed_forward.experts.w1"`` (``w3``,
    ``w2``): ``a`` [E, r, d2] and ``b`` [E, d1, r], ``scale * b @ a`` the change of the [E, d1, d2]
    tensor (Meta's [E, dim, hidden] w1/w3, [E, hidden, dim] w2), merged (:mod:`llama.lora.merge`)
    or served unmerged per expert (:class:`llama.layers.lora.LoraExperts`); without ``experts``
    such an adapter is refused.

    Everything is checked against ``params`` from the config and the weight file's header
    before a tensor is read: ValueError naming the field or tensor (DoRA, ``modules_to_save``,
    biases, the embedding or output layer, a layer or shape the base does not have, ...);
    FileNotFoundError for a missing folder or file.  The reading is
    :func:`llama.lora.peft.read_peft_adapter`'s (imported when called, so that this module,
    which the model's layers import, imports nothing of the checkpoint readers)."""
    from llama.lora.peft import read_peft_adapter

    return read_peft_adapter(path, params, name, experts=experts)


def local_factors(factors: LoraFactors, *, column_parallel: bool, rank: int, world: int,
                  region: Optional[tuple[int, int]] = None) -> LoraFactors:
    """The part of ``factors`` that rank ``rank`` of ``world`` applies to its slice of the layer.

    A column-parallel layer (``wq wk wv w1 w3``: each rank holds some output rows) keeps A whole
    and takes its rows of B; a row-parallel layer (``wo w2``: each rank holds some input
    columns) takes its columns of A and keeps B whole, and its small partial product
    ``x_local @ A_local.T`` (r wide) goes through the layer's own all-reduce with the rest.
    The sum over ranks of each rank's ``B_local @ A_local`` placed in its slice is ``B @ A``.
    (Stacked experts' 3-D factors split the same way along their last two axes: B's rows or
    A's columns.)

    ``region``: the [start, end) of the split dimension this rank holds, where the layer is not
    split evenly (a K/V projection over more ranks than K/V heads copies each head onto several
    ranks: :func:`llama.layers.tensor_parallel.holder_region` gives it); default: the ``rank``-th
    of ``world`` equal parts (ValueError if they are not equal)."""
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be in 0..world-1 with world >= 1, got rank={rank}, world={world}")
    size = factors.b.shape[-2] if column_parallel else factors.a.shape[-1]
    if region is None:
        if size % world:
            raise ValueError(f"a layer of {size} {'output rows' if column_parallel else 'input columns'} does not "
                             f"split evenly over {world} ranks: give this rank's region")
        part = size // world
        region = (rank * part, (rank + 1) * part)
    start, end = region
    if not 0 <= start < end <= size:
        raise ValueError(f"region {region} is not within the layer's {size} "
                         f"{'output rows' if column_parallel else 'input columns'}")
    if column_parallel:
        return LoraFactors(a=factors.a, b=factors.b[..., start:end, :])
    return LoraFactors(a=factors.a[..., start:end], b=factors.b)
