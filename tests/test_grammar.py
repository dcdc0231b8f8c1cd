"""The grammar engine of structured output (llama.structured) on our three tokenizer
families: SentencePiece (Llama 2, Code Llama), Llama 3's tiktoken (a tiny rank file and
Meta's real one) and Llama 4's.

Replies are random walks: each step picks uniformly among the ids the grammar allows, so
only the constraint can make them valid.  They are decoded with our own Tokenizer and
checked by independent means: ``json`` and ``jsonschema`` for JSON, ``re.fullmatch`` for
regular expressions, the ``lark`` package for Lark grammars.
"""

from __future__ import annotations

import codecs
import json
import random
import re
import weakref
from pathlib import Path
from typing import Annotated, Literal, Optional

import jsonschema
import lark
import pytest
import torch

from llama.structured import (
    GrammarMasker,
    GrammarTokenizer,
    compile_response_format,
    default_end_ids,
)
from llama.structured.matcher import mask_logits_
from llama.structured.vocabulary import sentencepiece_token_bytes
from llama.tokenizer import load_tokenizer

# -- the tokenizers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp(sp_tokenizer_path) -> GrammarTokenizer:
    return GrammarTokenizer(load_tokenizer(sp_tokenizer_path))


@pytest.fixture(scope="module")
def codellama(codellama_tokenizer_path) -> GrammarTokenizer:
    return GrammarTokenizer(load_tokenizer(codellama_tokenizer_path))


@pytest.fixture(scope="module")
def tiny_tiktoken(tiny_tiktoken_path) -> GrammarTokenizer:
    return GrammarTokenizer(load_tokenizer(tiny_tiktoken_path))


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer_path) -> GrammarTokenizer:
    return GrammarTokenizer(load_tokenizer(llama3_tokenizer_path))


@pytest.fixture(scope="module")
def llama4() -> GrammarTokenizer:
    llama_models = pytest.importorskip("llama_models")
    return GrammarTokenizer(load_tokenizer(Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"))


FAMILIES = ["sp", "codellama", "tiny_tiktoken", "llama3"]


@pytest.fixture(params=FAMILIES)
def family(request) -> GrammarTokenizer:
    return request.getfixturevalue(request.param)


# -- random walks ----------------------------------------------------------------------------


def walk(grammar, seed: int, *, end_ids=None, max_tokens: int = 400, closing: float = 0.0) -> str:
    """A reply drawn uniformly among the allowed ids at each step until an end id, decoded
    with our tokenizer.  ``closing``: the chance that a step draws only among the allowed ids
    whose text holds a closing character (for grammars whose uniform walks need not end)."""
    rng = random.Random(seed)
    m = grammar.matcher(end_ids)
    gt = grammar.tokenizer
    closers = closing_ids(gt) if closing else set()
    tokens: list[int] = []
    while True:
        allowed = m.allowed_ids()
        assert allowed, "the grammar allowed no token"
        if closing and rng.random() < closing:
            allowed = [t for t in allowed if t in closers or t in m.end_ids] or allowed
        t = rng.choice(allowed)
        m.consume(t)
        if t in m.end_ids:
            assert m.is_ended and m.is_complete
            break
        tokens.append(t)
        assert len(tokens) <= max_tokens, f"no end after {max_tokens} tokens: {gt.tokenizer.decode(tokens)!r}"
    text = gt.tokenizer.decode(tokens)
    # What llguidance matched is what our tokenizer decodes (SentencePiece drops the space
    # that the first piece may start with: its implicit leading space).
    matched = gt.ll.decode_bytes(tokens).decode("utf-8")
    assert text == matched or (matched.startswith(" ") and text == matched[1:]), (text, matched)
    return text


def closing_ids(gt: GrammarTokenizer) -> frozenset[int]:
    """The ids whose text holds a closing character, worked out once per tokenizer (it reads
    every id's bytes: most of a walk's time on Meta's 128k vocabulary when done for each walk)."""
    if gt not in _CLOSING_IDS:
        _CLOSING_IDS[gt] = frozenset(i for i in range(gt.n_words) if not gt.ll.is_special_token(i)
                                     and any(c in gt.ll.decode_bytes([i]) for c in b'"}]'))
    return _CLOSING_IDS[gt]


_CLOSING_IDS: "weakref.WeakKeyDictionary[GrammarTokenizer, frozenset[int]]" = weakref.WeakKeyDictionary()


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


# Bounded schemas: every uniform walk ends.
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "nickname": {"type": "string", "maxLength": 3},  # optional
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    "nullable_and_pattern": {
        "type": "object",
        "properties": {
            "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
        },
        "required": ["note", "code", "flags"],
        "additionalProperties": False,
    },
    "integers": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2,
                 "maxItems": 4},
}

