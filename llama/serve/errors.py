"""Every failure as an OpenAI error object: the application's exception handlers, and the
errors the endpoints share (a full queue, a request that failed in the engine).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from llama.serve.metrics import ServerMetrics
from llama.serve.openai_api import APIError

logger = logging.getLogger(__name__)


def error_response(metrics: ServerMetrics, endpoint: str, e: APIError) -> JSONResponse:
    """The error's JSON answer, counted in the request metrics."""
    metrics.requests.labels(endpoint, str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Answer :class:`APIError`, request validation errors and anything unexpected (500) with
    OpenAI error objects."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(metrics, request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(metrics, request.url.path, validation_error(e))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("error answering %s", request.url.path)
        return error_response(metrics, request.url.path, APIError(500, f"internal error: {e}", type="server_error"))


def validation_error(e: RequestValidationError) -> APIError:
    """A 400 naming the first field pydantic refused (or the JSON error)."""
    first = e.errors()[0] if e.errors() else {}
    # The field's path, without pydantic's union-member tags ("int", "list[str]", ...).
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON: " + first.get("ctx", {}).get("error", ""))
    param = ".".join(loc) or None
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)


def _is_union_tag(loc: object) -> bool:
    return isinstance(loc, str) and (loc in {"int", "float", "str", "bool", "none"} or "[" in loc or "-" in loc)


def busy() -> APIError:
    """429: the queue is full (the client should retry)."""
    return APIError(
        429, "the server's queue is full; retry shortly", type="rate_limit_error", code="queue_full",
        headers={"Retry-After": "1"},
    )


def failure(e: BaseException) -> APIError:
    """The error of a request the engine failed: 503 while shutting down, else 500."""
    from llama.engine import EngineStopped

    if isinstance(e, EngineStopped):
        return APIError(503, f"the server is shutting down: {e}", type="server_error", code="shutting_down")
    return APIError(500, f"generation failed: {e}", type="server_error")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
