"""Choosing each request's next token from its logits, on the first rank, and sharing the
choices: the vocabulary the tokenizer can decode, each request's logits processor,
temperature / top-k / top-p with the request's own seeded generator
(:mod:`llama.engine.sampling`).  A constrained request (a grammar, :mod:`llama.structured`)
samples among the tokens its grammar allows: each constrained row's mask is computed on a
worker thread of its own while the model runs (:meth:`Sampler.start_masks`), the masks are
applied together on the logits' device before the processors, and each chosen token
advances its request's matcher.  A request whose logits cannot be sampled from (not finite,
or its processor raised or returned unusable logits) fails alone.

The per-step mask budget: one grammar's mask can take a long time (``x{20000}``: 0.2 to 1.5 s
a token with Llama 3's vocabulary, where a typical schema's takes 0.1 to 2 ms), and the step
must not wait for it.  llguidance's own per-mask limit (``step_lexer_fuel``, 200,000 by
default) does not bound the time: ``x{20000}`` spends 0.2 s a mask within it, and lowered to
10,000 it fails such matchers at their second mask instead.  The step waits for
the masks at most until :attr:`Sampler.mask_budget_s` after they began (the model's forward
pass included).  A row whose mask is not ready then is *deferred*: it gets the token
:data:`DEFERRED` (shared with the other ranks like any token), draws nothing, and its logits
are held on every rank while the mask goes on computing; its request is not planned again
until the first rank finds the mask ready (:meth:`Sampler.mask_decisions`, shared as
:class:`~llama.engine.scheduler.Decisions`) and samples the held row (:meth:`Sampler.take_held`).
The other requests go on at their own pace; a slow grammar slows its own request only.
Once a request's mask was slow, the steps no longer wait for its masks at all (it is
deferred unless its mask is ready), and they are computed on the slow lane
(:class:`~llama.structured.matcher.MaskWorkers`: one thread shared by every slow grammar,
which bounds what they take to one core).  A mask still not ready
:attr:`Sampler.mask_timeout_s` after it was asked for ends its request with
:class:`GrammarTooSlow`, which names the field.  Deferral changes when a token is drawn,
never which: the draws come from the request's own generator.

The host reads the device once per step, for the chosen tokens: the finite check and
every sampling setting run on the device, a failed row marked by a token id below 0.
Only the rows that failed are read again, to say why; and a logits processor (the
caller's code, on host-visible logits) costs reads of its own."""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from typing import Collection, Mapping, Optional, cast

import torch

from llama.engine.requests import LogitsProcessor, RequestSettings, RunningRequest
from llama.engine.sampling import NO_TOKEN, greedy_tokens, sample_next_token
from llama.runtime import distributed
from llama.runtime.finite import NonFiniteError, check_finite_logits
from llama.structured import GrammarMasker
from llama.structured.matcher import GrammarMatcher, MaskJob, MaskWorkers

logger = logging.getLogger(__name__)

FAILED = NO_TOKEN  # the token the first rank shares for a request that failed while sampling
DEFERRED = NO_TOKEN - 1  # the token it shares for a row whose mask was not ready in time (it waits)

# How long after its masks began a step waits for them (the model's forward pass included).
MASK_BUDGET_S = 0.05
# How long one mask may take before its request fails.
MASK_TIMEOUT_S = 10.0
# How long a step with nothing else to do waits for a deferred request's mask.
MASK_POLL_S = 0.01


