"""Every failure as an OpenAI error object: the application's exception handlers, and the
errors the endpoints share (a full queue, a request that failed in the engine).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llama.serve.metrics import ServerMetrics
from llama.serve.openai_api import APIError, validation_error

logger = logging.getLogger(__name__)


def error_response(metrics: ServerMetrics, endpoint: str, e: APIError) -> JSONResponse:
    """The error's JSON answer, counted in the request metrics."""
    metrics.requests.labels(endpoint, str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Answer :class:`APIError`, request validation errors, the framework's own HTTP errors
    (404 for an unknown route, 405 for a wrong method, ...) and anything unexpected (500) with
    OpenAI error objects."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(metrics, request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(metrics, request.url.path, validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(metrics, request.url.path, http_error(request, e))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("error answering %s", request.url.path)
        return error_response(metrics, request.url.path, APIError(500, f"internal error: {e}", type="server_error"))


def http_error(request: Request, e: StarletteHTTPException) -> APIError:
    """The framework's HTTP error as ours, in words a client can act on."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        message = (f"no such route: {where} (the API is under /v1: /v1/models, /v1/completions, /v1/chat/completions, "
                   "/v1/responses; and /tokenize, /detokenize)")
        return APIError(404, message, code="not_found")
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow") or ""
        return APIError(405, f"method not allowed: {where} (allowed: {allowed or 'none'})", code="method_not_allowed",
                        headers=dict(e.headers or {}))
    return APIError(e.status_code, f"{where}: {e.detail}", headers=dict(e.headers or {}))


def busy() -> APIError:
    """429: the queue is full (the client should retry)."""
    return APIError(
        429, "the server's queue is full; retry shortly", type="rate_limit_error", code="queue_full",
        headers={"Retry-After": "1"},
    )


def compilers_busy(why: str) -> APIError:
    """429: too many grammars are being compiled (the client should retry)."""
    return APIError(429, f"the server is busy compiling grammars ({why}); retry shortly", type="rate_limit_error",
                    code="grammar_compilers_busy", headers={"Retry-After": "1"})


def failure(e: BaseException) -> APIError:
    """The error of a request the engine failed: 503 while shutting down, 400 naming the field
    for a grammar too slow to follow, else 500."""
    from llama.engine import EngineStopped
    from llama.engine.sampler import GrammarTooSlow
    from llama.serve.requests import RequestTimedOut

    if isinstance(e, RequestTimedOut):
        return timed_out(e)
    if isinstance(e, EngineStopped):  # (its own message says the same: one message, not two)
        return shutting_down()
    if isinstance(e, GrammarTooSlow):
        return APIError(400, str(e), param=e.param, code="grammar_too_slow")
    return APIError(500, f"generation failed: {e}", type="server_error")


def timed_out(e: Exception) -> APIError:
    """504: the request ran past its deadline and was ended (its blocks freed).  Marked not to be
    retried (``x-should-retry: false``, which OpenAI's clients honour): the same request would
    run out of time again."""
    return APIError(504, f"{e}: it was ended; give a longer 'timeout' (the server's --request_timeout_s caps it) or "
                         "ask for fewer tokens", type="timeout_error", code="request_timeout",
                    headers={"x-should-retry": "false"})


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


def client_gone() -> APIError:
    """499 (nginx's "client closed request"): the client went away before its answer was ready."""
    return APIError(499, "the client closed the connection before its answer was ready: its requests were cancelled",
                    code="client_closed_request")
