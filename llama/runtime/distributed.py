"""The processes of a job: the only module that talks to ``torch.distributed``.

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
to type) use a separate gloo "control" group with a long timeout.  Compiling a step
is such a wait too: a rank that compiled first waits at the step's first collective for
the others, so while the engine compiles at build the model-parallel group's timeout is
raised to :data:`COMPILE_TIMEOUT_S` (:func:`compile_timeout_for_collectives`).

Replicas (``llama-serve --data_parallel N`` under torchrun, :func:`plan_replicas`): the job's
W processes form N model-parallel groups of W / N consecutive ranks (fairscale's own layout:
ranks 0 .. W/N - 1 the first replica, and so on), each with a control group of its own.  Every
collective of a replica runs on its groups, from its first rank
(``fs_init.get_model_parallel_src_rank()``), so the replicas step independently; only the
making of groups (``new_group``) involves the whole job, which every rank does in the same order.
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
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fs_init

from llama.runtime.host import configure_cpu_threads

logger = logging.getLogger(__name__)

# Bound on any one collective of generation; override with LLAMA_COLLECTIVE_TIMEOUT_S.
STEP_TIMEOUT_S = 60.0
# Bound on waits between ranks outside the forward pass (loading, user input);
# override with LLAMA_CONTROL_TIMEOUT_S.
CONTROL_TIMEOUT_S = 24 * 3600.0

_control_group: Optional[dist.ProcessGroup] = None
_replicas = 1  # model-parallel groups the job is split into (plan_replicas)


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


# Bound on the collectives of steps run while compiling them; LLAMA_COMPILE_TIMEOUT_S overrides.
COMPILE_TIMEOUT_S = 3600.0
_MAX_TIMEOUT_S = 365 * 24 * 3600.0  # a year: beyond it "never" is what is meant, and timedelta may overflow


def step_timeout() -> datetime.timedelta:
    return _timeout("LLAMA_COLLECTIVE_TIMEOUT_S", STEP_TIMEOUT_S)


def control_timeout() -> datetime.timedelta:
    return _timeout("LLAMA_CONTROL_TIMEOUT_S", CONTROL_TIMEOUT_S)


def compile_timeout() -> datetime.timedelta:
    return _timeout("LLAMA_COMPILE_TIMEOUT_S", COMPILE_TIMEOUT_S)


@contextlib.contextmanager
def compile_timeout_for_collectives() -> Iterator[None]:
    """Within the block, the model-parallel group's collectives wait up to
    :func:`compile_timeout` (each rank compiles a step in its own time before the step's
    first collective); the step timeout again after it."""
    if fs_init.get_model_parallel_world_size() == 1:
        yield
        return
    group = fs_init.get_model_parallel_group()
    dist.distributed_c10d._set_pg_timeout(compile_timeout(), group)
    try:
        yield
    finally:
        dist.distributed_c10d._set_pg_timeout(step_timeout(), group)


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def planned_world_size() -> int:
    """How many processes this job has, known before any process group exists."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if _launched_by_torchrun() else 1


def plan_replicas(n: int) -> None:
    """Split the job's processes into ``n`` model replicas of ``planned_world_size() / n``
    consecutive ranks each (``llama-serve --data_parallel n`` under torchrun): call on every
    rank before the model loads (:func:`init_model_parallel` then makes the groups).
    ValueError where ``n`` does not divide the process count."""
    global _replicas
    world = planned_world_size()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or world % n:
        raise ValueError(f"{n!r} replicas cannot split {world} process(es) evenly: give a number of replicas "
                         f"that divides torchrun's process count ({world})")
    if dist.is_initialized() and fs_init.model_parallel_is_initialized() and \
            fs_init.get_model_parallel_world_size() != world // n:
        raise RuntimeError("the model-parallel groups are already made: plan the replicas before the model loads")
    _replicas = n


def planned_model_parallel_size() -> int:
    """How many processes one copy of the model is split over: the job's (or, with
    :func:`plan_replicas`, one replica's), known before any process group exists."""
    return planned_world_size() // _replicas


