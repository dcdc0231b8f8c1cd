"""What the demo model's training and evaluation share: the corpus, the held-out play,
how text is cut into chunks that start at a line, and the corpus-word measure.

The corpus is ``../shared/corpus/shakespeare/*.txt`` beside the repository (41 works,
public domain); set ``LLAMA_CORPUS_DIR`` to the ``corpus`` folder to read it from
elsewhere (e.g. from a git worktree, whose ``..`` is not the main checkout's).

One play, :data:`HELD_OUT`, is kept out of everything the model learns from (the
tokenizer included) and is only ever scored.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
CORPUS_ROOT = Path(os.environ.get("LLAMA_CORPUS_DIR", REPO.parent / "shared" / "corpus"))
DEFAULT_CORPUS = CORPUS_ROOT / "shakespeare"
HELD_OUT = "macbeth"  # file stem of the play kept out of training

# A word: lowercase letters, optionally joined by apostrophes ("o'er", "lord's").
# Leading/trailing apostrophes ("'tis", quotes) are not part of the word.
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def corpus_files(corpus_dir: Path | str = DEFAULT_CORPUS) -> list[Path]:
    """Every work of the corpus, sorted by name; ``FileNotFoundError`` if there is none."""
    corpus_dir = Path(corpus_dir)
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files in {corpus_dir}: the Shakespeare corpus lives in ../shared/corpus")
    return files


def split_corpus(corpus_dir: Path | str = DEFAULT_CORPUS, held_out: str = HELD_OUT) -> tuple[list[Path], Path]:
    """(training files, held-out file)."""
    files = corpus_files(corpus_dir)
    held = [f for f in files if f.stem == held_out]
    if not held:
        raise ValueError(f"held-out play {held_out!r} is not in {corpus_dir} (stems: {[f.stem for f in files]})")
    return [f for f in files if f.stem != held_out], held[0]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def line_units(text: str) -> list[str]:
    """``text`` cut before every line that is not blank: each piece is one line with
    the blank lines after it, so a chunk made of whole pieces never starts blank.
    The pieces concatenate back to ``text``."""
    units: list[str] = []
    for line in text.splitlines(keepends=True):
        if units and not line.strip():
            units[-1] += line
        else:
            units.append(line)
    return units


def unit_starts(text: str) -> list[int]:
    """Character offsets where the pieces of :func:`line_units` begin."""
    starts, pos = [], 0
    for unit in line_units(text):
        starts.append(pos)
        pos += len(unit)
    return starts


def chunk_text(text: str, tokenizer, max_tokens: int) -> list[str]:
    """Cut ``text`` into consecutive chunks of whole lines, each encoding to at most
    ``max_tokens`` tokens (BOS not counted).  The chunks concatenate back to ``text``,
    and each decodes back to itself (checked), so its characters are exactly ``len(chunk)``.
    """
    chunks: list[str] = []
    current = ""
    for unit in line_units(text):
        candidate = current + unit
        if current and len(tokenizer.encode(candidate, bos=False, eos=False)) > max_tokens:
            chunks.append(current)
            candidate = unit
        if len(tokenizer.encode(candidate, bos=False, eos=False)) > max_tokens:
            raise ValueError(f"a single line encodes to more than {max_tokens} tokens: {unit[:60]!r}...")
        current = candidate
    if current:
        chunks.append(current)
    assert "".join(chunks) == text
    for chunk in chunks:
        if tokenizer.decode(tokenizer.encode(chunk, bos=False, eos=False)) != chunk:
            raise ValueError(f"the tokenizer does not round-trip this chunk: {chunk[:60]!r}...")
    return chunks


def bits_per_char(llama, chunks: Sequence[str], batch_size: int) -> dict:
    """Score ``chunks`` through ``Llama.text_completion(echo=True, logprobs=True, max_gen_len=0)``.

    Every token after the BOS is scored given the tokens before it *in its own chunk*
    (no context crosses a chunk boundary).  The first token's log-probability (BOS,
    reported as 0.0) is skipped.  Returns a dict with the summed negative log-likelihood
    in nats, the counts of tokens and characters, and bits per character.
    """
    nll, n_tokens, n_chars = 0.0, 0, 0
    for start in range(0, len(chunks), batch_size):
        batch = list(chunks[start : start + batch_size])
        results = llama.text_completion(batch, max_gen_len=0, logprobs=True, echo=True)
        for chunk, result in zip(batch, results):
            logprobs = result["logprobs"]
            if logprobs[0] != 0.0:
                raise RuntimeError("expected the echoed BOS to carry log-probability 0.0")
            nll -= math.fsum(logprobs[1:])
            n_tokens += len(logprobs) - 1
            n_chars += len(chunk)
    return {
        "chunks": len(chunks),
        "tokens": n_tokens,
        "chars": n_chars,
        "nll_nats": nll,
        "bits_per_char": nll / n_chars / math.log(2),
        "bits_per_token": nll / n_tokens / math.log(2),
    }


def words(text: str) -> list[str]:
    """Lowercase alphabetic words of ``text`` (apostrophes inside a word kept)."""
    return _WORD.findall(text.lower())


def corpus_vocabulary(files: Iterable[Path]) -> set[str]:
    return {w for f in files for w in words(read_text(f))}


def corpus_word_fraction(texts: Iterable[str], vocabulary: set[str]) -> tuple[float, int]:
    """(fraction of the words of ``texts`` found in ``vocabulary``, number of words)."""
    found = total = 0
    for text in texts:
        for w in words(text):
            total += 1
            found += w in vocabulary
    return (found / total if total else 0.0), total


# Prompts for sampled generations (corpus-word measure, model card sample).
SAMPLE_PROMPTS = [
    "ROMEO.\n",
    "KING.\nMy lords,",
    "FIRST CITIZEN.\nWhat say you",
    "HAMLET.\nTo be, or not to be,",
    "LADY.\nO gentle",
    "CLOWN.\nMarry, sir,",
    "[Enter a Messenger.]\n\nMESSENGER.\n",
    "Shall I compare thee",
]
