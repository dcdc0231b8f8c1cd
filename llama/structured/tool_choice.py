"""``tool_choice``: whether a chat reply may, must or must not call the declared tools.

OpenAI's values, checked by :func:`check_tool_choice` (with the rest of a chat request's rules in
:mod:`llama.formats.chat_request`):

* ``"auto"`` (the default): the model chooses; its reply is read for calls as always.
* ``"none"``: no tool may be called.  The tools are not declared to the model at all
  (a model that sees tools writes calls whatever it is told), and its reply is content.
* ``"required"``: the reply is one call of a declared tool or, with
  ``parallel_tool_calls`` (the default), one or more.
* ``{"type": "function", "function": {"name": "f"}}``: the reply is a call of ``f``
  (or, with ``parallel_tool_calls``, one or more calls of it).

"required" and a named function are enforced with a grammar (:func:`tool_call_grammar`):
the reply can only be calls written in the model's own tool format, the one
``tool_prompt_format`` declared the tools in, so that the model writes what it was
trained to write:

* ``"json"`` (Llama 3.1): ``{"type": "function", "name": "f", "parameters": {...}}``;
  several calls are separated by ``"; "``;
* ``"function_tag"`` (Llama 3.1): ``<function=f>{...}</function>``; several calls follow
  one another on separate lines;
* ``"python_list"`` (Llama 3.2, 3.3): ``[f(a=1, b="x"), g(c=[1, 2])]``, the arguments in
  the order of the function's ``properties`` (the required ones always, the others when
  the model chooses), each value a JSON value (which the pythonic parser reads);
* a built-in tool: ``<|python_tag|>brave_search.call(query="...")`` (also
  ``wolfram_alpha`` and ``photogen``), or ``<|python_tag|>`` and code for
  ``code_interpreter``; always a single call.

A custom function's arguments are a JSON object valid against its ``parameters`` schema
(JSON Schema as llguidance supports it; properties in the schema's order), written as
``json.dumps`` writes JSON (``", "`` and ``": "`` between items, no other whitespace).
Only declared tools can be called.  One limit remains: a number is only bounded by its
schema, so an unbounded ``"number"`` may be written as ``1e400``, which no JSON reader
takes as a finite number; such a reply is returned as content.
"""

from __future__ import annotations

import json
import keyword
from typing import Any, Mapping, Optional, Sequence, cast

import llguidance

from llama.formats.chat_request import TOOL_CHOICE_MODES, ToolChoice, check_tool_choice
from llama.formats.tool_call_stream import SEPARATORS  # how a format writes several calls
from llama.formats.tool_calls import QUERY_TOOLS, TOOL_PROMPT_FORMATS, ToolPromptFormat
from llama.formats.tool_prompts import check_tools, declared_tool_names
from llama.structured.compiler import CompileRefused
from llama.structured.limits import check_schema_keywords, check_schema_limits
from llama.structured.response_format import Grammar, compile_grammar
from llama.structured.vocabulary import GrammarTokenizer

__all__ = ["ToolChoice", "check_tool_choice", "tool_call_grammar", "tool_call_lark", "TOOL_CHOICE_MODES"]

# How the arguments' JSON is written: as json.dumps writes it, which is also how the
# tool prompts and llama-models write calls.
ARGUMENTS_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A built-in tool's query: a double-quoted string as the call parser reads it.
QUERY_STRING = r'/"([^"\\\x00-\x1f\x7f]|\\["\\nt])*"/'
# code_interpreter's code: any text with something besides whitespace in it.
CODE = r"/[\s\S]*[^\s][\s\S]*/"


