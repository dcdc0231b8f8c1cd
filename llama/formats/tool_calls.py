"""Tool calls in Llama 3.1+ replies: the ``ToolCall`` type, its text form, and the parser.

A reply that calls tools comes in one of the forms Meta's llama-models documents
(``prompt_format.md`` of Llama 3.1, 3.2 and 3.3):

- a built-in tool: ``<|python_tag|>brave_search.call(query="...")`` (also
  ``wolfram_alpha``, ``photogen``), ending in ``<|eom_id|>``;
- code to run: ``<|python_tag|>`` then Python source, the ``code_interpreter`` tool;
- a custom function as JSON: ``{"type": "function", "name": "f", "parameters": {...}}``;
- a custom function in a tag: ``<function=f>{"a": 1}</function>``;
- a pythonic list (3.2/3.3): ``[f(a=1), g(b="x")]``.

:func:`parse_tool_calls` returns every call of a reply (llama-models keeps only the
first of a list) and leaves whatever is not a call as content; it never raises on what
a model writes, takes time linear in its length, and returns only calls whose arguments
are JSON values exactly.  :func:`format_tool_call` writes a call back as llama-models'
``ToolUtils.encode_tool_call`` does, so a multi-step tool dialog can be fed back.
"""

from __future__ import annotations

import ast
import bisect
import json
import logging
import math
import re
import sys
import uuid
from typing import Any, Iterator, Literal, Optional, Sequence, TypedDict

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
    "parse_tool_calls",
    "check_tool_calls",
    "is_json_arguments",
    "to_openai_tool_calls",
    "MAX_ARGUMENT_DEPTH",
]

StopReason = Literal["end_of_turn", "end_of_message", "out_of_tokens"]
STOP_REASONS = ("end_of_turn", "end_of_message", "out_of_tokens")

ToolPromptFormat = Literal["json", "function_tag", "python_list"]
TOOL_PROMPT_FORMATS = ("json", "function_tag", "python_list")

# llama-models' BuiltinTool names.  code_interpreter's argument is {"code": ...}; the
# others take {"query": ...}.
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "photogen", "code_interpreter")
QUERY_TOOLS = ("brave_search", "wolfram_alpha", "photogen")


class ToolCall(TypedDict):
    """One call of a tool by the model, as llama-models' ``ToolCall`` has it.

    ``tool_name`` is a built-in tool (:data:`BUILTIN_TOOLS`) or a custom function's name;
    ``arguments`` maps argument names to JSON values (those :func:`parse_tool_calls`
    returns always are: see :func:`is_json_arguments`); ``call_id`` is a fresh id the
    tool's answer can refer to.
    """

    call_id: str
    tool_name: str
    arguments: dict[str, Any]


def new_call_id() -> str:
    return str(uuid.uuid4())


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
    :func:`parse_tool_calls` does not take as a call (it is no JSON value)."""
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
    raise TypeError(f"a tool call argument must be JSON-like (str, number, bool, None, list, dict), got {type(value).__name__}")


def format_tool_call(call: ToolCall, tool_prompt_format: ToolPromptFormat = "json") -> str:
    """The text of one call as the model writes it (without ``<|python_tag|>``).

    Built-in tools: ``brave_search.call(query="...")``; ``code_interpreter``: its code;
    custom functions in ``tool_prompt_format``: ``json`` (``{"type": "function",
    "name": ..., "parameters": ...}``), ``function_tag`` (``<function=f>{...}</function>``)
    or ``python_list`` (``[f(a=1)]``).  Identical to llama-models' ``encode_tool_call``
    except where its text would not parse back (a ``"`` inside a query or string
    argument is escaped, a dict argument in python_list is a Python dict literal).

    Arguments that are JSON values (:func:`is_json_arguments`) read back as the same call
    with :func:`parse_tool_calls`.  Others are written as before (NaN and infinities as
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
        {"id": c["call_id"], "type": "function", "function": {"name": c["tool_name"], "arguments": json.dumps(c["arguments"])}}
        for c in calls
    ]


# --- reading calls ----------------------------------------------------------------------

# <function=name>{json}</function>; the closing tag is optional, as in llama-models.  The
# name stops at a "<" too, so that each try at a match reads no further than the next tag.
FUNCTION_TAG = re.compile(r"<function=(?P<name>[^<>{}]+)>")
CLOSE_TAG = "</function>"
# name.call(query="..."), with a JSON/Python-escaped double- or single-quoted string.
BUILTIN_CALL = re.compile(
    r"\b(?P<name>\w+)\.call\(\s*query\s*=\s*(?P<query>\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*')\s*\)"
)
_JSON = json.JSONDecoder()
_JSON_SPACE = re.compile(r"[ \t\n\r]*")  # what json.loads skips around a value

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


