"""Chat templates: how a dialog becomes prompt tokens, and a reply's tokens an assistant
message, for Llama 2, Llama 3.x (with tool calls), Llama 4 and CodeLlama-70B-Instruct.

Generation asks the chat format for tokens (``encode_dialog_prompt``, with ``tools=``
for Llama 3.1+), stops at its ``stop_tokens``, and hands the reply back to
``decode_assistant_message``, which says why the reply stopped and which tools it
calls; it never builds a template itself.  Each format checks the dialog first and
raises ``ValueError``/``TypeError`` before any compute is spent on a dialog it cannot
render faithfully.
"""

from __future__ import annotations

import datetime
from typing import Collection, List, Literal, Optional, Sequence, TypedDict

from llama.tokenizer import Llama4Tokenizer, SentencePieceTokenizer, TiktokenTokenizer, Tokenizer
from llama.formats.tool_calls import (
    STOP_REASONS,
    TOOL_PROMPT_FORMATS,
    StopReason,
    ToolCall,
    ToolPromptFormat,
    check_tool_calls,
    format_tool_calls,
    parse_tool_calls,
)
from llama.formats.tool_prompts import apply_tools

__all__ = [
    "Role",
    "Message",
    "Dialog",
    "ChatFormat",
    "Llama2ChatFormat",
    "Llama3ChatFormat",
    "CodeLlama70bInstructChatFormat",
    "Llama4ChatFormat",
    "CHAT_FORMATS",
    "chat_format_for",
]

Role = Literal["system", "user", "assistant", "ipython", "tool"]


class _MessageFields(TypedDict):
    role: Role
    content: str


class Message(_MessageFields, total=False):
    """A chat message: ``role`` and ``content``, and for an assistant's message that
    called tools (Llama 3.1+) its ``tool_calls`` and ``stop_reason`` (``"end_of_message"``
    when it ended in ``<|eom_id|>``).  A tool's answer has the role ``ipython`` (``tool``
    is accepted as another name for it, as in llama-models and OpenAI's API)."""

    tool_calls: List[ToolCall]
    stop_reason: StopReason


Dialog = List[Message]


