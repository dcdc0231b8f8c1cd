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
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

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
    if not value:
        return datetime.timedelta(seconds=default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    # timedelta refuses inf/nan with a message that names nothing, and 0 or a negative
    # bound would fail every collective at once.
    if not (math.isfinite(seconds) and 0 < seconds <= _MAX_TIMEOUT_S):
        raise ValueError(
            f"{env}={value!r} must be a positive, finite number of seconds (at most {_MAX_TIMEOUT_S:g}); "
            f"unset it for the default of {default:g} s"
        )
    return datetime.timedelta(seconds=seconds)


_MAX_TIMEOUT_S = 365 * 24 * 3600.0  # a year: beyond it "never" is what is meant, and timedelta may overflow


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
    else:
        configure_cpu_threads()
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
    try:
        dist.broadcast_object_list(box, src=0, group=_control_group)
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {dist.get_rank()} gave up waiting for rank 0 to share its next input (LLAMA_CONTROL_TIMEOUT_S="
            f"{control_timeout().total_seconds():g}): rank 0 probably died or hangs; see its log. "
            f"({str(e).splitlines()[0][:200]})"
        ) from e
    return box[0]


# How often a rank waiting on the others says who it waits for; LLAMA_WAIT_LOG_S overrides.
WAIT_LOG_EVERY_S = 60.0
_wait_count = 0


def wait_for_all_ranks(what: str = "finish loading the checkpoint") -> None:
    """Barrier on the control group (e.g. after loading, which takes each rank its own time).

    While it waits, every :data:`WAIT_LOG_EVERY_S` seconds it logs which ranks have not
    arrived yet (each rank marks its arrival in the job's key-value store); if the
    control timeout (LLAMA_CONTROL_TIMEOUT_S) runs out, the ``RuntimeError`` names them
    and ``what`` they were to do.
    """
    if _control_group is None:
        return
    global _wait_count
    _wait_count += 1
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = _store()
    key = f"llama/wait/{_wait_count}"
    if store is not None:
        store.set(f"{key}/{rank}", "1")

    def absent() -> str:
        try:
            missing = [r for r in range(world_size) if r != rank and not store.check([f"{key}/{r}"])]
        except (AttributeError, RuntimeError, dist.DistError):  # no store, or it is gone
            return "some rank(s)"
        return f"rank(s) {missing}" if missing else "the others"

    log_every = _timeout("LLAMA_WAIT_LOG_S", WAIT_LOG_EVERY_S).total_seconds()
    work = dist.barrier(group=_control_group, async_op=True)
    start = time.monotonic()
    next_log = start + log_every
    while not work.is_completed():
        time.sleep(0.05)
        if time.monotonic() >= next_log:
            logger.warning("rank %d has waited %.0f s for %s to %s", rank, time.monotonic() - start, absent(), what)
            next_log += log_every
    try:
        work.wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {rank} gave up after waiting {time.monotonic() - start:.0f} s (LLAMA_CONTROL_TIMEOUT_S="
            f"{control_timeout().total_seconds():g}) for {absent()} to {what}: they probably died or hang; "
            f"see their logs. ({str(e).splitlines()[0][:200]})"
        ) from e


def _store() -> Optional[dist.Store]:
    """The job's key-value store (torchrun's rendezvous store), or None if not reachable."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


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


def available_memory(
    device: torch.device,
    *,
    meminfo: Union[str, Path] = "/proc/meminfo",
    proc_cgroup: Union[str, Path] = "/proc/self/cgroup",
    cgroup_root: Union[str, Path] = "/sys/fs/cgroup",
) -> Optional[int]:
    """Bytes this process can still allocate on ``device``, or None where unknown.

    CUDA: the device's free memory.  CPU: the smaller of the machine's available RAM
    and what the container's memory limit leaves (cgroup v1 or v2, see
    :func:`cgroup_memory_available`), divided among the processes of this job on this
    machine (they share it).  The paths are parameters for tests.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f)
        available: Optional[int] = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = None  # not Linux: no cheap, dependency-free way to ask
    limited = cgroup_memory_available(proc_cgroup, cgroup_root)
    if limited is not None:
        available = limited if available is None else min(available, limited)
    if available is None:
        return None
    return max(available, 0) // local_world_size()


