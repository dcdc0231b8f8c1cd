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

import bisect
import weakref
from typing import Optional, Sequence

from llama.runtime.options import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from llama.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what decoders produce for incomplete UTF-8

# The text of each token decoded alone, by tokenizer: the window before a pushed token is most
# often the one token pushed before it, decoded again at every push (a tokenizer's decoding
# of a given list of ids never changes; at most one entry per token of its vocabulary)
_ONE_TOKEN_TEXT: "weakref.WeakKeyDictionary[Tokenizer, dict[int, str]]" = weakref.WeakKeyDictionary()


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """``tokenizer.decode(ids)``, a single token's text remembered."""
    if len(ids) != 1:
        return tokenizer.decode(ids)
    texts = _ONE_TOKEN_TEXT.get(tokenizer)
    if texts is None:
        texts = _ONE_TOKEN_TEXT[tokenizer] = {}
    text = texts.get(ids[0])
    if text is None:
        text = texts[ids[0]] = tokenizer.decode(ids)
    return text


def check_stop_strings(stop: Optional[Sequence[str]]) -> tuple[str, ...]:
    """``stop`` (None, a string or a list of them) as a tuple; TypeError/ValueError unless it
    holds at most :data:`MAX_STOP_STRINGS` non-empty strings of at most
    :data:`MAX_STOP_STRING_CHARS` characters."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must not be empty")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise ValueError(f"a stop string has {len(longest)} characters; at most {MAX_STOP_STRING_CHARS} are allowed")
    return tuple(stop)


class TextAssembler:
    """Accumulates one sequence's generated tokens and releases its text safely.

    ``push(token)`` returns the text that became final (possibly ""); ``stopped``
    turns true once a stop string appears, after which the text is cut before it.
    ``finish()`` returns whatever was held back (an incomplete character at the very
    end stays as the decoder renders it).

    ``context``: tokens that come before (the prompt's last few): the text is then what the
    tokens add after them, as decoding them together gives it.  SentencePiece drops the
    leading space of a text's first word, so without context a completion of "ROMEO: I am"
    reads "not", with it " not" (what the prompt's text needs to be followed by).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._n_context = len(context)
        self._context_text = tokenizer.decode(list(context)) if context else ""
        self.ids: list[int] = list(context)  # the context, then the tokens pushed
        self._prefix_offset = 0  # window start: decoding from here gives the right spacing
        self._read_offset = len(self.ids)  # tokens before this are already turned into text
        self._decoded = ""  # all text decoded from ids[:read_offset]
        self._released = 0  # characters of _decoded handed out
        self._ends: list[int] = []  # where each pushed token's text ends in _decoded (once decoded)
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
        window_before = _decode(self.tokenizer, self.ids[self._prefix_offset : self._read_offset])
        window_now = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if window_now.endswith(REPLACEMENT_CHAR) or not window_now.startswith(window_before):
            return ""  # mid-character: wait for the rest of its bytes
        start = len(self._decoded) - len(window_before)  # where the window's text starts in _decoded
        self._decoded += window_now[len(window_before) :]
        # Tokens this window decoded at once (the bytes of one character, or an invalid byte
        # and what followed it): each ends where its own prefix of the window does when that
        # prefix is final text (an invalid byte's replacement character stays), else with
        # the window (a character's first bytes).
        for j in range(self._read_offset, len(self.ids) - 1):
            partial = self.tokenizer.decode(self.ids[self._prefix_offset : j + 1])
            self._ends.append(start + len(partial) if window_now.startswith(partial) else len(self._decoded))
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self._mark_ends()
        return self._release()

    def _mark_ends(self) -> None:
        """Tokens decoded up to here end where the text does."""
        self._ends += [len(self._decoded)] * (self._read_offset - self._n_context - len(self._ends))

    @property
    def n_final(self) -> int:
        """How many pushed tokens have all their text handed out: those a client may be told
        about (a token in a stop string, or still held back, is not).  Never more than
        :meth:`tokens_before_stop` will keep: the bytes of an invalid character count as
        ending where the text goes on."""
        return bisect.bisect_right(self._ends, self._released)

    def token_start(self, k: int) -> int:
        """Where pushed token ``k``'s text starts in :attr:`text` (``k`` < :attr:`n_final`)."""
        if k == 0:
            return 0
        return min(self._ends[k - 1] if k - 1 < len(self._ends) else len(self._decoded), len(self.text))

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
            full = self._text_of(len(self.ids))
            if full.startswith(self._decoded):
                self._decoded = full
            self._read_offset = len(self.ids)
            self._mark_ends()
        if self.stopped:
            return ""
        return self._release(final=True)

    def tokens_before_stop(self) -> int:
        """How many of the tokens lie wholly before the stop string (all of them if none)."""
        if self._stop_at is None:
            return len(self.ids) - self._n_context
        cut = self.text
        n = len(self.ids)
        while n > self._n_context and not cut.startswith(self._text_of(n)):
            n -= 1
        return n - self._n_context

    def _text_of(self, n: int) -> str:
        """The text of ``ids[:n]`` after the context (decoded together with it)."""
        full = self.tokenizer.decode(self.ids[:n])
        if not self._n_context:
            return full
        return full[len(self._context_text):] if full.startswith(self._context_text) else \
            self.tokenizer.decode(self.ids[self._n_context : n])


def prompt_text(tokenizer: Tokenizer, prompt: Sequence[int]) -> str:
    """A prompt's text as an echo shows it: decoded, without a leading BOS.  A completion
    generated with ``RequestSettings.text_follows_prompt`` continues it exactly (with the
    space at the seam that SentencePiece drops from a text's first word)."""
    return tokenizer.decode(_without_bos(tokenizer, prompt))


def reference_echo_text(tokenizer: Tokenizer, prompt: Sequence[int]) -> str:
    """A prompt's text as Meta's reference ``text_completion(echo=True)`` gives it: every
    token decoded, a leading BOS included (``<|begin_of_text|>`` with Llama 3's and 4's
    tiktoken tokenizers; SentencePiece decodes BOS to nothing, so Llama 2's is
    :func:`prompt_text`).  OpenAI's echo (the server's) is :func:`prompt_text`."""
    bos = list(prompt[:1]) if list(prompt[:1]) == [getattr(tokenizer, "bos_id", None)] else []
    return tokenizer.decode(bos) + prompt_text(tokenizer, prompt)


def prompt_text_offsets(tokenizer: Tokenizer, prompt: Sequence[int]) -> list[int]:
    """Where each prompt token's text starts in :func:`prompt_text` (a leading BOS at 0)."""
    ids = _without_bos(tokenizer, prompt)
    assembler = TextAssembler(tokenizer)
    for token in ids:
        assembler.push(token)
    assembler.finish()
    offsets = [assembler.token_start(k) for k in range(len(ids))]
    return [0] * (len(prompt) - len(ids)) + offsets


def _without_bos(tokenizer: Tokenizer, prompt: Sequence[int]) -> list[int]:
    prompt = list(prompt)
    return prompt[1:] if prompt and prompt[0] == getattr(tokenizer, "bos_id", None) else prompt
