"""Quantisation of the model's linear layers: int8 and int4 weights, and w8a8.

int8: each weight row (one output feature) is stored as int8 with one float scale:
``W[i, :] ~= scale[i] * q[i, :]``, ``scale[i] = max|W[i, :]| / 127``.

int4: each row is cut into groups of ``group_size`` input columns; a group is stored as
4-bit codes 0..15 with a scale and an offset, ``W ~= (q - 8) * scale + zero`` where the
group's minimum maps to code 0 and its maximum to 15 (asymmetric, as gpt-fast and
torchao store it, the layout torch's int4 kernels read).

w8a8 (CPU only): int8's weights, also packed for fbgemm's int8 x int8 product, which
one-row products (decoding steps at batch 1) take: the row is quantised to 8-bit codes per
call, i.e. per token (see :func:`use_int8_activations_`).

Otherwise activations stay in floating point: every int4 product, and on the CPU int8 products of
fewer than 32 rows, take them rounded to bfloat16 (what torch's kernels are built for);
the results come back in the model's dtype.  Decoding reads a quarter / an eighth (vs
float32) of the weight bytes, which is what a batch-1 decode step is bound by.  Llama 4's
experts are quantised too, each expert's matrices as a linear layer's; the router and
the embedding table stay in float (a step reads one row of the table).  Quantisation
happens per rank, on that rank's slice, so any number of processes works; the loader
quantises each layer as soon as its slice is read (:func:`quantized_module`), so a rank holds
one layer in float at a time.

Each quantised layer is a layer of its own class (:mod:`llama.layers.quantized`), swapped in
for the dense one: its product is its class's, not chosen by what attributes it carries.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, cast

import torch
from torch import nn

from llama.layers import cpu_kernels
from llama.layers.moe import Experts, Int4Experts, Int8Experts
from llama.layers.packing import pack_weight_int8, register_for_compile
from llama.layers.parallel import ColumnParallel, DenseWeight, ParallelLinear, RowParallel
from llama.layers.policy import KernelPolicy
from llama.layers.quantized import (
    Int4ColumnParallelLinear,
    Int4RowParallelLinear,
    Int4Weight,
    Int8ColumnParallelLinear,
    Int8FusedProjections,
    Int8RowParallelLinear,
    Int8Weight,
    W8A8ColumnParallelLinear,
    W8A8FusedProjections,
    W8A8RowParallelLinear,
    W8A8Weight,
)
from llama.runtime.options import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES

logger = logging.getLogger(__name__)


def quantized_kind(model: nn.Module) -> Optional[str]:
    """How ``model``'s linear layers are quantised: ``"w8a8"``, ``"int8"``, ``"int4"`` or None."""
    kinds = set()
    for module in model.modules():
        if isinstance(module, W8A8Weight):
            kinds.add("w8a8")
        elif isinstance(module, (Int8Weight, Int8Experts)):
            kinds.add("int8")
        elif isinstance(module, (Int4Weight, Int4Experts)):
            kinds.add("int4")
    for kind in ("w8a8", "int8", "int4"):  # w8a8 keeps some layers (the output) plain int8
        if kind in kinds:
            return kind
    return None


def int4_group_size(quantize: Optional[str], group_size: Optional[int]) -> Optional[int]:
    """The group size ``Llama.build(quantize=..., quantize_group_size=...)`` quantises with:
    ``group_size`` (default :data:`DEFAULT_INT4_GROUP_SIZE`) for int4, None for the other
    modes.  A group size given with another mode is refused rather than ignored: int8 and w8a8
    have one scale per output channel, so a caller asking for groups would get something else."""
    if quantize != "int4":
        if group_size is not None:
            raise ValueError(
                f"quantize_group_size applies to quantize='int4' only (int8 and w8a8 keep one scale per "
                f"output channel); got quantize={quantize!r} with quantize_group_size={group_size!r}: "
                "leave the group size out, or use quantize='int4'"
            )
        return None
    if group_size is None:
        return DEFAULT_INT4_GROUP_SIZE
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"the int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    return group_size


