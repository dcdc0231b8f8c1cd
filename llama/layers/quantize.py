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
happens per rank, after loading that rank's slice, so any number of processes works
(a rank briefly holds its slice in float first).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from llama.layers.parallel import ColumnParallelLinear, Int8Projections, RowParallelLinear
from llama.layers.moe import Experts
from llama.layers.packing import Int8ActivationProjections, int8_activation_kernel, pack_weight_int8, register_for_compile

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept
DEFAULT_INT4_GROUP_SIZE = 128


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


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per row) with symmetric per-output-channel scaling."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale


@torch.no_grad()
def quantize_int8_(model: nn.Module) -> int:
    """Quantise every model-parallel linear layer of ``model`` in place, and every
    Llama 4 expert matrix (the embedding table stays in float: a step reads one row of
    it).  Returns the number of linear layers and expert stacks converted."""
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None:
            q, scale = quantize_rows_int8(module.weight)
            scale_dtype = _int8_scale_dtype(module.weight.device, module.weight.dtype)
            del module.weight
            module.weight = None
            module.register_buffer("weight_int8", q.contiguous())
            module.register_buffer("weight_scale", scale.to(scale_dtype))
            count += 1
        elif isinstance(module, Experts) and module.quantized is None:
            for name in Experts.matrices:
                stacked = getattr(module, name)  # (E, in, out)
                dtype = _int8_scale_dtype(stacked.device, stacked.dtype)
                rows = [quantize_rows_int8(stacked[e].t()) for e in range(module.num_experts)]  # (out, in) each
                delattr(module, name)
                module.register_buffer(name + "_int8", torch.stack([q for q, _ in rows]))
                module.register_buffer(name + "_scale", torch.stack([scale for _, scale in rows]).to(dtype))
                del rows, stacked
            module.quantized = "int8"
            count += 1
    fused = _int8_siblings_as_one_(model)
    logger.info("quantised %d linear layers / expert stacks to int8 (weight-only, per output channel); "
                "%d groups of layers that read the same input multiply as one", count, fused)
    return count


def _int8_siblings_as_one_(model: nn.Module) -> int:
    """Layers that read the same input (a module's ``packable_input_projections``: wq, wk,
    wv; w1, w3) get one int8 weight and one scale vector, each layer's ``weight_int8`` and
    ``weight_scale`` becoming views of its rows (no second copy), and the module one
    product for all of them (:class:`Int8Projections`).  Returns the number of groups."""
    groups = 0
    for module in model.modules():
        siblings = [getattr(module, name) for name in getattr(module, "packable_input_projections", ())]
        if len(siblings) < 2 or any(getattr(layer, "weight_int8", None) is None for layer in siblings):
            continue
        weight = torch.cat([layer.weight_int8 for layer in siblings])
        scale = torch.cat([layer.weight_scale for layer in siblings])
        start = 0
        for layer in siblings:
            rows = layer.weight_int8.shape[0]
            layer.weight_int8, layer.weight_scale = weight[start : start + rows], scale[start : start + rows]
            start += rows
        sizes = [layer.weight_int8.shape[0] for layer in siblings]
        module.packed_input_projections = Int8Projections(weight, scale, sizes)
        groups += 1
    return groups


def require_w8a8_device(device: torch.device) -> None:
    """Raise where ``quantize="w8a8"`` cannot run: anywhere but the CPU."""
    if device.type != "cpu":
        raise ValueError(f'quantize="w8a8" runs on the CPU only (fbgemm\'s int8 products); on {device} use "int8"')


def require_int8_activation_kernel() -> None:
    """Raise where ``quantize="w8a8"`` cannot run: no fbgemm int8 product in this torch build."""
    if int8_activation_kernel() is None:
        raise RuntimeError('quantize="w8a8" needs fbgemm\'s int8 product, which this torch build lacks '
                           '(x86 builds of torch have it); use quantize="int8"')


@torch.no_grad()
def use_int8_activations_(model: nn.Module) -> int:
    """``quantize="w8a8"``, after :func:`quantize_int8_`: every int8 linear layer on the
    CPU also gets its weight packed for fbgemm's int8 x int8 product, which one-row
    products (decoding steps at batch 1) then take: the row is quantised to 8-bit codes
    with one scale and offset (its own range, zero included), multiplied in integers and
    scaled back, as llama.cpp's Q8_0 quantises activations (in blocks of 32 there).
    Products of more rows (prompts, batched steps) keep bfloat16 activations, and
    Llama 4's experts stay weight-only.  Layers that read the same input (wq, wk, wv;
    w1, w3) are packed as one matrix, their owner's ``packed_input_projections`` (see
    :class:`llama.layers.packing.Int8ActivationProjections`); the others each hold their own
    (``weight_int8_packed``).  The packed copy is a second copy of the int8 weights
    (prompts read the first).  Returns the number of layers packed."""
    require_int8_activation_kernel()
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
              and getattr(m, "weight_int8", None) is not None]
    for module in layers:
        require_w8a8_device(module.weight_int8.device)
    # int8's groups of layers that read the same input (Int8Projections, made by
    # quantize_int8_) are packed as one matrix: one call, one quantisation of the row.
    as_one: set[nn.Module] = set()
    for module in model.modules():
        group = getattr(module, "packed_input_projections", None)
        if isinstance(group, Int8Projections):
            siblings = [getattr(module, name) for name in module.packable_input_projections]
            packed = pack_weight_int8(group.weight_int8, group.weight_scale.float())
            key = register_for_compile(siblings[0], packed, group.weight_int8.shape[0])
            module.packed_input_projections = Int8ActivationProjections(packed, siblings, key, group)
            as_one.update(siblings)
    for module in layers:
        if module in as_one:
            continue
        weight = module.weight_int8
        module.weight_int8_packed = pack_weight_int8(weight, module.weight_scale.float())
        module.weight_int8_packed_key = register_for_compile(module, module.weight_int8_packed, weight.shape[0])
    logger.info("packed %d int8 layers for int8 activations (one-row products), %d of them with their siblings%s",
                len(layers), len(as_one), ", 7-bit input codes on this CPU" if int8_activation_kernel() else "")
    return len(layers)


