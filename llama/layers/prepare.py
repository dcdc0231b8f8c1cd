"""Getting a loaded model ready to run under its kernel policy."""

from __future__ import annotations

import torch
from torch import nn

from llama.layers.moe import Experts
from llama.layers.packed import use_packed_weights_
from llama.layers.parallel import DenseWeight, ParallelLinear
from llama.layers.policy import KernelPolicy
from llama.layers.quantized import Int8FusedProjections


def prepare_model_(model: nn.Module, policy: KernelPolicy) -> int:
    """Give every layer that multiplies ``policy``, and lay the weights out as it says:
    float32 weights column-major, bfloat16/float16 ones packed for its CPU kernel.  Returns
    the number of weights packed."""
    for module in model.modules():
        if isinstance(module, (ParallelLinear, Int8FusedProjections, Experts)):
            module.policy = policy
    if policy.column_major:
        use_column_major_weights_(model)
    return use_packed_weights_(model, policy)


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
