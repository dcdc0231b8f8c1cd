"""Sizing the paged KV cache from the GPU's memory: ``kv_cache_memory`` (CUDA only).

``kv_cache_memory=f`` is the share of the GPU's *total* memory this process may fill, as
vLLM's ``gpu_memory_utilization`` is: the weights, the activations of the largest passes the
engine runs, the compiled steps' CUDA graphs, what libraries hold beyond torch, and the KV
cache, which gets what is left.  What was held outside torch when the engine was made (the
CUDA context, other processes) does not count against ``f``; the cache must still fit in
what is free (if it cannot, the error says which fraction would).

What is left is measured, not estimated (:func:`size_kv_cache`):

1. the engine starts with a provisional pool of ``max_seq_len`` tokens (the least it takes);
2. with ``compile``, every compiled shape is warmed up on it (its CUDA graphs captured), as
   the engine does at start; then profiling passes run on it: the largest prefill pass a step
   can make (:func:`largest_prefill`), the largest decoding batch over the whole context
   (compiled, where it is), and the step's sampling;
3. the allocator's peak over them, and what the process gained outside torch meanwhile,
   give what it needs without a pool; the pool gets ``f * total`` less that, in whole
   blocks, the same on every rank (the least of theirs);
4. the provisional pool goes, with everything made against it (the runner, its compiled
   step and the CUDA graphs captured from it), the allocator returns what it cached, and the
   engine allocates the real pool, then compiles and captures its steps again against it.

With LoRA adapters served unmerged (:mod:`llama.engine.lora`), their slots' factors are
allocated when the adapters are loaded, before the engine is made: they count among the
weights (the log says how much of them they are); the provisional runner serves them as the
engine's will, so the profiling passes and the compiled steps warmed up are those of rows of
adapters (every row of one, the adapters in turn), whose low-rank products the passes' peak
then holds.

With a draft model (speculative decoding's ``"draft"`` method, :mod:`llama.engine.draft`) the
draft's weights are loaded before the engine, so they count among the weights; step 1 makes
a provisional pool of the draft's too, and step 2 runs the draft's largest pass (its catch-up
of as many rows as may propose, ``disable_by_batch_size``, each fed a whole prefill chunk).
The draft's pool holds as many tokens as the target's (every running request may propose),
so what is left is split between the two by their K/V bytes per token
(:func:`kv_cache_tokens_for_memory`): a draft of Llama 3.2 1B's shape (16 layers, 8 K/V heads
of 64) beside Llama 3.1 8B (32 layers, 8 of 128) takes a fifth of it.

Why capture twice.  A CUDA graph replays the device addresses it was captured with: graphs
captured against the provisional pool would read and write freed memory (or the real pool's
blocks) if they ran after it is replaced.  They cannot run: a runner's compiled step is its
own (its own code object, hence its own compiled graphs and CUDA graphs, see
:meth:`~llama.engine.runner.ModelRunner.compile`), and it is dropped with its runner before
the real pool exists.  Sizing first and capturing only after would leave the graphs' memory
unmeasured; it does not depend on the pool's size, so the second capture needs what the
first one measured.  The price is a second compilation at start (the compiled graph
specialises on the pool's size; Inductor's caches serve part of it).

Every reading goes through a :class:`DeviceMemory` (:class:`CudaMemory` on a GPU), which
tests replace with a fake device.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, cast

import torch

from llama.engine.block_manager import SCRATCH_BLOCK
from llama.engine.kv_cache_manager import KVCacheManager
from llama.engine.lora import ServedAdapters
from llama.engine.runner import ModelRunner
from llama.engine.sampling import SamplingParams, greedy_tokens, sample_next_token
from llama.engine.scheduler import check_prefill_chunk
from llama.layers.kv_cache import kv_cache_bytes
from llama.layers.lora import lora_factor_bytes
from llama.model import Transformer, TransformerBlock
from llama.runtime import distributed

logger = logging.getLogger(__name__)

__all__ = ["CudaMemory", "DeviceMemory", "KVCacheBudget", "KVCacheSizing", "MemoryReading", "adapter_rows",
           "check_kv_cache_memory", "kv_bytes_per_token", "kv_cache_tokens_for_memory", "largest_prefill",
           "size_kv_cache"]

GIB = 2**30


@dataclass(frozen=True)
class MemoryReading:
    """One look at a device's memory, in bytes."""

    total: int  # the device's memory
    free: int  # free on the device, whoever holds the rest
    reserved: int  # held by this process's torch allocator (every pool, CUDA graphs' too)
    peak_reserved: int  # the most ``reserved`` has been since the peak was last reset

    @property
    def outside_torch(self) -> int:
        """Held on the device but not by this process's allocator: the CUDA context,
        libraries' own memory (kernels' code, communication buffers), other processes."""
        return self.total - self.free - self.reserved


