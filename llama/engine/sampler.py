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

Speculation (:mod:`llama.engine.speculative`): a decoding row that fed tokens proposed after
its pending one has logits at each fed position, and its tokens are chosen position by
position (:meth:`Sampler._verify`): at each, exactly as a step without proposals would choose
there (the request's processor given every token before it, proposals included; greedy, or a
draw from its own generator), and while the token chosen is the proposal fed next, that
proposal is *accepted* and the next position's logits are valid: the run goes on.  The first
token that differs from its proposal (or the token after the last proposal) ends the step's
run.  For a greedy request these are the argmax tokens steps without proposals give.  For a
sampled one this is the standard rejection rule (Leviathan et al., 2023) with the proposal
distribution ``q`` a point mass on the proposal ``d``, as prompt lookup's is: ``d`` is accepted
with probability ``min(1, p(d) / q(d)) = p(d)``, and when it is not, the token is drawn from
``max(0, p - q)`` normalised, which is ``p`` with ``d``'s mass removed: exactly the law of a draw
from ``p`` that is not ``d``.  Drawing from ``p`` and comparing is that rule, and it draws as
many numbers from the request's generator, in the same order, as steps without proposals would:
a seeded request gives the same tokens whether or not it speculated, and whatever shared its
batch (tests/test_speculative.py checks the distribution on a small vocabulary).  A draft
model's proposals for a sampled request are drawn from a ``q`` of its own
(:mod:`llama.engine.draft`), given with them: each goes through the general rule
(:meth:`Sampler._draft_rule`: a uniform number decides acceptance, ``max(0, p - q)`` is drawn
from on rejection), and the token after the last accepted one is drawn from ``p`` as a step
would.  The output is again a draw from exactly the target's distribution, but the generator
is read differently than without proposals: a seeded request gives the same text for the same
seed and the same speculation (tests/test_speculative_draft.py checks the distribution).