# --- the grammar ----------------------------------------------------------------------


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def _json_rule(schema: Mapping[str, Any]) -> str:
    """An llguidance ``%json`` rule body: JSON valid against ``schema``, written in
    :data:`ARGUMENTS_STYLE` unless the schema's own ``x-guidance`` (an object) says otherwise."""
    options = schema.get("x-guidance")
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"has an x-guidance that is not an object of llguidance's JSON options (such as "
                         f"{{'whitespace_flexible': false}}) but a {type(options).__name__}")
    style = {**ARGUMENTS_STYLE, **(options or {})}
    try:
        return "%json " + json.dumps({**schema, "x-guidance": style}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"is not JSON: {e}") from None
    except RecursionError:
        raise ValueError("nests too deeply to be a schema") from None


def _arguments_schema(tool: Mapping[str, Any], where: str) -> dict:
    """A function's ``parameters`` as the schema of its arguments object (``type: object``
    where the schema says no type; an empty schema is any object)."""
    schema = dict(tool["function"].get("parameters") or {})
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise ValueError(f"{where}.function.parameters must be a schema of type 'object', not {kind!r}")
    return schema


# The top-level keywords of a function's schema that the pythonic format can express:
# keyword arguments named by its properties.
PYTHON_LIST_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "$defs", "definitions", "description", "title",
    "x-guidance",
})


def _python_arguments(rule: str, schema: Mapping[str, Any], where: str) -> list[str]:
    """Rules for ``f(a=1, b="x")``'s keyword arguments: the schema's properties in order,
    the required ones always, the others optional; each value JSON valid against its
    property's schema.  Returns the rules, the first being ``rule``'s."""
    unsupported = sorted(set(schema) - PYTHON_LIST_KEYWORDS)
    if unsupported:
        raise ValueError(f"{where}.function.parameters uses {', '.join(map(repr, unsupported))}, which the "
                         "python_list tool format cannot express; use tool_prompt_format 'json'")
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what "$ref"s point to
    rules, items = [], []
    for j, (name, prop) in enumerate(properties.items()):
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"{where}: the argument {name!r:.80} is no Python name, so the python_list tool "
                             "format cannot pass it; use tool_prompt_format 'json'")
        try:
            rules.append(f"{rule}_{j}: {_lark_string(name + '=')} {rule}_{j}_value")
            rules.append(f"{rule}_{j}_value: {_json_rule({**prop, **defs})}")
        except ValueError as e:
            raise ValueError(f"{where}.function.parameters.properties.{name} {e}") from None
        items.append((f"{rule}_{j}", name in required))
    # rule_from_j: the arguments from the j-th on; rule_after_j: the same, each after ", ".
    n = len(items)
    for j in range(n, -1, -1):
        if j == n:
            first, rest = '""', '""'
        else:
            item, is_required = items[j]
            first = f"{item} {rule}_after_{j + 1}"
            rest = f'", " {item} {rule}_after_{j + 1}'
            if not is_required:
                first += f" | {rule}_from_{j + 1}"
                rest += f" | {rule}_after_{j + 1}"
        rules.append(f"{rule}_from_{j}: {first}")
        rules.append(f"{rule}_after_{j}: {rest}")
    rules.insert(0, f"{rule}: {rule}_from_0")
    return rules