REGEXES = [r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"#[0-9a-f]{6}"]

# Written in the subset of Lark that llguidance and the lark package read alike.
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""

SEEDS = range(3)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_json_schema_walks_validate(family, name):
    grammar = compile_response_format(json_schema_format(SCHEMAS[name]), family)
    for seed in SEEDS:
        jsonschema.validate(json.loads(walk(grammar, seed)), SCHEMAS[name])


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_json_object_walks_are_objects(family):
    # A uniform walk through any JSON object need not end (on Llama 3's vocabulary 7 of
    # 10 seeds were still going after 2,000 tokens): half the steps draw among closers.
    grammar = compile_response_format({"type": "json_object"}, family)
    for seed in SEEDS:
        assert isinstance(json.loads(walk(grammar, seed, closing=0.5, max_tokens=2000)), dict)


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_walks_match(family, regex):
    grammar = compile_response_format({"type": "regex", "regex": regex}, family)
    for seed in SEEDS:
        text = walk(grammar, seed)
        assert re.fullmatch(regex, text), text


def test_lark_walks_parse(family):
    grammar = compile_response_format({"type": "grammar", "grammar": ARITHMETIC}, family)
    parser = lark.Lark(ARITHMETIC)
    for seed in range(5):
        parser.parse(walk(grammar, seed))


def test_pydantic_schema(llama3):
    """A schema as pydantic writes it ($defs, titles, Optional, Literal), as the openai
    client's ``parse`` sends it (closed objects, bounded values: a walk must end)."""
    pydantic = pytest.importorskip("pydantic")
    closed = pydantic.ConfigDict(extra="forbid")

    class Address(pydantic.BaseModel):
        model_config = closed
        city: str = pydantic.Field(max_length=10)
        zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")

    class Person(pydantic.BaseModel):
        """Someone."""

        model_config = closed
        name: str = pydantic.Field(max_length=12)
        kind: Literal["friend", "foe"]
        home: Address
        phone: Optional[str] = pydantic.Field(max_length=5)
        scores: list[Annotated[int, pydantic.Field(ge=0, le=100)]] = pydantic.Field(min_length=1, max_length=3)

    schema = Person.model_json_schema()
    grammar = compile_response_format(json_schema_format(schema), llama3)
    for seed in SEEDS:
        text = walk(grammar, seed)
        jsonschema.validate(json.loads(text), schema)
        Person.model_validate_json(text)


# -- the tokenizer bridge --------------------------------------------------------------------


def test_sentencepiece_bytes_match_decode(sp, codellama):
    """Each piece's bytes, as the bridge gives them, are what our tokenizer decodes: every
    id alone (after a piece, so that SentencePiece's leading-space rule does not apply),
    and byte-fallback pieces together in multi-byte characters."""
    for gt in (sp, codellama):
        tok = gt.tokenizer
        tokens, special = sentencepiece_token_bytes(tok)
        assert len(tokens) == tok.n_words == gt.n_words
        anchor = tok.encode("a", bos=False, eos=False)
        for i, b in enumerate(tokens):
            if i in special or (len(b) == 1 and b[0] >= 0x80):
                continue
            assert tok.decode(anchor + [i]) == tok.decode(anchor) + b.decode("utf-8"), (i, tok.sp_model.id_to_piece(i))
            assert gt.ll.decode_bytes([i]) == b and not gt.ll.is_special_token(i)
        for text in ["東京 😀 naïve", "ÿ\u0100 \x7f\t\n  two  spaces", "a ☺ b"]:
            ids = tok.encode(text, bos=False, eos=False)
            assert b"".join(tokens[i] for i in ids).decode("utf-8") == " " + text  # the implicit leading space
    # Control tokens: unknown, BOS, EOS, and Code Llama's infilling and <step> pieces (not ☺).
    assert sentencepiece_token_bytes(sp.tokenizer)[1] == [0, 1, 2]
    cl = codellama.tokenizer
    assert sentencepiece_token_bytes(cl)[1] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert cl.sp_model.id_to_piece(8) == "\u263a" and not codellama.ll.is_special_token(8)
    assert all(codellama.ll.is_special_token(i) for i in range(8))


