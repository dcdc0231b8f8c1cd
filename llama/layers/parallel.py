"""fairscale's model-parallel layers, built without their full-size initial weight.

fairscale's constructors allocate a CPU tensor with the legacy ``torch.Tensor(...)``
call (which ignores ``torch.device(...)`` contexts) and initialise a full,
unsharded "master" weight on every rank before slicing it.  For inference the
weights come from a checkpoint, so that work is wasted memory and time.  The
classes here *are* fairscale's classes (same forward, same collectives,
``isinstance`` holds) with a constructor that allocates only this rank's slice,
on the current default device: ``with torch.device("meta"): ...`` allocates
nothing at all.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel import layers as fs_layers
from fairscale.nn.model_parallel.mappings import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
)
from torch import nn

from llama.layers.packing import PackedProjections, cpu_has_native_bf16_matmul, cpu_vendor, packed_linear

logger = logging.getLogger(__name__)


def _split_size(total: int, what: str) -> int:
    world = fs_init.get_model_parallel_world_size()
    if total % world:
        raise ValueError(f"{what}={total} cannot be split evenly over {world} model-parallel processes")
    return total // world


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _LocalMatmul:
    """The rank-local product ``x @ W.T`` of a parallel linear layer, in full precision
    or, after :mod:`llama.layers.quantize`, with int8 weights and a float scale per output row,
    or int4 weights with a scale and offset per group of input columns, or (bfloat16 and
    float16 weights on an x86 CPU, see :mod:`llama.layers.packing`) packed for a CPU kernel."""

    weight: Optional[nn.Parameter]  # (out, in); None once quantised or packed, replaced by buffers
    # int8: weight_int8 (out, in) and weight_scale (out,); with quantize="w8a8" also
    #       weight_int8_packed (fbgemm's copy) and weight_int8_packed_key, except in
    #       layers packed with their siblings (llama.layers.packing.Int8ActivationProjections)
    # int4: weight_int4 (packed by torch for the device), weight_scales_and_zeros
    #       (in / group, out, 2), and the int attributes int4_group_size and
    #       int4_out_features (the rows stored are padded to a multiple of 16)
    # packed: weight_packed and the attributes llama.layers.packing describes

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            if x.device.type == "cpu" and x.shape[:-1].numel() == 1 and torch.compiler.is_compiling() \
                    and not MKL_ONE_ROW_PRODUCTS_ARE_FAST:
                # One row on the CPU under torch.compile: written as multiply-and-sum,
                # the product becomes one fused, vectorised reduction kernel that reads
                # the weight once (faster on an AVX2 CPU than MKL's or oneDNN's
                # matrix-vector product), and the ops around it fuse too.
                return (x.float().unsqueeze(-2) * self.weight.float()).sum(-1).to(x.dtype)
            if x.device.type == "cpu" and not torch.compiler.is_compiling():
                return cpu_linear(x, self.weight)
            return F.linear(x, self.weight)
        if hasattr(self, "weight_packed"):
            out = packed_linear(x, self.weight_packed, self.weight_packed_key, self.weight_packed_out_features)
            rows = self.weight_packed_rows  # packed together with sibling layers: this layer's outputs
            return out if rows is None else out[..., rows[0] : rows[1]]
        if hasattr(self, "weight_int4"):
            out = int4_linear(x, self.weight_int4, self.weight_scales_and_zeros, self.int4_group_size)
            return out if out.shape[-1] == self.int4_out_features else out[..., : self.int4_out_features]
        packed = getattr(self, "weight_int8_packed", None)
        if packed is not None and x.shape[:-1].numel() == 1:
            # quantize="w8a8": one row (a decoding step) through fbgemm's int8 x int8
            # product, its activations quantised per call, i.e. per token (see
            # llama.layers.quantize.use_int8_activations_).  More rows keep bfloat16 activations.
            return packed_linear(x, packed, self.weight_int8_packed_key, self.weight_int8.shape[0])
        return int8_linear(x, self.weight_int8, self.weight_scale)


# Row counts from which a bfloat16/float16 product on a CPU without native support for
# them goes through float32 blocks (see linear_by_blocks), and up to which a
# float32 product with a column-major weight is split by output columns over threads.
CONVERT_FROM_ROWS = 8
SPLIT_UP_TO_ROWS = 8
INT8_CONVERT_FROM_ROWS = 32  # torch's int8 kernel handles a few rows well, not a prompt
CONVERTED_BLOCK_BYTES = 4 << 20  # one converted block: stays in the last-level cache
# Whether MKL's few-row float32 products run on all of torch's threads and stream the
# weight at memory speed by themselves.  On an Intel CPU where torch dispatches to
# AVX-512 kernels they do (measured on the AMX benchmark machine: splitting them over
# threads made a 150m decoding step 4% and a 1B step of 8 rows 20% slower at 2 threads,
# and compiled multiply-and-sum steps were 5-8% slower than eager ones); on AMD CPUs,
# where MKL does not take its Intel code paths, they do not, with AVX-512 (Zen 4: the
# split 1.35-1.9x faster at 2 threads on one-row products of 1-131 MB) or AVX2 (1.2-2.2x,
# the compiled reduction 1.2-1.3x).  A plain module constant: compiled steps read it
# without tracing a call.
MKL_ONE_ROW_PRODUCTS_ARE_FAST = torch.backends.cpu.get_cpu_capability() == "AVX512" and cpu_vendor() != "amd"


def cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` on the CPU, by the kernel that is fastest for the shape (measured
    on the benchmark machine, an AVX2 CPU; see BENCHMARKS.md "CPU kernels"):

    * bfloat16/float16 with ``CONVERT_FROM_ROWS`` rows or more (prefill, batches), where
      the CPU has no native bfloat16 products: :func:`linear_by_blocks`.  Torch's
      own kernel converts the weight again for every row, so 256 rows cost 256 one-row
      products; converted once per block they cost 5-7x less.
    * float32 with a column-major weight, up to ``SPLIT_UP_TO_ROWS`` rows and two or more
      threads, where MKL keeps such products on one thread
      (``MKL_ONE_ROW_PRODUCTS_ARE_FAST`` false): :func:`linear_split_over_threads`.  MKL
      runs a one-row product with a short inner dimension on one thread on an AVX2 CPU;
      split by output columns it uses them all (1.2-2.2x faster at 2 threads there).
    * otherwise ``F.linear``.
    """
    rows = x.shape[:-1].numel()
    if weight.dtype in (torch.bfloat16, torch.float16):
        if rows >= CONVERT_FROM_ROWS and not cpu_has_native_bf16_matmul():
            return linear_by_blocks(x, weight)
    elif weight.dtype == torch.float32 and rows <= SPLIT_UP_TO_ROWS and weight.stride(0) == 1 \
            and not MKL_ONE_ROW_PRODUCTS_ARE_FAST:
        parts = torch.get_num_threads()
        if parts > 1 and weight.shape[0] % parts == 0 and weight.shape[0] >= 64 * parts:
            return linear_split_over_threads(x, weight, parts)
    return F.linear(x, weight)


