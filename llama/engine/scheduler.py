"""Deciding each step: which waiting requests start, which are cancelled, which are
preempted and resumed, which prompt chunks are prefilled and which rows decode.

The first rank alone sees the callers, so it alone makes the :class:`Decisions`
(admissions and cancellations) and shares them with the other ranks; every rank then
applies them to the same running requests and derives the same :class:`StepPlan` (which
tokens the step feeds, and which blocks of the paged KV cache each request holds) from
them, so the plan follows the decisions without travelling.

At most ``max_batch_size`` requests run at once; a request starts only when the KV
cache's free blocks hold its prompt.  When a running request needs a block for its next
token and none is left, the most recently started request is *preempted*: its blocks go
back to the pool (its full ones stay in the prefix cache), its tokens are kept, and it
waits ahead of every new request; it resumes when blocks are free again, prefilling what
it had (from the prefix cache where it still holds it) and going on where it stopped.
No request fails for lack of blocks: one request of ``max_seq_len`` tokens always fits.
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
    # Requests waiting for their grammar's mask (llama.engine.sampler): ready to be sampled, or
    # failed for taking too long.
    masks_ready: list[int] = field(default_factory=list)
    masks_overdue: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.admissions or self.cancellations or self.shutdown or self.masks_ready or self.masks_overdue)


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
    decode: list[RunningRequest]  # requests with a sampled token to feed, oldest first

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


def check_prefill_chunk(prefill_chunk: int) -> None:
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")


class Scheduler:
    """The wait queue, the running and the preempted requests, and the step's plan.

    ``lock`` guards the queue and the running set against the threads that submit and
    cancel requests; the engine holds it when it changes them."""

    def __init__(self, kv: KVCacheManager, lock: threading.Condition, *, first_rank: bool, prefill_chunk: int,
                 max_queue: Optional[int], max_batch_size: int) -> None:
        check_prefill_chunk(prefill_chunk)
        self.kv = kv
        self.lock = lock
        self.first_rank = first_rank
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.queue: deque[RequestHandle] = deque()  # first rank: submitted, not admitted
        self.local: dict[int, RequestHandle] = {}  # submitted here, awaiting the first rank's admission
        self.max_batch_size = max_batch_size  # most requests running at once (decoded together)
        self.running: dict[int, RunningRequest] = {}  # by request id, in the order they started
        self.preempted: deque[RunningRequest] = deque()  # waiting to resume, oldest first
        self.preemptions = 0  # statistics

    # -- requests coming and going (under the lock) ---------------------------------------

    def waiting_beyond_free_slots(self) -> int:
        """Requests that would still wait after the next admissions (those not yet admitted
        take free rows at the next step: only those beyond the free rows wait)."""
        return len(self.queue) - (self.max_batch_size - len(self.running) - len(self.preempted))

    def add(self, handle: RequestHandle) -> None:
        if self.first_rank:
            self.queue.append(handle)
        else:
            self.local[handle.id] = handle

    def start(self, request: RunningRequest) -> None:
        self.running[request.id] = request

    def release(self, request: RunningRequest) -> None:
        """The request runs no more: it holds no blocks (its full ones stay cached)."""
        if self.running.get(request.id) is request:
            del self.running[request.id]
        elif request in self.preempted:
            self.preempted.remove(request)
        self.kv.free(request)

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.running or self.preempted)

    # -- the first rank's decisions ----------------------------------------------------------

    def decide(self) -> Decisions:
        """Cancellations of running (or preempted) requests whose caller asked, then
        admissions of waiting requests, in order, while rows (``max_batch_size``) and blocks
        for their prompts are free (those freed by this step's cancellations included) and
        no preempted request waits to resume.  A request whose prompt goes on with a block
        a running request is writing waits until it is cached (then it reuses it).  A
        request cancelled while it waited is admitted as cancelled: every rank ends it (the
        others match requests by order)."""
        decisions = Decisions()
        with self.lock:
            for request in list(self.running.values()) + list(self.preempted):
                if request.handle is not None and request.handle.cancel_requested:
                    decisions.cancellations.append(request.id)
            kept: deque[RequestHandle] = deque()
            for handle in self.queue:
                if handle.cancel_requested:
                    decisions.admissions.append(Admission(handle.id, handle.prompt_tokens, _shareable(handle),
                                                          cancelled=True))
                    self.local[handle.id] = handle
                else:
                    kept.append(handle)
            self.queue = kept
            cancelled = [r for r in self.running.values() if r.id in decisions.cancellations]
            rows = self.max_batch_size - len(self.running) - len(self.preempted) + len(cancelled)
            # Blocks: what is free now and what the cancellations give back, less one block per
            # request left running (room to grow before anyone is preempted).  Counted without
            # the prefix cache's hits, so every admission finds its blocks.
            blocks = self.kv.blocks.available + sum(len(self.kv.block_ids(r.id)) for r in cancelled)
            blocks -= len(self.running) - len(cancelled)
            being_written = self._blocks_being_written(cancelled)
            waiting: deque[RequestHandle] = deque()
            while self.queue and rows > 0 and not self.preempted:
                handle = self.queue.popleft()
                key = self._next_block_key(handle)
                if key is not None and key in being_written:
                    # A running request is writing the block its prompt goes on with: it starts once
                    # that block is cached, and reuses it (as all of a shared prompt's clients do).
                    waiting.append(handle)
                    continue
                need = self.kv.blocks.blocks_for(len(handle.prompt_tokens) + 1)
                if need > blocks and (self.running or decisions.admissions):
                    self.queue.appendleft(handle)
                    break  # it waits for blocks (alone, it always fits: max_seq_len <= capacity)
                rows, blocks = rows - 1, blocks - need
                decisions.admissions.append(Admission(handle.id, handle.prompt_tokens, _shareable(handle)))
                self.local[handle.id] = handle
                if key is not None:
                    being_written.add(key)
            self.queue = waiting + self.queue
            self.lock.notify_all()
        return decisions

    def _next_block_key(self, handle: RequestHandle) -> Optional[tuple]:
        """The prefix-cache key of the first block of ``handle``'s prompt that is not cached
        (None: no whole block is left to reuse, or it may not reuse any: echo)."""
        if handle.settings.echo:
            return None
        prompt, scope = handle.prompt_tokens, handle.settings.cache_scope
        hits = self.kv.blocks.match(prompt, scope, len(prompt) - 1)
        return self.kv.blocks.next_key(prompt, scope, hits, len(prompt) - 1)

    def _blocks_being_written(self, cancelled: list[RunningRequest]) -> set[tuple]:
        """The prefix-cache keys of the blocks running requests are about to write whole: the
        first not yet cached block of each one's context."""
        keys = set()
        for request in self.running.values():
            if request in cancelled or not request.prefilling:
                continue
            key = self.kv.next_block_key(request)
            if key is not None:
                keys.add(key)
        return keys

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
        """Preempted requests resumed while blocks allow; then prompt chunks of at most
        ``prefill_chunk`` tokens in all, oldest requests first, and every running request
        that has a sampled token to feed, each given the blocks its new tokens need
        (preempting the newest requests when none are left).  The same on every rank."""
        self._resume()
        budget = self.prefill_chunk
        prefill: list[PrefillChunk] = []
        decode: list[RunningRequest] = []
        for request in list(self.running.values()):  # oldest first
            if request.id not in self.running:  # preempted for an older one's blocks
                continue
            if request.prefilling:
                if budget == 0:
                    continue
                n = min(request.context_length() - request.n_fed, budget)
                if self._blocks_for(request, request.n_fed + n):
                    prefill.append(PrefillChunk(request, request.n_fed, request.n_fed + n))
                    budget -= n
            elif request.pending is not None and self._blocks_for(request, request.n_fed + 1):
                decode.append(request)
        return StepPlan(prefill, decode)

    def _blocks_for(self, request: RunningRequest, n_tokens: int) -> bool:
        """Give ``request`` blocks for ``n_tokens`` tokens, preempting the newest running
        requests while there are too few; False if it was preempted itself."""
        while not self.kv.grow(request.id, n_tokens):
            victim = next(reversed(self.running.values()))
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: RunningRequest) -> None:
        """Take ``request``'s blocks back; it keeps its tokens and waits to resume."""
        del self.running[request.id]
        self.kv.free(request)
        request.n_fed = 0
        self.preempted.append(request)
        self.preempted = deque(sorted(self.preempted, key=lambda r: r.id))
        self.preemptions += 1

    def _resume(self) -> None:
        """Resume preempted requests, oldest first, while rows and blocks allow (leaving one
        block per running request to grow)."""
        while self.preempted and len(self.running) < self.max_batch_size:
            request = self.preempted[0]
            need = self.kv.blocks.blocks_for(request.context_length() + 1)
            if self.running and need > self.kv.blocks.available - len(self.running):
                return
            n_cached = self.kv.start(request, reuse=request.prompt_logprobs is None)
            if n_cached is None:
                return
            request.n_fed = n_cached
            self.preempted.popleft()
            self.running[request.id] = request
            self.running = dict(sorted(self.running.items()))


def _shareable(handle: RequestHandle):
    """The settings the other ranks are told: without the logits processor and the grammar
    (the first rank alone runs them; neither travels)."""
    return replace(handle.settings, logits_processor=None, grammar=None)