def _int8_scale_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    # The CPU kernel takes bfloat16 scales; elsewhere they meet the activations' dtype.
    return torch.bfloat16 if device.type == "cpu" else weight_dtype


def quantize_groups_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int32 (out, in) in 0..15, scale (out, in/group), zero (out, in/group)) with
    ``weight ~= (codes - 8) * scale + zero`` group by group."""
    out_f, in_f = weight.shape
    groups = weight.float().reshape(out_f, in_f // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low).clamp(min=1e-6) / 15
    zero = low + 8 * scale
    codes = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.int32)
    return codes.reshape(out_f, in_f), scale, zero


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """The codes in the layout torch's int4 matmul kernel for their device reads."""
    if codes.device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # two codes a byte, high nibble first
    return torch._convert_weight_to_int4pack(pairs, 8)


def check_int4_group_size(model: nn.Module, group_size: object) -> None:
    """Refuse (ValueError) a group size torch's int4 kernels do not take, or one that does not
    divide every quantised layer's width on this rank.  Reads shapes only, so ``model`` may be
    on the meta device (``load_model`` checks before reading the checkpoint)."""
    int4_group_size("int4", group_size)
    widths = set()
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None:
            widths.add(m.weight.shape[1])
        elif isinstance(m, Experts) and m.quantized is None:
            widths.update(getattr(m, name).shape[1] for name in Experts.matrices)  # (E, in, out)
    bad = sorted(w for w in widths if w % group_size)
    if bad:
        fits = [g for g in INT4_GROUP_SIZES if all(w % g == 0 for w in widths)]
        raise ValueError(
            f"int4 groups of {group_size} columns do not divide this rank's layer widths {bad}; "
            + (f"group sizes that work here: {fits}" if fits else "no int4 group size fits this model: use int8")
        )


def _int4_matrix(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(packed codes, scales and zeros (in / group, out padded, 2), out features) of one
    (out, in) weight, in the layout torch's int4 kernel for its device reads.  Scales,
    zeros and activations are bfloat16 whatever the model's dtype: CUDA's kernel takes
    nothing else, and torch's CPU kernel is vectorised for bfloat16 only (float32
    activations made a 150m decoding step 20x slower on the AVX-512 benchmark machine:
    137 against 7 ms)."""
    dtype = torch.bfloat16
    codes, scale, zero = quantize_groups_int4(weight, group_size)
    # The kernels want a multiple of 16 output rows: pad with rows that are zero
    # (code 8, offset 0); the callers drop their outputs.
    pad = -codes.shape[0] % 16
    if pad:
        codes = torch.cat([codes, codes.new_full((pad, codes.shape[1]), 8)])
        scale = torch.cat([scale, scale.new_ones(pad, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return _pack_int4(codes), scales_and_zeros, codes.shape[0] - pad


@torch.no_grad()
def quantize_int4_(model: nn.Module, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> int:
    """Quantise every model-parallel linear layer of ``model`` in place to 4-bit groups
    of ``group_size`` input columns (one of :data:`INT4_GROUP_SIZES`), and every Llama 4
    expert matrix.  Activations meet the weights in bfloat16 (the products are rounded back
    to the model's dtype; see :func:`_int4_matrix`).  Returns the number of linear layers
    and expert stacks converted."""
    check_int4_group_size(model, group_size)
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None:
            packed, scales_and_zeros, out_features = _int4_matrix(module.weight, group_size)
            del module.weight
            module.weight = None
            module.register_buffer("weight_int4", packed)
            module.register_buffer("weight_scales_and_zeros", scales_and_zeros)  # (in / group, out, 2)
            module.int4_group_size = group_size
            module.int4_out_features = out_features
            count += 1
        elif isinstance(module, Experts) and module.quantized is None:
            for name in Experts.matrices:
                stacked = getattr(module, name)  # (E, in, out)
                parts = [_int4_matrix(stacked[e].t(), group_size) for e in range(module.num_experts)]
                delattr(module, name)
                module.register_buffer(name + "_int4", torch.stack([packed for packed, _, _ in parts]))
                module.register_buffer(name + "_scales_and_zeros", torch.stack([sz for _, sz, _ in parts]))
                module.int4_out_features[name] = parts[0][2]
                del parts, stacked
            module.int4_group_size = group_size
            module.quantized = "int4"
            count += 1
    logger.info("quantised %d linear layers / expert stacks to int4 (weight-only, groups of %d columns)",
                count, group_size)
    return count