# Quantisation works through a weight by blocks of rows of about this many float32 bytes, so
# that its float32 temporaries stay small beside the weight itself (a vocabulary projection
# in float32 is gigabytes).  Every step is per row (or per group of a row), so the result is
# the same bit for bit as in one piece.
QUANTIZE_BLOCK_BYTES = 64 << 20
# torch's CPU int4 packing lays rows out in blocks of 64: packed by blocks of a multiple of
# 64 rows, the pieces put together are the whole matrix packed at once.
_INT4_CPU_PACK_ROWS = 64


def _row_blocks(weight: torch.Tensor, block_bytes: int, multiple: int = 1) -> list[torch.Tensor]:
    """``weight`` (out, in) cut into blocks of whole rows, a multiple of ``multiple`` rows each
    (the last one may be shorter), of about ``block_bytes`` in float32."""
    rows = max(multiple, block_bytes // (4 * max(weight.shape[1], 1)) // multiple * multiple)
    return list(weight.split(rows)) if weight.shape[0] else [weight]


def quantize_rows_int8(weight: torch.Tensor, block_bytes: int = QUANTIZE_BLOCK_BYTES) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """(int8 weight, float32 scale per row) with symmetric per-output-channel scaling,
    computed by blocks of rows of about ``block_bytes`` in float32."""
    codes, scales = [], []
    for block in _row_blocks(weight, block_bytes):
        w = block.to(torch.float32, copy=True)  # one float32 temporary, worked on in place
        # max |w| per row without a tensor of |w|: the same value exactly
        scale = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg_()).clamp_(min=1e-12).div_(127.0)
        codes.append(w.div_(scale.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8))
        scales.append(scale)
        del w
    if len(codes) == 1:
        return codes[0], scales[0]
    return torch.cat(codes), torch.cat(scales)


def _dense_layers(model: nn.Module) -> list[tuple[nn.Module, str, ParallelLinear]]:
    """(parent, attribute name, layer) of every dense parallel linear layer."""
    return [(parent, name, cast(ParallelLinear, layer)) for parent in model.modules()
            for name, layer in parent.named_children()
            if isinstance(layer, DenseWeight) and isinstance(layer, ParallelLinear)]


def _experts(model: nn.Module) -> list[tuple[nn.Module, str, Experts]]:
    """(parent, attribute name, experts) of every stack of Llama 4 experts not yet quantised."""
    return [(parent, name, e) for parent in model.modules() for name, e in parent.named_children()
            if type(e) is Experts]


def quantizable(module: nn.Module) -> bool:
    """Whether :func:`quantized_module` turns ``module`` into a quantised one: a dense parallel
    linear layer, or a stack of Llama 4 experts not yet quantised."""
    return (isinstance(module, DenseWeight) and isinstance(module, ParallelLinear)) or type(module) is Experts


@torch.no_grad()
def quantized_module(module: nn.Module, mode: str, group_size: Optional[int] = None) -> nn.Module:
    """The quantised twin of one :func:`quantizable` module (its weights loaded, on their
    device): ``mode`` "int8" (also w8a8's first step) or "int4" (in groups of
    ``group_size`` input columns).  ``module`` is left as it is; the caller swaps the twin in
    and lets the full-precision weights go.  The same function quantises a loaded model
    (:func:`quantize_int8_`, :func:`quantize_int4_`) and a model being loaded
    (:mod:`llama.checkpoint.loader`), so both give the same tensors bit for bit."""
    if mode == "int8":
        return _int8_experts(module) if type(module) is Experts else _int8_layer(cast(ParallelLinear, module))
    if mode == "int4":
        if group_size is None:
            raise ValueError("int4 quantisation needs a group size")
        if type(module) is Experts:
            return _int4_experts(module, group_size)
        return _int4_layer(cast(ParallelLinear, module), group_size)
    raise ValueError(f"quantised_module: mode must be 'int8' or 'int4', got {mode!r}")


