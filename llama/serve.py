"""An OpenAI-compatible HTTP server in front of the model-parallel ranks.

    python -m llama.serve                                        # the bundled demo model on 127.0.0.1:8000
    torchrun --nproc_per_node 2 -m llama.serve --ckpt_dir Meta-Llama-3-8B-Instruct/ --port 8000

Every rank loads its share of the model and runs the engine's loop on its main thread
(``engine.run_forever``); the first rank also runs the HTTP server (uvicorn, in a thread),
turns requests into engine requests and streams their tokens back.  The other ranks never
see a client: they follow the first rank's plan for each step.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
with ``stream``: server-sent events ending in ``data: [DONE]``), ``GET /health``,
``GET /metrics`` (Prometheus) and ``GET /`` (a chat page).

Faults: a full queue answers 429 with ``Retry-After``; a client that goes away cancels its
requests; if a step fails (a rank died or hung) the requests in flight get an error and every
process exits non-zero; SIGTERM/SIGINT stop accepting, end the requests in flight and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Collection, Optional, Sequence

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response
    from sse_starlette import EventSourceResponse
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"the server needs its extra packages ({e.name} is missing): pip install 'llama[serve]'") from e

from . import openai_api as oa
from .cli import add_model_flags, model_options
from .streaming import prompt_text, prompt_text_offsets
from .tool_prompts import declared_tool_names

logger = logging.getLogger("llama.serve")  # not "__main__" under python -m

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"
# After SIGTERM/SIGINT a process that has not left by itself within this many seconds is ended.
SHUTDOWN_DEADLINE_S = 25.0
# How often a non-streaming request checks that its client is still connected.
DISCONNECT_POLL_S = 0.25


# -- metrics -------------------------------------------------------------------------------


class ServerMetrics:
    """The Prometheus metrics of one server (its own registry, so tests can build several)."""

    def __init__(self, engine: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llama_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("llama_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("llama_generation_tokens", "Tokens generated for clients", registry=r)
        self.cached_prompt_tokens = Counter(
            "llama_cached_prompt_tokens", "Prompt tokens reused from a slot's cache (not prefilled)", registry=r
        )
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.time_to_first_token = Histogram(
            "llama_time_to_first_token_seconds", "From submission to the first token", buckets=latency_buckets,
            registry=r,
        )
        self.tokens_per_second = Histogram(
            "llama_request_tokens_per_second", "Decoding speed of each request after its first token",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r,
        )
        stats = engine.stats
        Gauge("llama_queue_depth", "Requests waiting for a slot", registry=r).set_function(lambda: stats()["queued"])
        Gauge("llama_slots_in_use", "KV-cache slots held by requests", registry=r).set_function(
            lambda: stats()["slots_in_use"]
        )
        Gauge("llama_slots_total", "KV-cache slots (max_batch_size)", registry=r).set(engine.max_batch_size)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# -- engine requests seen from asyncio -----------------------------------------------------


@dataclass
class _Choice:
    """One engine request: one choice of one prompt."""

    index: int
    prompt_tokens: list[int]
    handle: Any = None
    events: list = field(default_factory=list)
    result: Any = None
    submitted_at: float = 0.0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    n_reported: int = 0  # tokens whose log-probabilities a stream has sent

    def newly_final(self, item: Any) -> list[tuple[Any, int]]:
        """(token event, text offset) of the tokens ``item`` says became final (a stream
        reports log-probabilities for those only: what the finished request keeps)."""
        start = self.n_reported
        self.n_reported += len(item.final_offsets)
        return list(zip(self.events[start : self.n_reported], item.final_offsets))


class _RequestGroup:
    """The engine requests behind one HTTP request (``n`` choices of each prompt).

    The engine calls ``on_event`` from its stepping thread; the events are handed to the
    event loop with ``call_soon_threadsafe`` and read back in order with :meth:`items`.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.pending = 0

    def submit(self, prompt_tokens: list[int], settings: Any) -> None:
        choice = _Choice(index=len(self.choices), prompt_tokens=prompt_tokens, submitted_at=time.perf_counter())

        def on_event(item: Any, choice: _Choice = choice) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice, item))
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        choice.handle = self.engine.submit(prompt_tokens, settings, on_event)
        self.choices.append(choice)
        self.pending += 1

    async def items(self) -> AsyncIterator[tuple[_Choice, Any]]:
        """(choice, TokenEvent) for each token, then (choice, RequestResult) when it ends; raises
        the first request error (after cancelling the others)."""
        from .engine import RequestResult

        while self.pending:
            choice, item = await self.queue.get()
            now = time.perf_counter()
            if isinstance(item, BaseException):
                self.pending -= 1
                self.cancel()
                raise item
            if isinstance(item, RequestResult):
                self.pending -= 1
                choice.result = item
                self._record(choice, item)
            elif item.token is not None:  # (the last event may carry only held-back text)
                if choice.first_token_at is None:
                    choice.first_token_at = now
                    self.metrics.time_to_first_token.observe(now - choice.submitted_at)
                choice.last_token_at = now
                choice.events.append(item)
            yield choice, item

    async def results(self, request: Any) -> list[_Choice]:
        """Wait for every choice to finish; cancel them all if the client goes away."""
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            async for _ in self.items():
                pass
        finally:
            watcher.cancel()
        return self.choices

    async def _watch_disconnect(self, request: Any) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                logger.info("client went away: cancelling %d request(s)", len(self.choices))
                self.cancel()
                return

    def cancel(self) -> None:
        for choice in self.choices:
            if choice.handle is not None and not choice.handle.finished:
                choice.handle.cancel()

    def _record(self, choice: _Choice, result: Any) -> None:
        m = self.metrics
        m.prompt_tokens.inc(result.n_prompt_tokens)
        m.cached_prompt_tokens.inc(result.n_cached_prompt_tokens)
        m.generation_tokens.inc(len(result.tokens))
        n = len(choice.events)
        if n > 1 and choice.last_token_at > choice.first_token_at:
            m.tokens_per_second.observe((n - 1) / (choice.last_token_at - choice.first_token_at))


