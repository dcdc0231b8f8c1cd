"""Which tokens may come next: one matcher per constrained request, and the masks of a
step's constrained rows applied to its logits together.

A token bitmask row holds one bit per token id (bit ``j`` of 32-bit word ``w`` is id
``32 * w + j``; set: allowed), ``(n_words + 31) // 32`` words, as llguidance writes it.
Masks are computed on the host (llguidance, in parallel over the rows), copied to the
logits' device once, and applied there in place (one pass of integer operations over the
constrained rows), without reading the device back.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence, cast

import llguidance
import numpy as np
import torch

from llama.runtime.daemon_pool import DaemonPool
from llama.structured.vocabulary import GrammarTokenizer

if TYPE_CHECKING:
    from llama.structured.response_format import Grammar

logger = logging.getLogger(__name__)

__all__ = ["GrammarMasker", "GrammarMatcher", "MaskJob", "MaskWorkers", "mask_logits_"]


def error_message(message: str) -> str:
    """An llguidance error without its trailing markup."""
    return message.replace("<non-verbose/>", "").strip()


def _bit_words(ids: Iterable[int]) -> list[tuple[int, np.uint32]]:
    """``ids`` as (word, bits) pairs of a token bitmask row."""
    words: dict[int, int] = {}
    for i in ids:
        words[i // 32] = words.get(i // 32, 0) | (1 << (i % 32))
    return [(w, np.uint32(bits)) for w, bits in sorted(words.items())]


class GrammarMatcher:
    """Where one constrained reply stands in its grammar (made by :meth:`Grammar.matcher`).

    Each step, the engine fills the request's row of a bitmask (or lets :class:`GrammarMasker`
    do it for all rows), samples, and gives the chosen token to :meth:`consume`.  Once
    :attr:`is_complete`, only one of :attr:`end_ids` may follow; once one is consumed the
    reply :attr:`is_ended`.
    """

    def __init__(self, grammar: Grammar, matcher: llguidance.LLMatcher,
                 end_ids: Optional[Iterable[int]] = None) -> None:
        tokenizer = grammar.tokenizer
        ends = tokenizer.end_ids if end_ids is None else frozenset(end_ids)
        if not ends:
            raise ValueError("end_ids is empty: a constrained reply needs at least one token that can end it")
        if not ends <= tokenizer.end_ids:
            raise ValueError(
                f"end ids {sorted(ends - tokenizer.end_ids)} are not among the grammar tokenizer's "
                f"{sorted(tokenizer.end_ids)}: build the GrammarTokenizer with end_ids that include them"
            )
        self.grammar = grammar
        self.tokenizer: GrammarTokenizer = tokenizer
        self.end_ids: frozenset[int] = ends
        self._matcher = matcher
        self._ended = False
        # llguidance allows every end id of the tokenizer; this request allows only its own.
        self._other_ends = _bit_words(tokenizer.end_ids - ends)
        self._own_ends = _bit_words(ends)

    # -- state ------------------------------------------------------------------------------

    @property
    def error(self) -> Optional[str]:
        """Why the matcher failed (a token it did not allow was consumed), else ``None``."""
        return (error_message(self._matcher.get_error()) or "failed") if self._matcher.is_error() else None

    @property
    def can_end(self) -> bool:
        """Whether the text so far is a complete match: an end id is allowed next."""
        return not self._ended and not self._matcher.is_error() and self._matcher.is_accepting()

    @property
    def is_complete(self) -> bool:
        """Whether the grammar is complete: nothing but an end id may follow (or one did)."""
        return not self._matcher.is_error() and self._matcher.is_stopped()

    @property
    def is_ended(self) -> bool:
        """Whether an end id was consumed: the reply is over."""
        return self._ended

    # -- advancing --------------------------------------------------------------------------

    def consume(self, token_id: int) -> None:
        """Advance by the token the request accepted.

        ``ValueError`` if the grammar did not allow it here (the matcher then stays failed:
        :attr:`error`), if it is an end id this request may not end with, or if the reply
        already ended."""
        token_id = int(token_id)
        if self._ended:
            raise ValueError(f"token {token_id} follows the end of the constrained reply")
        if not 0 <= token_id < self.tokenizer.n_words:
            raise ValueError(f"token {token_id} is outside the vocabulary [0, {self.tokenizer.n_words})")
        if token_id in self.tokenizer.end_ids and token_id not in self.end_ids:
            raise ValueError(f"token {token_id} does not end this reply (its end ids: {sorted(self.end_ids)})")
        if not self._matcher.consume_token(token_id):
            raise ValueError(
                f"token {token_id} ({self.tokenizer.ll.dbg_tokens([token_id])}) is not allowed by the grammar here: "
                f"{error_message(self._matcher.get_error())}"
            )
        self._ended = token_id in self.end_ids

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in turn, this reply may take from where it stands (read only:
        the matcher does not move): up to the first its grammar does not allow here, or that is
        an end id this request may not end with; an end id it may end with is the last (nothing
        follows the end).  For proposals (speculative decoding): a token past this count could
        never be accepted."""
        if self._ended or self._matcher.is_error() or not tokens:
            return 0
        n = self._matcher.validate_tokens([int(t) for t in tokens])
        for k, token in enumerate(tokens[:n]):
            if token in self.tokenizer.end_ids:
                return k + 1 if token in self.end_ids else k
        return n

    def reset(self) -> None:
        """Back to the start of the grammar (a failed matcher stays failed)."""
        self._matcher.reset()
        self._ended = False

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (cheap: no recompilation)."""
        other = GrammarMatcher(self.grammar, self._matcher.deep_copy(), self.end_ids)
        other._ended = self._ended
        return other

    # -- masks ------------------------------------------------------------------------------

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into ``bitmask[row]`` (a CPU int32 tensor of
        ``tokenizer.words_per_mask`` words a row, contiguous)."""
        _check_bitmask(bitmask, self.tokenizer, row + 1)
        words = self.tokenizer.words_per_mask
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * words * 4, words * 4)
        self._fix_row(bitmask.numpy().view(np.uint32)[row])

    def _fix_row(self, row: np.ndarray) -> None:
        """Narrow the row's end ids to this request's; a row left empty (a dead end of the
        grammar, or a failed matcher) allows the request's end ids, so that it can stop."""
        for word, bits in self._other_ends:
            row[word] &= ~bits
        if not row.any():
            logger.warning("a constrained reply reached a state where its grammar allows no token "
                           "(%s); allowing only its end tokens", self.error or "a dead end of the grammar")
            for word, bits in self._own_ends:
                row[word] |= bits

    def allowed_ids(self) -> list[int]:
        """The ids allowed next, ascending (computes a mask: for tests and debugging)."""
        bitmask = torch.zeros((1, self.tokenizer.words_per_mask), dtype=torch.int32)
        self.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")  # bit j of word w: id 32 w + j
        return np.flatnonzero(bits[: self.tokenizer.n_words]).tolist()