def _int8_layer(layer: ParallelLinear) -> ParallelLinear:
    q, scale = quantize_rows_int8(layer.weight)
    cls: type[Int8ColumnParallelLinear | Int8RowParallelLinear] = (
        Int8ColumnParallelLinear if isinstance(layer, ColumnParallel) else Int8RowParallelLinear)
    new = layer.swapped_to(cls)
    new.register_buffer("weight_int8", q.contiguous())
    new.register_buffer("weight_scale", scale.to(_int8_scale_dtype(layer.weight.device, layer.weight.dtype)))
    return new


def _int8_experts(experts: Experts) -> Experts:
    new = experts.swapped_to(Int8Experts)
    for matrix in Experts.matrices:
        stacked = getattr(experts, matrix)  # (E, in, out)
        dtype = _int8_scale_dtype(stacked.device, stacked.dtype)
        rows = [quantize_rows_int8(stacked[e].t()) for e in range(experts.num_experts)]  # (out, in) each
        new.register_buffer(matrix + "_int8", torch.stack([q for q, _ in rows]))
        new.register_buffer(matrix + "_scale", torch.stack([scale for _, scale in rows]).to(dtype))
        del rows, stacked
    return new


@torch.no_grad()
def quantize_int8_(model: nn.Module) -> int:
    """Swap every dense parallel linear layer of ``model`` for an int8 one, and every Llama 4
    expert stack for int8 experts (the embedding table stays in float: a step reads one row of
    it).  Returns the number of linear layers and expert stacks converted."""
    count = _quantize_units_(model, "int8")
    fused = int8_siblings_as_one_(model)
    logger.info("quantised %d linear layers / expert stacks to int8 (weight-only, per output channel); "
                "%d groups of layers that read the same input multiply as one", count, fused)
    return count


def _quantize_units_(model: nn.Module, mode: str, group_size: Optional[int] = None) -> int:
    """Swap every :func:`quantizable` module of ``model`` for its quantised twin, one at a
    time (each full-precision original is let go before the next is quantised)."""
    units = _dense_layers(model) + _experts(model)
    count = len(units)
    units.reverse()
    while units:
        parent, name, module = units.pop()
        setattr(parent, name, quantized_module(module, mode, group_size))
        del module
    return count


def int8_siblings_as_one_(model: nn.Module) -> int:
    """Layers that read the same input (a module's ``packable_input_projections``: wq, wk,
    wv; w1, w3) get one int8 weight and one scale vector, each layer's ``weight_int8`` and
    ``weight_scale`` becoming views of its rows (no second copy), and the module one product
    for all of them, its ``fused`` (:class:`Int8FusedProjections`).  Returns the number of groups."""
    groups = 0
    for module in model.modules():
        siblings = [getattr(module, name) for name in getattr(module, "packable_input_projections", ())]
        if len(siblings) < 2 or not all(isinstance(layer, Int8Weight) for layer in siblings):
            continue
        weight = torch.cat([layer.weight_int8 for layer in siblings])
        scale = torch.cat([layer.weight_scale for layer in siblings])
        start = 0
        for layer in siblings:
            rows = layer.weight_int8.shape[0]
            layer.weight_int8, layer.weight_scale = weight[start : start + rows], scale[start : start + rows]
            start += rows
        sizes = [layer.weight_int8.shape[0] for layer in siblings]
        module.fused = Int8FusedProjections(weight, scale, sizes, siblings[0].policy)
        groups += 1
    return groups


def require_w8a8_device(device: torch.device) -> None:
    """Raise where ``quantize="w8a8"`` cannot run: anywhere but the CPU."""
    if device.type != "cpu":
        raise ValueError(f'quantize="w8a8" runs on the CPU only (fbgemm\'s int8 products); on {device} use "int8"')


