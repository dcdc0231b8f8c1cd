"""The commands: ``hf_to_meta``, ``meta_to_hf``, ``reshard`` and ``merge_lora``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import torch

from llama.args import ModelArgs
from llama.checkpoint.shards import (
    CheckpointError,
    CheckpointInfo,
    find_shards,
    inspect_checkpoint,
    iter_rank_tensors,
    load_full_tensors,
)
from llama.convert.config import hf_config_to_params, multimodal_hf_config, params_to_hf_config
from llama.convert.files import (
    check_model_parallel_size,
    copy_tokenizer,
    read_tokenizer,
    slice_region,
    writes_directory,
)
from llama.convert.hf_weights import (
    HFWeights,
    check_config_against_weights,
    hf_source_name,
    llama4_prefixes,
    meta_tensor_reader,
    read_meta_args,
)
from llama.convert.mllama import (
    iter_mllama_hf_to_meta,
    mllama_config_to_params,
    mllama_meta_to_hf,
    mllama_params_to_hf_config,
    model_name,
)
from llama.convert.names import (
    DEFAULT_MAX_SHARD_SIZE_GB,
    HF_IGNORED_SUFFIXES,
    LLAMA4_VISION_PREFIXES,
    ROPE_PERMUTED,
    hf_name,
    layer_pattern,
    meta_to_hf_rope_rows,
)
from llama.convert.paths import PathLike, source_dir
from llama.layers.tensor_parallel import (
    choose_embedding_layout,
    full_shapes,
    holder_region,
    is_vision_tensor,
    shard_shape,
    tensor_names,
)
from llama.runtime.checks import positive_int, positive_number
from llama.runtime.json_file import read_json_object

logger = logging.getLogger(__name__)


@writes_directory
def hf_to_meta(src: PathLike, dst: Path, model_parallel_size: int = 1) -> None:
    """Convert a Hugging Face Llama directory to a Meta checkpoint.

    Reads ``config.json`` and the weights (``model.safetensors``, sharded safetensors
    with ``model.safetensors.index.json``, or ``pytorch_model*.bin``); writes
    ``params.json`` and ``consolidated.00.pth .. consolidated.{N-1}.pth`` split over
    ``model_parallel_size`` ranks, in the weights' own dtype.  ``tok_embeddings`` is
    split over the vocabulary when it divides, else over dim (the rule ``Llama.build``
    applies to an unsplit checkpoint).  ``output.weight`` is always split over the
    vocabulary, so every allowed size divides it and the result is a vocabulary split.
    Tied HF embeddings (no ``lm_head``) are written as ``output.weight`` too.
    ``tokenizer.model`` is copied from ``original/`` (Llama 3 repos) or the top level.
    A ``Llama4ForConditionalGeneration`` converts whole: its image encoder too (params.json's
    ``vision_args``, Meta's ``vision_embeddings.*`` and ``vision_projection`` tensors, split
    as Meta's are), unless its ``vision_config`` has no Meta equivalent (logged: the text
    model alone is converted).  A ``MllamaForConditionalGeneration`` (Llama 3.2 Vision) becomes
    Meta's ``text_model.*`` / ``vision_model.*`` checkpoint (:mod:`llama.convert.mllama`).

    Args:
        src: the HF model directory.
        dst: output directory: absent or empty; written complete or not at all.
        model_parallel_size: number of shards to write.
    """
    positive_int("model_parallel_size", model_parallel_size)
    src = source_dir(src)
    config = read_json_object(src / "config.json", "is it a Hugging Face model directory?", "model settings")
    if config.get("model_type") == "mllama":
        _mllama_hf_to_meta(src, dst, config, model_parallel_size)
        return
    params = hf_config_to_params(config)
    args = ModelArgs.from_dict(params)
    weights = HFWeights(src)
    prefixes = llama4_prefixes(weights) if args.is_llama4 else ("model.", "lm_head.")
    check_config_against_weights(weights, args, prefixes[0])  # before anything is listed per layer
    n = check_model_parallel_size(model_parallel_size, args)
    tied = bool(config.get("tie_word_embeddings", False))
    layout = choose_embedding_layout(None, args, n)  # vocab split whenever vocab % n == 0
    read = meta_tensor_reader(weights, args, tied)
    shapes = full_shapes(args)
    expected = {hf_source_name(name, args, prefixes) for name in tensor_names(args)}
    extra = sorted(k for k in set(weights.location) - expected if not k.endswith(HF_IGNORED_SUFFIXES))
    vision = [k for k in extra if k.startswith(LLAMA4_VISION_PREFIXES)]
    if vision:
        logger.info("%s: skipping %d vision tensors (only the text model is converted: config.json's "
                    "vision_config is missing or has no Meta equivalent)", src, len(vision))
    extra = [k for k in extra if k not in vision]
    if extra:
        logger.warning("%s: ignoring tensors a Meta checkpoint has no place for: %s", src, extra[:5])

    (dst / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    # One output shard at a time: memory holds that shard plus one source tensor;
    # each source tensor is read once per shard (from the page cache after the first).
    for rank in range(n):
        shard = {}
        for name in tensor_names(args):
            region = holder_region(name, shapes[name], n, rank, layout, args.head_dim)
            shard[name] = slice_region(read(name), region)
        path = dst / f"consolidated.{rank:02d}.pth"
        torch.save(shard, path)
        logger.info("wrote %s (%d tensors)", path, len(shard))
        del shard
    copy_tokenizer([src / "original" / "tokenizer.model", src / "tokenizer.model"], dst)


class _HFTensors(Mapping[str, torch.Tensor]):
    """An HF checkpoint's tensors by name, each read whole when asked for."""

    def __init__(self, weights: HFWeights) -> None:
        self.weights = weights

    def __contains__(self, name: object) -> bool:
        return name in self.weights.location

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.weights.location:
            raise CheckpointError(f"{self.weights.src} has no tensor {name!r}: is it a complete "
                                  "MllamaForConditionalGeneration checkpoint?")
        return self.weights.get_region(name, [(0, n) for n in self.weights.shape(name)])

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights.location)

    def __len__(self) -> int:
        return len(self.weights.location)


