"""The generation engine: one continuous-batching loop under every entry point.

The KV cache's ``max_batch_size`` rows are *slots*.  A request waits in a queue, takes a
free slot, has its prompt prefilled (several prompts in one ragged forward pass, a long
one in chunks of at most ``prefill_chunk`` tokens per step so that it does not stall the
others), then decodes one token per step together with every other running request, and
frees its slot the moment it finishes, is cancelled or fails.  A free slot keeps the
tokens its cache holds: a later request whose prompt starts with them (the next turn of
a chat, a shared system prompt) prefills only the rest.

Each request has its own sampling settings and its own seeded generator, so a seeded
request gives the same text whatever else shares the batch.

Driving.  Without a server, whichever thread waits on a request runs the steps (one at a
time, under a lock); the others' requests advance with them.  A server calls
:meth:`Engine.run_forever` instead, on every rank's main thread.  In a multi-rank job
only the main thread ever runs steps (the ranks must take the same steps in the same
order), so there, requests from other threads need ``run_forever``.

Ranks.  Under torchrun every rank holds a slice of the model and runs the same steps.
The first rank decides each step's *plan* (requests admitted, with their tokens and
settings, and cancellations) and shares it before computing; it also samples every token
and shares those (:func:`distributed.broadcast_from_first_rank`).  The other ranks only
follow: they never wait on a client, and requests they submit themselves (the Python API,
where every rank makes the same calls) are matched to the first rank's by their ids.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Sequence

import torch

from llama.runtime import distributed
from llama.runtime.finite import NonFiniteError, check_finite_logits
from llama.model import Transformer
from llama.engine.sampling import SamplingParams, greedy_tokens, sample_next_token
from llama.engine.detokenize import TextAssembler, check_stop_strings
from llama.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "RequestSettings",
    "RequestHandle",
    "TokenEvent",
    "RequestResult",
    "EngineBusy",
    "EngineStopped",
]

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MAX_TOP_LOGPROBS = 20
SEED_MODULUS = 2**64  # seeds are reduced to the range torch's generators take
FAILED = -1  # the token the first rank shares for a request that failed while sampling
PROMPT_CONTEXT_TOKENS = 4  # prompt tokens decoded with the text that follows them (a character's bytes)


class EngineBusy(RuntimeError):
    """The engine's wait queue is full (``max_queue``): try again later."""


class EngineStopped(RuntimeError):
    """The engine was shut down before the request finished."""


@dataclass(frozen=True)
class RequestSettings:
    """How one request is generated.  Checked by :meth:`Engine.submit`."""

    max_new_tokens: int  # clipped so that prompt + new tokens <= max_seq_len
    temperature: float = 0.6  # 0 = greedy
    top_p: float = 0.9
    top_k: Optional[int] = None
    seed: Optional[int] = None  # None: drawn from the engine's generator; any int (taken modulo 2**64)
    stop: tuple[str, ...] = ()  # stop strings
    logprobs: bool = False  # log-probability of each generated token
    top_logprobs: int = 0  # and the most likely alternatives (0..20)
    echo: bool = False  # score the prompt tokens too (with logprobs); disables prefix reuse
    # The text as it continues the prompt's (a SentencePiece word keeps its leading space):
    # what an echo of the prompt is followed by.  False: the tokens' text on its own (Meta's).
    text_follows_prompt: bool = False
    logits_processor: Optional[LogitsProcessor] = None  # (tokens (1, L), logits (1, V)) -> logits
    stop_tokens: Optional[frozenset[int]] = None  # token ids that end the request (None: the tokenizer's)
    # Requests reuse cached prompt prefixes only from requests of the same scope (None is a
    # scope too): a server gives each tenant its own, so no tenant can probe another's prompts.
    cache_scope: Optional[str] = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass
class TokenEvent:
    """One generated token and the text it released.  ``token`` is None only for a
    request's last event, which carries text held back until the end.

    ``final_offsets``: the request's tokens whose text became wholly released with this
    event (the next ones in order), as the offsets where their text starts in the request's
    text.  A token inside a stop string never becomes final: a stream that reports each
    token's log-probability once it is final lists exactly the tokens the result keeps."""

    token: Optional[int]
    text: str
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None
    final_offsets: tuple[int, ...] = ()


@dataclass
class RequestResult:
    tokens: list[int]  # generated tokens, cut at the stop token / stop string
    text: str  # their text, cut at the stop string
    logprobs: Optional[list[float]]
    prompt_logprobs: Optional[list[float]]  # with echo and logprobs; the first token has none: 0.0
    finish_reason: str  # "stop" (stop token or string), "length" or "cancelled"
    stop_token: Optional[int]  # the stop token that ended the request, if one did
    n_prompt_tokens: int
    n_cached_prompt_tokens: int  # prompt tokens reused from a slot's cache, not prefilled
    all_tokens: list[int] = field(default_factory=list)  # every generated token (stop string included)
    text_offsets: list[int] = field(default_factory=list)  # where each of ``tokens`` starts in ``text``