def tool_call_lark(tools: Sequence[object], choice: ToolChoice, tool_prompt_format: ToolPromptFormat = "json",
                   parallel_tool_calls: bool = True) -> Optional[str]:
    """The Lark grammar (llguidance's dialect) of a reply that ``choice`` constrains to
    calls of ``tools`` in ``tool_prompt_format`` (see the module doc); ``None`` when the
    choice constrains nothing ("auto", "none").  Raises ``ValueError`` naming the tool
    whose schema cannot be expressed."""
    if not choice.constrained:
        return None
    if tool_prompt_format not in TOOL_PROMPT_FORMATS:
        raise ValueError(f"tool_prompt_format must be one of {TOOL_PROMPT_FORMATS}, got {tool_prompt_format!r}")
    builtin, _ = check_tools(tools)
    callable_ = choice.callable(declared_tool_names(tools))
    rules: list[str] = []
    calls: list[str] = []
    for i, tool in enumerate(tools):
        if isinstance(tool, str):
            continue
        tool = cast(Mapping[str, Any], tool)  # check_tools: a name or a function definition
        if tool["function"]["name"] not in callable_:
            continue
        where, name, rule = f"tools[{i}]", tool["function"]["name"], f"call_{i}"
        schema = _arguments_schema(tool, where)
        check_schema_keywords(schema, f"{where}.function.parameters")
        check_schema_limits(schema, f"{where}.function.parameters")
        if tool_prompt_format == "python_list":
            rules.append(f'{rule}: {_lark_string(name + "(")} {rule}_arguments ")"')
            rules += _python_arguments(f"{rule}_arguments", schema, where)
        else:
            head = (f'{{"type": "function", "name": "{name}", "parameters": ' if tool_prompt_format == "json"
                    else f"<function={name}>")
            tail = "}" if tool_prompt_format == "json" else "</function>"
            try:
                rules.append(f"{rule}_arguments: {_json_rule(schema)}")
            except ValueError as e:
                raise ValueError(f"{where}.function.parameters {e}") from None
            rules.append(f"{rule}: {_lark_string(head)} {rule}_arguments {_lark_string(tail)}")
        calls.append(rule)
    alternatives = []
    if calls:
        rules.append(f"custom_call: {' | '.join(calls)}")
        several = f"custom_call ({_lark_string(SEPARATORS[tool_prompt_format])} custom_call)*"
        body = several if parallel_tool_calls else "custom_call"
        alternatives.append(f'"[" {body} "]"' if tool_prompt_format == "python_list" else body)
    for name in builtin:
        if name not in callable_:
            continue
        if name in QUERY_TOOLS:
            alternatives.append(f'<|python_tag|> {_lark_string(name + ".call(query=")} {QUERY_STRING} ")"')
        else:  # code_interpreter
            alternatives.append(f"<|python_tag|> {CODE}")
    if not alternatives:  # check_tool_choice refuses such a choice
        raise ValueError("tool_choice allows no tool: none of the tools can be called")
    return "\n".join([f"start: {' | '.join(alternatives)}", *rules]) + "\n"


def tool_call_grammar(tools: Sequence[object], tool_choice: object, tokenizer: GrammarTokenizer,
                      tool_prompt_format: ToolPromptFormat = "json",
                      parallel_tool_calls: bool = True) -> Optional[Grammar]:
    """The compiled grammar of a reply that ``tool_choice`` constrains to calls of ``tools``
    (:func:`tool_call_lark`), or ``None`` where it constrains nothing.  Raises
    ``ValueError`` for a bad ``tool_choice`` or a schema that cannot be compiled (naming
    the tool)."""
    choice = check_tool_choice(tool_choice, tools)
    lark = tool_call_lark(tools, choice, tool_prompt_format, parallel_tool_calls)
    if lark is None:
        return None
    try:
        return compile_grammar("tool_choice", llguidance.LLMatcher.grammar_from_lark(lark), tokenizer, "tools")
    except CompileRefused:
        raise  # too slow or a crash: compiling each tool alone to find it would cost as much again
    except ValueError as e:
        raise ValueError(_culprit(tools, tool_prompt_format, tokenizer) or str(e)) from None


def _culprit(tools: Sequence[object], tool_prompt_format: ToolPromptFormat,
             tokenizer: GrammarTokenizer) -> Optional[str]:
    """The error of the first tool whose grammar alone does not compile, naming it."""
    for i, tool in enumerate(tools):
        if isinstance(tool, str):
            continue
        alone = ToolChoice("function", cast(Mapping[str, Any], tool)["function"]["name"])  # a function definition
        try:
            lark = cast(str, tool_call_lark([tool], alone, tool_prompt_format, False))  # "function": constrained
            compile_grammar("tool_choice", llguidance.LLMatcher.grammar_from_lark(lark), tokenizer, "tools")
        except ValueError as e:
            return f"tools[{i}].function.parameters: {str(e).removeprefix('tools: ')}"
    return None
