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

import ctypes
import functools
import itertools
import logging
import math
import threading
import warnings
import weakref
from typing import Optional, Union

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
    or, after :mod:`llama.quantize`, with int8 weights and a float scale per output row,
    or int4 weights with a scale and offset per group of input columns, or (bfloat16 and
    float16 weights on an x86 CPU, see :func:`use_fp16_packed_weights_`) packed for
    fbgemm's half-precision kernel."""

    weight: Optional[nn.Parameter]  # (out, in); None once quantised or packed, replaced by buffers
    # int8: weight_int8 (out, in) and weight_scale (out,)
    # int4: weight_int4 (packed by torch for the device), weight_scales_and_zeros
    #       (in / group, out, 2), and the int attributes int4_group_size and
    #       int4_out_features (the rows stored are padded to a multiple of 16)
    # fp16-packed: weight_fp16_packed (fbgemm's packed matrix, not a tensor) and
    #       weight_fp16_dtype, weight_fp16_shape (the weight's: the layer's output dtype, (out, in)),
    #       weight_fp16_rows: None, or (start, end), this weight's rows in a matrix packed
    #       together with sibling layers that read the same input (see PackedProjections);
    #       weight_fp16_key, weight_fp16_out_features: the matrix's key for compiled steps
    #       and its output features (see fp16_packed_linear)

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            if x.device.type == "cpu" and x.shape[:-1].numel() == 1 and torch.compiler.is_compiling():
                # One row on the CPU under torch.compile: written as multiply-and-sum,
                # the product becomes one fused, vectorised reduction kernel that reads
                # the weight once (faster here than MKL's or oneDNN's matrix-vector
                # product), and the ops around it fuse too.
                return (x.float().unsqueeze(-2) * self.weight.float()).sum(-1).to(x.dtype)
            if x.device.type == "cpu" and not torch.compiler.is_compiling():
                return cpu_linear(x, self.weight)
            return F.linear(x, self.weight)
        if hasattr(self, "weight_fp16_packed"):
            out = fp16_packed_linear(x, self.weight_fp16_packed, self.weight_fp16_key, self.weight_fp16_out_features)
            rows = self.weight_fp16_rows  # packed together with sibling layers: this layer's outputs
            return out if rows is None else out[..., rows[0] : rows[1]]
        if hasattr(self, "weight_int4"):
            out = int4_linear(x, self.weight_int4, self.weight_scales_and_zeros, self.int4_group_size)
            return out if out.shape[-1] == self.int4_out_features else out[..., : self.int4_out_features]
        return int8_linear(x, self.weight_int8, self.weight_scale)


# Row counts from which a bfloat16/float16 product on a CPU without native support for
# them goes through float32 blocks (see linear_by_float32_blocks), and up to which a
# float32 product with a column-major weight is split by output columns over threads.
CONVERT_FROM_ROWS = 8
SPLIT_UP_TO_ROWS = 8
INT8_CONVERT_FROM_ROWS = 32  # torch's int8 kernel handles a few rows well, not a prompt
FLOAT32_BLOCK_BYTES = 4 << 20  # one converted block: stays in the last-level cache


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16_matmul() -> bool:
    """Whether oneDNN multiplies bfloat16 matrices natively here (AVX-512 BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` on the CPU, by the kernel that is fastest for the shape (measured
    on the benchmark machine, an AVX2 CPU; see BENCHMARKS.md "CPU kernels"):

    * bfloat16/float16 with ``CONVERT_FROM_ROWS`` rows or more (prefill, batches), where
      the CPU has no native bfloat16 products: :func:`linear_by_float32_blocks`.  Torch's
      own kernel converts the weight again for every row, so 256 rows cost 256 one-row
      products; converted once per block they cost 5-7x less.
    * float32 with a column-major weight, up to ``SPLIT_UP_TO_ROWS`` rows and two or more
      threads: :func:`linear_split_over_threads`.  MKL runs a one-row product with a
      short inner dimension on one thread; split by output columns it uses them all
      (1.2-2.2x faster at 2 threads).
    * otherwise ``F.linear``.
    """
    rows = x.shape[:-1].numel()
    if weight.dtype in (torch.bfloat16, torch.float16):
        if rows >= CONVERT_FROM_ROWS and not cpu_has_native_bf16_matmul():
            return linear_by_float32_blocks(x, weight)
    elif weight.dtype == torch.float32 and rows <= SPLIT_UP_TO_ROWS and weight.stride(0) == 1:
        parts = torch.get_num_threads()
        if parts > 1 and weight.shape[0] % parts == 0 and weight.shape[0] >= 64 * parts:
            return linear_split_over_threads(x, weight, parts)
    return F.linear(x, weight)


