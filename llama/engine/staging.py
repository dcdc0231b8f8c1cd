"""A step's inputs on their way to a GPU: pinned host buffers, allocated once, and copies
that do not make the host wait.

A tensor made in ordinary (pageable) host memory reaches a CUDA device through
``.to(device)``, which queues the copy and then waits for the whole stream
(``cudaStreamSynchronize``): everything queued before it must run first (a step's prefill
pass, before its decoding inputs can go), and the host queues nothing meanwhile.  From
page-locked (pinned) memory, ``copy_(..., non_blocking=True)`` only queues the copy: the
host goes on at once, and the copy runs in stream order, before the kernels queued after
it, which read its result.

The catch is the buffer: until the copy has run, the GPU still reads the pinned memory it
comes from, so writing the next step's inputs there too early sends the GPU the next
step's values.  Each buffer therefore carries an event recorded (on the stream) after its
copies, and :meth:`InputStaging.take` waits for that event before handing the buffer out
again.  Each kind of input (``group``: the runner's "decode" and "prefill") has ``slots``
buffers, used in turn, so that a step may fill one while the copies from the other are
still queued; today every step reads the device at its end (the sampled tokens), so by
the next step the wait finds its event complete and costs nothing.

On the CPU there is no separate device and nothing to stage: :meth:`InputStaging.for_device`
gives None there and the runner makes its tensors as before.  Tests drive the same code
on the CPU with unpinned buffers and fake events (``pin_memory``, ``new_event``, ``copy``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Lists of shapes whose views a buffer keeps (decoding steps have one per row count; prefill
# steps one per (rows, width), which vary with the prompts)
MAX_KEPT_SHAPES = 64


class Event(Protocol):
    """What a buffer needs of a CUDA event (``torch.cuda.Event``)."""

    def record(self) -> None: ...  # on the current stream, after the copies queued so far

    def synchronize(self) -> None: ...  # the host waits until the stream has passed it


def copy_non_blocking(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue the copy of ``src`` (pinned host memory) into ``dst`` (on the device)."""
    dst.copy_(src, non_blocking=True)


@dataclass
class _Slot:
    """One pinned buffer (int64, flat), a numpy array over the same memory (written without
    torch calls: cheaper for a few values than a tensor's), and the event recorded after the
    copies from it."""

    buffer: torch.Tensor
    array: np.ndarray
    event: Optional[Event] = None  # None until its first copies
    # The views of ``buffer`` and ``array`` handed out for each list of shapes asked for, made
    # once: a step's shapes repeat (its rows come in few counts), and slicing a tensor into
    # views costs more than filling them
    views: dict[tuple[tuple[int, ...], ...], tuple[list[torch.Tensor], list[np.ndarray]]] = field(default_factory=dict)


@dataclass
class _Group:
    slots: list[_Slot] = field(default_factory=list)
    next: int = 0  # the slot the next take() hands out


class StagedInputs:
    """The buffer :meth:`InputStaging.take` handed out: ``host``, pinned int64 views of the
    shapes asked for (contiguous, laid end to end in one buffer), and ``arrays``, numpy
    views of the same memory, for the caller to fill; then :meth:`to_device` once."""

    def __init__(self, staging: InputStaging, slot: _Slot, host: list[torch.Tensor], arrays: list[np.ndarray]) -> None:
        self.host = host
        self.arrays = arrays
        self._staging = staging
        self._slot: Optional[_Slot] = slot

    def to_device(self) -> list[torch.Tensor]:
        """Each of ``host`` copied into a new tensor on the device, the copies queued without
        waiting; the buffer's event is recorded after them.  The host views must not be
        written after this call (the buffer is another step's once :meth:`InputStaging.take`
        hands it out again)."""
        slot, self._slot = self._slot, None
        assert slot is not None, "to_device() is called once per take()"
        staging = self._staging
        out = []
        for view in self.host:
            # a tensor of its own each (views of one allocation would alias, which a compiled
            # step's guards tell apart from the warm-up's separate tensors: a recompilation)
            device_tensor = torch.empty(view.shape, dtype=view.dtype, device=staging.device)
            staging.copy(device_tensor, view)
            out.append(device_tensor)
        if slot.event is None:
            slot.event = staging.new_event()
        slot.event.record()
        return out