class ChatFormat:
    """Renders dialogs ending in a user (or tool) message as a prompt for the assistant's
    reply, and turns the reply's tokens back into an assistant message."""

    roles: frozenset[str]
    tokenizer: Tokenizer
    special_tags: tuple[str, ...] = ()  # strings a message may not contain

    def encode_dialog_prompt(
        self,
        dialog: Sequence[Message],
        tool_prompt_format: ToolPromptFormat = "json",
        *,
        tools: Optional[Sequence[object]] = None,
        today: Optional[datetime.date] = None,
    ) -> list[int]:
        """The prompt ids for the assistant's reply to ``dialog``.

        ``tools`` (Llama 3.1+ only): built-in tool names and OpenAI-shaped function
        definitions, declared as :func:`llama.formats.tool_prompts.apply_tools` does, in
        ``tool_prompt_format`` (``"json"``, ``"function_tag"`` or ``"python_list"``),
        which is also the form earlier assistant messages' custom calls are written back
        in; ``today`` is the date the Llama 3.1 tool prompt gives (default: today).
        """
        if tool_prompt_format not in TOOL_PROMPT_FORMATS:
            raise ValueError(f"tool_prompt_format must be one of {TOOL_PROMPT_FORMATS}, got {tool_prompt_format!r}")
        self.validate(dialog)
        if tools:
            if not self.has_tools:
                raise ValueError(
                    f"tools need a Llama 3.1 or later model; this model's chat format ({type(self).__name__}) has no tool calls"
                )
            dialog = apply_tools(dialog, tools, tool_prompt_format, today=today)
        return self._encode_dialog(dialog, tool_prompt_format)

    def validate(self, dialog: Sequence[Message]) -> None:
        raise NotImplementedError

    def _encode_dialog(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat) -> list[int]:
        raise NotImplementedError

    @property
    def stop_tokens(self) -> frozenset[int]:
        """The token ids that end the assistant's reply."""
        return frozenset(self._stop_reasons())

    def _stop_reasons(self) -> dict[int, StopReason]:
        return {self.tokenizer.eos_id: "end_of_turn"}

    def stop_reason(self, stop_token: int) -> StopReason:
        """Why a reply that ended at ``stop_token`` (one of :attr:`stop_tokens`) stopped."""
        return self._stop_reasons().get(stop_token, "end_of_turn")

    def _split_at_stop(self, tokens: Sequence[int], stop_token: Optional[int]) -> tuple[list[int], StopReason]:
        """The reply's tokens before its end token, and why it ended."""
        reasons = self._stop_reasons()
        tokens = list(tokens)
        for k, t in enumerate(tokens):
            if t in reasons:
                return tokens[:k], reasons[t]
        if stop_token is None:
            return tokens, "out_of_tokens"
        if stop_token not in reasons:
            raise ValueError(f"stop_token {stop_token} does not end a reply in this chat format; its end tokens are {sorted(reasons)}")
        return tokens, reasons[stop_token]

    def decode_assistant_message(
        self, tokens: Sequence[int], stop_token: Optional[int] = None, *, tool_calls: bool = True
    ) -> Message:
        """The assistant message a generated reply makes.

        ``tokens`` are the generated ids (the end token may be among them, and ends the
        reply there); ``stop_token`` is the end token generation stopped at, or None when
        it ran out of tokens.  Returns ``{"role": "assistant", "content", "stop_reason",
        "tool_calls"}`` with ``stop_reason`` one of ``"end_of_turn"`` (``<|eot_id|>`` or
        EOS), ``"end_of_message"`` (``<|eom_id|>``: the model waits for a tool's answer)
        and ``"out_of_tokens"``; ``tool_calls`` is ``[]`` for formats without tools, or
        when ``tool_calls=False`` (then the content is the reply's text unparsed).
        """
        body, stop_reason = self._split_at_stop(tokens, stop_token)
        return self.parse_assistant_text(self.tokenizer.decode(body), stop_reason, tool_calls=tool_calls)

    def parse_assistant_text(
        self, text: str, stop_reason: StopReason = "end_of_turn", *, tool_calls: bool = True
    ) -> Message:
        """:meth:`decode_assistant_message` for a reply already decoded to text (as a
        stream delivers it), without its end token."""
        if stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {STOP_REASONS}, got {stop_reason!r}")
        return {"role": "assistant", "content": text, "stop_reason": stop_reason, "tool_calls": []}

    def reply_message(self, tokens: Sequence[int], stop_reason: StopReason, *, text: Optional[str] = None,
                      tools: Collection[str] = ()) -> Message:
        """The assistant message of a reply this library generated, read from its token ids
        (what generation and the server use; :meth:`decode_assistant_message` is llama-models'
        reading, for replies from elsewhere).

        ``tokens``: the reply's ids without its end token; ``text``: their text when it was cut
        inside a token (at a stop string), else they are decoded; ``stop_reason`` as in
        :meth:`decode_assistant_message`.  Text stays text: only a real ``<|python_tag|>``
        token (never those characters in the text) starts a tool call, only calls of the
        ``tools`` the request declared (built-ins by name) become ``tool_calls`` (a reply
        calling anything else is left as text), and a reply that ran out of tokens is its
        text, whatever it began.  Formats without tools return the text."""
        text = self.tokenizer.decode(list(tokens)) if text is None else text
        return {"role": "assistant", "content": text, "stop_reason": stop_reason, "tool_calls": []}

    def _check_messages(self, dialog: Sequence[Message]) -> None:
        """Shape checks shared by every format: a non-empty list of {role, content} dicts."""
        if not isinstance(dialog, (list, tuple)):
            raise TypeError(f"a dialog must be a list of messages, got {type(dialog).__name__}")
        if not dialog:
            raise ValueError("a dialog must hold at least one message")
        for i, msg in enumerate(dialog):
            if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {msg!r:.80}")
            if msg["role"] not in self.roles:
                raise ValueError(
                    f"message {i} has unknown role {msg['role']!r}; this model's roles are {sorted(self.roles)}"
                )
            if not isinstance(msg["content"], str):
                raise TypeError(f"message {i} content must be a str, got {type(msg['content']).__name__}")
            if msg.get("tool_calls") and not self.has_tools:
                raise ValueError(f"message {i} has tool_calls, but this model's chat format has no tool calls")
            for tag in self.special_tags:
                if tag in msg["content"]:
                    raise ValueError(
                        f"message {i} contains the chat-format tag {tag!r}, which would let the text pose as "
                        "template structure; remove it from the message"
                    )

    has_tools = False  # whether assistant messages may carry tool_calls

    @staticmethod
    def _check_order(dialog: Sequence[Message], allowed_next: dict[str, set[str]], last_roles: set[str]) -> None:
        """Check role order: an optional system message first, then each role followed
        only by those ``allowed_next`` lists; the dialog must end in one of ``last_roles``."""
        prev = "start"
        for i, msg in enumerate(dialog):
            role = msg["role"]
            if role not in allowed_next[prev]:
                expected = " or ".join(sorted(allowed_next[prev]))
                where = "first" if prev == "start" else f"after a {prev!r} message"
                raise ValueError(f"message {i} has role {role!r}, but {where} the dialog needs {expected}")
            prev = role
        if prev not in last_roles:
            raise ValueError(
                f"the dialog ends with a {prev!r} message; to get the assistant's reply it must end with "
                + " or ".join(repr(r) for r in sorted(last_roles))
            )


