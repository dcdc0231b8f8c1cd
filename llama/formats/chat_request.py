"""A chat request's tool rules, decided once for both front doors: the Python API
(:meth:`llama.Llama.chat_completion` and its stream) and the server's
``/v1/chat/completions`` (:mod:`llama.serve.chat`).

:func:`plan_chat_request` reads a request's ``tools``, ``tool_choice`` and
``response_format`` and says, before its prompt is encoded or a token generated:

* which tools are declared to the model (none under ``tool_choice`` "none": a model that
  sees tools writes calls whatever it is told);
* whether the reply is constrained to calls ("required" or a named function, by the
  tool-call grammar of :mod:`llama.structured.tool_choice`), which a ``response_format``
  cannot constrain as well (the conflict is a ``ValueError``);
* which tools the reply may call: those ``tool_choice`` allows of the declared ones, and
  none when a ``response_format`` constrains the reply (such a reply is content).

Meta's own way of declaring built-in tools works too, as in llama-models: a system message
that says ``Environment: ipython`` (and ``Tools: brave_search, wolfram_alpha``) declares
``code_interpreter`` (and the tools named), so that a reply calling them is read as calls
(:meth:`ChatRequestPlan.with_system_tools`; the system message itself is the declaration,
so the prompt is not changed).

:meth:`ChatRequestPlan.reply` then reads the finished reply into an assistant message
(:func:`assistant_reply`).  Compiling the grammars is not done here (no torch, no llguidance
in :mod:`llama.formats`): each front door compiles what the plan asks for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Collection, Mapping, Optional, Protocol, Sequence, cast

from llama.formats.dialog import ChatFormat, Message
from llama.formats.tool_calls import BUILTIN_TOOLS, QUERY_TOOLS
from llama.formats.tool_prompts import declared_tool_names

__all__ = ["ChatRequestPlan", "ToolChoice", "TOOL_CHOICE_MODES", "assistant_reply", "check_tool_choice",
           "plan_chat_request", "system_declared_tools"]

TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    """A checked ``tool_choice``: ``mode`` is ``"none"``, ``"auto"``, ``"required"`` or
    ``"function"`` (then ``name`` is the tool's)."""

    mode: str
    name: Optional[str] = None

    @property
    def constrained(self) -> bool:
        """Whether the reply must be calls (enforced by a grammar)."""
        return self.mode in ("required", "function")

    def callable(self, declared: frozenset[str]) -> frozenset[str]:
        """The tools a reply may call, of those ``declared``."""
        if self.mode == "none":
            return frozenset()
        if self.mode == "function":
            return frozenset({cast(str, self.name)}) & declared  # mode function: it names one
        return declared


def check_tool_choice(tool_choice: object, tools: Optional[Sequence[object]]) -> ToolChoice:
    """``tool_choice`` checked against the declared ``tools`` (OpenAI's values, see
    :mod:`llama.structured.tool_choice`; ``None`` is ``"auto"``).  Raises ``ValueError``
    saying what is wrong: an unknown value, ``"required"`` without tools, or a function that
    is not declared (and as :func:`~llama.formats.tool_prompts.check_tools` for a bad list of
    tools, its message starting with ``tools``)."""
    declared = declared_tool_names(tools)
    if tool_choice is None:
        return ToolChoice("auto")
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(map(repr, TOOL_CHOICE_MODES))} or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, not {tool_choice!r:.80}")
        if tool_choice == "required" and not declared:
            raise ValueError("tool_choice 'required' needs tools: declare at least one")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if (not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function"
            or not isinstance(function, Mapping)):
        raise ValueError(f"tool_choice must be a string or {{'type': 'function', 'function': {{'name': ...}}}}, "
                         f"not {json.dumps(tool_choice, default=repr)[:120]}")
    name = function.get("name")
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name must be the name of one of the tools")
    if name not in declared:
        known = ", ".join(sorted(declared)) or "no tools are declared"
        raise ValueError(f"tool_choice names {name!r:.80}, which is not among the tools ({known})")
    return ToolChoice("function", name)


