"""Speculative decoding: proposing the tokens a request may generate next, and when to.

A decoding step feeds each request its one pending token.  With speculation a request also
feeds ``d1 .. dk``, tokens *proposed* for the positions after it, at positions ``n_fed ..
n_fed + k`` of the same forward pass (every other row of the batch as before), and the
model's logits at every one of those positions say which proposals it agrees with: the
sampler (:meth:`~llama.engine.sampler.Sampler.sample`) chooses the token at the first
position exactly as it would without proposals; while that token is the proposal fed after
it, the logits of the next position are valid too, and it goes on.  So one step may give a
request up to ``k + 1`` tokens, which are exactly the tokens (greedy) or a draw from exactly
the distribution (sampled) that ``k + 1`` steps without proposals would give: see
:mod:`llama.engine.sampler` for the rule.  The keys and values written at rejected positions
lie beyond the request's fed count, where its next step overwrites them; they never enter
the prefix cache (:meth:`~llama.engine.scheduler.Scheduler.update_from_sampled`).

This module holds what proposes (:class:`Proposer`; :class:`NgramProposer`, prompt lookup;
a :class:`RowProposer` proposes for a step's rows at once: the draft model of
:mod:`llama.engine.draft`) and the rule that decides how many tokens each decoding row
proposes in a step (:class:`Speculator`).  They read requests and change none, and they
decide from the requests' tokens and from what earlier steps accepted, which every rank holds
alike.  So under torchrun every rank computes the same proposals from the same tokens, and
no n-gram proposal travels between ranks (the first rank's sampled tokens, which every rank
receives, are what keeps them the same); a draft model, run by every rank (whole on each,
or sharded as the target is), keeps a KV cache of its own per request (released when the request ends or is preempted:
:meth:`Speculator.release`), and its proposals are the first rank's (one small broadcast).
A draft's proposals for a sampled request are drawn from its own distribution ``q``
(:attr:`Speculator.probs`), which the sampler's rejection rule takes with them.

When it pays: a decoding step reads every weight to produce one token per row, so checking
``k`` more tokens costs little while a step feeds few positions; with many the step is no
longer bound by reading the weights, and the extra positions cost about what they would as rows
of their own (:data:`MAX_STEP_POSITIONS`).  So a step proposes only while it has at most
:data:`MAX_SPECULATING_ROWS` decoding rows (``disable_by_batch_size``), and its rows propose at
most as many tokens as keep its pass within :data:`MAX_STEP_POSITIONS` positions.  Within those
bounds each request proposes what its measured gain is worth against the measured cost
(:meth:`Speculator.best`):

- *Gain.*  A request's proposals are accepted, each after the ones before it, with a
  probability ``a`` estimated from its recent verifying steps (:class:`Acceptance`: accepted
  proposals ``hits`` and runs cut short ``misses``, each step's added to the earlier ones halved,
  ``a = hits / (hits + misses)``, the geometric law's estimate).  A step in which it proposes
  ``k`` gives it ``E(k) = 1 + a + ... + a**k`` tokens on average (its accepted run and the token
  after it: :func:`expected_tokens`); a plain step gives 1.
- *Cost.*  The engine times its own steps (plan, proposing (a draft's forwards included), the
  model's pass, sampling, bookkeeping: :meth:`Speculator.observe`), by shape, steps with prompt
  chunks left out: ``C(r, 1 + k)`` is the time of a step of ``r`` decoding rows feeding
  ``1 + k`` positions each over that of a plain step of ``r`` rows (each shape's time the
  fastest of its last :data:`TIME_WINDOW` steps, which other work on the machine disturbs
  least, counted once :data:`MIN_TIMED` steps of it and of the plain shape were timed; the first
  3 steps of each number of rows are plain, and one again after :data:`REMEASURE_STEPS`
  verifying ones, by proposing nothing that step).  Before a shape is measured, ``C = 1 + s k``
  with ``s`` the mean cost per proposed position of the measured shapes of as many rows, or
  before any, 0.1 (:data:`PRIOR_COST_PER_POSITION`; the CPU's verifying passes cost 0.05 to 0.21
  per position below).
- *Rule.*  A request proposes the ``k`` (1 to its allowance) of the largest ``E(k) / C(r, 1 +
  k)``, its tokens per second against a plain step's, while that is above 1; a verifying step
  after which no ``k`` is above 1 pauses it for :data:`PAUSE_TOKENS` generated tokens, and each
  pause in a row for twice as long as the last (up to :data:`MAX_PAUSE_TOKENS`); after a pause it
  probes with the ``k`` that pays best, at least 1, from ``a = 1/2`` (:data:`RETRY_HITS`).
  A request starts from ``a = 3/4`` worth two steps (:data:`START_HITS`), or with ``adaptive``
  from the engine's recent acceptance over all requests (:attr:`Speculator.recent`, the same
  average), so that a proposer found poor on earlier requests is not tried at length on each new one.
  Numbers: an always-wrong proposer with ``C = 1.4`` at ``k = 4`` and ``1.1`` at ``k = 1`` (the
  prior) proposes 4, 2, then 1 token and pauses (``a``: 3/4, 3/8, 3/16, 3/32); with measured costs
  of 1.8 to 2.5 for ``k`` = 1 to 4 it proposes 4 once and pauses.  An always-right one (``a``
  towards 1, ``E(4) = 5``) proposes 4 up to ``C(1, 5) = 5``.  Measured (CPU time, 1 thread, the
  demo model at batch 1): bfloat16 compiled, a plain step 7.0 ms and a verifying one 8.0-9.0 ms
  (``C`` 1.15-1.28 for ``k`` = 1 to 4); float32 eager, 9.9-10.7 ms and 16.3 ms (``C`` about
  1.6: a plain float32 step is a matrix-vector product), where the rule mostly proposes 1 token.

Ranks and seeds.  Step times differ by rank, so only the first rank's count: it shares the
ratios ``C`` with the step's decisions whenever one moved by :data:`SHARE_CHANGE` (2 %) or more
(:meth:`Speculator.costs_to_share`; every rank, the first included, then reads them at the
step's start: :meth:`Speculator.use_costs`), and everything else the rule reads (acceptance,
which steps were plain, when to time one) comes from the plans and the sampled tokens, which
every rank holds alike.  Greedy requests get the same tokens whatever was proposed.  A sampled
request's n-gram proposals are verified by drawing from the target as a plain step would
(:mod:`llama.engine.sampler`), so its seed gives the same text whatever the timing decided.  A
draft's sampled proposals read the request's generator differently from a plain step, so with
``adaptive`` (the default) its text for a seed follows the target's distribution but may differ
from one run to the next as the times do; ``"adaptive": False`` (fixed costs, each request's own
acceptance alone) makes it the same text for the same seed and settings.

Requests with a grammar (structured output, forced tool calls) propose too.  Their proposals
are cut at the first token the grammar does not allow after the ones before it (on the first
rank, which alone holds the matchers; it tells the others how many are kept, as every rank must
feed the same positions: :meth:`Engine._proposals_within_grammars
<llama.engine.core.Engine._proposals_within_grammars>`), so that no verified position goes to a
token that could never be accepted.  Each verified position's token is chosen under the mask of
the grammar's state after the tokens before it, proposals included, which are computed while
the model runs, one after the other on a copy of the request's matcher, and are as bounded in
time as a step's one mask is: the positions whose masks are not ready by the step's mask
deadline are not verified (the run ends at the last that has one), and a request whose masks
are slow proposes nothing (:mod:`llama.engine.sampler`).  The mask is part of the target's
distribution, so the rule stays exact.

Where decoding steps are compiled, so are the steps that verify: a verification step of its
own (:meth:`~llama.engine.runner.ModelRunner.compile`), compiled and warmed up with the
decoding step when the engine is built, for every (rows, positions per row) a step may verify
(:meth:`SpeculativeConfig.verified_shapes`) at every context bucket, so that none compiles
while serving.  On the CPU two graphs (one row, several rows) serve all its shapes, and a
first start takes about as long again as without speculation
(:data:`~llama.engine.runner.VERIFY_COMPILE_SHARE`); on a GPU each shape is captured as a
CUDA graph.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from os import PathLike
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch

    from llama.engine.requests import RunningRequest

__all__ = ["Proposer", "RowProposer", "NgramProposer", "SpeculativeConfig", "check_speculative", "Acceptance",
           "Speculator", "MAX_SPECULATING_ROWS", "MAX_STEP_POSITIONS"]

METHODS = ("ngram", "draft")
OPTIONS = ("method", "num_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
           "draft_tensor_parallel_size")
BOOL_OPTIONS = ("adaptive",)
# The longest and shortest n-grams prompt lookup matches by default (vLLM's prompt_lookup_max
# and prompt_lookup_min).  Longer matches are tried first: they are right more often.
DEFAULT_LOOKUP_MAX = 3
DEFAULT_LOOKUP_MIN = 1
# Most tokens one request may propose in a step: beyond it, a wrong early proposal wastes
# the rest, and the step's extra positions stop being nearly free (vLLM's k=32 slowed batch 1).
MAX_NUM_TOKENS = 16

# A step with more decoding rows than this proposes nothing (the default of the option
# disable_by_batch_size) ...
MAX_SPECULATING_ROWS = 4
# ... and its rows propose so few tokens that its decoding pass feeds at most this many
# positions (rows x (1 + the most proposed by a row): shorter rows are padded): at most 4
# tokens a row with 2 rows, 2 with 3, 1 with 4.  What a decoding pass cost with 4 proposals a
# row against without (CPU time of 1 thread on a 2-core Xeon, the 150m shape, context 128,
# BENCHMARKS.md "Speculative decoding"): float32 1.84x (1 row: its plain pass is a
# matrix-vector product), 1.22x (2 rows), 1.29x (4), 1.46x (8), 2.22x (16); bfloat16 1.21x, 1.31x,
# 2.10x, 2.95x, 3.70x.  The pass's time follows the positions it feeds: flat up to about 10
# (bfloat16) or 20 (float32), then growing with them, as the weights stop being the cost.
# Without these rules an always-wrong proposer cost 26-60 % at every batch size; with them
# the loss was within that machine's noise.  (A GPU verifies many more positions at the cost
# of one: not measured yet.)
MAX_STEP_POSITIONS = 10

# Each verifying step discounts what a request's earlier steps said of its proposals by this
# factor before counting its own (an exponential average over its recent steps) ...
ACCEPTANCE_DECAY = 0.5
# ... starting from 3 accepted of 4 proposals, worth two steps' evidence (Acceptance's defaults;
# with ``adaptive``, from the engine's recent requests instead: :attr:`Speculator.recent`), and
# from 1 of 2, worth one step, after a pause.
START_HITS, START_MISSES = 1.5, 0.5
RETRY_HITS, RETRY_MISSES = 0.5, 0.5
# A request whose proposals do not pay stops proposing for PAUSE_TOKENS generated tokens, twice
# as many each time it is found there again in a row (at most MAX_PAUSE_TOKENS), then probes.
PAUSE_TOKENS = 16
MAX_PAUSE_TOKENS = 256
# What a step of a shape costs against a plain step of as many rows, before it is measured (and
# always, with ``adaptive`` off): 1 + this x the positions a row feeds beyond its own token.  The
# CPU's verifying passes cost 0.05 (bfloat16) to 0.21 (float32, 1 row) per position (above);
# small and fast models pay more of a step on the host, which measuring finds.
PRIOR_COST_PER_POSITION = 0.1
# Step times (first rank, steps without prefill): a shape's time is the fastest of its last
# TIME_WINDOW steps.  Other work on the machine only ever makes a step slower, so the fastest is
# what the step itself costs (a mean moved with the machine's load: on a loaded 2-core machine
# it put a verifying step of the demo model at 2-3x a plain one, whose CPU time is 1.2-1.3x) ...
TIME_WINDOW = 16
# ... counted once it has at least MIN_TIMED steps, and the plain step of as many rows too (a
# single step that other work slowed would otherwise pause a request for its whole reply): the
# first MIN_TIMED steps of each number of rows propose nothing, to time plain steps ...
MIN_TIMED = 3
# ... a plain step of r rows is timed again (the step proposes nothing) after this many
# verifying steps of r rows without one ...
REMEASURE_STEPS = 64
# ... and the ratios are shared with every rank when one moved by this share or more.
SHARE_CHANGE = 0.02


class Proposer(Protocol):
    """Proposes the tokens that may follow a sequence (pure: it changes nothing)."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` token ids that may come after ``tokens`` (the request's prompt and
        what it generated, its pending token last); none where it has no guess."""
        ...


@runtime_checkable
class RowProposer(Protocol):
    """Proposes for a step's rows at once, keeping state of its own per request (a draft
    model: :class:`~llama.engine.draft.DraftProposer`)."""

    def propose_rows(self, rows: Sequence[tuple[RunningRequest, int]]) -> tuple[dict[int, list[int]],
                                                                                 dict[int, torch.Tensor]]:
        """For each (request, k) of ``rows``: at most ``k`` tokens that may follow the request's
        tokens (its pending one last), by request id (none where it has no guess); and for the
        requests whose proposals were drawn from a distribution (sampled requests), that
        distribution at each proposed position (k', V) float, by request id."""
        ...

    def release(self, request_id: int) -> None:
        """Forget the request (it finished, failed, was cancelled or preempted): its state goes."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram`` method, llama.cpp's lookup decoding): the last ``n``
    tokens of the sequence are looked for earlier in it (prompt and output alike), ``n``
    from ``max_n`` down to ``min_n``, the most recent occurrence first; what followed that
    occurrence, up to ``k`` tokens, is proposed.  Nothing when no n-gram of those lengths
    occurs earlier.  It pays where replies repeat their context: summaries and answers that
    quote the source, code edits, extraction, and text that repeats itself."""

    def __init__(self, max_n: int = DEFAULT_LOOKUP_MAX, min_n: int = DEFAULT_LOOKUP_MIN) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {min_n} and {max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        # Plain Python: list.index finds each earlier occurrence of the last token (a C scan),
        # and the occurrences are tried from the most recent back until one matches max_n
        # tokens.  A step's lookup takes ~20-40 us on 150-250 tokens, where NumPy's took 70-400
        # (its per-call overhead; on the demo model's 7-ms CPU steps that was 4 % of a step).
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        length = len(tokens)
        if k < 1 or length < self.min_n + 1:
            return []
        last, ends, i = tokens[-1], [], -1
        try:
            while True:
                i = tokens.index(last, i + 1, length - 1)
                ends.append(i)
        except ValueError:
            pass
        top = min(self.max_n, length - 1)
        best_n, best_start = 0, -1
        for end in reversed(ends):  # the most recent first: kept unless a later one matches longer
            n = 1
            while n < top and n <= end and tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_start = n, end + 1
                if n == top:
                    break
        if best_n < self.min_n:
            return []
        return tokens[best_start : best_start + k]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Checked speculative-decoding options (:func:`check_speculative`)."""

    method: str = "ngram"
    num_tokens: int = 4  # most tokens a request proposes per step
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    # A step with more decoding rows than this proposes nothing (vLLM's option of that name).
    disable_by_batch_size: int = MAX_SPECULATING_ROWS
    draft_ckpt_dir: Optional[str] = None  # method "draft": the draft model's checkpoint
    # Method "draft": 1, the draft whole on every rank; or the target's model-parallel size, the
    # draft sharded over the ranks as the target is (vLLM's option of that name).
    draft_tensor_parallel_size: int = 1
    # Whether the rule weighs measured step times and the engine's recent acceptance (True), or
    # fixed costs and each request's own acceptance alone (False: the proposals, and a draft's
    # sampled text for a seed, depend on nothing but the request).  See the module's docstring.
    adaptive: bool = True

    def proposer(self) -> Proposer:
        if self.method == "draft":
            raise ValueError("the draft method's proposer runs a draft model: the engine makes it (Engine(draft=...))")
        return NgramProposer(self.prompt_lookup_max, self.prompt_lookup_min)

    def verified_shapes(self, max_rows: int) -> list[tuple[int, int]]:
        """Every shape a step's decoding pass may have when it verifies proposals
        (:meth:`Speculator.proposals`), as (rows, positions per row): 1 to
        ``disable_by_batch_size`` decoding rows (at most ``max_rows``), each fed its pending
        token and as many proposed tokens as the widest row proposes (at least 1, at most
        ``num_tokens``), within :data:`MAX_STEP_POSITIONS` positions.  What the compiled
        verification step is compiled for (:meth:`~llama.engine.runner.ModelRunner.compile`)."""
        shapes = []
        for rows in range(1, min(self.disable_by_batch_size, max_rows) + 1):
            most = min(self.num_tokens, MAX_STEP_POSITIONS // rows - 1)
            shapes += [(rows, 1 + k) for k in range(1, most + 1)]
        return shapes


def check_speculative(value: Any) -> Optional[SpeculativeConfig]:
    """``speculative`` as ``Llama.build`` takes it (None, or a dict such as ``{"method":
    "ngram", "num_tokens": 4}`` or ``{"method": "draft", "draft_ckpt_dir": ..., "num_tokens":
    4}``) checked: ValueError/TypeError naming the options otherwise.  (Whether the draft's
    files exist is checked where it is loaded: :func:`llama.engine.build.build_engine`.)"""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"speculative must be None or a dict such as {{'method': 'ngram', 'num_tokens': 4}}, "
                        f"got {type(value).__name__}")
    unknown = sorted(set(value) - set(OPTIONS) - set(BOOL_OPTIONS) - {"draft_ckpt_dir"})
    if unknown:
        raise ValueError(f"speculative: unknown option(s) {unknown}; the options are "
                         f"{list(OPTIONS) + list(BOOL_OPTIONS) + ['draft_ckpt_dir']}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative: method must be one of {list(METHODS)} ('ngram': prompt lookup), "
                         f"got {method!r}")
    draft = value.get("draft_ckpt_dir")
    if method == "draft":
        if draft is None:
            raise ValueError("speculative: method 'draft' needs draft_ckpt_dir, the draft model's checkpoint "
                             "directory (one whose tokenizer is the target's, e.g. Llama 3.2 1B for Llama 3.1 8B)")
        if not isinstance(draft, (str, PathLike)):
            raise TypeError(f"speculative: draft_ckpt_dir must be a path, got {type(draft).__name__}")
    else:
        for name in ("draft_ckpt_dir", "draft_tensor_parallel_size"):
            if value.get(name) is not None:
                raise ValueError(f"speculative: {name} goes with method 'draft' (a draft model proposes); "
                                 f"method {method!r} uses none")
    options: dict[str, Any] = {}
    for name in BOOL_OPTIONS:
        if name in value:
            if not isinstance(value[name], bool):
                raise TypeError(f"speculative: {name} must be True or False, got {type(value[name]).__name__}")
            options[name] = value[name]
    for name in OPTIONS[1:]:
        if name not in value:
            continue
        n = value[name]
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"speculative: {name} must be an int, got {type(n).__name__}")
        if name in ("disable_by_batch_size", "draft_tensor_parallel_size"):
            if n < 1:
                raise ValueError(f"speculative: {name} must be >= 1, got {n}")
        elif not 1 <= n <= MAX_NUM_TOKENS:
            raise ValueError(f"speculative: {name} must be in [1, {MAX_NUM_TOKENS}], got {n}")
        options[name] = n
    config = SpeculativeConfig(method=method, draft_ckpt_dir=None if draft is None else str(draft), **options)
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(f"speculative: prompt_lookup_min ({config.prompt_lookup_min}) must not exceed "
                         f"prompt_lookup_max ({config.prompt_lookup_max})")
    return config


@dataclass(frozen=True)
class Acceptance:
    """What a request's earlier verifications say of its proposals (kept on the request,
    changed only by the scheduler's update): ``hits`` and ``misses``, the proposals accepted
    and the runs cut short by a rejected one, each step's counts added to the earlier ones
    discounted by :data:`ACCEPTANCE_DECAY` (None: nothing verified yet, the speculator's start
    counts stand in); no proposals before it has ``resume_at`` generated tokens (a pause);
    ``pauses``, the pauses in a row so far (each twice the last)."""

    hits: Optional[float] = None
    misses: Optional[float] = None
    resume_at: int = 0
    pauses: int = 0

    @staticmethod
    def of_rate(rate: float, weight: float = 2.0, **kw: int) -> Acceptance:
        """A request whose proposals were each accepted with probability ``rate``, as sure of
        it as ``weight`` steps' evidence."""
        return Acceptance(rate * weight, (1 - rate) * weight, **kw)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verifying step gives a request that proposes ``k``, each accepted (after the
    ones before it) with probability ``rate``: its accepted run and the token after it,
    ``1 + rate + ... + rate**k``."""
    return float(sum(rate**j for j in range(k + 1)))


class Speculator:
    """Decides each step's proposals: which decoding rows propose, and how many tokens
    (:meth:`proposals`); and how a verification changes a request's :class:`Acceptance`
    (:meth:`after`).  ``proposer``: instead of the method's own (benchmarks).  ``clock``: what
    the engine times its steps with (:meth:`observe`; tests give a fake one)."""

    def __init__(self, config: SpeculativeConfig, proposer: Optional[Proposer | RowProposer] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else config.proposer()
        self.clock = clock
        # The distributions the last step's sampled proposals were drawn from, by request id
        # (a RowProposer's: a draft model's); read by the sampler through the engine.
        self.probs: dict[int, torch.Tensor] = {}
        self.max_rows = config.disable_by_batch_size
        self.proposed_total = 0  # statistics: tokens proposed and fed, and of them accepted
        self.accepted_total = 0
        # What a step of (rows, positions per row) costs against a plain step of as many rows:
        # the ratios the rule reads, the same on every rank (the first rank's, shared through the
        # plan's decisions: :meth:`costs_to_share`, :meth:`use_costs`); the prior where unmeasured.
        self.costs: dict[tuple[int, int], float] = {}
        self._slopes: dict[int, float] = {}  # by rows: the measured shapes' mean cost per proposed position
        self._shared: dict[tuple[int, int], float] = {}
        self._seconds: dict[tuple[int, int], deque[float]] = {}  # first rank: each shape's last step times
        # Every rank alike (from the plans): plain steps of r rows (up to MIN_TIMED), and verifying
        # steps of r rows since a plain one of r rows.
        self._plain_steps: dict[int, int] = {}
        self._since_plain: dict[int, int] = {}
        # Every rank alike: the engine's recent requests' hits and misses (new requests start from
        # them, ``adaptive``), and the rows of the last step proposals were decided for.
        self.recent = (START_HITS, START_MISSES)
        self._rows = 1

    # -- the rule ----------------------------------------------------------------------------

    def cost(self, rows: int, width: int) -> float:
        """What a step of ``rows`` decoding rows of ``width`` positions each (the pending token and
        ``width - 1`` proposed) costs against one of ``rows`` rows of one position: measured
        (shared by the first rank); before that, ``1 + s (width - 1)`` with ``s`` the mean cost per
        proposed position of the shapes of ``rows`` rows measured, or the prior
        (:data:`PRIOR_COST_PER_POSITION`; always with ``adaptive`` off)."""
        if width <= 1:
            return 1.0
        measured = self.costs.get((rows, width))
        if measured is not None:
            return measured
        return 1.0 + self._slopes.get(rows, PRIOR_COST_PER_POSITION) * (width - 1)

    def rate(self, state: Acceptance) -> float:
        """The probability that a proposal of the request is accepted (after the ones before it)."""
        hits, misses = self._counts(state)
        return hits / (hits + misses)

    def _counts(self, state: Acceptance) -> tuple[float, float]:
        if state.hits is not None and state.misses is not None:
            return state.hits, state.misses
        if self.config.adaptive:
            return self.recent
        return START_HITS, START_MISSES

    def best(self, state: Acceptance, rows: int, most: int) -> int:
        """The number of proposals, 0 to ``most``, that gives the request the most tokens per
        second in a step of ``rows`` rows: the ``k`` of the largest ``expected_tokens(rate, k) /
        cost(rows, 1 + k)``, 0 (propose none) unless that is above 1, what a plain step gives."""
        rate = self.rate(state)
        best, value = 0, 1.0
        for k in range(1, most + 1):
            v = expected_tokens(rate, k) / self.cost(rows, 1 + k)
            if v > value:
                best, value = k, v
        return best

    def allowance(self, request: RunningRequest, rows: int = 1, most: Optional[int] = None) -> int:
        """How many tokens ``request`` may propose now in a step of ``rows`` decoding rows (at
        most ``most``): none while it may not (its settings turn it off; paused) or may generate
        at most one more token; else the number that pays best (:meth:`best`), at least 1 (a
        request found not to pay is paused after its step: :meth:`after`, so this 1 is the
        probe after a pause), and never more than it may still generate after its pending token.
        Read from what every rank holds alike."""
        if not request.settings.speculative:
            return 0
        state = request.speculation
        if len(request.generated) < state.resume_at:
            return 0
        room = request.budget - len(request.generated)  # tokens it may still generate, this step's first included
        most = min(self.config.num_tokens, room - 1, self.config.num_tokens if most is None else most)
        if most < 1:
            return 0
        return max(1, self.best(state, rows, most))

    def proposals(self, decoding: Sequence[RunningRequest]) -> dict[int, list[int]]:
        """The tokens each of a step's ``decoding`` rows proposes, by request id (rows that
        propose none are left out): none at all when the step has more than
        ``disable_by_batch_size`` rows or times a plain step (:meth:`timing_due`), and so few
        that the pass feeds at most :data:`MAX_STEP_POSITIONS` positions (every row is as wide
        as the widest)."""
        rows = len(decoding)
        most = MAX_STEP_POSITIONS // max(1, rows) - 1
        self.probs = {}
        self._rows = rows
        if rows > self.max_rows or most < 1 or self.timing_due(rows):
            return {}
        if isinstance(self.proposer, RowProposer):
            wanted = [(request, k) for request in decoding if (k := self.allowance(request, rows, most))]
            if not wanted:
                return {}
            out, self.probs = self.proposer.propose_rows(wanted)
            return {request_id: proposed for request_id, proposed in out.items() if proposed}
        out = {}
        for request in decoding:
            k = self.allowance(request, rows, most)
            if k:
                proposed = self.proposer.propose(request.tokens_so_far(), k)[:k]
                if proposed:
                    out[request.id] = proposed
        return out

    def release(self, request_id: int) -> None:
        """The request runs no more (finished, failed, cancelled) or was preempted: a proposer
        that keeps state per request (a draft model's cache) lets go of it."""
        self.probs.pop(request_id, None)
        if isinstance(self.proposer, RowProposer):
            self.proposer.release(request_id)

    def after(self, request: RunningRequest, proposed: int, accepted: int) -> Acceptance:
        """``request``'s acceptance after a step that verified ``proposed`` of its tokens and
        accepted ``accepted``; counted in the statistics (and in :attr:`recent`).  Paused when
        no number of proposals pays any more at the step's rows (:meth:`best`)."""
        self.proposed_total += proposed
        self.accepted_total += accepted
        state = request.speculation
        if not proposed:
            return state
        missed = int(accepted < proposed)
        hits, misses = self._counts(state)
        hits, misses = ACCEPTANCE_DECAY * hits + accepted, ACCEPTANCE_DECAY * misses + missed
        recent_hits, recent_misses = self.recent
        self.recent = (ACCEPTANCE_DECAY * recent_hits + accepted, ACCEPTANCE_DECAY * recent_misses + missed)
        state = Acceptance(hits, misses, state.resume_at, 0 if accepted else state.pauses)
        most = min(self.config.num_tokens, MAX_STEP_POSITIONS // self._rows - 1)
        if self.best(state, self._rows, max(1, most)):
            return state
        pause = min(PAUSE_TOKENS << request.speculation.pauses, MAX_PAUSE_TOKENS)
        return Acceptance(RETRY_HITS, RETRY_MISSES, len(request.generated) + pause, request.speculation.pauses + 1)

    # -- what steps cost ---------------------------------------------------------------------

    def timing_due(self, rows: int) -> bool:
        """Whether a step of ``rows`` decoding rows proposes nothing so as to time a plain step
        (``adaptive``): fewer than :data:`MIN_TIMED` of that many rows timed yet, or
        :data:`REMEASURE_STEPS` verifying ones since the last.  Decided from the plans, the same on
        every rank."""
        if not self.config.adaptive:
            return False
        return self._plain_steps.get(rows, 0) < MIN_TIMED or self._since_plain.get(rows, 0) >= REMEASURE_STEPS

    def observe(self, rows: int, width: int, mixed: bool, seconds: Optional[float]) -> None:
        """A step ran ``rows`` decoding rows of ``width`` positions each (1: none proposed),
        with prompt chunks too (``mixed``: its time is not a decoding step's), in ``seconds``
        (the first rank's plan, pass, sampling and bookkeeping; None on the other ranks)."""
        if rows < 1 or mixed:
            return
        if width == 1:
            self._since_plain[rows] = 0
            self._plain_steps[rows] = min(MIN_TIMED, self._plain_steps.get(rows, 0) + 1)
        else:
            self._since_plain[rows] = self._since_plain.get(rows, 0) + 1
        if seconds is None or not self.config.adaptive:
            return
        self._seconds.setdefault((rows, width), deque(maxlen=TIME_WINDOW)).append(seconds)

    def costs_to_share(self) -> Optional[dict[tuple[int, int], float]]:
        """(First rank.)  The measured ratios (:meth:`cost`) when one is new or moved by
        :data:`SHARE_CHANGE` or more since they were last shared; else None."""
        ratios = {}
        for (rows, width), times in self._seconds.items():
            plain = self._seconds.get((rows, 1))
            if width > 1 and plain and len(plain) >= MIN_TIMED and len(times) >= MIN_TIMED and min(plain) > 0:
                ratios[(rows, width)] = round(min(times) / min(plain), 3)
        changed = any(key not in self._shared or abs(value / self._shared[key] - 1) >= SHARE_CHANGE
                      for key, value in ratios.items())
        if not changed:
            return None
        self._shared = ratios
        return ratios

    def use_costs(self, costs: Mapping[tuple[int, int], float]) -> None:
        """The ratios the first rank shared (every rank, the first included, at a step's start)."""
        self.costs = dict(costs)
        slopes: dict[int, list[float]] = {}
        for (rows, width), ratio in self.costs.items():
            slopes.setdefault(rows, []).append((ratio - 1) / (width - 1))
        self._slopes = {rows: sum(values) / len(values) for rows, values in slopes.items()}
