"""OpenAI's streamed tool-call deltas, read from a reply that is calls as it is written.

A reply constrained to tool calls (``tool_choice`` "required" or a named function, see
:mod:`llama.structured.tool_choice`) has a known shape, so its calls can be told as the
model writes them, the way OpenAI streams them::

    {"index": 0, "id": "call_...", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    {"index": 0, "function": {"arguments": "{\\"city\\": \\"Paris\\""}}
    {"index": 0, "function": {"arguments": ", \\"days\\": 3"}}
    {"index": 0, "function": {"arguments": "}"}}

A call is announced (id and name) as soon as its name is written; its arguments follow
one top-level argument at a time, each once its value is complete, written as
``json.dumps`` writes the whole arguments object, so that the fragments of a call
concatenate to exactly the ``arguments`` string of the reply read whole
(:func:`~llama.formats.tool_calls.to_openai_tool_calls`).  :meth:`ToolCallDeltas.finish`
gives whatever the whole reply's calls hold beyond what was streamed (``code_interpreter``'s
code comes whole at the end).

The reader is incremental: each character of the reply is looked at a bounded number of
times, whatever its length.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from typing import Any, Collection, Optional, Sequence, cast

from llama.formats.tool_calls import ToolCall, ToolPromptFormat, new_call_id

logger = logging.getLogger(__name__)

__all__ = ["AutoReplyContent", "ToolCallDeltas"]

PYTHON_TAG = "<|python_tag|>"
# The start of each call, by format: what comes before its name, and what after it.
HEADS: dict[str, tuple[str, str]] = {
    "json": ('{"type": "function", "name": "', '", "parameters": '),
    "function_tag": ("<function=", ">"),
    "python_list": ("", "("),
}
TAILS = {"json": "}", "function_tag": "</function>", "python_list": ")"}
SEPARATORS = {"json": "; ", "function_tag": "\n", "python_list": ", "}
NAME = re.compile(r"[A-Za-z0-9_-]*")
BUILTIN_HEAD = re.compile(r"(\w+)\.call\(query=")
CLOSERS = {"{": "}", "[": "]"}


class _ValueEnd:
    """Where a JSON value that starts at a given place ends, found incrementally: feed it
    the text as it grows; :attr:`end` is set once the value is complete."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.stack: list[str] = []
        self.in_string = False
        self.escaped = False
        self.end: Optional[int] = None

    def scan(self, text: str) -> bool:
        """Read on; True once the value is complete (it ends at :attr:`end`)."""
        while self.end is None and self.pos < len(text):
            c = text[self.pos]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if not self.stack:
                        self.end = self.pos + 1
            elif c == '"':
                self.in_string = True
            elif c in CLOSERS:
                self.stack.append(CLOSERS[c])
            elif self.stack and c == self.stack[-1]:
                self.stack.pop()
                if not self.stack:
                    self.end = self.pos + 1
            elif not self.stack and c in ",)}]":  # a number or literal ends before this
                self.end = self.pos
                return True
            self.pos += 1
        return self.end is not None


class _Call:
    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self.id = new_call_id()
        self.arguments = ""  # the fragments sent so far, joined


