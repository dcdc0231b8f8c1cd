"""Streamed answers as server-sent events, the one way both endpoints stream.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from llama.serve.errors import failure
from llama.serve.finite_json import dumps
from llama.serve.metrics import ServerMetrics
from llama.serve.requests import RequestGroup

# Seconds between keep-alive comments on a quiet stream (a long prefill, a full batch).
PING_S = 15


def sse(metrics: ServerMetrics, endpoint: str, request: Request, group: RequestGroup, bodies: AsyncIterator[dict],
        usage_chunk: Callable[[], dict], include_usage: bool) -> EventSourceResponse:
    """A streamed answer: each body as one ``data:`` event, the usage chunk when asked for
    (``include_usage``), an OpenAI error object if the request fails part-way, then ``[DONE]``;
    every event JSON (:func:`~llama.serve.finite_json.dumps`).
    A client that goes away cancels its requests (counted with status 499).  The usage so far
    goes to ``request.state.usage`` at the end, for the access log."""

    async def events() -> AsyncIterator[dict]:
        try:
            async for body in bodies:
                yield {"data": dumps(body)}
            if include_usage:
                yield {"data": dumps(usage_chunk())}
            metrics.requests.labels(endpoint, "200").inc()
        except BaseException as e:
            group.cancel()
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                metrics.requests.labels(endpoint, "499").inc()
                raise
            err = failure(e)
            metrics.requests.labels(endpoint, str(err.status)).inc()
            yield {"data": dumps(err.body())}
        finally:
            request.state.usage = usage_chunk()["usage"]
        yield {"data": "[DONE]"}

    return EventSourceResponse(events(), ping=PING_S)
