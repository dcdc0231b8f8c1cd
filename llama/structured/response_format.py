"""A ``response_format`` in OpenAI's shapes, checked and compiled into a grammar.

Accepted shapes (anything else is a ``ValueError`` naming the field at fault, raised
before anything is generated):

* ``None`` or ``{"type": "text"}``: no constraint (:func:`compile_response_format`
  returns ``None``).
* ``{"type": "json_object"}``: any JSON object.
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``:
  JSON valid against the schema (JSON Schema draft 2020-12 as llguidance supports it:
  properties come in the schema's order; unsupported keywords are errors, not ignored).
  The schema is enforced whatever ``strict`` says.
* ``{"type": "regex", "regex": "..."}``: text the regular expression matches in full
  (Rust ``regex`` syntax, close to Python's ``re`` without lookarounds or backreferences).
* ``{"type": "grammar", "grammar": "..."}``: text of a Lark grammar, as llguidance reads
  Lark (``start`` is the start rule).

JSON may hold whitespace between its tokens, at most :data:`JSON_WHITESPACE` at each place
(one space, or a line break and an indentation): enough for a model to write JSON the
way it learned to, bounded so that a model cannot fill its reply with whitespace.  A
schema's own ``"x-guidance"`` options (llguidance's) override this.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, Iterable, Mapping, Optional

import llguidance

from llama.structured.limits import check_grammar_limits, check_schema_keywords
from llama.structured.matcher import GrammarMatcher, error_message
from llama.structured.vocabulary import GrammarTokenizer

logger = logging.getLogger(__name__)

__all__ = ["Grammar", "compile_response_format", "JSON_WHITESPACE", "RESPONSE_FORMAT_TYPES"]

# JSON whitespace allowed at each place it may appear (the regex matches it at most once
# there): one space, or one or two line breaks and up to 20 spaces or tabs (as llama.cpp's
# JSON grammars do).  llguidance's default, any run of whitespace, lets a weak or
# untrained model write whitespace until it runs out of tokens.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})"

# The fields each type takes, besides "type".
RESPONSE_FORMAT_TYPES: dict[str, tuple[str, ...]] = {
    "text": (),
    "json_object": (),
    "json_schema": ("json_schema",),
    "regex": ("regex",),
    "grammar": ("grammar",),
}
JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")


class Grammar:
    """A compiled response format for one tokenizer: checked, ready to start matchers.

    Compiling already built one llguidance matcher and computed its first mask (which
    is how an empty grammar is found); :meth:`matcher` copies it.  A ``Grammar`` holds
    no per-request state, so one may be cached and shared by any number of requests.
    """

    def __init__(self, kind: str, source: str, tokenizer: GrammarTokenizer, initial: llguidance.LLMatcher) -> None:
        self.kind = kind  # the response format's type
        self.source = source  # the grammar in llguidance's own form (JSON text)
        self.tokenizer = tokenizer
        self._initial = initial

    def matcher(self, end_ids: Optional[Iterable[int]] = None) -> GrammarMatcher:
        """A new matcher at the start of the grammar, for one request; ``end_ids``: the ids
        that may end this request's reply (some of the tokenizer's end ids; default all)."""
        return GrammarMatcher(self, self._initial.deep_copy(), end_ids)

    def __repr__(self) -> str:
        return f"Grammar({self.kind!r}, {len(self.source)} chars)"


def compile_response_format(response_format: Optional[Mapping[str, Any]],
                            tokenizer: GrammarTokenizer) -> Optional[Grammar]:
    """The grammar that ``response_format`` asks for, or ``None`` for no constraint.

    Raises ``ValueError`` naming the field at fault (``response_format.type``,
    ``response_format.json_schema.schema``, ``response_format.regex``, ...) for an unknown
    shape, a schema, regex or grammar that does not compile, or one that matches no text.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(
            f"response_format must be an object such as {{'type': 'json_object'}}, not {type(response_format).__name__}"
        )
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        known = ", ".join(repr(k) for k in RESPONSE_FORMAT_TYPES)
        got = "missing" if kind is None else f"{kind!r}"
        raise ValueError(f"response_format.type is {got}: it must be one of {known}")
    fields = RESPONSE_FORMAT_TYPES[kind]
    unknown = sorted(set(response_format) - {"type", *fields})
    if unknown:
        raise ValueError(
            f"response_format: {', '.join(repr(k) for k in unknown)} is not a field of type {kind!r} "
            f"(its fields: {', '.join(repr(f) for f in ('type', *fields))})"
        )
    for field in fields:
        if field not in response_format:
            raise ValueError(f"response_format.{field} is required for type {kind!r}")
    if kind == "text":
        return None
    param = "response_format"
    if kind == "json_object":
        source = _json_schema_grammar({"type": "object"}, param)
    elif kind == "json_schema":
        param, schema = _json_schema_field(response_format["json_schema"])
        source = _json_schema_grammar(schema, param)
    else:
        param = f"response_format.{kind}"
        text = response_format[kind]
        if not isinstance(text, str):
            raise ValueError(f"{param} must be a string, not {type(text).__name__}")
        if kind == "regex":
            source = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            source = llguidance.LLMatcher.grammar_from_lark(text)
    return compile_grammar(kind, source, tokenizer, param)


