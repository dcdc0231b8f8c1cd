"""Our tokenizers as llguidance sees them.

llguidance masks tokens by the bytes each id stands for, so it needs, for every id, its
bytes, whether it is a control token (never text: llguidance marks those and no grammar
can produce them), and which ids end a reply (allowed once the grammar is complete).

* Llama 3 and Llama 4 (:class:`~llama.tokenizer.TiktokenTokenizer` and its subclass): the
  tiktoken ``Encoding`` itself, whose byte-level BPE ranks llguidance reads directly (and
  tokenizes with natively); every id of the family's control block is a control token.
* Llama 2 and Code Llama (:class:`~llama.tokenizer.SentencePieceTokenizer`): each piece's
  bytes derived from the model: ``▁`` is a space, a byte-fallback piece ``<0xNN>`` is that
  byte, and SentencePiece's control and unknown pieces, plus Code Llama's infilling and
  ``<step>`` pieces (text-like pieces that the library treats as control tokens), are
  control tokens.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Optional

import llguidance
from llguidance.tiktoken import lltokenizer_from_encoding

from llama.tokenizer import SentencePieceTokenizer, TiktokenTokenizer, Tokenizer

if TYPE_CHECKING:
    from llama.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

__all__ = ["GrammarTokenizer", "default_end_ids", "sentencepiece_token_bytes"]

# SentencePiece's word-boundary mark, which stands for a space.
SPACE_MARK = "\u2581"


def default_end_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Every id that may end some reply: the tokenizer's stop tokens, plus Code Llama's
    ``<EOT>`` (the end of an infilling) and ``<step>`` (the end of a CodeLlama-70B-Instruct
    turn) where the model has them."""
    ids = set(tokenizer.stop_tokens)
    for attribute in ("eot_id", "step_id"):
        i = getattr(tokenizer, attribute, None)
        if i is not None:
            ids.add(i)
    return frozenset(ids)


def sentencepiece_token_bytes(tokenizer: SentencePieceTokenizer) -> tuple[list[bytes], list[int]]:
    """Each id's bytes, and the ids that are control tokens, of a SentencePiece model.

    A control token's "bytes" are its piece's name (llguidance marks them as special,
    so no grammar matches them as text)."""
    sp = tokenizer.sp_model
    control = tokenizer.control_piece_ids
    tokens: list[bytes] = []
    special: list[int] = []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or i in control:
            tokens.append(piece.encode("utf-8"))
            special.append(i)
        elif sp.is_byte(i):  # "<0x0A>"
            tokens.append(bytes([int(piece[3:-1], 16)]))
        else:
            tokens.append(piece.replace(SPACE_MARK, " ").encode("utf-8"))
    return tokens, special


class _SentencePieceVocabulary:
    """What ``llguidance.LLTokenizer`` reads from a Python tokenizer (the attributes of its
    ``TokenizerWrapper``), for a SentencePiece model."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: SentencePieceTokenizer) -> None:
        self._tokenizer = tokenizer
        self.tokens, self.special_token_ids = sentencepiece_token_bytes(tokenizer)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._byte_ids = [tokenizer.sp_model.piece_to_id(f"<0x{b:02X}>") for b in range(256)]

    def __call__(self, text: str) -> list[int]:
        """Token ids of ``text`` without SentencePiece's implicit leading space.

        llguidance calls this (from Rust, where an exception cannot be handled) only to
        tokenize text a grammar forces; this package never asks for forced tokens.  Text
        that holds one of Code Llama's control pieces is spelled in byte pieces."""
        try:
            return self._tokenizer.encode_infilling(text)
        except ValueError:
            return [self._byte_ids[b] for b in text.encode("utf-8")]


class GrammarTokenizer:
    """A tokenizer of ours, as llguidance's ``LLTokenizer``, with the ids that may end a
    constrained reply.

    ``end_ids`` (default :func:`default_end_ids`) must be control tokens; a grammar that is
    complete allows them, and only them.  Each matcher may narrow them to its request's own
    (Llama 3: ``<|eot_id|>`` for a chat reply, ``<|end_of_text|>`` for a completion).

    Building one reads the whole vocabulary: about a second for Llama 3's 128k ids; build
    it once per tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer, end_ids: Optional[Iterable[int]] = None) -> None:
        self.tokenizer = tokenizer
        self.n_words: int = tokenizer.n_words
        ends = sorted(default_end_ids(tokenizer) if end_ids is None else set(end_ids))
        if not ends:
            raise ValueError("end_ids is empty: a constrained reply needs at least one token that can end it")
        if isinstance(tokenizer, TiktokenTokenizer):
            self._check_end_ids(ends, set(tokenizer.special_tokens.values()))
            self.ll = lltokenizer_from_encoding(tokenizer.model, n_vocab=self.n_words, eos_token=ends)
            encoding = tokenizer.model
            self._spec = dict(kind="tiktoken", ranks=encoding._mergeable_ranks, special_tokens=encoding._special_tokens,
                              pattern=encoding._pat_str, n_vocab=self.n_words, eos=ends)
        elif isinstance(tokenizer, SentencePieceTokenizer):
            vocabulary = _SentencePieceVocabulary(tokenizer)
            self._check_end_ids(ends, set(vocabulary.special_token_ids))
            # a duck-typed tokenizer, which llguidance's stubs do not name
            self.ll = llguidance.LLTokenizer(vocabulary, eos_token=ends)  # type: ignore[arg-type]
            self._spec = dict(kind="bytes", tokens=vocabulary.tokens, special_token_ids=vocabulary.special_token_ids,
                              eos_token_id=vocabulary.eos_token_id, bos_token_id=vocabulary.bos_token_id, eos=ends)
        else:
            raise TypeError(
                f"structured output supports SentencePiece and tiktoken tokenizers, not {type(tokenizer).__name__}"
            )
        self.end_ids: frozenset[int] = frozenset(ends)
        # Bounds every grammar compiled for this tokenizer in time, where set
        # (llama.structured.compiler: the engine sets its own).
        self.compiler: Optional[GrammarCompiler] = None
        if self.ll.vocab_size != self.n_words:
            raise RuntimeError(f"llguidance sees {self.ll.vocab_size} tokens in a tokenizer of {self.n_words}")
        logger.debug("grammar tokenizer for %s: %d ids, end ids %s", type(tokenizer).__name__, self.n_words, ends)

    def _check_end_ids(self, ends: list[int], control: set[int]) -> None:
        for i in ends:
            if not 0 <= i < self.n_words:
                raise ValueError(f"end id {i} is outside the vocabulary [0, {self.n_words})")
            if i not in control:
                raise ValueError(
                    f"end id {i} ({self.tokenizer.decode([i])!r}) is text, not a control token: a reply can only "
                    "be ended by control tokens such as the tokenizer's stop tokens"
                )

    def worker_spec(self) -> dict:
        """This vocabulary as :func:`llama.structured.compile_worker.lltokenizer` rebuilds it in
        another process (picklable: the token bytes or tiktoken's ranks, the control and end ids)."""
        return self._spec

    @property
    def words_per_mask(self) -> int:
        """32-bit words in one row of a token bitmask (one bit per id)."""
        return (self.n_words + 31) // 32