# Llama 2's template pieces, as Meta's Llama 2 code builds them.
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
LLAMA2_SPECIAL_TAGS = (B_INST, E_INST, "<<SYS>>", "<</SYS>>")


class Llama2ChatFormat(ChatFormat):
    """``<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {answer} </s><s>[INST] ...``

    Each (user, assistant) pair is one BOS ... EOS sequence; the final user message is
    BOS ``[INST] ... [/INST]`` with no EOS.  A system message is folded into the first
    user message.
    """

    roles = frozenset({"system", "user", "assistant"})
    special_tags = LLAMA2_SPECIAL_TAGS
    _next = {"start": {"system", "user"}, "system": {"user"}, "user": {"assistant"}, "assistant": {"user"}}

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def validate(self, dialog: Sequence[Message]) -> None:
        self._check_messages(dialog)
        self._check_order(dialog, self._next, {"user"})

    def _encode_dialog(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat) -> list[int]:
        messages = list(dialog)
        if messages[0]["role"] == "system":
            first = messages[1]
            messages = [
                {"role": first["role"], "content": B_SYS + messages[0]["content"] + E_SYS + first["content"]}
            ] + messages[2:]
        tokens: list[int] = []
        for prompt, answer in zip(messages[::2], messages[1::2]):
            text = f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} "
            tokens += self.tokenizer.encode(text, bos=True, eos=True)
        tokens += self.tokenizer.encode(f"{B_INST} {messages[-1]['content'].strip()} {E_INST}", bos=True, eos=False)
        return tokens


