"""A checkpoint made ready to generate: the model loaded on this rank, its tokenizer and chat
format, and the engine that runs it.

Every front door starts here: :meth:`llama.Llama.build` wraps what :func:`build_engine`
returns in the Meta-shaped API, and the server (:mod:`llama.serve.server`) serves it as it
is.  :func:`assemble_engine` is the second half alone, for a model already loaded
(``llama.Llama(model, tokenizer)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union, cast

import torch

from llama.checkpoint.layout import checkpoint_layout, find_tokenizer
from llama.checkpoint.loader import LoadOptions, load_model
from llama.engine.core import Engine
from llama.engine.draft import check_same_tokenizer
from llama.engine.kv_sizing import check_kv_cache_memory
from llama.engine.lora import check_lora_options, load_lora_adapters
from llama.engine.speculative import SpeculativeConfig, check_speculative
from llama.formats.chat import ChatFormat, chat_format_for
from llama.images.prompt import ImageLayout, MllamaLayout, TileLayout, image_layout
from llama.layers.policy import KernelPolicy, compile_by_default
from llama.layers.prepare import prepare_model_
from llama.layers.quantize import quantized_kind
from llama.model import Transformer
from llama.runtime import devices, distributed
from llama.structured.manager import StructuredOutputs
from llama.tokenizer import Llama4Tokenizer, Tokenizer, load_tokenizer

__all__ = ["LoadedModel", "build_engine", "assemble_engine", "load_draft"]


@dataclass
class LoadedModel:
    """A model ready to generate (what :class:`llama.serve.protocols.ServedModel` asks of a
    served model, and what :class:`llama.Llama` holds).

    ``generator`` draws the sampling seed of each request that gives none; ``policy``: the
    kernels the model runs with (:class:`~llama.layers.policy.KernelPolicy`)."""

    model: Transformer
    tokenizer: Tokenizer
    formatter: ChatFormat
    engine: Engine
    policy: KernelPolicy
    generator: torch.Generator
    structured: StructuredOutputs  # compiles and keeps the grammars of response formats and tool choices


def build_engine(
    ckpt_dir: Union[str, Path],
    tokenizer_path: Union[str, Path, None] = None,
    *,
    max_seq_len: int,
    max_batch_size: int,
    model_parallel_size: Optional[int] = None,
    seed: int = 1,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    quantize: Optional[str] = None,
    compile: Optional[bool] = None,
    quantize_group_size: Optional[int] = None,
    chat_format: Optional[str] = None,
    prefill_chunk: int = 512,
    cpu_packing: Optional[str] = None,
    kv_cache_tokens: Optional[int] = None,
    kv_block_size: int = 16,
    kv_cache_memory: Optional[float] = None,
    speculative: Optional[Mapping[str, Any]] = None,
    vision: bool = True,
    lora: Union[str, Path, None] = None,
    lora_adapters: Optional[Mapping[str, Any]] = None,
    max_loras: Optional[int] = None,
    max_lora_rank: Optional[int] = None,
) -> LoadedModel:
    """Load a checkpoint (Meta's or a Hugging Face folder) on this process's share of the model
    and build its engine.

    The options are :meth:`llama.Llama.build`'s (documented there).  Every option is checked,
    and the kernel policy decided, before the checkpoint is read (a draft model's files and
    tokenizer too)."""
    config = check_speculative(speculative)
    check_lora_options(lora_adapters, max_loras, max_lora_rank)
    target: Optional[Tokenizer] = None
    if lora_adapters and config is not None:
        raise ValueError("speculative decoding with LoRA adapters served unmerged is not supported: leave "
                         "speculative unset, or merge the adapter (merge_lora)")
    if config is not None and config.method == "draft":
        check_draft_tensor_parallel_size(config)
        draft_dir = Path(cast(str, config.draft_ckpt_dir))  # the draft method has one
        target = load_tokenizer(tokenizer_path if tokenizer_path is not None else find_tokenizer(ckpt_dir))
        check_same_tokenizer(load_tokenizer(find_tokenizer(draft_dir, checkpoint_layout(draft_dir))), target)
    if kv_cache_memory is not None:
        check_kv_cache_memory(kv_cache_memory)  # before the checkpoint is read, as the others
        if kv_cache_tokens is not None:
            raise ValueError("give kv_cache_tokens or kv_cache_memory, not both")
        if devices.resolve_device(device).type != "cuda":
            raise ValueError("kv_cache_memory sizes the KV cache from the GPU's memory: it needs a CUDA device; "
                             "on the CPU give kv_cache_tokens")
        kv_cache_tokens = max_seq_len  # what the memory check counts before loading: the least
    options = LoadOptions(max_seq_len=max_seq_len, max_batch_size=max_batch_size,  # checked once, here
                          model_parallel_size=model_parallel_size, device=device, dtype=dtype, quantize=quantize,
                          quantize_group_size=quantize_group_size, prefill_chunk=prefill_chunk,
                          kv_cache_tokens=kv_cache_tokens, kv_block_size=kv_block_size, vision=vision)
    device, dtype = cast(torch.device, options.device), cast(torch.dtype, options.dtype)  # resolved by LoadOptions
    compiled = compile_by_default(device, dtype, quantize) if compile is None else bool(compile)
    # The kernel policy, decided once, before the checkpoint is read: a cpu_packing it
    # cannot honour is refused at once.
    policy = KernelPolicy.decide(device, dtype, compile=compiled, cpu_packing=cpu_packing,
                                 quantize=quantize)
    model, tokenizer = load_model(ckpt_dir, tokenizer_path, options, policy, lora=lora,  # lora: merged
                                  tokenizer=target)  # a draft's target tokenizer, read once (None: read there)
    return assemble_engine(model, tokenizer, seed=seed, compile=compiled, chat_format=chat_format,
                           prefill_chunk=prefill_chunk, cpu_packing=cpu_packing, policy=policy,
                           kv_cache_tokens=None if kv_cache_memory is not None else options.kv_cache_tokens,
                           kv_block_size=options.kv_block_size, kv_cache_memory=kv_cache_memory,
                           speculative=speculative, lora_adapters=lora_adapters, max_loras=max_loras,
                           max_lora_rank=max_lora_rank)


def assemble_engine(
    model: Transformer,
    tokenizer: Tokenizer,
    *,
    seed: int = 1,
    compile: Optional[bool] = None,
    chat_format: Optional[str] = None,
    prefill_chunk: int = 512,
    cpu_packing: Optional[str] = None,
    policy: Optional[KernelPolicy] = None,
    kv_cache_tokens: Optional[int] = None,
    kv_block_size: int = 16,
    kv_cache_memory: Optional[float] = None,
    speculative: Optional[Mapping[str, Any]] = None,
    lora_adapters: Optional[Mapping[str, Any]] = None,
    max_loras: Optional[int] = None,
    max_lora_rank: Optional[int] = None,
) -> LoadedModel:
    """A loaded ``model`` made ready to generate: its weights laid out for the kernel
    ``policy`` (default: decided here from its device and dtype, ``compile`` and
    ``cpu_packing``, as :func:`build_engine` does), LoRA layers swapped in for the layers
    ``lora_adapters`` change (after the layout: their base product is the policy's), its chat
    format and its engine.  The options are :meth:`llama.Llama.build`'s."""
    # A model with an image encoder gets a chat format that lays out image tokens: Llama 4's
    # (with Llama 4's tokenizer: with another, the model's prompts stay text) or Llama 3.2
    # Vision's (loaded with its encoder: vision=False leaves a text model).
    layout = image_layout(model.params)
    vision: Optional[ImageLayout] = None
    if isinstance(layout, TileLayout) and model.takes_images and isinstance(tokenizer, Llama4Tokenizer):
        vision = layout
    elif isinstance(layout, MllamaLayout) and model.vision_model is not None:
        vision = layout
    formatter = chat_format_for(tokenizer, chat_format, vision=vision)
    config = check_speculative(speculative)
    check_lora_options(lora_adapters, max_loras, max_lora_rank)
    generator = torch.Generator().manual_seed(seed)  # draws the seeds of unseeded requests
    compiled = compile_by_default(model.device, model.dtype, quantized_kind(model)) if compile is None \
        else bool(compile)
    if policy is None:
        policy = KernelPolicy.decide(model.device, model.dtype, compile=compiled, cpu_packing=cpu_packing)
    packed = prepare_model_(model, policy)  # the weights laid out for the policy's kernels
    if cpu_packing is not None and not packed:
        raise ValueError(f"cpu_packing={cpu_packing!r} found no bfloat16/float16 linear weight to pack "
                         "(quantized models keep their own kernels): leave cpu_packing unset")
    served_adapters = None
    if lora_adapters:
        if config is not None:
            raise ValueError("speculative decoding with LoRA adapters served unmerged is not supported: leave "
                             "speculative unset, or merge the adapter (merge_lora)")
        served_adapters = load_lora_adapters(model, model.params, lora_adapters, max_loras=max_loras,
                                             max_lora_rank=max_lora_rank)
    draft = None
    if config is not None and config.method == "draft":
        # With kv_cache_memory the draft's pool is sized with the target's, after loading: its
        # memory check counts the least, as the target's does.
        draft = load_draft(config, model, tokenizer, policy, prefill_chunk=prefill_chunk,
                           kv_cache_tokens=model.params.max_seq_len if kv_cache_memory is not None else kv_cache_tokens,
                           kv_block_size=kv_block_size)
    engine = Engine(model, tokenizer, generator=generator, prefill_chunk=prefill_chunk,
                    compile=compiled, kv_cache_tokens=kv_cache_tokens, block_size=kv_block_size,
                    kv_cache_memory=kv_cache_memory, speculative=config, draft=draft,
                    lora=served_adapters)
    return LoadedModel(model=model, tokenizer=tokenizer, formatter=formatter, engine=engine, policy=policy,
                       generator=generator, structured=StructuredOutputs(tokenizer))


def load_draft(config: SpeculativeConfig, target: Transformer, tokenizer: Tokenizer, policy: KernelPolicy, *,
               prefill_chunk: int = 512, kv_cache_tokens: Optional[int] = None,
               kv_block_size: int = 16) -> Transformer:
    """The draft model of ``config`` (method ``"draft"``) loaded from its ``draft_ckpt_dir`` (Meta's
    files or a Hugging Face folder) for the ``target``: with its own tokenizer, which must be the
    target's (ValueError naming both files and what differs), the same vocab_size, device,
    dtype, ``max_seq_len`` and ``max_batch_size``, never quantised, laid out for the target's
    kernel ``policy``; whole on every rank, or with ``draft_tensor_parallel_size`` (the target's
    model-parallel size) sharded as the target is (:mod:`llama.engine.draft`).  The memory check counts
    a KV cache of ``kv_cache_tokens`` (default: ``max_batch_size * max_seq_len``) for it."""
    sharded = check_draft_tensor_parallel_size(config) > 1
    draft_dir = Path(cast(str, config.draft_ckpt_dir))
    draft_tokenizer = load_tokenizer(find_tokenizer(draft_dir, checkpoint_layout(draft_dir)))
    check_same_tokenizer(draft_tokenizer, tokenizer)
    params = target.params
    options = LoadOptions(max_seq_len=params.max_seq_len, max_batch_size=params.max_batch_size,
                          device=target.device, dtype=target.dtype, prefill_chunk=prefill_chunk,
                          kv_cache_tokens=kv_cache_tokens, kv_block_size=kv_block_size)
    draft, _ = load_model(draft_dir, None, options, policy, replicated=not sharded, tokenizer=draft_tokenizer)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {draft_dir} has vocab_size {draft.vocab_size}, the target "
                         f"{target.vocab_size}: a draft must share the target's vocabulary (and tokenizer)")
    prepare_model_(draft, policy)
    return draft


def check_draft_tensor_parallel_size(config: SpeculativeConfig) -> int:
    """``config``'s ``draft_tensor_parallel_size``: 1 (the draft whole on every rank) or this job's
    number of processes (sharded as the target is); ValueError for any other."""
    size, ranks = config.draft_tensor_parallel_size, distributed.planned_model_parallel_size()
    if size not in (1, ranks):
        raise ValueError(f"speculative: draft_tensor_parallel_size={size} is not supported with {ranks} process(es): "
                         f"1 runs the draft whole on every rank, {ranks} shards it over them as the target is")
    return size