_scratch = threading.local()


def _scratch_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` buffer of at least ``numel`` elements, reused by this thread."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def linear_by_blocks(x: torch.Tensor, weight: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                     block_bytes: int = CONVERTED_BLOCK_BYTES, block_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ weight.T`` (times ``row_scale`` per output column, for int8 weights) for a
    low-precision (out, in) weight on the CPU: blocks of weight rows are converted to
    ``block_dtype`` into one reused buffer (about ``block_bytes``, so it stays in cache)
    and multiplied by a product made for many rows: MKL's for float32, oneDNN's for
    bfloat16 (AMX or AVX-512 BF16; ``x`` is then rounded to bfloat16, and each block's
    product to bfloat16 before the scale).  Accumulation is in float32 as in torch's own
    kernels; the result is rounded to ``x.dtype`` at the end."""
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features).to(block_dtype)
    out = torch.empty(flat.shape[0], out_features, dtype=block_dtype, device=x.device)
    block_rows = max(1, min(out_features, block_bytes // (block_dtype.itemsize * in_features)))
    scratch = _scratch_buffer(block_rows * in_features, block_dtype)
    for start in range(0, out_features, block_rows):
        end = min(out_features, start + block_rows)
        block = scratch[: (end - start) * in_features].view(end - start, in_features)
        block.copy_(weight[start:end])
        out[:, start:end] = flat @ block.t()
    if row_scale is not None:
        out = out.float() * row_scale.float()
    return out.to(x.dtype).view(*x.shape[:-1], out_features)


def linear_split_over_threads(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``x @ weight.T`` for a column-major float32 (out, in) weight, as ``parts`` products
    of one batched call, each over a slice of the output columns (a strided view of the
    same weight: nothing is copied)."""
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features)
    by_part = weight.t().view(in_features, parts, out_features // parts).transpose(0, 1)  # (parts, in, out/parts)
    out = torch.bmm(flat.expand(parts, *flat.shape), by_part)  # (parts, rows, out/parts)
    return out.transpose(0, 1).reshape(*x.shape[:-1], out_features)


def int8_linear(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight_int8 * scale[:, None]).T`` with PyTorch's own kernels.

    On CPU, ``torch._weight_int8pack_mm`` multiplies bfloat16 activations by the int8
    weight directly (the weight is never expanded); from ``INT8_CONVERT_FROM_ROWS`` rows
    (prefill) the weight goes through converted blocks instead (see
    :func:`linear_by_blocks`): bfloat16 blocks through oneDNN where the CPU multiplies
    bfloat16 natively (2-4x faster than float32 blocks on the AMX benchmark machine),
    float32 blocks through MKL elsewhere.  Elsewhere the weight is converted to the
    activations' dtype first (fused by torch.compile where compiled).
    """
    if x.device.type == "cpu":
        if x.shape[:-1].numel() >= INT8_CONVERT_FROM_ROWS and not torch.compiler.is_compiling():
            # Prefill and batches: the kernel below handles each row as its own product.
            block_dtype = torch.bfloat16 if cpu_has_native_bf16_matmul() else torch.float32
            return linear_by_blocks(x, weight_int8, row_scale=scale, block_dtype=block_dtype)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, weight_int8, scale)
        return out.to(x.dtype).view(*x.shape[:-1], -1)
    return F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ W.T`` with W stored as 4-bit groups (see :func:`llama.layers.quantize.quantize_int4_`),
    through torch's int4 kernels: the weight is never expanded.  Activations meet the
    weight in the scales' dtype (bfloat16), the result is rounded to ``x.dtype``."""
    flat = x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype)
    if x.device.type == "cpu":
        out = torch._weight_int4pack_mm_for_cpu(flat, packed, group_size, scales_and_zeros)
    else:
        out = torch._weight_int4pack_mm(flat, packed, group_size, scales_and_zeros)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


class Int8Projections(PackedProjections):
    """``quantize="int8"``: int8 layers that read the same input (wq, wk, wv; w1, w3) as one
    weight (the layers' ``weight_int8`` are views of its rows) and one product: one call
    instead of three or two (a 150m decoding step 3% faster, within noise at 1 thread, on
    the AMX benchmark machine; the same logits there).  Each output is the same sum as in
    the layer's own product."""

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, sizes: list[int]) -> None:
        super().__init__(None, sizes, -1)
        self.weight_int8 = weight_int8  # plain attributes, not buffers: the layers' views are the state
        self.weight_scale = scale

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight_int8, self.weight_scale)


class ColumnParallelLinear(_LocalMatmul, fs_layers.ColumnParallelLinear):
    """``y = x @ W.T`` with W's output rows split over ranks (each rank holds ``out/world`` rows)."""

    def __init__(self, in_features: int, out_features: int, *, gather_output: bool) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.world_size = fs_init.get_model_parallel_world_size()
        self.output_size_per_partition = _split_size(out_features, "output features")
        self.weight = _weight(self.output_size_per_partition, in_features)
        self.register_parameter("bias", None)
        self.master_weight = None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.world_size == 1:  # fairscale's region functions are identities then
            return self.local_matmul(input_)
        out = self.local_matmul(copy_to_model_parallel_region(input_))
        return gather_from_model_parallel_region(out) if self.gather_output else out


class RowParallelLinear(_LocalMatmul, fs_layers.RowParallelLinear):
    """``y = x @ W.T`` with W's input columns split over ranks; partial outputs are summed (all-reduce)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = True
        self.world_size = fs_init.get_model_parallel_world_size()
        self.input_size_per_partition = _split_size(in_features, "input features")
        self.weight = _weight(out_features, self.input_size_per_partition)
        self.register_parameter("bias", None)
        self.master_weight = None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = self.local_matmul(input_)
        return out if self.world_size == 1 else reduce_from_model_parallel_region(out)


def _init_embedding_attributes(module: nn.Module, num_embeddings: int, embedding_dim: int) -> None:
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
        self.embedding_dim_per_partition = _split_size(embedding_dim, "embedding dim")
        self.weight = _weight(num_embeddings, self.embedding_dim_per_partition)


class VocabParallelEmbedding(fs_layers.VocabParallelEmbedding):
    """Embedding table split along the vocabulary (Llama 3 checkpoints)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        _init_embedding_attributes(self, num_embeddings, embedding_dim)
        per_rank = _split_size(num_embeddings, "vocab_size")
        self.vocab_start_index = fs_init.get_model_parallel_rank() * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.num_embeddings_per_partition = per_rank
        self.weight = _weight(per_rank, embedding_dim)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # fairscale's forward masks with boolean indexing, which makes the host wait
        # for the device on every call; ``where`` keeps everything on the device.
        local = input_ - self.vocab_start_index
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_model_parallel_region(embedded)


def use_column_major_weights_(model: nn.Module) -> int:
    """Store every parallel linear layer's weight column-major (the same (out, in)
    tensor, laid out as its transpose).  For one-token decoding on CPU in float32,
    MKL's matrix-vector product streams a column-major weight markedly faster
    (measured 1.3-1.9x here, most for tall matrices such as the vocabulary
    projection); prefill matrix products are about as fast either way.
    Returns the number of weights re-laid."""
    count = 0
    for module in model.modules():
        if isinstance(module, _LocalMatmul) and module.weight is not None and module.weight.is_contiguous():
            module.weight = nn.Parameter(module.weight.detach().t().contiguous().t(), requires_grad=False)
            count += 1
    return count