@dataclass
class _Admission:
    """What the first rank tells the others about a request it admits."""

    request_id: int
    slot: int
    reused: int  # prompt tokens already in the slot's cache
    prompt: list[int]
    settings: RequestSettings  # without the logits processor (not shareable)
    cancelled: bool = False  # cancelled while queued: every rank just ends it (no slot)


@dataclass
class _Plan:
    admissions: list[_Admission] = field(default_factory=list)
    cancellations: list[int] = field(default_factory=list)
    shutdown: bool = False

    def __bool__(self) -> bool:
        return bool(self.admissions or self.cancellations or self.shutdown)


class RequestHandle:
    """A submitted request: iterate :meth:`events`, wait for :meth:`result`, or :meth:`cancel`."""

    def __init__(self, engine: "Engine", request_id: int, prompt: list[int], settings: RequestSettings,
                 on_event: Optional[Callable]) -> None:
        self.engine = engine
        self.id = request_id
        self.prompt_tokens = prompt
        self.settings = settings
        self._on_event = on_event
        self._events: deque = deque()
        self._result: Optional[RequestResult] = None
        self._error: Optional[BaseException] = None
        self.cancel_requested = False
        self.finished = False

    def cancel(self) -> None:
        """Stop generating at the next step boundary and free the slot (thread-safe)."""
        with self.engine._cond:
            self.cancel_requested = True
            self.engine._cond.notify_all()

    def events(self) -> Iterator[TokenEvent]:
        """The request's tokens as they are generated; blocks; raises the request's error."""
        while True:
            item = self.engine._next_event(self)
            if item is None:
                return
            yield item

    def result(self) -> RequestResult:
        """Block until the request has finished and return its result."""
        for _ in self.events():
            pass
        assert self._result is not None
        return self._result

    # -- called by the engine, under its lock --------------------------------------------

    def _emit(self, event) -> None:
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:  # a listener's bug must not stop the engine
                logger.exception("on_event callback of request %d failed", self.id)
        self._events.append(event)

    def _finish(self, result: Optional[RequestResult], error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self.finished = True
        if self._on_event is not None:
            try:
                self._on_event(error if error is not None else result)
            except Exception:
                logger.exception("on_event callback of request %d failed", self.id)


class _Running:
    """Engine-side state of an admitted request (the same on every rank)."""

    def __init__(self, adm: _Admission, handle: Optional[RequestHandle], tokenizer: Tokenizer,
                 budget: int, generator: Optional[torch.Generator]) -> None:
        self.id = adm.request_id
        self.slot = adm.slot
        self.prompt = adm.prompt
        self.settings = adm.settings
        self.handle = handle
        self.processor = handle.settings.logits_processor if handle is not None else None
        self.sampling = adm.settings.sampling()
        self.generator = generator
        self.n_fed = adm.reused  # tokens of prompt + generated whose K/V are in the cache
        self.reused = adm.reused
        self.budget = budget  # new tokens allowed
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_logprobs: Optional[list[float]] = (
            [0.0] * len(adm.prompt) if adm.settings.echo and adm.settings.logprobs else None
        )
        context = adm.prompt[-PROMPT_CONTEXT_TOKENS:] if adm.settings.text_follows_prompt else ()
        self.assembler = TextAssembler(tokenizer, adm.settings.stop, context)
        self.pending: Optional[int] = None  # last sampled token, to be fed next step
        self.n_reported_final = 0  # tokens whose text events have said is final
        self.stop_token: Optional[int] = None
        self.finish_reason: Optional[str] = None

    def newly_final(self, n_final: int) -> tuple[int, ...]:
        """The text offsets of the tokens final now that were not before (see TokenEvent)."""
        offsets = tuple(self.assembler.token_start(k) for k in range(self.n_reported_final, n_final))
        self.n_reported_final = max(self.n_reported_final, n_final)
        return offsets

    @property
    def prefilling(self) -> bool:
        return self.n_fed < len(self.prompt)

    def tokens_so_far(self) -> list[int]:
        return self.prompt + self.generated


class Engine:
    """Continuous batching over the KV cache's slots (see the module docstring).

    Collaborators: ``model`` (a :class:`~llama.model.Transformer` with its caches set up),
    ``tokenizer`` (stop tokens, text), ``decode_step`` (the one-token-per-row forward,
    possibly compiled; ``model.decode_logits`` by default), ``generator`` (draws the seeds
    of requests that give none).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        generator: torch.Generator,
        decode_step: Optional[Callable] = None,
        fixed_shape_decode: bool = False,
        prefill_chunk: int = 512,
        max_queue: Optional[int] = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.device
        self.generator = generator
        self.decode_step = decode_step or model.decode_logits
        self.fixed_shape_decode = fixed_shape_decode  # attend to the whole cache every step (compiled steps)
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.max_batch_size = model.params.max_batch_size
        self.max_seq_len = model.params.max_seq_len
        self.scratch = self.max_seq_len  # the KV cache's scratch position: padding goes there
        # Ids the tokenizer cannot turn into text (a checkpoint may pad its vocabulary) are never sampled.
        self.n_tokenizer_ids = min(tokenizer.n_words, model.vocab_size)
        self.first_rank = distributed.model_parallel_rank() == 0
        self.multi_rank = distributed.model_parallel_world_size() > 1

        self._cond = threading.Condition(threading.RLock())
        self._drive = threading.Lock()
        self._ids = itertools.count()
        self._queue: deque[RequestHandle] = deque()  # first rank: submitted, not admitted
        self._local: dict[int, RequestHandle] = {}  # other ranks: submitted here, awaiting the plan
        self._running: dict[int, _Running] = {}  # by slot
        self.cache = model.new_kv_cache(self.max_batch_size)  # one row per slot
        self._slot_tokens: list[list[int]] = [[] for _ in range(self.max_batch_size)]  # what each cache row holds
        self._slot_scope: list[Optional[str]] = [None] * self.max_batch_size  # whose tokens they are
        self._stepping: Optional[int] = None  # the thread running a step, while it runs one
        self._serving = False
        self._failed: Optional[BaseException] = None
        self._counters = dict(requests_total=0, tokens_generated_total=0, prompt_tokens_total=0,
                              cached_prompt_tokens_total=0)

    # -- submitting ----------------------------------------------------------------------

    def check_settings(self, settings: RequestSettings) -> RequestSettings:
        """Type and range checks (ValueError/TypeError); returns the settings normalised."""
        if not isinstance(settings, RequestSettings):
            raise TypeError(f"settings must be a RequestSettings, got {type(settings).__name__}")
        n = settings.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"max_new_tokens must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {n}")
        settings.sampling()  # checks temperature, top_p, top_k
        seed = settings.seed
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
            # Any int: torch's generators take 64 bits, and -1 and 2**64 - 1 seed them alike.
            settings = replace(settings, seed=seed % SEED_MODULUS)
        scope = settings.cache_scope
        if scope is not None and not isinstance(scope, str):
            raise TypeError(f"cache_scope must be a str or None, got {type(scope).__name__}")
        k = settings.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if settings.logits_processor is not None and not callable(settings.logits_processor):
            raise TypeError("logits_processor must be callable as logits_processor(tokens, logits)")
        if settings.stop_tokens is not None:
            settings = replace(settings, stop_tokens=frozenset(settings.stop_tokens))
        return replace(settings, stop=check_stop_strings(settings.stop))

    def check_prompt(self, prompt: Sequence[int], what: str = "prompt") -> list[int]:
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TypeError(f"{what} must be a list of int token ids")
        if not prompt:
            raise ValueError(f"{what} is empty: give at least one token (e.g. BOS)")
        if len(prompt) > self.max_seq_len:
            raise ValueError(
                f"{what} has {len(prompt)} tokens, more than max_seq_len={self.max_seq_len}: "
                "shorten it or build with a larger max_seq_len"
            )
        if not all(0 <= t < self.model.vocab_size for t in prompt):
            raise ValueError(f"{what} holds token ids outside [0, {self.model.vocab_size})")
        return list(prompt)

    def submit(self, prompt_tokens: Sequence[int], settings: RequestSettings,
               on_event: Optional[Callable] = None) -> RequestHandle:
        """Queue a request (thread-safe).  Raises ValueError/TypeError for bad input and
        :class:`EngineBusy` when ``max_queue`` requests already wait for a slot."""
        if self._stepping == threading.get_ident():
            raise RuntimeError(
                "a generation call was made from inside the engine's step (a logits_processor or event "
                "callback calling back into the same Llama): the step cannot wait for itself. Make such "
                "calls before or after generating, or on another Llama"
            )
        prompt = self.check_prompt(prompt_tokens)
        settings = self.check_settings(settings)
        with self._cond:
            if self._failed is not None:
                raise RuntimeError(f"the engine stopped after an error: {self._failed}") from self._failed
            # Requests not yet admitted take free slots at the next step: only those beyond
            # the free slots wait.
            waiting = len(self._queue) - (self.max_batch_size - len(self._running))
            if self.max_queue is not None and waiting >= self.max_queue:
                raise EngineBusy(f"{waiting} requests are already waiting for a slot (max_queue={self.max_queue})")
            handle = RequestHandle(self, next(self._ids), prompt, settings, on_event)
            if self.first_rank:
                self._queue.append(handle)
            else:
                self._local[handle.id] = handle
            self._cond.notify_all()
        return handle

    def stats(self) -> dict:
        with self._cond:
            return dict(queued=len(self._queue), running=len(self._running), slots_in_use=len(self._running),
                        **self._counters)

    # -- driving -------------------------------------------------------------------------

    def _next_event(self, handle: RequestHandle):
        """The handle's next event, driving the engine or waiting for whoever does.
        None once the request has finished; its error is raised."""
        while True:
            with self._cond:
                if handle._events:
                    return handle._events.popleft()
                if handle.finished:
                    if handle._error is not None:
                        raise handle._error
                    return None
                if not self._may_drive() or not self._drive.acquire(blocking=False):
                    self._cond.wait(timeout=0.5)
                    continue
            try:
                self.step()
            finally:
                self._drive.release()

    def _may_drive(self) -> bool:
        """Whether a thread waiting on a request may run steps itself: not while the
        engine is served, and in a multi-rank job only from the main thread (the other
        ranks follow the first rank's steps in one order, which two driving threads on
        the first rank would not keep; there, other threads wait for run_forever)."""
        if self._serving:
            return False
        return not self.multi_rank or threading.current_thread() is threading.main_thread()

    def run_forever(self, should_stop: threading.Event, poll_s: float = 0.1) -> None:
        """Serve: step whenever there is work, until ``should_stop`` is set on the first
        rank.  Call it on every rank's main thread; the other ranks follow the first.
        Requests still queued or running when it stops fail with :class:`EngineStopped`."""
        with self._cond:
            self._serving = True
        try:
            if self.first_rank:
                self._lead(should_stop, poll_s)
            else:
                self._follow()
        finally:
            with self._cond:
                self._serving = False
                self._cond.notify_all()

    def _lead(self, should_stop: threading.Event, poll_s: float) -> None:
        awake = False  # have the other ranks been told that steps are coming?
        while True:
            with self._cond:
                while not (should_stop.is_set() or self._queue or self._running or awake):
                    self._cond.wait(timeout=poll_s)
                has_work = bool(self._queue or self._running)
            if should_stop.is_set():
                if self.multi_rank:
                    if not awake:
                        distributed.share_from_first_rank("wake")
                    self._share_plan(_Plan(shutdown=True))
                self._stop_all()
                return
            if not has_work:
                # Nothing left: the other ranks go back to waiting on the long-timeout group
                # (a follower whose step brings an empty plan and runs nothing is idle).
                if self.multi_rank:
                    self._share_plan(None)
                awake = False
                continue
            if self.multi_rank and not awake:
                distributed.share_from_first_rank("wake")
                awake = True
            with self._drive:
                self.step()

    def _follow(self) -> None:
        while True:
            distributed.share_from_first_rank(None)  # wait (long timeout) until the first rank has work
            while True:
                with self._drive:
                    outcome = self.step()
                if outcome == "idle":
                    break
                if outcome == "shutdown":
                    self._stop_all()
                    return

    def _stop_all(self) -> None:
        error = EngineStopped("the server is shutting down")
        with self._cond:
            for handle in list(self._queue) + list(self._local.values()):
                handle._finish(None, error)
            self._queue.clear()
            self._local.clear()
            for run in list(self._running.values()):
                self._release(run)
                if run.handle is not None:
                    run.handle._finish(None, error)
            self._cond.notify_all()

    # -- one step ------------------------------------------------------------------------

    def step(self) -> str:
        """Admit and cancel (as planned by the first rank), prefill up to ``prefill_chunk``
        prompt tokens, decode one token for every running request, sample, deliver.
        Returns "idle" when a follower was told to wait, "shutdown" when to stop, else "ran"."""
        self._stepping = threading.get_ident()
        try:
            with distributed.explain_peer_failures(), torch.inference_mode():
                plan = self._make_plan() if self.first_rank else None
                if self.multi_rank:
                    plan = self._share_plan(plan)
                if plan.shutdown:
                    return "shutdown"
                if not self.first_rank and not plan and not self._running:
                    return "idle"
                self._apply(plan)
                self._compute()
            return "ran"
        except BaseException as e:
            self._fail_all(e)
            raise
        finally:
            self._stepping = None

    def _share_plan(self, plan: Optional[_Plan]) -> _Plan:
        # Most steps change nothing: one small broadcast says so; a plan's contents only
        # travel when there are some.
        return distributed.broadcast_object_from_first_rank(plan if plan else None) or _Plan()

    def _make_plan(self) -> _Plan:
        plan = _Plan()
        with self._cond:
            for run in self._running.values():
                if run.handle is not None and run.handle.cancel_requested:
                    plan.cancellations.append(run.id)
            kept = deque()
            for handle in self._queue:
                if handle.cancel_requested:  # told to the other ranks too, which match requests by order
                    plan.admissions.append(_Admission(handle.id, -1, 0, handle.prompt_tokens,
                                                      replace(handle.settings, logits_processor=None), cancelled=True))
                    self._local[handle.id] = handle
                else:
                    kept.append(handle)
            self._queue = kept
            free = [s for s in range(self.max_batch_size) if s not in self._running]
            free += [self._running[s].slot for s in self._running if self._running[s].id in plan.cancellations]
            while self._queue and free:
                handle = self._queue.popleft()
                slot, reused = self._choose_slot(handle, free)
                free.remove(slot)
                settings = replace(handle.settings, logits_processor=None)
                plan.admissions.append(_Admission(handle.id, slot, reused, handle.prompt_tokens, settings))
                self._local[handle.id] = handle
            self._cond.notify_all()
        return plan

    def _choose_slot(self, handle: RequestHandle, free: list[int]) -> tuple[int, int]:
        """The free slot whose cache holds the longest prefix of the prompt (and how much
        of it to reuse: all but the prompt's last token, whose logits are needed); when none
        helps, the lowest free slot that holds nothing, else the lowest (keeping the decoded
        rows contiguous while sparing what other slots hold for later requests)."""
        prompt = handle.prompt_tokens
        empty = [slot for slot in free if not self._slot_tokens[slot]]
        best_slot, best = min(empty or free), 0
        if not handle.settings.echo:
            for slot in free:
                if self._slot_scope[slot] != handle.settings.cache_scope:
                    continue
                held = self._slot_tokens[slot]
                n = 0
                for a, b in zip(held, prompt):
                    if a != b:
                        break
                    n += 1
                n = min(n, len(prompt) - 1)
                if n > best:
                    best_slot, best = slot, n
        return best_slot, best

    def _result_of_unstarted(self, handle: RequestHandle) -> RequestResult:
        return RequestResult([], "", [] if handle.settings.logprobs else None, None, "cancelled", None,
                             len(handle.prompt_tokens), 0)

    def _apply(self, plan: _Plan) -> None:
        with self._cond:
            for run in list(self._running.values()):
                if run.id in plan.cancellations:
                    run.finish_reason = "cancelled"
                    self._finish(run)
            for adm in plan.admissions:
                handle = self._local_handle(adm)
                if adm.cancelled:
                    if handle is not None:
                        handle._finish(self._result_of_unstarted(handle), None)
                    continue
                budget = min(adm.settings.max_new_tokens, self.max_seq_len - len(adm.prompt))
                generator = None
                if self.first_rank and not adm.settings.sampling().greedy:
                    seed = adm.settings.seed
                    if seed is None:
                        seed = int(torch.randint(2**62, (1,), generator=self.generator))
                    generator = torch.Generator(device=self.device).manual_seed(seed)
                run = _Running(adm, handle, self.tokenizer, budget, generator)
                self._slot_tokens[adm.slot] = self._slot_tokens[adm.slot][: adm.reused]
                self._slot_scope[adm.slot] = adm.settings.cache_scope
                self._running[adm.slot] = run
                self._counters["requests_total"] += 1
                self._counters["prompt_tokens_total"] += len(adm.prompt)
                self._counters["cached_prompt_tokens_total"] += adm.reused
                if budget == 0 and not run.prompt_logprobs:
                    run.finish_reason = "length"
                    self._finish(run)

    def _local_handle(self, adm: _Admission) -> Optional[RequestHandle]:
        """This rank's handle for a request the first rank admits.  The first rank's own;
        on another rank the oldest request submitted here (every rank makes the same
        calls in the same order), or none when only the first rank has clients (serving)."""
        if self.first_rank:
            return self._local.pop(adm.request_id)
        if not self._local:
            if self._serving:
                return None
            raise RuntimeError(
                "rank 0 started a request this rank never made: under torchrun every rank must make the "
                "same generation calls in the same order"
            )
        handle = self._local.pop(next(iter(self._local)))
        if handle.prompt_tokens != adm.prompt:
            raise RuntimeError(
                "rank 0 and this rank asked for different prompts: under torchrun every rank must make the same "
                "generation calls in the same order, with the same arguments"
            )
        return handle

    def _compute(self) -> None:
        """The forward passes of one step, then sampling and delivery."""
        to_sample: list[tuple[_Running, torch.Tensor]] = []  # (request, its logits row)
        to_sample += self._prefill()
        decoded, decoded_logits = self._decode()
        to_sample += decoded
        if not to_sample:
            return
        runs = [run for run, _ in to_sample]
        if decoded_logits is not None and len(decoded) == len(to_sample):
            logits = decoded_logits  # the decoding step's rows are the requests', in order: no copy
        else:
            logits = torch.stack([row for _, row in to_sample])  # (R, V) float32
        # A failure of one request (logits it cannot be sampled from, its logits processor)
        # ends that request alone; the others go on.  The model's own logits are checked
        # before any masking; every rank holds the same (gathered) ones, so every rank
        # fails the same requests here.
        non_finite = self._non_finite_rows(runs, logits)
        tokens, errors = self._sample(runs, logits, non_finite)
        if self.multi_rank:
            tokens = distributed.broadcast_from_first_rank(tokens)
            errors = self._share_sampling_errors(tokens, non_finite, errors)
        self._deliver(runs, logits, tokens, {**non_finite, **errors})

    def _non_finite_rows(self, runs: list[_Running], logits: torch.Tensor) -> dict[int, BaseException]:
        """The rows (by index) whose logits hold NaN or Inf, with the error each request ends with.
        One host sync for the whole step."""
        suspects = (~torch.isfinite(logits.sum(-1))).nonzero().flatten().tolist()  # overflowed sums too
        errors: dict[int, BaseException] = {}
        for i in suspects:
            run = runs[i]
            try:
                check_finite_logits(logits[i], f"the step choosing token {len(run.generated) + 1} of request {run.id}")
            except NonFiniteError as e:
                errors[i] = e
        return errors

    def _share_sampling_errors(self, tokens: torch.Tensor, non_finite: dict[int, BaseException],
                               errors: dict[int, BaseException]) -> dict[int, BaseException]:
        """The errors of the requests that failed while the first rank sampled (their token is
        :data:`FAILED`), on every rank: the first rank's own, and on the others an error
        carrying the first rank's message.  Every rank finds the same rows, so they all take
        part in the broadcast or none does."""
        failed = [i for i, t in enumerate(tokens.tolist()) if t == FAILED and i not in non_finite]
        if not failed:
            return {}
        sent = {i: f"{type(e).__name__}: {e}" for i, e in errors.items()} if self.first_rank else None
        messages = distributed.broadcast_object_from_first_rank(sent)
        if self.first_rank:
            return errors
        return {i: RuntimeError(f"the request failed on the first rank: {messages.get(i, 'see its log')}")
                for i in failed}

    def _prefill(self) -> list[tuple[_Running, torch.Tensor]]:
        """Feed up to ``prefill_chunk`` prompt tokens, oldest requests first, in one ragged
        forward pass.  Returns the logits of requests whose prompt is now complete (and
        whose budget allows a token)."""
        budget = self.prefill_chunk
        chunks: list[tuple[_Running, int, int]] = []  # (request, start, end) positions fed
        for run in sorted(self._running.values(), key=lambda r: r.id):
            if not run.prefilling or budget == 0:
                continue
            n = min(len(run.prompt) - run.n_fed, budget)
            chunks.append((run, run.n_fed, run.n_fed + n))
            budget -= n
        if not chunks:
            return []
        width = max(end - start for _, start, end in chunks)
        from_start = all(start == 0 for _, start, _ in chunks)
        tokens = torch.zeros((len(chunks), width), dtype=torch.long)
        positions = torch.full((len(chunks), width), self.scratch, dtype=torch.long)
        for i, (run, start, end) in enumerate(chunks):
            tokens[i, : end - start] = torch.tensor(run.prompt[start:end])
            positions[i, : end - start] = torch.arange(start, end)
        if from_start:
            # A new context on every row: plain causal attention over the fed tokens (padding
            # after a short prompt writes future slots of its own row, overwritten before use).
            positions = torch.arange(width).expand(len(chunks), width)
        slots = torch.tensor([run.slot for run, _, _ in chunks])
        kv_len = width if from_start else max(end for _, _, end in chunks)
        hidden = self.model.hidden_states(
            tokens.to(self.device), positions.to(self.device), kv_len, self.cache, from_start=from_start,
            cache_rows=slots.to(self.device),
        )
        out = []
        for i, (run, start, end) in enumerate(chunks):
            if run.prompt_logprobs is not None:
                try:
                    self._score_prompt(run, hidden[i, : end - start], start, end)
                except NonFiniteError as e:  # every rank scores the same logits: all fail it here
                    with self._cond:
                        self._fail(run, e)
                    continue
            run.n_fed = end
            self._slot_tokens[run.slot] = run.prompt[:end]
            if end == len(run.prompt):
                if run.budget == 0:
                    run.finish_reason = "length"
                    with self._cond:
                        self._finish(run)
                else:
                    out.append((run, self.model.logits(hidden[i, end - start - 1])))
        return out

    def _score_prompt(self, run: _Running, hidden: torch.Tensor, start: int, end: int, chunk: int = 256) -> None:
        """Log-probability of prompt tokens start+1..end (within the prompt) given those
        before; logits are made ``chunk`` positions at a time to bound memory."""
        last = min(end, len(run.prompt) - 1)  # position whose successor is the last prompt token scored
        for a in range(start, last, chunk):
            b = min(a + chunk, last)
            logits = self.model.logits(hidden[a - start : b - start])
            check_finite_logits(logits, f"scoring prompt tokens {a + 1}..{b} of request {run.id}")
            log_probs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(run.prompt[a + 1 : b + 1], device=log_probs.device)
            run.prompt_logprobs[a + 1 : b + 1] = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()

    def _decode(self) -> tuple[list[tuple[_Running, torch.Tensor]], Optional[torch.Tensor]]:
        """Feed every running request's last sampled token, one per row.  Rows are the
        cache's slots 0..n-1 (a view of the cache, no copy); a slot in that range with
        nothing to feed gets a padding token at the scratch position.  Returns each
        request's logits row, and the step's (n, V) logits where its rows are exactly those
        rows in that order (else None): a batch of 8 saves copying 4 MB a step."""
        feeding = [run for run in self._running.values() if run.pending is not None]
        if not feeding:
            return [], None
        n = 1 + max(run.slot for run in feeding)
        if self.fixed_shape_decode:  # few distinct shapes for a compiled step: 1, 2, 4, 8 ... rows
            n = min(self.max_batch_size, 1 << (n - 1).bit_length())
        tokens = torch.zeros((n, 1), dtype=torch.long)
        positions = torch.full((n, 1), self.scratch, dtype=torch.long)
        for run in feeding:
            tokens[run.slot, 0] = run.pending
            positions[run.slot, 0] = run.n_fed
        kv_len = self.max_seq_len if self.fixed_shape_decode else 1 + max(run.n_fed for run in feeding)
        logits = self.decode_step(tokens.to(self.device), positions.to(self.device), kv_len, self.cache)  # (n, V)
        out = []
        for run in feeding:
            run.n_fed += 1
            self._slot_tokens[run.slot].append(run.pending)
            run.pending = None
            out.append((run, logits[run.slot]))
        in_order = [run.slot for run in feeding] == list(range(logits.shape[0]))
        return out, (logits if in_order else None)

    def _sample(self, runs: list[_Running], logits: torch.Tensor,
                non_finite: dict[int, BaseException]) -> tuple[torch.Tensor, dict[int, BaseException]]:
        """Each request's next token (R,), on the first rank (others get zeros, then the
        first rank's choice), and the errors of the requests that failed while sampling
        (their logits processor raised or returned unusable logits).  Those, and the rows in
        ``non_finite``, get the token :data:`FAILED`."""
        if self.n_tokenizer_ids < logits.shape[-1]:
            logits[:, self.n_tokenizer_ids :] = float("-inf")
        errors: dict[int, BaseException] = {}
        if not self.first_rank:
            return torch.zeros(len(runs), dtype=torch.long, device=logits.device), errors
        for i, run in enumerate(runs):
            if run.processor is not None and i not in non_finite:
                try:
                    logits[i : i + 1] = self._processed(run, logits[i : i + 1])
                except Exception as e:  # the caller's code: its error is that request's alone
                    errors[i] = e
        tokens = greedy_tokens(logits)
        for i, run in enumerate(runs):
            if i in non_finite or i in errors:
                tokens[i] = FAILED
            elif not run.sampling.greedy:
                try:
                    tokens[i] = sample_next_token(logits[i : i + 1], run.sampling, run.generator)[0]
                except (ValueError, RuntimeError) as e:
                    errors[i] = e
                    tokens[i] = FAILED
        return tokens, errors

    @staticmethod
    def _processed(run: _Running, row: torch.Tensor) -> torch.Tensor:
        """``run``'s logits processor applied to its logits ``row`` (1, V), checked: the same
        shape, no NaN or +inf, and at least one token left possible."""
        history = torch.tensor([run.tokens_so_far()], device=row.device)
        out = run.processor(history, row.clone())
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(row.shape):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"logits_processor must return a tensor of the logits' shape {tuple(row.shape)}, got {got}")
        if not (out.is_floating_point() and out.device == row.device):
            raise ValueError(f"logits_processor must return floating-point logits on {row.device}, "
                             f"got {out.dtype} on {out.device}")
        if bool(torch.isnan(out).any() | (out == float("inf")).any()):
            raise ValueError("logits_processor returned NaN or +inf logits: mask tokens with -inf, never NaN")
        if not bool(torch.isfinite(out).any()):
            raise ValueError("logits_processor set every logit to -inf: leave at least one token possible")
        return out

    def _deliver(self, runs: list[_Running], logits: torch.Tensor, tokens: torch.Tensor,
                 errors: dict[int, BaseException]) -> None:
        want_lp = [i for i, run in enumerate(runs)
                   if (run.settings.logprobs or run.settings.top_logprobs) and i not in errors]
        log_probs = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
        token_list = tokens.tolist()
        lp_rows = {i: j for j, i in enumerate(want_lp)}
        default_stops = self.tokenizer.stop_tokens
        with self._cond:
            for i, run in enumerate(runs):
                if i in errors:
                    self._fail(run, errors[i])
                    continue
                stop_tokens = default_stops if run.settings.stop_tokens is None else run.settings.stop_tokens
                token = token_list[i]
                self._counters["tokens_generated_total"] += 1
                if token in stop_tokens:
                    run.stop_token, run.finish_reason = token, "stop"
                    self._finish(run)
                    continue
                lp = top = None
                if i in lp_rows:
                    row = log_probs[lp_rows[i]]
                    lp = float(row[token])
                    if run.settings.top_logprobs:
                        values, ids = torch.topk(row, run.settings.top_logprobs)
                        top = list(zip(ids.tolist(), values.tolist()))
                run.generated.append(token)
                if run.settings.logprobs:
                    run.logprobs.append(lp)
                text = run.assembler.push(token)
                if run.handle is not None:
                    run.handle._emit(TokenEvent(token, text, lp, top, run.newly_final(run.assembler.n_final)))
                if run.assembler.stopped:
                    run.finish_reason = "stop"
                    self._finish(run)
                elif len(run.generated) >= run.budget:
                    run.finish_reason = "length"
                    self._finish(run)
                else:
                    run.pending = token
            self._cond.notify_all()

    def _finish(self, run: _Running) -> None:
        """End a request (under the lock): free its slot, deliver its result."""
        self._release(run)
        if run.handle is None:
            return
        tail = run.assembler.finish()
        n_tokens = run.assembler.tokens_before_stop() if run.assembler.stopped else len(run.generated)
        final = run.newly_final(n_tokens)
        if tail or final:
            run.handle._emit(TokenEvent(None, tail, final_offsets=final))
        result = RequestResult(
            tokens=run.generated[:n_tokens],
            text=run.assembler.text,
            logprobs=run.logprobs[:n_tokens] if run.settings.logprobs else None,
            prompt_logprobs=run.prompt_logprobs,
            finish_reason=run.finish_reason or "length",
            stop_token=run.stop_token,
            n_prompt_tokens=len(run.prompt),
            n_cached_prompt_tokens=run.reused,
            all_tokens=list(run.generated),
            text_offsets=[run.assembler.token_start(k) for k in range(n_tokens)],
        )
        run.handle._finish(result)
        self._cond.notify_all()

    def _release(self, run: _Running) -> None:
        if self._running.get(run.slot) is run:
            del self._running[run.slot]

    def _fail(self, run: _Running, error: BaseException) -> None:
        """End one request with ``error`` (under the lock); the others go on.  Its slot's cache
        is not reused (its logits may have come from non-finite keys and values)."""
        self._release(run)
        self._slot_tokens[run.slot] = []
        logger.info("request %d failed: %s", run.id, error)
        if run.handle is not None and not run.handle.finished:
            run.handle._finish(None, error)
        self._cond.notify_all()

    def _fail_all(self, error: BaseException) -> None:
        """A step failed (a peer died, a collective timed out, bad logits): every request
        in flight gets the error; the cache's contents are no longer trusted."""
        with self._cond:
            if not isinstance(error, Exception):  # KeyboardInterrupt and the like
                error = RuntimeError(f"generation was interrupted ({type(error).__name__})")
            for run in list(self._running.values()):
                self._release(run)
                if run.handle is not None and not run.handle.finished:
                    run.handle._finish(None, error)
            self._slot_tokens = [[] for _ in range(self.max_batch_size)]
            if self.multi_rank:
                # The ranks may now disagree on what happened: nothing further can be trusted.
                self._failed = error
                for handle in list(self._queue) + list(self._local.values()):
                    handle._finish(None, error)
                self._queue.clear()
                self._local.clear()
            self._cond.notify_all()
