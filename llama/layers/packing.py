"""Half-precision CPU weights packed for a faster kernel than torch's plain product.

A bfloat16 or float16 linear layer on the CPU multiplies fastest when its weight is laid
out ahead of time for the kernel that reads it.  Two kinds, chosen per CPU by
:func:`cpu_packing_kind` (measurements in BENCHMARKS.md):

* ``"onednn"``: oneDNN's blocked layout for its native bfloat16 products, chosen on CPUs
  with AMX.  The weight keeps its dtype and values exactly, and one packed matrix serves
  one row (decoding) and many (prefill, batches) alike: on an AMX CPU a step of 8 rows
  costs 1.1-1.5x a step of one, and a 256-row prompt block is 8-12x faster than through
  fbgemm.
* ``"fbgemm"``: fbgemm's half-precision product (x86 builds of torch), which holds the
  weight as float16 and converts it to float32 in registers; activations are float32.
  The choice for float16 weights, and for bfloat16 on CPUs without AMX.  Without native
  bfloat16 products (AVX2), torch's own bfloat16 kernels convert the weight again for
  every row: fbgemm streams the weight 1.6-3.7x faster.  With AVX-512 BF16 but no AMX
  (AMD Zen 4), oneDNN's one-row products read the weight at about half fbgemm's speed (a
  150m decoding step 1.65x slower at 1 thread, 1.26x at 2); its many-row products are
  2-2.7x faster there (256-row prompt blocks), so prompts pay for the faster decoding.

A third kind serves ``quantize="w8a8"`` (:func:`llama.layers.quantize.use_int8_activations_`):
int8 weights packed for fbgemm's int8 x int8 product (:func:`pack_weight_int8`), whose
inputs are quantised to 8-bit codes per call.

:func:`use_packed_weights_` packs a model's parallel linear layers in place: each layer's
``weight`` becomes ``None`` and its product goes through :func:`packed_linear`;
``state_dict()`` still returns the weights (unpacked on demand), and
:func:`unpack_weights_` undoes it.  Layers that read the same input (wq/wk/wv, w1/w3) are
packed as one matrix (:class:`PackedProjections`).  Compiled steps reach the packed
matrices through the ``llama::packed_linear`` operator, by key.

A packed layer holds:

* ``weight_packed``: the packed matrix (not a tensor torch.compile can trace);
* ``weight_packed_dtype``, ``weight_packed_shape``: the weight's dtype (the layer's output
  dtype) and (out, in) shape;
* ``weight_packed_rows``: None, or (start, end), this weight's rows in a matrix packed
  together with sibling layers (see :class:`PackedProjections`);
* ``weight_packed_key``, ``weight_packed_out_features``: the matrix's key for compiled
  steps and its output features.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import math
import warnings
import weakref
from typing import Optional, Union

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKING_KINDS = ("onednn", "fbgemm")
FLOAT16_MAX = 65504.0


@functools.lru_cache(maxsize=None)
def cpu_features() -> dict:
    """What torch's CPU probe (pytorch/cpuinfo) reports about this CPU: instruction-set
    flags such as ``amx_bf16`` and ``avx512_bf16``, and ``cpu_name``; empty where this
    torch build has no such probe (the choices below then keep their defaults)."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError, TypeError):
        return {}


@functools.lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """``"intel"``, ``"amd"`` or ``""`` (unknown): Linux's /proc/cpuinfo ``vendor_id``, else
    the CPU's name as torch's probe gives it.  MKL picks its code paths by vendor."""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    return vendor_of(cpuinfo, str(cpu_features().get("cpu_name", "")))