class GrammarTooSlow(ValueError):
    """A request's grammar took longer than the limit to say which tokens may come next;
    ``param`` names its field (``response_format`` or ``tools``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
        self.mask_budget_s = MASK_BUDGET_S
        self.mask_timeout_s = MASK_TIMEOUT_S
        self._mask_workers: Optional[MaskWorkers] = None  # started with the first constrained request
        # First rank: each constrained request's mask for its matcher's current state, until a
        # token advances it (computing, or done); the requests whose last mask was slow.
        self._jobs: weakref.WeakKeyDictionary[RunningRequest, MaskJob] = weakref.WeakKeyDictionary()
        self._slow: weakref.WeakSet[RunningRequest] = weakref.WeakSet()
        self._deadline: Optional[float] = None  # this step's, for its masks (start_masks)
        # Every rank: the deferred requests and their logits, by request id.
        self._held: dict[int, tuple[RunningRequest, torch.Tensor]] = {}

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

    def sample(self, requests: list[RunningRequest], logits: torch.Tensor) -> tuple[list[int],
                                                                                    dict[int, BaseException]]:
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
            deferred = self._apply_grammars(requests, logits)
            # A processor is the caller's code on the logits: keep the rows that fail the
            # finite check from it (finding them reads the device, as the processor does).
            with_processor = any(request.processor is not None for request in requests)
            suspects = suspect.nonzero().flatten().tolist() if with_processor else []
            skip = set(self._non_finite_rows(requests, logits, suspects))
            tokens = self._choose(requests, logits, skip, errors, deferred)
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
        for i, token in enumerate(chosen):
            if token == DEFERRED and i not in errors:  # its logits wait for its mask, on every rank
                self._held[requests[i].id] = (requests[i], logits[i : i + 1].clone())
        self._advance_grammars(requests, chosen, errors)
        return chosen, errors

    def start_masks(self, requests: list[RunningRequest]) -> None:
        """Begin computing the grammar masks of the constrained ``requests`` (those the step
        under way may sample), each on a worker thread, so that llguidance works on the host
        while the model runs; :meth:`sample` takes them, waiting at most until
        :attr:`mask_budget_s` from now.  A matcher changes only when a sampled token advances
        it, after the step's masks are used, so the early masks are the ones the step needs;
        a request whose mask is still computing (it was deferred, or its prompt is not done)
        keeps that one."""
        self._deadline = None
        if not self.first_rank:
            return
        self._deadline = time.monotonic() + self.mask_budget_s
        for masker, group in self._by_masker(requests):
            new = [request for request in group if request not in self._jobs]
            if not new:
                continue
            if self._mask_workers is None:
                self._mask_workers = MaskWorkers()
            # One bitmask for the step's new masks (pinned: copied to the device as it is).
            bitmask = torch.empty((len(new), masker.tokenizer.words_per_mask), dtype=torch.int32,
                                  pin_memory=self.device.type == "cuda")
            for k, request in enumerate(new):
                matcher = cast(GrammarMatcher, request.matcher)  # a constrained request's
                self._jobs[request] = self._mask_workers.submit(masker, matcher, bitmask, k,
                                                                slow=request in self._slow)

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

    def _apply_grammars(self, requests: list[RunningRequest], logits: torch.Tensor) -> set[int]:
        """Mask the rows of constrained requests to the tokens their grammars allow, with the
        masks :meth:`start_masks` began where it did (else computed now); the rows whose masks
        are not ready by the step's deadline are left as they are: deferred (returned)."""
        deferred: set[int] = set()
        row_of = {request.id: i for i, request in enumerate(requests)}
        deadline = self._deadline if self._deadline is not None else time.monotonic() + self.mask_budget_s
        for masker, group in self._by_masker(requests):
            late = [r for r in group if r not in self._jobs]  # start_masks did not see them (tests, benchmarks)
            if late:
                masker.apply(logits, [row_of[r.id] for r in late], [cast(GrammarMatcher, r.matcher) for r in late])
            ready: list[tuple[RunningRequest, MaskJob]] = []
            for request in group:
                job = self._jobs.get(request)
                if job is None:
                    continue
                # A request whose last mask was slow gets no wait: it is deferred unless its mask is ready.
                if job.wait(time.monotonic() if request in self._slow else deadline):
                    ready.append((request, job))
                    if job.seconds() > self.mask_budget_s:
                        self._slow.add(request)
                    else:
                        self._slow.discard(request)
                else:
                    deferred.add(row_of[request.id])
                    self._slow.add(request)
                    logger.debug("request %d: its mask is not ready after %.3f s; it waits", request.id,
                                 job.seconds())
            if ready:
                masker.apply_bitmask(logits, [row_of[r.id] for r, _ in ready], _bitmask_of(ready, logits.is_cuda))
        return deferred

    def _advance_grammars(self, requests: list[RunningRequest], chosen: list[int],
                          errors: dict[int, BaseException]) -> None:
        """Give each constrained request's matcher its chosen token (not a deferred row's).  A
        token the grammar did not allow cannot be chosen from a masked row; should it be, the
        matcher fails, its next mask allows only the request's end tokens, and the reply ends
        there (on every rank alike, as they follow the first rank's tokens)."""
        for i, request in enumerate(requests):
            if request.matcher is None or (chosen[i] == DEFERRED and i not in errors):
                continue
            self._jobs.pop(request, None)  # its mask was of the state the token leaves
            if i in errors:
                continue
            try:
                request.matcher.consume(chosen[i])
            except ValueError as e:
                logger.warning("request %d: %s; ending its constrained reply", request.id, e)

    # -- deferred requests -----------------------------------------------------------------

    @property
    def holding(self) -> bool:
        """Whether some request waits for its mask."""
        return bool(self._held)

    def mask_decisions(self) -> tuple[list[int], list[int]]:
        """(First rank.)  Of the deferred requests, the ids of those whose masks are ready, to be
        sampled now, and of those whose masks are overdue (:attr:`mask_timeout_s` after they were
        asked for), to fail with :meth:`too_slow`."""
        ready, overdue = [], []
        now = time.monotonic()
        for request_id, (request, _) in self._held.items():
            job = self._jobs.get(request)
            if job is None or job.done():
                ready.append(request_id)
            elif now - job.submitted > self.mask_timeout_s:
                overdue.append(request_id)
        return ready, overdue

    def take_held(self, request_ids: list[int],
                  running: Mapping[int, RunningRequest]) -> tuple[list[RunningRequest], Optional[torch.Tensor]]:
        """The deferred requests ``request_ids`` that still run, and their held logits
        (len, V), no longer held: to be sampled (every rank alike)."""
        taken = [self._held.pop(i) for i in request_ids if i in self._held]
        taken = [(request, row) for request, row in taken if running.get(request.id) is request]
        if not taken:
            return [], None
        return [request for request, _ in taken], torch.cat([row for _, row in taken])

    def forget_held(self, running: Mapping[int, RunningRequest]) -> None:
        """Let go of the held logits of the requests that no longer run (ended, or preempted:
        a resumed request computes its logits again)."""
        for request_id, (request, _) in list(self._held.items()):
            if running.get(request_id) is not request:
                del self._held[request_id]

    def wait_for_masks(self, timeout: float = MASK_POLL_S) -> None:
        """(First rank.)  Wait until a deferred request's mask is ready, at most ``timeout``:
        for a step with nothing else to do."""
        futures = [job.future for request, _ in self._held.values() if (job := self._jobs.get(request))]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def too_slow(self, request: RunningRequest) -> GrammarTooSlow:
        """The error of a request whose mask is overdue (the same on every rank)."""
        grammar = request.handle.settings.grammar if request.handle is not None else None
        param = "tools" if grammar is not None and grammar.kind == "tool_choice" else "response_format"
        return GrammarTooSlow(
            f"{param}: the grammar took longer than {self.mask_timeout_s:g} s to say which tokens may follow the "
            f"{len(request.generated)} generated so far, this server's limit: simplify it (large or nested "
            "repetition counts such as x{20000} are what takes long)", param)

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
                errors: dict[int, BaseException], deferred: Collection[int] = ()) -> torch.Tensor:
        """Tokens (R,) on the device, :data:`FAILED` where a row failed (its error in ``errors``
        when known on the host; rows in ``skip`` are left to the finite check), :data:`DEFERRED`
        for the ``deferred`` rows (their processors run when they are sampled)."""
        for i, request in enumerate(requests):
            if request.processor is not None and i not in skip and i not in deferred:
                try:
                    logits[i : i + 1] = processed(request, logits[i : i + 1])
                except Exception as e:  # the caller's code: its error is that request's alone
                    errors[i] = e
        tokens = greedy_tokens(logits)
        for i, request in enumerate(requests):
            if i in errors or i in skip:
                tokens[i] = FAILED
            elif i in deferred:
                tokens[i] = DEFERRED
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


def _bitmask_of(ready: list[tuple[RunningRequest, MaskJob]], pin_memory: bool) -> torch.Tensor:
    """The masks of ``ready`` as one bitmask, row for row: the step's own bitmask where they
    are its rows in order (as they are unless a request was deferred or its prompt is not
    done), else gathered."""
    jobs = [job for _, job in ready]
    outs = [job.bitmask() for job in jobs]  # (raises a job's error)
    step = jobs[0].step_bitmask
    if step.shape[0] == len(jobs) and all(job.step_bitmask is step and job.row == k for k, job in enumerate(jobs)):
        return step
    bitmask = torch.empty((len(outs), outs[0].shape[1]), dtype=torch.int32, pin_memory=pin_memory)
    return torch.cat(outs, out=bitmask)


def processed(request: RunningRequest, row: torch.Tensor) -> torch.Tensor:
    """``request``'s logits processor applied to its logits ``row`` (1, V), checked: the same
    shape, no NaN or +inf, and at least one token left possible."""
    history = torch.tensor([request.tokens_so_far()], device=row.device)
    out = cast(LogitsProcessor, request.processor)(history, row.clone())  # asked of requests with one
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
