"""Code Llama's fill-in-the-middle prompts, as Meta's codellama reference builds them.

Code Llama 7B and 13B (base and Instruct) and 70B were trained to write the code that
goes between a prefix and a suffix.  The prompt is::

    <s> <PRE> {prefix} <SUF>{suffix} <MID>          (prefix-suffix-middle, the default)
    <s> <PRE> <SUF>{suffix} <MID> {prefix}          (suffix_first=True)

where ``<PRE>``, ``<SUF>``, ``<MID>`` are control tokens (SentencePiece pieces
``▁<PRE>``, ``▁<SUF>``, ``▁<MID>``), the prefix is encoded as ordinary text and the
suffix without SentencePiece's leading space.  The model writes the middle and ends it
with ``<EOT>``.
"""

from __future__ import annotations

from typing import List, Sequence, TypedDict, cast

from llama.tokenizer import SentencePieceTokenizer, Tokenizer

__all__ = [
    "InfillingPrediction",
    "check_infilling",
    "infilling_prompt_tokens",
    "infilling_stop_tokens",
    "decode_infilling",
]


class InfillingPrediction(TypedDict, total=False):
    generation: str  # the infilled middle
    full_text: str  # prefix + generation + suffix
    tokens: List[str]  # with logprobs=True: the generated pieces
    logprobs: List[float]


def check_infilling(tokenizer: Tokenizer) -> SentencePieceTokenizer:
    """``tokenizer`` if it has Code Llama's infilling tokens, else a ValueError saying so."""
    if not isinstance(tokenizer, SentencePieceTokenizer) or not tokenizer.has_infilling:
        raise ValueError(
            "text infilling needs a Code Llama tokenizer with the <PRE>, <SUF>, <MID> and <EOT> tokens "
            "(Code Llama 7B, 13B or 70B, base or Instruct); this model's tokenizer has none"
        )
    return tokenizer


def infilling_prompt_tokens(tokenizer: Tokenizer, prefix: str, suffix: str, *, suffix_first: bool = False) -> list[int]:
    """The prompt ids for filling in the code between ``prefix`` and ``suffix``."""
    tok = check_infilling(tokenizer)
    for name, text in (("prefix", prefix), ("suffix", suffix)):
        if not isinstance(text, str):
            raise TypeError(f"the {name} must be a str, got {type(text).__name__}")
    # check_infilling: the tokenizer has every infilling token
    prefix_id, suffix_id, middle_id = cast(int, tok.prefix_id), cast(int, tok.suffix_id), cast(int, tok.middle_id)
    if suffix_first:
        return (
            [tok.bos_id, prefix_id, suffix_id]
            + tok.encode_infilling(suffix)
            + [middle_id]
            + tok.encode(prefix, bos=False, eos=False)
        )
    return (
        [tok.bos_id, prefix_id]
        + tok.encode(prefix, bos=False, eos=False)
        + [suffix_id]
        + tok.encode_infilling(suffix)
        + [middle_id]
    )


def infilling_stop_tokens(tokenizer: Tokenizer) -> frozenset[int]:
    """Where infilling generation stops: ``<EOT>`` (the reference's stop token) or EOS."""
    tok = check_infilling(tokenizer)
    return frozenset({cast(int, tok.eot_id), tok.eos_id})  # check_infilling: it has <EOT>


def decode_infilling(tokenizer: Tokenizer, tokens: Sequence[int]) -> str:
    """The infilled text of generated ``tokens``: up to the first ``<EOT>`` (or EOS),
    decoded keeping a leading space (the prompt ended in ``<MID>``, not in text)."""
    tok = check_infilling(tokenizer)
    ids = list(tokens)
    stops = [k for k, t in enumerate(ids) if t in (tok.eot_id, tok.eos_id)]
    if stops:
        ids = ids[: stops[0]]
    return tok.decode_infilling(ids)
