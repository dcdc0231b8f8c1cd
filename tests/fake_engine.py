"""A small stand-in for ``llama.engine.Engine`` (the contract the server is written against,
:class:`llama.serve.protocols.ServedEngine`), for fast tests of the HTTP layer without a model.

It "generates" a fixed script of tokens (the tokenizer's encoding of :data:`SCRIPT`, then EOS),
one token per step for every request holding a slot, on its own thread.  Logprobs are made up
but fixed (token k of a request has logprob ``-(k + 1) / 10``), so tests can check the server's
plumbing against them.  Stop strings use the library's own ``TextAssembler``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

from llama.engine import EngineBusy, EngineStopped, RequestResult, RequestSettings, TokenEvent
from llama.engine.detokenize import TextAssembler

SCRIPT = "Once upon a time there was a little girl who lived in a village near the forest."


@dataclass
class _Request:
    id: int
    prompt_tokens: list[int]
    settings: RequestSettings
    on_event: Optional[Callable]
    script: list[int]
    assembler: TextAssembler
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    n_final: int = 0  # tokens reported final (TokenEvent.final_offsets)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Any = None
    images: list = field(default_factory=list)  # the prompt's images, as submitted

    # the RequestHandle side
    def cancel(self) -> None:
        self.cancelled = True

    def result(self) -> RequestResult:
        self.done.wait()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def served_model(engine, formatter=None) -> SimpleNamespace:
    """What the server reads of a model (``llama.serve.protocols.ServedModel``), around ``engine``:
    its tokenizer, a chat format (Llama 2's unless given) and a structured-output manager that
    compiles the real grammars (so that their errors are the real ones; the script ignores them),
    in-process with no time budget."""
    from llama.formats.chat import Llama2ChatFormat
    from llama.structured import StructuredOutputs

    return SimpleNamespace(engine=engine, tokenizer=engine.tokenizer,
                           formatter=formatter if formatter is not None else Llama2ChatFormat(engine.tokenizer),
                           structured=StructuredOutputs(engine.tokenizer, compile_timeout_s=None))


class FakeEngine:
    def __init__(self, tokenizer, max_batch_size: int = 4, max_seq_len: int = 256, max_queue: int = 8,
                 step_s: float = 0.005) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_queue = max_queue
        self.step_s = step_s
        self.script = tokenizer.encode(SCRIPT, bos=False, eos=False) + [tokenizer.eos_id]
        self.queue: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.lock = threading.Lock()
        self.paused = threading.Event()  # set: no steps are taken (requests pile up in the queue)
        self.next_id = 0
        self.submitted: list[_Request] = []
        self.totals = {"requests_total": 0, "tokens_generated_total": 0, "prompt_tokens_total": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # -- the contract --
    def check_images(self, images: Sequence[Any], prompt_length: int) -> tuple:
        """As the engine's for a model that takes images: ``images`` as they are."""
        return tuple(images)

    def submit(self, prompt_tokens: Sequence[int], settings: RequestSettings, on_event: Optional[Callable] = None,
               *, images: Sequence[Any] = ()):
        """As the engine's; ``images`` are kept with the request (``submitted[k].images``) for the
        tests to read, and otherwise ignored."""
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if len(prompt_tokens) > self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_tokens)} tokens, more than max_seq_len={self.max_seq_len}")
        if not all(0 <= t < self.tokenizer.n_words for t in prompt_tokens):
            raise ValueError("token ids out of range")
        with self.lock:
            if len(self.queue) >= self.max_queue:
                raise EngineBusy("the queue is full")
            # the seed picks where in the script the "model" starts; greedy starts at 0
            start = 0 if settings.temperature == 0 or settings.seed is None else settings.seed % 5
            req = _Request(self.next_id, list(prompt_tokens), settings, on_event, self.script[start:],
                           TextAssembler(self.tokenizer, settings.stop,
                                         prompt_tokens[-4:] if settings.text_follows_prompt else ()))
            req.images = list(images)
            self.next_id += 1
            self.queue.append(req)
            self.submitted.append(req)
        return req

    def check_prompt(self, prompt: Sequence[int], what: str = "prompt") -> list[int]:
        """What ``llama.Llama`` asks of its engine before submitting (the real one checks more)."""
        if not prompt:
            raise ValueError(f"{what} is empty")
        return list(prompt)

    def stats(self) -> dict:
        with self.lock:
            return {"queued": len(self.queue), "running": len(self.running), "slots_in_use": len(self.running),
                    **self.totals, "cached_prompt_tokens_total": 0}

    def arriving(self):
        """The fake steps on its own clock: it waits for no announced request."""
        return contextlib.nullcontext()

    # -- the stepping thread --
    def _loop(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.step_s)
            if self.paused.is_set():
                continue
            with self.lock:
                while self.queue and len(self.running) < self.max_batch_size:
                    self.running.append(self.queue.popleft())
                running = list(self.running)
            for req in running:
                self._step(req)
            with self.lock:
                self.running = [r for r in self.running if not r.finished]

    def _emit(self, req: _Request, item: Any) -> None:
        if req.on_event is not None:
            req.on_event(item)

    def _finish(self, req: _Request, reason: str, stop_token: Optional[int] = None) -> None:
        s = req.settings
        kept = req.assembler.tokens_before_stop() if req.assembler.stopped else len(req.tokens)
        tail = req.assembler.finish()
        final = self._newly_final(req, kept)
        if tail or final:
            self._emit(req, TokenEvent(token=None, text=tail, final_offsets=final))
        tokens = req.tokens[:kept]
        result = RequestResult(
            tokens=tokens, text=req.assembler.text, logprobs=req.logprobs[:kept] if s.logprobs else None,
            prompt_logprobs=[0.0] + [-1.0] * (len(req.prompt_tokens) - 1) if (s.echo and s.logprobs) else None,
            finish_reason=reason, stop_token=stop_token, n_prompt_tokens=len(req.prompt_tokens),
            n_cached_prompt_tokens=0, text_offsets=[req.assembler.token_start(k) for k in range(kept)],
        )
        with self.lock:
            self.totals["requests_total"] += 1
            self.totals["tokens_generated_total"] += len(tokens)
            self.totals["prompt_tokens_total"] += len(req.prompt_tokens)
        req.finished = True
        req.outcome = result
        req.done.set()
        self._emit(req, result)

    def _step(self, req: _Request) -> None:
        s = req.settings
        budget = min(s.max_new_tokens, self.max_seq_len - len(req.prompt_tokens))
        if req.cancelled:
            return self._finish(req, "cancelled")
        if len(req.tokens) >= budget:
            return self._finish(req, "length")
        k = len(req.tokens)
        token = req.script[k % len(req.script)]
        if token in self.tokenizer.stop_tokens:
            return self._finish(req, "stop", token)
        lp = -(k + 1) / 10
        req.tokens.append(token)
        req.logprobs.append(lp)
        text = req.assembler.push(token)
        top = [(token, lp), (self.tokenizer.eos_id, lp - 1.0)][: s.top_logprobs] if s.top_logprobs else None
        self._emit(req, TokenEvent(token=token, text=text, logprob=lp if s.logprobs else None, top_logprobs=top,
                                   final_offsets=self._newly_final(req, req.assembler.n_final)))
        if req.assembler.stopped:
            self._finish(req, "stop")

    @staticmethod
    def _newly_final(req: _Request, n_final: int) -> tuple[int, ...]:
        offsets = tuple(req.assembler.token_start(k) for k in range(req.n_final, n_final))
        req.n_final = max(req.n_final, n_final)
        return offsets

    def fail_all(self, error: BaseException) -> None:
        with self.lock:
            reqs = list(self.queue) + list(self.running)
            self.queue.clear()
            self.running.clear()
        for req in reqs:
            req.finished = True
            req.outcome = error
            req.done.set()
            self._emit(req, error)

    def stop_all(self) -> None:
        self.fail_all(EngineStopped("the server is stopping"))

    def run_forever(self, should_stop: threading.Event) -> None:
        """Server mode: wait for ``should_stop``, then end every request (as the engine does)."""
        while not should_stop.wait(0.05):
            pass
        self.stop_all()
        self.close()


def main(port: str, options: str = "{}") -> None:
    """Serve the fake engine through ``llama.serve.serve`` (for tests of the server's process side);
    ``options``: a JSON object of its ``api_keys`` and ``ServerLimits`` fields."""
    import json
    import logging

    from helpers import REPO
    from llama.serve import ServerLimits, bind_socket, serve
    from llama.tokenizer import load_tokenizer

    logging.basicConfig(level=logging.INFO)
    tokenizer = load_tokenizer(REPO / "demo" / "tokenizer.model")
    engine = FakeEngine(tokenizer, max_batch_size=2, max_seq_len=256, max_queue=4, step_s=0.02)
    engine.script = engine.script[:-1] * 20  # long answers, no EOS: only cancellation ends them early
    llama = served_model(engine)
    limits = json.loads(options)
    api_keys = limits.pop("api_keys", ())
    raise SystemExit(serve(llama, bind_socket("127.0.0.1", int(port)), "fake", api_keys=api_keys,
                           limits=ServerLimits(**limits)))


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:])
