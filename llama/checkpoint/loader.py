"""Loading a Meta-format checkpoint into a model on this process's share of the ranks.

Two calls into checkpoint code (inspect the files; read this rank's slice), with
the process group joined in between, and a memory check before anything is read.  A
quantised model is quantised while it is read: each linear layer (or stack of experts)
as soon as its slice is in, so a rank never holds more than one layer in full precision.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union, cast

import torch
from torch import nn

from llama.args import ModelArgs
from llama.checkpoint.hf import iter_hf_rank_tensors, open_hf_checkpoint
from llama.checkpoint.layout import checkpoint_layout, find_tokenizer
from llama.checkpoint.memory import check_memory, paged_kv_slots
from llama.checkpoint.shards import CheckpointInfo, find_shards, inspect_checkpoint, iter_rank_tensors
from llama.layers.packing import return_freed_memory
from llama.layers.policy import KernelPolicy
from llama.layers.quantize import (
    check_int4_group_size,
    int4_group_size,
    int8_siblings_as_one_,
    quantizable,
    quantized_module,
    require_int8_activation_kernel,
    require_w8a8_device,
    use_int8_activations_,
)
from llama.layers.tensor_parallel import choose_embedding_layout, valid_model_parallel_sizes
from llama.lora.adapter import read_adapter
from llama.lora.merge import merge_memory_bytes, merged_tensors
from llama.model import Transformer
from llama.runtime import devices, distributed
from llama.runtime.checks import positive_int
from llama.runtime.options import DEFAULT_KV_BLOCK_SIZE, QUANTIZATION_MODES, check_kv_cache_tokens
from llama.runtime.progress import Progress, counted
from llama.tokenizer import Tokenizer, decodable_vocab_size, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a checkpoint is loaded (see :meth:`llama.Llama.build` for each option), checked once,
    when made: ValueError/TypeError naming the option.  ``device`` and ``dtype`` are resolved
    (None: CUDA in bfloat16 where there is one, else the CPU in float32), and so is the int4
    group size (None: 128)."""

    max_seq_len: int
    max_batch_size: int
    model_parallel_size: Optional[int] = None
    device: Union[str, torch.device, None] = None
    dtype: Union[str, torch.dtype, None] = None
    quantize: Optional[str] = None
    quantize_group_size: Optional[int] = None
    prefill_chunk: int = 512
    kv_cache_tokens: Optional[int] = None  # the paged KV cache's tokens (default max_batch_size * max_seq_len)
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    vision: bool = True  # build Llama 4's image encoder where the checkpoint has one (False: skip its weights)

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_batch_size", "prefill_chunk"):
            positive_int(name, getattr(self, name))
        if self.model_parallel_size is not None:
            positive_int("model_parallel_size", self.model_parallel_size)
        if not isinstance(self.vision, bool):
            raise TypeError(f"vision must be True or False, got {self.vision!r}")
        if self.quantize is not None and self.quantize not in QUANTIZATION_MODES:
            raise ValueError(f"quantize must be None or one of {QUANTIZATION_MODES}, got {self.quantize!r}")
        device = devices.resolve_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", devices.resolve_dtype(self.dtype, device))
        object.__setattr__(self, "quantize_group_size", int4_group_size(self.quantize, self.quantize_group_size))
        positive_int("kv_block_size", self.kv_block_size)
        object.__setattr__(self, "kv_cache_tokens",
                           check_kv_cache_tokens(self.kv_cache_tokens, self.max_batch_size, self.max_seq_len))


