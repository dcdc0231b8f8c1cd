"""What the generating endpoints share: the model served, the checks of a request against
it, the engine settings of each choice, and submitting them together.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar, Union, cast

from fastapi import Request

from llama.runtime.daemon_pool import DaemonPool
from llama.serve import openai_api as oa
from llama.serve.auth import cache_scope
from llama.serve.errors import busy, client_gone, compilers_busy, failure, shutting_down
from llama.serve.limits import MediaLimits
from llama.serve.metrics import ServerMetrics
from llama.serve.protocols import ServedModel
from llama.serve.requests import Choice, ClientGone, RequestGroup, disconnected
from llama.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llama.engine import RequestResult, RequestSettings
    from llama.images.prompt import PromptImage

AnyRequest = Union[oa.CompletionRequest, oa.ChatCompletionRequest]
T = TypeVar("T")
logger = logging.getLogger(__name__)


# Threads compiling grammars (each compile is bounded in time and first tried in a worker
# process: llama.structured.compiler), and most compiles in flight (running or waiting for
# a thread) before a request with a new grammar is answered 429.
COMPILE_THREADS = 4
MAX_COMPILES = 16


class OpenAIServing:
    """The model behind the endpoints, and the request handling both generating endpoints share.

    ``max_queue``: most requests left waiting once max_batch_size run (None: no limit);
    ``shared_prefix_cache``: requests of different API keys may share cached prompt prefixes;
    ``accepting``: False once the server shuts down (a request that got past the gate before
    is refused when it would submit); ``media``: the limits on a chat request's images
    (:class:`~llama.serve.limits.MediaLimits`); ``request_timeout_s``: the deadline of a request
    that gives no ``timeout``, and the most one may give (None: none).
    """

    def __init__(self, llama: ServedModel, model_name: str, metrics: ServerMetrics, *,
                 max_queue: Optional[int] = None, shared_prefix_cache: bool = False,
                 tool_prompt_format: Optional[str] = None, accepting: Callable[[], bool] = lambda: True,
                 media: Optional[MediaLimits] = None, request_timeout_s: Optional[float] = None) -> None:
        self.engine = llama.engine
        self.request_timeout_s = request_timeout_s
        self.tokenizer = llama.tokenizer
        self.formatter = llama.formatter
        self.model_name = model_name
        # The LoRA adapters the engine serves unmerged (llama.engine.lora), by the name a request's
        # ``model`` gives (as vLLM's --lora-modules), with the folder each came from
        lora = getattr(self.engine, "lora", None)
        self.adapters: dict[str, str] = dict(lora.paths) if lora is not None else {}
        self.metrics = metrics
        self.max_queue = max_queue
        self.shared_prefix_cache = shared_prefix_cache
        # How tools are declared and calls written: the model's own unless told (ValueError if it has no such form).
        self.tool_prompt_format = llama.formatter.check_tool_prompt_format(tool_prompt_format)
        self.accepting = accepting
        self.media = media if media is not None else MediaLimits()  # where images come from, how many, how large
        self.created = int(time.time())
        # Compiles response formats and tool choices and keeps the last ones, by tenant scope and JSON.
        self.structured = llama.structured
        # Grammars compile on threads of their own, never on asyncio's default pool, which parses
        # and tokenises every request: a slow grammar delays no other request's tokens.
        self._compile_threads = DaemonPool(COMPILE_THREADS, "grammar-compile")
        self._compiles = 0  # in flight: submitted and not finished (an abandoned one until it stops)
        self._compiles_lock = threading.Lock()
        longest = longest_token_chars(self.tokenizer)
        # No longer text can fit the context: each token stands for at most `longest` characters.
        self.max_prompt_chars = None if longest is None else self.engine.max_seq_len * longest

    # -- checks --

    def check_request(self, req: AnyRequest, n_generations: int) -> None:
        """What can be checked of a request before its prompts are tokenised (besides its
        model): its stop strings, and whether its ``n_generations`` could ever be taken."""
        req.stop_strings()
        self.check_capacity(n_generations)

    def check_model(self, name: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's ``model`` picks: None for the base's name (or none given),
        the adapter's name for an adapter's; 404 (OpenAI's ``model_not_found``) for any other."""
        if name is None or name == self.model_name:
            return None
        if name in self.adapters:
            return name
        served = ", ".join(repr(n) for n in [self.model_name, *self.adapters])
        raise oa.APIError(
            404, f"the model {name!r} does not exist; this server serves {served}",
            param="model", code="model_not_found",
        )

    def check_context(self, n_prompt: int, max_tokens: int, param: str) -> None:
        max_seq_len = self.engine.max_seq_len
        if n_prompt + max_tokens > max_seq_len:
            raise oa.APIError(
                400,
                f"this model's maximum context length is {max_seq_len} tokens; the request has "
                f"{n_prompt} prompt tokens and asks for {max_tokens} more: shorten the prompt or lower {param}",
                param=param, code="context_length_exceeded",
            )

    def check_text_length(self, n_chars: int, param: str) -> None:
        """400 for prompt text too long for any tokenisation of it to fit the context: the
        cheap check made before tokenising (which takes time in proportion)."""
        if self.max_prompt_chars is not None and n_chars > self.max_prompt_chars:
            raise oa.APIError(
                400, f"the {param} has {n_chars} characters; this model's maximum context length is "
                     f"{self.engine.max_seq_len} tokens, which no text of more than {self.max_prompt_chars} "
                     f"characters fits: shorten the {param}", param=param, code="context_length_exceeded")

    def check_capacity(self, n_requests: int) -> None:
        """400 for a request whose engine requests (``n`` per prompt) could never all be taken,
        not even by an idle server: retrying it (as a 429 would invite) never helps."""
        if self.max_queue is None:
            return
        capacity = self.engine.max_batch_size + self.max_queue
        if n_requests > capacity:
            raise oa.APIError(
                400, f"this request needs {n_requests} generations (n x prompts) at once, more than this server "
                     f"ever holds ({self.engine.max_batch_size} running + {self.max_queue} queued): lower n or send "
                     "fewer prompts per request", param="n", code="too_many_generations")

    def scope(self, req: AnyRequest, request: Request) -> Optional[str]:
        """The request's tenant scope (:func:`~llama.serve.auth.cache_scope`): its API key, unless
        keys share the prefix cache, and its ``cache_salt``.  What one scope has cached (prompt
        prefixes, compiled grammars) no request of another scope reuses, nor can time."""
        api_key = None if self.shared_prefix_cache else getattr(request.state, "api_key", None)
        return cache_scope(api_key, req.cache_salt)

    def grammar(self, req: AnyRequest, request: Request):
        """The request's ``response_format`` compiled (None: free text); 400 naming the field
        where it cannot be.  Kept compiled by the structured-output manager (clients repeat
        their formats), by exact JSON within the request's tenant scope."""
        return self._or_400("response_format", lambda: self.structured.response_format(
            req.response_format, scope=self.scope(req, request)))

    def tool_grammar(self, req: oa.ChatCompletionRequest, request: Request):
        """The grammar of a chat reply that ``tool_choice`` constrains to calls of the request's
        tools ("required" or a named function; None otherwise), kept as response formats are;
        400 naming ``tools`` where a function's schema cannot be followed."""
        return self._or_400("tools", lambda: self.structured.tool_choice(
            req.tools, req.tool_choice, self.tool_prompt_format, req.parallel_tool_calls,
            scope=self.scope(req, request)))

    @staticmethod
    def _or_400(param: str, compile: Callable[[], object]):
        try:
            return compile()
        except ValueError as e:
            raise oa.APIError(400, str(e), param=param) from None

    async def compiled(self, compile: Callable[[], T], request: Request) -> T:
        """``compile()`` (:meth:`grammar` or :meth:`tool_grammar`) run on the grammar threads, off
        the event loop and off the pool that tokenises.  429 when :data:`MAX_COMPILES` are in
        flight or the grammar compilers stay busy; when the client goes away meanwhile, the
        compile is abandoned (its worker process killed, its result never made) and the
        request answered 499."""
        from llama.structured.compiler import CompileAbandoned, GrammarCompilerBusy, abandon_when

        with self._compiles_lock:
            if self._compiles >= MAX_COMPILES:
                raise compilers_busy(f"{self._compiles} grammars are being compiled")
            self._compiles += 1
        abandon = threading.Event()

        def run() -> T:
            try:
                with abandon_when(abandon):
                    return compile()
            finally:
                with self._compiles_lock:
                    self._compiles -= 1

        future = asyncio.get_running_loop().run_in_executor(self._compile_threads, run)
        future.add_done_callback(_retrieve)
        gone = asyncio.ensure_future(disconnected(request))
        try:
            waits: set[asyncio.Future] = {future, gone}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if future not in done:
                abandon.set()
                logger.info("client went away: abandoning the compile of its grammar")
                raise client_gone()
            return future.result()
        except (asyncio.CancelledError, GeneratorExit):
            abandon.set()
            raise
        except GrammarCompilerBusy as e:
            raise compilers_busy(str(e)) from None
        except CompileAbandoned:
            raise client_gone() from None
        finally:
            gone.cancel()  # the request's channel is the endpoint's again

    def timeout_s(self, req: AnyRequest) -> Optional[float]:
        """The request's deadline in seconds: its ``timeout``, at most the server's
        ``request_timeout_s`` (which a request that gives none gets)."""
        given = None if req.timeout is None else float(req.timeout)
        if given is None or self.request_timeout_s is None:
            return given if given is not None else self.request_timeout_s
        return min(given, self.request_timeout_s)

    # -- engine requests --

    def settings(self, req: AnyRequest, request: Request, max_tokens: int, choice: int, *, logprobs: bool,
                 top_logprobs: int, echo: bool, stop_tokens: Optional[frozenset] = None,
                 text_follows_prompt: bool = False, grammar=None, lora: Optional[str] = None) -> RequestSettings:
        """The engine settings of choice ``choice`` (seeded with ``seed + choice``), with the LoRA
        adapter ``lora`` (None: the base)."""
        from llama.engine import RequestSettings

        try:
            return RequestSettings(
                max_new_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
                top_k=req.top_k, seed=None if req.seed is None else req.seed + choice,
                stop=req.stop_strings(), logprobs=logprobs, top_logprobs=top_logprobs, echo=echo,
                stop_tokens=stop_tokens, text_follows_prompt=text_follows_prompt,
                cache_scope=self.scope(req, request), grammar=grammar, speculative=req.speculative,
                priority=req.priority, timeout_s=self.timeout_s(req),
                lora=lora,
            )
        except (TypeError, ValueError) as e:
            raise oa.APIError(400, str(e)) from None

    def submit_all(self, prompts: Sequence[list[int]], make_settings: Callable[[int], RequestSettings], *,
                   images: Sequence[PromptImage] = ()) -> RequestGroup:
        """Submit one engine request per prompt (all or none): 429 when the queue cannot take
        them, 400 when the engine refuses one.  ``images``: the prompts' images (every prompt is
        the same chat prompt when there are any), handed to the engine with each."""
        from llama.engine import EngineBusy, EngineStopped

        engine = self.engine
        if not self.accepting():
            raise shutting_down()
        if self.max_queue is not None:
            stats = engine.stats()
            free_slots = engine.max_batch_size - stats["slots_in_use"]
            if stats["queued"] + len(prompts) - free_slots > self.max_queue:
                raise busy()
        group = RequestGroup(engine, self.metrics)
        try:
            for i, tokens in enumerate(prompts):
                group.submit(tokens, make_settings(i), images)
        except EngineBusy:
            group.cancel()
            raise busy() from None
        except EngineStopped:  # an engine process that died (llama.serve.engine_process): 503, as while stopping
            group.cancel()
            raise shutting_down() from None
        except (TypeError, ValueError) as e:
            group.cancel()
            raise oa.APIError(400, str(e)) from None
        return group

    async def results(self, group: RequestGroup, request: Request) -> list[Choice]:
        """Every choice, finished; an engine failure as an :class:`~llama.serve.openai_api.APIError`,
        and so a client that went away (its requests cancelled): status 499, which the access log
        and the metrics count, with an answer no one reads."""
        try:
            return await group.results(request)
        except ClientGone:
            raise client_gone() from None
        except Exception as e:
            raise failure(e) from e