def vendor_of(cpuinfo: str, cpu_name: str) -> str:
    """The vendor named by /proc/cpuinfo's text (its first ``vendor_id`` line), else by the
    CPU's name: ``"intel"``, ``"amd"`` or ``""``."""
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id") and ":" in line:
            return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(line.split(":", 1)[1].strip(), "")
    name = cpu_name.lower()
    return "intel" if "intel" in name else "amd" if "amd" in name else ""


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 tiles (AMX-BF16): oneDNN's one-row products then
    stream a packed weight at memory speed, as fbgemm's do.  Unknown (no probe): assumed so,
    as this library chose before it looked."""
    features = cpu_features()
    return bool(features.get("amx_bf16", True)) if features else True


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16_matmul() -> bool:
    """Whether oneDNN multiplies bfloat16 matrices natively here (AVX-512 BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def onednn_packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build and CPU run oneDNN's product on a packed ``dtype`` weight
    (``torch.ops.mkldnn._reorder_linear_weight``; torch refuses bfloat16 on CPUs without
    AVX-512)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none", [], "")
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def cpu_packing_kind(dtype: torch.dtype) -> Optional[str]:
    """The packing that decodes ``dtype`` weights fastest on this CPU: ``"onednn"`` for
    bfloat16 where the CPU has AMX, else ``"fbgemm"`` for bfloat16 and float16 where torch
    has fbgemm, else None (torch's own kernels).  Measured on three CPUs (BENCHMARKS.md):
    with AMX, oneDNN is as fast for one row and much faster for many; with AVX-512 BF16
    and no AMX, fbgemm's one-row products are 1.5-2x faster than oneDNN's and its 256-row
    ones 2-2.7x slower (decoding chosen over prompts); on AVX2 fbgemm wins both.  float16
    stays with fbgemm: without AMX-FP16, oneDNN's one-row float16 product was 1.5-2.5x
    slower than fbgemm's on the AMX machine (AVX-512 FP16)."""
    if dtype == torch.bfloat16 and cpu_has_native_bf16_matmul() and cpu_has_amx_bf16() \
            and onednn_packing_available(dtype):
        return "onednn"
    if dtype in (torch.bfloat16, torch.float16) and fp16_packing_available():
        return "fbgemm"
    return None


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
    (see :func:`int8_activation_kernel`).  Made by :func:`pack_weight_int8`."""

    __slots__ = ("packed", "reduce_range")

    def __init__(self, packed: torch.ScriptObject, reduce_range: bool) -> None:
        self.packed = packed
        self.reduce_range = reduce_range


# A packed matrix: fbgemm's object for its threaded entry point, the single-threaded one's
# (see FP16_ONE_THREAD_UP_TO), oneDNN's, or fbgemm's int8 one.
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


def pack_weight_fp16(weight: torch.Tensor) -> Optional[PackedMatrix]:
    """A bfloat16/float16 (out, in) weight packed for fbgemm's half-precision product, or
    None where float16 cannot hold it (a value beyond +-65504, or not finite).  With torch
    on one thread and up to ``FP16_ONE_THREAD_UP_TO`` values, it is packed for fbgemm's
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


def pack_weight_onednn(weight: torch.Tensor) -> OneDnnMatrix:
    """A bfloat16 (or float16) (out, in) weight in oneDNN's blocked layout for its native
    products, values unchanged (:func:`unpack_weight` gives them back exactly)."""
    return OneDnnMatrix(torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None), weight.dtype)


def pack_weight(weight: torch.Tensor, kind: str) -> Optional[PackedMatrix]:
    """``weight`` packed for the kernel ``kind`` names (one of :data:`PACKING_KINDS`), or
    None where that kernel cannot hold it (fbgemm: a value beyond float16's range)."""
    if kind == "onednn":
        return pack_weight_onednn(weight)
    if kind == "fbgemm":
        return pack_weight_fp16(weight)
    raise ValueError(f"packing kind must be one of {PACKING_KINDS}, got {kind!r}")


@functools.lru_cache(maxsize=None)
def int8_activation_kernel() -> Optional[bool]:
    """None where this torch build has no fbgemm int8 product (not x86, or torch dropped
    its deprecated quantised tensors); else the ``reduce_range`` it needs here: False where
    8-bit input codes give exact int32 sums (CPUs with VNNI accumulate code products in
    int32), True where they would not (AVX2 without VNNI sums pairs of products in 16 bits,
    which 8-bit codes overflow: 255 * 127 * 2 > 32767).  Found by a product that overflows
    16 bits if anything does: every input code 255, every weight 127."""
    try:
        with warnings.catch_warnings():  # quantised tensors are deprecated (torch 2.13)
            warnings.simplefilter("ignore")
            weight = torch.full((16, 64), 127, dtype=torch.int8)
            packed = pack_weight_int8(weight, torch.ones(16), reduce_range=False).packed
            out = torch.ops.quantized.linear_dynamic(torch.ones(1, 64), packed, False)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    exact = 64 * 127.0  # codes of the input 1.0 (scale 1/255) times 127, times the scales
    return not torch.allclose(out, torch.full_like(out, exact), rtol=1e-4)


def pack_weight_int8(weight_int8: torch.Tensor, scale: torch.Tensor,
                     reduce_range: Optional[bool] = None) -> Int8ActivationMatrix:
    """An (out, in) int8 weight with one scale per row (``weight_int8 * scale[:, None]``,
    as :func:`llama.layers.quantize.quantize_rows_int8` makes) packed for fbgemm's int8 product;
    the codes and scales are kept exactly.  ``reduce_range`` None: what this CPU needs
    (:func:`int8_activation_kernel`)."""
    if reduce_range is None:
        reduce_range = int8_activation_kernel()
        if reduce_range is None:
            raise RuntimeError("this torch build has no fbgemm int8 product (x86 builds of torch have it)")
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


