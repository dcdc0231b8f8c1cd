"""What a dialog is (:class:`Message`, :data:`Dialog`) and what every chat format does with
one (:class:`ChatFormat`): check it, render it as the prompt for the assistant's reply,
and read the reply's tokens back as an assistant message.  The formats themselves, one
per model family, are in :mod:`llama.formats.chat`.
"""

from __future__ import annotations

import datetime
from typing import Any, Collection, List, Literal, Mapping, Optional, Sequence, TypedDict, Union

from llama.formats.content import ImagePart, dialog_has_images, split_dialog
from llama.formats.tool_calls import (
    STOP_REASONS,
    TOOL_PROMPT_FORMATS,
    StopReason,
    ToolCall,
    ToolPromptFormat,
)
from llama.formats.tool_prompts import apply_tools
from llama.images.prompt import EncodedDialog, ImageLayout
from llama.tokenizer import Tokenizer

Role = Literal["system", "user", "assistant", "ipython", "tool"]


# A message's content: a string, or a list of content parts ({"type": "text", "text": ...},
# {"type": "image", "image": <PIL.Image | bytes | path>}, llama-models' RawTextItem/RawMediaItem:
# llama.formats.content reads them).
Content = Union[str, List[Any]]


class _MessageFields(TypedDict):
    role: Role
    content: Content


class Message(_MessageFields, total=False):
    """A chat message: ``role`` and ``content``, and for an assistant's message that
    called tools (Llama 3.1+) its ``tool_calls`` and ``stop_reason`` (``"end_of_message"``
    when it ended in ``<|eom_id|>``).  A tool's answer has the role ``ipython`` (``tool``
    is accepted as another name for it, as in llama-models and OpenAI's API)."""

    tool_calls: List[ToolCall]
    stop_reason: StopReason
    destination: str  # CodeLlama-70B-Instruct's: whom the message is for


Dialog = List[Message]


def message_text(message: Message) -> str:
    """The text of a message the format's checks passed as text (:func:`~llama.formats.content.split_dialog`
    made every content without images one string; only a format that takes images sees lists,
    and encodes them part by part).  ``TypeError`` for content that is not a string."""
    content = message["content"]
    if not isinstance(content, str):
        raise TypeError(f"a {message['role']!r} message's content must be text here, got {type(content).__name__}")
    return content