def _mllama_hf_to_meta(src: Path, dst: Path, config: dict, model_parallel_size: int) -> None:
    """:func:`hf_to_meta` for a ``MllamaForConditionalGeneration``: one output shard at a time,
    each HF tensor read once per shard (memory: one shard plus one tensor)."""
    params = mllama_config_to_params(config)
    args = ModelArgs.from_dict(params)
    n = check_model_parallel_size(model_parallel_size, args)
    layout = choose_embedding_layout(None, args, n)
    weights = _HFTensors(HFWeights(src))
    shapes = full_shapes(args)
    (dst / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    for rank in range(n):
        shard = {}
        for name, t in iter_mllama_hf_to_meta(weights, args):
            ours = model_name(name)
            if tuple(t.shape) != shapes[ours]:
                raise CheckpointError(f"{src}: Meta's {name!r} comes out of the weights with shape {list(t.shape)}, "
                                      f"but config.json implies {list(shapes[ours])}: use the config.json that came "
                                      "with these weights")
            shard[name] = slice_region(t, holder_region(ours, shapes[ours], n, rank, layout, args.head_dim))
        path = dst / f"consolidated.{rank:02d}.pth"
        torch.save(shard, path)
        logger.info("wrote %s (%d tensors)", path, len(shard))
        del shard
    copy_tokenizer([src / "original" / "tokenizer.model", src / "tokenizer.model"], dst)


def _shard_groups(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    total = 0
    for name in names:
        if groups[-1] and total + sizes[name] > max_bytes:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += sizes[name]
    return groups


def _keep_experts_together(groups: list[list[str]]) -> list[list[str]]:
    """Move an experts' w3 into the group of its w1 (they form one HF tensor)."""
    out = [list(g) for g in groups]
    for i, group in enumerate(out):
        for name in list(group):
            if name.endswith("experts.w1"):
                partner = name[: -len("w1")] + "w3"
                for other in out[i + 1 :]:
                    if partner in other:
                        other.remove(partner)
                        group.append(partner)
    return [g for g in out if g]


def _hf_output_name(name: str, args: ModelArgs) -> str:
    """The name :func:`meta_to_hf` writes Meta's ``name`` under: a ``Llama4ForConditionalGeneration``'s
    (text model under ``language_model.``, as published) for a model with an image encoder."""
    hf = hf_name(name, llama4=args.is_llama4)
    if args.vision_args is None or is_vision_tensor(name):
        return hf
    return "language_model." + hf


def _to_hf_tensors(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names and layouts for full Meta tensors (a Llama 4 experts' w1 and w3 together)."""
    state = {}
    for name, t in tensors.items():
        key = layer_pattern(name)[0]
        heads_field = ROPE_PERMUTED.get(key)
        if heads_field is not None and not args.is_llama4:
            t = meta_to_hf_rope_rows(t, getattr(args, heads_field))
        elif key.endswith("router_DE"):
            t = t.t()
        elif key.endswith("experts.w3"):
            continue  # written with w1
        elif key.endswith("experts.w1"):
            t = torch.cat([t, tensors[name[: -len("w1")] + "w3"]], dim=-1)
        state[_hf_output_name(name, args)] = t.contiguous()
    return state


@writes_directory
def meta_to_hf(
    src: PathLike,
    dst: Path,
    max_position_embeddings: Optional[int] = None,
    max_shard_size_gb: float = DEFAULT_MAX_SHARD_SIZE_GB,
) -> None:
    """Convert a Meta checkpoint (any number of shards) to a Hugging Face Llama directory.

    Writes ``config.json`` and the weights as ``model.safetensors``, or, when larger
    than ``max_shard_size_gb``, as ``model-0000K-of-0000M.safetensors`` with
    ``model.safetensors.index.json``.  With a ``tokenizer.model``, copies it and writes
    the Hugging Face tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with
    the chat template, ``special_tokens_map.json``) and ``generation_config.json`` (the
    stop tokens), made by :mod:`llama.convert.hf_tokenizer`: ``LlamaForCausalLM`` and
    ``AutoTokenizer.from_pretrained`` load the directory with nothing else installed.  A Llama 4
    checkpoint with an image encoder (params.json's ``vision_args``) is written as a
    ``Llama4ForConditionalGeneration`` (the text model under ``language_model.``, the encoder as
    ``vision_model.`` and ``multi_modal_projector.``); its image token ids are the tokenizer's.

    Args:
        src: the Meta checkpoint directory (``params.json``, ``consolidated.*.pth``).
        dst: output directory: absent or empty; written complete or not at all.
        max_position_embeddings: written to config.json (Meta's params.json has no such
            field); default 131072 with scaled RoPE, 8192 for rope_theta >= 5e5, else 4096.
        max_shard_size_gb: largest safetensors file, in GB (10**9 bytes).
    """
    if max_position_embeddings is not None:
        positive_int("max_position_embeddings", max_position_embeddings)
    max_shard_size_gb = positive_number("max_shard_size_gb", max_shard_size_gb)
    src = source_dir(src)
    shards = find_shards(src)
    args = read_meta_args(src, shards)
    info = inspect_checkpoint(shards, args)
    tokenizer = read_tokenizer(src / "tokenizer.model")

    from safetensors.torch import save_file

    if args.has_cross_attention:  # Llama 3.2 Vision: its tensors are renamed and reshaped as a whole
        tensors = load_full_tensors(info, args, tensor_names(args))
        meta = {(k if k.startswith("vision_model.") else "text_model." + k): t for k, t in tensors.items()}
        del tensors
        state = {k: t.contiguous() for k, t in mllama_meta_to_hf(meta, args).items()}
        del meta
        _save_safetensors(state, dst, max_shard_size_gb)
        text = params_to_hf_config(args, info.dtype, max_position_embeddings,
                                   tokenizer.bos_id if tokenizer else None, tokenizer.eos_id if tokenizer else None)
        config = mllama_params_to_hf_config(args, text, image_token_index=args.vocab_size)
        if tokenizer is not None and tokenizer.n_words != args.vocab_size:
            raise ValueError(f"tokenizer.model has {tokenizer.n_words} tokens but params.json's vocab_size is "
                             f"{args.vocab_size}: a Llama 3.2 Vision checkpoint's <|image|> is the row past both")
        _write_hf_config_and_tokenizer(src, dst, config, tokenizer, image_row=True)
        return
    # One output file's tensors are merged in memory at a time, in the checkpoint's dtype.
    itemsize = torch.empty(0, dtype=info.dtype).element_size()
    shapes = full_shapes(args)
    names = tensor_names(args)
    sizes = {name: math.prod(shapes[name]) * itemsize for name in names}
    groups = _shard_groups(names, sizes, int(max_shard_size_gb * 1e9))
    if args.is_llama4:
        groups = _keep_experts_together(groups)
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
    ]
    weight_map = {}
    for file, group in zip(files, groups):
        state = _to_hf_tensors(load_full_tensors(info, args, group), args)
        save_file(state, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in state})
        del state
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    logger.info("wrote %d tensors to %d safetensors file(s) in %s", len(names), len(groups), dst)

    config = params_to_hf_config(
        args, info.dtype, max_position_embeddings,
        tokenizer.bos_id if tokenizer else None, tokenizer.eos_id if tokenizer else None,
    )
    if args.vision_args is not None:
        special = getattr(tokenizer, "special_tokens", {}) if tokenizer is not None else {}
        ids = [special.get(t, default) for t, default in
               (("<|patch|>", 200092), ("<|image_start|>", 200080), ("<|image_end|>", 200081))]
        config = multimodal_hf_config(config, args.vision_args, *ids)
    _write_hf_config_and_tokenizer(src, dst, config, tokenizer)


def _write_hf_config_and_tokenizer(src: Path, dst: Path, config: dict, tokenizer, image_row: bool = False) -> None:
    """``image_row``: Llama 3.2 Vision's tokenizer files (``<|image|>`` at the row past the vocabulary)."""
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        copy_tokenizer([src / "tokenizer.model"], dst)
        from llama.convert.hf_tokenizer import hf_tokenizer_files

        context = config.get("text_config", config)["max_position_embeddings"]
        for name, content in hf_tokenizer_files(tokenizer, context, image_row=image_row).items():
            (dst / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_safetensors(state: dict[str, torch.Tensor], dst: Path, max_shard_size_gb: float) -> None:
    """``state`` as ``model.safetensors``, or in files of at most ``max_shard_size_gb`` with an index."""
    from safetensors.torch import save_file

    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    groups = _shard_groups(list(state), sizes, int(max_shard_size_gb * 1e9))
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
    ]
    weight_map = {}
    for file, group in zip(files, groups):
        save_file({k: state[k] for k in group}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in group})
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    logger.info("wrote %d tensors to %d safetensors file(s) in %s", len(state), len(groups), dst)


@writes_directory
def reshard(src: PathLike, dst: Path, model_parallel_size: int) -> None:
    """Rewrite a Meta checkpoint split over ``model_parallel_size`` shards.

    The offline form of what ``Llama.build`` does at load time, with the same shard
    table and code: with more shards than K/V heads, each K/V head is copied into
    consecutive shards.  The embedding keeps the source's split when it divides, else
    the vocabulary is split.  Shards are built one at a time (memory: one output shard),
    in the checkpoint's dtype; ``params.json`` and ``tokenizer.model`` are copied.

    Args:
        src: the Meta checkpoint directory.
        dst: output directory: absent or empty; written complete or not at all.
        model_parallel_size: number of shards to write; must be one the model allows.
    """
    positive_int("model_parallel_size", model_parallel_size)
    src = source_dir(src)
    shards = find_shards(src)
    args = read_meta_args(src, shards)
    info = inspect_checkpoint(shards, args)
    n = check_model_parallel_size(model_parallel_size, args)
    layout = _write_shards(src, dst, info, args, n)
    logger.info("resharded %s (%d shards) into %s (%d shards, %s embedding split)", src, info.n_shards, dst, n, layout)



def _write_shards(src: Path, dst: Path, info: CheckpointInfo, args: ModelArgs, n: int,
                  change: Optional[Callable[[Iterator[tuple[str, torch.Tensor]], int],
                                            Iterator[tuple[str, torch.Tensor]]]] = None) -> str:
    """Write checkpoint ``src`` (``info``, ``args``) into ``dst`` as ``n`` shards, one at a time (memory:
    one output shard), in its dtype, each rank's (name, tensor) stream passed through ``change(tensors,
    rank)`` where given; copy ``params.json`` and ``tokenizer.model``.  Returns the embedding split used."""
    layout = choose_embedding_layout(info.embedding_layout, args, n)
    shapes = full_shapes(args)
    cpu = torch.device("cpu")
    for rank in range(n):
        local = {
            name: torch.Size(shard_shape(name, shapes[name], n, rank, layout, args.head_dim))
            for name in tensor_names(args)
        }
        tensors = iter_rank_tensors(info, args, local, layout, n, rank, cpu, info.dtype)
        state = dict(change(tensors, rank) if change is not None else tensors)
        path = dst / f"consolidated.{rank:02d}.pth"
        torch.save(state, path)
        logger.info("wrote %s", path)
        del state
    shutil.copyfile(src / "params.json", dst / "params.json")
    if (src / "tokenizer.model").is_file():
        shutil.copyfile(src / "tokenizer.model", dst / "tokenizer.model")
    return layout

def merge_lora(src: PathLike, adapter: PathLike, dst: PathLike, model_parallel_size: Optional[int] = None) -> None:
    """Write the Meta checkpoint ``src`` with the PEFT LoRA adapter in folder ``adapter`` folded in
    (``W += scale * B @ A``, in float32, each weight then stored in the checkpoint's dtype) to ``dst``.

    The adapter is read and checked against ``params.json`` first
    (:func:`llama.lora.adapter.read_adapter`); each output shard is then built as
    :func:`reshard` builds it, with the adapter merged into the weights it changes on that
    shard's slice (:func:`llama.lora.merge.merged_tensors`, what ``Llama.build(..., lora=)``
    does at load time).  ``params.json`` and ``tokenizer.model`` are copied.

    Args:
        src: the base model's Meta checkpoint directory (a Hugging Face folder: convert it with
            ``hf_to_meta`` first).
        adapter: the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).
        dst: output directory: absent or empty; written complete or not at all.
        model_parallel_size: number of shards to write (default: the base's).
    """
    _merge_lora(src, dst, adapter=adapter, model_parallel_size=model_parallel_size)


@writes_directory
def _merge_lora(src: Path, dst: Path, *, adapter: PathLike, model_parallel_size: Optional[int]) -> None:
    from llama.lora.adapter import read_adapter
    from llama.lora.merge import merged_tensors

    if model_parallel_size is not None:
        positive_int("model_parallel_size", model_parallel_size)
    if not (src / "params.json").is_file() and (src / "config.json").is_file():
        raise ValueError(f"{src} is a Hugging Face folder: merge_lora reads a Meta checkpoint; convert it first "
                         f"(python -m llama.convert hf_to_meta {src} META_DIR)")
    shards = find_shards(src)
    args = read_meta_args(src, shards)
    lora = read_adapter(Path(str(adapter)), args, experts=True)  # checked against the base before anything is written
    info = inspect_checkpoint(shards, args)
    n = check_model_parallel_size(info.n_shards if model_parallel_size is None else model_parallel_size, args)
    _write_shards(src, dst, info, args, n, change=lambda tensors, rank: merged_tensors(tensors, lora, args, n, rank))
    logger.info("merged LoRA adapter %s into %s (%d shards): %s (%d shards)", adapter, src, info.n_shards, dst, n)