def _retrieve(future: asyncio.Future) -> None:
    """Retrieve a compile's outcome, so that an abandoned one's error is not logged as never retrieved."""
    if not future.cancelled():
        future.exception()


def usage(choices: list[Choice], n_per_prompt: int) -> dict:
    """OpenAI's ``usage`` of the choices (each prompt counted once); of a choice that has not
    finished (a stream cut short), the tokens generated so far."""
    prompt = sum(len(c.prompt_tokens) for c in choices[::n_per_prompt])
    completion = sum(len(c.result.tokens) if c.result is not None else len(c.events) for c in choices)
    # Prompt tokens found in the prefix cache (each prompt counted once, as its first choice had them).
    cached = sum(c.result.n_cached_prompt_tokens for c in choices[::n_per_prompt] if c.result is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def kept_events(choice: Choice) -> list:
    """The token events of the tokens the result kept (a stop string cuts some)."""
    return choice.events[: len(cast("RequestResult", choice.result).tokens)]  # asked of finished choices


def finish_reason(result: RequestResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


# A text whose decoded tokens do not give it back (a SentencePiece model that normalises
# Unicode or collapses spaces) may take fewer tokens than characters over the longest token.
_ROUND_TRIP_PROBE = "a  \t\n  b e\u0301 \ufb01 \u1100\u1161 \u00e9"


@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer: Tokenizer) -> Optional[int]:
    """The most characters of text one token stands for (a SentencePiece piece's characters,
    a byte-level token's bytes), or None where text is normalised before it is split (then
    no such bound holds).  Read from the whole vocabulary (0.2 s for 128k tokens), once."""
    from llama.tokenizer import SentencePieceTokenizer

    if tokenizer.decode(tokenizer.encode(_ROUND_TRIP_PROBE, bos=False, eos=False)) != _ROUND_TRIP_PROBE:
        return None
    by_chars = isinstance(tokenizer, SentencePieceTokenizer)
    longest = 1
    for token in range(tokenizer.n_words):
        text, raw = oa.token_piece(tokenizer, token)
        longest = max(longest, len(text) if by_chars else len(raw))
    return longest