class InputStaging:
    """Pinned host buffers for a step's int64 inputs (token ids, positions, block tables,
    row indices), by ``group``, ``slots`` buffers each, and their non-blocking copies to
    ``device`` (see the module's docstring for why each buffer waits for its event).

    Buffers are allocated by :meth:`reserve` (when the engine is built) and grow only when a
    step needs more than was reserved, to twice their size at least, so that steps allocate
    nothing.  ``pin_memory``, ``new_event`` and ``copy`` are for tests: on a GPU they are
    True, ``torch.cuda.Event`` and :func:`copy_non_blocking`."""

    def __init__(self, device: torch.device, *, pin_memory: bool = True,
                 new_event: Optional[Callable[[], Event]] = None,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] = copy_non_blocking, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.new_event: Callable[[], Event] = new_event if new_event is not None else torch.cuda.Event
        self.copy = copy
        self.n_slots = slots
        self.allocations = 0  # host buffers allocated so far (steps should add none)
        self._groups: dict[str, _Group] = {}

    @classmethod
    def for_device(cls, device: torch.device) -> Optional[InputStaging]:
        """Staging for ``device``: on a CUDA device, pinned buffers and CUDA events; None
        elsewhere (on the CPU a step's tensors are already where the model reads them)."""
        return cls(device) if torch.device(device).type == "cuda" else None

    def reserve(self, group: str, numel: int) -> None:
        """Make each of ``group``'s buffers hold ``numel`` int64 values at least."""
        slots = self._group(group).slots
        for slot in slots:
            if slot.buffer.numel() < numel:
                if slot.event is not None:
                    slot.event.synchronize()  # its copies may still read the old buffer
                slot.buffer, slot.array = self._allocate(numel)
                slot.views.clear()

    def take(self, group: str, shapes: Sequence[tuple[int, ...]]) -> StagedInputs:
        """``group``'s next buffer, once the copies from it that were queued last time have
        run, as views of ``shapes`` to fill (then :meth:`StagedInputs.to_device`)."""
        state = self._group(group)
        slot = state.slots[state.next]
        state.next = (state.next + 1) % len(state.slots)
        if slot.event is not None:
            slot.event.synchronize()  # the GPU has read what this buffer held: it may be written
        key = tuple(tuple(shape) for shape in shapes)
        made = slot.views.get(key)
        if made is None:
            sizes = [math.prod(shape) for shape in key]
            needed = sum(sizes)
            if needed > slot.buffer.numel():
                logger.debug("staging buffer %r grows from %d to %d values", group, slot.buffer.numel(), needed)
                slot.buffer, slot.array = self._allocate(max(needed, 2 * slot.buffer.numel()))
                slot.views.clear()  # views of the old buffer
            views, arrays, offset = [], [], 0
            for shape, size in zip(key, sizes):
                views.append(slot.buffer[offset : offset + size].view(shape))
                arrays.append(slot.array[offset : offset + size].reshape(shape))
                offset += size
            if len(slot.views) >= MAX_KEPT_SHAPES:  # prompts' widths vary: keep the set small
                slot.views.clear()
            made = slot.views[key] = (views, arrays)
        return StagedInputs(self, slot, list(made[0]), list(made[1]))

    def buffers(self, group: str) -> list[torch.Tensor]:
        """``group``'s host buffers (for checks: pinned, not reallocated)."""
        return [slot.buffer for slot in self._group(group).slots]

    def _group(self, group: str) -> _Group:
        if group not in self._groups:
            self._groups[group] = _Group([_Slot(*self._allocate(0)) for _ in range(self.n_slots)])
        return self._groups[group]

    def _allocate(self, numel: int) -> tuple[torch.Tensor, np.ndarray]:
        self.allocations += 1
        buffer = torch.empty(numel, dtype=torch.long, pin_memory=self.pin_memory)
        return buffer, buffer.numpy()
