"""Choosing each request's next token from its logits, on the first rank, and sharing the
choices: the vocabulary the tokenizer can decode, each request's logits processor,
temperature / top-k / top-p with the request's own seeded generator
(:mod:`llama.engine.sampling`).  A constrained request (a grammar, :mod:`llama.structured`)
samples among the tokens its grammar allows: the masks of all constrained rows are computed
on a worker thread while the model runs (:meth:`Sampler.start_masks`), applied together on the
logits' device before the processors, and each chosen token advances its request's matcher.  A request whose logits cannot be sampled from (not finite, or its
processor raised or returned unusable logits) fails alone.

The host reads the device once per step, for the chosen tokens: the finite check and
every sampling setting run on the device, a failed row marked by a token id below 0.
Only the rows that failed are read again, to say why; and a logits processor (the
caller's code, on host-visible logits) costs reads of its own."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from llama.engine.requests import RequestSettings, RunningRequest
from llama.engine.sampling import NO_TOKEN, greedy_tokens, sample_next_token
from llama.runtime import distributed
from llama.runtime.finite import NonFiniteError, check_finite_logits
from llama.structured import GrammarMasker

logger = logging.getLogger(__name__)

FAILED = NO_TOKEN  # the token the first rank shares for a request that failed while sampling


class Sampler:
    """Samples on the first rank; every rank gets the same tokens and the same failures.

    ``n_decodable``: ids from this one up are never sampled (a checkpoint may pad its
    vocabulary beyond what the tokenizer can turn into text).  ``generator`` draws the seed
    of a request that gives none."""

    def __init__(self, n_decodable: int, generator: torch.Generator, device: torch.device, *,
                 first_rank: bool, multi_rank: bool, sync_free: Optional[bool] = None) -> None:
        self.n_decodable = n_decodable
        self.generator = generator
        self.device = device
        self.first_rank = first_rank
        self.multi_rank = multi_rank
        # Sample without reading the device (llama.engine.sampling): off the CPU, where each
        # read stalls the host; on the CPU reads cost nothing and top-p's shortcut pays.
        self.sync_free = device.type != "cpu" if sync_free is None else sync_free
        self._maskers: dict[int, GrammarMasker] = {}  # by id of the grammar tokenizer
        # The masks of the step under way, computed on a worker thread while the model runs
        # (start_masks): by request id, (the step's bitmask future, its row in it).
        self._mask_worker: Optional[ThreadPoolExecutor] = None
        self._early_masks: dict[int, tuple[Future, int]] = {}

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
        # Rows whose logits may hold NaN or Inf: the sum is non-finite where any logit is, or
        # where finite logits overflowed it (told apart below, only for such rows).  Every rank
        # holds the same logits (gathered), so every rank finds the same rows.
        suspect = ~torch.isfinite(logits.sum(-1))  # (R,) on the device
        if self.n_decodable < logits.shape[-1]:
            logits[:, self.n_decodable :] = float("-inf")
        errors: dict[int, BaseException] = {}
        if self.first_rank:
            self._apply_grammars(requests, logits)
            # A processor is the caller's code on the logits: keep the rows that fail the
            # finite check from it (finding them reads the device, as the processor does).
            with_processor = any(request.processor is not None for request in requests)
            suspects = suspect.nonzero().flatten().tolist() if with_processor else []
            skip = set(self._non_finite_rows(requests, logits, suspects))
            tokens = self._choose(requests, logits, skip, errors)
        else:
            tokens = torch.zeros(len(requests), dtype=torch.long, device=logits.device)
        if self.multi_rank:
            tokens = distributed.broadcast_from_first_rank(tokens)
        chosen, suspects = torch.stack([tokens, suspect.long()]).tolist()  # the step's one read of the device
        non_finite = self._non_finite_rows(requests, logits, [i for i, s in enumerate(suspects) if s])
        failed = [i for i, t in enumerate(chosen) if t == FAILED and i not in non_finite]
        if self.first_rank:
            for i in failed:  # a sync-free draw that found nothing to draw
                errors.setdefault(i, ValueError("cannot sample from a row whose weights are all zero or not finite"))
        if self.multi_rank and failed:
            errors = self._shared_errors(failed, errors)
        errors = {**{i: e for i, e in errors.items() if i not in non_finite}, **non_finite}
        self._advance_grammars(requests, chosen, errors)
        return chosen, errors

    def start_masks(self, requests: list[RunningRequest]) -> None:
        """Begin computing the grammar masks of the constrained ``requests`` (those the step
        under way may sample) on a worker thread, so that llguidance works on the host while
        the model runs; :meth:`sample` takes them.  A matcher changes only when a sampled
        token advances it, after the step's masks are used, so the early masks are the ones
        the step needs."""
        self._early_masks = {}
        if not self.first_rank:
            return
        for masker, group in self._by_masker(requests):
            if self._mask_worker is None:
                self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            future = self._mask_worker.submit(masker.fill, [r.matcher for r in group],
                                              pin_memory=self.device.type == "cuda")
            self._early_masks.update((r.id, (future, k)) for k, r in enumerate(group))

    def _by_masker(self, requests: list[RunningRequest]) -> list[tuple[GrammarMasker, list[RunningRequest]]]:
        """The constrained ``requests`` by the masker of their grammar's tokenizer (one per
        tokenizer: all of a model's grammars share one)."""
        groups: dict[int, tuple[GrammarMasker, list[RunningRequest]]] = {}
        for request in requests:
            if request.matcher is not None:
                tokenizer = request.matcher.tokenizer
                if id(tokenizer) not in self._maskers:
                    self._maskers[id(tokenizer)] = GrammarMasker(tokenizer)
                groups.setdefault(id(tokenizer), (self._maskers[id(tokenizer)], []))[1].append(request)
        return list(groups.values())

    def _apply_grammars(self, requests: list[RunningRequest], logits: torch.Tensor) -> None:
        """Mask the rows of constrained requests to the tokens their grammars allow: with
        the masks :meth:`start_masks` computed where it did, else computed now."""
        early, self._early_masks = self._early_masks, {}
        row_of = {request.id: i for i, request in enumerate(requests)}
        for masker, group in self._by_masker(requests):
            rows = [row_of[r.id] for r in group]
            if all(r.id in early for r in group) and len({id(early[r.id][0]) for r in group}) == 1:
                bitmask, picked = early[group[0].id][0].result(), [early[r.id][1] for r in group]
                if picked != list(range(bitmask.shape[0])):  # some did not sample (a prompt not yet done)
                    bitmask = bitmask[picked]
                masker.apply_bitmask(logits, rows, bitmask)
            else:
                masker.apply(logits, rows, [r.matcher for r in group])

    @staticmethod
    def _advance_grammars(requests: list[RunningRequest], chosen: list[int], errors: dict[int, BaseException]) -> None:
        """Give each constrained request's matcher its chosen token.  A token the grammar did
        not allow cannot be chosen from a masked row; should it be, the matcher fails, its
        next mask allows only the request's end tokens, and the reply ends there (on every
        rank alike, as they follow the first rank's tokens)."""
        for i, request in enumerate(requests):
            if request.matcher is None or i in errors:
                continue
            try:
                request.matcher.consume(chosen[i])
            except ValueError as e:
                logger.warning("request %d: %s; ending its constrained reply", request.id, e)

    def _non_finite_rows(self, requests: list[RunningRequest], logits: torch.Tensor,
                         suspects: list[int]) -> dict[int, NonFiniteError]:
        """Of the ``suspects`` (row indices), the rows whose logits hold NaN or Inf, with their errors."""
        errors = {}
        for i in suspects:
            request = requests[i]
            try:
                # the decodable ids only: those beyond are -inf by now (never sampled)
                check_finite_logits(logits[i, : self.n_decodable], f"the step choosing token "
                                    f"{len(request.generated) + 1} of request {request.id}")
            except NonFiniteError as e:
                errors[i] = e
        return errors

    def _choose(self, requests: list[RunningRequest], logits: torch.Tensor, skip: set[int],
                errors: dict[int, BaseException]) -> torch.Tensor:
        """Tokens (R,) on the device, :data:`FAILED` where a row failed (its error in ``errors``
        when known on the host; rows in ``skip`` are left to the finite check)."""
        for i, request in enumerate(requests):
            if request.processor is not None and i not in skip:
                try:
                    logits[i : i + 1] = processed(request, logits[i : i + 1])
                except Exception as e:  # the caller's code: its error is that request's alone
                    errors[i] = e
        tokens = greedy_tokens(logits)
        for i, request in enumerate(requests):
            if i in errors or i in skip:
                tokens[i] = FAILED
            elif not request.sampling.greedy:
                try:
                    tokens[i] = sample_next_token(logits[i : i + 1], request.sampling, request.generator,
                                                  sync_free=self.sync_free)[0]
                except (ValueError, RuntimeError) as e:
                    errors[i] = e
                    tokens[i] = FAILED
        return tokens

    def _shared_errors(self, failed: list[int], errors: dict[int, BaseException]) -> dict[int, BaseException]:
        """The errors of the rows that failed while the first rank sampled (``failed``: their
        token is :data:`FAILED`), on every rank: the first rank's own, and on the others an
        error carrying the first rank's message.  Every rank finds the same rows, so they all
        take part in the broadcast."""
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