class ChatFormat:
    """Renders dialogs ending in a user (or tool) message as a prompt for the assistant's
    reply, and turns the reply's tokens back into an assistant message."""

    roles: frozenset[str]
    tokenizer: Tokenizer
    special_tags: tuple[str, ...] = ()  # strings a message may not contain

    # The forms this model's tool calls take; the first is its own (the default).
    tool_prompt_formats: tuple[ToolPromptFormat, ...] = TOOL_PROMPT_FORMATS

    def check_tool_prompt_format(self, tool_prompt_format: Optional[str]) -> ToolPromptFormat:
        """``tool_prompt_format`` checked for this model (``None``: its own, the first of
        :attr:`tool_prompt_formats`); ValueError naming the ones it takes."""
        if tool_prompt_format is None:
            return self.tool_prompt_formats[0]
        if tool_prompt_format not in TOOL_PROMPT_FORMATS:
            raise ValueError(f"tool_prompt_format must be one of {TOOL_PROMPT_FORMATS}, got {tool_prompt_format!r}")
        if tool_prompt_format not in self.tool_prompt_formats:
            raise ValueError(f"this model's chat format ({type(self).__name__}) writes tool calls in the "
                             f"{' or '.join(self.tool_prompt_formats)} format, not {tool_prompt_format!r}")
        return tool_prompt_format

    def encode_dialog_prompt(
        self,
        dialog: Sequence[Message],
        tool_prompt_format: Optional[ToolPromptFormat] = None,
        *,
        tools: Optional[Sequence[object]] = None,
        today: Optional[datetime.date] = None,
    ) -> list[int]:
        """The prompt ids for the assistant's reply to ``dialog``.

        ``tools`` (Llama 3.1+ only): built-in tool names and OpenAI-shaped function
        definitions, declared as :func:`llama.formats.tool_prompts.apply_tools` does (Llama
        4: :func:`~llama.formats.tool_prompts.apply_llama4_tools`), in ``tool_prompt_format``
        (``"json"``, ``"function_tag"`` or ``"python_list"``; default: the model's own,
        :meth:`check_tool_prompt_format`), which is also the form earlier assistant
        messages' custom calls are written back in; ``today`` is the date the Llama 3.1
        tool prompt gives (default: today).

        A dialog with images needs :meth:`encode_dialog`, which returns their pixel values
        with the ids: here it is a ``ValueError``.
        """
        if self.image_layout is not None and dialog_has_images(dialog):
            raise ValueError("the dialog holds images: encode it with encode_dialog, which returns the images' "
                             "pixel values and positions with the token ids")
        return self.encode_dialog(dialog, tool_prompt_format, tools=tools, today=today).tokens

    def encode_dialog(
        self,
        dialog: Sequence[Message],
        tool_prompt_format: Optional[ToolPromptFormat] = None,
        *,
        tools: Optional[Sequence[object]] = None,
        today: Optional[datetime.date] = None,
    ) -> EncodedDialog:
        """:meth:`encode_dialog_prompt` for a dialog that may hold images: the prompt's ids
        and, per image, its ``pixel_values`` and the positions of its ``<|patch|>`` tokens
        (:class:`llama.images.prompt.EncodedDialog`; no images for a text-only dialog).

        A message's ``content`` is a string or a list of parts,
        ``{"type": "text", "text": ...}`` and ``{"type": "image", "image": <PIL.Image | bytes |
        path>}`` (or llama-models' ``RawTextItem``/``RawMediaItem``): see
        :mod:`llama.formats.content`.  Images go in user messages, and only to a format with
        an :attr:`image_layout`; otherwise ``ValueError`` (the model takes no images).  An
        image that cannot be read, and a dialog of more than :attr:`max_images` images, are a
        ``ValueError`` (the former naming its message and part), raised before any image is
        decoded.  Llama 4's images are :class:`~llama.images.prompt.PromptImage` s, Llama 3.2
        Vision's :class:`~llama.images.prompt.MllamaPromptImage` s.
        """
        dialog = split_dialog(dialog, takes_images=self.image_layout is not None, why_not=self.why_no_images())
        n_images = sum(isinstance(p, ImagePart) for m in dialog if isinstance(m, Mapping)
                       and isinstance(m.get("content"), list) for p in m["content"])
        if self.max_images is not None and n_images > self.max_images:
            raise ValueError(f"the dialog holds {n_images} images, more than this model takes in one prompt "
                             f"({self.max_images}, max_images)")
        tool_prompt_format = self.check_tool_prompt_format(tool_prompt_format)
        self.validate(dialog)
        if tools:
            if not self.has_tools:
                raise ValueError(
                    f"tools need a Llama 3.1 or later model; this model's chat format ({type(self).__name__}) has "
                    "no tool calls"
                )
            dialog = self._declare_tools(dialog, tools, tool_prompt_format, today)
        return self._encode_dialog_with_images(dialog, tool_prompt_format)

    # How this format's model cuts images into tiles; None: it takes no images.
    image_layout: Optional[ImageLayout] = None
    # The most images one dialog may hold (None: no limit but the pixels of each).
    max_images: Optional[int] = None

    def why_no_images(self) -> str:
        """Why this format takes no images, for the error that refuses one."""
        return f"{type(self).__name__} is a text-only chat format"

    def _encode_dialog_with_images(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat
                                   ) -> EncodedDialog:
        return EncodedDialog(self._encode_dialog(dialog, tool_prompt_format))

    def _declare_tools(self, dialog: Sequence[Message], tools: Sequence[object], tool_prompt_format: ToolPromptFormat,
                       today: Optional[datetime.date]) -> list:
        return apply_tools(dialog, tools, tool_prompt_format, today=today)

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
            raise ValueError(f"stop_token {stop_token} does not end a reply in this chat format; its end tokens "
                             f"are {sorted(reasons)}")
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
            content: Any = msg["content"]
            if isinstance(content, list) and self.image_layout is not None and all(
                    isinstance(p, (str, ImagePart)) for p in content):  # a user message with images, split
                texts = [p for p in content if isinstance(p, str)]
            elif not isinstance(content, str):
                raise TypeError(f"message {i} content must be a str, got {type(content).__name__}")
            else:
                texts = [content]
            if msg.get("tool_calls") and not self.has_tools:
                raise ValueError(f"message {i} has tool_calls, but this model's chat format has no tool calls")
            for tag in self.special_tags:
                if any(tag in text for text in texts):
                    raise ValueError(
                        f"message {i} contains the chat-format tag {tag!r}, which would let the text pose as "
                        "template structure; remove it from the message"
                    )

    has_tools = False  # whether assistant messages may carry tool_calls

    @staticmethod
    def _check_order(dialog: Sequence[Mapping[str, Any]], allowed_next: dict[str, set[str]],
                     last_roles: set[str]) -> None:
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