def _json_schema_field(json_schema: Any) -> tuple[str, Mapping[str, Any]]:
    """``response_format.json_schema`` checked: the name of its schema field and the schema."""
    param = "response_format.json_schema"
    if not isinstance(json_schema, Mapping):
        raise ValueError(f"{param} must be an object with 'name' and 'schema', not {type(json_schema).__name__}")
    unknown = sorted(set(json_schema) - set(JSON_SCHEMA_FIELDS))
    if unknown:
        raise ValueError(f"{param}: {', '.join(repr(k) for k in unknown)} is not one of its fields "
                         f"({', '.join(repr(f) for f in JSON_SCHEMA_FIELDS)})")
    name = json_schema.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{param}.name is required: a non-empty string naming the schema")
    if json_schema.get("strict") not in (None, True, False):
        raise ValueError(f"{param}.strict must be true or false, not {json_schema['strict']!r}")
    if "description" in json_schema and not isinstance(json_schema["description"], (str, type(None))):
        raise ValueError(f"{param}.description must be a string")
    schema = json_schema.get("schema")
    if not isinstance(schema, Mapping):
        got = "missing" if schema is None else f"a {type(schema).__name__}"
        raise ValueError(f"{param}.schema is {got}: it must be a JSON Schema object")
    return f"{param}.schema", schema


def _json_schema_grammar(schema: Mapping[str, Any], param: str) -> str:
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{param} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{param} nests too deeply to be a schema") from None
    check_schema_keywords(schema, param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_pattern": JSON_WHITESPACE})
    except ValueError as e:
        raise ValueError(f"{param}: {e}") from None


def compile_grammar(kind: str, source: str, tokenizer: GrammarTokenizer, param: str) -> Grammar:
    """``source`` (a grammar in llguidance's JSON form) checked and compiled for ``tokenizer``;
    ``ValueError`` prefixed with ``param`` where it does not compile or matches no text, or
    where llguidance's compiler could recurse too deeply into it (:mod:`~llama.structured.limits`:
    such a grammar would crash the process).  Where the tokenizer has a ``compiler``
    (:mod:`llama.structured.compiler`), also where it takes longer than that compiler's budget:
    it is compiled there first."""
    start = time.perf_counter()
    check_grammar_limits(source, param)
    # Short errors: llguidance's verbose ones append its parser state and the whole grammar.
    limit_options = {"verbose_errors": False}
    if tokenizer.compiler is not None:  # first in a worker process, within its time budget
        tokenizer.compiler.check(source, param, limit_options)
    limits = llguidance.LLParserLimits(**limit_options)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer.ll, limits=limits)
    if is_error:
        message = error_message(messages[0])
        if kind == "regex":
            message = _regex_message(message)
        raise ValueError(f"{param}: {message}")
    for warning in messages:
        logger.warning("%s: %s", param, error_message(warning))
    initial = llguidance.LLMatcher(tokenizer.ll, source, log_level=0, limits=limits)
    if initial.is_error():
        raise ValueError(f"{param}: {error_message(initial.get_error())}")
    # The first mask: llguidance compiles a regex or grammar that matches no text without
    # an error, and then allows no token at all, not even an end token.
    first = initial.compute_bitmask()
    if initial.is_error() and not error_message(initial.get_error()).startswith("NoExtension"):
        raise ValueError(f"{param}: {error_message(initial.get_error())}")
    if initial.is_error() or not any(first):
        raise ValueError(f"{param} matches no text at all, not even an empty reply")
    logger.debug("compiled %s %s in %.1f ms", kind, param, 1e3 * (time.perf_counter() - start))
    return Grammar(kind, source, tokenizer, initial)


def _regex_message(message: str) -> str:
    """A regex's error without the position and the line of the one-rule Lark grammar
    llguidance wraps a regex in (``start: /.../``), which the user never wrote."""
    message = re.sub(r"^at \d+\(\d+\): ", "", message)
    lines = message.splitlines()
    for k, line in enumerate(lines):
        if re.match(r"\s*\d+ \| start: ", line):
            lines = lines[:k]
            break
    return "\n".join(lines).strip()