def require_int8_activation_kernel(reduce_range: Optional[bool]) -> bool:
    """``reduce_range`` (the CPU's :attr:`~llama.layers.cpu.CpuFeatures.int8_activation_reduce_range`),
    or a RuntimeError where ``quantize="w8a8"`` cannot run: no fbgemm int8 product in this torch build."""
    if reduce_range is None:
        raise RuntimeError('quantize="w8a8" needs fbgemm\'s int8 product, which this torch build lacks '
                           '(x86 builds of torch have it); use quantize="int8"')
    return reduce_range


@torch.no_grad()
def use_int8_activations_(model: nn.Module, policy: KernelPolicy) -> int:
    """``quantize="w8a8"``, after :func:`quantize_int8_`: every int8 linear layer on the CPU is
    swapped for a w8a8 one, whose weight is also packed for fbgemm's int8 x int8 product,
    which one-row products (decoding steps at batch 1) then take: the row is quantised to
    8-bit codes with one scale and offset (its own range, zero included), multiplied in
    integers and scaled back, as llama.cpp's Q8_0 quantises activations (in blocks of 32
    there).  Products of more rows (prompts, batched steps) keep bfloat16 activations, and
    Llama 4's experts stay weight-only.  int8's fused groups (wq, wk, wv; w1, w3) are packed
    as one matrix (:class:`W8A8FusedProjections`): one call, one quantisation of the row.
    The packed copy is a second copy of the int8 weights (prompts read the first).  Returns
    the number of layers packed."""
    reduce_range = require_int8_activation_kernel(policy.int8_activation_reduce_range)
    # Int8Weight is mixed into the int8 ParallelLinear classes only
    layers = [(parent, name, cast(Int8ColumnParallelLinear | Int8RowParallelLinear, layer))
              for parent in model.modules() for name, layer in parent.named_children()
              if isinstance(layer, Int8Weight)]
    for _, _, layer in layers:
        require_w8a8_device(layer.weight_int8.device)
    for module in model.modules():
        group = getattr(module, "fused", None)
        if isinstance(group, Int8FusedProjections):
            packed = pack_weight_int8(group.weight_int8, group.weight_scale.float(), reduce_range)
            key = register_for_compile(module, packed, group.weight_int8.shape[0])
            module.fused = W8A8FusedProjections(packed, key, group)
    for parent, name, layer in layers:
        cls: type[W8A8ColumnParallelLinear | W8A8RowParallelLinear] = (
            W8A8ColumnParallelLinear if isinstance(layer, ColumnParallel) else W8A8RowParallelLinear)
        new = layer.swapped_to(cls)
        new.register_buffer("weight_int8", layer.weight_int8)
        new.register_buffer("weight_scale", layer.weight_scale)
        new.int8_packed = pack_weight_int8(layer.weight_int8, layer.weight_scale.float(), reduce_range)
        new.int8_packed_key = register_for_compile(new, new.int8_packed, layer.weight_int8.shape[0])
        setattr(parent, name, new)
    logger.info("packed %d int8 layers for int8 activations (one-row products)%s",
                len(layers), ", 7-bit input codes on this CPU" if reduce_range else "")
    return len(layers)


def _int8_scale_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    # The CPU kernel takes bfloat16 scales; elsewhere they meet the activations' dtype.
    return torch.bfloat16 if device.type == "cpu" else weight_dtype


# The int4 quantiser's search (as llama.cpp's for its formats with an offset, Q4_1 and Q4_K): each
# group's range clipped at either end by each of these factors, the clipping with the least
# squared error kept, then its scale and offset fitted to its codes by least squares and the
# codes rounded again, this many times (each kept only where it lowers the error).
INT4_RANGE_CLIPS = (1.0, 0.88)
INT4_LEAST_SQUARES_STEPS = 3
# Values quantised at a time on a CPU: a piece's temporaries stay in its caches between passes.
_INT4_PIECE_VALUES = 1 << 18


