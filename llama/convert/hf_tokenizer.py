"""Hugging Face tokenizer files for a Meta ``tokenizer.model``, written without transformers.

:func:`hf_tokenizer_files` returns the contents of ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json`` and ``generation_config.json``,
so that ``AutoTokenizer.from_pretrained`` on a converted directory needs only
``transformers`` (no SentencePiece, tiktoken or protobuf) and encodes text as this
library does, BOS included:

* Llama 2 (SentencePiece BPE): the pieces and their ids, merges ordered by the merged
  piece's id (SentencePiece merges the best-scored piece first, and a BPE model's ids
  follow its scores), byte fallback, the dummy-prefix space added to the text and
  every space written as "▁" (SentencePiece's identity normalisation).
* Llama 3 (tiktoken): byte-level BPE over the rank file, merges ordered by the merged
  token's rank (tiktoken merges the lowest rank first) and whole pieces kept when they
  are tokens (``ignore_merges``), the same split pattern, Meta's 256 control tokens.

The chat templates render a dialog to the same tokens as :mod:`llama.formats.chat`, and
``generation_config.json`` names every stop token of the family.  One difference
stays: this library encodes a control-token string typed in the text (``"<s>"``,
``"<|eot_id|>"``) as plain characters, while a Hugging Face tokenizer reads it as the
control token.
"""

from __future__ import annotations

from typing import Any

from llama.formats.chat import B_INST, B_SYS, E_INST, E_SYS
from llama.tokenizer import (
    Llama4Tokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    byte_level_alphabet,
    read_bpe_ranks,
)

__all__ = ["hf_tokenizer_files", "image_row_special_tokens", "LLAMA2_CHAT_TEMPLATE", "LLAMA3_CHAT_TEMPLATE",
           "LLAMA4_CHAT_TEMPLATE"]

# Llama 2: BOS [INST] (<<SYS>> system <</SYS>> folded into the first user message) user [/INST] answer EOS ...
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system_message = none %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message is not none %}"
    "{% set content = " + repr(B_SYS) + " + system_message + " + repr(E_SYS) + " + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '" + B_INST + " ' + content | trim + ' " + E_INST + "' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# Llama 3: BOS, then <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> per message, then
# the assistant's open header.  Content is not trimmed: llama-models (and this library) encode
# message text as it is (transformers' own template trims it, as the older llama3 repository did).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)
# Llama 4: as Llama3ChatFormat's successor in llama/chat_format.py: <|header_start|>role<|header_end|>\n\n
# content, <|eot|> after each message (<|eom|> after a tool's, whose role is written "ipython").
LLAMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] in ('tool', 'ipython') else message['role'] %}"
    "{{ '<|header_start|>' + role + '<|header_end|>\\n\\n' + message['content'] }}"
    "{{ '<|eom|>' if role == 'ipython' else '<|eot|>' }}"
    "{% endfor %}"
    "{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}"
)


def _added_token(token_id: int, content: str) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def _bos_template(bos: str, bos_id: int) -> dict[str, Any]:
    """Post-processor adding BOS before each sequence (as ``encode(..., bos=True)``)."""
    special = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [special, {"Sequence": {"id": "A", "type_id": 0}}, special, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def _merges(vocab: dict[str, int], pieces: list[str]) -> list[list[str]]:
    """Every (left, right) pair of tokens whose concatenation is a token, ordered by that
    token's id (then the halves' ids): BPE then merges in the source's priority order."""
    found = []
    for piece in pieces:
        merged = vocab[piece]
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((merged, vocab[left], vocab[right], left, right))
    found.sort()
    return [[left, right] for *_, left, right in found]


def _sentencepiece_json(tok: SentencePieceTokenizer) -> dict[str, Any]:
    sp = tok.sp_model
    vocab: dict[str, int] = {}
    specials: list[dict[str, Any]] = []
    learned: list[str] = []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        vocab[piece] = i
        if sp.is_control(i) or sp.is_unknown(i):
            specials.append(_added_token(i, piece))
        elif not sp.is_byte(i) and not sp.is_unused(i):
            learned.append(piece)
    merge_vocab = {p: vocab[p] for p in learned}
    bos = sp.id_to_piece(tok.bos_id)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": _bos_template(bos, tok.bos_id),
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": _merges(merge_vocab, learned),
        },
    }