def _is_valid_call(call: ToolCall) -> bool:
    name = call["tool_name"]
    return type(name) is str and bool(name) and _is_text(name) and is_json_arguments(call["arguments"])


def _call(name: Any, arguments: Any) -> ToolCall:
    """A call as read; :func:`parse_tool_calls` checks its name and arguments."""
    # A built-in tool called in a custom tool's format (which models do when custom
    # and built-in tools are mixed) takes its first argument as the query, as in llama-models.
    if name in QUERY_TOOLS and isinstance(arguments, dict) and "query" not in arguments and arguments:
        arguments = {"query": next(iter(arguments.values()))}
    return {"call_id": new_call_id(), "tool_name": name, "arguments": arguments}


# _decode_at reads a JSON value from a window of the text this long at first ...
_WINDOW = 1024
# ... and from a window twice as long whenever the value or the error is this close to the
# window's end (a number or a literal such as -Infinity may go on past it).
_WINDOW_MARGIN = 16


def _decode_at(text: str, start: int, stop: int) -> tuple[Any, int]:
    """``_JSON.raw_decode(text[:stop], start)`` (the value and where it ends in ``text``),
    in time linear in the length of what the scan reads, not in ``stop``: a failed
    ``raw_decode`` of the whole text would cost the length of the text before the error,
    which ``JSONDecodeError`` counts lines in.  Raises what ``raw_decode`` raises."""
    window = _WINDOW
    while True:
        if start + window >= stop:
            value, end = _JSON.raw_decode(text[start:stop])
            return value, start + end
        chunk = text[start : start + window]
        try:
            value, end = _JSON.raw_decode(chunk)
        except json.JSONDecodeError as e:
            # An unterminated string says where it starts, not where the window cut it.
            if e.pos < window - _WINDOW_MARGIN and not e.msg.startswith("Unterminated string"):
                raise
        else:
            if end < window - _WINDOW_MARGIN:
                return value, start + end
        window *= 2


def _function_tags(text: str) -> tuple[list[ToolCall], list[tuple[int, int]]]:
    """Every ``<function=name>{...}</function>`` whose arguments read as a JSON object
    (or, as llama-models reads them, as one once ``'`` is read as ``"``).

    Linear in ``len(text)``: the name pattern stops at the next ``<``; the closing tags
    are found once; each JSON value is read from a window no longer than about twice
    what its scan reads (:func:`_decode_at`); and the scans from the tags cannot add up
    to more than about twice the text.  (A scan goes past a tag only inside a string, and
    a scan that starts at that tag is then outside one: from there on the two are in and
    out of strings in turn, so they cannot both get past the tag after it.)"""
    calls, spans = [], []
    closes: Optional[list[int]] = None  # where each </function> starts, found on first need
    swapped = ""  # text with ' read as ", made on first need
    for m in FUNCTION_TAG.finditer(text):
        if spans and m.start() < spans[-1][1]:
            continue
        start = m.end()
        try:
            args, end = _decode_at(text, start, len(text))
        except (ValueError, RecursionError):  # a JSON error, an int over the digit limit, deep nesting
            # llama-models also reads {'a': 'b'}: single quotes for double.  The arguments
            # are then all of the text up to the next </function> (or the end), as one value.
            if closes is None:
                closes = [c.start() for c in re.finditer(re.escape(CLOSE_TAG), text)]
                swapped = text.replace("'", '"')
            k = bisect.bisect_left(closes, start)
            close = closes[k] if k < len(closes) else len(text)
            try:
                args, end = _decode_at(swapped, _JSON_SPACE.match(swapped, start).end(), close)
            except (ValueError, RecursionError):
                continue
            if _JSON_SPACE.match(swapped, end).end() != close:
                continue
            end = close
        if not isinstance(args, dict):
            continue
        if text.startswith(CLOSE_TAG, end):
            end += len(CLOSE_TAG)
        calls.append(_call(m.group("name").strip(), args))
        spans.append((m.start(), end))
    return calls, spans


def _json_objects(text: str) -> Iterator[Any]:
    """The JSON values making up all of ``text``, separated by whitespace or ``;``;
    raises ValueError if anything else is there."""
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == n:
            return
        value, pos = _JSON.raw_decode(text, pos)
        yield value


