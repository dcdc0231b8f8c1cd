"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

The choices are Meta's reference's; the arithmetic avoids what is slow on a CPU with a
128k vocabulary (torch's argmax, sorting the whole vocabulary, ``torch.multinomial``), which
made default sampling (temperature 0.6, top-p 0.9) cost more than a small model's decoding
step.  ``python benchmarks/bench.py sampling`` measures both (BENCHMARKS.md).

On a GPU the host must not wait for the device while it samples: each wait stops the
CPU from queueing the next step's work.  ``sync_free=True`` (what the engine uses off the
CPU) chooses the same tokens without reading the device: top-p sorts the whole row
instead of first finding the likely tokens (which reads their count and mass), and a row
that cannot be sampled from gives :data:`NO_TOKEN` instead of raising.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, cast

import torch

from llama.runtime.finite import scale_by_temperature


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.  Checked on creation (``ValueError``/``TypeError``)."""

    temperature: float = 0.6  # 0 = greedy (argmax)
    top_p: float = 0.9  # keep the smallest set of tokens whose probability reaches top_p
    top_k: Optional[int] = None  # keep only the k most likely tokens (None: all)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
                raise TypeError(f"top_k must be an int or None, got {type(self.top_k).__name__}")
            if self.top_k < 1:
                raise ValueError(f"top_k must be >= 1 (or None for no limit), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


#: Block width of :func:`greedy_tokens`' two-level search, and the fewest logits it is
#: used for (below, its few extra calls cost more than torch.argmax's scalar loop).
GREEDY_BLOCK = 128
GREEDY_BLOCKED_FROM = 1 << 16
#: Where :func:`top_p_candidates` looks for a row's nucleus: first among the tokens at
#: least this many times as likely as the most likely one, then the next ratio, at
#: last the whole sorted vocabulary.
TOP_P_CANDIDATE_RATIOS = (1e-4, 1e-8)
#: What a sync-free draw gives for a row whose weights are all zero or not finite.
NO_TOKEN = -1


@dataclass
class RowSummary:
    """What sampling reads of every row of a step's logits (R, V), computed inside the compiled
    CPU decoding step: ``greedy`` (R,) each row's argmax over the decodable vocabulary (its first
    ``n_decodable`` ids), ``totals`` (R,) each row's sum (NaN or infinite where a logit is, or
    where finite ones overflowed it: the finite check's first test).  Fused into the step, these
    two reductions cost ~0.05 ms of a 150m step on the CPU; after it, as separate operations, they
    cost ~0.2 ms more, their code and the logits evicted from the caches by the weights streamed
    through them (llama.engine.sampler uses them where no processor or grammar changed a row)."""

    greedy: torch.Tensor
    totals: torch.Tensor

    def first(self, rows: int) -> "RowSummary":
        """The summary of the first ``rows`` rows (a step's requests, without its padding rows)."""
        return self if rows == self.greedy.shape[0] else RowSummary(self.greedy[:rows], self.totals[:rows])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for logits (B, V): the first index of each row's
    maximum (a NaN counts as the maximum, as in torch), found faster on CPU.

    torch's CPU argmax tracks an index per element and is not vectorised (a cost that
    shows at every decoding step of a 128k vocabulary).  Here the row is cut into blocks of
    :data:`GREEDY_BLOCK`; ``amax`` (vectorised) gives each block's maximum, argmax over
    those picks the first block holding the row's maximum, and argmax inside that block
    the first position: the same index, reading the row about once.
    """
    if logits.dim() != 2 or logits.device.type != "cpu" or logits.stride(-1) != 1 \
            or logits.shape[-1] < 4 * GREEDY_BLOCK or logits.numel() < GREEDY_BLOCKED_FROM:
        return torch.argmax(logits, dim=-1)
    rows, width = logits.shape
    full = width - width % GREEDY_BLOCK
    blocks = logits[:, :full].unflatten(-1, (full // GREEDY_BLOCK, GREEDY_BLOCK))  # a view
    block = blocks.amax(-1).argmax(-1)  # (B,) first block holding the maximum
    rows_index = torch.arange(rows)
    within = blocks[rows_index, block]  # (B, GREEDY_BLOCK)
    best = block * GREEDY_BLOCK + within.argmax(-1)
    if full == width:
        return best
    # The last width % GREEDY_BLOCK logits: they win only if strictly larger (or NaN
    # where the rest is not), as the later index of a tie loses in torch.argmax.
    tail = logits[:, full:]
    tail_best = tail.argmax(-1)
    best_value, tail_value = logits[rows_index, best], tail[rows_index, tail_best]
    tail_wins = (tail_value > best_value) | (tail_value.isnan() & ~best_value.isnan())
    return torch.where(tail_wins, tail_best + full, best)


def draw(weights: torch.Tensor, generator: Optional[torch.Generator] = None, *,
         sync_free: bool = False) -> torch.Tensor:
    """One index per row of ``weights`` (B, n), drawn with probability proportional to its
    weight (>= 0, rows need not sum to 1; a weight of 0 is never drawn).

    Inverse-CDF sampling: one uniform number per row against the row's running sum
    (in float64).  The same distribution as ``torch.multinomial(weights, 1)``, which
    draws one exponential number per *entry* of the row.  A row whose weights are all
    zero or not finite raises ValueError, or with ``sync_free`` (no reading of the
    device) gives :data:`NO_TOKEN`.
    """
    cdf = weights.double().cumsum(-1)
    total = cdf[:, -1:]
    drawable = total > 0
    if not sync_free and not bool(drawable.all()):
        raise ValueError("cannot sample from a row whose weights are all zero or not finite")
    u = torch.rand(total.shape, dtype=torch.float64, device=weights.device, generator=generator) * total
    index = torch.searchsorted(cdf, u, right=True).clamp_(max=weights.shape[-1] - 1)
    if sync_free:
        index = index.masked_fill(~drawable, NO_TOKEN)
    return index.squeeze(-1)


def nucleus(probs_sorted: torch.Tensor, p: float) -> torch.Tensor:
    """``probs_sorted`` (B, n), each row in descending order, with the tokens outside the
    top-p nucleus set to 0: a token stays while the mass before it is at most ``p``, so
    the most likely token always stays."""
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    return probs_sorted.masked_fill(mass_before > p, 0.0)


def top_p_candidates(probs: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept probabilities (n,), in descending order with 0 outside the nucleus; their
    token ids (n,)) for one row of probabilities (V,): the tokens Meta's reference keeps
    for top-p, and their probabilities.

    The reference sorts the whole vocabulary (for 128,256 tokens, more than a decoding
    step of a small model on a CPU).  The nucleus of
    a trained model is usually a few tokens, so this first takes the tokens at least
    :data:`TOP_P_CANDIDATE_RATIOS` times as likely as the most likely one and sorts only
    those.  If their mass exceeds ``p``, the most likely token left out has more than
    ``p`` before it and would be cut, so the nucleus lies among them; otherwise it tries
    the next ratio, and at last sorts everything.  Tokens of equal probability may come
    in another order than the reference's (``torch.sort`` does not fix their order either).
    """
    if probs.dim() != 1:
        raise ValueError(f"top_p_candidates takes one row of probabilities (V,), got shape {tuple(probs.shape)}")
    found = _nucleus_among_likely(probs, p)
    if found is not None:
        return found
    probs_sorted, order = torch.sort(probs, descending=True)
    return nucleus(probs_sorted, p), order