_byte_to_char = byte_level_alphabet  # the alphabet tokenizer.json's tokens are written in


def image_row_special_tokens(tok: TiktokenTokenizer) -> dict[str, int]:
    """Llama 3's control tokens as Hugging Face's Llama 3.2 Vision tokenizers number them:
    ``<|image|>`` at ``tok.n_words`` (128256, the first learnt row past the vocabulary, the id
    Meta's chat format writes and the model's ``image_token_index``) instead of tiktoken's place
    (128011), whose id and those after it hold ``<|reserved_special_token_2|>`` onwards, one more
    than tiktoken names (transformers' ``convert_mllama_weights_to_hf``)."""
    image = tok.special_tokens["<|image|>"]
    named = {name: i for name, i in tok.special_tokens.items() if i < image}
    first = 2  # <|reserved_special_token_0|> and _1 are among the named ones
    reserved = {f"<|reserved_special_token_{first + j}|>": image + j for j in range(tok.n_words - image)}
    return {**named, **reserved, "<|image|>": tok.n_words}


def _tiktoken_json(tok: TiktokenTokenizer, special_tokens: dict[str, int]) -> dict[str, Any]:
    to_char = _byte_to_char()
    ranks = read_bpe_ranks(tok.model_path)
    vocab = {"".join(to_char[b] for b in token): rank for token, rank in ranks.items()}
    pieces = sorted(vocab, key=vocab.__getitem__)
    bos = next(name for name, i in special_tokens.items() if i == tok.bos_id)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(i, name) for name, i in sorted(special_tokens.items(), key=lambda kv: kv[1])],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": tok.model._pat_str}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": _bos_template(bos, tok.bos_id),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": _merges(vocab, pieces),
        },
    }


def hf_tokenizer_files(tok: Tokenizer, model_max_length: int,
                       image_row: bool = False) -> dict[str, dict[str, Any]]:
    """File name -> JSON contents of the Hugging Face tokenizer files for ``tok``.

    ``eos_token`` is the family's end of text (``</s>``, ``<|end_of_text|>``);
    ``generation_config.json`` lists every stop token (Llama 3: also ``<|eot_id|>`` and
    ``<|eom_id|>``), so ``generate`` ends a chat reply where this library does.  ``image_row``
    (a Llama 3.2 Vision model, Llama 3's tokenizer): ``<|image|>`` is numbered as Hugging Face's
    Mllama tokenizers number it (:func:`image_row_special_tokens`).
    """
    if isinstance(tok, TiktokenTokenizer):
        template = LLAMA4_CHAT_TEMPLATE if isinstance(tok, Llama4Tokenizer) else LLAMA3_CHAT_TEMPLATE
        if image_row and (isinstance(tok, Llama4Tokenizer) or "<|image|>" not in tok.special_tokens):
            raise ValueError("a Llama 3.2 Vision checkpoint needs Llama 3's tokenizer.model (with <|image|>)")
        special = image_row_special_tokens(tok) if image_row else dict(tok.special_tokens)
        tokenizer_json = _tiktoken_json(tok, special)
        names = {i: name for name, i in special.items()}
        extra: dict[str, Any] = {}
    elif image_row:
        raise ValueError("a Llama 3.2 Vision checkpoint needs Llama 3's tokenizer.model (tiktoken), "
                         f"not {type(tok).__name__}")
    elif isinstance(tok, SentencePieceTokenizer):
        tokenizer_json, template = _sentencepiece_json(tok), LLAMA2_CHAT_TEMPLATE
        names = {t["id"]: t["content"] for t in tokenizer_json["added_tokens"]}
        extra = {"unk_token": tokenizer_json["model"]["unk_token"], "legacy": True, "add_prefix_space": True}
    else:
        raise TypeError(f"no Hugging Face tokenizer files are known for {type(tok).__name__}")
    bos, eos = names[tok.bos_id], names[tok.eos_id]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        **extra,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": template,
        "added_tokens_decoder": {
            str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tokenizer_json["added_tokens"]
        },
    }
    special_map = {"bos_token": bos, "eos_token": eos,
                   **({"unk_token": extra["unk_token"]} if extra.get("unk_token") else {})}
    stops = sorted(tok.stop_tokens)
    generation = {
        "bos_token_id": tok.bos_id,
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
    }
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": config,
        "special_tokens_map.json": special_map,
        "generation_config.json": generation,
    }