def load_model(ckpt_dir: Union[str, Path], tokenizer_path: Union[str, Path, None], options: LoadOptions,
               policy: KernelPolicy, *, replicated: bool = False,
               lora: Union[str, Path, None] = None,
               tokenizer: Optional[Tokenizer] = None) -> tuple[Transformer, Tokenizer]:
    """This rank's model (weights loaded, quantised if asked, RoPE table set up, eval mode)
    and the tokenizer; with Llama 4's image encoder where the checkpoint has one (params.json's
    ``vision_args``; kept in ``dtype``, never quantised), unless ``options.vision`` is False,
    which leaves its weights unread.  ``ckpt_dir``: Meta's ``params.json`` + ``consolidated.NN.pth``, or a
    Hugging Face folder (``config.json`` + safetensors, :mod:`llama.checkpoint.hf`), told apart
    by :func:`~llama.checkpoint.layout.checkpoint_layout`; ``tokenizer_path`` None: the
    checkpoint's own (:func:`~llama.checkpoint.layout.find_tokenizer`).  ``policy``: the kernel
    policy the model will run with, decided by the caller once (:meth:`llama.Llama.build`;
    w8a8 reads from it how this CPU quantises activations).  ``replicated``: every rank loads
    the whole model (a draft model, :mod:`llama.engine.draft`), built as if alone
    (:func:`~llama.runtime.distributed.alone`, within which it must also run), after joining
    the job's process group as any model does.  ``lora``: a PEFT LoRA adapter folder folded into
    the weights as they are read (:mod:`llama.lora.merge`), before any quantisation; read and
    checked against the model before the process group is joined.  ``tokenizer``: the one at
    ``tokenizer_path`` (or the checkpoint's own), already loaded by the caller, which is then not
    read again (a Llama 3 or 4 tokenizer takes 0.3-1 s); it is checked against the model as a
    loaded one is."""
    start = time.perf_counter()
    max_seq_len, max_batch_size, quantize = options.max_seq_len, options.max_batch_size, options.quantize
    device, dtype = cast(torch.device, options.device), cast(torch.dtype, options.dtype)  # resolved by LoadOptions
    if quantize == "w8a8":  # before loading anything
        require_w8a8_device(device)
        require_int8_activation_kernel(policy.int8_activation_reduce_range)
    ckpt_dir = Path(ckpt_dir)
    # Check the files before joining the process group: a typo should fail fast.
    kind = checkpoint_layout(ckpt_dir)  # Meta's files or a Hugging Face folder, read from the files
    if tokenizer_path is None:
        tokenizer_path = find_tokenizer(ckpt_dir, kind)
    hf, info = None, None
    if kind == "hf":
        hf = open_hf_checkpoint(ckpt_dir, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_path)
        args = hf.args
        if not options.vision:
            args.vision_args = None  # its tensors are skipped as a text-only model's would be
        decodable_vocab_size(tokenizer, args.vocab_size, tokenizer_path)  # refuses another model's tokenizer
        stored_layout, files = None, f"{hf.n_files} Hugging Face weight file(s)"  # HF tensors are whole
    else:
        shards = find_shards(ckpt_dir)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_path)
        args = ModelArgs.from_json(ckpt_dir / "params.json", max_seq_len=max_seq_len, max_batch_size=max_batch_size)
        if args.vocab_size == -1:
            args.vocab_size = tokenizer.n_words
        decodable_vocab_size(tokenizer, args.vocab_size, tokenizer_path)  # refuses another model's tokenizer
        if not options.vision:
            args.vision_args = None  # the image encoder's tensors are skipped, as a text-only model's are
            # Llama 3.2 Vision: the text model alone (its self-attention layers: Meta's text-only inference)
            args.vision_chunk_size, args.mllama_vision_args = -1, None
        info = inspect_checkpoint(shards, args)
        stored_layout, files = info.embedding_layout, f"{info.n_shards} shard(s)"
    # The adapter is small: read and checked before anything else is.
    adapter = read_adapter(lora, args, experts=True) if lora is not None else None
    world_size = distributed.planned_model_parallel_size()
    if not replicated and world_size not in valid_model_parallel_sizes(args):
        raise ValueError(
            f"this model cannot be split over {world_size} processes; "
            f"model-parallel sizes that work: {valid_model_parallel_sizes(args)}"
        )
    rank, world_size = distributed.init_model_parallel(device, options.model_parallel_size)
    if replicated:
        distributed.make_alone_group()
        rank, world_size = 0, 1  # this rank's slice is the whole model
    layout = choose_embedding_layout(stored_layout, args, world_size)
    with torch.device("meta"), distributed.alone() if replicated else contextlib.nullcontext():
        model = Transformer(args, embedding_layout=layout)
    if quantize == "int4":  # the layer widths are known now: refuse a group size before reading weights
        group_size = cast(int, options.quantize_group_size)  # LoadOptions gives int4 its group size
        check_int4_group_size(model, group_size, device, valid_model_parallel_sizes(args))
    # The engine prefills at most prefill_chunk tokens a step, over up to max_batch_size
    # rows padded to the longest, through a mask when they follow cached tokens.
    check_memory(model, dtype, device, prefill_batch=max_batch_size,
                 prefill_tokens=min(options.prefill_chunk, max_seq_len), prefill_masked=True,
                 quantize=quantize, group_size=options.quantize_group_size,
                 kv_cache_slots=paged_kv_slots(cast(int, options.kv_cache_tokens), options.kv_block_size),  # resolved
                 merge_bytes=merge_memory_bytes(model, adapter, dtype) if adapter is not None else 0)
    local_shapes = {name: t.shape for name, t in model.state_dict().items()}
    if hf is not None:
        tensors = iter_hf_rank_tensors(hf, local_shapes, layout, world_size, rank, device, dtype)
    else:
        tensors = iter_rank_tensors(cast(CheckpointInfo, info), args, local_shapes, layout, world_size, rank,
                                    device, dtype)
    if adapter is not None:
        tensors = merged_tensors(tensors, adapter, args, world_size, rank)
    with Progress(f"loading weights from {files}" + (f" as {quantize}" if quantize else ""), len(local_shapes),
                  unit="tensors", logger=logger) as progress:
        tensors = counted(tensors, progress)
        if quantize is None:
            model.load_state_dict(dict(tensors), strict=True, assign=True)
        else:
            load_quantized_(model, tensors, "int4" if quantize == "int4" else "int8", options.quantize_group_size)
    if quantize == "w8a8":
        use_int8_activations_(model, policy)
    model.setup_rope(device)
    model.eval()
    distributed.wait_for_all_ranks()  # ranks finish loading at their own pace
    logger.info(
        "loaded %s (%s) as rank %d/%d on %s in %s%s, %.1f s",
        ckpt_dir, files, rank, world_size, device, dtype,
        f" ({quantize} weights)" if quantize else "", time.perf_counter() - start,
    )
    return model, tokenizer