def _nucleus_among_likely(probs: torch.Tensor, p: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`top_p_candidates` without its last resort: None where only sorting the whole
    row would do."""
    top = probs.max()
    for ratio in TOP_P_CANDIDATE_RATIOS:
        ids = torch.nonzero(probs >= top * ratio).squeeze(-1)
        if 4 * ids.numel() > probs.numel():
            return None  # most of the vocabulary: sort it all
        candidates = probs[ids]
        # The margin keeps a sum that only rounding puts above p (in another order of
        # additions than the reference's running sum) from deciding: such rows look wider.
        if bool(candidates.sum() > p + 1e-5):
            probs_sorted, order = torch.sort(candidates, descending=True)
            return nucleus(probs_sorted, p), ids[order]
    return None


def draw_in_vocabulary_order(kept: torch.Tensor, ids: torch.Tensor, vocab_size: int,
                             generator: Optional[torch.Generator] = None, *, sync_free: bool = False) -> torch.Tensor:
    """One token id, drawn with probability proportional to ``kept`` (n,) among the token
    ids ``ids`` (n,), the running sum taken in the order of the ids, not of the weights.

    Any fixed order gives the same distribution, but this one does not move when two
    nearly equal probabilities swap places: logits that differ only by rounding (a prompt
    prefilled in one pass or after a cached prefix, another kernel, another batch) then
    draw the same token for the same seed, unless the uniform number falls within that
    rounding of a boundary.  In the order of the sorted probabilities (Meta's reference),
    each such swap moves every token after it."""
    if 4 * ids.numel() <= vocab_size:  # few tokens: sort their ids
        ids, order = torch.sort(ids)
        return ids[draw(kept[order].unsqueeze(0), generator)]
    weights = kept.new_zeros(vocab_size).scatter_(0, ids, kept)  # many: lay them out over the vocabulary
    return draw(weights.unsqueeze(0), generator, sync_free=sync_free)


def sample_top_p(probs: torch.Tensor, p: float, generator: Optional[torch.Generator] = None, *,
                 sync_free: bool = False) -> torch.Tensor:
    """Sample from the smallest set of most likely tokens whose probability reaches ``p``.

    probs (B, V), rows summing to 1; returns token ids (B,), drawn in row order (see
    :func:`draw_in_vocabulary_order`).  See :func:`top_p_candidates`; the rows that need a
    whole sort are sorted together.  ``sync_free``: every row is sorted whole (the same
    tokens, without reading the device).
    """
    if sync_free:
        probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
        kept = nucleus(probs_sorted, p)
        weights = torch.zeros_like(kept).scatter_(-1, order, kept)  # back in vocabulary order
        return draw(weights, generator, sync_free=True)
    found = [_nucleus_among_likely(row, p) for row in probs]
    unsorted = [i for i, f in enumerate(found) if f is None]
    if unsorted:
        probs_sorted, order = torch.sort(probs[unsorted], dim=-1, descending=True)
        kept = nucleus(probs_sorted, p)
        for j, i in enumerate(unsorted):
            found[i] = (kept[j], order[j])
    rows = cast(list[tuple[torch.Tensor, torch.Tensor]], found)  # every None was filled in above
    return torch.cat([draw_in_vocabulary_order(kept, ids, probs.shape[-1], generator) for kept, ids in rows])


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None, *,
    sync_free: bool = False,
) -> torch.Tensor:
    """Next token ids (B,) from float logits (B, V).

    With ``top_k``, exactly the k most likely tokens are candidates (``torch.topk``
    breaks ties in the k-th place); ``top_p`` then keeps the nucleus of their
    renormalised probabilities.  Draws run over the kept tokens in vocabulary order (see
    :func:`draw_in_vocabulary_order`).  ``sync_free``: never read the device (see the
    module's docstring); a row that cannot be sampled from gives :data:`NO_TOKEN`.
    """
    if params.greedy:
        return greedy_tokens(logits)
    logits = scale_by_temperature(logits, params.temperature)  # cannot overflow, whatever the temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        values, ids = torch.topk(logits, params.top_k, dim=-1)  # sorted, descending
        probs = torch.softmax(values, dim=-1)
        if params.top_p < 1.0:
            probs = nucleus(probs, params.top_p)
        ids, order = torch.sort(ids, dim=-1)  # draw in vocabulary order
        probs = torch.gather(probs, -1, order)
        index = draw(probs, generator, sync_free=sync_free)
        token = torch.gather(ids, -1, index.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return token.masked_fill(index < 0, NO_TOKEN) if sync_free else token
    probs = torch.softmax(logits, dim=-1)
    if params.top_p >= 1.0:
        return draw(probs, generator, sync_free=sync_free)
    return sample_top_p(probs, params.top_p, generator, sync_free=sync_free)


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities (B, V) float64 that :func:`sample_next_token` draws from, for float
    logits (B, V) of a sampled (not greedy) ``params``: temperature, then the ``top_k`` most
    likely tokens, then the top-p nucleus (Meta's rule: :func:`nucleus`) of what is left,
    renormalised; 0 outside.  What speculative decoding needs of a draft's distribution and
    the target's (:mod:`llama.engine.sampler`)."""
    if params.greedy:
        raise ValueError("a greedy request draws from no distribution: its token is the argmax")
    # In float32 as sample_next_token computes them (the same nucleus), then float64.
    scaled = scale_by_temperature(logits, params.temperature)
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        values, ids = torch.topk(scaled, params.top_k, dim=-1)  # sorted, descending
        kept = torch.softmax(values, dim=-1)
    else:
        kept, ids = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)
    if params.top_p < 1.0:
        kept = nucleus(kept, params.top_p)
    probs = torch.zeros(scaled.shape, dtype=torch.float64, device=scaled.device).scatter_(-1, ids, kept.double())
    return probs / probs.sum(-1, keepdim=True)