class ToolCallDeltas:
    """Reads a reply constrained to tool calls in ``tool_prompt_format`` as it grows and
    returns the OpenAI delta entries (``choices[i].delta.tool_calls``) of what is new.

    Feed :meth:`feed` the reply's text so far (a ``<|python_tag|>`` token as that text),
    then give :meth:`finish` the calls read from the whole reply."""

    def __init__(self, tool_prompt_format: ToolPromptFormat) -> None:
        if tool_prompt_format not in HEADS:
            raise ValueError(f"tool_prompt_format must be one of {tuple(HEADS)}, got {tool_prompt_format!r}")
        self.format = tool_prompt_format
        self.calls: list[_Call] = []
        self._pos = 0  # the first character not yet read
        self._state = "start"
        self._value: Optional[_ValueEnd] = None
        self._key: Any = None
        self._members = 0
        self._done = False  # the reply went somewhere this reader does not follow: leave the rest to finish()

    # -- reading -------------------------------------------------------------------------

    def feed(self, text: str) -> list[dict]:
        """The delta entries for what ``text`` (the whole reply so far) adds."""
        out: list[dict] = []
        while not self._done and self._step(text, out):
            pass
        return out

    def _step(self, text: str, out: list[dict]) -> bool:
        """Read one more piece of the reply if it is all there; False to wait for more."""
        rest = text[self._pos:]
        state = self._state
        if state == "start":
            if PYTHON_TAG.startswith(rest[: len(PYTHON_TAG)]) and len(rest) < len(PYTHON_TAG):
                return False
            if rest.startswith(PYTHON_TAG):
                self._pos += len(PYTHON_TAG)
                self._state = "builtin"
                return True
            if self.format == "python_list":
                if not rest:
                    return False
                if rest[0] != "[":
                    return self._give_up()
                self._pos += 1
            self._state = "head"
            return True
        if state == "head":
            before, after = HEADS[self.format]
            if len(rest) < len(before):
                return self._wait(before.startswith(rest))
            if not rest.startswith(before):
                return self._give_up()
            name = cast(re.Match, NAME.match(rest, len(before))).group()  # NAME matches the empty string
            end = len(before) + len(name)
            if len(rest) < end + len(after):
                return self._wait(after.startswith(rest[end:]))
            if not rest.startswith(after, end) or not name:
                return self._give_up()
            call = _Call(len(self.calls), name)
            self.calls.append(call)
            out.append({"index": call.index, "id": call.id, "type": "function",
                        "function": {"name": name, "arguments": ""}})
            self._pos += end + len(after)
            self._state, self._members = "arguments", 0
            return True
        if state == "arguments":
            return self._arguments(text, rest, out)
        if state == "tail":
            return self._expect(rest, TAILS[self.format] if self.format != "python_list" else "", "between")
        if state == "between":
            if self.format == "python_list" and rest.startswith("]"):
                self._done = True
                return False
            return self._expect(rest, SEPARATORS[self.format], "head")
        if state == "builtin":
            m = BUILTIN_HEAD.match(rest)
            if m is None:
                # Code for code_interpreter (or a query call still being named): its call comes whole.
                return self._wait(re.fullmatch(r"\w*(\.(c(a(l(l(\((q(u(e(r(y=?)?)?)?)?)?)?)?)?)?)?)?",
                                               rest) is not None)
            call = _Call(len(self.calls), m.group(1))
            self.calls.append(call)
            out.append({"index": call.index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}})
            self._pos += m.end()
            self._value = _ValueEnd(self._pos)
            self._state = "query"
            return True
        if state == "query":
            assert self._value is not None
            if not self._value.scan(text):
                return False
            literal = text[self._value.start:self._value.end]
            try:
                query = ast.literal_eval(literal)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return self._give_up()
            self._send(out, json.dumps({"query": query}))
            self._done = True
            return False
        return self._give_up()

    def _arguments(self, text: str, rest: str, out: list[dict]) -> bool:
        """One argument of the current call: ``"key": value`` (JSON formats) or ``key=value``."""
        pythonic = self.format == "python_list"
        if self._value is None:
            if not pythonic and self._members == 0:
                if not rest:
                    return False
                if rest[0] != "{":
                    return self._give_up()
                self._pos += 1
                self._members = -1  # the brace is read, no argument yet
                return True
            close = ")" if pythonic else "}"
            if not rest:
                return False
            if rest[0] == close:
                self._send(out, "{}" if self._members <= 0 else "}")
                self._pos += 1
                self._state = "between" if pythonic else "tail"
                return True
            if self._members > 0:
                if len(rest) < 2:
                    return self._wait(rest == ",")
                if not rest.startswith(", "):
                    return self._give_up()
                rest = rest[2:]
                skip = 2
            else:
                skip = 0
            if pythonic:
                m = re.match(r"([A-Za-z_]\w*)=", rest)
                if m is None:
                    return self._wait(re.fullmatch(r"[A-Za-z_]\w*", rest) is not None or rest == "")
                self._key, length = m.group(1), m.end()
            else:
                key = _ValueEnd(0)
                if not rest.startswith('"'):
                    return self._wait(rest == "")
                if not key.scan(rest):
                    return False
                end = cast(int, key.end)  # scan() is true: the key's end is found
                if not rest.startswith(": ", end):
                    return self._wait(len(rest) < end + 2 and ": ".startswith(rest[end:]))
                try:
                    self._key = json.loads(rest[:end])
                except ValueError:
                    return self._give_up()
                length = end + 2
            self._pos += skip + length
            self._value = _ValueEnd(self._pos)
            return True
        if not self._value.scan(text):
            return False
        try:
            value = json.loads(text[self._value.start:self._value.end])
        except (ValueError, RecursionError):
            return self._give_up()
        first = self._members <= 0
        self._send(out, ("{" if first else ", ") + json.dumps(self._key) + ": " + json.dumps(value))
        self._members = max(self._members, 0) + 1
        self._pos = cast(int, self._value.end)  # scan() was true
        self._value = None
        return True

    def _send(self, out: list[dict], fragment: str) -> None:
        call = self.calls[-1]
        call.arguments += fragment
        out.append({"index": call.index, "function": {"arguments": fragment}})

    def _expect(self, rest: str, literal: str, then: str) -> bool:
        """Read ``literal`` and go on in state ``then``; wait while ``rest`` may still grow
        into it, give up when it cannot."""
        if len(rest) < len(literal):
            return self._wait(literal.startswith(rest))
        if not rest.startswith(literal):
            return self._give_up()
        self._pos += len(literal)
        self._state = then
        return True

    def _wait(self, more_may_come: bool) -> bool:
        """Wait for more text where what is there may still grow into the expected shape;
        give up otherwise.  False either way: nothing more to read now."""
        return False if more_may_come else self._give_up()

    def _give_up(self) -> bool:
        """The reply is not in the shape this reader follows (it cannot be, under a tool-call
        grammar): stream nothing more of it; :meth:`finish` sends what the whole reply holds."""
        logger.debug("tool-call stream: an unexpected reply at %d; the rest comes at its end", self._pos)
        self._done = True
        return False

    def written(self) -> list[dict]:
        """The calls announced so far in OpenAI's response shape (``message.tool_calls``), each
        with the arguments sent so far: what the deltas put together say.  For a reply cut
        short (by max_tokens), whose last call's arguments may be unfinished JSON."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls]

    # -- the end -------------------------------------------------------------------------

    def finish(self, calls: Sequence[ToolCall]) -> list[dict]:
        """The delta entries that complete the streamed calls to ``calls``, those read from
        the whole reply: each call's arguments beyond what was sent, and the calls not yet
        announced, whole.  A streamed call that the whole reply reads differently (which a
        tool-call grammar rules out) is logged and left as sent."""
        out: list[dict] = []
        for k, call in enumerate(calls):
            arguments = json.dumps(call["arguments"])
            if k < len(self.calls):
                sent = self.calls[k]
                if sent.name != call["tool_name"] or not arguments.startswith(sent.arguments):
                    logger.warning("a streamed tool call differs from the reply read whole: call %d", k)
                    continue
                if len(arguments) > len(sent.arguments):
                    out.append({"index": k, "function": {"arguments": arguments[len(sent.arguments):]}})
            else:
                out.append({"index": k, "id": new_call_id(), "type": "function",
                            "function": {"name": call["tool_name"], "arguments": arguments}})
        return out


FUNCTION_TAG_START = "<function="


class AutoReplyContent:
    """How much of a reply that may call tools (``tool_choice`` "auto") can be streamed as
    content before the reply ends, without ever sending text that the reply read whole
    (:meth:`~llama.formats.dialog.ChatFormat.reply_message`) would not have as the start
    of its content.

    The reply is read whole at its end, as calls and text around them; until then only
    text that no ending can take back is sent: nothing of a reply that starts with
    whitespace, ``{`` or ``[`` (it may be calls throughout, or its text is kept unstripped
    while the content around calls is stripped), nothing from the first place a call may
    start (``<function=``, the ``<|python_tag|>`` token's text, or a declared built-in's
    ``name.call(``), and no whitespace at the end of what is sent.  Plain answers so
    stream as they are written; a reply with calls sends the text before them, and the
    rest at its end.  ``builtin_tools``: the declared built-in tools called as
    ``name.call(query=...)``.
    """

    def __init__(self, builtin_tools: Collection[str] = ()) -> None:
        self._calls = [name + ".call(" for name in builtin_tools]
        self._checked = 0  # no call starts before this
        self._held = False  # a call may start at _checked: nothing from there on is sent

    def sendable(self, text: str) -> int:
        """How many characters of ``text`` (the reply so far) may be sent as content."""
        if not text or text[0].isspace() or text[0] in "{[":
            self._held = True
            return 0
        i = self._checked
        while not self._held and i < len(text):
            state = self._call_at(text, i)
            if state == "maybe":  # the text ends before it tells
                break
            if state == "yes":
                self._held = True
                break
            i += 1
        self._checked = i
        return len(text[:i].rstrip())

    def _call_at(self, text: str, i: int) -> str:
        """Whether a call starts at ``text[i]``: "yes", "no", or "maybe" (too little text yet)."""
        candidates = []
        if text[i] == "<":
            candidates = [FUNCTION_TAG_START, PYTHON_TAG]
        elif self._calls and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            candidates = [c for c in self._calls if c[0] == text[i]]
        for start in candidates:
            piece = text[i : i + len(start)]
            if piece == start:
                return "yes"
            if start.startswith(piece):
                return "maybe"
        return "no"
