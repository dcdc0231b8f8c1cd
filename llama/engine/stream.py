"""One request's text, piece by piece as the engine decodes it: what the streaming calls
of :class:`llama.Llama` return."""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterator, Optional, Sequence

from llama.engine.core import Engine
from llama.engine.requests import RequestHandle, RequestResult, RequestSettings


class GenerationStream(Iterator[str]):
    """The text of one request, piece by piece as the engine decodes it.

    Iterate it (or ``"".join`` it); the pieces concatenate to the non-streamed text.
    The request is submitted at the first ``next()``, so a stream never iterated costs
    nothing; ``close()`` (or leaving a ``for`` loop early and dropping the stream)
    cancels it.  After the last piece, ``result`` holds the engine's result and, for a
    chat stream, ``message`` the assistant message (``stop_reason``, ``tool_calls``).
    """

    def __init__(self, engine: Engine, prompt_tokens: list[int], settings: RequestSettings,
                 make_message: Optional[Callable[[RequestResult], dict]] = None, *,
                 images: Sequence[Any] = ()) -> None:
        self.result: Optional[RequestResult] = None
        self.message: Optional[dict] = None
        self._handle: Optional[RequestHandle] = None
        self._pieces = self._generate(engine, prompt_tokens, settings, make_message, images)

    def _generate(self, engine, prompt_tokens, settings, make_message, images) -> Generator[str, None, None]:
        handle: Optional[RequestHandle] = None
        try:
            handle = self._handle = engine.submit(prompt_tokens, settings, images=images)
            for event in handle.events():
                if event.text:
                    yield event.text
            self.result = handle.result()
            if self.result.finish_reason == "timeout":
                raise TimeoutError(f"the request ran past its timeout_s={settings.timeout_s:g} s and was ended: "
                                   "give a longer timeout_s or a smaller max_gen_len")
            if make_message is not None:
                self.message = make_message(self.result)
        finally:
            if handle is not None and not handle.finished:
                handle.cancel()

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Cancel the request if it is still running and wait until the engine has ended it
        (one step at most), so that on several ranks the cancellation has been shared
        with every rank when this returns."""
        self._pieces.close()
        if self._handle is not None and not self._handle.finished:
            self._handle.result()
