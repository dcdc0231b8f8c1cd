"""Chat templates: how a dialog becomes prompt tokens, and a reply's tokens an assistant
message, for Llama 2, Llama 3.x (with tool calls, and images for 3.2 Vision), Llama 4 (with
images) and CodeLlama-70B-Instruct.

Generation asks the chat format for tokens (``encode_dialog_prompt``, with ``tools=``
for Llama 3.1+), stops at its ``stop_tokens``, and hands the reply back to
``decode_assistant_message``, which says why the reply stopped and which tools it
calls; it never builds a template itself.  Each format checks the dialog first and
raises ``ValueError``/``TypeError`` before any compute is spent on a dialog it cannot
render faithfully.  What every format shares (the message types, the checks, the
reading of a reply) is :class:`llama.formats.dialog.ChatFormat`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection, Optional, Sequence

from llama.formats.content import ImagePart
from llama.formats.dialog import ChatFormat, Dialog, Message, Role, message_text
from llama.formats.tool_call_parser import parse_tool_calls
from llama.formats.tool_calls import (
    STOP_REASONS,
    StopReason,
    ToolPromptFormat,
    check_tool_calls,
    format_tool_calls,
)
from llama.formats.tool_prompts import apply_llama4_tools
from llama.images.prompt import (
    DEFAULT_MAX_PIXELS,
    MLLAMA_IMAGE_TOKEN_ID,
    EncodedDialog,
    ImageLayout,
    MllamaLayout,
    MllamaPromptImage,
    PromptImage,
    TileLayout,
    attended_until,
)
from llama.tokenizer import Llama4Tokenizer, SentencePieceTokenizer, TiktokenTokenizer, Tokenizer

if TYPE_CHECKING:
    from llama.images.mllama import MllamaImage  # PIL and torch: imported when an image is encoded

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
                Message(role=first["role"], content=B_SYS + message_text(messages[0]) + E_SYS + message_text(first))
            ] + messages[2:]
        tokens: list[int] = []
        for prompt, answer in zip(messages[::2], messages[1::2]):
            text = f"{B_INST} {message_text(prompt).strip()} {E_INST} {message_text(answer).strip()} "
            tokens += self.tokenizer.encode(text, bos=True, eos=True)
        tokens += self.tokenizer.encode(f"{B_INST} {message_text(messages[-1]).strip()} {E_INST}", bos=True,
                                        eos=False)
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

    Images (Llama 3.2 Vision: with ``vision``, the model's
    :class:`~llama.images.prompt.MllamaLayout`; without it the format takes none): a user
    message's content may hold image parts anywhere among its text parts
    (:mod:`llama.formats.content`).  As Meta's ``ChatFormat`` encodes such content, each text part
    is encoded on its own, unstripped, and each image is one token where it stands, with no text
    added around it: ``<|image|>`` (:data:`~llama.images.prompt.MLLAMA_IMAGE_TOKEN_ID`, the id
    Meta's format hands the model for it)::

        <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n<|image|>Describe it.<|eot_id|>
        <|start_header_id|>assistant<|end_header_id|>\\n\\n

    Each image is preprocessed (:func:`llama.images.mllama.preprocess_image`, refused over
    ``max_image_pixels``); :meth:`encode_dialog` returns its tiles and where it is
    (:class:`~llama.images.prompt.MllamaPromptImage`) with the ids.
    """

    roles = frozenset({"system", "user", "assistant", "ipython", "tool"})
    has_tools = True
    _next = {
        "start": {"system", "user"},
        **dict.fromkeys(["system", "user", "assistant", "ipython"], {"user", "assistant", "ipython"}),
    }

    tokenizer: TiktokenTokenizer
    image_layout: Optional[MllamaLayout]

    def __init__(self, tokenizer: TiktokenTokenizer, vision: Optional[MllamaLayout] = None, *,
                 max_image_pixels: int = DEFAULT_MAX_PIXELS, max_images: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.image_layout = vision
        self.max_image_pixels = max_image_pixels
        self.max_images = max_images

    def why_no_images(self) -> str:
        return ("this Llama 3 chat format was made without an image layout: the model is a text model (of Llama "
                "3.x, the 3.2 Vision checkpoints alone take images: params.json's vision_chunk_size)")

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
        tokens += tok.encode(message_text(message), bos=False, eos=False)
        for text in format_tool_calls(calls, tool_prompt_format):
            tokens += tok.encode(text, bos=False, eos=False)  # each call separately, as llama-models
        end_of_message = message["role"] == "assistant" and message.get("stop_reason") == "end_of_message"
        return tokens + [tok.eom_id if end_of_message else tok.eot_id]

    def _encode_dialog(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat) -> list[int]:
        return self._encode_dialog_with_images(dialog, tool_prompt_format).tokens

    def _encode_dialog_with_images(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat
                                   ) -> EncodedDialog:
        self.validate(dialog)  # the dialog as the tools' messages made it
        tok = self.tokenizer
        tokens = [tok.bos_id]
        tiled: list[tuple[int, MllamaImage]] = []  # (position, the image's tiles)
        for i, message in enumerate(dialog):
            content: Any = message["content"]  # a str, or the parts of a user message with images
            if isinstance(content, str):
                tokens += self.encode_message(message, tool_prompt_format)
                continue
            # A user message with images (split by llama.formats.content): each part on its own.
            tokens += self.encode_header(message["role"])
            for j, part in enumerate(content):
                if isinstance(part, ImagePart):
                    tiled.append((len(tokens), self._encode_image(part, f"message {i} content part {j}")))
                    tokens.append(MLLAMA_IMAGE_TOKEN_ID)
                else:
                    tokens += tok.encode(part, bos=False, eos=False)
            tokens.append(tok.eot_id)
        ends = attended_until([position for position, _ in tiled])
        images = [MllamaPromptImage(pixel_values=image.pixel_values, grid=image.grid, start=position,
                                    end=position + 1, attended_until=end)
                  for (position, image), end in zip(tiled, ends)]
        return EncodedDialog(tokens + self.encode_header("assistant"), images)

    def _encode_image(self, image: ImagePart, where: str) -> MllamaImage:
        """An image's tiles; errors name ``where``."""
        from llama.images.mllama import preprocess_image  # PIL and torch, only for images

        assert self.image_layout is not None
        try:
            return preprocess_image(image.image, self.image_layout, max_pixels=self.max_image_pixels)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"{where}: {e}") from None

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
        ends: tuple[tuple[str, StopReason], ...] = (("<|eot_id|>", "end_of_turn"), ("<|eom_id|>", "end_of_message"))
        for end, reason in ends:
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
    """CodeLlama-70B-Instruct's turns, as Meta's codellama reference builds them (one line,
    shown on two here; ``␣`` is the space the prompt ends with)::

        <s> Source: system\\n\\n {system}<step> Source: user\\n\\n {user}
        <step> Source: assistant\\nDestination: user\\n\\n␣

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
            dialog = [Message(role="system", content=""), *dialog]
        tokens = [tok.bos_id]
        for message in dialog:
            header = f" Source: {message['role']}"
            if message.get("destination") is not None:
                header += f"\nDestination: {message['destination'].strip()}"
            tokens += tok.encode(header, bos=False, eos=False)
            if message["content"]:
                tokens += tok.encode("\n\n " + message_text(message).strip(), bos=False, eos=False)
            tokens.append(self.step_id)
        tokens += tok.encode(" Source: assistant\nDestination: user", bos=False, eos=False)
        return tokens + tok.encode("\n\n ", bos=False, eos=False)


class Llama4ChatFormat(ChatFormat):
    """``<|begin_of_text|>`` then per message ``<|header_start|>{role}<|header_end|>\n\n{content}<|eot|>``,
    then an open assistant header for the reply (Meta's Llama 4 template).

    Unlike Llama 3's, message text is not stripped.  A tool's output (role ``tool``, or
    ``ipython`` as in Llama 3.1 dialogs) is headed ``ipython`` and ends with ``<|eom|>``,
    as Meta's reference renders it; message text is encoded as text, so a typed
    ``<|eot|>`` stays characters.

    Tools are custom functions, declared in a system message
    (:func:`llama.formats.tool_prompts.apply_llama4_tools`) and called as a pythonic list,
    ``[f(a=1), g(b="x")]``.  An assistant message with ``tool_calls`` is its content, then
    the calls in that form, then ``<|eom|>``, as llama-models encodes it.

    Images (with ``vision``, the model's :class:`~llama.images.prompt.TileLayout`; without it
    the format takes none): a user message's content may hold image parts anywhere among its
    text parts (:mod:`llama.formats.content`; each text part encoded on its own, as Meta's
    reference encodes content items).  Each image is preprocessed
    (:func:`llama.images.preprocess.preprocess_image`, refused over ``max_image_pixels``) and
    written as Meta's ``ChatFormat`` writes it (:meth:`image_tokens`); :meth:`encode_dialog`
    returns its pixel values and the positions of its ``<|patch|>`` tokens with the ids.
    """

    has_tools = True
    tool_prompt_formats = ("python_list",)

    roles = frozenset({"system", "user", "assistant", "ipython", "tool"})
    _next = {
        "start": {"system", "user"},
        "system": {"user"},
        "user": {"assistant"},
        "assistant": {"user", "ipython", "tool"},
        "ipython": {"assistant", "ipython", "tool"},
        "tool": {"assistant", "ipython", "tool"},
    }

    tokenizer: Llama4Tokenizer
    image_layout: Optional[TileLayout]

    def __init__(self, tokenizer: Llama4Tokenizer, vision: Optional[TileLayout] = None, *,
                 max_image_pixels: int = DEFAULT_MAX_PIXELS, max_images: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.image_layout = vision
        self.max_image_pixels = max_image_pixels
        self.max_images = max_images

    def why_no_images(self) -> str:
        return ("this Llama 4 chat format was made without the model's vision layout: its checkpoint has no "
                "vision_args, or it was built without vision")

    def image_tokens(self, grid: tuple[int, int]) -> list[int]:
        """An image's tokens for its tile grid ``(tiles_y, tiles_x)``, as Meta's
        ``ChatFormat._encode_image`` writes them (``P``: ``patches_per_tile`` ``<|patch|>``)::

            one tile:  <|image_start|> <|image|> P <|image_end|>
            a grid:    <|image_start|> (P <|tile_x_separator|> ... P <|tile_y_separator|>) per row
                       <|image|> P <|image_end|>      (the global tile after <|image|>)
        """
        if self.image_layout is None:
            raise ValueError(f"this model takes no images ({self.why_no_images()})")
        special = self.tokenizer.special_tokens
        patches = [special["<|patch|>"]] * self.image_layout.patches_per_tile
        tiles_y, tiles_x = grid
        tokens = [special["<|image_start|>"]]
        if tiles_y * tiles_x > 1:
            for _ in range(tiles_y):
                for x in range(tiles_x):
                    tokens += patches
                    if x < tiles_x - 1:
                        tokens.append(special["<|tile_x_separator|>"])
                tokens.append(special["<|tile_y_separator|>"])
        return tokens + [special["<|image|>"]] + patches + [special["<|image_end|>"]]

    def _encode_image(self, image: ImagePart, offset: int, where: str) -> tuple[list[int], PromptImage]:
        """An image's tokens and what the prompt carries for it, its tokens starting at ``offset``."""
        from llama.images.preprocess import preprocess_image  # PIL and torch, only for images

        assert self.image_layout is not None
        layout = self.image_layout
        try:
            pre = preprocess_image(image.image, max_pixels=self.max_image_pixels, tile_size=layout.image_size,
                                   max_num_chunks=layout.max_num_chunks)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"{where}: {e}") from None
        tokens = self.image_tokens(pre.grid)
        patch_id = self.tokenizer.special_tokens["<|patch|>"]
        positions = tuple(offset + k for k, t in enumerate(tokens) if t == patch_id)
        assert len(positions) == pre.n_tiles * layout.patches_per_tile
        return tokens, PromptImage(pixel_values=pre.pixel_values, grid=pre.grid, start=offset,
                                   end=offset + len(tokens), patch_positions=positions)

    def validate(self, dialog: Sequence[Message]) -> None:
        self._check_messages(dialog)
        for i, msg in enumerate(dialog):
            if msg.get("tool_calls") is not None:
                if msg["role"] != "assistant":
                    raise ValueError(f"message {i} has tool_calls, which only an assistant message may have")
                check_tool_calls(msg["tool_calls"], where=f"message {i} tool_calls")
        self._check_order(dialog, self._next, {"user", "ipython", "tool"})

    def _declare_tools(self, dialog, tools, tool_prompt_format, today) -> list:
        return apply_llama4_tools(dialog, tools)

    def encode_header(self, role: str) -> list[int]:
        tok = self.tokenizer
        header = "ipython" if role == "tool" else role
        return [tok.header_start_id] + tok.encode(header, bos=False, eos=False) + [tok.header_end_id] + tok.encode(
            "\n\n", bos=False, eos=False
        )

    def encode_message(self, message: Message) -> list[int]:
        tok = self.tokenizer
        calls = check_tool_calls(message.get("tool_calls") or []) if message["role"] == "assistant" else []
        tokens = self.encode_header(message["role"]) + tok.encode(message_text(message), bos=False, eos=False)
        for text in format_tool_calls(calls, "python_list"):
            tokens += tok.encode(text, bos=False, eos=False)
        end_of_message = message["role"] in ("tool", "ipython") or bool(calls) or (
            message["role"] == "assistant" and message.get("stop_reason") == "end_of_message")
        return tokens + [tok.eom_id if end_of_message else tok.eot_id]

    def reply_message(self, tokens: Sequence[int], stop_reason: StopReason, *, text: Optional[str] = None,
                      tools: Collection[str] = ()) -> Message:
        text = self.tokenizer.decode(list(tokens)) if text is None else text
        plain: Message = {"role": "assistant", "content": text, "stop_reason": stop_reason, "tool_calls": []}
        if stop_reason == "out_of_tokens" or not tools:
            return plain
        content, calls = parse_tool_calls(text)
        if not calls or any(call["tool_name"] not in tools for call in calls):
            return plain
        return {"role": "assistant", "content": content, "stop_reason": stop_reason, "tool_calls": calls}

    def _stop_reasons(self) -> dict[int, StopReason]:
        tok = self.tokenizer
        return {tok.eos_id: "end_of_turn", tok.eot_id: "end_of_turn", tok.eom_id: "end_of_message"}

    def _encode_dialog(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat) -> list[int]:
        return self._encode_dialog_with_images(dialog, tool_prompt_format).tokens

    def _encode_dialog_with_images(self, dialog: Sequence[Message], tool_prompt_format: ToolPromptFormat
                                   ) -> EncodedDialog:
        tok = self.tokenizer
        tokens = [tok.bos_id]
        images: list[PromptImage] = []
        for i, message in enumerate(dialog):
            content: Any = message["content"]  # a str, or the parts of a user message with images
            if isinstance(content, str):
                tokens += self.encode_message(message)
                continue
            # A user message with images (split by llama.formats.content): each part on its own.
            tokens += self.encode_header(message["role"])
            for j, part in enumerate(content):
                if isinstance(part, ImagePart):
                    image_tokens, image = self._encode_image(part, len(tokens), f"message {i} content part {j}")
                    tokens += image_tokens
                    images.append(image)
                else:
                    tokens += tok.encode(part, bos=False, eos=False)
            tokens.append(tok.eot_id)
        return EncodedDialog(tokens + self.encode_header("assistant"), images)


