"""Getting a loaded model ready to run under its kernel policy."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from llama.layers import cpu_kernels
from llama.layers.moe import Experts, Int4Experts, Int8Experts
from llama.layers.packed import use_packed_weights_
from llama.layers.packing import return_freed_memory
from llama.layers.parallel import DenseWeight, ParallelLinear
from llama.layers.policy import KernelPolicy
from llama.layers.quantized import Int4FusedProjections, Int4Weight, Int8FusedProjections, Int8Weight

logger = logging.getLogger(__name__)


def prepare_model_(model: nn.Module, policy: KernelPolicy) -> int:
    """Give every layer that multiplies ``policy`` (and the attention layers, whose kernel it
    chooses too), and lay the weights out as it says:
    float32 weights column-major, bfloat16/float16 ones packed for its CPU kernel, int4 ones
    in our CPU kernel's layout instead of torch's where the policy uses it (``cpu_qkernel``; the kernels are
    built here, and where they cannot be, the model keeps torch's kernels).  Returns the
    number of weights packed."""
    if policy.cpu_qkernel is not None and _quantized_on_cpu(model) and not cpu_kernels.load():
        policy = dataclasses.replace(policy, cpu_qkernel=None)
    for module in model.modules():
        # the layers that multiply, and any other that declares a policy (the model's attention)
        if isinstance(module, (ParallelLinear, Int8FusedProjections, Int4FusedProjections, Experts)) \
                or isinstance(getattr(module, "policy", None), KernelPolicy):
            setattr(module, "policy", policy)  # a plain attribute, not a submodule
    if policy.column_major:
        use_column_major_weights_(model)
    if policy.cpu_qkernel is not None:
        use_cpu_int4_layout_(model, per_group=cpu_kernels.scale_per_group(policy.cpu_qkernel))
    return use_packed_weights_(model, policy)


def _quantized_on_cpu(model: nn.Module) -> bool:
    """Whether ``model`` has int8 or int4 layers or experts on the CPU."""
    for module in model.modules():
        if isinstance(module, (Int8Weight, Int4Weight, Int8Experts, Int4Experts)):
            if getattr(module, "int4_kernel_rows", None) is not None:  # laid out for our kernel: on the CPU
                return True
            return next(iter(module.buffers())).device.type == "cpu"
    return False


@torch.no_grad()
def use_cpu_int4_layout_(model: nn.Module, per_group: bool = True) -> int:
    """Lay every int4 layer and int4 expert stack on the CPU out in our CPU kernel's layout
    (:func:`llama.layers.cpu_kernels.pack_int4_from_torch`: the same codes, scales and offsets,
    with ``per_group`` a scale per group -- 4.25 bits a weight in groups of 128 -- else per block
    of 32: :func:`llama.layers.cpu_kernels.scale_per_group`), which decoding and prompts read,
    and drop torch's packing: one copy of the weights (``state_dict()`` makes torch's again on
    demand).  Layer by layer, so that only one layer is held twice at a time; then the layers
    that read the same input are fused (:func:`int4_siblings_as_one_`).  Returns the number of
    layers and stacks laid out."""
    count = 0
    for module in model.modules():
        packed, sz = getattr(module, "weight_int4", None), getattr(module, "weight_scales_and_zeros", None)
        if isinstance(module, Int4Weight) and module.int4_kernel_rows is None \
                and packed is not None and sz is not None and packed.device.type == "cpu":
            width = packed.shape[1] * 2
            module.int4_kernel_rows = cpu_kernels.pack_int4_from_torch(packed, sz, width, per_group=per_group)
            module.int4_in_features = width
            module.weight_int4 = None  # registered buffers: None leaves them out of state_dict's own walk
            module.weight_scales_and_zeros = None
            count += 1
        elif isinstance(module, Int4Experts) and module.int4_kernel_rows is None \
                and module.w1_int4.device.type == "cpu":
            stacks, widths = {}, {}
            for name in Experts.matrices:
                packed, sz = getattr(module, name + "_int4"), getattr(module, name + "_scales_and_zeros")
                widths[name] = packed.shape[2] * 2
                stacks[name] = torch.stack([cpu_kernels.pack_int4_from_torch(packed[e], sz[e], widths[name],
                                                                             per_group=per_group)
                                            for e in range(packed.shape[0])])
                setattr(module, name + "_int4", None)
                setattr(module, name + "_scales_and_zeros", None)
            module.int4_kernel_rows = stacks
            module.int4_in_features = widths
            count += 1
    fused = int4_siblings_as_one_(model)
    if count:
        return_freed_memory()  # torch's packing and the layout's temporaries, freed layer by layer
        logger.info("laid out %d int4 layers / expert stacks for the CPU kernel (torch's packing dropped); "
                    "%d groups of layers that read the same input multiply as one", count, fused)
    return count


def int4_siblings_as_one_(model: nn.Module) -> int:
    """int4 layers laid out for our CPU kernel that read the same input (a module's
    ``packable_input_projections``: wq, wk, wv; w1, w3) get one matrix in the kernel's layout,
    each layer's ``int4_kernel_rows`` becoming a view of its rows (no second copy), and the
    module one product for all of them, its ``fused`` (:class:`Int4FusedProjections`).  Layers
    whose stored rows are padded (outputs not a multiple of 16) are left as they are.  Returns
    the number of groups."""
    groups = 0
    for module in model.modules():
        siblings = [getattr(module, name) for name in getattr(module, "packable_input_projections", ())]
        if len(siblings) < 2 or getattr(module, "fused", None) is not None \
                or not all(isinstance(layer, Int4Weight) and layer.int4_kernel_rows is not None
                           and layer.int4_kernel_rows.shape[0] == layer.int4_out_features for layer in siblings):
            continue
        rows = torch.cat([layer.int4_kernel_rows for layer in siblings])
        start = 0
        for layer in siblings:
            count = layer.int4_kernel_rows.shape[0]
            layer.int4_kernel_rows = rows[start : start + count]
            start += count
        module.fused = Int4FusedProjections(rows, [layer.int4_out_features for layer in siblings],
                                            siblings[0].int4_group_size, siblings[0].policy)
        groups += 1
    return groups


def use_column_major_weights_(model: nn.Module) -> int:
    """Store every dense float32 parallel linear weight on the CPU column-major (the same
    (out, in) tensor, laid out as its transpose).  For one-token decoding in float32, MKL's
    matrix-vector product streams a column-major weight faster (most for tall matrices such
    as the vocabulary projection); prefill matrix products are about as fast either way.
    Returns the number of weights re-laid."""
    count = 0
    for module in model.modules():
        if not isinstance(module, DenseWeight):
            continue
        weight = module.weight
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous():
            module.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
            count += 1
    return count