A constrained row that verifies proposals has every verified position masked, each with the
mask of its grammar's state after the tokens before it (the accepted proposals): the mask is
part of ``p``, and the rule is unchanged.  :meth:`Sampler.start_masks` computes them while the
model runs, the first on the request's matcher as for any step, the others one after the
other on a copy advanced through the proposals (the request's own matcher then takes the
accepted tokens and the chosen one, as it would one step at a time; the copy is dropped).
The per-step budget holds for each position: the step waits for them until the same
deadline as for one mask; the positions whose masks are not ready then are not verified
(the row's run ends at the last that has its mask, whose token is drawn as usual), a mask
that alone took longer than :attr:`Sampler.mask_budget_s` stops the ones after it, a row
whose first mask is late is deferred as without proposals (verifying none), and a request
whose masks were slow proposes nothing (:meth:`Sampler.grammar_allows`) until they are fast
again.  Proposals the grammar forbids were cut before the step (the same method), so each
proposal verified has its position's mask unless that mask was late.

The host reads the device once per step, for the chosen tokens: the finite check and
every sampling setting run on the device, a failed row marked by a token id below 0.
Only the rows that failed are read again, to say why; and a logits processor (the
caller's code, on host-visible logits) costs reads of its own."""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from typing import Collection, Mapping, Optional, Sequence, cast

import torch

from llama.engine.requests import LogitsProcessor, RequestSettings, RunningRequest
from llama.engine.sampling import NO_TOKEN, RowSummary, draw, greedy_tokens, sample_next_token, sampling_distribution
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

    def sample(self, requests: list[RunningRequest], logits: torch.Tensor, rows: Optional[list[int]] = None,
               proposals: Optional[Mapping[int, list[int]]] = None,
               proposal_probs: Optional[Mapping[int, torch.Tensor]] = None,
               summary: Optional[RowSummary] = None) -> tuple[list[int],
                                                                                     dict[int, BaseException],
                                                                                     dict[int, int]]:
        """Each request's next token (the first rank's choice, on every rank), the errors of
        the rows that failed (by row), and how many of its proposals each row that verified
        some accepted (by row), the same on every rank.

        ``logits`` (N, V): request i's at row ``rows[i]`` (default: row i).  A request that
        verifies proposals (``proposals``, by index into ``requests``: the tokens fed after its
        pending one) has a row for each fed position from there, in order; it accepts its
        proposals while each is the token chosen at the position before it, and its token is
        the one chosen at the first position whose proposal it did not accept (or after the
        last).  ``proposal_probs`` (by index, as ``proposals``): for a sampled request whose
        proposals were drawn from a distribution ``q`` of their own (a draft model's), ``q``
        at each proposed position (at least len(proposals), V): those proposals go through
        the general rejection rule (:meth:`_draft_rule`).  See :mod:`llama.engine.sampler` for
        why that is exact.  ``summary``: of ``logits`` (one row per request, no proposals), the
        compiled step's greedy tokens and row sums, used for the rows no grammar or processor
        changes."""
        rows = list(range(len(requests))) if rows is None else rows
        proposals = proposals or {}
        # Rows whose logits may hold NaN or Inf: the sum is non-finite where any logit is, or
        # where finite logits overflowed it (told apart below, only for such rows).  Every rank
        # holds the same logits (gathered), so every rank finds the same rows.
        total = logits.sum(-1) if summary is None else summary.totals
        # (N,) on the device: a difference of infinities (or a NaN) is NaN, any finite number's
        # with itself 0: two kernels, where ~isfinite runs five (abs, !=, ==, *, ~)
        suspect = torch.isnan(total - total)
        if self.n_decodable < logits.shape[-1]:
            logits[:, self.n_decodable :] = float("-inf")
        errors: dict[int, BaseException] = {}
        accepted = {i: 0 for i in proposals}
        if self.first_rank:
            deferred, with_masks = self._apply_grammars(requests, logits, rows, proposals)
            # A constrained row verifies the proposals whose positions have their masks.
            verified = {i: proposed[: with_masks.get(i, len(proposed))] for i, proposed in proposals.items()}
            # A processor is the caller's code on the logits: keep the rows that fail the
            # finite check from it (finding them reads the device, as the processor does).
            with_processor = any(r.processor is not None for i, r in enumerate(requests) if i not in proposals)
            suspect_rows = set(suspect.nonzero().flatten().tolist()) if with_processor else set()
            suspects = [i for i, row in enumerate(rows) if row in suspect_rows and i not in proposals]
            skip = set(self._non_finite_rows(requests, logits, suspects, rows))
            # Where no row's logits change below (a grammar's mask, a processor), the step's greedy
            # tokens are those of these logits
            greedy = summary.greedy if summary is not None and all(
                r.matcher is None and r.processor is None for r in requests) else None
            tokens, accepted = self._choose(requests, logits, rows, skip, errors, deferred, verified, suspect,
                                            proposal_probs or {}, greedy)
        else:
            tokens = torch.zeros(len(requests), dtype=torch.long, device=logits.device)
        shared = tokens
        if proposals:  # how many each accepted travels with the tokens
            counts = torch.tensor([accepted.get(i, 0) for i in range(len(requests))], device=tokens.device)
            shared = torch.cat([tokens, counts])
        if self.multi_rank:
            shared = distributed.broadcast_from_first_rank(shared)
        values = torch.cat([shared, suspect.long()]).tolist()  # the step's one read of the device
        chosen, suspects = values[: len(requests)], values[len(shared) :]
        if proposals:
            accepted = {i: values[len(requests) + i] for i in proposals}
        failed_at = self._non_finite_runs(requests, logits, rows, accepted, suspects)
        non_finite = {i: error for i, (error, _) in failed_at.items()}
        for i, (_, position) in failed_at.items():
            if i in accepted:  # it accepted the proposals before the position that failed
                accepted[i] = position
        failed = [i for i, t in enumerate(chosen) if t == FAILED and i not in non_finite]
        if self.first_rank:
            for i in failed:  # a sync-free draw that found nothing to draw
                errors.setdefault(i, ValueError("cannot sample from a row whose weights are all zero or not finite"))
        if self.multi_rank and failed:
            errors = self._shared_errors(failed, errors)
        errors = {**{i: e for i, e in errors.items() if i not in non_finite}, **non_finite}
        for i, token in enumerate(chosen):
            if token == DEFERRED and i not in errors:  # its logits wait for its mask, on every rank
                self._held[requests[i].id] = (requests[i], logits[rows[i] : rows[i] + 1].clone())
        self._advance_grammars(requests, chosen, errors, proposals, accepted)
        return chosen, errors, accepted

    def _non_finite_runs(self, requests: list[RunningRequest], logits: torch.Tensor, rows: list[int],
                         accepted: Mapping[int, int], suspects: list[int]) -> dict[int, tuple[NonFiniteError, int]]:
        """The requests whose logits hold NaN or Inf at a position their tokens were chosen from
        (their first row, and for a run of accepted proposals each row up to the one after
        them; ``suspects``: by row), with the error of the first such position and its place
        in the run."""
        found: dict[int, tuple[NonFiniteError, int]] = {}
        for i, request in enumerate(requests):
            for j in range(accepted.get(i, 0) + 1):
                if suspects[rows[i] + j]:
                    error = self._non_finite_rows([request], logits, [0], [rows[i] + j], offset=j)
                    if error:
                        found[i] = (error[0], j)
                        break
        return found

    def start_masks(self, requests: list[RunningRequest], proposals: Optional[Mapping[int, list[int]]] = None) -> None:
        """Begin computing the grammar masks of the constrained ``requests`` (those the step
        under way may sample), each on a worker thread, so that llguidance works on the host
        while the model runs; :meth:`sample` takes them, waiting at most until
        :attr:`mask_budget_s` from now.  A matcher changes only when a sampled token advances
        it, after the step's masks are used, so the early masks are the ones the step needs;
        a request whose mask is still computing (it was deferred, or its prompt is not done)
        keeps that one.  ``proposals`` (by request id: the tokens a decoding row feeds after
        its next one): the masks of the positions after them too, in turn, until the step
        takes them (:class:`~llama.structured.matcher.MaskJob`)."""
        proposals = proposals or {}
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
                                                                slow=request in self._slow,
                                                                proposed=proposals.get(request.id, ()),
                                                                max_mask_s=self.mask_budget_s)

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

    def grammar_allows(self, request: RunningRequest, proposed: list[int]) -> int:
        """(First rank.)  How many of ``proposed`` (the tokens ``request`` would feed after its
        next one) the step may verify: all for a free request; for a constrained one, those
        its grammar allows in turn (a proposal it forbids could never be accepted), and none
        while its mask is still computing (its matcher is busy) or its masks were slow (each
        verified position needs one more)."""
        matcher = request.matcher
        if matcher is None:
            return len(proposed)
        if request in self._jobs or request in self._slow:
            return 0
        return matcher.valid_prefix(proposed)

    def _apply_grammars(self, requests: list[RunningRequest], logits: torch.Tensor, rows: list[int],
                        proposals: Mapping[int, list[int]]) -> tuple[set[int], dict[int, int]]:
        """Mask the rows of constrained requests (request i's at ``rows[i]``) to the tokens their
        grammars allow, with the masks :meth:`start_masks` began where it did (else computed
        now); the requests whose masks are not ready by the step's deadline are left as they
        are: deferred (their indices returned).  A constrained row that verifies ``proposals``
        (by index) has the rows after its first masked too, each with the mask after the
        proposals before it, as far as those masks are ready by the deadline: how many of its
        proposals have their masks is returned (by index; the row verifies only those)."""
        deferred: set[int] = set()
        with_masks: dict[int, int] = {}
        index_of = {request.id: i for i, request in enumerate(requests)}
        row_of = {request.id: rows[i] for i, request in enumerate(requests)}
        deadline = self._deadline if self._deadline is not None else time.monotonic() + self.mask_budget_s
        for masker, group in self._by_masker(requests):
            after: list[tuple[int, torch.Tensor]] = []  # (first row, the masks of the rows after it)
            late = [r for r in group if r not in self._jobs]  # start_masks did not see them (tests, benchmarks)
            if late:
                masker.apply(logits, [row_of[r.id] for r in late], [cast(GrammarMatcher, r.matcher) for r in late])
                for request in late:
                    i = index_of[request.id]
                    if i in proposals:
                        masks = torch.empty((len(proposals[i]), masker.tokenizer.words_per_mask), dtype=torch.int32)
                        matcher = cast(GrammarMatcher, request.matcher).copy()
                        with_masks[i] = sum(1 for _ in masker.fill_after(matcher, proposals[i], masks))
                        after.append((rows[i], masks[: with_masks[i]]))
            ready: list[tuple[RunningRequest, MaskJob]] = []
            for request in group:
                job = self._jobs.get(request)
                if job is None:
                    continue
                # A request whose last mask was slow gets no wait: it is deferred unless its mask is ready.
                n = job.take(time.monotonic() if request in self._slow else deadline)
                if n:
                    ready.append((request, job))
                    if job.seconds() > self.mask_budget_s:
                        self._slow.add(request)
                    else:
                        self._slow.discard(request)
                    i = index_of[request.id]
                    if i in proposals:
                        with_masks[i] = min(n - 1, len(proposals[i]))
                        if with_masks[i] and job.draft_bitmask is not None:
                            after.append((rows[i], job.draft_bitmask[: with_masks[i]]))
                else:
                    deferred.add(index_of[request.id])
                    self._slow.add(request)
                    logger.debug("request %d: its mask is not ready after %.3f s; it waits", request.id,
                                 job.seconds())
            if ready:
                masker.apply_bitmask(logits, [row_of[r.id] for r, _ in ready], _bitmask_of(ready, logits.is_cuda))
            after = [(first, masks) for first, masks in after if masks.shape[0]]
            if after:
                bitmask = torch.empty((sum(m.shape[0] for _, m in after), masker.tokenizer.words_per_mask),
                                      dtype=torch.int32, pin_memory=logits.is_cuda)
                masker.apply_bitmask(logits, [first + 1 + j for first, m in after for j in range(m.shape[0])],
                                     torch.cat([m for _, m in after], out=bitmask))
        return deferred, with_masks

    def _advance_grammars(self, requests: list[RunningRequest], chosen: list[int], errors: dict[int, BaseException],
                          proposals: Mapping[int, list[int]], accepted: Mapping[int, int]) -> None:
        """Give each constrained request's matcher its tokens this step (not a deferred row's):
        the proposals it accepted, then its chosen token (none after an end token).  A token the
        grammar did not allow cannot be chosen from a masked row; should it be, the matcher
        fails, its next mask allows only the request's end tokens, and the reply ends there (on
        every rank alike, as they follow the first rank's tokens)."""
        for i, request in enumerate(requests):
            if request.matcher is None or (chosen[i] == DEFERRED and i not in errors):
                continue
            self._jobs.pop(request, None)  # its masks were of the states the tokens leave
            if i in errors:
                continue
            for token in proposals.get(i, [])[: accepted.get(i, 0)] + [chosen[i]]:
                if request.matcher.is_ended:
                    break
                try:
                    request.matcher.consume(token)
                except ValueError as e:
                    logger.warning("request %d: %s; ending its constrained reply", request.id, e)
                    break

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

    def _non_finite_rows(self, requests: list[RunningRequest], logits: torch.Tensor, suspects: list[int],
                         rows: list[int], offset: int = 0) -> dict[int, NonFiniteError]:
        """Of the ``suspects`` (indices into ``requests``, request i's logits at ``rows[i]``), those
        whose logits hold NaN or Inf, with their errors (``offset``: the logits are those of the
        token that many after the request's next)."""
        errors = {}
        for i in suspects:
            request = requests[i]
            try:
                # the decodable ids only: those beyond are -inf by now (never sampled)
                check_finite_logits(logits[rows[i], : self.n_decodable], f"the step choosing token "
                                    f"{len(request.generated) + 1 + offset} of request {request.id}")
            except NonFiniteError as e:
                errors[i] = e
        return errors

    def _choose(self, requests: list[RunningRequest], logits: torch.Tensor, rows: list[int], skip: set[int],
                errors: dict[int, BaseException], deferred: Collection[int], proposals: Mapping[int, list[int]],
                suspect: torch.Tensor, proposal_probs: Mapping[int, torch.Tensor],
                greedy: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[int, int]]:
        """Tokens (R,) on the device, :data:`FAILED` where a row failed (its error in ``errors``
        when known on the host; rows in ``skip`` are left to the finite check), :data:`DEFERRED`
        for the ``deferred`` rows (their processors run when they are sampled); and how many
        of its ``proposals`` each row that verified some accepted (:meth:`_verify`).  ``greedy``:
        each row's argmax, where known (a row-for-row summary of logits that nothing changes)."""
        for i, request in enumerate(requests):
            if request.processor is not None and i not in skip and i not in deferred and i not in proposals:
                row = rows[i]
                try:
                    logits[row : row + 1] = processed(request, logits[row : row + 1])
                except Exception as e:  # the caller's code: its error is that request's alone
                    errors[i] = e
        greedy = greedy_tokens(logits) if greedy is None else greedy  # (N,)
        tokens = greedy if len(rows) == logits.shape[0] else greedy[torch.tensor(rows, device=logits.device)]
        for i, request in enumerate(requests):
            if i in proposals:
                continue
            if i in errors or i in skip:
                tokens[i] = FAILED
            elif i in deferred:
                tokens[i] = DEFERRED
            elif not request.sampling.greedy:
                row = rows[i]
                try:
                    tokens[i] = sample_next_token(logits[row : row + 1], request.sampling, request.generator,
                                                  sync_free=self.sync_free)[0]
                except (ValueError, RuntimeError) as e:
                    errors[i] = e
                    tokens[i] = FAILED
        accepted = {}
        for i, proposed in proposals.items():
            if i in deferred:  # its first mask is late: it verifies nothing, and waits
                tokens[i], accepted[i] = DEFERRED, 0
                continue
            token, accepted[i] = self._verify(i, requests[i], logits, rows[i], proposed, greedy, suspect, errors,
                                              proposal_probs.get(i))
            tokens[i] = token
        return tokens, accepted

    def _verify(self, i: int, request: RunningRequest, logits: torch.Tensor, first: int, proposed: list[int],
                greedy: torch.Tensor, suspect: torch.Tensor, errors: dict[int, BaseException],
                q: Optional[torch.Tensor] = None) -> tuple[int, int]:
        """(First rank.)  Row ``i``'s token and how many of its ``proposed`` tokens it accepts,
        from its logits at rows ``first`` .. ``first + len(proposed)``: at each position in turn,
        the token is chosen exactly as a step without proposals would choose it there (its
        processor given the tokens before it, proposals included; its own generator, one draw
        per position reached); the proposal after it is accepted if it is that token, and the
        first that is not ends the run, the chosen token taking its place.  With ``q`` (the
        distributions a sampled request's proposals were drawn from, row j for proposal j), each
        proposal is accepted or replaced by :meth:`_draft_rule` instead.  :data:`FAILED` where
        the position failed (its error in ``errors`` when known here)."""
        m = len(proposed)
        if request.processor is None and request.sampling.greedy:
            picks = greedy[first : first + m + 1].tolist()
            n = 0
            while n < m and picks[n] == proposed[n]:
                n += 1
            return picks[n], n
        for j in range(m + 1):
            row = first + j
            if request.processor is not None:
                if bool(suspect[row]) and self._non_finite_rows([request], logits, [0], [row], offset=j):
                    return FAILED, j  # the check after sampling says why
                try:
                    logits[row : row + 1] = processed(request, logits[row : row + 1], proposed[:j])
                except Exception as e:  # the caller's code: its error is that request's alone
                    errors[i] = e
                    return FAILED, j
            if request.sampling.greedy:
                token = int(greedy_tokens(logits[row : row + 1])[0])
            elif q is not None and j < m:
                try:
                    token = self._draft_rule(logits[row : row + 1], request, proposed[j], q[j])
                except (ValueError, RuntimeError) as e:
                    errors[i] = e
                    return FAILED, j
            else:
                try:
                    token = int(sample_next_token(logits[row : row + 1], request.sampling, request.generator,
                                                  sync_free=self.sync_free)[0])
                except (ValueError, RuntimeError) as e:
                    errors[i] = e
                    return FAILED, j
            if j == m or token != proposed[j]:
                return token, j
        raise AssertionError("a run ends at its last position")

    @staticmethod
    def _draft_rule(logits: torch.Tensor, request: RunningRequest, proposal: int, q: torch.Tensor) -> int:
        """The standard rejection rule (Leviathan et al., 2023) for a ``proposal`` drawn from
        ``q`` (V,): with ``p`` the distribution a step would draw from ``logits`` (1, V)
        (:func:`~llama.engine.sampling.sampling_distribution`), the proposal is accepted
        (returned) with probability ``min(1, p(d) / q(d))``; otherwise a token is drawn from
        ``max(0, p - q)`` normalised, which never holds ``d``.  Both draws use the request's own
        generator (a uniform number, then the draw on rejection)."""
        p = sampling_distribution(logits, request.sampling)[0]  # (V,) float64
        q = q.to(p)
        u = torch.rand((), dtype=torch.float64, device=p.device, generator=request.generator)
        if bool(u * q[proposal] < p[proposal]):  # u < p(d) / q(d), without dividing by q(d)
            return proposal
        residual = (p - q).clamp_(min=0)
        if not bool(residual.sum() > 0):  # p <= q everywhere, so p == q: rejection was impossible (rounding)
            residual = p
        return int(draw(residual.unsqueeze(0), request.generator)[0])

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


def processed(request: RunningRequest, row: torch.Tensor, after: Sequence[int] = ()) -> torch.Tensor:
    """``request``'s logits processor applied to its logits ``row`` (1, V), checked: the same
    shape, no NaN or +inf, and at least one token left possible.  ``after``: the tokens fed
    after the request's so far (proposals) before the position of ``row``."""
    history = torch.tensor([request.tokens_so_far() + list(after)], device=row.device)
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