def _unpacked_weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a packed layer: its ``weight`` as a tensor again, in its dtype."""
    if getattr(module, "weight_packed", None) is not None:
        state_dict[prefix + "weight"] = _unpacked_weight(module)


def _unpacked_weight(module: nn.Module) -> torch.Tensor:
    """A packed layer's weight as a tensor, in its dtype (its own rows of a shared matrix)."""
    weight = unpack_weight(module.weight_packed, module.weight_packed_shape[1])
    rows = module.weight_packed_rows
    if rows is not None:
        weight = weight[rows[0] : rows[1]]
    return weight.to(module.weight_packed_dtype)


class PackedProjections(nn.Module):
    """Column-parallel layers that read the same input (an attention layer's wq, wk, wv; a
    feed-forward layer's w1, w3), packed as one matrix: one product gives all their outputs,
    fewer, larger calls than one per layer (about 40 us a decoding step per layer saved on
    the benchmark machine).  Each layer keeps working on its own (it computes the whole
    product and keeps its rows), and ``state_dict()`` still holds each layer's weight (this
    module has no parameters).  A module, so that torch.compile guards on ``key`` and
    ``sizes`` (int attributes of plain objects are not guarded): a step compiled for one
    model is not reused for another."""

    def __init__(self, packed: PackedMatrix, sizes: list[int], key: int) -> None:
        super().__init__()
        self.packed = packed
        self.sizes = sizes  # each layer's output features, in order
        self.key = key  # the matrix's key for compiled steps

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """All the layers' outputs side by side, (..., sum(sizes)), in the layers' order."""
        return packed_linear(x, self.packed, self.key, sum(self.sizes))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, dim=-1)


class Int8ActivationProjections(PackedProjections):
    """``quantize="w8a8"``: int8 layers that read the same input (wq, wk, wv; w1, w3) packed
    as one matrix for fbgemm's int8 x int8 product (see :class:`Int8ActivationMatrix`),
    which one-row inputs (decoding steps at batch 1) take: the row is quantised once for
    all of them, and each layer's outputs are exactly what its own product would give
    (code products summed in integers, one scale per output row).  Inputs of more rows go
    through ``rows``, int8's product for the group (:class:`llama.layers.parallel.Int8Projections`),
    with bfloat16 activations: one quantisation for many rows would make a row's result
    depend on the others."""

    def __init__(self, packed: Int8ActivationMatrix, layers: list[nn.Module], key: int,
                 rows: PackedProjections) -> None:
        super().__init__(packed, [layer.weight_int8.shape[0] for layer in layers], key)
        self.layers = tuple(layers)  # a tuple: their owner holds them as submodules, this does not
        self.rows = rows

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.shape[:-1].numel() == 1:
            return self.product(x).split(self.sizes, dim=-1)
        return self.rows(x)


def _pack_as_one_(layers: list[nn.Module], kind: str) -> Optional[PackedProjections]:
    """Pack the weights of ``layers`` (same input features, same dtype) as one matrix, or
    return None (and change nothing) where the kernel cannot hold one of them."""
    weights = [layer.weight for layer in layers]
    if len({(w.dtype, w.shape[1]) for w in weights}) != 1:
        return None
    packed = pack_weight(torch.cat([w.detach() for w in weights]), kind)
    if packed is None:
        return None
    out_features = sum(w.shape[0] for w in weights)
    key = register_for_compile(layers[0], packed, out_features)
    start = 0
    for layer, weight in zip(layers, weights):
        _use_packed_(layer, packed, weight, (start, start + weight.shape[0]), (key, out_features))
        start += weight.shape[0]
    return PackedProjections(packed, [w.shape[0] for w in weights], key)


def _use_packed_(module: nn.Module, packed: PackedMatrix, weight: torch.Tensor,
                 rows: Optional[tuple[int, int]], shared: Optional[tuple[int, int]] = None) -> None:
    """``shared``: (key, output features) of a matrix packed with sibling layers."""
    module.weight = None
    module.weight_packed = packed
    if shared is None:
        shared = register_for_compile(module, packed, weight.shape[0]), weight.shape[0]
    module.weight_packed_key, module.weight_packed_out_features = shared
    module.weight_packed_dtype = weight.dtype
    module.weight_packed_shape = tuple(weight.shape)
    module.weight_packed_rows = rows
    module._register_state_dict_hook(_unpacked_weight_in_state_dict)