def replica_index() -> int:
    """Which replica (model-parallel group) this process belongs to: 0 .. replicas - 1."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank() // planned_model_parallel_size()


def init_model_parallel(device: torch.device, model_parallel_size: Optional[int] = None) -> tuple[int, int]:
    """Join (or create) the process group and fairscale's model-parallel group.

    Returns (model-parallel rank, model-parallel size).  Every process of the job is one
    model-parallel rank, of the one group or (:func:`plan_replicas`) of its replica's;
    ``model_parallel_size``, when given, must equal the group's number of processes.
    """
    world_size = planned_model_parallel_size()
    if model_parallel_size is not None and model_parallel_size != world_size:
        raise ValueError(
            f"model_parallel_size={model_parallel_size} but {world_size} process(es) were started; "
            f"start {model_parallel_size} with torchrun --nproc_per_node {model_parallel_size}, "
            "or leave model_parallel_size unset"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        select_cuda_device(device)
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
        _control_group = _make_control_group(world_size)
    return fs_init.get_model_parallel_rank(), world_size


def _make_control_group(size: int) -> Optional[dist.ProcessGroup]:
    """This process's replica's gloo group with the long timeout (None for a replica of one
    process).  Every rank makes every replica's group (``new_group`` is collective)."""
    world = dist.get_world_size()
    if size == 1:
        return None
    if size == world:
        return dist.new_group(backend="gloo", timeout=control_timeout())
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)), backend="gloo", timeout=control_timeout())
        if first <= dist.get_rank() < first + size:
            mine = group
    return mine


def select_cuda_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device.  ``cuda`` without an index means
    the current device, as everywhere in torch (``torch.cuda.set_device`` refuses it), so
    nothing is changed for it; ``cuda:N`` selects GPU N."""
    if device.index is not None:
        torch.cuda.set_device(device)


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


# This process's own one-process group, in which a replicated model (a draft: every rank holds
# all of it, llama.engine.draft) runs as if alone: made by make_alone_group().
_alone_group: Optional[dist.ProcessGroup] = None


def make_alone_group() -> None:
    """Make (once) a one-process group for each rank of the job, this process's kept for
    :func:`alone`.  Collective: every rank calls it, in the same order as its other calls
    that make groups (loading a replicated model does)."""
    global _alone_group
    if _alone_group is not None or fs_init.get_model_parallel_world_size() == 1:
        return
    rank = dist.get_rank()
    for r in range(dist.get_world_size()):  # every rank takes part in making every group
        group = dist.new_group([r], timeout=step_timeout())
        if r == rank:
            _alone_group = group


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within it, fairscale's model-parallel group is this process alone (model-parallel size
    1, rank 0): a model built or run within it is whole on this rank and its forward passes
    make no collective (a replicated draft model, each rank running all of it).  Nothing
    changes in a one-process job.  Not for other threads' collectives meanwhile: the engine's
    step runs the draft between its own passes."""
    if fs_init.get_model_parallel_world_size() == 1 and _alone_group is None:
        yield
        return
    if _alone_group is None:
        raise RuntimeError("distributed.alone() needs make_alone_group() first (every rank, when loading)")
    shared = fs_init._MODEL_PARALLEL_GROUP
    fs_init._MODEL_PARALLEL_GROUP = _alone_group
    try:
        yield
    finally:
        fs_init._MODEL_PARALLEL_GROUP = shared


def share_over_job(obj: Any) -> Any:
    """Give every process of the job rank 0's picklable ``obj`` (over the default group, long
    timeout): what the replicas' first ranks need of rank 0 once, e.g. where to connect."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


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


def min_over_ranks(value: int) -> int:
    """The least of every model-parallel rank's ``value`` (each rank passes its own), on
    every rank: what all ranks must agree on, e.g. the KV cache's size sized from each
    rank's own GPU memory."""
    if fs_init.get_model_parallel_world_size() == 1:
        return value
    group = fs_init.get_model_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    box = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
    return int(box.item())


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
        dist.broadcast_object_list(box, src=fs_init.get_model_parallel_src_rank(), group=_control_group)
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {dist.get_rank()} gave up waiting for rank {fs_init.get_model_parallel_src_rank()} (its "
            f"replica's first) to share its next input (LLAMA_CONTROL_TIMEOUT_S="
            f"{control_timeout().total_seconds():g}): that rank probably died or hangs; see its log. "
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
    rank, size = dist.get_rank(), fs_init.get_model_parallel_world_size()
    first = fs_init.get_model_parallel_src_rank()  # (the replica's ranks: first .. first + size - 1)
    store = _store()
    key = f"llama/wait/{_wait_count}"
    if store is not None:
        store.set(f"{key}/{rank}", "1")

    def absent() -> str:
        if store is None:
            return "some rank(s)"
        try:
            missing = [r for r in range(first, first + size) if r != rank and not store.check([f"{key}/{r}"])]
        except (AttributeError, RuntimeError, dist.DistError):  # the store is gone
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
