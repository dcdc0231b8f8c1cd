"""Process and device setup: the only module that talks to ``torch.distributed``.

One rule decides device and backend: CUDA with NCCL when a GPU is used, CPU with
gloo otherwise.  Under ``torchrun`` the rank and world size come from its
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` ...), which is
also how multi-node runs work; in a plain ``python`` process a one-process group is
made in memory.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import logging
import os
from typing import Optional, Union

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fs_init

logger = logging.getLogger(__name__)

# Every collective gives up after this long instead of waiting forever on a rank
# that died.  Generous enough for loading a large checkpoint from slow disks;
# override with LLAMA_COLLECTIVE_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 600.0

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: Union[str, torch.device, None] = None) -> torch.device:
    """The device this process computes on.

    ``None`` picks CUDA when available, else CPU.  Under torchrun each process takes
    the GPU of its ``LOCAL_RANK``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r} ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for but CUDA is not available here; use device='cpu'")
        if device.index is None:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if local_rank >= torch.cuda.device_count():
                raise RuntimeError(
                    f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} GPU(s): "
                    "start at most one process per GPU (torchrun --nproc_per_node)"
                )
            device = torch.device("cuda", local_rank)
    elif device.type != "cpu":
        raise ValueError(f"unsupported device {device}: this library runs on 'cuda' or 'cpu'")
    return device


def resolve_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """The dtype weights and activations use.

    ``None``: bfloat16 on CUDA where supported, else float16; float32 on CPU (exact
    and, with MKL, the fastest for small batches there).  Names such as
    ``"bfloat16"``/``"bf16"`` are accepted.
    """
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
        return _DTYPE_NAMES[name]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def collective_timeout() -> datetime.timedelta:
    seconds = float(os.environ.get("LLAMA_COLLECTIVE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    return datetime.timedelta(seconds=seconds)


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_model_parallel(device: torch.device, model_parallel_size: Optional[int] = None) -> tuple[int, int]:
    """Join (or create) the process group and fairscale's model-parallel group.

    Returns (rank, world_size).  Every process of the job is one model-parallel
    rank; ``model_parallel_size``, when given, must equal the number of processes.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = collective_timeout()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if _launched_by_torchrun():
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        # We made the group, so we take it down at exit (torch warns otherwise, and
        # backends can abort in their destructors).
        atexit.register(_destroy_process_group)
    elif dist.get_backend() != backend:
        raise RuntimeError(
            f"torch.distributed is already initialised with {dist.get_backend()}, but device {device} needs {backend}"
        )
    world_size = dist.get_world_size()
    if model_parallel_size is not None and model_parallel_size != world_size:
        raise ValueError(
            f"model_parallel_size={model_parallel_size} but {world_size} process(es) were started; "
            f"start {model_parallel_size} with torchrun --nproc_per_node {model_parallel_size}, "
            "or leave model_parallel_size unset"
        )
    if fs_init.model_parallel_is_initialized():
        if fs_init.get_model_parallel_world_size() != world_size:
            raise RuntimeError("fairscale's model-parallel group is already set up with a different size")
    else:
        _init_fairscale(world_size, timeout)
    return dist.get_rank(), world_size


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _init_fairscale(world_size: int, timeout: datetime.timedelta) -> None:
    # fairscale makes its groups with ``new_group`` and no timeout, which would give
    # them torch's 30-minute default instead of ours; and it prints.  Pass the
    # timeout through and send its prints to the log.
    new_group = dist.new_group

    def new_group_with_timeout(*args, **kwargs):
        kwargs.setdefault("timeout", timeout)
        return new_group(*args, **kwargs)

    out = io.StringIO()
    dist.new_group = new_group_with_timeout
    try:
        with contextlib.redirect_stdout(out):
            fs_init.initialize_model_parallel(world_size)
    finally:
        dist.new_group = new_group
    for line in out.getvalue().splitlines():
        logger.debug("fairscale: %s", line.lstrip("> "))


def model_parallel_rank() -> int:
    return fs_init.get_model_parallel_rank()


def model_parallel_world_size() -> int:
    return fs_init.get_model_parallel_world_size()


def broadcast_from_first_rank(tensor: torch.Tensor) -> torch.Tensor:
    """Give every model-parallel rank the first rank's ``tensor`` (in place; returned).

    Used so that one rank decides each sampled token and all ranks continue with it,
    instead of trusting identical random streams everywhere.
    """
    if fs_init.get_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=fs_init.get_model_parallel_src_rank(), group=fs_init.get_model_parallel_group())
    return tensor


def broadcast_object(obj: object) -> object:
    """Give every model-parallel rank the first rank's picklable ``obj``."""
    if fs_init.get_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=fs_init.get_model_parallel_src_rank(), group=fs_init.get_model_parallel_group())
    return box[0]
