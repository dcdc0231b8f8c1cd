"""The engine requests behind one HTTP request, seen from asyncio: their events handed
to the event loop, their cancellation when the client goes away, their metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Sequence, Union

from llama.serve.metrics import ServerMetrics
from llama.serve.protocols import EngineEvent, ServedEngine, ServedRequest

if TYPE_CHECKING:
    from starlette.requests import Request

    from llama.engine import RequestResult, RequestSettings, TokenEvent


logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client of a request that is not streamed went away before its answer was ready."""


class RequestTimedOut(Exception):
    """A request ran past its deadline (its ``timeout``, or the server's ``--request_timeout_s``):
    the engine ended it (finish reason ``"timeout"``), its blocks freed."""

    def __init__(self, timeout_s: Optional[float]) -> None:
        super().__init__(f"the request ran past its deadline of {timeout_s:g} s" if timeout_s is not None
                         else "the request ran past its deadline")
        self.timeout_s = timeout_s


async def disconnected(request: Request) -> None:
    """Return once the client has gone: the HTTP server's ``http.disconnect``, read from the
    request's ASGI channel (which the endpoint has read its body from; nothing else reads it
    while the answer is being made, and uvicorn answers ``http.disconnect`` at once, ever after,
    once the connection is closed)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Choice:
    """One engine request: one choice of one prompt."""

    index: int
    prompt_tokens: list[int]
    handle: Optional[ServedRequest] = None
    events: list = field(default_factory=list)  # its TokenEvents that carry a token
    result: Optional[RequestResult] = None
    submitted_at: float = 0.0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    n_reported: int = 0  # tokens whose log-probabilities a stream has sent

    def newly_final(self, item: TokenEvent) -> list[tuple[TokenEvent, int]]:
        """(token event, text offset) of the tokens ``item`` says became final (a stream
        reports log-probabilities for those only: what the finished request keeps)."""
        start = self.n_reported
        self.n_reported += len(item.final_offsets)
        return list(zip(self.events[start : self.n_reported], item.final_offsets))


class RequestGroup:
    """The engine requests behind one HTTP request (``n`` choices of each prompt).

    The engine calls ``on_event`` from its stepping thread; the events are handed to the
    event loop with ``call_soon_threadsafe`` and read back in order with :meth:`items`.
    """

    def __init__(self, engine: ServedEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []
        self.pending = 0
        self.timeout_s: Optional[float] = None  # its choices' deadline (they share one)

    def submit(self, prompt_tokens: list[int], settings: RequestSettings, images: Sequence[Any] = ()) -> None:
        """Submit one choice; ``images``: its prompt's (:class:`~llama.images.prompt.PromptImage`),
        handed to the engine only when there are any (an engine that takes none refuses them)."""
        choice = Choice(index=len(self.choices), prompt_tokens=prompt_tokens, submitted_at=time.perf_counter())
        self.timeout_s = settings.timeout_s

        def on_event(item: EngineEvent, choice: Choice = choice) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice, item))
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        if images:
            choice.handle = self.engine.submit(prompt_tokens, settings, on_event, images=images)
        else:
            choice.handle = self.engine.submit(prompt_tokens, settings, on_event)
        self.choices.append(choice)
        self.pending += 1

    async def items(self) -> AsyncIterator[tuple[Choice, Union[TokenEvent, RequestResult]]]:
        """(choice, TokenEvent) for each token, then (choice, RequestResult) when it ends; raises
        the first request error (after cancelling the others), and :class:`RequestTimedOut` for a
        choice the engine ended at its deadline."""
        from llama.engine import RequestResult

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
                if item.finish_reason == "timeout":
                    self.cancel()
                    raise RequestTimedOut(self.timeout_s)
            elif item.token is not None:  # (the last event may carry only held-back text)
                if choice.first_token_at is None:
                    choice.first_token_at = now
                    self.metrics.first_token(now - choice.submitted_at)
                elif choice.last_token_at is not None:
                    self.metrics.next_token(now - choice.last_token_at)
                choice.last_token_at = now
                choice.events.append(item)
            yield choice, item

    async def results(self, request: Request) -> list[Choice]:
        """Wait for every choice to finish.  If the client goes away first, cancel them all (the
        engine ends them at its next step, giving back their slots and blocks) and raise
        :class:`ClientGone` at once; so too if this wait is itself cancelled."""
        finished = asyncio.ensure_future(self._drain())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self.cancel()
            raise
        finally:
            gone.cancel()
            if not finished.done():
                finished.cancel()
        if finished.done():
            return finished.result()  # (an engine error is raised here)
        logger.info("client went away: cancelling %d request(s)", len(self.choices))
        self.cancel()
        raise ClientGone()

    async def _drain(self) -> list[Choice]:
        async for _ in self.items():
            pass
        return self.choices

    def cancel(self) -> None:
        for choice in self.choices:
            if choice.handle is not None and not choice.handle.finished:
                choice.handle.cancel()

    def _record(self, choice: Choice, result: RequestResult) -> None:
        start = choice.submitted_at
        first, last = choice.first_token_at, choice.last_token_at  # set by the first and last of the events
        self.metrics.request_finished(result, e2e_s=time.perf_counter() - start,
                                      first_s=None if first is None else first - start,
                                      last_s=None if last is None else last - start, n_tokens=len(choice.events))
        if not self.pending:  # the HTTP request's last choice
            self.metrics.group_finished(max(len(c.result.tokens) for c in self.choices if c.result is not None))
