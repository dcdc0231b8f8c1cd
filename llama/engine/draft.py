"""A draft model as speculative decoding's proposer (``speculative={"method": "draft",
"draft_ckpt_dir": ..., "num_tokens": 4}``): a smaller checkpoint with the target's tokenizer
(Llama 3.2 1B for Llama 3.1 8B and 70B) proposes the tokens the target verifies
(:mod:`llama.engine.speculative`).

The draft is loaded like any model (Meta's files or a Hugging Face folder, the target's device,
dtype and kernel policy; never quantised, never compiled) and holds a paged KV cache of its
own: a pool of blocks (:class:`~llama.engine.block_manager.BlockManager`, no prefix cache) as
large as the target's (``kv_cache_tokens``), and a block table per request, kept here by
request id with how much of the request the cache holds (:class:`DraftProposer`): nothing of
it is on the running request, whose state the scheduler alone writes.

Each step, for each decoding row that proposes ``k`` tokens, the draft first *catches up*: it
feeds the request's tokens its cache does not hold (on first use the whole prompt, in chunks
of ``prefill_chunk`` tokens; later the tokens accepted last step and the pending one), all
rows in one ragged pass per chunk; the logits after the pending token give ``d1``.  Then it
decodes ``d2 .. dk`` one position at a time, one forward pass per position for every row that
proposes that many.  Greedy requests are proposed the draft's argmax tokens; sampled ones a
draw from the draft's own distribution ``q`` after the request's temperature / top-k / top-p
(:func:`~llama.engine.sampling.sampling_distribution`), with a generator of the draft's own
for the request, seeded from the request's seed (so a seed gives the same text again), and
``q`` goes to the sampler with the proposals (the general rejection rule:
:meth:`~llama.engine.sampler.Sampler._draft_rule`).  What the draft's cache holds is known
by the tokens fed into it: the next step keeps the longest run of them the request's tokens
begin with (the proposals the target accepted) and writes over the rest (the rejected ones),
so no roll-back call is needed.  A request's blocks go back when it finishes, fails, is
cancelled or preempted (:meth:`release`, called by the scheduler), and when the pool is short
the requests that propose nothing this step give theirs back first; a row that still finds
too few proposes nothing that step.

Ranks.  By default the draft is *replicated*: every rank loads all of it (whatever the target's
model-parallel size) and runs it as if alone (:func:`llama.runtime.distributed.alone`: no
collective inside the draft's passes), on the same tokens, so every rank computes the same
proposals and keeps the same books.  The first rank's proposals are still shared with the
others (one small broadcast per speculating step): kernels may round differently from one
rank to another (CPU thread counts), and a rank that fed the target other tokens than the
first would corrupt its slice of the cache; a sampled request's draws, whose seed only the
first rank knows when the request gave none, also differ.  A rank whose proposals differed
goes on from the first rank's, its draft catching up on them as on any other tokens.  With
``draft_tensor_parallel_size`` equal to the target's model-parallel size the draft is instead
sharded over the ranks as the target is, through the same model-parallel group (every rank
then holds the same gathered logits); any other size is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from llama.engine.block_manager import SCRATCH_BLOCK, BlockManager
from llama.engine.requests import RunningRequest
from llama.engine.sampling import draw, greedy_tokens, sampling_distribution
from llama.model import Transformer
from llama.runtime import distributed
from llama.tokenizer import SentencePieceTokenizer, TiktokenTokenizer, Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["DraftProposer", "check_same_tokenizer", "tokenizer_difference"]

# Added to a request's seed to seed its draft's generator: the draft's draws and the
# request's own (which decide acceptance) must be different streams.
DRAFT_SEED_OFFSET = 0x5DEECE66D


@dataclass
class _DraftState:
    """What the draft holds of one request: the tokens whose keys and values its cache holds
    (positions 0 .. len - 1, in order), the blocks that hold them (and room for the step's
    proposals), and the generator of its sampled proposals (None: greedy)."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None


@dataclass
class _Row:
    """One proposing row of a step: its request, how many tokens it proposes, its tokens so
    far (the pending one last), its draft state."""

    request: RunningRequest
    k: int
    seq: list[int]
    state: _DraftState


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest run of tokens ``a`` and ``b`` both begin with."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, compared at C speed
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if list(a[:mid]) == list(b[:mid]):
            low = mid
        else:
            high = mid
    return low


