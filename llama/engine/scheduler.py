"""Deciding each step: which waiting requests start (in which slot), which are cancelled,
which prompt chunks are prefilled and which rows decode.

The first rank alone sees the callers, so it alone makes the :class:`Decisions`
(admissions and cancellations) and shares them with the other ranks; every rank then
applies them to the same running requests and derives the same :class:`StepPlan` (which
tokens the step feeds) from them, so the plan follows the decisions without travelling.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional

from llama.engine.kv_cache_manager import KVCacheManager
from llama.engine.requests import Admission, RequestHandle, RunningRequest


@dataclass
class Decisions:
    """What only the first rank can decide; shared with the others when there is any."""

    admissions: list[Admission] = field(default_factory=list)
    cancellations: list[int] = field(default_factory=list)  # ids of running requests
    shutdown: bool = False

    def __bool__(self) -> bool:
        return bool(self.admissions or self.cancellations or self.shutdown)


@dataclass
class PrefillChunk:
    """Prompt positions ``start``..``end - 1`` of ``request``, fed this step."""

    request: RunningRequest
    start: int
    end: int


@dataclass
class StepPlan:
    """The tokens one step feeds: prompt chunks (oldest requests first, at most
    ``prefill_chunk`` tokens in all) and one token per decoding row."""

    prefill: list[PrefillChunk]
    decode: list[RunningRequest]  # requests with a sampled token to feed, by slot

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    """The wait queue, the running requests (by slot) and the step's plan.

    ``lock`` guards the queue and the running set against the threads that submit and
    cancel requests; the engine holds it when it changes them."""

    def __init__(self, kv: KVCacheManager, lock: threading.Condition, *, first_rank: bool, prefill_chunk: int,
                 max_queue: Optional[int]) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.kv = kv
        self.lock = lock
        self.first_rank = first_rank
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.queue: deque[RequestHandle] = deque()  # first rank: submitted, not admitted
        self.local: dict[int, RequestHandle] = {}  # submitted here, awaiting the first rank's admission
        self.running: dict[int, RunningRequest] = {}  # by slot

    # -- requests coming and going (under the lock) ---------------------------------------

    def waiting_beyond_free_slots(self) -> int:
        """Requests that would still wait after the next admissions (those not yet admitted
        take free slots at the next step: only those beyond the free slots wait)."""
        return len(self.queue) - (self.kv.n_slots - len(self.running))

    def add(self, handle: RequestHandle) -> None:
        if self.first_rank:
            self.queue.append(handle)
        else:
            self.local[handle.id] = handle

    def start(self, request: RunningRequest) -> None:
        self.running[request.slot] = request

    def release(self, request: RunningRequest) -> None:
        """The request holds its slot no more."""
        if self.running.get(request.slot) is request:
            del self.running[request.slot]

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    # -- the first rank's decisions ----------------------------------------------------------

    def decide(self) -> Decisions:
        """Cancellations of running requests whose caller asked, then admissions of waiting
        requests into free slots (those freed by this step's cancellations included), each in
        the slot whose row helps its prompt most.  A request cancelled while it waited is
        admitted as cancelled: every rank ends it (the others match requests by order)."""
        decisions = Decisions()
        with self.lock:
            for request in self.running.values():
                if request.handle is not None and request.handle.cancel_requested:
                    decisions.cancellations.append(request.id)
            kept: deque[RequestHandle] = deque()
            for handle in self.queue:
                if handle.cancel_requested:
                    decisions.admissions.append(Admission(handle.id, -1, 0, handle.prompt_tokens,
                                                          _shareable(handle), cancelled=True))
                    self.local[handle.id] = handle
                else:
                    kept.append(handle)
            self.queue = kept
            free = [s for s in range(self.kv.n_slots) if s not in self.running]
            free += [r.slot for r in self.running.values() if r.id in decisions.cancellations]
            while self.queue and free:
                handle = self.queue.popleft()
                slot, reused = self.kv.choose_slot(handle.prompt_tokens, handle.settings.cache_scope, free,
                                                   reuse=not handle.settings.echo)
                free.remove(slot)
                decisions.admissions.append(Admission(handle.id, slot, reused, handle.prompt_tokens,
                                                      _shareable(handle)))
                self.local[handle.id] = handle
            self.lock.notify_all()
        return decisions

    def handle_of(self, admission: Admission, serving: bool) -> Optional[RequestHandle]:
        """This rank's handle for a request the first rank admits: the first rank's own; on
        another rank the oldest request submitted here (every rank makes the same calls in
        the same order), or none when only the first rank has callers (serving)."""
        if self.first_rank:
            return self.local.pop(admission.request_id)
        if not self.local:
            if serving:
                return None
            raise RuntimeError(
                "rank 0 started a request this rank never made: under torchrun every rank must make the "
                "same generation calls in the same order"
            )
        handle = self.local.pop(next(iter(self.local)))
        if handle.prompt_tokens != admission.prompt:
            raise RuntimeError(
                "rank 0 and this rank asked for different prompts: under torchrun every rank must make the same "
                "generation calls in the same order, with the same arguments"
            )
        return handle

    # -- every rank: the step's plan -------------------------------------------------------

    def plan(self) -> StepPlan:
        """Prompt chunks of at most ``prefill_chunk`` tokens in all, oldest requests first, and
        every running request that has a sampled token to feed.  The same on every rank."""
        budget = self.prefill_chunk
        prefill: list[PrefillChunk] = []
        for request in sorted(self.running.values(), key=lambda r: r.id):
            if not request.prefilling or budget == 0:
                continue
            n = min(len(request.prompt) - request.n_fed, budget)
            prefill.append(PrefillChunk(request, request.n_fed, request.n_fed + n))
            budget -= n
        decode = [r for r in self.running.values() if r.pending is not None]
        return StepPlan(prefill, decode)


def _shareable(handle: RequestHandle):
    """The settings the other ranks are told: without the logits processor and the grammar
    (the first rank alone runs them; neither travels)."""
    return replace(handle.settings, logits_processor=None, grammar=None)
