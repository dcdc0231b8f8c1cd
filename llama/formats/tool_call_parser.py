"""Reading tool calls out of a Llama 3.1+ reply (the forms are listed in
:mod:`llama.formats.tool_calls`).

:func:`parse_tool_calls` returns every call of a reply (llama-models keeps only the
first of a list) and leaves whatever is not a call as content; it never raises on what
a model writes, takes time linear in its length, and returns only calls whose arguments
are JSON values exactly.
"""

from __future__ import annotations

import ast
import bisect
import json
import logging
import re
from typing import Any, Iterator, Optional, cast

from llama.formats.tool_calls import QUERY_TOOLS, ToolCall, is_valid_call, new_call_id

logger = logging.getLogger(__name__)

__all__ = ["parse_tool_calls"]

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


def _space_end(text: str, pos: int) -> int:
    """Where the JSON whitespace at ``pos`` of ``text`` ends (the pattern matches the empty string)."""
    return cast(re.Match, _JSON_SPACE.match(text, pos)).end()


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
    calls: list[ToolCall] = []
    spans: list[tuple[int, int]] = []
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
                args, end = _decode_at(swapped, _space_end(swapped, start), close)
            except (ValueError, RecursionError):
                continue
            if _space_end(swapped, end) != close:
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
        keys = [_literal(cast(ast.expr, k)) for k in node.keys]  # no None: refused above
        if not all(type(k) is str for k in keys):
            return _NOT_JSON  # {1: 2}: JSON's keys are str, and (1, 2) would be read as a list
        return dict(zip(keys, (_literal(v) for v in node.values)))
    return ast.literal_eval(node)


# What _literal reads a dict with a key other than a str as: a value with no JSON form,
# so that parse_tool_calls keeps the reply as text.
_NOT_JSON = object()


def _builtin_calls(text: str) -> tuple[list[ToolCall], list[tuple[int, int]]]:
    calls: list[ToolCall] = []
    spans: list[tuple[int, int]] = []
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
    ``code_interpreter``'s code included); a tuple in a pythonic call is read as a list.  If
    any call of a reply is not so, the whole reply is returned as text, ``(text, [])``,
    whatever ``python_tag`` says: no partial list of calls.

    Never raises for a str, whatever it holds (huge numbers, deep nesting, lone
    surrogates, NUL), and takes time about linear in ``len(text)``: the server calls it
    on its event loop.  Should a parser still fail, the reply is kept as text and a
    warning logged.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    try:
        content, calls = _parse(text, python_tag)
        if calls and not all(is_valid_call(c) for c in calls):
            return text, []
        return content, calls
    except Exception:  # a parser's bug must not fail the reply
        logger.warning("reading tool calls from a reply of %d characters failed; keeping it as text", len(text),
                       exc_info=True)
        return text, []


def _parse(text: str, python_tag: bool) -> tuple[str, list[ToolCall]]:
    calls, spans = _function_tags(text)
    if calls:
        return _cut(text, spans), calls
    for parse in (_json_calls, _python_list_calls):
        whole = parse(text)
        if whole:
            return "", whole
    calls, spans = _builtin_calls(text)
    if calls:
        return _cut(text, spans), calls
    if python_tag and text.strip():
        return "", [_call("code_interpreter", {"code": text})]
    return text, []
