"""Tokenizers: SentencePiece (Llama 2) and tiktoken BPE (Llama 3.x, Llama 4), behind one interface.

Which one a ``tokenizer.model`` is, is read from the file itself (:func:`load_tokenizer`):
Llama 3's and Llama 4's files are text, one ``<base64 token> <rank>`` per line (Llama 4's
holds 200,000 ranks, Llama 3's 128,000); Llama 2's is a SentencePiece model protobuf.  Hugging
Face's ``tokenizer.json`` of Llama 3.x and 4 is read too (the same ranks, written as
byte-level BPE's vocabulary).
"""

from __future__ import annotations

import base64
import binascii
import logging
import operator
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

logger = logging.getLogger(__name__)

__all__ = ["Tokenizer", "SentencePieceTokenizer", "TiktokenTokenizer", "Llama4Tokenizer", "load_tokenizer",
           "read_tokenizer_json", "decodable_vocab_size"]


class Tokenizer:
    """What generation and chat formats need from a tokenizer.

    ``encode`` never turns text into control tokens: special-token strings inside the
    text are encoded as ordinary text.  Control tokens are added by id.  Text holding
    surrogate code points is not valid Unicode and is refused with ``ValueError``.
    """

    n_words: int  # vocabulary size, control tokens included
    bos_id: int
    eos_id: int
    stop_tokens: frozenset[int]  # generation ends at any of these

    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        raise NotImplementedError

    def decode(self, t: Sequence[int]) -> str:
        raise NotImplementedError

    def _check_text(self, s: object) -> str:
        if not isinstance(s, str):
            raise TypeError(f"text to encode must be a str, got {type(s).__name__}")
        # A str can hold surrogate code points (json.loads('"\ud800"'), surrogateescape),
        # which are not text: SentencePiece fails on them with an opaque RuntimeError and
        # tiktoken silently turns them into U+FFFD.  Refuse them the same way for both.
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"text holds the surrogate code point {s[e.start]!r} at index {e.start}, which is not "
                    "valid Unicode; decode the input with errors='replace' (or fix its source) before encoding"
                ) from None
        return s

    def _check_ids(self, t: Sequence[int]) -> list[int]:
        if isinstance(t, (str, bytes)):
            raise TypeError("decode takes a sequence of int token ids, not a string")
        try:
            ids = [operator.index(i) for i in t]  # ints (and int tensors/numpy ints), never floats
        except TypeError:
            raise TypeError(f"token ids must be ints, got {t!r:.80}") from None
        for i in ids:
            if not 0 <= i < self.n_words:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.n_words})")
        return ids


