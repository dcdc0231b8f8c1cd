"""Weights packed ahead of time for a CPU kernel, and the product through them.

A bfloat16 or float16 linear layer on the CPU multiplies fastest when its weight is laid
out for the kernel that reads it.  Two kinds (which one a model uses is the kernel
policy's choice, :func:`llama.layers.policy.fastest_packing`; measurements in BENCHMARKS.md):

* ``"onednn"``: oneDNN's blocked layout for its native bfloat16 products, chosen on CPUs
  with AMX.  The weight keeps its dtype and values exactly, and one packed matrix serves
  one row (decoding) and many (prefill, batches) alike: on an AMX CPU a step of 8 rows
  costs little more than a step of one, and prompt blocks are much faster than through
  fbgemm.
* ``"fbgemm"``: fbgemm's half-precision product (x86 builds of torch), which holds the
  weight as float16 and converts it to float32 in registers; activations are float32.
  The choice for float16 weights, and for bfloat16 on CPUs without AMX.  Without native
  bfloat16 products (AVX2), torch's own bfloat16 kernels convert the weight again for
  every row: fbgemm streams the weight faster.  With AVX-512 BF16 but no AMX (AMD Zen 4),
  oneDNN's one-row products read the weight at about half fbgemm's speed while its many-row
  products are faster, so prompts pay for the faster decoding.

A third kind serves ``quantize="w8a8"``: int8 weights packed for fbgemm's int8 x int8
product (:func:`pack_weight_int8`), whose inputs are quantised to 8-bit codes per call.

A packed matrix is not a tensor torch.compile can trace: compiled steps reach it through
the ``llama::packed_linear`` operator, by a key (:func:`register_for_compile`).  The layers
that hold packed matrices are in :mod:`llama.layers.packed` and :mod:`llama.layers.quantized`.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import warnings
import weakref
from typing import Optional, Union

import torch

from llama.runtime.options import PACKING_KINDS

logger = logging.getLogger(__name__)

FLOAT16_MAX = 65504.0


class OneThreadFp16Matrix:
    """A matrix packed for fbgemm's single-threaded entry point.  fbgemm hands it back as
    an opaque uint8 tensor; held here, out of torch.compile's sight (it cannot trace such
    a tensor: compiled steps find the matrix by key instead)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class OneDnnMatrix:
    """A weight reordered into oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor,
    in the weight's dtype), held out of torch.compile's sight like fbgemm's matrices."""

    __slots__ = ("tensor", "dtype")

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self.tensor = tensor
        self.dtype = dtype


class Int8ActivationMatrix:
    """An int8 weight and its scale per row, packed for fbgemm's int8 x int8 product
    (``torch.ops.quantized.linear_dynamic``): each call quantises its whole input to 8-bit
    codes with one scale and offset (the input's range, zero included) and accumulates the
    code products in int32; the result is scaled back to float32.  ``reduce_range``: 7-bit
    input codes, for CPUs where 8-bit ones would overflow fbgemm's 16-bit sums of pairs
    (see :attr:`llama.layers.cpu.CpuFeatures.int8_activation_reduce_range`).  Made by :func:`pack_weight_int8`."""

    __slots__ = ("packed", "reduce_range")

    def __init__(self, packed: torch.ScriptObject, reduce_range: bool) -> None:
        self.packed = packed
        self.reduce_range = reduce_range


# A packed matrix: fbgemm's object for its threaded entry point, the single-threaded one's
# (see KernelPolicy.fp16_one_thread), oneDNN's, or fbgemm's int8 one.
PackedMatrix = Union[torch.ScriptObject, OneThreadFp16Matrix, OneDnnMatrix, Int8ActivationMatrix]

# Packed matrices by key, for compiled steps: torch.compile cannot take a packed matrix as
# an argument, so the operator below takes the key and looks the matrix up.  An entry
# lives as long as the layer that owns the matrix (see register_for_compile).
_PACKED_BY_KEY: dict[int, tuple[PackedMatrix, int]] = {}  # key -> (packed matrix, output features)
_next_key = itertools.count()
_library = torch.library.Library("llama", "DEF")
# out_features is an argument, not looked up by key, so that it is part of the compiled
# graph: Inductor caches compiled graphs on disk, and in another process the same key may
# name a matrix of another shape; the graph it finds there must not claim this one's.
_library.define("packed_linear(Tensor x, int key, int out_features) -> Tensor")


