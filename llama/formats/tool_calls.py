"""Tool calls in Llama 3.1+ replies: the ``ToolCall`` type, its text form, and the parser.

A reply that calls tools comes in one of the forms Meta's llama-models documents
(``prompt_format.md`` of Llama 3.1, 3.2 and 3.3):

- a built-in tool: ``<|python_tag|>brave_search.call(query="...")`` (also
  ``wolfram_alpha``, ``photogen``), ending in ``<|eom_id|>``;
- code to run: ``<|python_tag|>`` then Python source, the ``code_interpreter`` tool;
- a custom function as JSON: ``{"type": "function", "name": "f", "parameters": {...}}``;
- a custom function in a tag: ``<function=f>{"a": 1}</function>``;
- a pythonic list (3.2/3.3): ``[f(a=1), g(b="x")]``.

This module holds what a call is (:class:`ToolCall`, :func:`check_tool_calls`,
:func:`is_json_arguments`) and writes one: :func:`format_tool_call` writes a call back as
llama-models' ``ToolUtils.encode_tool_call`` does, so a multi-step tool dialog can be fed
back.  Reading calls out of a reply is :mod:`llama.formats.tool_call_parser`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import uuid
from typing import Any, Literal, Sequence, TypedDict

logger = logging.getLogger(__name__)

__all__ = [
    "ToolCall",
    "StopReason",
    "ToolPromptFormat",
    "BUILTIN_TOOLS",
    "STOP_REASONS",
    "TOOL_PROMPT_FORMATS",
    "format_tool_call",
    "format_tool_calls",
    "check_tool_calls",
    "is_json_arguments",
    "to_openai_tool_calls",
    "MAX_ARGUMENT_DEPTH",
]

StopReason = Literal["end_of_turn", "end_of_message", "out_of_tokens"]
STOP_REASONS = ("end_of_turn", "end_of_message", "out_of_tokens")

ToolPromptFormat = Literal["json", "function_tag", "python_list"]
TOOL_PROMPT_FORMATS: tuple[ToolPromptFormat, ...] = ("json", "function_tag", "python_list")

# llama-models' BuiltinTool names.  code_interpreter's argument is {"code": ...}; the
# others take {"query": ...}.
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "photogen", "code_interpreter")
QUERY_TOOLS = ("brave_search", "wolfram_alpha", "photogen")


class ToolCall(TypedDict):
    """One call of a tool by the model, as llama-models' ``ToolCall`` has it.

    ``tool_name`` is a built-in tool (:data:`BUILTIN_TOOLS`) or a custom function's name;
    ``arguments`` maps argument names to JSON values (those :func:`~llama.formats.tool_call_parser.parse_tool_calls`
    returns always are: see :func:`is_json_arguments`); ``call_id`` is a fresh id the
    tool's answer can refer to.
    """

    call_id: str
    tool_name: str
    arguments: dict[str, Any]


def new_call_id() -> str:
    """A fresh tool-call id, of one format wherever a call is made (the Python API, the
    server, streamed or not): ``call_`` and 24 hexadecimal digits, as OpenAI's look."""
    return f"call_{uuid.uuid4().hex[:24]}"


# --- writing calls ----------------------------------------------------------------------


def _string_literal(s: str) -> str:
    """``"s"``, as llama-models writes a string; escaped (JSON style, which Python also
    reads) only when the plain form would not read back: a ``"``, ``\\`` or control
    character inside."""
    plain = f'"{s}"'
    if '"' in s or "\\" in s or any(ord(c) < 0x20 or c in "\x7f\u2028\u2029" for c in s):
        return json.dumps(s, ensure_ascii=False)
    return plain


def _python_value(value: Any) -> str:
    """A value as llama-models' python_list format writes it (``str()`` of numbers,
    booleans and None, ``"..."`` strings, ``[...]`` lists).  Dicts are written as Python
    dict literals: llama-models writes ``{k=v}``, which no parser reads back.  A NaN or
    infinite float is written ``float("nan")``/``float("inf")``, which Python reads but
    :func:`~llama.formats.tool_call_parser.parse_tool_calls` does not take as a call (it is no JSON value)."""
    if isinstance(value, str):
        return _string_literal(value)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(value) if math.isfinite(value) else f'float("{value}")'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_python_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_string_literal(str(k))}: {_python_value(v)}" for k, v in value.items()) + "}"
    raise TypeError("a tool call argument must be JSON-like (str, number, bool, None, list, dict), "
                    f"got {type(value).__name__}")