class SentencePieceTokenizer(Tokenizer):
    """Llama 2's tokenizer: ids and BOS/EOS come from the SentencePiece model file."""

    def __init__(self, model_path: Union[str, Path]) -> None:
        from sentencepiece import SentencePieceProcessor

        self.model_path = str(model_path)
        self.sp_model = SentencePieceProcessor()
        try:
            self.sp_model.Load(self.model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{model_path} is not a readable SentencePiece model: {e}") from None
        self.n_words = self.sp_model.vocab_size()
        self.bos_id = self.sp_model.bos_id()
        self.eos_id = self.sp_model.eos_id()
        self.pad_id = self.sp_model.pad_id()  # -1 in Llama 2's model: no pad token
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"{model_path}: a Llama tokenizer needs BOS and EOS tokens, this model has none")
        self.stop_tokens = frozenset({self.eos_id})
        # Code Llama's pieces: infilling (<PRE> prefix, <SUF> suffix, <MID> middle,
        # <EOT> end of the infilled text) and CodeLlama-70B-Instruct's <step> (end of a
        # turn).  None where the model has no such piece.
        self.prefix_id = self._piece_id("▁<PRE>")
        self.suffix_id = self._piece_id("▁<SUF>")
        self.middle_id = self._piece_id("▁<MID>")
        self.eot_id = self._piece_id("▁<EOT>")
        self.step_id = self._piece_id("<step>")
        # Pieces SentencePiece would produce from plain text (user-defined symbols) but
        # that act as control tokens: text that encodes to one of them is refused.
        self._control_pieces = {
            i: self.sp_model.id_to_piece(i)
            for i in (self.prefix_id, self.suffix_id, self.middle_id, self.eot_id, self.step_id)
            if i is not None
        }
        logger.debug("SentencePiece tokenizer %s: %d words, BOS %d, EOS %d", model_path, self.n_words, self.bos_id,
                     self.eos_id)

    @property
    def control_piece_ids(self) -> frozenset[int]:
        """Code Llama's pieces that act as control tokens (<PRE>, <SUF>, <MID>, <EOT>, <step>),
        where the model has them."""
        return frozenset(self._control_pieces)

    def _piece_id(self, piece: str) -> Optional[int]:
        i = self.sp_model.piece_to_id(piece)
        return None if i == self.sp_model.unk_id() or self.sp_model.id_to_piece(i) != piece else i

    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        t = self._encode_text(self._check_text(s))
        return ([self.bos_id] if bos else []) + t + ([self.eos_id] if eos else [])

    def _encode_text(self, s: str) -> list[int]:
        t = self.sp_model.encode(s)
        if self._control_pieces:
            for i in t:
                if i in self._control_pieces:
                    piece = self._control_pieces[i].replace("▁", " ")
                    raise ValueError(
                        f"the text contains {piece!r}, which this tokenizer reads as its control token {i}; "
                        "remove it from the text (control tokens are added by the library, never typed)"
                    )
        return t

    def decode(self, t: Sequence[int]) -> str:
        return self.sp_model.decode(self._check_ids(t))

    @property
    def has_infilling(self) -> bool:
        """Whether the model has Code Llama's infilling tokens <PRE>, <SUF>, <MID>, <EOT>."""
        return None not in (self.prefix_id, self.suffix_id, self.middle_id, self.eot_id)

    # SentencePiece puts a space ("▁") before the text it encodes.  Infilling needs
    # the suffix and the infilled text without it, so, as Code Llama's reference does,
    # the text is encoded after a sentinel character whose pieces are then dropped.
    INFILLING_SENTINEL = "☺"  # ☺

    def encode_infilling(self, s: str) -> list[int]:
        """Encode ``s`` without SentencePiece's implicit leading space."""
        sentinel = self._encode_text(self.INFILLING_SENTINEL)
        return self._encode_text(self.INFILLING_SENTINEL + self._check_text(s))[len(sentinel) :]

    def decode_infilling(self, t: Sequence[int]) -> str:
        """Decode ids without dropping a leading space (the inverse of :meth:`encode_infilling`)."""
        text = self.sp_model.decode(self._encode_text(self.INFILLING_SENTINEL) + self._check_ids(t))
        return text[len(self.INFILLING_SENTINEL) :]


# Llama 3's pre-tokenisation regex (its ``pat_str``).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
# Meta's named control tokens, in id order after the BPE vocabulary, with the names
# llama-models gives them (Llama 3.0 files give the same ids to the tokens they share).
# The remaining ids are "<|reserved_special_token_2|>" onwards.
LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message: the model expects a tool's answer next (3.1)
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",  # starts a tool call (3.1)
    "<|image|>",  # an image's place in a prompt (3.2 vision)
)
# tiktoken's Rust core can panic on very long inputs: encode at most this many
# characters at a time, and cut runs of only-whitespace or only-non-whitespace
# characters longer than MAX_UNBROKEN_RUN (such runs would otherwise stay one piece).
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_UNBROKEN_RUN = 25_000


def llama3_special_tokens() -> list[str]:
    named = list(LLAMA3_NAMED_SPECIAL_TOKENS)
    first_unnamed = 2  # reserved_0 and reserved_1 are among the named ones
    return named + [
        f"<|reserved_special_token_{first_unnamed + i}|>" for i in range(LLAMA3_NUM_SPECIAL_TOKENS - len(named))
    ]