class DraftProposer:
    """Proposes with a draft ``model`` (loaded whole on this rank: ``load_model(...,
    replicated=True)``) over a paged cache of its own of ``n_blocks`` blocks of ``block_size``
    tokens (block 0 the scratch block); ``n_decodable``: ids from this one up are never proposed
    (the target's sampler never samples them); ``prefill_chunk``: most tokens a row feeds per
    catch-up pass; ``multi_rank``: share the first rank's proposals (see the module's
    docstring); ``whole``: the draft is whole on this rank (else sharded over the ranks as the
    target is, its passes collectives of every rank).  A
    :class:`~llama.engine.speculative.RowProposer`."""

    def __init__(self, model: Transformer, *, n_blocks: int, block_size: int, n_decodable: int,
                 prefill_chunk: int = 512, multi_rank: bool = False, whole: bool = True) -> None:
        self.model = model
        self.whole = whole  # loaded whole on this rank (run alone), not sharded over the ranks
        self.device = model.device
        self.cache = model.new_kv_cache(n_blocks=n_blocks, block_size=block_size)
        self.blocks = BlockManager(n_blocks, block_size)
        self.block_size = block_size
        self.scratch = model.params.max_seq_len  # padding positions write the scratch block
        self.table_width = model.params.max_seq_len // block_size + 1
        self.n_decodable = n_decodable
        self.prefill_chunk = prefill_chunk
        self.multi_rank = multi_rank
        self._states: dict[int, _DraftState] = {}  # by request id, oldest first
        self.passes = 0  # statistics: the draft's forward passes
        self.differed = 0  # steps whose proposals differed from the first rank's (other ranks)

    # -- the books --------------------------------------------------------------------------

    def held(self, request_id: int) -> int:
        """How many of the draft's blocks the request holds."""
        state = self._states.get(request_id)
        return len(state.blocks) if state is not None else 0

    def fed(self, request_id: int) -> int:
        """How many of the request's tokens the draft's cache holds (0: none, or not known)."""
        state = self._states.get(request_id)
        return len(state.tokens) if state is not None else 0

    def check(self) -> None:
        """AssertionError unless the draft's pool agrees with its tables (tests)."""
        self.blocks.check([state.blocks for state in self._states.values()])
        for state in self._states.values():
            assert len(state.tokens) <= len(state.blocks) * self.block_size

    def release(self, request_id: int) -> None:
        """The request is gone from the batch (finished, failed, cancelled, preempted): its
        blocks go back; a resumed request starts again from nothing."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.blocks.release(state.blocks)

    def _room(self, request_id: int, state: _DraftState, n_tokens: int, proposing: set[int]) -> bool:
        """Give ``state`` blocks for exactly ``n_tokens`` tokens (those beyond go back), taking
        the blocks of requests that propose nothing this step (not in ``proposing``), oldest
        first, when the pool is short; False where there are still too few."""
        keep = self.blocks.blocks_for(n_tokens)
        if len(state.blocks) > keep:
            self.blocks.release(state.blocks[keep:])
            del state.blocks[keep:]
        while not self.blocks.grow(state.blocks, n_tokens):
            idle = next((i for i in self._states if i not in proposing), None)
            if idle is None:
                return False
            logger.debug("draft: request %d gives its blocks back for request %d's", idle, request_id)
            self.release(idle)
        return True

    # -- proposing ----------------------------------------------------------------------------

    def propose_rows(self, rows: Sequence[tuple[RunningRequest, int]]) -> tuple[dict[int, list[int]],
                                                                                dict[int, torch.Tensor]]:
        """Each row's ``k`` proposed tokens by request id, and for sampled rows the draft's
        distributions they were drawn from, (k, V) float64 by request id."""
        # A whole draft runs alone (no collective inside); a sharded one with every rank.
        with distributed.alone() if self.whole else contextlib.nullcontext():
            proposals, probs = self._propose(rows)
        if self.multi_rank:
            proposals = self._first_rank_s(rows, proposals)
        return proposals, probs

    def _propose(self, rows: Sequence[tuple[RunningRequest, int]]) -> tuple[dict[int, list[int]],
                                                                            dict[int, torch.Tensor]]:
        proposing = {request.id for request, _ in rows}
        live: list[_Row] = []
        for request, k in rows:
            seq = request.tokens_so_far()
            state = self._states.get(request.id)
            if state is None:
                state = self._states[request.id] = _DraftState(generator=self._generator_for(request))
            # What the cache holds that the request's tokens begin with stays (accepted
            # proposals included); the rest is written over.  The pending token is always fed:
            # its logits give the first proposal.
            del state.tokens[min(_common_prefix(state.tokens, seq), len(seq) - 1):]
            # it writes its tokens and k - 1 proposals (the last proposal is not fed)
            if self._room(request.id, state, len(seq) + k - 1, proposing):
                live.append(_Row(request, k, seq, state))
        if not live:
            return {}, {}
        proposed: list[list[int]] = [[] for _ in live]
        dists: list[list[torch.Tensor]] = [[] for _ in live]
        active = list(range(len(live)))
        logits = self._catch_up(live)  # (len(active), V): after each row's pending token
        for j in range(max(row.k for row in live)):
            if j:  # feed each row's last proposal, for the next
                active = [r for r in active if live[r].k > j]
                logits = self._decode([live[r] for r in active], [proposed[r][-1] for r in active],
                                      [len(live[r].seq) + j - 1 for r in active])
            logits[:, self.n_decodable :] = float("-inf")
            best = greedy_tokens(logits).tolist()
            for a, r in enumerate(active):
                request = live[r].request
                if request.sampling.greedy:
                    proposed[r].append(best[a])
                    continue
                q = sampling_distribution(logits[a : a + 1], request.sampling)  # (1, V)
                proposed[r].append(int(draw(q, live[r].state.generator)[0]))
                dists[r].append(q[0])
        out = {row.request.id: proposed[r] for r, row in enumerate(live)}
        probs = {row.request.id: torch.stack(dists[r]) for r, row in enumerate(live) if dists[r]}
        return out, probs

    def _generator_for(self, request: RunningRequest) -> Optional[torch.Generator]:
        """The generator of a sampled request's draft draws: seeded from the request's seed (its
        own generator's, on the first rank: drawn there when it gave none), offset."""
        if request.sampling.greedy:
            return None
        if request.generator is not None:
            seed = request.generator.initial_seed()
        else:  # another rank: its proposals give way to the first rank's where they differ
            seed = request.settings.seed if request.settings.seed is not None else request.id
        return torch.Generator(device=self.device).manual_seed((seed + DRAFT_SEED_OFFSET) % 2**63)

    def _table(self, states: Sequence[_DraftState]) -> torch.Tensor:
        """The block tables (len(states), table_width) of ``states``, on the device."""
        width = self.table_width
        rows = [s.blocks + [SCRATCH_BLOCK] * (width - len(s.blocks)) for s in states]
        return torch.tensor(rows, dtype=torch.long).view(-1, width).to(self.device)

    def _catch_up(self, live: list[_Row]) -> torch.Tensor:
        """Feed each row the tokens its draft cache lacks (at least its pending token), at most
        ``prefill_chunk`` a row per pass, the rows together (ragged: shorter rows padded at the
        scratch position).  The logits (len(live), V) float32 after each row's last token."""
        last: list[Optional[torch.Tensor]] = [None] * len(live)
        while batch := [r for r, row in enumerate(live) if len(row.state.tokens) < len(row.seq)]:
            spans = [(len(live[r].state.tokens), min(len(live[r].seq), len(live[r].state.tokens) + self.prefill_chunk))
                     for r in batch]
            width = max(end - start for start, end in spans)
            tokens = torch.zeros((len(batch), width), dtype=torch.long)
            positions = torch.full((len(batch), width), self.scratch, dtype=torch.long)
            for b, (r, (start, end)) in enumerate(zip(batch, spans)):
                tokens[b, : end - start] = torch.tensor(live[r].seq[start:end])
                positions[b, : end - start] = torch.arange(start, end)
            kv_len = max(end for _, end in spans)
            hidden = self.model.hidden_states(tokens.to(self.device), positions.to(self.device), kv_len, self.cache,
                                              block_table=self._table([live[r].state for r in batch]))
            self.passes += 1
            for b, (r, (start, end)) in enumerate(zip(batch, spans)):
                live[r].state.tokens.extend(live[r].seq[start:end])
                if end == len(live[r].seq):
                    last[r] = hidden[b, end - start - 1]
        return self.model.logits(torch.stack([h for h in last if h is not None]))

    def _decode(self, rows: list[_Row], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Feed one token per row at the given positions; the logits (len(rows), V) float32."""
        logits = self.model.decode_logits(torch.tensor(tokens, device=self.device).view(-1, 1),
                                          torch.tensor(positions, device=self.device).view(-1, 1),
                                          max(positions) + 1, self.cache,
                                          self._table([row.state for row in rows]))
        self.passes += 1
        for row, token in zip(rows, tokens):
            row.state.tokens.append(token)
        return logits

    def _first_rank_s(self, rows: Sequence[tuple[RunningRequest, int]],
                      proposals: dict[int, list[int]]) -> dict[int, list[int]]:
        """The first rank's proposals, on every rank (one broadcast; every rank proposes as many
        tokens for the same rows, the books being the same everywhere)."""
        order = [request.id for request, _ in rows if request.id in proposals]
        flat = [t for i in order for t in proposals[i]]
        if not flat:  # no row found room (the same on every rank)
            return proposals
        shared = distributed.broadcast_from_first_rank(torch.tensor(flat, dtype=torch.long, device=self.device))
        first = shared.tolist()
        if first == flat:
            return proposals
        self.differed += 1
        logger.debug("draft: this rank's proposals differ from the first rank's; going on with the first rank's")
        out, at = {}, 0
        for i in order:
            out[i] = first[at : at + len(proposals[i])]
            at += len(proposals[i])
        return out


# -- the draft's tokenizer against the target's ---------------------------------------------------


def _vocabulary(tokenizer: Tokenizer) -> list:
    """Each id's token (its piece or bytes), id after id, as the tokenizer's kind knows it."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return [tokenizer.sp_model.id_to_piece(i) for i in range(tokenizer.n_words)]
    if isinstance(tokenizer, TiktokenTokenizer):
        n_base = tokenizer.n_words - len(tokenizer.special_tokens)
        names = {i: name for name, i in tokenizer.special_tokens.items()}
        return [tokenizer.model.decode_single_token_bytes(i) for i in range(n_base)] + \
            [names.get(i) for i in range(n_base, tokenizer.n_words)]
    return [tokenizer.decode([i]) for i in range(tokenizer.n_words)]


def _digest(path: Union[str, Path, None]) -> Optional[str]:
    if path is None or not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokenizer_difference(draft: Tokenizer, target: Tokenizer) -> Optional[str]:
    """What differs between two tokenizers (None: nothing: the same ids for the same tokens):
    their kind, ``n_words``, the special tokens (BOS, EOS, the stop tokens), then each id's
    token (skipped where the two files are the same bytes)."""
    if type(draft) is not type(target):
        return f"their kinds differ ({type(draft).__name__} against {type(target).__name__})"
    if draft.n_words != target.n_words:
        return f"n_words differs ({draft.n_words} against {target.n_words})"
    for name in ("bos_id", "eos_id"):
        if getattr(draft, name) != getattr(target, name):
            return f"{name} differs ({getattr(draft, name)} against {getattr(target, name)})"
    if draft.stop_tokens != target.stop_tokens:
        return f"the stop tokens differ ({sorted(draft.stop_tokens)} against {sorted(target.stop_tokens)})"
    digest = _digest(getattr(draft, "model_path", None))
    if digest is not None and digest == _digest(getattr(target, "model_path", None)):
        return None
    ours, theirs = _vocabulary(draft), _vocabulary(target)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"token {i} differs ({a!r} against {b!r})"
    return None


def check_same_tokenizer(draft: Tokenizer, target: Tokenizer) -> None:
    """ValueError naming both files and what differs unless the draft's tokenizer is the
    target's (a draft proposes token ids: they must mean the same tokens)."""
    difference = tokenizer_difference(draft, target)
    if difference is not None:
        raise ValueError(
            f"the draft model's tokenizer {getattr(draft, 'model_path', '?')} is not the target's "
            f"{getattr(target, 'model_path', '?')}: {difference}. A draft must share the target's tokenizer "
            "(e.g. Llama 3.2 1B or 3B drafting Llama 3.1 8B or 70B)")