@torch.no_grad()
def load_quantized_(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], mode: str,
                    group_size: Optional[int] = None) -> int:
    """Load a meta-built ``model`` from ``tensors`` ((name, tensor) in ``state_dict`` order,
    every one of its tensors), quantising as it goes: each dense linear layer and each stack
    of Llama 4 experts is swapped for its ``mode`` ("int8" or "int4") twin as soon as its
    weights are in (:func:`~llama.layers.quantize.quantized_module`), and its full-precision
    weights are let go.  The rest (embeddings, norms, router) keeps the tensors as read.  The
    result is what loading in full then quantising gives, bit for bit.  Returns the number of
    modules quantised."""
    units: dict[str, nn.Module] = {}  # quantisable module's name -> module
    waiting: dict[str, int] = {}  # its tensors not yet read
    for qualified, module in model.named_modules():
        if quantizable(module):
            units[qualified] = module
            waiting[qualified] = len(module.state_dict())
    count = fused = 0
    for name, tensor in tensors:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner.load_state_dict({attr: tensor}, strict=False, assign=True)
        del owner, tensor  # the module holds the tensor now, and only it
        if owner_name in waiting:
            waiting[owner_name] -= 1
            if waiting[owner_name] == 0:
                parent_name, _, child = owner_name.rpartition(".")
                parent = model.get_submodule(parent_name)
                unit = units.pop(owner_name)
                setattr(parent, child, quantized_module(unit, mode, group_size))
                del unit  # its full-precision weights go with it
                if mode == "int8" and child in getattr(parent, "packable_input_projections", ()):
                    fused += int8_siblings_as_one_(parent)  # once its last sibling is in
                # The C allocator hands the freed pages back: otherwise the freed blocks, split
                # by the smaller quantised ones made between them, pile up layer by layer.
                return_freed_memory()
                count += 1
    unread = [name for name, t in model.state_dict().items() if t.is_meta]
    if unread or units:
        raise RuntimeError(f"internal error: tensors not loaded: {(unread or sorted(units))[:5]}")
    logger.info("quantised %d linear layers / expert stacks to %s while loading%s", count, mode,
                f" (groups of {group_size} columns)" if mode == "int4" else
                f"; {fused} groups of layers that read the same input multiply as one")
    return count