def test_tiktoken_bytes_match_decode(tiny_tiktoken, llama3):
    for gt in (tiny_tiktoken, llama3):
        tok = gt.tokenizer
        specials = set(tok.special_tokens.values())
        ids = range(gt.n_words) if gt.n_words < 1000 else [*range(0, gt.n_words, 97), *sorted(specials)]
        for i in ids:
            text = tok.model.decode_single_token_bytes(i) if i not in specials else None
            # llguidance marks a special token by a leading 0xff byte, so it takes the single
            # byte 0xff (never in UTF-8 text, so never allowed anyway) for one.
            assert gt.ll.is_special_token(i) == (i in specials or text == b"\xff"), i
            if not gt.ll.is_special_token(i):
                assert gt.ll.decode_bytes([i]) == text, i


def test_end_ids(sp, codellama, llama3):
    assert sp.end_ids == default_end_ids(sp.tokenizer) == {sp.tokenizer.eos_id}
    cl = codellama.tokenizer
    assert codellama.end_ids == {cl.eos_id, cl.eot_id, cl.step_id}  # EOS, <EOT> (infilling), <step> (70B chat)
    t3 = llama3.tokenizer
    assert llama3.end_ids == {t3.eos_id, t3.eot_id, t3.eom_id} == {128001, 128009, 128008}
    with pytest.raises(ValueError, match="is text, not a control token"):
        GrammarTokenizer(sp.tokenizer, end_ids=[100])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        GrammarTokenizer(sp.tokenizer, end_ids=[10**6])
    with pytest.raises(ValueError, match="end_ids is empty"):
        GrammarTokenizer(sp.tokenizer, end_ids=[])


def test_a_complete_grammar_allows_only_the_requests_end_ids(llama3):
    tok = llama3.tokenizer
    grammar = compile_response_format({"type": "regex", "regex": "ab"}, llama3)
    chat = grammar.matcher({tok.eot_id})  # a chat reply ends with <|eot_id|>
    completion = grammar.matcher({tok.eos_id})  # a completion with <|end_of_text|>
    both = grammar.matcher()
    for m in (chat, completion, both):
        assert not m.can_end
        for t in tok.encode("ab", bos=False, eos=False):
            m.consume(t)
        assert m.can_end and m.is_complete and not m.is_ended
    assert chat.allowed_ids() == [tok.eot_id]
    assert completion.allowed_ids() == [tok.eos_id]
    assert both.allowed_ids() == sorted(llama3.end_ids)
    with pytest.raises(ValueError, match="does not end this reply"):
        chat.consume(tok.eos_id)
    chat.consume(tok.eot_id)
    assert chat.is_ended
    with pytest.raises(ValueError, match="follows the end"):
        chat.consume(tok.eot_id)
    with pytest.raises(ValueError, match="not among the grammar tokenizer's"):
        grammar.matcher({tok.bos_id})


def test_consume_refuses_a_token_the_grammar_does_not_allow(sp):
    tok = sp.tokenizer
    m = compile_response_format({"type": "regex", "regex": "[0-9]+"}, sp).matcher()
    (x,) = [i for i in tok.encode("x", bos=False, eos=False) if tok.decode([i]) == "x"]
    with pytest.raises(ValueError, match="not allowed by the grammar here"):
        m.consume(x)
    assert m.error and not m.is_complete and not m.can_end
    # A failed matcher's row allows only its end ids, so that sampling stays possible.
    assert m.allowed_ids() == [tok.eos_id]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.consume(tok.n_words)


def test_copy_and_reset(tiny_tiktoken):
    tok = tiny_tiktoken.tokenizer
    grammar = compile_response_format({"type": "regex", "regex": "(the|then) end"}, tiny_tiktoken)
    m = grammar.matcher()
    start = m.allowed_ids()
    for t in tok.encode("the", bos=False, eos=False):
        m.consume(t)
    other = m.copy()
    for t in tok.encode(" end", bos=False, eos=False):
        other.consume(t)
    assert other.is_complete and not m.can_end  # the copy moved on alone
    for t in tok.encode("n end", bos=False, eos=False):
        m.consume(t)
    assert m.is_complete
    m.reset()
    assert m.allowed_ids() == start and not m.is_ended