def read_bpe_ranks(path: Union[str, Path]) -> dict[bytes, int]:
    """Parse a tiktoken rank file: one ``<base64 bytes> <rank>`` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{lineno} is not a '<base64 token> <rank>' line") from None
    if not ranks:
        raise ValueError(f"{path} holds no BPE ranks")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: BPE ranks must be 0..{len(ranks) - 1} with none missing or repeated")
    # Byte-level BPE starts every text from single bytes: one missing makes tiktoken's
    # Rust core panic (not even an Exception) on the first text that holds it.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(
            f"{path} lacks {len(missing)} of the 256 single-byte tokens ({shown}) that byte-level BPE needs "
            "to encode any text: it is not a complete tiktoken rank file (use the tokenizer.model that came "
            "with the checkpoint)"
        )
    return ranks


class TiktokenTokenizer(Tokenizer):
    """Llama 3.x's tokenizer: BPE ranks from ``tokenizer.model`` plus Meta's 256 control tokens."""

    # The family, as data: its split pattern, its control tokens, the attributes naming the
    # ones the library uses, and those that end generation.
    split_pattern = LLAMA3_SPLIT_PATTERN
    named_ids = {"bos_id": "<|begin_of_text|>", "eos_id": "<|end_of_text|>", "eot_id": "<|eot_id|>",
                 "eom_id": "<|eom_id|>", "python_tag_id": "<|python_tag|>", "pad_id": "<|finetune_right_pad_id|>"}
    stop_names = ("eos_id", "eot_id", "eom_id")
    # The ids named_ids sets (by setattr), typed for the type checker; Llama 4's has no python_tag_id.
    eot_id: int
    eom_id: int
    python_tag_id: int
    pad_id: int

    @staticmethod
    def special_token_names() -> list[str]:
        return llama3_special_tokens()

    def __init__(self, model_path: Union[str, Path], ranks: Optional[dict[bytes, int]] = None) -> None:
        """The BPE ranks of ``model_path`` (or ``ranks``, read from it by the caller: a
        ``tokenizer.json``'s, :func:`read_tokenizer_json`) and this family's control tokens after them."""
        import tiktoken

        self.model_path = str(model_path)
        ranks = read_bpe_ranks(model_path) if ranks is None else ranks
        n_base = len(ranks)
        self.special_tokens = {name: n_base + i for i, name in enumerate(self.special_token_names())}
        self.model = tiktoken.Encoding(
            name=Path(model_path).name,
            pat_str=self.split_pattern,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = n_base + len(self.special_tokens)
        for attribute, name in self.named_ids.items():
            setattr(self, attribute, self.special_tokens[name])
        self.stop_tokens = frozenset(getattr(self, attribute) for attribute in self.stop_names)
        logger.debug("%s %s: %d words", type(self).__name__, model_path, self.n_words)

    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        s = self._check_text(s)
        t: list[int] = []
        for start in range(0, len(s), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_long_runs(s[start : start + TIKTOKEN_MAX_ENCODE_CHARS], MAX_UNBROKEN_RUN):
                # disallowed_special=() with no allowed specials: "<|eot_id|>" in the
                # text is encoded as the characters it is made of.
                t.extend(self.model.encode(piece, allowed_special=set(), disallowed_special=()))
        return ([self.bos_id] if bos else []) + t + ([self.eos_id] if eos else [])

    def decode(self, t: Sequence[int]) -> str:
        return self.model.decode(self._check_ids(t))


# -- Llama 4 ---------------------------------------------------------------------------------

# Llama 4's pre-tokenisation regex (OpenAI's o200k pattern).
LLAMA4_SPLIT_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA4_NUM_BASE_TOKENS = 200_000  # how a Llama 4 rank file is told from a Llama 3 one (128,000)
LLAMA4_NUM_SPECIAL_TOKENS = 2048


def _numbered(name: str, start: int, stop: int) -> list[str]:
    return [f"<|{name}_reserved_special_token_{i}|>" for i in range(start, stop)]


def llama4_special_tokens() -> list[str]:
    """Llama 4's 2,048 control tokens in id order after the BPE vocabulary (ids 200000..202047):
    the basic five, the post-training (chat/tool) block, the vision block, the reasoning
    block, then plain reserved tokens to fill the 2,048."""
    text = ["<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>"]
    text += _numbered("text_post_train", 0, 6) + ["<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>"]
    text += _numbered("text_post_train", 8, 69)
    vision = ["<|image_start|>", "<|image_end|>"] + _numbered("vision", 0, 2)
    vision += ["<|tile_x_separator|>", "<|tile_y_separator|>"] + _numbered("vision", 2, 6)
    vision += ["<|image|>"] + _numbered("vision", 6, 7) + ["<|patch|>"] + _numbered("vision", 7, 1048)
    reasoning = _numbered("reasoning", 0, 8) + ["<|reasoning_thinking_start|>", "<|reasoning_thinking_end|>"]
    basic = ["<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
    named = basic + text + vision + reasoning
    return named + [f"<|reserved_special_token_{i}|>" for i in range(LLAMA4_NUM_SPECIAL_TOKENS - len(named))]


class Llama4Tokenizer(TiktokenTokenizer):
    """Llama 4's tokenizer: 200,000 BPE ranks from ``tokenizer.model``, the o200k split
    pattern, and 2,048 control tokens (202,048 ids).  Generation stops at
    ``<|end_of_text|>``, ``<|eom|>`` and ``<|eot|>``, as in Meta's reference."""

    split_pattern = LLAMA4_SPLIT_PATTERN
    named_ids = {"bos_id": "<|begin_of_text|>", "eos_id": "<|end_of_text|>", "eot_id": "<|eot|>", "eom_id": "<|eom|>",
                 "header_start_id": "<|header_start|>", "header_end_id": "<|header_end|>",
                 "python_start_id": "<|python_start|>", "python_end_id": "<|python_end|>",
                 "pad_id": "<|finetune_right_pad|>"}
    stop_names = ("eos_id", "eom_id", "eot_id")
    header_start_id: int  # set from named_ids, as above
    header_end_id: int
    python_start_id: int
    python_end_id: int

    @staticmethod
    def special_token_names() -> list[str]:
        return llama4_special_tokens()


def _split_long_runs(s: str, max_run: int) -> Iterator[str]:
    """Cut ``s`` so that no piece holds more than ``max_run`` consecutive whitespace
    (or consecutive non-whitespace) characters."""
    start = 0
    run = 0
    run_is_space = s[:1].isspace()
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run_is_space, run = is_space, 1
            continue
        run += 1
        if run > max_run:
            yield s[start:i]
            start, run = i, 1
    yield s[start:]


def _looks_like_bpe_rank_file(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    first = head.split(b"\n", 1)[0].strip()
    parts = first.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except binascii.Error:
        return False
    return True


def _count_rank_lines(path: Path) -> int:
    """Non-empty lines of a rank file (cheap: no decoding)."""
    with open(path, "rb") as f:
        data = f.read()
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1) - data.count(b"\n\n")


# The largest tokenizer.model Meta ships is Llama 4's, 3,622,230 bytes (Llama 3's: 2.2 MB,
# Llama 2's: 0.5 MB).  Ten times that is far beyond any real one: a larger file is refused
# unread rather than parsed into memory.
MAX_TOKENIZER_BYTES = 10 * 3_622_230


# -- Hugging Face's tokenizer.json (Llama 3.x and 4) ------------------------------------------

# Meta's Llama 4 tokenizer.json is about 28 MB (Llama 3's 9 MB): a larger one is refused unread.
MAX_TOKENIZER_JSON_BYTES = 128 * 2**20


def byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's alphabet (GPT-2's, which Hugging Face's Llama 3 and 4 tokenizer.json
    write tokens in): printable Latin-1 bytes stand for themselves, the other bytes (controls,
    space, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_tokenizer_json(path: Union[str, Path]) -> tuple[type["TiktokenTokenizer"], dict[bytes, int]]:
    """The family (:class:`TiktokenTokenizer` for Llama 3.x, :class:`Llama4Tokenizer`) and the
    BPE ranks of a Hugging Face ``tokenizer.json`` of byte-level BPE: its vocabulary below
    the first control token, each token's characters turned back into bytes, its id as its
    rank (as Meta's ``tokenizer.model`` holds them: HF's files were made from those).  The
    family is read from its control tokens (``<|eot_id|>``: Llama 3, ``<|eot|>``: Llama 4),
    whose ids must be where the family puts them.  ValueError (saying which file to pass
    instead) for anything else: a Llama 2 ``tokenizer.json`` is SentencePiece's pieces, not
    bytes (pass ``tokenizer.model``)."""
    import json

    path = Path(path)
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON tokenizer file ({e})") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ValueError(f"{path} is not a BPE tokenizer.json; pass the model's tokenizer.model with --tokenizer_path")
    if '"ByteLevel"' not in json.dumps(data.get("pre_tokenizer")):
        raise ValueError(
            f"{path} is not a byte-level BPE tokenizer (Llama 3/4's): a Llama 2 or Code Llama tokenizer.json "
            "holds SentencePiece pieces; pass the tokenizer.model beside it with --tokenizer_path"
        )
    added = {t["id"]: t["content"] for t in data.get("added_tokens") or () if isinstance(t, dict)
             and isinstance(t.get("id"), int) and isinstance(t.get("content"), str) and t.get("special", True)}
    names = set(added.values())
    family = Llama4Tokenizer if "<|eot|>" in names or "<|header_start|>" in names else TiktokenTokenizer
    if family is TiktokenTokenizer and "<|eot_id|>" not in names:
        raise ValueError(f"{path} has neither Llama 3's control tokens (<|eot_id|>) nor Llama 4's (<|eot|>); "
                         "pass the model's tokenizer.model with --tokenizer_path")
    n_base = min(added)
    to_byte = {c: b for b, c in byte_level_alphabet().items()}
    ranks: dict[bytes, int] = {}
    for token, rank in model["vocab"].items():
        if not isinstance(rank, int) or rank >= n_base:
            continue
        try:
            ranks[bytes(to_byte[c] for c in token)] = rank
        except KeyError:
            raise ValueError(f"{path}: token {token!r} is not written in byte-level BPE's alphabet") from None
    if sorted(ranks.values()) != list(range(n_base)):
        raise ValueError(f"{path}: the tokens below the first control token ({n_base}) are not ids 0..{n_base - 1} "
                         "each once; pass the model's tokenizer.model with --tokenizer_path")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of the 256 single-byte tokens byte-level BPE needs")
    expected = family.special_token_names()
    # The ones every release names alike (Llama 3.0's file calls 3.1's <|eom_id|> a reserved token).
    for name in (family.named_ids["bos_id"], family.named_ids["eos_id"], family.named_ids["eot_id"]):
        want = n_base + expected.index(name)
        if added.get(want) != name:
            raise ValueError(f"{path}: control token {name} is at id {want} in the {family.__name__} family, but "
                             f"this file has {added.get(want)!r} there; pass the model's tokenizer.model with "
                             "--tokenizer_path")
    return family, ranks


def check_tokenizer_file(path: Path) -> None:
    """Refuse an existing tokenizer ``path`` that is not a regular file (a FIFO or a device such
    as /dev/zero would block or never end; ``ValueError``) or is unreadable (``PermissionError``),
    without reading it.  Light (no torch, no tokenizer library): the command lines call it on
    their flags before they import torch."""
    if not path.is_file():
        raise ValueError(f"tokenizer file {path} is not a regular file (a directory, FIFO or device?): "
                         "pass the tokenizer.model file itself")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"tokenizer file {path} is not readable")


