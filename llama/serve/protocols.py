"""What the server needs of the model it serves: the contract that
:class:`llama.engine.build.LoadedModel` and ``llama.Llama`` (with their
:class:`llama.engine.Engine`) meet, and that ``tests/fake_engine.py`` implements for fast
tests of the HTTP layer without a model.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    from llama.engine import RequestResult, RequestSettings, TokenEvent
    from llama.formats.chat import ChatFormat
    from llama.images.prompt import PromptImage
    from llama.structured import StructuredOutputs
    from llama.tokenizer import Tokenizer

# What an engine hands a request's ``on_event``: each token, then the result or the error.
EngineEvent = Union["TokenEvent", "RequestResult", BaseException]


class ServedRequest(Protocol):
    """One engine request, as the server holds it (:class:`llama.engine.RequestHandle`)."""

    finished: bool

    def cancel(self) -> None: ...


class ServedEngine(Protocol):
    """The engine behind the endpoints (:class:`llama.engine.Engine`).

    ``submit`` queues a request and returns at once (ValueError/TypeError for bad input,
    :class:`~llama.engine.EngineBusy` when its own queue is full); ``on_event`` is then called
    from the engine's stepping thread.  ``stats()`` holds at least ``queued`` and
    ``slots_in_use``.  ``images``: the prompt's images (a chat prompt's
    :class:`~llama.images.prompt.PromptImage` s); an engine that cannot take them raises
    ValueError.  ``arriving()`` is entered while a request is read, until it is
    submitted (an idle engine may wait for it, to start it together with others).
    ``run_forever`` steps on the calling thread until ``should_stop`` is set, then ends
    every request still queued or running with :class:`~llama.engine.EngineStopped`."""

    max_batch_size: int
    max_seq_len: int

    def submit(self, prompt_tokens: Sequence[int], settings: RequestSettings,
               on_event: Optional[Callable[[EngineEvent], None]] = None, *,
               images: Sequence[PromptImage] = ()) -> ServedRequest: ...

    def stats(self) -> dict: ...

    def arriving(self) -> ContextManager[None]: ...

    def run_forever(self, should_stop: threading.Event) -> None: ...


class ServedModel(Protocol):
    """What the server reads of the model it serves (:class:`llama.engine.build.LoadedModel`).
    Read-only members (properties here), so that a model holding a :class:`llama.engine.Engine`
    (a ``ServedEngine``) meets it: the server never replaces them."""

    @property
    def engine(self) -> ServedEngine: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def formatter(self) -> ChatFormat: ...

    @property
    def structured(self) -> StructuredOutputs:  # compiles the grammars of response formats and tool choices
        ...