# -- grammars that accept everything ----------------------------------------------------------


def could_start_text(b: bytes) -> bool:
    """Whether ``b`` starts some valid UTF-8 text."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(b, final=False)
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("response_format", [
    {"type": "regex", "regex": "(?s:.*)"},
    {"type": "grammar", "grammar": "start: /(.|\\n)*/"},
])
def test_a_grammar_that_accepts_everything_masks_only_what_cannot_be_text(family, response_format):
    """Every id that can start text is allowed, and the end ids; masked: the other control
    tokens, the ids no text starts with (a lone UTF-8 continuation byte, bytes never in
    UTF-8: llguidance matches text, not bytes), and the ids past the tokenizer's."""
    grammar = compile_response_format(response_format, family)
    m = grammar.matcher()
    expected = [i for i in range(family.n_words) if i in family.end_ids
                or (not family.ll.is_special_token(i) and could_start_text(family.ll.decode_bytes([i])))]
    assert m.allowed_ids() == expected
    pad = 5  # a checkpoint whose vocabulary is padded past the tokenizer
    logits = torch.randn(1, family.n_words + pad)
    GrammarMasker(family, num_threads=1).apply(logits, [0], [m])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == expected


# -- bad response formats --------------------------------------------------------------------


@pytest.mark.parametrize("response_format, message", [
    (["json_object"], "response_format must be an object"),
    ({}, "response_format.type is missing"),
    ({"type": "xml"}, "response_format.type is 'xml': it must be one of"),
    ({"type": "json_object", "schema": {}}, "'schema' is not a field of type 'json_object'"),
    ({"type": "json_schema"}, "response_format.json_schema is required"),
    ({"type": "json_schema", "json_schema": "{}"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name is required"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema is missing"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "strict must be true or false"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}},
     "'extra' is not one of its fields"),
    (json_schema_format({"type": "strnig"}), r"(?s)response_format.json_schema.schema: .*strnig"),
    (json_schema_format({"type": "integer", "minimum": 5, "maximum": 1}),
     r"(?s)response_format.json_schema.schema: .*minimum"),
    (json_schema_format({"enum": []}), "response_format.json_schema.schema: "),
    (json_schema_format({"type": "string", "format": "no-such-format"}), "no-such-format"),
    (json_schema_format({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema: "),
    (json_schema_format({"type": "number", "minimum": float("nan")}), "response_format.json_schema.schema is not JSON"),
    ({"type": "regex", "regex": "a(b"}, "(?s)response_format.regex: .*unclosed group"),
    ({"type": "regex", "regex": 3}, "response_format.regex must be a string"),
    ({"type": "regex", "regex": "[^\\s\\S]"}, "response_format.regex matches no text at all"),
    ({"type": "grammar", "grammar": "start: missing_rule"}, "(?s)response_format.grammar: .*missing_rule"),
    ({"type": "grammar", "grammar": "start: (\"a\""}, "response_format.grammar: "),
])
def test_bad_response_formats_are_value_errors(sp, response_format, message):
    with pytest.raises(ValueError, match=message):
        compile_response_format(response_format, sp)


def test_text_is_no_constraint(sp):
    assert compile_response_format(None, sp) is None
    assert compile_response_format({"type": "text"}, sp) is None


# -- masks on logits --------------------------------------------------------------------------


def advanced(grammar, text: str):
    m = grammar.matcher()
    for t in grammar.tokenizer.tokenizer.encode(text, bos=False, eos=False):
        m.consume(t)
    return m


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [[3, 1], [1, 2]])  # scattered rows, a contiguous run
def test_masks_applied_to_constrained_rows_only(llama3, dtype, rows):
    schema = compile_response_format(json_schema_format(SCHEMAS["nested"]), llama3)
    digits = compile_response_format({"type": "regex", "regex": "[0-9]{2,5}"}, llama3)
    matchers = [advanced(schema, '{"user": {"name": "Al'), advanced(digits, "12")]
    width = llama3.n_words + 128  # padded past the tokenizer
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    GrammarMasker(llama3).apply(logits, rows, matchers)
    for r in range(4):
        if r not in rows:
            assert torch.equal(logits[r], before[r])  # bit-identical
    for r, m in zip(rows, matchers):
        allowed = torch.zeros(width, dtype=torch.bool)
        allowed[m.allowed_ids()] = True
        assert torch.equal(logits[r][allowed], before[r][allowed])
        assert (logits[r][~allowed] == float("-inf")).all()
        assert 0 < allowed.sum() < llama3.n_words


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_mask_logits_is_masked_fill_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    width = 32 * 5 - 3  # the last word only partly used
    bitmask = torch.randint(-(2**31), 2**31, (3, 5), dtype=torch.int32, generator=g)
    logits = torch.randn(3, width, generator=g, dtype=torch.float64).to(dtype)
    logits[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0], dtype=dtype)
    bits = torch.tensor([[(int(w) >> j) & 1 for w in row for j in range(32)] for row in bitmask.tolist()])[:, :width]
    expected = logits.masked_fill(bits == 0, float("-inf"))
    mask_logits_(logits, bitmask)
    assert torch.equal(logits.view(torch.uint8), expected.view(torch.uint8))  # NaN and -0.0 kept too