def local_world_size() -> int:
    """Processes of this job on this machine (torchrun's LOCAL_WORLD_SIZE; 1 otherwise)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def cgroup_memory_available(
    proc_cgroup: Union[str, Path] = "/proc/self/cgroup", cgroup_root: Union[str, Path] = "/sys/fs/cgroup"
) -> Optional[int]:
    """Bytes the memory cgroups this process is in still allow, or None without a limit.

    v2 (``0::/path`` in ``/proc/self/cgroup``): ``memory.max`` minus ``memory.current``;
    v1 (a ``memory`` controller line): ``memory.limit_in_bytes`` minus
    ``memory.usage_in_bytes``.  Usage counts the page cache; its inactive file pages
    (``memory.stat``), which the kernel drops before killing anything, are not counted.
    Limits apply at every level of the hierarchy, so the tightest level from this
    process's group up to the root wins.  Inside a container the group's own path is
    often not visible under the mount (it is the mount's root): then the root is read.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    best: Optional[int] = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        if controllers == "" and (root / "cgroup.controllers").exists():  # v2, unified hierarchy
            mount, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            mount, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for directory in _cgroup_levels(mount, group):
            left = _cgroup_level_available(directory, *files)
            if left is not None:
                best = left if best is None else min(best, left)
    return best


def _cgroup_levels(mount: Path, group: str) -> list[Path]:
    """The directories of ``group`` and its ancestors under ``mount`` that exist."""
    parts = [p for p in group.strip().split("/") if p and p != ".."]
    levels = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in levels if d.is_dir()]


def _cgroup_level_available(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> Optional[int]:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max":
            return None
        limit = int(limit_text)
        if limit >= _UNLIMITED:
            return None
        usage = int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for stat_line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = stat_line.partition(" ")
            if name == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return limit - max(usage - inactive, 0)


# -- CPU threads ---------------------------------------------------------------------------

_threads_configured = False


def cpu_count(
    proc_cgroup: Union[str, Path] = "/proc/self/cgroup", cgroup_root: Union[str, Path] = "/sys/fs/cgroup"
) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota
    (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``), rounded up."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return count
    root = Path(cgroup_root)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        if controllers == "" and (root / "cgroup.controllers").exists():
            mount = root
        elif "cpu" in controllers.split(","):
            mount = root / "cpu"
            if not mount.is_dir():
                mount = root / controllers
        else:
            continue
        for directory in _cgroup_levels(mount, group):
            quota = _cpu_quota(directory)
            if quota is not None:
                count = min(count, max(1, math.ceil(quota)))
    return count


def _cpu_quota(directory: Path) -> Optional[float]:
    try:
        if (directory / "cpu.max").exists():
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def omp_threads_set_by_torchrun(
    environ: Mapping[str, str] = os.environ, parent_environ: Union[str, Path, None] = None
) -> bool:
    """Whether OMP_NUM_THREADS=1 in this process is torchrun's default rather than the user's.

    torchrun sets OMP_NUM_THREADS=1 for its workers (printing a banner) when it starts
    more than one per machine and the variable is not already set.  Its own process,
    this worker's parent, keeps the environment it was started with in
    ``/proc/<pid>/environ``: if OMP_NUM_THREADS is absent there, torchrun set it.
    Where that file cannot be read (not Linux), a value of exactly 1 under torchrun
    with several local processes is taken as torchrun's.
    """
    if environ.get("OMP_NUM_THREADS") != "1" or "TORCHELASTIC_RUN_ID" not in environ:
        return False
    path = Path(parent_environ if parent_environ is not None else f"/proc/{os.getppid()}/environ")
    try:
        started_with = path.read_bytes().split(b"\0")
    except OSError:
        return int(environ.get("LOCAL_WORLD_SIZE", "1") or 1) > 1
    return not any(entry.startswith(b"OMP_NUM_THREADS=") for entry in started_with)


def choose_cpu_threads(environ: Mapping[str, str] = os.environ, cpus: Optional[int] = None,
                       parent_environ: Union[str, Path, None] = None) -> tuple[Optional[int], str]:
    """(threads for torch on CPU, or None to leave torch's choice; the reason, for the log).

    LLAMA_NUM_THREADS, if set, wins.  An OMP_NUM_THREADS the user set is respected
    (torch has already applied it).  Otherwise, including torchrun's default of 1, the
    CPUs this process may use (:func:`cpu_count`) are shared evenly among the job's
    processes on this machine: C CPUs and N local ranks give each rank C // N threads
    (at least 1), so ranks neither idle cores nor oversubscribe them.
    """
    value = environ.get("LLAMA_NUM_THREADS")
    if value:
        if not (value.isdigit() and int(value) > 0):
            raise ValueError(f"LLAMA_NUM_THREADS={value!r} must be a positive integer")
        return int(value), "LLAMA_NUM_THREADS"
    if "OMP_NUM_THREADS" in environ and not omp_threads_set_by_torchrun(environ, parent_environ):
        return None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} set by the user"
    cpus = cpu_count() if cpus is None else cpus
    local = environ.get("LOCAL_WORLD_SIZE", "1")
    local_ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    reason = "torchrun's default OMP_NUM_THREADS=1 replaced: " if "OMP_NUM_THREADS" in environ else ""
    return max(1, cpus // local_ranks), f"{reason}{cpus} CPU(s) shared by {local_ranks} local process(es)"


def configure_cpu_threads() -> int:
    """Set torch's CPU thread count once per process by :func:`choose_cpu_threads`;
    returns the count in use."""
    global _threads_configured
    if not _threads_configured:
        _threads_configured = True
        threads, reason = choose_cpu_threads()
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        logger.info("CPU threads per process: %d (%s)", torch.get_num_threads(), reason)
    return torch.get_num_threads()