class Llama3ChatFormat(ChatFormat):
    """``<|begin_of_text|>`` then per message ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``,
    then an open assistant header for the reply; as llama-models' ``ChatFormat`` encodes it.

    Message text is encoded as text, unstripped: a ``<|eot_id|>`` typed by a user stays
    characters.  ``ipython`` (or ``tool``) is the role of a tool's answer (Llama 3.1+).
    An assistant message with ``tool_calls`` is encoded as llama-models does: a
    ``<|python_tag|>`` first when its first call is ``code_interpreter``, the content,
    each call's text (:func:`llama.formats.tool_calls.format_tool_call`), then ``<|eom_id|>`` if
    its ``stop_reason`` is ``"end_of_message"``, else ``<|eot_id|>``.

    Role order (llama-models', which unlike Llama 2 lets a role follow itself): an
    optional system message first, then any of user, assistant and ipython, ending with
    user or ipython.
    """

    roles = frozenset({"system", "user", "assistant", "ipython", "tool"})
    has_tools = True
    _next = {
        "start": {"system", "user"},
        **dict.fromkeys(["system", "user", "assistant", "ipython"], {"user", "assistant", "ipython"}),
    }

    def __init__(self, tokenizer: TiktokenTokenizer) -> None:
        self.tokenizer = tokenizer

    def _stop_reasons(self) -> dict[int, StopReason]:
        tok = self.tokenizer
        return {tok.eos_id: "end_of_turn", tok.eot_id: "end_of_turn", tok.eom_id: "end_of_message"}

    def validate(self, dialog: Sequence[Message]) -> None:
        self._check_messages(dialog)
        for i, msg in enumerate(dialog):
            if "tool_calls" in msg and msg["tool_calls"] is not None:
                if msg["role"] != "assistant":
                    raise ValueError(f"message {i} has tool_calls, which only an assistant message may have")
                check_tool_calls(msg["tool_calls"], where=f"message {i} tool_calls")
            reason = msg.get("stop_reason")
            if reason is not None and reason not in STOP_REASONS:
                raise ValueError(f"message {i} has stop_reason {reason!r}; it must be one of {STOP_REASONS}")
        roles = [{"role": "ipython" if m["role"] == "tool" else m["role"]} for m in dialog]
        self._check_order(roles, self._next, {"user", "ipython"})

    def encode_header(self, role: str) -> list[int]:
        special = self.tokenizer.special_tokens
        return (
            [special["<|start_header_id|>"]]
            + self.tokenizer.encode("ipython" if role == "tool" else role, bos=False, eos=False)
            + [special["<|end_header_id|>"]]
            + self.tokenizer.encode("\n\n", bos=False, eos=False)
        )

    def encode_message(self, message: Message, tool_prompt_format: ToolPromptFormat = "json") -> list[int]:
        """One message's tokens; ``tool_prompt_format`` is how custom tool calls are written."""
        tok = self.tokenizer
        tokens = self.encode_header(message["role"])
        calls = check_tool_calls(message.get("tool_calls") or []) if message["role"] == "assistant" else []
        if calls and calls[0]["tool_name"] == "code_interpreter":
            tokens.append(tok.python_tag_id)
        tokens += tok.encode(message["content"], bos=False, eos=False)
        for text in format_tool_calls(calls, tool_prompt_format):
            tokens += tok.encode(text, bos=False, eos=False)  # each call separately, as llama-models
        end_of_message = message["role"] == "assistant" and message.get("stop_reason") == "end_of_message"
        return tokens + [tok.eom_id if end_of_message else tok.eot_id]

    def _encode_dialog(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat) -> list[int]:
        self.validate(dialog)  # the dialog as the tools' messages made it
        tokens = [self.tokenizer.bos_id]
        for message in dialog:
            tokens += self.encode_message(message, tool_prompt_format)
        return tokens + self.encode_header("assistant")

    def decode_assistant_message(
        self, tokens: Sequence[int], stop_token: Optional[int] = None, *, tool_calls: bool = True
    ) -> Message:
        body, stop_reason = self._split_at_stop(tokens, stop_token)
        tag = self.tokenizer.python_tag_id
        if tag not in body:
            return self._assistant_message("", self.tokenizer.decode(body), False, stop_reason, tool_calls)
        k = body.index(tag)
        before, after = self.tokenizer.decode(body[:k]), self.tokenizer.decode(body[k + 1 :])
        return self._assistant_message(before, after, True, stop_reason, tool_calls)

    def reply_message(self, tokens: Sequence[int], stop_reason: StopReason, *, text: Optional[str] = None,
                      tools: Collection[str] = ()) -> Message:
        tokens = list(tokens)
        decode = self.tokenizer.decode
        text = decode(tokens) if text is None else text
        plain: Message = {"role": "assistant", "content": text, "stop_reason": stop_reason, "tool_calls": []}
        if stop_reason == "out_of_tokens" or not tools:
            return plain
        tag = self.tokenizer.python_tag_id
        if tag in tokens:
            k = tokens.index(tag)
            head = decode(tokens[: k + 1])  # the reply up to and with the tag, a prefix of its text
            body = text[len(head):] if text.startswith(head) else decode(tokens[k + 1 :])
            message = self._assistant_message(decode(tokens[:k]), body, True, stop_reason, True)
        else:
            message = self._assistant_message("", text, False, stop_reason, True)
        if not message["tool_calls"] or any(call["tool_name"] not in tools for call in message["tool_calls"]):
            return plain
        return message

    def parse_assistant_text(
        self, text: str, stop_reason: StopReason = "end_of_turn", *, tool_calls: bool = True
    ) -> Message:
        """For a reply decoded to text: a ``<|python_tag|>`` in it (the control token's
        text, as the tokenizer decodes it) starts the tool call, and a trailing
        ``<|eot_id|>``/``<|eom_id|>`` sets the stop reason, as in llama-models'
        ``decode_assistant_message_from_content``."""
        if stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {STOP_REASONS}, got {stop_reason!r}")
        for end, reason in (("<|eot_id|>", "end_of_turn"), ("<|eom_id|>", "end_of_message")):
            if text.endswith(end):
                text, stop_reason = text[: -len(end)], reason
        before, tag, after = text.partition("<|python_tag|>")
        if not tag:
            return self._assistant_message("", text, False, stop_reason, tool_calls)
        return self._assistant_message(before, after, True, stop_reason, tool_calls)

    @staticmethod
    def _assistant_message(
        before: str, body: str, python_tag: bool, stop_reason: StopReason, parse: bool
    ) -> Message:
        """``before``: text ahead of ``<|python_tag|>``; ``body``: the text after it (all of
        the reply when there is none)."""
        if not parse:
            text = before + ("<|python_tag|>" if python_tag else "") + body
            return {"role": "assistant", "content": text, "stop_reason": stop_reason, "tool_calls": []}
        content, calls = parse_tool_calls(body, python_tag=python_tag)
        if python_tag:
            content = "\n".join(part for part in (before.strip(), content) if part)
        return {"role": "assistant", "content": content, "stop_reason": stop_reason, "tool_calls": calls}