def _check_bitmask(bitmask: torch.Tensor, tokenizer: GrammarTokenizer, rows: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("a token bitmask must be a contiguous int32 tensor on the CPU")
    if bitmask.dim() != 2 or bitmask.shape[0] < rows or bitmask.shape[1] != tokenizer.words_per_mask:
        raise ValueError(f"token bitmask of shape {tuple(bitmask.shape)}: expected at least {rows} rows of "
                         f"{tokenizer.words_per_mask} words")


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i, t] = -inf`` where bit ``t`` of ``bitmask[i]`` is clear, in place,
    leaving the other entries bit for bit as they were.

    ``logits``: ``(n, V)`` floats with ``V <= 32 * words``; ``bitmask``: ``(n, words)``
    int32 on the same device.  Integer operations on the logits' bits, not ``masked_fill_``:
    on the CPU they are several times faster (measured: benchmarks/bench_grammar.py)."""
    n, width = logits.shape
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[logits.element_size()]
    # Bit j of a word shifted up to the sign bit, then arithmetically back down: all ones
    # where id 32 w + j is allowed, zero where it is masked.
    up = torch.arange(31, -1, -1, dtype=torch.int32, device=bitmask.device)
    keep = ((bitmask.unsqueeze(-1) << up) >> 31).view(n, -1)[:, :width].to(as_int)  # (n, V)
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype).view(as_int).item()
    # x ^ -inf & keep ^ -inf: x where keep is all ones, -inf where it is zero.
    logits.view(as_int).bitwise_xor_(minus_inf).bitwise_and_(keep).bitwise_xor_(minus_inf)


class GrammarMasker:
    """Applies the masks of a step's constrained rows to its logits, all rows together.

    ``num_threads``: threads computing masks in parallel (llguidance's pool; default:
    llguidance's choice, most of the machine's cores).  One masker per grammar tokenizer;
    it keeps no per-request state.
    """

    def __init__(self, tokenizer: GrammarTokenizer, *, num_threads: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.executor = llguidance.LLExecutor(num_threads)

    def fill(self, matchers: Sequence[GrammarMatcher], *, pin_memory: bool = False,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The masks of ``matchers`` as a CPU int32 bitmask ``(len(matchers), words)``,
        computed in parallel (row ``i`` is ``matchers[i]``'s); written into ``out`` where given
        (rows of a larger bitmask: contiguous, that shape)."""
        for m in matchers:
            if m.tokenizer is not self.tokenizer:
                raise ValueError("a matcher of another tokenizer's grammar: every grammar of a batch must be "
                                 "compiled for the masker's tokenizer")
        words = self.tokenizer.words_per_mask
        if out is None:
            bitmask = torch.empty((len(matchers), words), dtype=torch.int32, pin_memory=pin_memory)
        else:
            _check_bitmask(out, self.tokenizer, len(matchers))
            bitmask = out
        if len(matchers) == 1:
            matchers[0]._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        elif matchers:
            self.executor.unsafe_compute_mask_ptr(
                [(m._matcher, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers))
        as_unsigned = bitmask.numpy().view(np.uint32)
        for i, m in enumerate(matchers):
            m._fix_row(as_unsigned[i])
        return bitmask

    def fill_after(self, matcher: GrammarMatcher, tokens: Sequence[int], out: torch.Tensor) -> Iterator[int]:
        """The masks that follow each of ``tokens`` in turn (speculative decoding: the positions
        after proposed tokens): ``matcher`` consumes ``tokens[j]``, then row ``j`` of ``out`` (a
        CPU int32 bitmask of at least ``len(tokens)`` rows) gets its mask, and ``j`` is yielded;
        it stops at a token the grammar does not allow.  ``matcher`` is advanced: give a copy
        (:meth:`GrammarMatcher.copy`)."""
        for j, token in enumerate(tokens):
            try:
                matcher.consume(token)
            except ValueError:
                return
            self.fill([matcher], out=out[j : j + 1])
            yield j

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]) -> None:
        """Set ``logits[rows[i], t] = -inf`` for every id ``t`` that ``matchers[i]`` does not
        allow next, ids past the tokenizer's vocabulary included (a checkpoint may pad its
        vocabulary); other rows are untouched.

        ``logits``: ``(R, V)`` on any device, ``V >= n_words``.  One host-to-device copy of
        the bitmask (pinned and asynchronous on CUDA), no read back."""
        if len(rows) != len(matchers):
            raise ValueError(f"{len(rows)} rows for {len(matchers)} matchers")
        if not matchers:
            return
        self._check(logits, rows)  # before the masks are computed
        self.apply_bitmask(logits, rows, self.fill(matchers, pin_memory=logits.is_cuda))

    def _check(self, logits: torch.Tensor, rows: Sequence[int]) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be (rows, vocabulary), got shape {tuple(logits.shape)}")
        n_rows, width = logits.shape
        if width < self.tokenizer.n_words:
            raise ValueError(f"logits have {width} columns, fewer than the tokenizer's {self.tokenizer.n_words} ids")
        rows = [int(r) for r in rows]
        if len(set(rows)) != len(rows) or not all(0 <= r < n_rows for r in rows):
            raise ValueError(f"rows {rows} must be distinct and within the logits' {n_rows} rows")

    def apply_bitmask(self, logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """:meth:`apply` with the masks already computed (:meth:`fill`): ``bitmask[i]`` is the
        mask of row ``rows[i]``."""
        self._check(logits, rows)
        if bitmask.shape[0] != len(rows):
            raise ValueError(f"{bitmask.shape[0]} masks for {len(rows)} rows")
        if not rows:
            return
        rows = [int(r) for r in rows]
        # The copy is asynchronous from pinned memory; torch's pinned-memory cache keeps the
        # block from reuse until the copy is done.
        bitmask = bitmask.to(logits.device, non_blocking=True)
        first = rows[0]
        if rows == list(range(first, first + len(rows))):
            index = None
            target = logits[first : first + len(rows)]  # a view: masked in place
        else:
            index = torch.tensor(rows)
            index = (index.pin_memory() if logits.is_cuda else index).to(logits.device, non_blocking=True)
            target = logits.index_select(0, index)
        n_words = self.tokenizer.n_words
        mask_logits_(target[:, :n_words], bitmask)
        target[:, n_words:] = float("-inf")  # a padded vocabulary's ids, past the tokenizer's
        if index is not None:
            logits.index_copy_(0, index, target)


class MaskJob:
    """The mask of one matcher in its current state, computed on a :class:`MaskWorkers` thread
    (:meth:`GrammarMasker.fill` of that matcher alone).  Valid until the matcher consumes a
    token; the matcher must not consume one while its mask is computing (llguidance's matchers
    are not thread-safe).

    With ``proposed`` (speculative decoding: the tokens fed after the request's next one), it
    then computes the masks of the positions after each proposal in turn, on a copy of the
    matcher taken before it began (so that the request's own matcher is free once the first
    mask is done, however long the others take), into :attr:`draft_bitmask`: row ``j`` is the
    mask after ``proposed[: j + 1]``.  It stops at a proposal the grammar does not allow, after
    a mask that took longer than ``max_mask_s``, and once :meth:`take` has taken what was ready.
    :attr:`ready` counts the masks done, the first included."""

    def __init__(self, masker: GrammarMasker, matcher: GrammarMatcher, executor: Executor,
                 bitmask: torch.Tensor, row: int, proposed: Sequence[int] = (),
                 max_mask_s: Optional[float] = None) -> None:
        self.matcher = matcher
        self.step_bitmask, self.row = bitmask, row  # it is row `row` of the bitmask of the step that asked for it
        self.out = bitmask[row : row + 1]
        self.submitted = time.monotonic()
        self.started: Optional[float] = None
        self.finished: Optional[float] = None  # when the first mask was done
        self.ready = 0
        self.proposed = list(proposed)
        self.draft_bitmask = torch.empty((len(self.proposed), bitmask.shape[1]), dtype=torch.int32,
                                         pin_memory=bitmask.is_pinned()) if self.proposed else None
        self._draft = matcher.copy() if self.proposed else None  # before the job begins: its state now
        self._max_mask_s = max_mask_s
        self._taken = False
        self._masker = masker
        self.future: Future = executor.submit(self._run)

    def _run(self) -> torch.Tensor:
        self.started = time.monotonic()
        try:
            out = self._masker.fill([self.matcher], out=self.out)
            self.ready = 1
        finally:
            self.finished = time.monotonic()
        if self._draft is not None and not self._taken:
            self._fill_drafts()
        return out

    def _fill_drafts(self) -> None:
        """The masks after the proposals, while they are wanted (see the class)."""
        start = time.monotonic()
        try:
            for j in self._masker.fill_after(cast(GrammarMatcher, self._draft), self.proposed,
                                             cast(torch.Tensor, self.draft_bitmask)):
                self.ready = j + 2
                now = time.monotonic()
                if self._taken or (self._max_mask_s is not None and now - start > self._max_mask_s):
                    return
                start = now
        except Exception:  # a proposal's mask is an optimisation: the first mask stands alone
            logger.exception("the grammar's mask after a proposed token failed; the proposals stop there")

    def done(self) -> bool:
        """Whether the first mask is ready (or failed)."""
        return self.ready > 0 or self.future.done()

    def take(self, deadline: float) -> int:
        """How many of its masks are ready (0: not even the first), waiting until all are or
        until ``deadline``; it computes no more masks after the proposals' from then on.  A job
        whose first mask failed counts 1: :meth:`bitmask` raises its error."""
        try:
            self.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            pass
        except Exception:
            return 1
        self._taken = True
        return self.ready

    def bitmask(self) -> torch.Tensor:
        """The first mask, ``(1, words)`` int32 on the CPU (once :meth:`done`; raises the job's error)."""
        if self.ready:
            return self.out
        return self.future.result()

    def seconds(self) -> float:
        """How long the first mask took, or has been computing so far (0 while it waits for a thread)."""
        if self.started is None:
            return 0.0
        return (self.finished or time.monotonic()) - self.started


def default_mask_threads() -> int:
    """Threads of the fast lane: half the machine's cores, from 2 to 8 (the rest run the model
    and the server)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


class MaskWorkers:
    """Threads computing masks one matcher at a time (llguidance releases the GIL while it
    computes), so that each request's mask is ready, or late, on its own: a fast lane of
    ``threads`` threads, and a slow lane of one thread for the matchers whose masks were
    slow, where they wait for each other and leave the fast lane to the rest.  A mask
    cannot be stopped once begun; the slow lane bounds what slow grammars take to one core
    (and the fast lane to its threads while a grammar turns slow)."""

    def __init__(self, threads: Optional[int] = None) -> None:
        self.threads = default_mask_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads!r}")
        # Daemon threads: a mask cannot be stopped, and one that runs on must not keep the process alive.
        self._fast = DaemonPool(self.threads, "grammar-masks")
        self._slow = DaemonPool(1, "grammar-masks-slow")

    def submit(self, masker: GrammarMasker, matcher: GrammarMatcher, bitmask: torch.Tensor, row: int, *,
               slow: bool = False, proposed: Sequence[int] = (), max_mask_s: Optional[float] = None) -> MaskJob:
        """Compute ``matcher``'s mask into row ``row`` of ``bitmask`` (a CPU int32 bitmask), and
        with ``proposed`` the masks after them (:class:`MaskJob`)."""
        return MaskJob(masker, matcher, self._slow if slow else self._fast, bitmask, row, proposed, max_mask_s)

    def shutdown(self) -> None:
        self._fast.shutdown()
        self._slow.shutdown()