def _packed_linear_by_key(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    packed, registered_out = _PACKED_BY_KEY[key]
    if registered_out != out_features:
        raise RuntimeError(f"compiled step asked for packed matrix {key} with {out_features} output features; "
                           f"it has {registered_out} (a stale compiled graph: clear torch.compile's caches)")
    return _packed_product(x, packed)


def _packed_linear_shape(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_library.impl("packed_linear", _packed_linear_by_key, "CPU")
torch.library.register_fake("llama::packed_linear", _packed_linear_shape, lib=_library)


def register_for_compile(owner: object, packed: PackedMatrix, out_features: int) -> int:
    """A key under which compiled code finds ``packed``, forgotten when ``owner`` is freed."""
    key = next(_next_key)
    _PACKED_BY_KEY[key] = (packed, out_features)
    weakref.finalize(owner, _PACKED_BY_KEY.pop, key, None)
    return key


def pack_weight_fp16(weight: torch.Tensor, one_thread_up_to: int = 0) -> Optional[PackedMatrix]:
    """A bfloat16/float16 (out, in) weight packed for fbgemm's half-precision product, or
    None where float16 cannot hold it (a value beyond +-65504, or not finite).  With torch
    on one thread and up to ``one_thread_up_to`` values, it is packed for fbgemm's
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
    if torch.get_num_threads() == 1 and weight.numel() <= one_thread_up_to:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Its packing takes float32: values float16 holds exactly, so nothing rounds again.
            return OneThreadFp16Matrix(torch.fbgemm_pack_gemm_matrix_fp16(half.float()))
    return torch.ops.quantized.linear_prepack_fp16(half, None)


def pack_weight_onednn(weight: torch.Tensor) -> OneDnnMatrix:
    """A bfloat16 (or float16) (out, in) weight in oneDNN's blocked layout for its native
    products, values unchanged (:func:`unpack_weight` gives them back exactly)."""
    return OneDnnMatrix(torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None), weight.dtype)


def pack_weight(weight: torch.Tensor, kind: str, fp16_one_thread_up_to: int = 0) -> Optional[PackedMatrix]:
    """``weight`` packed for the kernel ``kind`` names (one of :data:`PACKING_KINDS`), or
    None where that kernel cannot hold it (fbgemm: a value beyond float16's range)."""
    if kind == "onednn":
        return pack_weight_onednn(weight)
    if kind == "fbgemm":
        return pack_weight_fp16(weight, fp16_one_thread_up_to)
    raise ValueError(f"packing kind must be one of {PACKING_KINDS}, got {kind!r}")


def pack_weight_int8(weight_int8: torch.Tensor, scale: torch.Tensor, reduce_range: bool) -> Int8ActivationMatrix:
    """An (out, in) int8 weight with one scale per row (``weight_int8 * scale[:, None]``,
    as :func:`llama.layers.quantize.quantize_rows_int8` makes) packed for fbgemm's int8 product;
    the codes and scales are kept exactly.  ``reduce_range``: 7-bit input codes, where this
    CPU needs them (:attr:`llama.layers.cpu.CpuFeatures.int8_activation_reduce_range`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        codes = torch._make_per_channel_quantized_tensor(
            weight_int8.detach().contiguous(), scale.detach().double(),
            torch.zeros(weight_int8.shape[0], dtype=torch.long), 0)
        return Int8ActivationMatrix(torch.ops.quantized.linear_prepack(codes, None), reduce_range)


def unpack_weight(packed: PackedMatrix, in_features: int) -> torch.Tensor:
    """The (out, in) matrix ``packed`` holds: float16 for fbgemm's, the weight's own dtype
    (and values) for oneDNN's."""
    if isinstance(packed, OneDnnMatrix):
        return packed.tensor.to_dense()
    return unpack_weight_fp16(packed, in_features)


def unpack_weight_fp16(packed: PackedMatrix, in_features: int) -> torch.Tensor:
    """The float16 (out, in) matrix held by ``packed`` (from :func:`pack_weight_fp16`)."""
    if not isinstance(packed, OneThreadFp16Matrix):
        return torch.ops.quantized.linear_unpack_fp16(packed)[0]
    # The single-threaded entry point has no unpacking: multiply the identity by it.  Exact:
    # each output is one float16 value times 1, plus zeros, accumulated in float32.
    columns = [_packed_product(eye, packed).t() for eye in torch.eye(in_features).split(256)]
    return torch.cat(columns, dim=1).to(torch.float16)


def _packed_product(flat: torch.Tensor, packed: PackedMatrix) -> torch.Tensor:
    """``flat @ W.T`` for a 2-d ``flat`` in the kernel's input dtype (the weight's for
    oneDNN, float32 for fbgemm), by the kernel (and entry point) ``packed`` was made for."""
    if isinstance(packed, OneDnnMatrix):
        return torch.ops.mkldnn._linear_pointwise(flat, packed.tensor, None, "none", [], "")
    if isinstance(packed, OneThreadFp16Matrix):
        return torch.fbgemm_linear_fp16_weight_fp32_activation(flat, packed.tensor, None)
    if isinstance(packed, Int8ActivationMatrix):
        return torch.ops.quantized.linear_dynamic(flat, packed.packed, packed.reduce_range)
    return torch.ops.quantized.linear_dynamic_fp16(flat, packed)


def packed_linear(x: torch.Tensor, packed: PackedMatrix, key: Optional[int] = None,
                  out_features: Optional[int] = None) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by :func:`pack_weight`.  oneDNN's kernel takes
    ``x`` in the weight's dtype; fbgemm's takes it in float32 and converts the
    half-precision weight to float32 in registers.  Both accumulate in float32 and round
    the result to ``x.dtype`` once, as torch's bfloat16 kernels do.  Under torch.compile
    the product goes through the ``llama::packed_linear`` operator, which finds the matrix
    by ``key`` and is told its ``out_features`` (see :func:`use_packed_weights_`)."""
    if x.device.type != "cpu":
        raise RuntimeError("weights packed for a CPU kernel cannot run on " + str(x.device) +
                           ": build the model on that device instead of moving it")
    flat = x.reshape(-1, x.shape[-1])
    flat = flat.to(packed.dtype) if isinstance(packed, OneDnnMatrix) else flat.float()
    if torch.compiler.is_compiling():
        if key is None or out_features is None:
            raise RuntimeError("a compiled step needs the packed matrix's key and output features "
                               "(packed_linear(x, packed, key, out_features))")
        out = torch.ops.llama.packed_linear(flat, key, out_features)
    else:
        out = _packed_product(flat, packed)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def return_freed_memory() -> None:
    """Hand memory freed by the C allocator back to the system (glibc only; elsewhere a
    no-op).  Packing frees each layer's weight and a converted copy of it; without this the
    process keeps those pages, about one more copy of the weights."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