class CodeLlama70bInstructChatFormat(ChatFormat):
    """CodeLlama-70B-Instruct's turns, as Meta's codellama reference builds them::

        <s> Source: system\\n\\n {system}<step> Source: user\\n\\n {user}<step> Source: assistant\\nDestination: user\\n\\n 

    Each message is `` Source: {role}`` (and ``\\nDestination: {destination}`` if the
    message names one), then ``\\n\\n {content}`` (stripped; nothing if empty), then the
    ``<step>`` control token, which also ends the assistant's reply.  A dialog without a
    system message gets an empty one.  The model's files do not tell it apart from Code
    Llama's other models: choose it with ``chat_format="codellama-70b-instruct"``.
    """

    roles = frozenset({"system", "user", "assistant"})
    special_tags = ("<step>",)
    _next = {"start": {"system", "user"}, "system": {"user"}, "user": {"assistant"}, "assistant": {"user"}}

    def __init__(self, tokenizer: Tokenizer) -> None:
        step_id = getattr(tokenizer, "step_id", None)
        if step_id is None:
            raise ValueError(
                "the CodeLlama-70B-Instruct chat format needs a tokenizer with the <step> token; "
                "this tokenizer has none (use that model's tokenizer.model, or another chat format)"
            )
        self.tokenizer = tokenizer
        self.step_id: int = step_id

    def _stop_reasons(self) -> dict[int, StopReason]:
        return {self.step_id: "end_of_turn", self.tokenizer.eos_id: "end_of_turn"}

    def validate(self, dialog: Sequence[Message]) -> None:
        self._check_messages(dialog)
        for i, msg in enumerate(dialog):
            destination = msg.get("destination")
            if destination is not None and not isinstance(destination, str):
                raise TypeError(f"message {i} destination must be a str, got {type(destination).__name__}")
        self._check_order(dialog, self._next, {"user"})

    def _encode_dialog(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat) -> list[int]:
        tok = self.tokenizer
        if dialog[0]["role"] != "system":
            dialog = [{"role": "system", "content": ""}, *dialog]
        tokens = [tok.bos_id]
        for message in dialog:
            header = f" Source: {message['role']}"
            if message.get("destination") is not None:
                header += f"\nDestination: {message['destination'].strip()}"
            tokens += tok.encode(header, bos=False, eos=False)
            if message["content"]:
                tokens += tok.encode("\n\n " + message["content"].strip(), bos=False, eos=False)
            tokens.append(self.step_id)
        tokens += tok.encode(" Source: assistant\nDestination: user", bos=False, eos=False)
        return tokens + tok.encode("\n\n ", bos=False, eos=False)