def format_tool_call(call: ToolCall, tool_prompt_format: ToolPromptFormat = "json") -> str:
    """The text of one call as the model writes it (without ``<|python_tag|>``).

    Built-in tools: ``brave_search.call(query="...")``; ``code_interpreter``: its code;
    custom functions in ``tool_prompt_format``: ``json`` (``{"type": "function",
    "name": ..., "parameters": ...}``), ``function_tag`` (``<function=f>{...}</function>``)
    or ``python_list`` (``[f(a=1)]``).  Identical to llama-models' ``encode_tool_call``
    except where its text would not parse back (a ``"`` inside a query or string
    argument is escaped, a dict argument in python_list is a Python dict literal).

    Arguments that are JSON values (:func:`is_json_arguments`) read back as the same call
    with :func:`~llama.formats.tool_call_parser.parse_tool_calls`.  Others are written as before (NaN and infinities as
    ``NaN``/``Infinity`` in JSON, ``float("nan")`` in python_list), but a reply holding
    them is no call to the parser: it keeps such a reply as text.
    """
    name, args = call["tool_name"], call["arguments"]
    if name in QUERY_TOOLS:
        return f"{name}.call(query={_string_literal(str(args['query']))})"
    if name == "code_interpreter":
        return args["code"]
    if tool_prompt_format == "json":
        return json.dumps({"type": "function", "name": name, "parameters": args})
    if tool_prompt_format == "function_tag":
        return f"<function={name}>{json.dumps(args)}</function>"
    if tool_prompt_format == "python_list":
        return f"[{_python_call(call)}]"
    raise ValueError(f"tool_prompt_format must be one of {TOOL_PROMPT_FORMATS}, got {tool_prompt_format!r}")


def _python_call(call: ToolCall) -> str:
    args = ", ".join(f"{k}={_python_value(v)}" for k, v in call["arguments"].items())
    return f"{call['tool_name']}({args})"


def format_tool_calls(calls: Sequence[ToolCall], tool_prompt_format: ToolPromptFormat = "json") -> list[str]:
    """The texts of an assistant message's calls, each encoded separately after the content,
    as llama-models does.  Several custom calls in the python_list format make one list
    ``[f(a=1), g(b=2)]`` (the form the model writes; llama-models would write ``[f(a=1)][g(b=2)]``)."""
    customs = [c for c in calls if c["tool_name"] not in BUILTIN_TOOLS]
    if tool_prompt_format == "python_list" and len(customs) > 1:
        texts = [format_tool_call(c, tool_prompt_format) for c in calls if c["tool_name"] in BUILTIN_TOOLS]
        return texts + ["[" + ", ".join(_python_call(c) for c in customs) + "]"]
    return [format_tool_call(c, tool_prompt_format) for c in calls]


