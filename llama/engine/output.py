"""What a request's caller gets from each step: its token's log-probabilities, its events
(the text each token released, detokenised incrementally: :mod:`llama.engine.detokenize`),
and at the end its result (cut at a stop string) or error.  Which requests end, and why (a
stop token, a stop string, the length limit, a cancellation, a failure), the scheduler's
update decides (:meth:`~llama.engine.scheduler.Scheduler.update_from_output`); this module
tells their callers, through their handles' public methods."""

from __future__ import annotations

import logging
import math
import threading
from typing import Optional, Sequence

import torch

from llama.engine.requests import RequestHandle, RequestResult, RunningRequest, TokenEvent
from llama.engine.scheduler import RequestOutput

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Tells each request's caller what the step did to it (under ``lock``: callers' threads
    read the events): the scheduler's update decides (:class:`~llama.engine.scheduler.RequestOutput`),
    the handle hears of it (:class:`~llama.engine.requests.RequestHandle`)."""

    def __init__(self, lock: threading.Condition) -> None:
        self.lock = lock

    @staticmethod
    def log_probs(requests: list[RunningRequest], logits: torch.Tensor, runs: Sequence[Sequence[int]],
                  rows: Sequence[int]) -> dict[int, list[tuple[float, Optional[list[tuple[int, float]]]]]]:
        """By row, for the requests that asked: for each of its chosen tokens (``runs[i]``, chosen
        from rows ``rows[i]``, ``rows[i] + 1``, ... of ``logits``: one, or a verified run of
        proposals and the token after them), its log-probability and the most likely tokens'
        (top_logprobs), read from the device at once.

        ``logits`` are those the token was drawn from, before its temperature, top-k and top-p:
        the model's, with the ids the tokenizer cannot decode, the tokens the request's
        grammar forbids and those its logits processor set to -inf masked out (as vLLM's
        default ``raw_logprobs`` are taken after its grammar mask).  A masked token has
        probability 0 there: it is never listed among the alternatives, which are the most
        likely tokens of that distribution, fewer than asked where it allows fewer.  A row
        whose mask was deferred, or that failed before choosing any token, has no token yet,
        and nothing to report this step."""
        asking = [i for i, r in enumerate(requests) if (r.settings.logprobs or r.settings.top_logprobs) and runs[i]]
        if not asking:
            return {}
        picks = [(i, rows[i] + j, token) for i in asking for j, token in enumerate(runs[i])]
        log_probs = torch.log_softmax(logits[[row for _, row, _ in picks]], dim=-1)
        chosen = torch.tensor([token for _, _, token in picks], device=logits.device).unsqueeze(-1)
        columns = [log_probs.gather(-1, chosen).double()]
        most = max(requests[i].settings.top_logprobs or 0 for i in asking)
        if most:
            values, ids = torch.topk(log_probs, most)
            columns += [values.double(), ids.double()]  # ids below 2**53: exact
        table = torch.cat(columns, dim=-1).tolist()
        out: dict[int, list[tuple[float, Optional[list[tuple[int, float]]]]]] = {}
        for (i, _, _), row in zip(picks, table):
            k = requests[i].settings.top_logprobs or 0
            # topk sorts descending: the masked alternatives (-inf) come last, left out here
            top = [(int(t), v) for t, v in zip(row[1 + most : 1 + most + k], row[1 : 1 + k])
                   if math.isfinite(v)] if k else None
            out.setdefault(i, []).append((row[0], top))
        return out

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """(Under the lock.)  Each output to its request's handle: a token's event (with the
        text offsets of the tokens it made final), the result of a request that ended (its
        text held back until then, cut at a stop string), the error of one that failed."""
        if not outputs:
            return
        for output in outputs:
            request = output.request
            handle = request.handle
            if handle is None:  # another rank's request: only the first rank has callers
                continue
            if output.error is not None:
                if not handle.finished:
                    handle.fail(output.error)
                continue
            if output.token is not None:
                n_final = request.assembler.n_final if output.n_final is None else output.n_final
                final = request.newly_final(n_final)
                handle.emit(TokenEvent(output.token, output.text, output.logprob, output.top_logprobs, final))
            if output.finished:
                self._finish(request, handle)
        self.lock.notify_all()

    def _finish(self, request: RunningRequest, handle: RequestHandle) -> None:
        """The result of a request that ended: its text held back until now, cut at a stop string."""
        assembler = request.assembler
        tail = assembler.finish()
        n_tokens = assembler.tokens_before_stop() if assembler.stopped else len(request.generated)
        final = request.newly_final(n_tokens)
        if tail or final:
            handle.emit(TokenEvent(None, tail, final_offsets=final))
        handle.finish(RequestResult(
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
            queue_time_s=handle.queue_time_s(),
        ))

    def end_unstarted(self, handles: list[RequestHandle], error: Optional[BaseException] = None, *,
                      reason: str = "cancelled") -> None:
        """(Under the lock.)  End requests that never started: with ``error``, or with an empty
        result whose finish reason is ``reason`` ("cancelled", or "timeout": past its deadline)."""
        if not handles:
            return
        for handle in handles:
            if error is not None:
                handle.fail(error)
            else:
                handle.finish(RequestResult([], "", [] if handle.settings.logprobs else None, None, reason,
                                            None, len(handle.prompt_tokens), 0))
        self.lock.notify_all()