class DeviceMemory(Protocol):
    """Where the sizing reads a device's memory (a fake in tests)."""

    def read(self) -> MemoryReading:
        ...

    def reset_peak(self) -> None:
        """Start ``peak_reserved`` again from what is reserved now."""

    def release_cached(self) -> None:
        """Collect garbage and hand the allocator's cached, unused memory back to the device."""


class CudaMemory:
    """A CUDA device's memory, through torch: ``mem_get_info`` for the device, the caching
    allocator's statistics for this process."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> MemoryReading:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryReading(total=total, free=free, reserved=torch.cuda.memory_reserved(self.device),
                             peak_reserved=torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        gc.collect()  # a dropped runner's compiled step and CUDA graphs sit in reference cycles
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def check_kv_cache_memory(fraction: object) -> float:
    """``fraction`` as a float in (0, 1); ValueError otherwise.  1 would leave nothing for
    the allocator's slack or for anything the profiling did not see."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"kv_cache_memory must be a fraction in (0, 1) of the GPU's total memory, e.g. 0.9: the "
                         f"share this process may fill with the weights, activations, CUDA graphs and the KV "
                         f"cache; got {fraction!r}")
    return float(fraction)


def largest_prefill(max_batch_size: int, prefill_chunk: int, max_seq_len: int) -> tuple[int, int]:
    """(rows, width) of a prefill pass at least as large as any a step can make.

    A step prefills at most ``prefill_chunk`` tokens in all, over at most ``max_batch_size``
    rows padded to the longest (at most ``max_seq_len``), attending through a mask to up to
    ``max_seq_len`` positions.  Over r rows the longest holds at most ``prefill_chunk + 1 - r``
    tokens; the pass's memory grows with its tokens, r x width, and with r x ``max_seq_len``
    (the keys and values read, the mask).  Both grow with r while r is at most half the chunk,
    so up to there r = the most rows is the largest; past it, the box of the most rows by the
    width at half the chunk holds every pass."""
    check_prefill_chunk(prefill_chunk)
    rows = min(max_batch_size, prefill_chunk)
    width = prefill_chunk + 1 - min(rows, (prefill_chunk + 1) // 2)
    return rows, min(width, max_seq_len)


@torch.inference_mode()
def profile_passes(runner: ModelRunner, max_batch_size: int, prefill_chunk: int) -> None:
    """Run the largest passes of a step on ``runner``'s pool: the largest prefill
    (:func:`largest_prefill`) through a mask over ``max_seq_len`` positions, with the
    logits of every row; then the largest decoding batch over the whole context through
    the runner's decoding step (compiled or not), and the step's sampling over both
    passes' logits.  Padding rows: every token is in the scratch block, whose contents
    nobody reads.  With LoRA adapters (``runner.lora``), every row is served with one, the
    adapters in turn (:func:`adapter_rows`)."""
    model, kv, device = runner.model, runner.kv, runner.device
    max_seq_len = model.params.max_seq_len
    rows, width = largest_prefill(max_batch_size, prefill_chunk, max_seq_len)
    tokens = torch.zeros((rows, width), dtype=torch.long, device=device)
    # The last positions of the context, so that the mask and the keys read span all of it.
    positions = torch.arange(max_seq_len - width, max_seq_len, device=device).expand(rows, width)
    hidden = model.hidden_states(tokens, positions, max_seq_len, kv.cache,
                                 block_table=kv.block_table([None] * rows, device),
                                 lora_slots=adapter_rows(runner.lora, rows, device))
    prefilled = model.logits(hidden[:, -1])  # (rows, V)
    del hidden
    tokens = torch.zeros((max_batch_size, 1), dtype=torch.long, device=device)
    positions = torch.full((max_batch_size, 1), max_seq_len - 1, dtype=torch.long, device=device)
    decoded = runner.decode_step(tokens, positions, max_seq_len, kv.cache,
                                 kv.block_table([None] * max_batch_size, device),
                                 adapter_rows(runner.lora, max_batch_size, device))  # (B, V)
    logits = torch.cat([prefilled, decoded])
    greedy_tokens(logits)
    sample_next_token(logits[:1], SamplingParams(), sync_free=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def adapter_rows(lora: Optional[ServedAdapters], rows: int, device: torch.device) -> Optional[torch.Tensor]:
    """LoRA slots (rows,) for a profiling pass: every row served with an adapter, slots 1..
    ``max_loras`` in turn (rows of several adapters, as a mixed batch has them); None without
    adapters."""
    if lora is None:
        return None
    return (torch.arange(rows, device=device) % lora.max_loras + 1).long()


@torch.inference_mode()
def profile_draft_pass(draft: Transformer, cache: torch.nn.ModuleList, *, rows: int, prefill_chunk: int,
                       block_size: int, whole: bool) -> None:
    """Run the largest pass a draft model makes (:meth:`~llama.engine.draft.DraftProposer._catch_up`)
    over its ``cache``: ``rows`` rows (as many as may propose in a step) each fed a whole prefill
    chunk (at most ``max_seq_len``), at the last positions of the context, and the logits of
    each row's last position.  ``whole``: the draft is whole on this rank (its passes run
    alone), else sharded as the target is.  Every token is written in the scratch block, whose
    contents nobody reads."""
    max_seq_len, device = draft.params.max_seq_len, draft.device
    width = min(prefill_chunk, max_seq_len)
    tokens = torch.zeros((rows, width), dtype=torch.long, device=device)
    positions = torch.arange(max_seq_len - width, max_seq_len, device=device).expand(rows, width)
    table = torch.full((rows, max_seq_len // block_size + 1), SCRATCH_BLOCK, dtype=torch.long, device=device)
    with distributed.alone() if whole else contextlib.nullcontext():
        hidden = draft.hidden_states(tokens, positions, max_seq_len, cache, block_table=table)
        draft.logits(hidden[:, -1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class KVCacheBudget:
    """What the readings before and after profiling leave the KV cache, in bytes."""

    fraction: float
    total: int  # the device's memory
    weights: int  # held by the allocator when profiling began: the weights, the RoPE table, LoRA factors
    passes: int  # its peak beyond that over the profiling, the provisional pool aside
    outside_torch: int  # what the process gained outside torch meanwhile (kernels' code, workspaces)
    free: int  # free on the device once the provisional pool and its graphs are gone
    reserved: int  # held by the allocator then
    lora: int = 0  # of ``weights``: the LoRA adapters' factors (every slot's), served unmerged

    @property
    def need(self) -> int:
        """What the process holds at its peak without a pool."""
        return self.weights + self.passes + self.outside_torch

    @property
    def allowed(self) -> int:
        """The fraction's share of the device, less what the process needs without a pool."""
        return int(self.fraction * self.total) - self.need

    @property
    def room(self) -> int:
        """What is free beyond what the passes will take again."""
        return self.free - max(self.weights + self.passes - self.reserved, 0)

    @property
    def fits(self) -> bool:
        """Whether what the fraction allows the pool is free (not where other processes hold
        more than the rest of the device)."""
        return self.room >= self.allowed

    def describe(self) -> str:
        return (f"kv_cache_memory={self.fraction:g} of the GPU's {self.total / GIB:.2f} GiB is "
                f"{self.fraction * self.total / GIB:.2f} GiB: weights {self.weights / GIB:.2f} GiB"
                f"{f' (LoRA adapters {self.lora / GIB:.3f} GiB)' if self.lora else ''}, the largest "
                f"passes (prefill, decoding, CUDA graphs) {self.passes / GIB:.2f} GiB at their peak, "
                f"{self.outside_torch / GIB:.2f} GiB outside torch")


def kv_bytes_per_token(model: Transformer) -> int:
    """Bytes one token takes in a paged KV cache of ``model``'s K/V heads on this rank, in its dtype."""
    attention = cast(TransformerBlock, model.layers[0]).attention
    return kv_cache_bytes(len(model.layers), 1, attention.n_local_kv_heads, attention.head_dim, model.dtype)


def kv_cache_tokens_for_memory(model: Transformer, pool_bytes: int, block_size: int,
                               draft: Optional[Transformer] = None) -> int:
    """The tokens of a paged KV cache of this rank's K/V heads, in the model's dtype, within
    ``pool_bytes``: whole blocks, the scratch block among them.  With a ``draft`` model, whose
    pool holds as many tokens (as many blocks), ``pool_bytes`` holds both pools: each token
    takes the two models' K/V bytes.  Below ``max_seq_len`` (or below 0) where ``pool_bytes``
    is too small: the caller refuses."""
    per_token = kv_bytes_per_token(model) + (kv_bytes_per_token(draft) if draft is not None else 0)
    return (max(pool_bytes, 0) // (per_token * block_size) - 1) * block_size  # less the scratch block


@dataclass
class KVCacheSizing:
    """The outcome of :func:`size_kv_cache`: the pool's ``tokens``, whether the decoding
    step still compiles (False: compiling failed while profiling, so the engine runs it
    eager and does not try again), and how to check the process's use once the real pool
    is made (:meth:`check_use`)."""

    tokens: int
    compiled: bool
    budget: KVCacheBudget
    memory: DeviceMemory
    outside_torch_before: int

    def check_use(self, pool_bytes: int) -> None:
        """Log what the process holds now that the real pool (``pool_bytes``) is made and its
        steps are compiled; warn if that is more than ``kv_cache_memory`` allows."""
        now = self.memory.read()
        held = now.peak_reserved + max(now.outside_torch - self.outside_torch_before, 0)
        allowed = self.budget.fraction * self.budget.total
        logger.info("KV cache: %d tokens (%.2f GiB); this process holds %.2f GiB at its peak so far, of the %.2f GiB "
                    "kv_cache_memory=%g allows", self.tokens, pool_bytes / GIB, held / GIB, allowed / GIB,
                    self.budget.fraction)
        if held > allowed:
            logger.warning("this process holds %.2f GiB, more than the %.2f GiB kv_cache_memory=%g allows: give a "
                           "smaller kv_cache_memory if the GPU runs out of memory", held / GIB, allowed / GIB,
                           self.budget.fraction)


def size_kv_cache(model: Transformer, fraction: float, memory: DeviceMemory, *, max_batch_size: int,
                  prefill_chunk: int, block_size: int, compile: bool,
                  verify_shapes: Sequence[tuple[int, int]] = (), draft: Optional[Transformer] = None,
                  draft_rows: int = 0, draft_whole: bool = True,
                  lora: Optional[ServedAdapters] = None) -> KVCacheSizing:
    """The KV cache's size in tokens for ``kv_cache_memory=fraction``, measured as the
    module's docstring says (steps 1-4; the caller makes the real pool).  ``verify_shapes``:
    those of the compiled verification step (:class:`ModelRunner`), warmed up too.  ``draft``:
    a draft model whose pool holds as many tokens, sized with the target's; ``draft_rows``: the
    most rows its passes have (``disable_by_batch_size``); ``draft_whole``: it is whole on this
    rank, not sharded.  ``lora``: the LoRA adapters ``model`` serves unmerged (loaded already:
    their factors are among what the allocator holds at the start), which the provisional
    runner serves in the passes it profiles and the steps it compiles.  RuntimeError where what is left holds
    fewer than ``max_seq_len`` tokens (in both pools), on this rank or another."""
    fraction = check_kv_cache_memory(fraction)
    max_seq_len = model.params.max_seq_len
    memory.release_cached()  # what loading left cached is not the passes' need
    start = memory.read()
    memory.reset_peak()
    n_blocks = 1 + -(-max_seq_len // block_size)  # and the scratch block
    kv = KVCacheManager(model.new_kv_cache(n_blocks=n_blocks, block_size=block_size), n_blocks, block_size,
                        max_seq_len)
    provisional = sum(t.numel() * t.element_size() for t in kv.cache.buffers())
    draft_cache = None
    if draft is not None:  # the draft's pool holds as many blocks
        draft_cache = draft.new_kv_cache(n_blocks=n_blocks, block_size=block_size)
        provisional += sum(t.numel() * t.element_size() for t in draft_cache.buffers())
    runner = ModelRunner(model, kv, max_batch_size, prefill_chunk=prefill_chunk, verify_shapes=verify_shapes)
    runner.lora = lora  # its steps take the rows' slots, as the engine's will
    if compile:
        # First: the graphs' pools stay held while serving, so the passes' peak is measured
        # over them.  Profiled before, the passes' peak was reached while the pools were not
        # yet held, and compiling returns the cached memory, so the peak never added them (on
        # an H100 the largest prefill then went past the fraction by the pools' size).
        runner.compile()
        runner.warm_up()  # every compiled shape, CUDA graphs captured: their memory is counted
        memory.release_cached()  # what compiling left cached, not held while serving
    compiled = compile and runner.compiled
    profile_passes(runner, max_batch_size, prefill_chunk)
    if draft is not None:
        profile_draft_pass(draft, cast(torch.nn.ModuleList, draft_cache), rows=min(draft_rows, max_batch_size),
                           prefill_chunk=prefill_chunk, block_size=block_size, whole=draft_whole)
    profiled = memory.read()
    # the provisional pools, the compiled step and the graphs captured against the pool
    del runner, kv, draft_cache
    memory.release_cached()
    after = memory.read()
    logger.debug("memory for the KV cache's sizing: before profiling %s; at its end %s; once the provisional pool "
                 "is gone %s", start, profiled, after)
    budget = KVCacheBudget(
        fraction=fraction, total=start.total, weights=start.reserved,
        passes=max(profiled.peak_reserved - start.reserved - provisional, 0),
        outside_torch=max(profiled.outside_torch - start.outside_torch, 0), free=after.free, reserved=after.reserved,
        lora=lora_factor_bytes(model))
    here = kv_cache_tokens_for_memory(model, budget.allowed, block_size, draft) if budget.fits else -1
    tokens = distributed.min_over_ranks(here)  # every rank's pool the same: the first rank's tables index them all
    if tokens < max_seq_len:
        raise RuntimeError(_too_little(budget, here, tokens, model, max_batch_size, prefill_chunk))
    logger.info("%s: the KV cache takes %.2f GiB, %d tokens%s", budget.describe(), budget.allowed / GIB, tokens,
                "" if draft is None else " (in the target's pool and as many in the draft's)")
    return KVCacheSizing(tokens, compiled, budget, memory, start.outside_torch)


def _too_little(budget: KVCacheBudget, here: int, tokens: int, model: Transformer, max_batch_size: int,
                prefill_chunk: int) -> str:
    """Why the KV cache cannot hold one request, and what to change."""
    max_seq_len = model.params.max_seq_len
    if here >= max_seq_len:
        return (f"another model-parallel rank's GPU leaves its KV cache {tokens} tokens, fewer than max_seq_len="
                f"{max_seq_len} (its error says why); here, {budget.describe()}")
    if not budget.fits:
        most = math.floor(100 * (budget.need + budget.room) / budget.total) / 100
        return (f"kv_cache_memory={budget.fraction:g} asks for {budget.fraction * budget.total / GIB:.2f} GiB of the "
                f"GPU, but only {(budget.need + budget.room) / GIB:.2f} GiB of it is this process's to take (other "
                f"processes or the CUDA context hold the rest): give kv_cache_memory={most:g} or less, or free the GPU")
    return (f"{budget.describe()}; that leaves {max(budget.allowed, 0) / GIB:.2f} GiB for the KV cache: "
            f"{max(here, 0)} tokens, fewer than max_seq_len={max_seq_len} (one request). Lower max_batch_size="
            f"{max_batch_size} or prefill_chunk={prefill_chunk} (the largest passes grow with both) or max_seq_len, "
            "give a larger kv_cache_memory (below 1), or make the weights smaller (a smaller dtype, "
            "quantize='int8' or 'int4')")
