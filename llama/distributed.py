"""Process and device setup: the only module that talks to ``torch.distributed``.

One rule decides device and backend: CUDA with NCCL when a GPU is used, CPU with
gloo otherwise.  Under ``torchrun`` the rank and world size come from its
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` ...), which is
also how multi-node runs work; in a plain ``python`` process a one-process group is
made in memory.

Timeouts.  The collectives of a forward pass and of token sharing come one after
another within milliseconds, so they run on fairscale's model-parallel group with a
short timeout (:data:`STEP_TIMEOUT_S`): if a rank dies or hangs, the others fail
within that bound instead of waiting forever.  Waits that may legitimately be long
(ranks finishing checkpoint loading at different times, rank 0 waiting for a user
to type) use a separate gloo "control" group with a long timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import logging
import os
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fs_init

logger = logging.getLogger(__name__)

# Bound on any one collective of generation; override with LLAMA_COLLECTIVE_TIMEOUT_S.
STEP_TIMEOUT_S = 60.0
# Bound on waits between ranks outside the forward pass (loading, user input);
# override with LLAMA_CONTROL_TIMEOUT_S.
CONTROL_TIMEOUT_S = 24 * 3600.0

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

_control_group: Optional[dist.ProcessGroup] = None


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
        if name not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
        return _DTYPE_NAMES[name]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def _timeout(env: str, default: float) -> datetime.timedelta:
    value = os.environ.get(env)
    try:
        seconds = float(value) if value else default
    except ValueError:
        raise ValueError(f"{env}={value!r} must be a number of seconds") from None
    return datetime.timedelta(seconds=seconds)


def step_timeout() -> datetime.timedelta:
    return _timeout("LLAMA_COLLECTIVE_TIMEOUT_S", STEP_TIMEOUT_S)


def control_timeout() -> datetime.timedelta:
    return _timeout("LLAMA_CONTROL_TIMEOUT_S", CONTROL_TIMEOUT_S)


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def planned_world_size() -> int:
    """How many processes this job has, known before any process group exists."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if _launched_by_torchrun() else 1


def init_model_parallel(device: torch.device, model_parallel_size: Optional[int] = None) -> tuple[int, int]:
    """Join (or create) the process group and fairscale's model-parallel group.

    Returns (rank, world_size).  Every process of the job is one model-parallel
    rank; ``model_parallel_size``, when given, must equal the number of processes.
    """
    world_size = planned_world_size()
    if model_parallel_size is not None and model_parallel_size != world_size:
        raise ValueError(
            f"model_parallel_size={model_parallel_size} but {world_size} process(es) were started; "
            f"start {model_parallel_size} with torchrun --nproc_per_node {model_parallel_size}, "
            "or leave model_parallel_size unset"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if _launched_by_torchrun():
            dist.init_process_group(backend, timeout=control_timeout())
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=control_timeout())
        # We made the group, so we take it down at exit (torch warns otherwise, and
        # backends can abort in their destructors).
        atexit.register(_destroy_process_group)
    elif dist.get_backend() != backend:
        raise RuntimeError(
            f"torch.distributed is already initialised with {dist.get_backend()}, but device {device} needs {backend}"
        )
    if fs_init.model_parallel_is_initialized():
        if fs_init.get_model_parallel_world_size() != world_size:
            raise RuntimeError("fairscale's model-parallel group is already set up with a different size")
    else:
        _init_fairscale(world_size, step_timeout())
        global _control_group
        _control_group = dist.new_group(backend="gloo", timeout=control_timeout()) if world_size > 1 else None
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


def broadcast_from_first_rank(tensor: torch.Tensor) -> torch.Tensor:
    """Give every model-parallel rank the first rank's ``tensor`` (in place; returned).

    Used so that one rank decides each sampled token and all ranks continue with it,
    instead of trusting identical random streams everywhere.
    """
    if fs_init.get_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=fs_init.get_model_parallel_src_rank(), group=fs_init.get_model_parallel_group())
    return tensor


def model_parallel_world_size() -> int:
    return fs_init.get_model_parallel_world_size()


def broadcast_object_from_first_rank(obj: Any) -> Any:
    """Give every model-parallel rank the first rank's picklable ``obj`` (or None) over
    the model-parallel group (short timeout: for data that follows within a step).
    None costs one one-element broadcast; anything else travels pickled after it."""
    if fs_init.get_model_parallel_world_size() == 1:
        return obj
    group, src = fs_init.get_model_parallel_group(), fs_init.get_model_parallel_src_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    present = torch.tensor([obj is not None], dtype=torch.int32, device=device)
    dist.broadcast(present, src=src, group=group)
    if not present.item():
        return None
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


def share_from_first_rank(obj: Any) -> Any:
    """Give every rank the first rank's picklable ``obj`` over the control group,
    which may wait long (e.g. for a user's next line)."""
    if _control_group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_control_group)
    return box[0]


def wait_for_all_ranks() -> None:
    """Barrier on the control group (e.g. after loading, which takes each rank its own time)."""
    if _control_group is not None:
        dist.barrier(group=_control_group)


@contextlib.contextmanager
def explain_peer_failures() -> Iterator[None]:
    """Re-raise a failed collective as an error that says what probably happened."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if (
            dist.is_initialized()
            and dist.get_world_size() > 1
            and (isinstance(e, dist.DistError) or any(s in text for s in _COMM_FAILURE_MARKS))
        ):
            raise RuntimeError(
                f"a collective with the other model-parallel ranks failed (timeout "
                f"{step_timeout().total_seconds():g} s, LLAMA_COLLECTIVE_TIMEOUT_S): another rank probably died "
                f"or stopped responding; see its log. ({text.splitlines()[0][:300]})"
            ) from e
        raise


_COMM_FAILURE_MARKS = ("gloo", "NCCL", "Timed out", "Connection closed", "Connection reset", "Broken pipe")


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes this process can still allocate on ``device``, or None where unknown.

    CUDA: the device's free memory.  CPU: the machine's available RAM divided among
    the processes of this job on this machine (they share it).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None  # not Linux: no cheap, dependency-free way to ask
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return available // max(local_procs, 1)