# -- the application -------------------------------------------------------------------------


def create_app(llama: Any, model_name: str, max_queue: Optional[int] = None, *,
               api_keys: Sequence[str] = (), shared_prefix_cache: bool = False):
    """The FastAPI application serving ``llama`` (anything with ``engine``, ``tokenizer`` and
    ``formatter`` attributes: a :class:`llama.Llama`).

    ``max_queue``: most requests left waiting once every free slot is taken; a request that
    would exceed it answers 429 (so does the engine's own ``EngineBusy``).  Requests that
    arrive together while slots are free are not counted against it, although the engine
    queues them all until its next step.

    ``api_keys``: when given, every ``/v1/*`` and ``/metrics`` request must carry
    ``Authorization: Bearer KEY`` with one of them (else 401).  Cached prompt prefixes are
    then shared only among requests of the same key (:func:`cache_scope`), unless
    ``shared_prefix_cache``; a request's ``cache_salt`` narrows its scope further.
    """
    from .engine import EngineBusy, RequestSettings

    keys = [key.encode("utf-8") for key in api_keys]
    engine = llama.engine
    tokenizer = llama.tokenizer
    metrics = ServerMetrics(engine)
    created = int(time.time())
    app = FastAPI(title="llama", description="OpenAI-compatible Llama server", docs_url="/docs", redoc_url=None)
    app.state.metrics = metrics
    app.state.accepting = True

    def error_response(endpoint: str, e: oa.APIError) -> JSONResponse:
        metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(oa.APIError)
    async def _api_error(request: Request, e: oa.APIError):
        return error_response(request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        # The field's path, without pydantic's union-member tags ("int", "list[str]", ...).
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON: " + first.get("ctx", {}).get("error", ""), None
        else:
            param = ".".join(loc) or None
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(request.url.path, oa.APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("error answering %s", request.url.path)
        return error_response(request.url.path, oa.APIError(500, f"internal error: {e}", type="server_error"))

    # -- helpers over the request schemas --

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != model_name:
            raise oa.APIError(
                404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                param="model", code="model_not_found",
            )

    def check_context(n_prompt: int, max_tokens: int, param: str) -> None:
        if n_prompt + max_tokens > engine.max_seq_len:
            raise oa.APIError(
                400,
                f"this model's maximum context length is {engine.max_seq_len} tokens; the request has "
                f"{n_prompt} prompt tokens and asks for {max_tokens} more: shorten the prompt or lower {param}",
                param=param, code="context_length_exceeded",
            )

    def settings(req: Any, request: Request, max_tokens: int, choice: int, *, logprobs: bool, top_logprobs: int,
                 echo: bool, stop_tokens: Optional[frozenset] = None, text_follows_prompt: bool = False):
        try:
            return RequestSettings(
                max_new_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
                top_k=req.top_k, seed=None if req.seed is None else req.seed + choice,
                stop=req.stop_strings(), logprobs=logprobs, top_logprobs=top_logprobs, echo=echo,
                stop_tokens=stop_tokens, text_follows_prompt=text_follows_prompt,
                cache_scope=cache_scope(getattr(request.state, "api_key", None) if not shared_prefix_cache else None,
                                        req.cache_salt),
            )
        except (TypeError, ValueError) as e:
            raise oa.APIError(400, str(e)) from None

    def submit_all(group: _RequestGroup, prompts: Sequence[list[int]], make_settings: Callable[[int], Any]) -> None:
        if max_queue is not None:
            stats = engine.stats()
            free_slots = engine.max_batch_size - stats["slots_in_use"]
            if stats["queued"] + len(prompts) - free_slots > max_queue:
                raise busy()
        try:
            for i, tokens in enumerate(prompts):
                group.submit(tokens, make_settings(i))
        except EngineBusy:
            group.cancel()
            raise busy() from None
        except (TypeError, ValueError) as e:
            group.cancel()
            raise oa.APIError(400, str(e)) from None

    def busy() -> oa.APIError:
        return oa.APIError(
            429, "the server's queue is full; retry shortly", type="rate_limit_error", code="queue_full",
            headers={"Retry-After": "1"},
        )

    def failure(e: BaseException) -> oa.APIError:
        from .engine import EngineStopped

        if isinstance(e, EngineStopped):
            return oa.APIError(503, f"the server is shutting down: {e}", type="server_error", code="shutting_down")
        return oa.APIError(500, f"generation failed: {e}", type="server_error")

    def logprob_entries(events: list, with_top: bool) -> list[dict]:
        """Chat-style logprobs: one entry per generated token."""
        entries = []
        for ev in events:
            text, raw = oa.token_piece(tokenizer, ev.token)
            entry = {"token": text, "logprob": ev.logprob, "bytes": list(raw), "top_logprobs": []}
            if with_top and ev.top_logprobs:
                for tok, lp in ev.top_logprobs:
                    t, b = oa.token_piece(tokenizer, tok)
                    entry["top_logprobs"].append({"token": t, "logprob": lp, "bytes": list(b)})
            entries.append(entry)
        return entries

    def completion_logprobs(events: list, offsets: Sequence[int], n_top: int,
                            prompt: Optional[tuple] = None) -> dict:
        """Completions-style logprobs: parallel lists (the prompt's tokens first when echoed,
        ``prompt`` = (tokens, logprobs, offsets)); ``text_offset`` is where each token's text
        starts in the choice's text."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt is not None:
            for i, (tok, lp, offset) in enumerate(zip(*prompt)):
                out["tokens"].append(oa.token_piece(tokenizer, tok)[0])
                out["token_logprobs"].append(None if i == 0 else lp)
                out["top_logprobs"].append(None)
                out["text_offset"].append(offset)
        for ev, offset in zip(events, offsets):
            out["tokens"].append(oa.token_piece(tokenizer, ev.token)[0])
            out["token_logprobs"].append(ev.logprob)
            out["top_logprobs"].append(
                {oa.token_piece(tokenizer, t)[0]: lp for t, lp in (ev.top_logprobs or [])[:n_top]} if n_top else None
            )
            out["text_offset"].append(offset)
        return out

    def kept_events(choice: _Choice) -> list:
        """The token events of the tokens the result kept (a stop string cuts some)."""
        return choice.events[: len(choice.result.tokens)]

    def usage(choices: list[_Choice], n_per_prompt: int) -> dict:
        prompt = sum(len(c.prompt_tokens) for c in choices[::n_per_prompt])
        completion = sum(len(c.result.tokens) for c in choices if c.result is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- endpoints --


    def sse(endpoint: str, group: "_RequestGroup", bodies, usage_chunk) -> EventSourceResponse:
        """A streamed answer as server-sent events: each body as one ``data:`` event, the
        usage chunk when asked for, an OpenAI error object if the request fails part-way,
        then ``[DONE]``.  A client that goes away cancels its requests (status 499)."""

        async def events():
            try:
                async for body in bodies:
                    yield {"data": json.dumps(body)}
                if usage_chunk is not None:
                    yield {"data": json.dumps(usage_chunk())}
                metrics.requests.labels(endpoint, "200").inc()
            except BaseException as e:
                group.cancel()
                if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                    metrics.requests.labels(endpoint, "499").inc()
                    raise
                err = failure(e)
                metrics.requests.labels(endpoint, str(err.status)).inc()
                yield {"data": json.dumps(err.body())}
            yield {"data": "[DONE]"}

        return EventSourceResponse(events(), ping=15)

    @app.middleware("http")
    async def _gate(request: Request, call_next):
        """API keys on ``/v1/*`` and ``/metrics``; 503 on ``/v1/*`` once shutting down."""
        path = request.url.path
        if keys and (path.startswith("/v1/") or path == "/metrics"):
            key = _bearer_token(request.headers.get("authorization"))
            # compare_digest: the time taken does not tell how much of a guess was right.
            if key is None or not any(hmac.compare_digest(key, k) for k in keys):
                return error_response(path, oa.APIError(
                    401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                    type="invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            request.state.api_key = key
        if not app.state.accepting and path.startswith("/v1/"):
            return error_response(
                path, oa.APIError(503, "the server is shutting down", type="server_error", code="shutting_down"),
            )
        return await call_next(request)

    @app.get("/health")
    async def health():
        # Up or not, nothing more: counters (cached prompt tokens above all) would let one client
        # learn about another's requests.  Operators read /metrics, behind the API key.
        if not app.state.accepting:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/")
    async def chat_page():
        return FileResponse(CHAT_PAGE, media_type="text/html")

    @app.get("/v1/models")
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "llama",
                      "max_model_len": engine.max_seq_len}],
        }

    @app.post("/v1/completions")
    async def completions(req: oa.CompletionRequest, request: Request):
        check_model(req.model)
        prompts: list[list[int]] = []
        texts: list[Optional[str]] = []
        for i, p in enumerate(req.prompts()):
            if isinstance(p, str):
                prompts.append(tokenizer.encode(p, bos=True, eos=False))
                texts.append(p)
            else:
                if not p:
                    raise oa.APIError(400, f"prompt {i} is an empty list of token ids", param="prompt")
                prompts.append(list(p))
                texts.append(None)
        max_tokens = req.max_tokens
        for tokens in prompts:
            check_context(len(tokens), max_tokens, "max_tokens")
        n = req.n
        n_top = req.logprobs or 0
        want_logprobs = req.logprobs is not None
        if req.echo and req.stream and want_logprobs:
            raise oa.APIError(400, "echo with logprobs is not supported when streaming", param="echo")
        group = _RequestGroup(engine, metrics)
        expanded = [tokens for tokens in prompts for _ in range(n)]
        submit_all(group, expanded, lambda i: settings(
            req, request, max_tokens, i % n, logprobs=want_logprobs, top_logprobs=n_top, echo=req.echo and want_logprobs,
            text_follows_prompt=req.echo))
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def echo_text(i: int) -> str:
            """What an echo shows of choice ``i``'s prompt, as text_completion(echo=True) does;
            the completion's text continues it (RequestSettings.text_follows_prompt)."""
            return prompt_text(tokenizer, prompts[i // n])

        if req.stream:
            async def chunks():
                if req.echo:
                    for i in range(len(expanded)):
                        yield _completion_chunk(rid, now, model_name, i, echo_text(i), None)
                async for choice, item in group.items():
                    if choice.result is item:
                        yield _completion_chunk(rid, now, model_name, choice.index, "", _finish_reason(item))
                        continue
                    final = choice.newly_final(item)
                    lp = None
                    if want_logprobs and final:
                        echoed = len(echo_text(choice.index)) if req.echo else 0
                        lp = completion_logprobs([ev for ev, _ in final], [echoed + o for _, o in final], n_top)
                    if item.text or lp is not None:
                        yield _completion_chunk(rid, now, model_name, choice.index, item.text, None, lp)

            def usage_chunk() -> dict:
                return {"id": rid, "object": "text_completion", "created": now, "model": model_name, "choices": [],
                        "usage": usage(group.choices, n)}

            return sse("/v1/completions", group, chunks(), usage_chunk if req.include_usage else None)

        try:
            choices = await group.results(request)
        except Exception as e:
            raise failure(e) from e
        body_choices = []
        for c in choices:
            r = c.result
            prefix = echo_text(c.index) if req.echo else ""
            lp = None
            if want_logprobs:
                prompt = None
                if req.echo and r.prompt_logprobs is not None:
                    prompt = (c.prompt_tokens, r.prompt_logprobs, prompt_text_offsets(tokenizer, c.prompt_tokens))
                lp = completion_logprobs(kept_events(c), [len(prefix) + o for o in r.text_offsets], n_top, prompt)
            body_choices.append({"index": c.index, "text": prefix + r.text, "logprobs": lp,
                                 "finish_reason": _finish_reason(r)})
        metrics.requests.labels("/v1/completions", "200").inc()
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                "choices": body_choices, "usage": usage(choices, n)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: oa.ChatCompletionRequest, request: Request):
        check_model(req.model)
        dialog = req.dialog()
        try:
            prompt = encode_chat(llama, dialog, req.tools)
        except (TypeError, ValueError) as e:
            raise oa.APIError(400, str(e), param="messages") from None
        limit = req.token_limit()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if limit is None:
            if len(prompt) >= engine.max_seq_len:
                check_context(len(prompt), 1, param)
            limit = engine.max_seq_len - len(prompt)
        check_context(len(prompt), limit, param)
        n = req.n
        n_top = req.top_logprobs or 0
        group = _RequestGroup(engine, metrics)
        # The chat format's end-of-reply tokens (<|eot_id|>, <|eom_id|> after a tool call, ...).
        reply_ends = getattr(llama.formatter, "stop_tokens", None)
        submit_all(group, [prompt] * n, lambda i: settings(
            req, request, limit, i, logprobs=req.logprobs, top_logprobs=n_top, echo=False, stop_tokens=reply_ends))
        parse_tools = bool(req.tools)
        declared = declared_tool_names(req.tools)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if req.stream:
            def chunk(index: int, delta: dict, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
                body = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
                if req.include_usage:
                    body["usage"] = None
                return body

            async def chunks():
                for i in range(n):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
                async for choice, item in group.items():
                    if choice.result is item:
                        if parse_tools:  # the reply was held back: it may be a tool call
                            message, finish = openai_reply(llama.formatter, item, declared)
                            delta = {k: v for k, v in message.items() if k != "role" and v}
                            if "tool_calls" in delta:
                                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(delta["tool_calls"])]
                            if delta:
                                yield chunk(choice.index, delta, None)
                        else:
                            finish = _finish_reason(item)
                        yield chunk(choice.index, {}, finish)
                    elif not parse_tools:
                        final = choice.newly_final(item)
                        lp = ({"content": logprob_entries([ev for ev, _ in final], n_top > 0)}
                              if req.logprobs and final else None)
                        if item.text or lp is not None:
                            yield chunk(choice.index, {"content": item.text}, None, lp)

            def usage_chunk() -> dict:
                return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                        "choices": [], "usage": usage(group.choices, n)}

            return sse("/v1/chat/completions", group, chunks(), usage_chunk if req.include_usage else None)

        try:
            choices = await group.results(request)
        except Exception as e:
            raise failure(e) from e
        body_choices = []
        for c in choices:
            lp = {"content": logprob_entries(kept_events(c), n_top > 0)} if req.logprobs else None
            message, finish = openai_reply(llama.formatter, c.result, declared)
            body_choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
        metrics.requests.labels("/v1/chat/completions", "200").inc()
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": body_choices, "usage": usage(choices, n)}

    return app


def encode_chat(llama: Any, dialog: list[dict], tools: Optional[list[dict]]) -> list[int]:
    """A chat request's prompt tokens, through the model's chat format (which declares the
    OpenAI-shaped ``tools`` for Llama 3.1+ and refuses them for older formats)."""
    if tools:
        try:
            return llama.formatter.encode_dialog_prompt(dialog, tools=tools)
        except (TypeError, ValueError) as e:
            raise oa.APIError(400, str(e), param="tools") from None
    return llama.formatter.encode_dialog_prompt(dialog)


def openai_reply(formatter: Any, result: Any, tools: Collection[str]) -> tuple[dict, str]:
    """The response message and finish_reason of a chat result.  Tool calls are read from the
    reply's token ids (:func:`llama.generation.assistant_reply`): only calls of the request's
    ``tools`` make ``tool_calls`` (finish_reason ``"tool_calls"``); a reply cut by max_tokens is
    ``"length"`` with its text as content."""
    if not tools:
        return {"role": "assistant", "content": result.text}, _finish_reason(result)
    from .generation import assistant_reply

    message = assistant_reply(formatter, result, tools)
    if not message["tool_calls"]:
        return {"role": "assistant", "content": message["content"]}, _finish_reason(result)
    return ({"role": "assistant", "content": message["content"] or None,
             "tool_calls": oa.openai_tool_calls(message["tool_calls"])}, "tool_calls")


def _bearer_token(header: Optional[str]) -> Optional[bytes]:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    if not header:
        return None
    scheme, _, key = header.partition(" ")
    return key.strip().encode("utf-8") if scheme.lower() == "bearer" and key.strip() else None


def cache_scope(api_key: Optional[bytes], cache_salt: Optional[str]) -> Optional[str]:
    """The engine's ``cache_scope`` of a request: requests share cached prompt prefixes only
    within one scope.  The key enters as a hash (the scope travels to every rank)."""
    parts = []
    if api_key is not None:
        parts.append("key:" + hashlib.sha256(api_key).hexdigest()[:32])
    if cache_salt is not None:
        parts.append("salt:" + hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:32])
    return "/".join(parts) or None


def _is_union_tag(loc: object) -> bool:
    return isinstance(loc, str) and (loc in {"int", "float", "str", "bool", "none"} or "[" in loc or "-" in loc)


def _finish_reason(result: Any) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish: Optional[str],
                      logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


# -- running it under torchrun -----------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a busy port fails at once.

    ``RuntimeError`` says which flag to change: ``--port`` for a port in use or one
    that needs privileges, ``--host`` for a name that does not resolve or an address
    this machine does not have."""
    import errno

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be a port number from 1 to 65535 (or 0: any free port), got {port!r}")
    where = f"cannot listen on {host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (socket.gaierror, UnicodeError) as e:  # a name the resolver does not know, or not a name at all
        sock.close()
        reason = e.strerror if isinstance(e, socket.gaierror) else "not a valid host name"
        raise RuntimeError(f"{where}: --host {host} does not resolve to an address ({reason}): check --host") from None
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            advice = "another program is listening there: pick another --port"
        elif e.errno == errno.EACCES:
            advice = "ports below 1024 need privileges: pick another --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            advice = (f"{host} is not an address of this machine: check --host (127.0.0.1: this machine only; "
                      "0.0.0.0: all its addresses)")
        else:
            advice = "check --host and --port"
        raise RuntimeError(f"{where} ({e.strerror}): {advice}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(llama: Any, sock: Optional[socket.socket], model_name: str, max_queue: Optional[int] = None, *,
          api_keys: Sequence[str] = (), shared_prefix_cache: bool = False) -> int:
    """Run the engine on this rank's main thread until SIGTERM/SIGINT or a failure; the rank given
    ``sock`` also answers HTTP on it.  Returns the exit status (0 after a signal, 1 after a failure)."""
    import uvicorn

    engine = llama.engine
    stop = threading.Event()
    failed = threading.Event()
    server = http_thread = app = None
    if sock is not None:
        app = create_app(llama, model_name, max_queue=max_queue, api_keys=api_keys,
                         shared_prefix_cache=shared_prefix_cache)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="off")
        server = uvicorn.Server(config)

        def run_http() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException:
                logger.exception("the HTTP server failed")
            if not stop.is_set():  # the server ended without being asked: stop the job
                failed.set()
                stop.set()

        http_thread = threading.Thread(target=run_http, name="http", daemon=True)
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d (chat page at /, OpenAI API under /v1)", model_name, host, port)

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            return
        logger.info("%s: finishing the requests in flight and exiting", signal.Signals(signum).name)
        begin_shutdown()

    def begin_shutdown() -> None:
        if app is not None:
            app.state.accepting = False
        if server is not None:
            server.should_exit = True
        stop.set()
        deadline = threading.Timer(SHUTDOWN_DEADLINE_S, _exit_now, args=(1, "shutdown took too long"))
        deadline.daemon = True
        deadline.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if http_thread is not None:
        http_thread.start()
    code = 0
    try:
        engine.run_forever(stop)
    except BaseException as e:  # a failed step: a rank died, a collective timed out
        logger.error("the engine stopped on an error, exiting: %s", e)
        code = 1
        begin_shutdown()
    if failed.is_set():
        code = 1
    if http_thread is not None:
        http_thread.join(timeout=10)
    return code


def _exit_now(code: int, why: str) -> None:
    logger.error("%s: exiting now", why)
    logging.shutdown()
    os._exit(code)


def _parser() -> argparse.ArgumentParser:
    from .cli import Parser, port

    p = Parser(  # a bad flag is one line, as in the other commands
        prog="llama-serve",
        description="Serve a Llama checkpoint over an OpenAI-compatible HTTP API "
        "(run it under torchrun for several model-parallel processes).",
    )
    p.add_argument("--ckpt_dir", help="Meta-format checkpoint directory (default: the bundled demo model)")
    p.add_argument("--tokenizer_path", help="tokenizer.model (default: the one in --ckpt_dir)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=port, default=8000,
                   help="port to listen on, 1..65535, or 0 for any free one (default %(default)s)")
    p.add_argument("--max_batch_size", type=int, default=8, help="requests decoded together (KV-cache slots)")
    p.add_argument("--max_seq_len", type=int, default=2048, help="longest prompt + generation per request")
    p.add_argument("--max_queue", type=int, default=64, help="requests waiting for a slot before 429 answers")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: CUDA if available)")
    p.add_argument("--model_name", help="the model id clients name (default: the checkpoint directory's name)")
    p.add_argument("--api_key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics; repeat for several keys "
                        "(default: the comma-separated keys in LLAMA_API_KEY, else none: anyone may call)")
    p.add_argument("--shared_prefix_cache", action="store_true",
                   help="let requests of different API keys reuse each other's cached prompt prefixes (faster for "
                        "a shared system prompt, but a client can then tell from timing whether another key's "
                        "prompt started the same way); default: each key its own")
    add_model_flags(p)
    return p


def api_keys_from(flags: Optional[Sequence[str]], environ: dict = os.environ) -> list[str]:
    """The keys ``--api_key`` gives, else those of ``LLAMA_API_KEY`` (comma-separated).
    A key must be non-empty printable ASCII without spaces or commas (it travels in a header)."""
    keys = list(flags) if flags else [k.strip() for k in environ.get("LLAMA_API_KEY", "").split(",") if k.strip()]
    for key in keys:
        if not key or not key.isascii() or not key.isprintable() or any(c in key for c in " ,"):
            raise ValueError("an API key must be printable ASCII without spaces or commas (--api_key / LLAMA_API_KEY)")
    return keys


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("max_batch_size", "max_seq_len", "max_queue"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1")
    api_keys = api_keys_from(args.api_key)
    from .examples import is_first_rank, resolve_checkpoint, setup_logging
    from .generation import Llama

    setup_logging()
    if args.ckpt_dir and not Path(args.ckpt_dir).is_dir():
        raise FileNotFoundError(f"checkpoint directory {args.ckpt_dir} not found: check --ckpt_dir")
    if not args.ckpt_dir and not DEMO_DIR.is_dir():
        raise FileNotFoundError(f"the bundled demo model ({DEMO_DIR}) comes with a source checkout: pass --ckpt_dir")
    ckpt, tokenizer_path = resolve_checkpoint(args.ckpt_dir, args.tokenizer_path, DEMO_DIR)
    sock = bind_socket(args.host, args.port) if is_first_rank() else None
    llama = Llama.build(
        ckpt_dir=ckpt, tokenizer_path=tokenizer_path, max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size, device=args.device, **model_options(args),
    )
    if not api_keys and is_first_rank():
        logger.warning("no API key set (--api_key or LLAMA_API_KEY): anyone who can reach %s:%d may use this "
                       "server and read /metrics", args.host, args.port)
    return serve(llama, sock, args.model_name or ckpt.resolve().name, max_queue=args.max_queue,
                 api_keys=api_keys, shared_prefix_cache=args.shared_prefix_cache)


def cli() -> None:
    """The ``llama-serve`` console script, run as the example scripts are
    (:func:`llama.examples.run_script`): a bad flag, checkpoint or environment found before
    serving (Llama.build's errors, a port in use) ends in one line ``llama-serve: error:
    ...`` and status 1, Ctrl-C while the model loads in one line and status 130."""
    from .examples import run_script

    run_script("llama-serve", main)


if __name__ == "__main__":
    cli()