def quantize_groups_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int32 (out, in) in 0..15, scale (out, in/group), zero (out, in/group)) with
    ``weight ~= (codes - 8) * scale + zero`` group by group.  The scale and zero are
    bfloat16 values (in float32: the dtype the kernels keep them in, so that the codes are
    rounded against the values the kernels multiply by), chosen for the least squared error
    of the group's reconstruction among :data:`INT4_RANGE_CLIPS` clippings of its range, then
    refined by least squares (:data:`INT4_LEAST_SQUARES_STEPS`): never worse than the plain
    range (minimum to code 0, maximum to 15).  Groups of 64 (4.5 bits a weight with our CPU
    kernel's layout) then come out closer to the weights than llama.cpp's Q4_0 at the same
    size (tests/test_quantization.py)."""
    out_f, in_f = weight.shape
    groups = weight.float().reshape(out_f * (in_f // group_size), group_size)
    codes = torch.empty(groups.shape, dtype=torch.int32, device=groups.device)
    scale = torch.empty(groups.shape[0], device=groups.device)
    zero = torch.empty(groups.shape[0], device=groups.device)
    # a GPU's passes are not cache-bound: pieces as large as the CPU's 64 MB quantisation blocks
    piece = _INT4_PIECE_VALUES if groups.device.type == "cpu" else QUANTIZE_BLOCK_BYTES // 4
    step = max(1, piece // group_size)
    for start in range(0, groups.shape[0], step):
        c, s, z = _fit_groups_int4(groups[start : start + step])
        codes[start : start + step], scale[start : start + step], zero[start : start + step] = c, s, z
    return codes.reshape(out_f, in_f), scale.reshape(out_f, -1), zero.reshape(out_f, -1)


def _in_bfloat16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest bfloat16, kept in float32."""
    return t.to(torch.bfloat16).float()


def _round_int4(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as float, zero rounded to bfloat16, squared error per group) of groups ``x``
    (groups, size) for a scale (bfloat16 values already) and zero per group."""
    zero = _in_bfloat16(zero)
    codes = torch.round((x - zero[:, None]) / scale[:, None] + 8).clamp_(0, 15)
    error = ((codes - 8) * scale[:, None] + zero[:, None] - x).square_().sum(-1)
    return codes, scale, zero, error


def _fit_groups_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_groups_int4` of groups ``x`` (groups, size) float32."""
    low, high = x.amin(-1), x.amax(-1)
    best: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def keep(candidate: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        nonlocal best
        if best is None:
            best = candidate
            return
        better = candidate[3] < best[3]
        best = (torch.where(better[:, None], candidate[0], best[0]), torch.where(better, candidate[1], best[1]),
                torch.where(better, candidate[2], best[2]), torch.minimum(candidate[3], best[3]))

    for low_clip in INT4_RANGE_CLIPS:
        for high_clip in INT4_RANGE_CLIPS:
            scale = _in_bfloat16(((high * high_clip - low * low_clip) / 15).clamp(min=1e-6))
            keep(_round_int4(x, scale, low * low_clip + 8 * scale))
    assert best is not None
    codes, mean = best[0], x.mean(-1)
    for _ in range(INT4_LEAST_SQUARES_STEPS):  # x ~ scale * (codes - 8) + zero, fitted to these codes
        centred = codes - codes.mean(-1, keepdim=True)
        spread = centred.square().sum(-1)
        scale = torch.where(spread > 0, (centred * x).sum(-1) / spread.clamp(min=1e-12), best[1])
        scale = _in_bfloat16(scale.clamp(min=1e-6))
        candidate = _round_int4(x, scale, mean - scale * (codes.mean(-1) - 8))
        keep(candidate)
        codes = candidate[0]
    assert best is not None
    return best[0].to(torch.int32), best[1], best[2]


# torch's CUDA int4 kernel reads a layer's input columns in tiles of 16, 8 tiles at a time
# (the inner k-tiles int4_matrix packs with): every width must be a multiple of 128.  Its
# CPU kernel takes any width the groups divide.
INT4_CUDA_WIDTH_MULTIPLE = 8 * 16


def check_int4_group_size(model: nn.Module, group_size: int, device: Optional[torch.device] = None,
                          model_parallel_sizes: Sequence[int] = ()) -> None:
    """Refuse (ValueError) a group size torch's int4 kernels do not take, one that does not
    divide every quantised layer's width on this rank, or, on CUDA (``device``), a layer
    whose width on this rank is not a multiple of :data:`INT4_CUDA_WIDTH_MULTIPLE`; the
    message names the layer and width, and which of ``model_parallel_sizes`` would work.
    Reads shapes only, so ``model`` may be on the meta device (``load_model`` checks before
    reading the checkpoint)."""
    int4_group_size("int4", group_size)
    inputs = _int4_inputs(model)
    widths = {width for _, width, _, _ in inputs}
    bad = sorted(w for w in widths if w % group_size)
    if bad:
        fits = [g for g in INT4_GROUP_SIZES if all(w % g == 0 for w in widths)]
        raise ValueError(
            f"int4 groups of {group_size} columns do not divide this rank's layer widths {bad}; "
            + (f"group sizes that work here: {fits}" if fits else "no int4 group size fits this model: use int8")
        )
    if device is None or device.type != "cuda":
        return
    tile = INT4_CUDA_WIDTH_MULTIPLE
    misfits = [(name, width, full, world) for name, width, full, world in inputs if width % tile]
    if misfits:
        name, width, full, world = misfits[0]
        sizes = [m for m in model_parallel_sizes
                 if all((f // m if w != f else f) % tile == 0 and (f // m if w != f else f) % group_size == 0
                        for _, w, f, _ in inputs)]
        split = f" ({full} over {world} processes)" if width != full else ""
        raise ValueError(
            f"int4 on CUDA needs each layer's input width on a process to be a multiple of {tile} (torch's int4 "
            f"kernel reads {tile} columns at a time), but {name} takes {width}{split}"
            + (f" and {len(misfits) - 1} other layer(s) do not fit either" if len(misfits) > 1 else "")
            + ": " + (f"run with model_parallel_size in {sizes}, or " if sizes else "")
            + "use quantize='int8'"
        )


def _int4_inputs(model: nn.Module) -> list[tuple[str, int, int, int]]:
    """(name, input width on this rank, full input width, processes it is split over) of every
    matrix int4 would quantise."""
    # the model's process count, as its row-parallel layers were built for (attention's wo in every model)
    world = next((m.world_size for m in model.modules() if isinstance(m, RowParallel)), 1)
    inputs = []
    for name, module in model.named_modules():
        if isinstance(module, DenseWeight) and isinstance(module, ParallelLinear):
            width = module.weight.shape[1]
            split = world if isinstance(module, RowParallel) else 1
            inputs.append((name, width, width * split, split))
        elif type(module) is Experts:
            for matrix in Experts.matrices:
                width = getattr(module, matrix).shape[1]  # (E, in, out)
                split = world if matrix == "w2" else 1  # w2's input is the split hidden units
                inputs.append((f"{name}.{matrix}", width, width * split, split))
    return inputs


def int4_matrix(weight: torch.Tensor, group_size: int,
                block_bytes: int = QUANTIZE_BLOCK_BYTES) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(packed codes, scales and zeros (in / group, out padded, 2), out features) of one
    (out, in) weight, in the layout torch's int4 kernel for its device reads.  Scales,
    zeros and activations are bfloat16 whatever the model's dtype: CUDA's kernel takes
    nothing else, and torch's CPU kernel is vectorised for bfloat16 only (with float32
    activations it is an order of magnitude slower).  Quantised by blocks of rows of about
    ``block_bytes`` in float32: the same result as in one piece."""
    dtype = torch.bfloat16
    out_features = weight.shape[0]
    # The kernels want a multiple of 16 output rows: pad with rows that are zero
    # (code 8, offset 0); the callers drop their outputs.
    pad = -out_features % 16
    on_cpu = weight.device.type == "cpu"
    blocks = _row_blocks(weight, block_bytes, _INT4_CPU_PACK_ROWS)
    packed, scales, zeros = [], [], []
    for i, block in enumerate(blocks):
        codes, scale, zero = quantize_groups_int4(block, group_size)
        if pad and i == len(blocks) - 1:  # the padding joins the last block (CPU packing is by 64 rows)
            codes = torch.cat([codes, codes.new_full((pad, codes.shape[1]), 8)])
            scale = torch.cat([scale, scale.new_ones(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        # CPU: packed block by block; CUDA: two codes a byte here, packed whole below.
        packed.append(torch._convert_weight_to_int4pack_for_cpu(codes, 2) if on_cpu else _int4_pairs(codes))
        scales.append(scale.to(dtype))
        zeros.append(zero.to(dtype))
        del codes
    scales_and_zeros = torch.stack([torch.cat(scales), torch.cat(zeros)], dim=-1).transpose(0, 1).contiguous()
    whole = packed[0] if len(packed) == 1 else torch.cat(packed)
    if not on_cpu:
        whole = torch._convert_weight_to_int4pack(whole, 8)
    return whole, scales_and_zeros, out_features


def _int4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (out, in) as bytes of two, high nibble first: what CUDA's int4 packing reads."""
    return (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)


def _int4_layer(layer: ParallelLinear, group_size: int) -> ParallelLinear:
    packed, scales_and_zeros, out_features = int4_matrix(layer.weight, group_size)
    cls: type[Int4ColumnParallelLinear | Int4RowParallelLinear] = (
        Int4ColumnParallelLinear if isinstance(layer, ColumnParallel) else Int4RowParallelLinear)
    new = layer.swapped_to(cls)
    new.register_buffer("weight_int4", packed)
    new.register_buffer("weight_scales_and_zeros", scales_and_zeros)  # (in / group, out, 2)
    new.int4_group_size = group_size
    new.int4_out_features = out_features
    return new


def _int4_experts(experts: Experts, group_size: int) -> Experts:
    new = experts.swapped_to(Int4Experts)
    new.int4_out_features = {}
    for matrix in Experts.matrices:
        stacked = getattr(experts, matrix)  # (E, in, out)
        parts = [int4_matrix(stacked[e].t(), group_size) for e in range(experts.num_experts)]
        new.register_buffer(matrix + "_int4", torch.stack([p for p, _, _ in parts]))
        new.register_buffer(matrix + "_scales_and_zeros", torch.stack([sz for _, sz, _ in parts]))
        new.int4_out_features[matrix] = parts[0][2]
        del parts, stacked
    new.int4_group_size = group_size
    return new


@torch.no_grad()
def quantize_int4_(model: nn.Module, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> int:
    """Swap every dense parallel linear layer of ``model`` for an int4 one, in groups of
    ``group_size`` input columns (one of :data:`INT4_GROUP_SIZES`), and every Llama 4 expert
    stack for int4 experts.  Activations meet the weights in bfloat16 (the products are
    rounded back to the model's dtype; see :func:`int4_matrix`).  Returns the number of linear
    layers and expert stacks converted."""
    check_int4_group_size(model, group_size)
    count = _quantize_units_(model, "int4", group_size)
    logger.info("quantised %d linear layers / expert stacks to int4 (weight-only, groups of %d columns)",
                count, group_size)
    return count


# fbgemm keeps, besides a packed matrix's int8 codes, three 4-byte values per output row
# (column offset, scale, zero point).
_FBGEMM_BYTES_PER_ROW = 12


def quantized_weight_bytes(model: nn.Module, mode: Optional[str], group_size: Optional[int],
                           device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of ``model``'s weights once loaded with ``quantize=mode``, bytes held besides
    them while one module is quantised during loading), from shapes only (``model`` may be
    on the meta device).  Linear layers and expert stacks are counted as this module stores
    them: int8 one byte a value plus a scale per row; int4 half a byte a value plus a bfloat16
    scale and offset per group, rows padded to 16, or on a CPU where our int4 kernel runs
    (:func:`llama.layers.cpu_kernels.int4_kernel_layout_expected`) in its layout instead (the
    same codes, scales and offsets, widths padded to 256: never less than torch's packing,
    which the model holds until it is prepared); w8a8 int8's tensors plus fbgemm's packed
    copy of every linear layer, and one more of each fused group (wq/wk/wv, w1/w3:
    :func:`use_int8_activations_` packs those both as one matrix and layer by layer).
    Embeddings, norms and the router stay in ``dtype``.  While loading, the module being
    quantised is held in ``dtype`` beside its quantisation's float32 temporaries."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if mode is None:
        return sum(p.numel() for p in model.parameters()) * itemsize, 0
    if mode == "int4" and group_size is None:
        raise ValueError("int4 quantisation needs a group size")
    kernel_layout = mode == "int4" and device.type == "cpu" and cpu_kernels.int4_kernel_layout_expected()
    spacing = cpu_kernels.expected_scale_spacing(cast(int, group_size)) if kernel_layout else 0
    int8_mode = "int8" if mode == "w8a8" else mode
    scale_size = torch.empty(0, dtype=_int8_scale_dtype(device, dtype)).element_size()
    quantised: set[int] = set()
    total = loading = 0
    for module in model.modules():
        if not quantizable(module):
            continue
        if type(module) is Experts:  # (out, in, how many)
            matrices = [(getattr(module, m).shape[2], getattr(module, m).shape[1], module.num_experts)
                        for m in Experts.matrices]
        else:
            weight = cast(ParallelLinear, module).weight  # quantizable: a dense layer
            matrices = [(weight.shape[0], weight.shape[1], 1)]
        held = 0
        for out_f, in_f, count in matrices:
            if kernel_layout:  # our CPU kernel's layout (rows padded to 16) in place of torch's packing
                held += count * (out_f + (-out_f % 16)) * cpu_kernels.int4_row_bytes(in_f, spacing)
            else:
                held += count * _matrix_bytes(int8_mode, out_f, in_f, group_size, scale_size)
            if mode == "w8a8" and type(module) is not Experts:
                held += out_f * in_f + out_f * _FBGEMM_BYTES_PER_ROW
        numel = sum(p.numel() for p in module.parameters())
        largest = max(out_f * in_f for out_f, in_f, _ in matrices)
        # one float32 block (int4: its temporaries, about five) and the quantised copy being put together
        temporaries = (5 if mode == "int4" else 1) * min(4 * largest, QUANTIZE_BLOCK_BYTES) + held
        loading = max(loading, numel * itemsize + temporaries)
        total += held
        quantised.update(id(p) for p in module.parameters())
    if mode == "w8a8":  # the fused groups' packed matrices
        for module in model.modules():
            siblings = [getattr(module, n) for n in getattr(module, "packable_input_projections", ())]
            if len(siblings) > 1 and all(isinstance(s, DenseWeight) for s in siblings):
                total += sum(s.weight.numel() + s.weight.shape[0] * _FBGEMM_BYTES_PER_ROW for s in siblings)
    total += sum(p.numel() for p in model.parameters() if id(p) not in quantised) * itemsize
    return total, loading


def _matrix_bytes(mode: str, out_f: int, in_f: int, group_size: Optional[int], scale_size: int) -> int:
    """Bytes of one (out, in) matrix stored as ``mode`` ("int8" or "int4")."""
    if mode == "int8":
        return out_f * in_f + out_f * scale_size
    if mode == "int4":
        if group_size is None:
            raise ValueError("int4 quantisation needs a group size")
        rows = out_f + (-out_f % 16)
        return rows * in_f // 2 + (in_f // group_size) * rows * 2 * 2  # codes; bfloat16 scales and offsets
    raise ValueError(f"quantize mode must be None, 'int8', 'int4' or 'w8a8', got {mode!r}")
