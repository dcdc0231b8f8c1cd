"""What a request's caller gets from each step: its token's log-probabilities, its text
(detokenised incrementally, cut at stop strings: :mod:`llama.engine.detokenize`), its
events, and at the end its result or error; and which requests end (a stop token, a stop
string, the length limit, a cancellation, a failure)."""

from __future__ import annotations

import logging
import math
import threading
from typing import Optional

import torch

from llama.engine.kv_cache_manager import KVCacheManager
from llama.engine.requests import RequestResult, RunningRequest, TokenEvent
from llama.engine.sampler import DEFERRED
from llama.engine.scheduler import Scheduler
from llama.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Delivers tokens to requests and ends them (under ``lock``: callers' threads read the
    events).  Ending a request gives its blocks back (``scheduler.release``)."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, lock: threading.Condition,
                 tokenizer: Tokenizer) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.lock = lock
        self.tokenizer = tokenizer  # its stop_tokens end requests that name none
        self.tokens_generated = 0

    def deliver(self, requests: list[RunningRequest], logits: torch.Tensor, tokens: list[int],
                errors: dict[int, BaseException]) -> None:
        """Each request's sampled token (row i of ``logits`` and ``tokens``), or its error; a
        deferred row (:data:`~llama.engine.sampler.DEFERRED`: waiting for its grammar's mask)
        gets nothing yet."""
        log_probs = self._log_probs(requests, logits, tokens, errors)
        default_stops = self.tokenizer.stop_tokens
        with self.lock:
            for i, request in enumerate(requests):
                if i in errors:
                    self.fail(request, errors[i])
                    continue
                token = tokens[i]
                if token == DEFERRED:
                    continue
                self.tokens_generated += 1
                stop_tokens = request.settings.stop_tokens
                if token in (default_stops if stop_tokens is None else stop_tokens):
                    request.stop_token, request.finish_reason = token, "stop"
                    self.finish(request)
                    continue
                lp, top = log_probs.get(i, (None, None))
                request.generated.append(token)
                if request.settings.logprobs:
                    request.logprobs.append(lp)
                text = request.assembler.push(token)
                if request.handle is not None:
                    final = request.newly_final(request.assembler.n_final)
                    request.handle.emit(TokenEvent(token, text, lp, top, final))
                if request.assembler.stopped:
                    request.finish_reason = "stop"
                    self.finish(request)
                elif len(request.generated) >= request.budget:
                    request.finish_reason = "length"
                    self.finish(request)
                else:
                    request.pending = token
            self.lock.notify_all()

    @staticmethod
    def _log_probs(requests: list[RunningRequest], logits: torch.Tensor, tokens: list[int],
                   errors: dict[int, BaseException]) -> dict[int, tuple[float, Optional[list[tuple[int, float]]]]]:
        """By row, for the requests that asked: the chosen token's log-probability and the
        most likely tokens' (top_logprobs), read from the device at once.

        ``logits`` are those the token was drawn from, before its temperature, top-k and top-p:
        the model's, with the ids the tokenizer cannot decode, the tokens the request's
        grammar forbids and those its logits processor set to -inf masked out (as vLLM's
        default ``raw_logprobs`` are taken after its grammar mask).  A masked token has
        probability 0 there: it is never listed among the alternatives, which are the most
        likely tokens of that distribution, fewer than asked where it allows fewer.  A row
        whose mask was deferred has no token yet, and nothing to report this step."""
        rows = [i for i, r in enumerate(requests)
                if (r.settings.logprobs or r.settings.top_logprobs) and i not in errors and tokens[i] != DEFERRED]
        if not rows:
            return {}
        log_probs = torch.log_softmax(logits[rows], dim=-1)
        chosen = torch.tensor([tokens[i] for i in rows], device=logits.device).unsqueeze(-1)
        columns = [log_probs.gather(-1, chosen).double()]
        most = max(requests[i].settings.top_logprobs or 0 for i in rows)
        if most:
            values, ids = torch.topk(log_probs, most)
            columns += [values.double(), ids.double()]  # ids below 2**53: exact
        table = torch.cat(columns, dim=-1).tolist()
        out = {}
        for i, row in zip(rows, table):
            k = requests[i].settings.top_logprobs or 0
            # topk sorts descending: the masked alternatives (-inf) come last, left out here
            top = [(int(t), v) for t, v in zip(row[1 + most : 1 + most + k], row[1 : 1 + k])
                   if math.isfinite(v)] if k else None
            out[i] = (row[0], top)
        return out

    def finish(self, request: RunningRequest, reason: Optional[str] = None) -> None:
        """End a request (under the lock): give its blocks back, deliver its result."""
        if reason is not None:
            request.finish_reason = reason
        self.scheduler.release(request)
        if request.handle is None:
            return
        assembler = request.assembler
        tail = assembler.finish()
        n_tokens = assembler.tokens_before_stop() if assembler.stopped else len(request.generated)
        final = request.newly_final(n_tokens)
        if tail or final:
            request.handle.emit(TokenEvent(None, tail, final_offsets=final))
        result = RequestResult(
            tokens=request.generated[:n_tokens],
            text=assembler.text,
            logprobs=request.logprobs[:n_tokens] if request.settings.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            finish_reason=request.finish_reason or "length",
            stop_token=request.stop_token,
            n_prompt_tokens=len(request.prompt),
            n_cached_prompt_tokens=request.reused,
            all_tokens=list(request.generated),
            text_offsets=[assembler.token_start(k) for k in range(n_tokens)],
        )
        request.handle.finish(result)
        self.lock.notify_all()

    def fail(self, request: RunningRequest, error: BaseException) -> None:
        """End one request with ``error`` (under the lock); the others go on.  What it wrote
        leaves the prefix cache (its logits may have come from non-finite keys and values)."""
        self.kv.fail(request)
        self.scheduler.release(request)
        logger.info("request %d failed: %s", request.id, error)
        if request.handle is not None and not request.handle.finished:
            request.handle.fail(error)
        self.lock.notify_all()
