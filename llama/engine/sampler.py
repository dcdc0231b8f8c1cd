"""Choosing each request's next token from its logits, on the first rank, and sharing the
choices: the vocabulary the tokenizer can decode, each request's logits processor,
temperature / top-k / top-p with the request's own seeded generator
(:mod:`llama.engine.sampling`).  A request whose logits cannot be sampled from (not
finite, or its processor raised or returned unusable logits) fails alone."""

from __future__ import annotations

from typing import Optional

import torch

from llama.engine.requests import RequestSettings, RunningRequest
from llama.engine.sampling import greedy_tokens, sample_next_token
from llama.runtime import distributed
from llama.runtime.finite import NonFiniteError, check_finite_logits

FAILED = -1  # the token the first rank shares for a request that failed while sampling


class Sampler:
    """Samples on the first rank; every rank gets the same tokens and the same failures.

    ``n_decodable``: ids from this one up are never sampled (a checkpoint may pad its
    vocabulary beyond what the tokenizer can turn into text).  ``generator`` draws the seed
    of a request that gives none."""

    def __init__(self, n_decodable: int, generator: torch.Generator, device: torch.device, *,
                 first_rank: bool, multi_rank: bool) -> None:
        self.n_decodable = n_decodable
        self.generator = generator
        self.device = device
        self.first_rank = first_rank
        self.multi_rank = multi_rank

    def generator_for(self, settings: RequestSettings) -> Optional[torch.Generator]:
        """A request's own generator (first rank, sampled requests): seeded with its seed, or
        one drawn from the engine's generator, so a seeded request's text does not depend on
        what shares its batch."""
        if not self.first_rank or settings.sampling().greedy:
            return None
        seed = settings.seed
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self.generator))
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, requests: list[RunningRequest], logits: torch.Tensor) -> tuple[list[int], dict[int, BaseException]]:
        """Each request's next token (the first rank's choice, on every rank) and the errors
        of the rows that failed (by row), the same on every rank."""
        non_finite = self._non_finite_rows(requests, logits)
        tokens, errors = self._choose(requests, logits, non_finite)
        if self.multi_rank:
            tokens = distributed.broadcast_from_first_rank(tokens)
            errors = self._shared_errors(tokens, non_finite, errors)
        return tokens.tolist(), {**non_finite, **errors}

    def _non_finite_rows(self, requests: list[RunningRequest], logits: torch.Tensor) -> dict[int, BaseException]:
        """The rows whose logits hold NaN or Inf (the model's own logits, before any masking;
        every rank holds the same, gathered, so every rank finds the same).  One host sync."""
        suspects = (~torch.isfinite(logits.sum(-1))).nonzero().flatten().tolist()  # overflowed sums too
        errors: dict[int, BaseException] = {}
        for i in suspects:
            request = requests[i]
            try:
                check_finite_logits(logits[i], f"the step choosing token {len(request.generated) + 1} "
                                               f"of request {request.id}")
            except NonFiniteError as e:
                errors[i] = e
        return errors

    def _choose(self, requests: list[RunningRequest], logits: torch.Tensor,
                non_finite: dict[int, BaseException]) -> tuple[torch.Tensor, dict[int, BaseException]]:
        """Tokens (R,) on the first rank (zeros elsewhere) and the first rank's errors."""
        if self.n_decodable < logits.shape[-1]:
            logits[:, self.n_decodable :] = float("-inf")
        errors: dict[int, BaseException] = {}
        if not self.first_rank:
            return torch.zeros(len(requests), dtype=torch.long, device=logits.device), errors
        for i, request in enumerate(requests):
            if request.processor is not None and i not in non_finite:
                try:
                    logits[i : i + 1] = processed(request, logits[i : i + 1])
                except Exception as e:  # the caller's code: its error is that request's alone
                    errors[i] = e
        tokens = greedy_tokens(logits)
        for i, request in enumerate(requests):
            if i in non_finite or i in errors:
                tokens[i] = FAILED
            elif not request.sampling.greedy:
                try:
                    tokens[i] = sample_next_token(logits[i : i + 1], request.sampling, request.generator)[0]
                except (ValueError, RuntimeError) as e:
                    errors[i] = e
                    tokens[i] = FAILED
        return tokens, errors

    def _shared_errors(self, tokens: torch.Tensor, non_finite: dict[int, BaseException],
                       errors: dict[int, BaseException]) -> dict[int, BaseException]:
        """The errors of the rows that failed while the first rank sampled (their token is
        :data:`FAILED`), on every rank: the first rank's own, and on the others an error
        carrying the first rank's message.  Every rank finds the same rows, so they all take
        part in the broadcast or none does."""
        failed = [i for i, t in enumerate(tokens.tolist()) if t == FAILED and i not in non_finite]
        if not failed:
            return {}
        sent = {i: f"{type(e).__name__}: {e}" for i, e in errors.items()} if self.first_rank else None
        messages = distributed.broadcast_object_from_first_rank(sent)
        if self.first_rank:
            return errors
        return {i: RuntimeError(f"the request failed on the first rank: {messages.get(i, 'see its log')}")
                for i in failed}


def processed(request: RunningRequest, row: torch.Tensor) -> torch.Tensor:
    """``request``'s logits processor applied to its logits ``row`` (1, V), checked: the same
    shape, no NaN or +inf, and at least one token left possible."""
    history = torch.tensor([request.tokens_so_far()], device=row.device)
    out = request.processor(history, row.clone())
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(row.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"logits_processor must return a tensor of the logits' shape {tuple(row.shape)}, got {got}")
    if not (out.is_floating_point() and out.device == row.device):
        raise ValueError(f"logits_processor must return floating-point logits on {row.device}, "
                         f"got {out.dtype} on {out.device}")
    if bool(torch.isnan(out).any() | (out == float("inf")).any()):
        raise ValueError("logits_processor returned NaN or +inf logits: mask tokens with -inf, never NaN")
    if not bool(torch.isfinite(out).any()):
        raise ValueError("logits_processor set every logit to -inf: leave at least one token possible")
    return out