def test_masks_of_a_batch_are_each_matchers_own(llama3):
    """Eight rows computed in parallel give what each matcher gives alone."""
    g = {name: compile_response_format(json_schema_format(s), llama3) for name, s in SCHEMAS.items()}
    email = compile_response_format({"type": "regex", "regex": REGEXES[0]}, llama3)
    matchers = [advanced(g["nested"], '{"'), advanced(g["nested"], '{"user":{"name":"x'),
                advanced(g["enum_and_array"], '{"color":"re'), advanced(g["enum_and_array"], ""),
                advanced(g["nullable_and_pattern"], '{"note":null,'), advanced(g["integers"], "[1,"),
                advanced(g["integers"], "["), advanced(email, "abc@d")]
    bitmask = GrammarMasker(llama3, num_threads=2).fill(matchers)
    for i, m in enumerate(matchers):
        alone = torch.zeros((1, llama3.words_per_mask), dtype=torch.int32)
        m.fill_bitmask(alone, 0)
        assert torch.equal(bitmask[i], alone[0])


def test_masker_refuses_bad_input(sp, llama3):
    grammar = compile_response_format({"type": "json_object"}, llama3)
    masker = GrammarMasker(llama3, num_threads=1)
    logits = torch.zeros(2, llama3.n_words)
    with pytest.raises(ValueError, match="2 rows for 1 matchers"):
        masker.apply(logits, [0, 1], [grammar.matcher()])
    with pytest.raises(ValueError, match="distinct"):
        masker.apply(logits, [0, 0], [grammar.matcher(), grammar.matcher()])
    with pytest.raises(ValueError, match="fewer than the tokenizer's"):
        masker.apply(logits[:, :100], [0], [grammar.matcher()])
    other = compile_response_format({"type": "json_object"}, sp)
    with pytest.raises(ValueError, match="another tokenizer"):
        masker.apply(logits, [0], [other.matcher()])
    masker.apply(logits, [], [])  # nothing constrained: nothing to do
    assert not logits.any()


# -- Llama 4 ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama4(llama4):
    tok = llama4.tokenizer
    assert llama4.end_ids == {tok.eos_id, tok.eot_id, tok.eom_id} == {200001, 200008, 200007}
    specials = set(tok.special_tokens.values())
    for i in [*range(0, llama4.n_words, 101), *sorted(specials)]:
        assert llama4.ll.is_special_token(i) == (i in specials), i
        if i not in specials:
            assert llama4.ll.decode_bytes([i]) == tok.model.decode_single_token_bytes(i), i
    for name in ("nested", "nullable_and_pattern"):
        grammar = compile_response_format(json_schema_format(SCHEMAS[name]), llama4)
        for seed in SEEDS:
            jsonschema.validate(json.loads(walk(grammar, seed, end_ids={tok.eot_id})), SCHEMAS[name])
    grammar = compile_response_format({"type": "grammar", "grammar": ARITHMETIC}, llama4)
    lark.Lark(ARITHMETIC).parse(walk(grammar, 0))
