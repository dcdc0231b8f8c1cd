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

When it pays (measured on the CPU: :data:`MAX_STEP_POSITIONS`): a decoding step reads every
weight to produce one token per row, so checking ``k`` more tokens costs little while a step
feeds few positions; with many the step is no longer bound by reading the weights, and the
extra positions cost about what they would as rows of their own.  So a step proposes only
while it has at most :data:`MAX_SPECULATING_ROWS` decoding rows (``disable_by_batch_size``),
its rows propose at most as many tokens as keep its pass within :data:`MAX_STEP_POSITIONS`
positions, and each request proposes as many as its recent acceptance is worth
(:meth:`Speculator.allowance`): all ``num_tokens`` while most are accepted, fewer as they are
not, none for a while once few are: a request starts proposing 3 of 4 (``num_tokens``;
4 once they are accepted); two steps whose proposals are all rejected pause it for 16 tokens,
and after a pause one more such step pauses it for twice as long, up to 256 (a rejected step
costs at most about two plain ones on the CPU, so an always-wrong proposer costs a few per
cent: 3 such steps in a 48-token reply, 7 in 500).

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

import math
from dataclasses import dataclass
from os import PathLike
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

    from llama.engine.requests import RunningRequest

__all__ = ["Proposer", "RowProposer", "NgramProposer", "SpeculativeConfig", "check_speculative", "Acceptance",
           "Speculator", "MAX_SPECULATING_ROWS", "MAX_STEP_POSITIONS"]

METHODS = ("ngram", "draft")
OPTIONS = ("method", "num_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
           "draft_tensor_parallel_size")
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

# Each verification moves a request's acceptance rate this far towards the share of its
# proposals just accepted (an exponential average over its recent steps).
ACCEPTANCE_WEIGHT = 0.5
# Below this acceptance a request stops proposing for PAUSE_TOKENS generated tokens, twice as
# many each time it is found there again in a row (at most MAX_PAUSE_TOKENS), then tries again.
MIN_ACCEPTANCE = 0.3
PAUSE_TOKENS = 16
MAX_PAUSE_TOKENS = 256
# The acceptance rate a request starts from (3 of 4 proposals; two wholly rejected steps pause
# it), and tries again from after a pause (2 of 4; one wholly rejected step pauses it again).
START_ACCEPTANCE = 0.75
RETRY_ACCEPTANCE = 0.5


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
        length = len(tokens)
        if k < 1 or length < self.min_n + 1:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        # Where the last token occurs earlier: every match ends at one of these (most recent last).
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        if ends.size == 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # the occurrences of the last n tokens that end at one of `ends` (and start at >= 0)
            candidates = ends[ends >= n - 1]
            matched = np.ones(candidates.size, dtype=bool)
            for back in range(1, n):
                matched &= seq[candidates - back] == seq[length - 1 - back]
            hits = candidates[matched]
            if hits.size:
                start = int(hits[-1]) + 1  # the most recent occurrence: what followed it
                return seq[start : start + k].tolist()
        return []


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
    unknown = sorted(set(value) - set(OPTIONS) - {"draft_ckpt_dir"})
    if unknown:
        raise ValueError(f"speculative: unknown option(s) {unknown}; the options are "
                         f"{list(OPTIONS) + ['draft_ckpt_dir']}")
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
    options: dict[str, int] = {}
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
    changed only by the scheduler's update): ``rate``, an exponential average of the share
    of its proposals accepted per step; no proposals before it has ``resume_at`` generated
    tokens (a pause); ``pauses``, the pauses in a row so far (each twice the last)."""

    rate: float = START_ACCEPTANCE
    resume_at: int = 0
    pauses: int = 0


class Speculator:
    """Decides each step's proposals: which decoding rows propose, and how many tokens
    (:meth:`proposals`); and how a verification changes a request's :class:`Acceptance`
    (:meth:`after`).  ``proposer``: instead of the method's own (benchmarks)."""

    def __init__(self, config: SpeculativeConfig, proposer: Optional[Proposer | RowProposer] = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else config.proposer()
        # The distributions the last step's sampled proposals were drawn from, by request id
        # (a RowProposer's: a draft model's); read by the sampler through the engine.
        self.probs: dict[int, torch.Tensor] = {}
        self.max_rows = config.disable_by_batch_size
        self.proposed_total = 0  # statistics: tokens proposed and fed, and of them accepted
        self.accepted_total = 0

    def allowance(self, request: RunningRequest) -> int:
        """How many tokens ``request`` may propose now: none while it may not (its settings
        turn it off; paused) or may generate at most one more token; else
        ``num_tokens`` scaled by its acceptance rate (at least 1), and never more than it may
        still generate after its pending token.  Read from what every rank holds alike."""
        if not request.settings.speculative:
            return 0
        state = request.speculation
        if len(request.generated) < state.resume_at:
            return 0
        room = request.budget - len(request.generated)  # tokens it may still generate, this step's first included
        k = max(1, math.ceil(self.config.num_tokens * state.rate))
        return max(0, min(k, room - 1))

    def proposals(self, decoding: Sequence[RunningRequest]) -> dict[int, list[int]]:
        """The tokens each of a step's ``decoding`` rows proposes, by request id (rows that
        propose none are left out): none at all when the step has more than
        ``disable_by_batch_size`` rows, and so few that the pass feeds at most
        :data:`MAX_STEP_POSITIONS` positions (every row is as wide as the widest)."""
        most = MAX_STEP_POSITIONS // max(1, len(decoding)) - 1
        self.probs = {}
        if len(decoding) > self.max_rows or most < 1:
            return {}
        if isinstance(self.proposer, RowProposer):
            rows = [(request, k) for request in decoding if (k := min(self.allowance(request), most))]
            if not rows:
                return {}
            out, self.probs = self.proposer.propose_rows(rows)
            return {request_id: proposed for request_id, proposed in out.items() if proposed}
        out = {}
        for request in decoding:
            k = min(self.allowance(request), most)
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
        accepted ``accepted``; counted in the statistics."""
        self.proposed_total += proposed
        self.accepted_total += accepted
        state = request.speculation
        if not proposed:
            return state
        rate = (1 - ACCEPTANCE_WEIGHT) * state.rate + ACCEPTANCE_WEIGHT * accepted / proposed
        if rate >= MIN_ACCEPTANCE:
            return Acceptance(rate, state.resume_at, 0 if accepted else state.pauses)
        pause = min(PAUSE_TOKENS << state.pauses, MAX_PAUSE_TOKENS)
        return Acceptance(RETRY_ACCEPTANCE, len(request.generated) + pause, state.pauses + 1)
