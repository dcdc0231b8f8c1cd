"""Streamed answers as server-sent events, the one way both endpoints stream.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Optional

from sse_starlette import EventSourceResponse

from llama.serve.errors import failure
from llama.serve.metrics import ServerMetrics
from llama.serve.requests import RequestGroup

# Seconds between keep-alive comments on a quiet stream (a long prefill, a full batch).
PING_S = 15


def sse(metrics: ServerMetrics, endpoint: str, group: RequestGroup, bodies: AsyncIterator[dict],
        usage_chunk: Optional[Callable[[], dict]]) -> EventSourceResponse:
    """A streamed answer: each body as one ``data:`` event, the usage chunk when asked for,
    an OpenAI error object if the request fails part-way, then ``[DONE]``.  A client that
    goes away cancels its requests (counted with status 499)."""

    async def events() -> AsyncIterator[dict]:
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

    return EventSourceResponse(events(), ping=PING_S)