def _json_calls(text: str) -> Optional[list[ToolCall]]:
    """``{"type": "function", "name": ..., "parameters": ...}`` (or a list of them, or
    several in a row): every call, or None if the text is anything else."""
    if not text.lstrip().startswith(("{", "[")):
        return None
    try:
        values = list(_json_objects(text))
    except (ValueError, RecursionError):
        return None
    objects = [o for v in values for o in (v if isinstance(v, list) else [v])]
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not (obj.get("type") == "function" or "name" in obj):
            return None
        if "parameters" not in obj and "arguments" not in obj:
            return None  # e.g. {"name": "Bob"}: data, not a call
        # A call from here on: one whose name or arguments are bad keeps the reply text.
        args = obj.get("parameters", obj.get("arguments"))
        if isinstance(args, str):  # OpenAI style: arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass  # left a str: no arguments dict
        calls.append(_call(obj.get("name"), args))
    return calls or None


def _python_list_calls(text: str) -> Optional[list[ToolCall]]:
    """``[f(a=1), g(b="x")]``: every call, or None unless the text is exactly such a list
    of calls with keyword arguments whose values are literals."""
    if not text.lstrip().startswith("["):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = _literal(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append(_call(node.func.id, args))
    return calls


def _literal(node: ast.AST) -> Any:
    """``ast.literal_eval``, plus ``float("...")`` and JSON's ``true``/``false``/``null``
    (which models write in Python lists too); tuples are read as lists.  Values that are
    no JSON (sets, bytes, NaN, ...) are returned as Python has them, for
    :func:`parse_tool_calls` to refuse."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "float"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return float(node.args[0].value)
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        keys = [_literal(k) for k in node.keys]
        if not all(type(k) is str for k in keys):
            return _NOT_JSON  # {1: 2}: JSON's keys are str, and (1, 2) would be read as a list
        return dict(zip(keys, (_literal(v) for v in node.values)))
    return ast.literal_eval(node)


# What _literal reads a dict with a key other than a str as: a value with no JSON form,
# so that parse_tool_calls keeps the reply as text.
_NOT_JSON = object()


def _builtin_calls(text: str) -> tuple[list[ToolCall], list[tuple[int, int]]]:
    calls, spans = [], []
    for m in BUILTIN_CALL.finditer(text):
        try:
            query = ast.literal_eval(m.group("query"))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        calls.append(_call(m.group("name"), {"query": query}))
        spans.append(m.span())
    return calls, spans


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    kept, pos = [], 0
    for start, end in spans:
        kept.append(text[pos:start])
        pos = end
    kept.append(text[pos:])
    return "".join(kept).strip()


def parse_tool_calls(text: str, *, python_tag: bool = False) -> tuple[str, list[ToolCall]]:
    """Split a reply's text into (content, tool calls).

    ``text`` is the reply decoded without its ``<|python_tag|>`` and end token;
    ``python_tag`` says whether it began with ``<|python_tag|>``.  The forms are tried in
    llama-models' order: custom calls (``<function=...>`` tags anywhere in the text, or
    the whole text as JSON or as a pythonic list), then built-in ``tool.call(query=...)``
    calls anywhere, then, after ``<|python_tag|>``, the whole text as code for
    ``code_interpreter``.  All calls found are returned, in order; the text around them
    (stripped) is the content, ``""`` when the reply is only calls.  Text that is no call
    is returned unchanged with no calls.

    Every call returned has a non-empty str name and arguments that are JSON values
    exactly (:func:`is_json_arguments`: no NaN or infinities, sets, tuples, bytes,
    complex numbers, non-str dict keys such as ``{1: 2}``, ints too long to write,
    nesting deeper than :data:`MAX_ARGUMENT_DEPTH`, or surrogate code points in a str,
    ``code_interpreter``'s code included); a tuple in a pythonic call is read as a list.  If any call of a reply is not so, the whole reply is returned as text,
    ``(text, [])``, whatever ``python_tag`` says: no partial list of calls.

    Never raises for a str, whatever it holds (huge numbers, deep nesting, lone
    surrogates, NUL), and takes time about linear in ``len(text)``: the server calls it
    on its event loop.  Should a parser still fail, the reply is kept as text and a
    warning logged.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    try:
        content, calls = _parse(text, python_tag)
        if calls and not all(_is_valid_call(c) for c in calls):
            return text, []
        return content, calls
    except Exception:  # a parser's bug must not fail the reply
        logger.warning("reading tool calls from a reply of %d characters failed; keeping it as text", len(text), exc_info=True)
        return text, []


def _parse(text: str, python_tag: bool) -> tuple[str, list[ToolCall]]:
    calls, spans = _function_tags(text)
    if calls:
        return _cut(text, spans), calls
    for parse in (_json_calls, _python_list_calls):
        calls = parse(text)
        if calls:
            return "", calls
    calls, spans = _builtin_calls(text)
    if calls:
        return _cut(text, spans), calls
    if python_tag and text.strip():
        return "", [_call("code_interpreter", {"code": text})]
    return text, []