def load_tokenizer(path: Union[str, Path]) -> Tokenizer:
    """Open ``tokenizer.model`` as whichever kind it is (tiktoken rank file or SentencePiece),
    or a Hugging Face ``tokenizer.json`` of Llama 3.x or 4 (:func:`read_tokenizer_json`).

    Refused before reading: a path that is missing (``FileNotFoundError``), not a regular
    file (a FIFO or a device such as /dev/zero would block or never end; ``ValueError``),
    unreadable (``PermissionError``), or larger than :data:`MAX_TOKENIZER_BYTES`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    check_tokenizer_file(path)
    size = path.stat().st_size
    if path.suffix == ".json":
        if size > MAX_TOKENIZER_JSON_BYTES:
            raise ValueError(f"tokenizer file {path} is {size} bytes, over {MAX_TOKENIZER_JSON_BYTES}: it is not a "
                             "Llama tokenizer.json; pass the tokenizer that came with the checkpoint")
        family, ranks = read_tokenizer_json(path)
        return family(path, ranks)
    if size > MAX_TOKENIZER_BYTES:
        raise ValueError(
            f"tokenizer file {path} is {size} bytes, over {MAX_TOKENIZER_BYTES} (ten times the largest real "
            "tokenizer.model, Llama 4's): it is not a tokenizer; pass the tokenizer.model that came with the checkpoint"
        )
    if _looks_like_bpe_rank_file(path):
        if _count_rank_lines(path) == LLAMA4_NUM_BASE_TOKENS:
            return Llama4Tokenizer(path)
        return TiktokenTokenizer(path)
    try:
        return SentencePieceTokenizer(path)
    except ValueError:
        raise ValueError(
            f"{path} is neither a SentencePiece model (Llama 2) nor a tiktoken BPE rank file (Llama 3)"
        ) from None


# A checkpoint's vocabulary may be larger than its tokenizer by at most this many ids
# (padding rows that no text maps to); beyond it the tokenizer is taken to be another
# model's.  Meta's own checkpoints never pad (Llama 2 takes vocab_size from the
# tokenizer, Code Llama 7B/13B/34B and Llama 3/3.x/4 store exactly the tokenizer's
# count, and Meta's Llama 4 loader asserts equality), but fine-tunes and converted
# checkpoints do: rounding the vocabulary up to a multiple of 64 or 128 (x ranks) for
# faster matrix products, or tokens added to tokenizer.json but not tokenizer.model.
MAX_VOCAB_PADDING = 1024


def decodable_vocab_size(tokenizer: Tokenizer, vocab_size: int, tokenizer_path: Union[str, Path] = "tokenizer") -> int:
    """How many of a checkpoint's ``vocab_size`` ids ``tokenizer`` can decode.

    Equal sizes: ``vocab_size``.  A tokenizer larger than the vocabulary, or smaller by
    more than :data:`MAX_VOCAB_PADDING` ids, is refused with ``ValueError`` (it belongs to
    another model).  Smaller by a little: the rows past it are padding; the tokenizer's
    size is returned, and the caller must never produce ids at or above it (mask those
    logits to -inf before choosing a token).
    """
    n_words = tokenizer.n_words
    if n_words > vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer_path} has {n_words} tokens but the model's vocabulary "
            f"has {vocab_size}: use the tokenizer.model that came with this checkpoint"
        )
    if vocab_size - n_words > MAX_VOCAB_PADDING:
        raise ValueError(
            f"the tokenizer {tokenizer_path} has {n_words} tokens but the model's vocabulary has {vocab_size}: "
            f"{vocab_size - n_words} ids would have no text, more than a padded vocabulary has "
            f"(at most {MAX_VOCAB_PADDING}); use the tokenizer.model that came with this checkpoint"
        )
    if n_words < vocab_size:
        logger.warning(
            "the model's vocabulary has %d ids, the tokenizer %s %d: ids %d..%d are taken as padding and "
            "will never be generated", vocab_size, tokenizer_path, n_words, n_words, vocab_size - 1,
        )
    return n_words
