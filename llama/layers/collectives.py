"""The model-parallel collectives of a forward pass, traceable by ``torch.compile``.

fairscale's region functions (``reduce_from_model_parallel_region`` ...) are autograd
Functions that call ``ctx.mark_dirty``, which Dynamo does not trace: a compiled step
breaks at every all-reduce, and under CUDA graphs becomes one replay per layer plus
eager collectives.  Here, in a graph that ``torch.compile`` traces (inference), the same
sums and gathers go through torch's functional collectives
(``torch.distributed._functional_collectives``), which Dynamo records into the graph.
Elsewhere fairscale's functions run: where a gradient flows (training through
:meth:`llama.model.Transformer.forward_uncached`) for their backward passes, and in eager
steps because torch's functional collectives import ``torch._dynamo`` at their first call
(3-7 s in every rank of a job that never compiles).  With one model-parallel rank every
function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel.mappings import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
)


def _world() -> int:
    return fs_init.get_model_parallel_world_size()


def _fairscale(x: torch.Tensor) -> bool:
    """fairscale's region functions for ``x``: where a gradient flows, or outside a graph that
    ``torch.compile`` traces (they are what Dynamo cannot trace)."""
    return (torch.is_grad_enabled() and x.requires_grad) or not torch.compiler.is_compiling()


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the model-parallel ranks (all-reduce), on every rank."""
    if _world() == 1:
        return x
    if _fairscale(x):
        return reduce_from_model_parallel_region(x)  # in place: callers pass a tensor of their own
    return funcol.all_reduce(x, "sum", fs_init.get_model_parallel_group())


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` (..., n) concatenated in rank order along the last dimension
    (..., n * ranks), on every rank."""
    if _world() == 1:
        return x
    if _fairscale(x):
        return gather_from_model_parallel_region(x)
    # Gathered along dim 0 (the collective's own layout: rank after rank), then each rank's
    # block put beside the others.  Asked for the last dimension, funcol does the same through
    # torch._utils._maybe_view_chunk_cat, which the Dynamo of torch 2.11 refuses to trace (a
    # graph break at every gather); the reordering here is traced by every version.
    whole = gather_dim0(x.contiguous(), fs_init.get_model_parallel_group())  # (ranks * d0, ..., n)
    return torch.cat(whole.chunk(_world(), dim=0), dim=-1)


# ``all_gather_tensor`` is deprecated in favour of ``all_gather_single`` (same arguments, same
# result) and warns (FutureWarning) at every eager call; older torch builds have only the
# former.  Chosen once, here.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` (d0, ...) of ``group`` stacked in rank order along dim 0 (ranks * d0, ...)."""
    return _all_gather(x, 0, group)


def enter_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the input of a column-parallel product: the identity forward; in training,
    fairscale's function whose backward sums the gradient over ranks."""
    if _world() > 1 and torch.is_grad_enabled() and x.requires_grad:
        return copy_to_model_parallel_region(x)
    return x
