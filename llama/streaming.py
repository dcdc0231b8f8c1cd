"""Turning tokens into text as they arrive: incremental detokenisation and stop strings.

A token can end in the middle of a UTF-8 character (byte-level BPE, SentencePiece
byte fallback), and SentencePiece decides a word's leading space from its
neighbours, so text cannot be produced token by token.  :class:`TextAssembler`
decodes a small window of recent tokens, holds back text that may still change (an
incomplete character, or the start of a stop string), and guarantees that the pieces
it hands out concatenate to exactly the text a full decode gives (cut at the first
stop string).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what decoders produce for incomplete UTF-8


def check_stop_strings(stop: Optional[Sequence[str]]) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a list of strings")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must not be empty")
    return tuple(stop)


class TextAssembler:
    """Accumulates one sequence's generated tokens and releases its text safely.

    ``push(token)`` returns the text that became final (possibly ""); ``stopped``
    turns true once a stop string appears, after which the text is cut before it.
    ``finish()`` returns whatever was held back (an incomplete character at the very
    end stays as the decoder renders it).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: decoding from here gives the right spacing
        self._read_offset = 0  # tokens before this are already turned into text
        self._decoded = ""  # all text decoded from ids[:read_offset]
        self._released = 0  # characters of _decoded handed out
        self.stopped = False
        self._stop_at: Optional[int] = None

    @property
    def text(self) -> str:
        """All text so far (cut at a stop string), released or not."""
        return self._decoded if self._stop_at is None else self._decoded[: self._stop_at]

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        window_before = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        window_now = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if window_now.endswith(REPLACEMENT_CHAR) or not window_now.startswith(window_before):
            return ""  # mid-character: wait for the rest of its bytes
        self._decoded += window_now[len(window_before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._release()

    def _release(self, final: bool = False) -> str:
        text = self._decoded
        if self.stop:
            search_from = max(0, self._released - max(len(s) for s in self.stop))
            hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                self._stop_at = min(hits)
                text = text[: self._stop_at]
            elif not final:
                # Hold back a tail that could still grow into a stop string.
                text = text[: len(text) - self._stop_prefix_len(text)]
        piece = text[self._released :]
        self._released = max(self._released, len(text))
        return piece

    def _stop_prefix_len(self, text: str) -> int:
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def finish(self) -> str:
        """Release everything left: text held for a possible stop string, and the
        tail of an incomplete character."""
        if not self.stopped and self._read_offset < len(self.ids):
            full = self.tokenizer.decode(self.ids)
            if full.startswith(self._decoded):
                self._decoded = full
            self._read_offset = len(self.ids)
        if self.stopped:
            return ""
        return self._release(final=True)

    def tokens_before_stop(self) -> int:
        """How many of the tokens lie wholly before the stop string (all of them if none)."""
        if self._stop_at is None:
            return len(self.ids)
        cut = self.text
        n = len(self.ids)
        while n > 0 and not cut.startswith(self.tokenizer.decode(self.ids[:n])):
            n -= 1
        return n