_scratch = threading.local()


def _float32_scratch(numel: int) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements, reused by this thread."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buffer = _scratch.buffer = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]


def linear_by_float32_blocks(x: torch.Tensor, weight: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                             block_bytes: int = FLOAT32_BLOCK_BYTES) -> torch.Tensor:
    """``x @ weight.T`` (times ``row_scale`` per output column, for int8 weights) for a
    low-precision (out, in) weight on the CPU: blocks of weight rows are converted to
    float32 into one reused buffer (about ``block_bytes``, so it stays in cache) and
    multiplied by MKL's float32 product.  Accumulation is in float32 as in torch's own
    kernels; the result is rounded to ``x.dtype`` once at the end."""
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features).float()
    out = torch.empty(flat.shape[0], out_features, dtype=torch.float32, device=x.device)
    block_rows = max(1, min(out_features, block_bytes // (4 * in_features)))
    scratch = _float32_scratch(block_rows * in_features)
    for start in range(0, out_features, block_rows):
        end = min(out_features, start + block_rows)
        block = scratch[: (end - start) * in_features].view(end - start, in_features)
        block.copy_(weight[start:end])
        out[:, start:end] = flat @ block.t()
    if row_scale is not None:
        out *= row_scale.float()
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


FLOAT16_MAX = 65504.0


@functools.lru_cache(maxsize=None)
def fp16_packing_available() -> bool:
    """Whether this torch build has fbgemm's half-precision packed product
    (``torch.ops.quantized.linear_prepack_fp16``; x86 builds of torch)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.zeros(8, 8), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.zeros(1, 8), packed)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# In a process running torch on one thread, matrices of up to this many values are packed
# for fbgemm's single-threaded entry point (``torch.fbgemm_linear_fp16_weight_fp32_activation``),
# the others, and all of them with more threads, for its threaded one
# (``torch.ops.quantized.linear_dynamic_fp16``).  Same kernel, same packed layout, same
# result bit for bit; the single-threaded call costs about 3 us beyond its bytes against
# 15-20 us, and a decoding step of a small model makes dozens of such products (150m
# bfloat16 at 1 thread: a step 7% faster).  With two threads the threaded entry point's
# parallel split wins back its cost on prefill and large matrices.  Measured on the
# benchmark machine (BENCHMARKS.md, "fbgemm's single-threaded entry point").
FP16_ONE_THREAD_UP_TO = 1 << 21


@functools.lru_cache(maxsize=None)
def fp16_one_thread_kernel_available() -> bool:
    """Whether this torch build has fbgemm's single-threaded half-precision product
    (deprecated by torch, so it may go; the threaded one then serves every size)."""
    try:
        with warnings.catch_warnings():  # both warn once per process that they are deprecated
            warnings.simplefilter("ignore")
            packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.zeros(8, 8))
            torch.fbgemm_linear_fp16_weight_fp32_activation(torch.zeros(1, 8), packed, None)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# Packed matrices by key, for compiled steps: torch.compile cannot take fbgemm's packed
# object as an argument, so the operator below takes the key and looks the matrix up.
# An entry lives as long as the layer that owns the matrix (see _register_for_compile).
class OneThreadFp16Matrix:
    """A matrix packed for fbgemm's single-threaded entry point.  fbgemm hands it back as
    an opaque uint8 tensor; held here, out of torch.compile's sight (it cannot trace such
    a tensor: compiled steps find the matrix by key instead)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# A packed matrix: fbgemm's object for its threaded entry point, or the single-threaded
# one's (see FP16_ONE_THREAD_UP_TO).
PackedFp16 = Union[torch.ScriptObject, OneThreadFp16Matrix]
_PACKED_BY_KEY: dict[int, tuple[PackedFp16, int]] = {}  # key -> (packed matrix, output features)
_next_key = itertools.count()
_library = torch.library.Library("llama", "DEF")
# out_features is an argument, not looked up by key, so that it is part of the compiled
# graph: Inductor caches compiled graphs on disk, and in another process the same key may
# name a matrix of another shape; the graph it finds there must not claim this one's.
_library.define("fp16_packed_linear(Tensor x, int key, int out_features) -> Tensor")


def _fp16_packed_linear_by_key(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    packed, registered_out = _PACKED_BY_KEY[key]
    if registered_out != out_features:
        raise RuntimeError(f"compiled step asked for packed matrix {key} with {out_features} output features; "
                           f"it has {registered_out} (a stale compiled graph: clear torch.compile's caches)")
    return _fp16_product(x, packed)


def _fp16_packed_linear_shape(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_library.impl("fp16_packed_linear", _fp16_packed_linear_by_key, "CPU")
torch.library.register_fake("llama::fp16_packed_linear", _fp16_packed_linear_shape, lib=_library)


def _register_for_compile(owner: object, packed: PackedFp16, out_features: int) -> int:
    """A key under which compiled code finds ``packed``, forgotten when ``owner`` is freed."""
    key = next(_next_key)
    _PACKED_BY_KEY[key] = (packed, out_features)
    weakref.finalize(owner, _PACKED_BY_KEY.pop, key, None)
    return key


def pack_weight_fp16(weight: torch.Tensor) -> Optional[PackedFp16]:
    """A bfloat16/float16 (out, in) weight packed for :func:`fp16_packed_linear`, or None
    where float16 cannot hold it (a value beyond +-65504, or not finite).  With torch on
    one thread and up to ``FP16_ONE_THREAD_UP_TO`` values, it is packed for fbgemm's
    single-threaded entry point (:class:`OneThreadFp16Matrix`, which stays single-threaded
    if the thread count rises later), otherwise for its threaded one (an fbgemm object);
    both hold it as float16.

    bfloat16 values from 2**-14 to 65504 in magnitude are exact in float16 (11 significant
    bits against bfloat16's 8).  Smaller ones become float16 subnormals: rounded to a
    multiple of 2**-24, so each moves by 2**-25 (3e-8) at most, a million times less than
    bfloat16's own rounding of a weight of 0.02."""
    largest = weight.detach().abs().amax().item() if weight.numel() else 0.0
    if not largest <= FLOAT16_MAX:  # also catches NaN
        return None
    half = weight.detach().to(torch.float16)
    one_thread = torch.get_num_threads() == 1 and weight.numel() <= FP16_ONE_THREAD_UP_TO
    if one_thread and fp16_one_thread_kernel_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Its packing takes float32: values float16 holds exactly, so nothing rounds again.
            return OneThreadFp16Matrix(torch.fbgemm_pack_gemm_matrix_fp16(half.float()))
    return torch.ops.quantized.linear_prepack_fp16(half, None)


def unpack_weight_fp16(packed: PackedFp16, in_features: int) -> torch.Tensor:
    """The float16 (out, in) matrix held by ``packed`` (from :func:`pack_weight_fp16`)."""
    if not isinstance(packed, OneThreadFp16Matrix):
        return torch.ops.quantized.linear_unpack_fp16(packed)[0]
    # The single-threaded entry point has no unpacking: multiply the identity by it.  Exact:
    # each output is one float16 value times 1, plus zeros, accumulated in float32.
    columns = [_fp16_product(eye, packed).t() for eye in torch.eye(in_features).split(256)]
    return torch.cat(columns, dim=1).to(torch.float16)


def _fp16_product(flat: torch.Tensor, packed: PackedFp16) -> torch.Tensor:
    """``flat @ W.T`` for a float32 (M, in) ``flat``, float32 out, by the entry point
    ``packed`` was made for."""
    if not isinstance(packed, OneThreadFp16Matrix):
        return torch.ops.quantized.linear_dynamic_fp16(flat, packed)
    return torch.fbgemm_linear_fp16_weight_fp32_activation(flat, packed.tensor, None)


def fp16_packed_linear(x: torch.Tensor, packed: PackedFp16, key: Optional[int] = None,
                       out_features: Optional[int] = None) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by :func:`pack_weight_fp16`, by fbgemm's AVX2/AVX-512
    kernel: it converts the half-precision weight to float32 in registers and accumulates
    in float32, so one row streams the weight at close to memory speed (1.6-3.7x torch's
    bfloat16 matrix-vector product on the benchmark machine, and 5-8x at 8 rows).  The
    result is rounded to ``x.dtype`` once, as torch's bfloat16 kernels do.  Under
    torch.compile the product goes through the ``llama::fp16_packed_linear`` operator,
    which finds the matrix by ``key`` and is told its ``out_features`` (see
    :func:`use_fp16_packed_weights_`)."""
    if x.device.type != "cpu":
        raise RuntimeError("weights packed for fbgemm's CPU kernel cannot run on " + str(x.device) +
                           ": build the model on that device instead of moving it")
    flat = x.reshape(-1, x.shape[-1]).float()
    if torch.compiler.is_compiling():
        if key is None or out_features is None:
            raise RuntimeError("a compiled step needs the packed matrix's key and output features "
                               "(fp16_packed_linear(x, packed, key, out_features))")
        out = torch.ops.llama.fp16_packed_linear(flat, key, out_features)
    else:
        out = _fp16_product(flat, packed)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def _unpacked_weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a packed layer: its ``weight`` as a tensor again, in its dtype."""
    if getattr(module, "weight_fp16_packed", None) is not None:
        state_dict[prefix + "weight"] = _unpacked_weight(module)


def _unpacked_weight(module: nn.Module) -> torch.Tensor:
    """A packed layer's weight as a tensor, in its dtype (its own rows of a shared matrix)."""
    weight = unpack_weight_fp16(module.weight_fp16_packed, module.weight_fp16_shape[1])
    rows = module.weight_fp16_rows
    if rows is not None:
        weight = weight[rows[0] : rows[1]]
    return weight.to(module.weight_fp16_dtype)


class PackedProjections(nn.Module):
    """Column-parallel layers that read the same input (an attention layer's wq, wk, wv; a
    feed-forward layer's w1, w3), packed as one matrix: one product gives all their outputs,
    fewer, larger calls than one per layer (about 40 us a decoding step per layer saved on
    the benchmark machine).  Each layer keeps working on its own (it computes the whole
    product and keeps its rows), and ``state_dict()`` still holds each layer's weight (this
    module has no parameters).  A module, so that torch.compile guards on ``key`` and
    ``sizes`` (int attributes of plain objects are not guarded): a step compiled for one
    model is not reused for another."""

    def __init__(self, packed: PackedFp16, sizes: list[int], key: int) -> None:
        super().__init__()
        self.packed = packed
        self.sizes = sizes  # each layer's output features, in order
        self.key = key  # the matrix's key for compiled steps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fp16_packed_linear(x, self.packed, self.key, sum(self.sizes)).split(self.sizes, dim=-1)


def _pack_as_one_(layers: list[nn.Module]) -> Optional[PackedProjections]:
    """Pack the weights of ``layers`` (same input features, same dtype) as one matrix, or
    return None (and change nothing) where float16 cannot hold one of them."""
    weights = [layer.weight for layer in layers]
    if len({(w.dtype, w.shape[1]) for w in weights}) != 1:
        return None
    packed = pack_weight_fp16(torch.cat([w.detach() for w in weights]))
    if packed is None:
        return None
    out_features = sum(w.shape[0] for w in weights)
    key = _register_for_compile(layers[0], packed, out_features)
    start = 0
    for layer, weight in zip(layers, weights):
        _use_packed_(layer, packed, weight, (start, start + weight.shape[0]), (key, out_features))
        start += weight.shape[0]
    return PackedProjections(packed, [w.shape[0] for w in weights], key)


def _use_packed_(module: nn.Module, packed: PackedFp16, weight: torch.Tensor,
                 rows: Optional[tuple[int, int]], shared: Optional[tuple[int, int]] = None) -> None:
    """``shared``: (key, output features) of a matrix packed with sibling layers."""
    module.weight = None
    module.weight_fp16_packed = packed
    if shared is None:
        shared = _register_for_compile(module, packed, weight.shape[0]), weight.shape[0]
    module.weight_fp16_key, module.weight_fp16_out_features = shared
    module.weight_fp16_dtype = weight.dtype
    module.weight_fp16_shape = tuple(weight.shape)
    module.weight_fp16_rows = rows
    module._register_state_dict_hook(_unpacked_weight_in_state_dict)


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, _LocalMatmul) and weight is not None and weight.device.type == "cpu"
            and weight.dtype in (torch.bfloat16, torch.float16))


def use_fp16_packed_weights_(model: nn.Module) -> int:
    """Pack every bfloat16/float16 parallel linear weight on the CPU for fbgemm's
    half-precision kernel (see :func:`fp16_packed_linear`), in place of the weight: the
    same two bytes per value.  A weight float16 cannot hold stays as it is.  The model's
    ``state_dict()`` still holds ``weight`` tensors (unpacked on demand).  The layers a
    module names in ``packable_input_projections`` are packed as one matrix, set as its
    ``packed_input_projections`` (see :class:`PackedProjections`).  Returns the number of
    weights packed; 0 where torch has no fbgemm (non-x86 builds)."""
    if not fp16_packing_available():
        return 0
    count = kept = 0
    for module in model.modules():
        # Layers that read the same input go into one matrix (see PackedProjections).
        names = getattr(module, "packable_input_projections", ())
        siblings = [getattr(module, name) for name in names]
        if siblings and all(_packable(layer) for layer in siblings):
            module.packed_input_projections = _pack_as_one_(siblings)
            if module.packed_input_projections is not None:
                count += len(siblings)
    for module in model.modules():
        if not _packable(module):
            continue
        packed = pack_weight_fp16(module.weight)
        if packed is None:
            kept += 1
            continue
        _use_packed_(module, packed, module.weight, None)
        count += 1
    if count:
        _return_freed_memory()
    if kept:
        logger.info("%d weight(s) with values beyond float16's range left to torch's kernels", kept)
    return count


def fp16_packed_bytes(model: nn.Module) -> int:
    """Bytes of the weights packed by :func:`use_fp16_packed_weights_` (two per value; they
    are not tensors, so ``parameters()`` and ``buffers()`` do not count them)."""
    # Layers packed together each count their own rows: the sum is the shared matrix's size.
    return sum(2 * math.prod(m.weight_fp16_shape) for m in model.modules() if hasattr(m, "weight_fp16_packed"))


def _return_freed_memory() -> None:
    """Hand memory freed by the C allocator back to the system (glibc only; elsewhere a
    no-op).  Packing frees each layer's weight and a converted copy of it; without this the
    process keeps those pages, about one more copy of the weights."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def unpack_fp16_weights_(model: nn.Module) -> int:
    """Undo :func:`use_fp16_packed_weights_`: every packed layer holds a plain ``weight``
    parameter again (for code that changes weights in place).  Returns the number unpacked."""
    count = 0
    for module in model.modules():
        if getattr(module, "packed_input_projections", None) is not None:
            module.packed_input_projections = None
        if getattr(module, "weight_fp16_packed", None) is None:
            continue
        module.weight = nn.Parameter(_unpacked_weight(module), requires_grad=False)
        del module.weight_fp16_packed, module.weight_fp16_dtype, module.weight_fp16_shape, module.weight_fp16_rows
        del module.weight_fp16_key, module.weight_fp16_out_features
        count += 1
    return count


def int8_linear(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight_int8 * scale[:, None]).T`` with PyTorch's own kernels.

    On CPU, ``torch._weight_int8pack_mm`` multiplies bfloat16 activations by the int8
    weight directly (the weight is never expanded); from ``INT8_CONVERT_FROM_ROWS`` rows
    (prefill) the weight goes through float32 blocks instead, see
    :func:`linear_by_float32_blocks`.  Elsewhere the weight is converted to the
    activations' dtype first (fused by torch.compile where compiled).
    """
    if x.device.type == "cpu":
        if x.shape[:-1].numel() >= INT8_CONVERT_FROM_ROWS and not torch.compiler.is_compiling():
            # Prefill and batches: the kernel below handles each row as its own product.
            return linear_by_float32_blocks(x, weight_int8, row_scale=scale)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, weight_int8, scale)
        return out.to(x.dtype).view(*x.shape[:-1], -1)
    return F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ W.T`` with W stored as 4-bit groups (see :func:`llama.quantize.quantize_int4_`),
    through torch's int4 kernels: the weight is never expanded.  The CPU kernel takes
    activations in the scales' dtype; the CUDA kernel takes bfloat16."""
    flat = x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype)
    if x.device.type == "cpu":
        out = torch._weight_int4pack_mm_for_cpu(flat, packed, group_size, scales_and_zeros)
    else:
        out = torch._weight_int4pack_mm(flat, packed, group_size, scales_and_zeros)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


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