def check_packing_kind(kind: Optional[str], dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """``kind`` itself if it is None or one of :data:`PACKING_KINDS` (and, given the
    weights' ``dtype``, one this torch build and CPU can run for it); a ValueError that says
    so otherwise."""
    if kind is not None and kind not in PACKING_KINDS:
        raise ValueError(f"packing kind must be None or one of {PACKING_KINDS}, got {kind!r}")
    if dtype is not None and kind is not None and not _kind_runs(kind, dtype):
        if kind == "onednn":
            raise ValueError(f"oneDNN's packed {dtype} product does not run here (torch needs AVX-512 for it): "
                             "use cpu_packing='fbgemm' or leave it unset")
        raise ValueError("this torch build has no fbgemm half-precision product (x86 builds have it): "
                         "use cpu_packing='onednn' or leave it unset")
    return kind


def _kind_runs(kind: str, dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run the packed product ``kind`` names for ``dtype`` weights."""
    return onednn_packing_available(dtype) if kind == "onednn" else fp16_packing_available()


def _packable(module: nn.Module) -> bool:
    """A parallel linear layer (it has ``local_matmul``) with a bfloat16/float16 CPU weight."""
    weight = getattr(module, "weight", None)
    return (hasattr(module, "local_matmul") and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"
            and weight.dtype in (torch.bfloat16, torch.float16))


def use_packed_weights_(model: nn.Module, kind: Optional[str] = None) -> int:
    """Pack every bfloat16/float16 parallel linear weight on the CPU for the kernel ``kind``
    names (``"onednn"`` or ``"fbgemm"``; None: :func:`cpu_packing_kind` of its dtype), in
    place of the weight: the same two bytes per value (see :func:`packed_linear`).  A
    weight the kernel cannot hold (fbgemm: beyond float16's range) stays as it is.  The
    model's ``state_dict()`` still holds ``weight`` tensors (unpacked on demand).  The
    layers a module names in ``packable_input_projections`` are packed as one matrix, set
    as its ``packed_input_projections`` (see :class:`PackedProjections`).  Returns the
    number of weights packed; 0 where this torch build has no such kernel."""
    check_packing_kind(kind)

    def kind_for(weight: torch.Tensor) -> Optional[str]:
        if kind is None:
            return cpu_packing_kind(weight.dtype)
        return kind if _kind_runs(kind, weight.dtype) else None

    count = kept = 0
    for module in model.modules():
        # Layers that read the same input go into one matrix (see PackedProjections).
        names = getattr(module, "packable_input_projections", ())
        siblings = [getattr(module, name) for name in names]
        if siblings and all(_packable(layer) for layer in siblings):
            chosen = kind_for(siblings[0].weight)
            if chosen is not None:
                module.packed_input_projections = _pack_as_one_(siblings, chosen)
                if module.packed_input_projections is not None:
                    count += len(siblings)
    for module in model.modules():
        if not _packable(module) or (chosen := kind_for(module.weight)) is None:
            continue
        packed = pack_weight(module.weight, chosen)
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


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the weights packed by :func:`use_packed_weights_` (two per value; they
    are not tensors, so ``parameters()`` and ``buffers()`` do not count them)."""
    # Layers packed together each count their own rows: the sum is the shared matrix's size.
    return sum(2 * math.prod(m.weight_packed_shape) for m in model.modules() if hasattr(m, "weight_packed"))


def _return_freed_memory() -> None:
    """Hand memory freed by the C allocator back to the system (glibc only; elsewhere a
    no-op).  Packing frees each layer's weight and a converted copy of it; without this the
    process keeps those pages, about one more copy of the weights."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def unpack_weights_(model: nn.Module) -> int:
    """Undo :func:`use_packed_weights_`: every packed layer holds a plain ``weight``
    parameter again (for code that changes weights in place).  Returns the number unpacked.
    A quantized model's grouped products (int8's, w8a8's int8-activation ones) are not
    packed weights of this kind and stay as they are: dropping w8a8's would quietly turn
    its wq/wk/wv and w1/w3 into weight-only int8."""
    count = 0
    for module in model.modules():
        if type(getattr(module, "packed_input_projections", None)) is PackedProjections:
            module.packed_input_projections = None
        if getattr(module, "weight_packed", None) is None:
            continue
        module.weight = nn.Parameter(_unpacked_weight(module), requires_grad=False)
        del module.weight_packed, module.weight_packed_dtype, module.weight_packed_shape, module.weight_packed_rows
        del module.weight_packed_key, module.weight_packed_out_features
        count += 1
    return count