class Llama4ChatFormat(ChatFormat):
    """``<|begin_of_text|>`` then per message ``<|header_start|>{role}<|header_end|>\n\n{content}<|eot|>``,
    then an open assistant header for the reply (Meta's Llama 4 template, text only).

    Unlike Llama 3's, message text is not stripped.  A tool's output (role ``tool``, or
    ``ipython`` as in Llama 3.1 dialogs) is headed ``ipython`` and ends with ``<|eom|>``,
    as Meta's reference renders it; message text is encoded as text, so a typed
    ``<|eot|>`` stays characters.
    """

    roles = frozenset({"system", "user", "assistant", "ipython", "tool"})
    _next = {
        "start": {"system", "user"},
        "system": {"user"},
        "user": {"assistant"},
        "assistant": {"user", "ipython", "tool"},
        "ipython": {"assistant", "ipython", "tool"},
        "tool": {"assistant", "ipython", "tool"},
    }

    def __init__(self, tokenizer: Llama4Tokenizer) -> None:
        self.tokenizer = tokenizer

    def validate(self, dialog: Sequence[Message]) -> None:
        self._check_messages(dialog)
        self._check_order(dialog, self._next, {"user", "ipython", "tool"})

    def encode_header(self, role: str) -> list[int]:
        tok = self.tokenizer
        header = "ipython" if role == "tool" else role
        return [tok.header_start_id] + tok.encode(header, bos=False, eos=False) + [tok.header_end_id] + tok.encode(
            "\n\n", bos=False, eos=False
        )

    def encode_message(self, message: Message) -> list[int]:
        tok = self.tokenizer
        end = tok.eom_id if message["role"] in ("tool", "ipython") else tok.eot_id
        return self.encode_header(message["role"]) + tok.encode(message["content"], bos=False, eos=False) + [end]

    def _stop_reasons(self) -> dict[int, StopReason]:
        tok = self.tokenizer
        return {tok.eos_id: "end_of_turn", tok.eot_id: "end_of_turn", tok.eom_id: "end_of_message"}

    def _encode_dialog(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat) -> list[int]:
        tokens = [self.tokenizer.bos_id]
        for message in dialog:
            tokens += self.encode_message(message)
        return tokens + self.encode_header("assistant")


CHAT_FORMATS = ("llama2", "llama3", "llama4", "codellama-70b-instruct")


def chat_format_for(tokenizer: Tokenizer, name: Optional[str] = None) -> ChatFormat:
    """The chat format for a tokenizer: by default the one its family uses (Llama 3's for
    a tiktoken tokenizer, Llama 2's for SentencePiece); ``name`` picks one explicitly
    (one of :data:`CHAT_FORMATS`), which CodeLlama-70B-Instruct needs."""
    if name is None:
        if isinstance(tokenizer, Llama4Tokenizer):
            return Llama4ChatFormat(tokenizer)
        if isinstance(tokenizer, TiktokenTokenizer):
            return Llama3ChatFormat(tokenizer)
        if isinstance(tokenizer, SentencePieceTokenizer):
            return Llama2ChatFormat(tokenizer)
        raise TypeError(f"no chat format is known for {type(tokenizer).__name__}")
    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r}; choose one of {CHAT_FORMATS}")
    if name == "llama4":
        if not isinstance(tokenizer, Llama4Tokenizer):
            raise ValueError("the llama4 chat format needs a Llama 4 tokenizer.model")
        return Llama4ChatFormat(tokenizer)
    if name == "llama3":
        if not isinstance(tokenizer, TiktokenTokenizer) or isinstance(tokenizer, Llama4Tokenizer):
            raise ValueError("the llama3 chat format needs a Llama 3 (tiktoken) tokenizer.model")
        return Llama3ChatFormat(tokenizer)
    if not isinstance(tokenizer, SentencePieceTokenizer):
        raise ValueError(f"the {name} chat format needs a SentencePiece (Llama 2 / Code Llama) tokenizer.model")
    if name == "llama2":
        return Llama2ChatFormat(tokenizer)
    return CodeLlama70bInstructChatFormat(tokenizer)
