"""The FastAPI application: the OpenAI-compatible endpoints over the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Sequence

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response
    from sse_starlette import EventSourceResponse
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"the server needs its extra packages ({e.name} is missing): pip install 'llama[serve]'") from e

from llama.serve import openai_api as oa
from llama.engine.detokenize import prompt_text, prompt_text_offsets
from llama.formats.tool_prompts import declared_tool_names
from llama.serve.metrics import ServerMetrics
from llama.serve.requests import Choice, RequestGroup


logger = logging.getLogger(__name__)
CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"


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
    from llama.engine import EngineBusy, RequestSettings

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

    def submit_all(group: RequestGroup, prompts: Sequence[list[int]], make_settings: Callable[[int], Any]) -> None:
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
        from llama.engine import EngineStopped

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

    def kept_events(choice: Choice) -> list:
        """The token events of the tokens the result kept (a stop string cuts some)."""
        return choice.events[: len(choice.result.tokens)]

    def usage(choices: list[Choice], n_per_prompt: int) -> dict:
        prompt = sum(len(c.prompt_tokens) for c in choices[::n_per_prompt])
        completion = sum(len(c.result.tokens) for c in choices if c.result is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- endpoints --


    def sse(endpoint: str, group: "RequestGroup", bodies, usage_chunk) -> EventSourceResponse:
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
        group = RequestGroup(engine, metrics)
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
        group = RequestGroup(engine, metrics)
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
    from llama.generation import assistant_reply

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
