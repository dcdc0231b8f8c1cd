"""A request as the engine sees it: its settings, the events and result it produces, the
handle its caller holds, and the state the engine keeps while it runs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Optional, Protocol, Sequence, cast

import torch

from llama.engine.detokenize import TextAssembler, check_stop_strings
from llama.engine.sampling import SamplingParams
from llama.engine.speculative import Acceptance
from llama.runtime.options import MAX_TOP_LOGPROBS
from llama.structured import Grammar, GrammarMatcher
from llama.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llama.images.prompt import PromptImage

logger = logging.getLogger(__name__)

# (tokens so far (1, L), logits (1, V)) -> the logits to choose from, as in Meta's reference generate
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SEED_MODULUS = 2**64  # seeds are reduced to the range torch's generators take
PROMPT_CONTEXT_TOKENS = 4  # prompt tokens decoded with the text that follows them (a character's bytes)


class EngineBusy(RuntimeError):
    """The engine's wait queue is full (``max_queue``): try again later."""


class EngineStopped(RuntimeError):
    """The engine was shut down before the request finished."""


@dataclass(frozen=True)
class RequestSettings:
    """How one request is generated.  Checked by :meth:`checked` (which ``Engine.submit`` calls)."""

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
    logits_processor: Optional[LogitsProcessor] = None
    stop_tokens: Optional[frozenset[int]] = None  # token ids that end the request (None: the tokenizer's)
    # Requests reuse cached prompt prefixes only from requests of the same scope (None is a
    # scope too): a server gives each tenant its own, so no tenant can probe another's prompts.
    cache_scope: Optional[str] = None
    # Constrains the reply to a grammar (llama.structured.compile_response_format); None: free text.
    grammar: Optional[Grammar] = None
    # Whether it may propose tokens where the engine speculates (llama.engine.speculative); a
    # request with a grammar does too, its proposals cut where the grammar forbids them.  The
    # tokens and their distribution are the same either way: False only saves the work of
    # checking proposals.
    speculative: bool = True
    # Waiting requests start in order of priority, lower first (vLLM's convention), then of
    # arrival; when blocks run short the lowest priority (then the latest) is preempted first.
    priority: int = 0
    # Seconds from submission after which the request is ended at the next step, its blocks
    # freed (finish_reason "timeout"); None: no deadline.
    timeout_s: Optional[float] = None
    # The LoRA adapter it is generated with (a name the engine was built with: Llama.build's
    # lora_adapters); None: the base model.
    lora: Optional[str] = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)

    @property
    def prefix_scope(self) -> Hashable:
        """What the prefix cache keys its blocks by besides their tokens: the cache scope and,
        with an adapter, the adapter (a block computed under one adapter holds other keys and
        values than under another, or the base: it is never shared with them)."""
        return self.cache_scope if self.lora is None else (self.cache_scope, "lora", self.lora)

    def checked(self) -> "RequestSettings":
        """These settings type- and range-checked (ValueError/TypeError), normalised: the seed
        reduced modulo 2**64, stop strings and stop tokens as tuples and frozensets."""
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"max_new_tokens must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {n}")
        self.sampling()  # checks temperature, top_p, top_k
        settings = self
        seed = self.seed
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
            # Any int: torch's generators take 64 bits, and -1 and 2**64 - 1 seed them alike.
            settings = replace(settings, seed=seed % SEED_MODULUS)
        if self.cache_scope is not None and not isinstance(self.cache_scope, str):
            raise TypeError(f"cache_scope must be a str or None, got {type(self.cache_scope).__name__}")
        if self.lora is not None and not isinstance(self.lora, str):
            raise TypeError(f"lora must be an adapter's name (a str) or None, got {type(self.lora).__name__}")
        k = self.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise TypeError("logits_processor must be callable as logits_processor(tokens, logits)")
        if self.stop_tokens is not None:
            settings = replace(settings, stop_tokens=frozenset(self.stop_tokens))
        if not isinstance(self.speculative, bool):
            raise TypeError(f"speculative must be True or False, got {type(self.speculative).__name__}")
        p = self.priority
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"priority must be an int (lower runs first), got {type(p).__name__}")
        t = self.timeout_s
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                raise TypeError(f"timeout_s must be a number of seconds or None, got {type(t).__name__}")
            if not (t > 0 and math.isfinite(t)):
                raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {t!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TypeError("grammar must be a compiled grammar (llama.structured.compile_response_format) or None, "
                            f"got {type(self.grammar).__name__}")
        return replace(settings, stop=check_stop_strings(self.stop))


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
    finish_reason: str  # "stop" (stop token or string), "length", "cancelled" or "timeout" (past its timeout_s)
    stop_token: Optional[int]  # the stop token that ended the request, if one did
    n_prompt_tokens: int
    n_cached_prompt_tokens: int  # prompt tokens reused from the prefix cache, not prefilled
    all_tokens: list[int] = field(default_factory=list)  # every generated token (stop string included)
    text_offsets: list[int] = field(default_factory=list)  # where each of ``tokens`` starts in ``text``
    queue_time_s: Optional[float] = None  # from its submission to its start (None: it never started)


class _Driver(Protocol):
    """What a handle needs of its engine."""

    lock: threading.Condition

    def next_event(self, handle: "RequestHandle") -> Optional[TokenEvent]: ...


class RequestHandle:
    """A submitted request: iterate :meth:`events`, wait for :meth:`result`, or :meth:`cancel`."""

    def __init__(self, engine: _Driver, request_id: int, prompt: list[int], settings: RequestSettings,
                 on_event: Optional[Callable], images: tuple["PromptImage", ...] = ()) -> None:
        self.engine = engine
        self.id = request_id
        self.prompt_tokens = prompt
        self.images = images  # the prompt's images, in prompt order
        self.settings = settings
        self._on_event = on_event
        self._events: deque = deque()
        self._result: Optional[RequestResult] = None
        self._error: Optional[BaseException] = None
        self.cancel_requested = False
        self.finished = False
        self.submitted_at = time.monotonic()
        self.started_at: Optional[float] = None  # when the engine first gave it blocks (the first rank's)
        # When the first rank ends it, running or not (settings.timeout_s); None: never.
        self.deadline = None if settings.timeout_s is None else self.submitted_at + settings.timeout_s

    def started(self) -> None:
        """The engine started it (it is admitted; a preempted request that resumes is not new)."""
        if self.started_at is None:
            self.started_at = time.monotonic()

    def queue_time_s(self) -> Optional[float]:
        """Seconds from its submission to its start (None: not started)."""
        return None if self.started_at is None else self.started_at - self.submitted_at

    def expired(self, now: float) -> bool:
        """Whether its deadline has passed at ``now`` (``time.monotonic()``)."""
        return self.deadline is not None and now >= self.deadline

    def cancel(self) -> None:
        """Stop generating at the next step boundary and give its blocks back (thread-safe)."""
        with self.engine.lock:
            self.cancel_requested = True
            self.engine.lock.notify_all()

    def events(self) -> Iterator[TokenEvent]:
        """The request's tokens as they are generated; blocks; raises the request's error."""
        while True:
            item = self.engine.next_event(self)
            if item is None:
                return
            yield item

    def result(self) -> RequestResult:
        """Block until the request has finished and return its result."""
        for _ in self.events():
            pass
        if self._result is None:  # a finished request has a result or raised its error above
            raise RuntimeError(f"request {self.id} finished without a result")
        return self._result

    # -- called by the engine, under its lock --------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether :meth:`take_event` has something to say: an event waits, or the request has
        finished."""
        return bool(self._events) or self.finished

    def take_event(self) -> Optional[TokenEvent]:
        """The next event; None once the request has finished and every event was taken; the
        request's error raised once it failed.  (Only when :attr:`ready`.)"""
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        return None

    def emit(self, event: TokenEvent) -> None:
        """Deliver ``event``: to the ``on_event`` callback, and to :meth:`events`."""
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:  # a listener's bug must not stop the engine
                logger.exception("on_event callback of request %d failed", self.id)
        self._events.append(event)

    def finish(self, result: RequestResult) -> None:
        """The request ended with ``result``."""
        self._end(result, None)

    def fail(self, error: BaseException) -> None:
        """The request ended with ``error``, raised to whoever waits on it."""
        self._end(None, error)

    def _end(self, result: Optional[RequestResult], error: Optional[BaseException]) -> None:
        self._result, self._error = result, error
        self.finished = True
        if self._on_event is not None:
            try:
                self._on_event(error if error is not None else result)
            except Exception:
                logger.exception("on_event callback of request %d failed", self.id)


@dataclass
class Admission:
    """What the first rank tells the others about a request it admits."""

    request_id: int
    prompt: list[int]
    settings: RequestSettings  # without the logits processor and the grammar (not shareable)
    cancelled: bool = False  # cancelled while queued: every rank just ends it (no blocks)
    expired: bool = False  # ... for being past its deadline while queued (its result says "timeout")
    constrained: bool = False  # it has a grammar (the first rank's alone)
    # The prompt's images (pixel values and where their patches go): every rank runs the
    # vision encoder, so every rank gets them with the admission.
    images: tuple["PromptImage", ...] = ()


def keyed_tokens(tokens: Sequence[int], images: Sequence["PromptImage"]) -> Sequence[Any]:
    """``tokens`` as the prefix cache keys them: each token from an image's
    ``<|image_start|>`` to its ``<|image_end|>`` paired with the image's digest, so that a
    block holding an image's positions is shared only with a prompt of the same text and the
    same image (the same ``<|patch|>`` ids stand for any image); the others as they are."""
    if not images:
        return tokens
    out: list[Any] = list(tokens)
    for image in images:
        digest = image.digest
        for p in range(image.start, min(image.end, len(out))):
            out[p] = (out[p], digest)
    return out


class RunningRequest:
    """The engine's state of an admitted request, the same on every rank (the first rank's
    alone holds the caller's logits processor and the seeded generator).

    Its progress (what the cache holds of it, its tokens, its end) changes only through its
    own methods, which the scheduler alone calls (:meth:`Scheduler.update_from_output
    <llama.engine.scheduler.Scheduler.update_from_output>`); every other unit reads it.  Its
    blocks are the KV-cache manager's books (:mod:`llama.engine.kv_cache_manager`), kept
    under its id."""

    def __init__(self, adm: Admission, handle: Optional[RequestHandle], tokenizer: Tokenizer,
                 budget: int, generator: Optional[torch.Generator], matcher: Optional[GrammarMatcher] = None) -> None:
        self.id = adm.request_id
        self.prompt = adm.prompt
        self.images = adm.images  # the prompt's images (the runner encodes them when it prefills their positions)
        self.settings = adm.settings
        self.handle = handle
        self.processor = handle.settings.logits_processor if handle is not None else None
        self.sampling = adm.settings.sampling()
        self.generator = generator
        self.matcher = matcher  # where a constrained reply stands in its grammar (first rank only)
        self.constrained = adm.constrained or matcher is not None  # it has a grammar (every rank knows)
        # the token ids that end it
        self.stop_token_ids = tokenizer.stop_tokens if adm.settings.stop_tokens is None else adm.settings.stop_tokens
        self.n_fed = 0  # tokens of prompt + generated whose K/V are in the cache
        self.reused = 0  # prompt tokens found in the prefix cache when it started
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
        self.speculation = Acceptance()  # how its proposals fared (llama.engine.speculative)

    # -- reading it --------------------------------------------------------------------------

    def context(self) -> list[int]:
        """The tokens whose K/V the cache must hold before the next token is sampled or fed:
        the prompt, and after a preemption (:mod:`llama.engine.scheduler`) what it had
        generated but its last sampled token, which the next decoding step feeds."""
        if not self.generated:
            return self.prompt
        return self.prompt + (self.generated[:-1] if self.pending is not None else self.generated)

    def context_length(self) -> int:
        """``len(self.context())``."""
        return len(self.prompt) + max(0, len(self.generated) - (self.pending is not None))

    @property
    def prefilling(self) -> bool:
        return self.n_fed < self.context_length()

    def tokens_so_far(self) -> list[int]:
        return self.prompt + self.generated

    def cache_keyed(self, tokens: list[int]) -> Sequence[Any]:
        """``tokens`` (its context or tokens so far) as the prefix cache keys them
        (:func:`keyed_tokens`: its images' positions carry their digests)."""
        return keyed_tokens(tokens, self.images) if self.images else tokens

    # -- its progress (the scheduler's calls) ------------------------------------------------

    def placed(self, n_cached: int, *, first: bool = False) -> None:
        """It holds blocks (it starts, or resumes after a preemption), the first ``n_cached``
        tokens of its context found in the prefix cache; ``first``: when it starts (they
        count as reused)."""
        self.n_fed = n_cached
        if first:
            self.reused = n_cached

    def evicted(self) -> None:
        """Its blocks were taken back (it is preempted): it keeps its tokens, not their K/V."""
        self.n_fed = 0

    def fed_context(self, end: int) -> None:
        """Its context's tokens up to ``end`` are in the cache (a prompt chunk was fed)."""
        self.n_fed = end

    def fed_pending(self) -> None:
        """Its pending token is in the cache (a decoding step fed it)."""
        self.n_fed += 1
        self.pending = None

    def fed_proposals(self, n: int) -> None:
        """The first ``n`` tokens proposed after its pending token, fed with it, are in the
        cache: they were accepted and kept (the rest of what that step wrote is not)."""
        self.n_fed += n

    def speculated(self, state: Acceptance) -> None:
        """How its proposals fared so far, after a step verified some."""
        self.speculation = state

    def scored_prompt(self, first: int, values: list[float]) -> None:
        """The log-probabilities of prompt tokens ``first`` .. ``first + len(values) - 1``."""
        cast(list[float], self.prompt_logprobs)[first : first + len(values)] = values  # scored: asked for

    def append_token(self, token: int, logprob: Optional[float]) -> str:
        """Keep a generated token (not a stop token), with its log-probability where asked;
        the text it releases (the assembler says whether a stop string ended it)."""
        self.generated.append(token)
        if self.settings.logprobs:
            self.logprobs.append(cast(float, logprob))  # given where asked for
        return self.assembler.push(token)

    def feed_next(self, token: int) -> None:
        """``token`` (its last) is fed by the next decoding step."""
        self.pending = token

    def end(self, reason: str, stop_token: Optional[int] = None) -> None:
        """It ends: ``reason`` is its finish reason; ``stop_token``, the token that ended it."""
        self.finish_reason = reason
        if stop_token is not None:
            self.stop_token = stop_token

    # -- what its caller has been told (the output processor's calls) -------------------------

    def newly_final(self, n_final: int) -> tuple[int, ...]:
        """The text offsets of the tokens final now that were not before (see TokenEvent)."""
        offsets = tuple(self.assembler.token_start(k) for k in range(self.n_reported_final, n_final))
        self.n_reported_final = max(self.n_reported_final, n_final)
        return offsets
