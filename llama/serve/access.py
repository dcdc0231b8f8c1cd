"""The access log: one line per request, on the ``llama.serve.access`` logger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)  # llama.serve.access: logs.ACCESS_LOGGER


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
            logger.info(
                '%s "%s %s" %s prompt_tokens=%s completion_tokens=%s %.3fs',
                f"{client[0]}:{client[1]}" if client else "-", scope["method"], scope["path"],
                499 if gone else status if complete else failed or 499,  # 499: the client went away
                usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-"), time.perf_counter() - start)
