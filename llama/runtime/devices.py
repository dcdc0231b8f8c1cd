"""The device and dtype a process computes with, chosen in one place: CUDA (the GPU of
the process's LOCAL_RANK) when there is one, else the CPU; bfloat16 on CUDA where
supported, float32 on the CPU, unless asked otherwise.
"""

from __future__ import annotations

import os
from typing import Union

import torch

from llama.runtime.options import DTYPE_NAMES


def resolve_device(device: Union[str, torch.device, None] = None) -> torch.device:
    """The device this process computes on.

    ``None`` picks CUDA when available, else CPU.  Under torchrun each process takes
    the GPU of its ``LOCAL_RANK``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
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
        if name not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
        return getattr(torch, DTYPE_NAMES[name])
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return dtype
