"""ASGI middleware in front of the application: the gate (API keys, shutdown) and the request
body limit (the access log is :mod:`~llama.serve.access`).

Plain ASGI callables, not Starlette's ``BaseHTTPMiddleware``: that one runs the application
behind a receive channel of its own, through which ``http.disconnect`` never reaches a request
that is not streamed, so a client that went away could not cancel it.
"""

from __future__ import annotations

from typing import Callable, Optional

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llama.serve.auth import APIKeys
from llama.serve.errors import shutting_down
from llama.serve.openai_api import APIError

# What answers without a key when the server has keys: the chat page (which asks for the key) and
# whether the server is up.  Every other path needs one: the API, /metrics, /docs and its schema,
# and any unknown path (a 401, not a 404 that tells which routes exist).
PUBLIC_PATHS = frozenset({"/", "/health"})


def too_large(max_bytes: int, size: Optional[int] = None) -> APIError:
    told = f"is {size} bytes" if size is not None else "goes on"
    return APIError(413, f"the request body {told}, more than this server takes ({max_bytes} bytes: "
                         "--max_request_bytes)", code="request_too_large")


class Gate:
    """In front of the routes: with ``keys``, every path but :data:`PUBLIC_PATHS` needs
    ``Authorization: Bearer KEY`` (else 401); the key goes to the request's state
    (``request.state.api_key``, its prefix-cache scope).  Once ``accepting()`` is False (the
    server shuts down), ``/v1/*`` answers 503.

    ``respond(path, error)``: the response to a refused request (counted in the metrics)."""

    def __init__(self, app: ASGIApp, keys: APIKeys, accepting: Callable[[], bool],
                 respond: Callable[[str, APIError], Response]) -> None:
        self.app = app
        self.keys = keys
        self.accepting = accepting
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.keys and path not in PUBLIC_PATHS:
            try:
                key = self.keys.check(_header(scope, b"authorization"))
            except APIError as e:
                await self.respond(path, e)(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = key
        if not self.accepting() and path.startswith("/v1/"):
            await self.respond(path, shutting_down())(scope, receive, send)
            return
        await self.app(scope, receive, send)


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


def _header(scope: Scope, name: bytes) -> Optional[str]:
    """The first header ``name`` (lower case) of the request, decoded as Starlette's ``Headers`` do."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _content_length(scope: Scope) -> Optional[int]:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:  # the HTTP server refuses those before the application sees them
        return None