CHAT_FORMATS = ("llama2", "llama3", "llama4", "codellama-70b-instruct")


def chat_format_for(tokenizer: Tokenizer, name: Optional[str] = None, *,
                    vision: Optional[ImageLayout] = None) -> ChatFormat:
    """The chat format for a tokenizer: by default the one its family uses (Llama 3's for
    a tiktoken tokenizer, Llama 2's for SentencePiece); ``name`` picks one explicitly
    (one of :data:`CHAT_FORMATS`), which CodeLlama-70B-Instruct needs.  ``vision``: the
    model's image layout when it takes images (:func:`llama.images.prompt.image_layout`): a
    :class:`~llama.images.prompt.TileLayout` for Llama 4 (with a Llama 4 tokenizer), an
    :class:`~llama.images.prompt.MllamaLayout` for Llama 3.2 Vision (with a Llama 3 tokenizer);
    without it images are refused."""
    llama3 = isinstance(tokenizer, TiktokenTokenizer) and not isinstance(tokenizer, Llama4Tokenizer)
    tiles = vision if isinstance(vision, TileLayout) else None
    mllama = vision if isinstance(vision, MllamaLayout) else None
    if vision is not None and tiles is None and mllama is None:
        raise TypeError(f"vision must be a TileLayout (Llama 4) or an MllamaLayout (Llama 3.2 Vision), got "
                        f"{type(vision).__name__}")
    if tiles is not None and not isinstance(tokenizer, Llama4Tokenizer):
        raise ValueError(f"image input is for Llama 4 models with this layout (a TileLayout); a "
                         f"{type(tokenizer).__name__} model takes none of it (Llama 3.2 Vision's is an MllamaLayout)")
    if mllama is not None and not llama3:
        raise ValueError(f"a Llama 3.2 Vision layout (MllamaLayout) needs a Llama 3 tokenizer.model, not a "
                         f"{type(tokenizer).__name__}: use the tokenizer that came with the checkpoint")
    if name is None:
        if isinstance(tokenizer, Llama4Tokenizer):
            return Llama4ChatFormat(tokenizer, tiles)
        if isinstance(tokenizer, TiktokenTokenizer):
            return Llama3ChatFormat(tokenizer, mllama)
        if isinstance(tokenizer, SentencePieceTokenizer):
            return Llama2ChatFormat(tokenizer)
        raise TypeError(f"no chat format is known for {type(tokenizer).__name__}")
    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r}; choose one of {CHAT_FORMATS}")
    if name == "llama4":
        if not isinstance(tokenizer, Llama4Tokenizer):
            raise ValueError("the llama4 chat format needs a Llama 4 tokenizer.model")
        return Llama4ChatFormat(tokenizer, tiles)
    if name == "llama3":
        if not isinstance(tokenizer, TiktokenTokenizer) or isinstance(tokenizer, Llama4Tokenizer):
            raise ValueError("the llama3 chat format needs a Llama 3 (tiktoken) tokenizer.model")
        return Llama3ChatFormat(tokenizer, mllama)
    if not isinstance(tokenizer, SentencePieceTokenizer):
        raise ValueError(f"the {name} chat format needs a SentencePiece (Llama 2 / Code Llama) tokenizer.model")
    if name == "llama2":
        return Llama2ChatFormat(tokenizer)
    return CodeLlama70bInstructChatFormat(tokenizer)
