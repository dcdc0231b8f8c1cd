"""Loading a Hugging Face model folder directly: ``config.json`` and safetensors weights, read
lazily, each rank reading only its own slices, as the Meta loader reads Meta's shards.

The names, the RoPE row order, Llama 4's router and experts, and ``config.json`` ->
``params.json`` are :mod:`llama.convert`'s (:func:`~llama.convert.config.hf_config_to_params`,
:class:`~llama.convert.hf_weights.MetaRegionReader`): what ``python -m llama.convert
hf_to_meta`` writes is what is loaded here, without writing it.  The split of every tensor
over ranks is :func:`llama.layers.tensor_parallel.holder_region`'s, as for Meta's shards, so
any process count the model's shapes allow works.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from llama.args import ModelArgs
from llama.checkpoint.shards import CheckpointError
from llama.convert.config import hf_config_to_params
from llama.convert.hf_weights import (
    HFWeights,
    MetaRegionReader,
    check_config_against_weights,
    hf_source_name,
    llama4_prefixes,
)
from llama.convert.names import HF_IGNORED_SUFFIXES, LLAMA4_VISION_PREFIXES
from llama.layers.tensor_parallel import full_shapes, holder_region, tensor_names
from llama.runtime.finite import check_finite_weight
from llama.runtime.json_file import read_json_object

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFCheckpoint:
    """A Hugging Face model folder, checked: its ``config.json`` as :class:`ModelArgs`, and its
    weights' table of contents (nothing read yet)."""

    path: Path
    config: Mapping[str, Any]
    args: ModelArgs
    weights: HFWeights
    tied: bool  # no lm_head: the output layer is the embedding (tie_word_embeddings)
    dtype: torch.dtype  # the embedding's, as stored

    @property
    def n_files(self) -> int:
        return len(set(self.weights.location.values()))


def open_hf_checkpoint(ckpt_dir: Path, **overrides: Any) -> HFCheckpoint:
    """Read ``config.json`` (into :class:`ModelArgs`, with ``overrides`` such as
    ``max_seq_len``) and the weights' headers, and check every tensor the model needs is
    there with the shape ``config.json`` implies, before anything is built or read.
    ValueError / :class:`CheckpointError` naming the file otherwise."""
    ckpt_dir = Path(ckpt_dir)
    config = read_json_object(ckpt_dir / "config.json", "a Hugging Face model folder holds one", "model settings")
    try:
        args = ModelArgs.from_dict(hf_config_to_params(config), **overrides)
    except ValueError as e:
        raise ValueError(f"{ckpt_dir / 'config.json'}: {e}") from None
    weights = HFWeights(ckpt_dir)
    prefixes = llama4_prefixes(weights) if args.is_llama4 else ("model.", "lm_head.")
    check_config_against_weights(weights, args, prefixes[0])
    tied = bool(config.get("tie_word_embeddings", False)) or (
        args.is_llama4 and isinstance(config.get("text_config"), Mapping)
        and bool(config["text_config"].get("tie_word_embeddings", False)))
    read = MetaRegionReader(weights, args, tied)
    expected = set()
    for name in tensor_names(args):  # every tensor's header checked, nothing read
        read.check(name)
        expected.add(hf_source_name(name, args, prefixes))
    extra = sorted(k for k in set(weights.location) - expected if not k.endswith(HF_IGNORED_SUFFIXES))
    vision = [k for k in extra if k.startswith(LLAMA4_VISION_PREFIXES)]
    if vision:
        logger.info("%s: skipping %d vision tensors (the image encoder is not loaded; text only)",
                    ckpt_dir, len(vision))
    extra = [k for k in extra if k not in vision and not (tied and k.endswith("lm_head.weight"))]
    if extra:
        logger.warning("%s: ignoring tensors this model has no place for: %s", ckpt_dir, extra[:5])
    embedding = hf_source_name("tok_embeddings.weight", args, prefixes)
    dtype = weights.dtype(embedding)
    return HFCheckpoint(ckpt_dir, config, args, weights, tied, dtype)


def iter_hf_rank_tensors(
    ckpt: HFCheckpoint,
    local_shapes: Mapping[str, torch.Size],
    target_layout: str,
    world_size: int,
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensors named in ``local_shapes``, one at a time and in that order, as
    :func:`llama.checkpoint.shards.iter_rank_tensors` gives them from Meta's shards: (Meta
    name, tensor of that shape on ``device`` in ``dtype``), each made from only its own part
    of the HF tensor that holds it."""
    args = ckpt.args
    shapes = full_shapes(args)
    unknown = set(local_shapes) - set(shapes)
    if unknown:
        raise KeyError(f"not tensors of this model: {sorted(unknown)[:5]}")
    read = MetaRegionReader(ckpt.weights, args, ckpt.tied)
    for name, shape in local_shapes.items():
        region = holder_region(name, shapes[name], world_size, rank, target_layout, args.head_dim)
        source = read(name, region)
        if tuple(source.shape) != tuple(shape):
            raise CheckpointError(f"internal error: {name!r} read as {list(source.shape)}, expected {list(shape)}")
        out = torch.empty(shape, dtype=dtype, device=device)
        out.copy_(source)
        check_finite_weight(out, name, read.file(name), source)
        del source
        yield name, out
        del out  # the caller holds the only reference now