def check_tool_calls(calls: object, where: str = "tool_calls") -> list[ToolCall]:
    """Validate an assistant message's ``tool_calls``; returns them as :class:`ToolCall`
    dicts, each with a ``call_id`` (a fresh one where it had none).

    Each call is ``{"tool_name", "arguments", "call_id"?}`` or OpenAI's shape,
    ``{"id", "type": "function", "function": {"name", "arguments": "<JSON object>"}}``.
    Raises ``TypeError``/``ValueError`` naming what is wrong.
    """
    if not isinstance(calls, (list, tuple)):
        raise TypeError(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    checked: list[ToolCall] = []
    for i, call in enumerate(calls):
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = _from_openai(call, f"{where}[{i}]")
        if not isinstance(call, dict) or "tool_name" not in call or "arguments" not in call:
            raise TypeError(f"{where}[{i}] must be a dict with 'tool_name' and 'arguments', got {call!r:.80}")
        name, args = call["tool_name"], call["arguments"]
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}[{i}]['tool_name'] must be a non-empty str, got {name!r:.80}")
        if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            raise TypeError(f"{where}[{i}]['arguments'] must be a dict with str keys, got {args!r:.80}")
        needed = "code" if name == "code_interpreter" else "query" if name in QUERY_TOOLS else None
        if needed is not None and needed not in args:
            raise ValueError(f"{where}[{i}] calls the built-in tool {name!r}, whose arguments need {needed!r}")
        if needed == "code" and not isinstance(args["code"], str):
            raise TypeError(f"{where}[{i}]: code_interpreter's 'code' must be a str")
        call_id = call.get("call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise TypeError(f"{where}[{i}]['call_id'] must be a str, got {type(call_id).__name__}")
        checked.append({"call_id": call_id or new_call_id(), "tool_name": name, "arguments": dict(args)})
    return checked


def _from_openai(call: dict, where: str) -> dict:
    fn = call["function"]
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: function arguments must be a JSON object: {e}") from None
    return {"call_id": call.get("id"), "tool_name": fn.get("name"), "arguments": args}


def to_openai_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Calls in OpenAI's chat-completion shape: ``{"id", "type": "function", "function":
    {"name", "arguments": "<JSON>"}}`` (built-in tools too, by their names)."""
    return [
        {"id": c["call_id"], "type": "function",
         "function": {"name": c["tool_name"], "arguments": json.dumps(c["arguments"])}}
        for c in calls
    ]


# The deepest nesting of lists and dicts (the arguments dict counts as one) a returned
# call may have: json.dumps and format_tool_call recurse, and a few hundred levels (what
# the parsers here reach before their own limits) would exhaust the stack of a caller.
MAX_ARGUMENT_DEPTH = 100
# Python's default limit on int <-> str conversion (sys.get_int_max_str_digits), which
# json.dumps is subject to; the lower of the two bounds an int argument's digits.
_MAX_INT_DIGITS = 4300


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_text(s: str) -> bool:
    """Whether ``s`` holds no surrogate code point.  One is no text: it has no UTF-8 form,
    the tokenizers refuse it, and JSON reads an escaped pair of them back as one character."""
    return s.isascii() or _SURROGATE.search(s) is None


def is_json_arguments(arguments: object) -> bool:
    """Whether ``arguments`` is a dict with str keys whose values are JSON values exactly:
    str, int, finite float, bool, None, and lists and str-keyed dicts of those, nested at
    most :data:`MAX_ARGUMENT_DEPTH` deep, so that ``json.loads(json.dumps(arguments,
    allow_nan=False)) == arguments``.  Tuples, sets, bytes, complex numbers, NaN and
    infinities are not; nor are dicts with keys other than str (``{1: 2}`` would come
    back from JSON as ``{"1": 2}``), ints too long for ``json.dumps`` to write, or strs
    (keys included) with a surrogate code point in them (``"\\ud800"`` in JSON), which
    are no text (see :func:`_is_text`).

    Iterative (a deep value cannot exhaust the stack) and linear in the value's size."""
    if type(arguments) is not dict:
        return False
    limit = sys.get_int_max_str_digits()
    max_digits = min(limit, _MAX_INT_DIGITS) if limit else _MAX_INT_DIGITS
    stack: list[tuple[Any, int]] = [(arguments, 1)]
    while stack:
        value, depth = stack.pop()
        kind = type(value)
        if kind is dict or kind is list:
            if depth > MAX_ARGUMENT_DEPTH:
                return False
            if kind is dict:
                if not all(type(k) is str and _is_text(k) for k in value):
                    return False
                stack.extend((v, depth + 1) for v in value.values())
            else:
                stack.extend((v, depth + 1) for v in value)
        elif kind is int:
            # |value| < 2**bits, so it has at most bits * log10(2) + 1 digits (0.30103
            # rounds log10(2) up): a cheap bound that never calls str() on a huge int.
            if value.bit_length() * 30103 // 100000 + 1 > max_digits:
                return False
        elif kind is float:
            if not math.isfinite(value):
                return False
        elif kind is str:
            if not _is_text(value):
                return False
        elif not (kind is bool or value is None):
            return False
    return True


def is_valid_call(call: ToolCall) -> bool:
    """Whether ``call`` has a non-empty text name and JSON arguments (:func:`is_json_arguments`)."""
    name = call["tool_name"]
    return type(name) is str and bool(name) and _is_text(name) and is_json_arguments(call["arguments"])
