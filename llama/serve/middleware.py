"""ASGI middleware in front of the application: the access log and the request body limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llama.serve.logs import ACCESS_LOGGER
from llama.serve.openai_api import APIError

access_logger = logging.getLogger(ACCESS_LOGGER)


class AccessLog:
    """One line per request on the ``llama.serve.access`` logger (INFO), once its answer is
    through (a stream's last event): client, method, path, status, the prompt and generated
    tokens, seconds taken.  Never the prompt's text, the query string or headers.  Status 499:
    the client went away before the answer was through.  The endpoints put the token counts in
    the request's state (``request.state.usage``, OpenAI's usage object)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: Optional[int] = None
        complete = gone = False

        async def watched_send(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def watched_receive() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                gone = True
            return message

        failed: Optional[int] = None
        try:
            await self.app(scope, watched_receive, watched_send)
        except asyncio.CancelledError:
            failed = 499
            raise
        except Exception:  # answered 500 further out
            failed = 500
            raise
        finally:
            usage = scope.get("state", {}).get("usage") or {}
            client = scope.get("client")
            access_logger.info(
                '%s "%s %s" %s prompt_tokens=%s completion_tokens=%s %.3fs',
                f"{client[0]}:{client[1]}" if client else "-", scope["method"], scope["path"],
                499 if gone else status if complete else failed or 499,  # 499: the client went away
                usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-"), time.perf_counter() - start)


def too_large(max_bytes: int, size: Optional[int] = None) -> APIError:
    told = f"is {size} bytes" if size is not None else "goes on"
    return APIError(413, f"the request body {told}, more than this server takes ({max_bytes} bytes: "
                         "--max_request_bytes)", code="request_too_large")


class BodyLimit:
    """Refuse request bodies above ``max_bytes`` with a 413 error object, without reading them
    into memory: at once when ``Content-Length`` says so, else (a chunked body) as soon as the
    bytes read pass the limit, by raising from ``receive`` into whatever reads the body.

    What the client still sends of a refused body is read and dropped by the HTTP server, so
    that a client which writes its whole body before reading sees the 413 rather than a reset
    connection; the header timeout (:mod:`~llama.serve.connections`) bounds how long that goes on.

    ``respond(path, error)``: the response to a refused body (counted in the metrics)."""

    def __init__(self, app: ASGIApp, max_bytes: int, respond: Callable[[str, APIError], Response]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self.respond(scope["path"], too_large(self.max_bytes, length))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> Optional[int]:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses those before the application sees them
                return None
    return None
