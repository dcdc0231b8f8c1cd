"""What this machine gives a process: the memory it may still use (RAM and cgroup limits,
shared by the job's local processes) and its CPU threads (affinity, cgroup quota,
torchrun's OMP_NUM_THREADS, LLAMA_NUM_THREADS), the C++ compiler torch.compile needs, and
a long-running process's garbage collector kept from pausing it.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

logger = logging.getLogger(__name__)


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


def local_world_size(environ: Mapping[str, str] = os.environ) -> int:
    """Processes of this job on this machine (torchrun's LOCAL_WORLD_SIZE; 1 where it is unset
    or not a positive whole number)."""
    value = environ.get("LOCAL_WORLD_SIZE", "1")
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


# This process's thread count, once configured: (count, whether the library chose it rather
# than the user through LLAMA_NUM_THREADS or OMP_NUM_THREADS).
_threads_configured: Optional[tuple[int, bool]] = None


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
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
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
        return local_world_size(environ) > 1
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
    local_ranks = local_world_size(environ)
    reason = "torchrun's default OMP_NUM_THREADS=1 replaced: " if "OMP_NUM_THREADS" in environ else ""
    return max(1, cpus // local_ranks), f"{reason}{cpus} CPU(s) shared by {local_ranks} local process(es)"


def configure_cpu_threads() -> int:
    """Set torch's CPU thread count once per process by :func:`choose_cpu_threads`;
    returns the count in use."""
    global _threads_configured
    if _threads_configured is None:
        threads, reason = choose_cpu_threads()
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        ours = threads is not None and reason != "LLAMA_NUM_THREADS"
        _threads_configured = (torch.get_num_threads(), ours)
        logger.info("CPU threads per process: %d (%s)", torch.get_num_threads(), reason)
    return torch.get_num_threads()


def threads_chosen_here() -> Optional[int]:
    """The CPU thread count this library chose for the process (:func:`configure_cpu_threads`),
    or None where the user set it (LLAMA_NUM_THREADS, OMP_NUM_THREADS) or nothing was
    configured: only a count of our own choosing may be tuned while running."""
    if _threads_configured is None or not _threads_configured[1]:
        return None
    return _threads_configured[0]


def freeze_startup_heap() -> int:
    """Keep every object alive now out of Python's garbage collector's full collections; returns
    how many objects that is.  For a process that loads one model and then serves it: a full
    collection walks every tracked object, and a loaded model, its tokenizer and compiled graphs
    are 320,000-480,000 of them (150m config, Llama 3 tokenizer): a 170-270 ms pause that
    stopped the server between requests (AMD EPYC Zen 3, 2026-11-27).  What is frozen is never
    freed by the collector (freed by reference counting as ever), so this belongs after start-up
    in a process that keeps its model, not in a library call that may build several."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def cpp_compiler(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The path of the C++ compiler ``torch.compile`` builds CPU code with ($CXX, else g++:
    Inductor's default), or None where there is none on the PATH."""
    for name in (environ.get("CXX"), "g++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None