@dataclass(frozen=True)
class ChatRequestPlan:
    """What a chat request's ``tools``, ``tool_choice`` and ``response_format`` decide
    (:func:`plan_chat_request`).

    ``tools``: the tools declared to the model (None under "none"); ``callable_tools``: the
    names of those its reply may call (read from its token ids, :meth:`reply`)."""

    tool_choice: ToolChoice
    tools: Optional[Sequence[object]]
    callable_tools: frozenset[str]
    follows_format: bool = False  # a response_format constrains the reply: it is content

    def with_system_tools(self, dialog: Sequence[Message]) -> "ChatRequestPlan":
        """This plan for ``dialog``: the built-in tools its system message declares in Meta's
        format (:func:`system_declared_tools`) may be called too, unless ``tool_choice`` is
        "none" or names a function, or a ``response_format`` constrains the reply."""
        if self.follows_format or self.tool_choice.mode in ("none", "function"):
            return self
        extra = system_declared_tools(dialog) - self.callable_tools
        return replace(self, callable_tools=self.callable_tools | extra) if extra else self

    @property
    def reply_is_calls(self) -> bool:
        """The reply is constrained to calls of :attr:`callable_tools` by the tool-call grammar
        ("required" or a named function), which the front door compiles."""
        return self.tool_choice.constrained

    @property
    def reply_may_call(self) -> bool:
        """The reply may be calls or text, which only its end tells ("auto" with tools to call
        and no ``response_format``)."""
        return bool(self.callable_tools) and not self.reply_is_calls

    @property
    def query_tools(self) -> list[str]:
        """The built-in tools the reply may call with a query (``brave_search.call(query=...)``)."""
        return [t for t in self.callable_tools if t in QUERY_TOOLS]

    def reply(self, formatter: ChatFormat, result: ReplyResult) -> Message:
        """The finished reply as an assistant message (:func:`assistant_reply`)."""
        return assistant_reply(formatter, result, self.callable_tools)


def follows_response_format(response_format: object) -> bool:
    """Whether ``response_format`` constrains the reply (any format but ``{"type": "text"}``;
    a format that is not an object is refused where it is compiled)."""
    return isinstance(response_format, Mapping) and response_format.get("type") != "text"


def plan_chat_request(tool_choice: object, tools: Optional[Sequence[object]],
                      response_format: Optional[Mapping[str, Any]]) -> ChatRequestPlan:
    """The plan of a chat request (see the module doc).  ``ValueError`` (or ``TypeError`` for a
    tool of the wrong type) for a ``tool_choice`` or ``tools`` :func:`check_tool_choice`
    refuses, and for a reply constrained to calls that is asked to follow a
    ``response_format`` too; each message starts with the field at fault (``tools`` or
    ``tool_choice``)."""
    choice = check_tool_choice(tool_choice, tools)
    follows_format = follows_response_format(response_format)
    if choice.constrained and follows_format:
        raise ValueError(f"tool_choice {json.dumps(tool_choice, default=repr)[:120]} makes the reply tool calls; "
                         "it cannot also follow a response_format: give one or the other")
    declared = None if choice.mode == "none" else tools
    # A reply constrained by a response_format is content; one constrained to calls is calls.
    callable_tools = frozenset() if follows_format else choice.callable(declared_tool_names(declared))
    return ChatRequestPlan(choice, declared, callable_tools, follows_format)


def system_declared_tools(dialog: Sequence[Message]) -> frozenset[str]:
    """The built-in tools a dialog's system message declares in Meta's format (llama-models'
    system prompt): ``Environment: ipython`` declares ``code_interpreter`` (a reply after
    ``<|python_tag|>`` is code, as llama-models reads it), and a ``Tools: a, b`` line the
    built-in tools it names (:data:`~llama.formats.tool_calls.BUILTIN_TOOLS`; other names
    are not built-ins and are left alone)."""
    first = dialog[0] if dialog else None
    content = first.get("content") if isinstance(first, Mapping) else None
    if not isinstance(first, Mapping) or first.get("role") != "system" or not isinstance(content, str):
        return frozenset()
    lines = [line.strip() for line in content.splitlines()]
    if "Environment: ipython" not in lines:
        return frozenset()
    named = {name.strip() for line in lines if line.startswith("Tools:")
             for name in line.removeprefix("Tools:").split(",")}
    return frozenset({"code_interpreter"} | (named & set(BUILTIN_TOOLS)))


class ReplyResult(Protocol):
    """What :func:`assistant_reply` reads of a finished request (:class:`llama.engine.RequestResult`)."""

    finish_reason: str
    stop_token: Optional[int]
    tokens: list[int]
    text: str


def assistant_reply(formatter: ChatFormat, result: ReplyResult, tools: Collection[str]) -> Message:
    """A chat request's reply as an assistant message (``stop_reason``, ``tool_calls``), read
    from its token ids whatever ended it (a stop token, a stop string, the length limit, a
    cancellation): only a real ``<|python_tag|>`` token starts a call, only ``tools`` may be
    called, and a reply cut short is its text (see :meth:`ChatFormat.reply_message`)."""
    if result.finish_reason == "stop":
        reason = "end_of_turn" if result.stop_token is None else formatter.stop_reason(result.stop_token)
    else:  # "length", "cancelled"
        reason = "out_of_tokens"
    return formatter.reply_message(result.tokens, reason, text=result.text, tools=tools)
