"""A conversation kept across turns and trimmed to fit the model's context."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Sequence

from llama.formats.chat import Dialog, Message

logger = logging.getLogger(__name__)


class ChatSession:
    """Holds the dialog of an ongoing chat with a :class:`~llama.generation.Llama`.

    Each :meth:`ask` renders system prompt + history + the new user message; when that
    leaves less than ``reply_room`` tokens of ``max_seq_len`` for the answer, the oldest
    exchanges are dropped (``trimmed`` says how many).  On several ranks every rank
    keeps its own session and must be given the same messages in the same order.
    """

    def __init__(self, llama, system_prompt: Optional[str] = None, reply_room: Optional[int] = None) -> None:
        self.llama = llama
        self.system_prompt = system_prompt
        self.reply_room = reply_room if reply_room is not None else max(1, llama.max_seq_len // 4)
        if not 0 < self.reply_room < llama.max_seq_len:
            raise ValueError(f"reply_room must be in [1, {llama.max_seq_len - 1}], got {self.reply_room}")
        self.history: list[Message] = []  # user and assistant messages, in order
        self.trimmed = 0  # exchanges dropped to make the last question fit
        self.last_finish_reason: Optional[str] = None  # "stop" or "length" (cut at reply_room) for the last answer

    def reset(self) -> None:
        self.history = []

    def _dialog(self, history: list[Message], user_message: Message) -> Dialog:
        system = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        return system + history + [user_message]

    @staticmethod
    def _user_message(user_text: str, images: Sequence[Any] = ()) -> Message:
        """The user's message: its text, or its images (as image parts) and then its text."""
        if not images:
            return Message(role="user", content=user_text)
        parts: list = [{"type": "image", "image": image} for image in images]
        return Message(role="user", content=parts + [{"type": "text", "text": user_text}])

    def _fit(self, user_text: str, images: Sequence[Any] = ()) -> Dialog:
        """The longest recent history that leaves ``reply_room`` tokens for the answer (an
        image counts its tokens: tiles x patches, separators and markers)."""
        budget = self.llama.max_seq_len - self.reply_room
        history = list(self.history)
        user_message = self._user_message(user_text, images)
        dropped = 0
        while True:
            dialog = self._dialog(history, user_message)
            n_tokens = len(self.llama.formatter.encode_dialog(dialog).tokens)
            if n_tokens <= budget:
                break
            if not history:
                raise ValueError(
                    f"this message needs {n_tokens} tokens with the system prompt, but only {budget} of "
                    f"max_seq_len={self.llama.max_seq_len} are left after {self.reply_room} for the reply: shorten it"
                )
            history = history[2:]  # the oldest user message and its answer
            dropped += 1
        if dropped:
            logger.info("dropped the %d oldest exchange(s) to fit max_seq_len=%d", dropped, self.llama.max_seq_len)
        self.history = history
        self.trimmed = dropped
        return dialog

    def ask(self, user_text: str, images: Sequence[Any] = (), **sampling) -> Iterator[str]:
        """Stream the assistant's answer to ``user_text``; it joins the history when the
        stream is exhausted.  Closing the returned generator early cancels the answer
        (``last_finish_reason`` becomes ``"cancelled"``, the history is left as it was).

        ``images`` (``PIL.Image``, bytes or paths) go before the text in the user message, as
        image parts, and stay in the history with it; a model that takes no images refuses them
        (``ValueError``).  ``sampling``: temperature, top_p, top_k, seed, stop."""
        if not isinstance(user_text, str):
            raise TypeError(f"the message must be a str, got {type(user_text).__name__}")
        dialog = self._fit(user_text, images)
        max_gen_len = min(self.reply_room, self.llama.max_seq_len - 1)
        stream = self.llama.chat_completion_stream(dialog, max_gen_len=max_gen_len, **sampling)

        def answer() -> Iterator[str]:
            pieces = []
            try:
                for piece in stream:
                    pieces.append(piece)
                    yield piece
            except GeneratorExit:  # the caller stopped the answer (answer.close()): cancel it
                stream.close()
                self.last_finish_reason = "cancelled"
                raise
            self.last_finish_reason = stream.result.finish_reason if stream.result else None
            if self.last_finish_reason == "cancelled":  # another rank stopped it: keep nothing
                return
            reply = "".join(pieces)
            for tag in self.llama.formatter.special_tags:  # a reply may not pose as template
                reply = reply.replace(tag, "")
            self.history += [dialog[-1], {"role": "assistant", "content": reply}]

        return answer()
