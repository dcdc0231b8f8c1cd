"""A grammar compiler in a process of its own, run as a script by
:mod:`llama.structured.compiler` (``python compile_worker.py``): it imports llguidance and
the standard library only (not torch, not ``llama``), so that it starts in a fraction of a
second, and it can be killed.

It speaks length-prefixed pickles on its standard input and output (:func:`write_frame`,
:func:`read_frame`):

* first the vocabulary (:func:`lltokenizer`'s ``spec``), answered with ``"ready"``;
* then, any number of times, ``(source, limits)``: a grammar in llguidance's JSON form and
  the keyword arguments of its ``LLParserLimits``, answered with the seconds the compile
  took.  It compiles as :func:`llama.structured.response_format.compile_grammar` does in
  the server (validate, build a matcher, compute its first mask, where most of the work is)
  and says nothing of the outcome: an error is found again, quickly, where the grammar is
  compiled for use.

A grammar that takes too long is the parent's to stop (it kills this process); one that
crashes llguidance ends this process, not the parent.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from typing import IO, Any, Optional

# The trial runs on a thread with this stack: smaller than a compiling thread's in the
# parent (the Linux default for a thread and a main thread: 8 MiB), so that a grammar
# whose recursion fits here fits there.
TRIAL_STACK_BYTES = 6 * 1024 * 1024

_LENGTH = struct.Struct(">Q")


def write_frame(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Optional[Any]:
    """The next object, or None at the end of the stream (the other side is gone)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


class _Vocabulary:
    """A SentencePiece vocabulary as ``llguidance.LLTokenizer`` reads it (the attributes of its
    ``TokenizerWrapper``), from its token bytes."""

    is_tokenizer_wrapper = True

    def __init__(self, spec: dict) -> None:
        self.tokens = spec["tokens"]
        self.special_token_ids = spec["special_token_ids"]
        self.eos_token_id = spec["eos_token_id"]
        self.bos_token_id = spec["bos_token_id"]
        self._byte_ids = {t[0]: i for i, t in enumerate(self.tokens)
                          if len(t) == 1 and i not in set(self.special_token_ids)}

    def __call__(self, text: str) -> list[int]:
        # Only asked for forced tokens, which a compile and a mask never are: one id per byte.
        return [self._byte_ids.get(b, 0) for b in text.encode("utf-8")]


def lltokenizer(spec: dict):
    """The ``llguidance.LLTokenizer`` that ``spec`` describes (made by
    :meth:`llama.structured.GrammarTokenizer.worker_spec`): the same vocabulary, so the
    same work per grammar."""
    import llguidance

    if spec["kind"] == "tiktoken":
        return llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]  # missing from its stubs
            encoder=spec["ranks"], special_tokens=spec["special_tokens"], pattern=spec["pattern"],
            eos_token=spec["eos"], n_vocab=spec["n_vocab"], slices=None)
    # _Vocabulary is the duck-typed tokenizer llguidance reads (its stubs name only its own wrapper)
    return llguidance.LLTokenizer(_Vocabulary(spec), eos_token=spec["eos"])  # type: ignore[arg-type]


def trial(ll, source: str, limits: dict) -> float:
    """Compile ``source`` as the parent will; the seconds it took."""
    import llguidance

    start = time.perf_counter()
    parser_limits = llguidance.LLParserLimits(**limits)
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(source, ll, limits=parser_limits)
    if not is_error:
        matcher = llguidance.LLMatcher(ll, source, log_level=0, limits=parser_limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
    return time.perf_counter() - start


def _exit_with(parent: int) -> None:
    """End this process once its parent is gone, even in the middle of a trial (the parent
    kills it otherwise; a parent killed itself cannot)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # the protocol owns the real standard output
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    spec = read_frame(stdin)
    if spec is None:
        return
    ll = lltokenizer(spec)
    write_frame(stdout, "ready")
    threading.stack_size(TRIAL_STACK_BYTES)
    while (job := read_frame(stdin)) is not None:
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(trial(ll, *job)), name="trial")
        thread.start()
        thread.join()
        if not outcome:  # the trial raised (its traceback is on standard error)
            os._exit(3)
        write_frame(stdout, outcome[0])


if __name__ == "__main__":
    main()
