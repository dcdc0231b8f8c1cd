"""Chat templates: how a dialog becomes prompt tokens, for Llama 2, Llama 3.x and Llama 4.

Generation asks the chat format for tokens and never builds a template itself.  Each
format checks the dialog first and raises ``ValueError``/``TypeError`` before any
compute is spent on a dialog it cannot render faithfully.
"""

from __future__ import annotations

from typing import List, Literal, Sequence, TypedDict

from .tokenizer import Llama4Tokenizer, SentencePieceTokenizer, TiktokenTokenizer, Tokenizer

__all__ = [
    "Role", "Message", "Dialog", "ChatFormat", "Llama2ChatFormat", "Llama3ChatFormat", "Llama4ChatFormat",
    "chat_format_for",
]

Role = Literal["system", "user", "assistant", "ipython", "tool"]


class Message(TypedDict):
    role: Role
    content: str


Dialog = List[Message]


class ChatFormat:
    """Renders dialogs ending in a user (or tool) message as a prompt for the assistant's reply."""

    roles: frozenset[str]
    tokenizer: Tokenizer
    special_tags: tuple[str, ...] = ()  # strings a message may not contain

    def encode_dialog_prompt(self, dialog: Sequence[Message]) -> list[int]:
        raise NotImplementedError

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
        for i, msg in enumerate(dialog):
            for tag in LLAMA2_SPECIAL_TAGS:
                if tag in msg["content"]:
                    raise ValueError(
                        f"message {i} contains the chat-format tag {tag!r}, which would let the text pose as "
                        "template structure; remove it from the message"
                    )
        self._check_order(dialog, self._next, {"user"})

    def encode_dialog_prompt(self, dialog: Sequence[Message]) -> list[int]:
        self.validate(dialog)
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
    then an open assistant header for the reply.

    Message text is encoded as text: a ``<|eot_id|>`` typed by a user stays characters.
    ``ipython`` is the role of a tool's output (Llama 3.1 tool use).
    """

    roles = frozenset({"system", "user", "assistant", "ipython"})
    _next = {
        "start": {"system", "user"},
        "system": {"user"},
        "user": {"assistant"},
        "assistant": {"user", "ipython"},
        "ipython": {"assistant", "ipython"},
    }

    def __init__(self, tokenizer: TiktokenTokenizer) -> None:
        self.tokenizer = tokenizer

    def validate(self, dialog: Sequence[Message]) -> None:
        self._check_messages(dialog)
        self._check_order(dialog, self._next, {"user", "ipython"})

    def encode_header(self, role: str) -> list[int]:
        special = self.tokenizer.special_tokens
        return (
            [special["<|start_header_id|>"]]
            + self.tokenizer.encode(role, bos=False, eos=False)
            + [special["<|end_header_id|>"]]
            + self.tokenizer.encode("\n\n", bos=False, eos=False)
        )

    def encode_message(self, message: Message) -> list[int]:
        return (
            self.encode_header(message["role"])
            + self.tokenizer.encode(message["content"].strip(), bos=False, eos=False)
            + [self.tokenizer.eot_id]
        )

    def encode_dialog_prompt(self, dialog: Sequence[Message]) -> list[int]:
        self.validate(dialog)
        tokens = [self.tokenizer.bos_id]
        for message in dialog:
            tokens += self.encode_message(message)
        return tokens + self.encode_header("assistant")


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

    def encode_dialog_prompt(self, dialog: Sequence[Message]) -> list[int]:
        self.validate(dialog)
        tokens = [self.tokenizer.bos_id]
        for message in dialog:
            tokens += self.encode_message(message)
        return tokens + self.encode_header("assistant")


def chat_format_for(tokenizer: Tokenizer) -> ChatFormat:
    """The chat format that goes with a tokenizer's family."""
    if isinstance(tokenizer, Llama4Tokenizer):
        return Llama4ChatFormat(tokenizer)
    if isinstance(tokenizer, TiktokenTokenizer):
        return Llama3ChatFormat(tokenizer)
    if isinstance(tokenizer, SentencePieceTokenizer):
        return Llama2ChatFormat(tokenizer)
    raise TypeError(f"no chat format is known for {type(tokenizer).__name__}")
