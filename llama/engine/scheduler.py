"""Deciding each step: which waiting requests start, which are cancelled, which are
preempted and resumed, which prompt chunks are prefilled and which rows decode.

The first rank alone sees the callers, so it alone makes the :class:`Decisions`
(admissions and cancellations) and shares them with the other ranks; every rank then
applies them to the same running requests and derives the same :class:`StepPlan` (which
tokens the step feeds, and which blocks of the paged KV cache each request holds) from
them, so the plan follows the decisions without travelling.

At most ``max_batch_size`` requests run at once; a request starts only when the KV
cache's free blocks hold its prompt.  Waiting requests start in order of their
``priority`` (lower first, as vLLM's), then of arrival.  When a running request needs a
block for its next token and none is left, the running request of the lowest priority
(the latest of those) is *preempted*: its blocks go back to the pool (its full ones stay
in the prefix cache), its tokens are kept, and it waits ahead of every new request of no
higher priority; it resumes when blocks are free again, prefilling what it had (from the
prefix cache where it still holds it) and going on where it stopped.  No request fails
for lack of blocks: one request of ``max_seq_len`` tokens always fits.  A request past its
deadline (``timeout_s``) is ended at the next step, running, preempted or waiting, its
blocks freed (finish reason ``"timeout"``).

The scheduler is also the one writer of a running request's progress, as vLLM v1's is:
after the step's forward passes (:mod:`llama.engine.runner`, which return data and change no
request) and the sampler, :meth:`Scheduler.update_from_output` records what the cache now
holds of each request, its scored prompt tokens, its new token, and its end, each through
the request's own methods (:class:`~llama.engine.requests.RunningRequest`), and gives back
the :class:`RequestOutput` list that the output processor turns into events and results.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, cast

from llama.engine.image_contexts import ImageContexts
from llama.engine.kv_cache_manager import KVCacheManager
from llama.engine.requests import Admission, RequestHandle, RunningRequest, keyed_tokens
from llama.engine.sampler import DEFERRED
from llama.engine.speculative import Speculator

if TYPE_CHECKING:  # the runner imports the plan's types from here
    from llama.engine.runner import RunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class Decisions:
    """What only the first rank can decide; shared with the others when there is any."""

    admissions: list[Admission] = field(default_factory=list)
    cancellations: list[int] = field(default_factory=list)  # ids of running requests
    expirations: list[int] = field(default_factory=list)  # ids of running requests past their deadlines
    shutdown: bool = False
    # Requests waiting for their grammar's mask (llama.engine.sampler): ready to be sampled, or
    # failed for taking too long.
    masks_ready: list[int] = field(default_factory=list)
    masks_overdue: list[int] = field(default_factory=list)
    # What steps of each shape cost, measured by the first rank (llama.engine.speculative's
    # Speculator.costs_to_share): only when they moved.
    speculation_costs: Optional[dict[tuple[int, int], float]] = None

    def __bool__(self) -> bool:
        return bool(self.admissions or self.cancellations or self.expirations or self.shutdown or self.masks_ready
                    or self.masks_overdue or self.speculation_costs is not None)


@dataclass
class PrefillChunk:
    """Prompt positions ``start``..``end - 1`` of ``request``, fed this step."""

    request: RunningRequest
    start: int
    end: int
    # It feeds the last of its request's context, whose logits give its next token (not a
    # resumed request's: its next token is pending) ...
    completes: bool = False
    # ... and the request may generate one: its last position's logits are needed.
    samples: bool = False


@dataclass
class StepPlan:
    """The tokens one step feeds: prompt chunks (oldest requests first, at most
    ``prefill_chunk`` tokens in all) and one token per decoding row, followed on some rows
    by the tokens proposed after it (:mod:`llama.engine.speculative`)."""

    prefill: list[PrefillChunk]
    decode: list[RunningRequest]  # requests with a sampled token to feed, oldest first
    # By request id, for the decoding rows that propose: the tokens fed after its pending one,
    # at the positions that follow (its blocks hold them).
    proposals: dict[int, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


@dataclass
class Sampled:
    """The tokens the sampler chose (:class:`~llama.engine.sampler.Sampler`), row by row of
    ``requests``: ``tokens`` (a deferred row's is :data:`~llama.engine.sampler.DEFERRED`),
    the rows that failed (``errors``), and for the rows that asked, each chosen token's
    log-probability and the most likely alternatives (``log_probs``).

    A row that verified proposals (``proposals``, by row) chose its first ``accepted[i]``
    proposals and then ``tokens[i]``: its tokens this step, in order, are :meth:`run`'s, each
    with its entry of ``log_probs[i]``.  A failed row may have accepted some before it failed."""

    requests: list[RunningRequest]
    tokens: list[int]
    errors: dict[int, BaseException] = field(default_factory=dict)
    log_probs: dict[int, list[tuple[float, Optional[list[tuple[int, float]]]]]] = field(default_factory=dict)
    proposals: dict[int, list[int]] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)

    def run(self, i: int) -> list[int]:
        """Row ``i``'s tokens this step: its accepted proposals, then its chosen token (none
        where it failed or was deferred)."""
        accepted = self.proposals.get(i, [])[: self.accepted.get(i, 0)]
        token = self.tokens[i]
        if i in self.errors or token == DEFERRED:
            return accepted
        return accepted + [token]


@dataclass
class RequestOutput:
    """What happened to one request that its caller must be told (by the output processor):
    a token it generated, with the text that token released and its log-probabilities; its
    end (``finished``: ``request.finish_reason`` says why); or its failure (``error``)."""

    request: RunningRequest
    token: Optional[int] = None
    text: str = ""
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None
    finished: bool = False
    error: Optional[BaseException] = None
    # With a token: how many of the request's tokens had wholly released text once it was
    # pushed (a step may give a request several tokens, each told as its own event).
    n_final: Optional[int] = None


def priority_key(request: Any) -> tuple[int, int]:
    """The order in which requests (handles or running requests) are served: priority, lower
    first, then arrival (ids grow with it).  Preemption takes the greatest key first."""
    return request.settings.priority, request.id


def check_prefill_chunk(prefill_chunk: int) -> None:
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")


class Scheduler:
    """The wait queue, the running and the preempted requests, and the step's plan.

    ``lock`` guards the queue and the running set against the threads that submit and
    cancel requests; the engine holds it when it changes them."""

    def __init__(self, kv: KVCacheManager, lock: threading.Condition, *, first_rank: bool, prefill_chunk: int,
                 max_queue: Optional[int], max_batch_size: int, speculator: Optional[Speculator] = None,
                 check_proposals: Optional[Callable[[dict[int, list[int]]], dict[int, list[int]]]] = None,
                 image_contexts: Optional[ImageContexts] = None) -> None:
        check_prefill_chunk(prefill_chunk)
        self.kv = kv
        self.lock = lock
        self.first_rank = first_rank
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.queue: deque[RequestHandle] = deque()  # first rank: submitted, not admitted, by priority_key
        self.local: dict[int, RequestHandle] = {}  # submitted here, awaiting the first rank's admission
        self.max_batch_size = max_batch_size  # most requests running at once (decoded together)
        self.running: dict[int, RunningRequest] = {}  # by request id (plan() takes them in priority_key order)
        self.preempted: deque[RunningRequest] = deque()  # waiting to resume, by priority_key
        self.preemptions = 0  # statistics
        self.tokens_generated = 0
        self.speculator = speculator  # decides the proposals of decoding rows (None: no speculation)
        # The proposals cut where the grammars of constrained requests forbid them, the same on
        # every rank (the engine's: the first rank's matchers decide, and it shares the cut).
        self.check_proposals = check_proposals
        # Llama 3.2 Vision requests' image contexts, let go with their blocks (None: none kept)
        self.image_contexts = image_contexts

    # -- requests coming and going (under the lock) ---------------------------------------

    def waiting_beyond_free_slots(self) -> int:
        """Requests that would still wait after the next admissions (those not yet admitted
        take free rows at the next step: only those beyond the free rows wait)."""
        return len(self.queue) - (self.max_batch_size - len(self.running) - len(self.preempted))

    def add(self, handle: RequestHandle) -> None:
        if self.first_rank:
            # In priority order (then arrival): after every request of its priority or higher.
            if not self.queue or priority_key(self.queue[-1]) <= priority_key(handle):
                self.queue.append(handle)
            else:
                self.queue.insert(bisect.bisect_right(self.queue, priority_key(handle), key=priority_key), handle)
        else:
            self.local[handle.id] = handle

    def admit(self, request: RunningRequest) -> None:
        """Start a request the first rank admitted, with blocks for its context (where the
        prefix cache holds some of it, that much is fed already); where there are too few
        (the first rank counted them: not expected) it waits to resume, as a preempted one."""
        n_cached = self.kv.start(request, reuse=not request.settings.echo)
        if n_cached is None:
            self.preempted.append(request)
            return
        request.placed(n_cached, first=True)
        self.running[request.id] = request

    def active(self) -> list[RunningRequest]:
        """The running requests (in the order they started), then the preempted ones."""
        return list(self.running.values()) + list(self.preempted)

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.running or self.preempted)

    # -- requests ending (under the lock) ------------------------------------------------

    def finish(self, request: RunningRequest, reason: str, stop_token: Optional[int] = None) -> RequestOutput:
        """End ``request`` for ``reason`` ("stop", "length", "cancelled"): its blocks go back
        (its full ones stay cached)."""
        request.end(reason, stop_token)
        self._release(request)
        return RequestOutput(request, finished=True)

    def fail(self, request: RunningRequest, error: BaseException) -> RequestOutput:
        """End one request with ``error``; the others go on.  What it wrote leaves the prefix
        cache (its logits may have come from non-finite keys and values)."""
        self.kv.fail(request)
        self._release(request)
        logger.info("request %d failed: %s", request.id, error)
        return RequestOutput(request, error=error)

    def abort_all(self, error: BaseException, *,
                  waiting: bool = True) -> tuple[list[RequestOutput], list[RequestHandle]]:
        """End every running and preempted request with ``error`` (their blocks go back, their
        full ones stay cached) and, with ``waiting``, take every request not yet started out
        of the queue: the outputs of the first, the handles of the others."""
        outputs = []
        for request in self.active():
            self._release(request)
            outputs.append(RequestOutput(request, error=error))
        handles: list[RequestHandle] = []
        if waiting:
            handles = list(self.queue) + list(self.local.values())
            self.queue.clear()
            self.local.clear()
        return outputs, handles

    def _release(self, request: RunningRequest) -> None:
        """The request runs no more: it holds no blocks (its full ones stay cached)."""
        if self.running.get(request.id) is request:
            del self.running[request.id]
        elif request in self.preempted:
            self.preempted.remove(request)
        self.kv.free(request)
        if self.image_contexts is not None:
            self.image_contexts.release(request.id)
        if self.speculator is not None:
            self.speculator.release(request.id)  # a draft model's blocks for it go back too

    # -- the first rank's decisions ----------------------------------------------------------

    def decide(self) -> Decisions:
        """Cancellations of running (or preempted) requests whose caller asked, expirations of
        those past their deadlines, then admissions of waiting requests, in priority order,
        while rows (``max_batch_size``) and blocks for their prompts are free (those freed by
        this step's cancellations and expirations included) and no preempted request of the
        same or a higher priority waits to resume.  A request whose prompt goes on with a
        block a running request is writing waits until it is cached (then it reuses it).  A
        request cancelled, or past its deadline, while it waited is admitted as such: every
        rank ends it (the others match requests by id)."""
        decisions = Decisions()
        now = time.monotonic()
        with self.lock:
            for request in list(self.running.values()) + list(self.preempted):
                if request.handle is None:
                    continue
                if request.handle.cancel_requested:
                    decisions.cancellations.append(request.id)
                elif request.handle.expired(now):
                    decisions.expirations.append(request.id)
            if not self.queue:  # nothing waits (most steps): no admission to weigh
                self.lock.notify_all()
                return decisions
            kept: deque[RequestHandle] = deque()
            for handle in self.queue:
                if handle.cancel_requested or handle.expired(now):
                    decisions.admissions.append(Admission(handle.id, handle.prompt_tokens, _shareable(handle),
                                                          cancelled=True, expired=not handle.cancel_requested,
                                                          constrained=_constrained(handle)))
                    self.local[handle.id] = handle
                else:
                    kept.append(handle)
            self.queue = kept
            ending = set(decisions.cancellations) | set(decisions.expirations)
            cancelled = [r for r in self.running.values() if r.id in ending]
            rows = self.max_batch_size - len(self.running) - len(self.preempted) + len(cancelled)
            # Blocks: what is free now and what the cancellations give back, less one block per
            # request left running (room to grow before anyone is preempted).  Counted without
            # the prefix cache's hits, so every admission finds its blocks.
            blocks = self.kv.blocks.available + sum(len(self.kv.block_ids(r.id)) for r in cancelled)
            blocks -= len(self.running) - len(cancelled)
            being_written = self._blocks_being_written(cancelled)
            held = self._image_slots_held(cancelled)
            waiting: deque[RequestHandle] = deque()
            # A preempted request resumes before any waiting request but one of a higher priority.
            while self.queue and rows > 0 and (not self.preempted
                                               or priority_key(self.queue[0])[0] < self.preempted[0].settings.priority):
                handle = self.queue.popleft()
                key = self._next_block_key(handle)
                if key is not None and key in being_written:
                    # A running request is writing the block its prompt goes on with: it starts once
                    # that block is cached, and reuses it (as all of a shared prompt's clients do).
                    waiting.append(handle)
                    continue
                need = self.kv.blocks.blocks_for(len(handle.prompt_tokens) + 1)
                fits = self.image_contexts is None or self.image_contexts.fits(held, handle.images)
                if (need > blocks or not fits) and (self.running or decisions.admissions):
                    self.queue.appendleft(handle)
                    # it waits for blocks or image slots (alone, it always fits: max_seq_len <= capacity,
                    # and a request with more images than the image pool holds is refused when submitted)
                    break
                rows, blocks = rows - 1, blocks - need
                held.append(self._image_slots(handle.images))
                decisions.admissions.append(Admission(handle.id, handle.prompt_tokens, _shareable(handle),
                                                      constrained=_constrained(handle), images=handle.images))
                self.local[handle.id] = handle
                if key is not None:
                    being_written.add(key)
            self.queue = waiting + self.queue
            self.lock.notify_all()
        return decisions

    def _image_slots(self, images: Sequence[Any]) -> int:
        """The image slots (:mod:`llama.engine.image_contexts`) a request with ``images`` holds while it runs."""
        return self.image_contexts.slots(images) if self.image_contexts is not None else 0

    def _image_slots_held(self, cancelled: Sequence[RunningRequest] = ()) -> list[int]:
        """The image slots each running request holds, but ``cancelled``'s."""
        return [self._image_slots(r.images) for r in self.running.values() if r not in cancelled]

    def image_slots_used(self) -> int:
        """The image slots the running requests count against the pool (preempted ones hold none):
        :meth:`~llama.engine.image_contexts.ImageContexts.footprint`."""
        return self.image_contexts.footprint(self._image_slots_held()) if self.image_contexts is not None else 0

    def _next_block_key(self, handle: RequestHandle) -> Optional[tuple]:
        """The prefix-cache key of the first block of ``handle``'s prompt that is not cached
        (None: no whole block is left to reuse, or it may not reuse any: echo)."""
        if handle.settings.echo:
            return None
        prompt, scope = keyed_tokens(handle.prompt_tokens, handle.images), handle.settings.prefix_scope
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
        # Every rank numbers its calls alike; priorities may admit them out of order.
        handle = self.local.pop(admission.request_id, None) or self.local.pop(next(iter(self.local)))
        if handle.prompt_tokens != admission.prompt:
            raise RuntimeError(
                "rank 0 and this rank asked for different prompts: under torchrun every rank must make the same "
                "generation calls in the same order, with the same arguments"
            )
        return handle

    # -- every rank: the step's plan -------------------------------------------------------

    def plan(self) -> StepPlan:
        """Preempted requests resumed while blocks allow; then prompt chunks of at most
        ``prefill_chunk`` tokens in all, in priority order (then oldest first), and every
        running request that has a sampled token to feed, each given the blocks its new
        tokens need (preempting the requests of the lowest priority, the newest of those,
        when none are left: always ones not yet planned); then the tokens decoding rows
        propose (:mod:`llama.engine.speculative`), with blocks for them where free ones are
        left.  The same on every rank."""
        self._resume()
        budget = self.prefill_chunk
        prefill: list[PrefillChunk] = []
        decode: list[RunningRequest] = []
        for request in sorted(self.running.values(), key=priority_key):  # (all of priority 0: oldest first)
            if request.id not in self.running:  # preempted for a higher one's blocks
                continue
            if request.prefilling:
                if budget == 0:
                    continue
                n = min(request.context_length() - request.n_fed, budget)
                if self._blocks_for(request, request.n_fed + n):
                    end = request.n_fed + n
                    completes = end == request.context_length() and request.pending is None
                    prefill.append(PrefillChunk(request, request.n_fed, end, completes=completes,
                                                samples=completes and request.budget != 0))
                    budget -= n
            elif request.pending is not None and self._blocks_for(request, request.n_fed + 1):
                decode.append(request)
        return StepPlan(prefill, decode, self._proposals(decode))

    def _proposals(self, decode: list[RunningRequest]) -> dict[int, list[int]]:
        """The speculator's proposals for the decoding rows, a constrained request's cut where
        its grammar forbids them (``check_proposals``), each cut to what free blocks hold: a
        proposal never preempts a request nor evicts a cached block (the blocks go back after
        the step, but what the cache held would be lost)."""
        if self.speculator is None or not decode:
            return {}
        out = {}
        proposals = self.speculator.proposals(decode)
        if self.check_proposals is not None and proposals:
            proposals = self.check_proposals(proposals)
        for request_id, proposed in proposals.items():
            request = self.running[request_id]
            n = len(proposed)
            held = self.kv.held(request.id)
            while n and self.kv.blocks.blocks_for(request.n_fed + 1 + n) - held > self.kv.blocks.free:
                n -= 1
            if n and self.kv.grow(request.id, request.n_fed + 1 + n):
                out[request.id] = proposed[:n]
        return out

    def _blocks_for(self, request: RunningRequest, n_tokens: int) -> bool:
        """Give ``request`` blocks for ``n_tokens`` tokens, preempting running requests of the
        lowest priority (the newest of those) while there are too few; False if it was
        preempted itself."""
        while not self.kv.grow(request.id, n_tokens):
            victim = max(self.running.values(), key=priority_key)
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: RunningRequest) -> None:
        """Take ``request``'s blocks back; it keeps its tokens and waits to resume."""
        del self.running[request.id]
        self.kv.free(request)
        if self.image_contexts is not None:
            self.image_contexts.release(request.id)  # recomputed when its prefill resumes
        if self.speculator is not None:
            self.speculator.release(request.id)
        request.evicted()
        self.preempted.append(request)
        self.preempted = deque(sorted(self.preempted, key=priority_key))
        self.preemptions += 1

    def _resume(self) -> None:
        """Resume preempted requests, in priority order (then oldest first), while rows, blocks
        (leaving one block per running request to grow) and image slots allow."""
        while self.preempted and len(self.running) < self.max_batch_size:
            request = self.preempted[0]
            need = self.kv.blocks.blocks_for(request.context_length() + 1)
            if self.running and (need > self.kv.blocks.available - len(self.running)
                                 or not (self.image_contexts is None
                                         or self.image_contexts.fits(self._image_slots_held(), request.images))):
                return
            n_cached = self.kv.start(request, reuse=request.prompt_logprobs is None)
            if n_cached is None:
                return
            request.placed(n_cached)
            self.preempted.popleft()
            self.running[request.id] = request
            self.running = dict(sorted(self.running.items()))

    # -- every rank: what the step did ---------------------------------------------------------

    def update_from_output(self, plan: StepPlan, ran: "RunnerOutput",
                           sampled: Optional[Sampled]) -> list[RequestOutput]:
        """(Under the lock.)  Record what the step did, the one place a running request's
        progress changes: the tokens its forward passes fed and the prompt tokens they scored
        (a request whose scoring failed ends with its error, its chunk not fed; one whose
        prompt is scored in full and may not generate ends), the full blocks they filled
        entered in the prefix cache, then the sampled tokens (:meth:`update_from_sampled`).
        The same on every rank."""
        for chunk in plan.prefill:
            request = chunk.request
            if request.id in ran.errors:
                continue
            scored = ran.prompt_logprobs.get(request.id)
            if scored is not None:
                request.scored_prompt(*scored)
            request.fed_context(chunk.end)
            self.kv.cache_blocks(request)
        for request in plan.decode:
            request.fed_pending()
            self.kv.cache_blocks(request)
        outputs = [self.finish(chunk.request, "length") for chunk in plan.prefill
                   if chunk.completes and not chunk.samples and chunk.request.id not in ran.errors]
        outputs += [self.fail(chunk.request, ran.errors[chunk.request.id]) for chunk in plan.prefill
                    if chunk.request.id in ran.errors]
        if sampled is not None:
            outputs += self.update_from_sampled(sampled)
        return outputs

    def update_from_sampled(self, sampled: Sampled) -> list[RequestOutput]:
        """(Under the lock.)  Each request's sampled tokens (one, or a verified run of several:
        :meth:`Sampled.run`), in order, each told as its own output: a stop token ends it, any
        other is kept (its text pushed, where it may complete a stop string), and the last is
        fed next step unless the request ends with it, which discards the tokens after it.  The
        proposals kept are counted as fed (the cache holds their keys and values; the blocks
        they fill enter the prefix cache), the blocks beyond go back, and the request's
        acceptance is updated.  A failed row ends its request alone (after the tokens it
        accepted); a deferred row waits (having verified none of its proposals: their blocks go
        back, and its acceptance stays)."""
        outputs = []
        for i, request in enumerate(sampled.requests):
            proposed = sampled.proposals.get(i)
            accepted = sampled.accepted.get(i, 0)
            run = sampled.run(i)
            deferred = not run and i not in sampled.errors  # its grammar's mask was late: nothing verified
            if proposed is not None and not deferred:
                request.speculated(cast(Speculator, self.speculator).after(request, len(proposed), accepted))
            values = sampled.log_probs.get(i, [])
            for j, token in enumerate(run):
                self.tokens_generated += 1
                if token in request.stop_token_ids:
                    outputs.append(self._end_run(request, proposed, "stop", stop_token=token))
                    break
                logprob, top = values[j] if j < len(values) else (None, None)
                text = request.append_token(token, logprob)
                if j < accepted:  # a proposal this step fed after the pending token
                    request.fed_proposals(1)
                if request.assembler.stopped:
                    output = self._end_run(request, proposed, "stop")
                elif len(request.generated) >= request.budget:
                    output = self._end_run(request, proposed, "length")
                else:
                    output = RequestOutput(request)
                output.token, output.text, output.logprob, output.top_logprobs = token, text, logprob, top
                output.n_final = request.assembler.n_final
                outputs.append(output)
                if output.finished:
                    break
            else:  # the request goes on, unless its row failed
                if proposed is not None:
                    self.kv.cache_blocks(request)
                if i in sampled.errors:
                    outputs.append(self.fail(request, sampled.errors[i]))
                elif run:
                    request.feed_next(run[-1])
                    if proposed is not None:  # what it holds beyond its next token held rejected ones
                        self.kv.trim(request.id, request.n_fed + 1)
                elif proposed is not None:  # deferred: the blocks of its proposals go back
                    self.kv.trim(request.id, request.n_fed + 1)
        return outputs

    def _end_run(self, request: RunningRequest, proposed: Optional[list[int]], reason: str,
                 stop_token: Optional[int] = None) -> RequestOutput:
        """End ``request`` within its step's tokens (:meth:`finish`), the blocks its kept
        proposals filled entered in the prefix cache first."""
        if proposed is not None:
            self.kv.cache_blocks(request)
        return self.finish(request, reason, stop_token)


def _shareable(handle: RequestHandle):
    """The settings the other ranks are told: without the logits processor and the grammar
    (the first rank alone runs them; neither travels)."""
    return replace(handle.settings, logits_processor=None, grammar=None)


def _constrained(handle: RequestHandle) -> bool:
    """Whether the request has a grammar, which every rank is told: the first rank cuts its
    proposals where the grammar forbids them, and shares the cut (:class:`Scheduler`)."""
    return handle.settings.grammar is not None
