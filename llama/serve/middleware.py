"""ASGI middleware in front of the application: the request body limit (the access log is
:mod:`~llama.serve.access`).
"""

from __future__ import annotations

from typing import Callable, Optional

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llama.serve.openai_api import APIError

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
