"""What the demo model's training and evaluation share: the corpus, the held-out play,
how text is cut into chunks that start at a line, the dialog pairs the chat
fine-tuning draws from the plays, and the corpus-word measure.

The corpus is not shipped: set ``LLAMA_CORPUS_DIR`` to a folder whose ``shakespeare/``
subfolder holds the works as ``.txt`` files (41 public-domain works, ``macbeth.txt`` among
them; demo/MODEL_CARD.md says where they came from).  Without it, ``shared/corpus`` beside
the repository is tried (where the demo was built).

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
        raise FileNotFoundError(f"no *.txt files in {corpus_dir}: set LLAMA_CORPUS_DIR to a folder whose shakespeare/ "
                                "subfolder holds the works as .txt files (see demo/MODEL_CARD.md, Data)")
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


# -- dialogs --------------------------------------------------------------------------------

# A speaker's name on a line of its own, before the speech: "Ber." / "HAMLET." (most
# plays) or "THESEUS" (A Midsummer Night's Dream, capitals and no full stop).
_SPEAKER = re.compile(r"^(?:[A-Z][A-Za-z'\- ]{0,30}[A-Za-z]\.|[A-Z][A-Z'\- ]{1,30}[A-Z])$")
# Headings that look like a speaker's name but begin a new scene.
_HEADING = re.compile(r"^(?:ACT|Act|SCENE|Scene|PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|Induction)\b")
_STAGE_DIRECTION = re.compile(r"^\[.*\]$")


def scenes(text: str) -> list[list[tuple[str, str]]]:
    """The play ``text`` as scenes, each a list of speeches ``(speaker, words)`` in order.

    A speech is a block of lines (between blank lines) whose first line is a speaker's
    name and which has at least one more line.  Stage directions on lines of their own
    are dropped from the words; indentation is removed; line breaks (verse) are kept.
    A scene or act heading starts a new scene.  Works that are not plays (the sonnets,
    the poems) have no speeches.
    """
    result: list[list[tuple[str, str]]] = [[]]
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in block.strip("\n").split("\n")]
        if not lines or not lines[0]:
            continue
        if _HEADING.match(lines[0]):
            if result[-1]:
                result.append([])
            continue
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        words = "\n".join(line for line in lines[1:] if line and not _STAGE_DIRECTION.match(line))
        if words:
            result[-1].append((lines[0].rstrip("."), words))
    return [scene for scene in result if len(scene) >= 2]


def dialog_turns(text: str) -> list[list[str]]:
    """Runs of consecutive speeches, each run alternating between speakers (a speaker
    who speaks twice in a row, after a stage direction, ends the run).  A chat dialog
    takes a run's speeches as user, assistant, user, assistant, ..."""
    runs: list[list[str]] = []
    for scene in scenes(text):
        run = [scene[0][1]]
        for (prev_speaker, _), (speaker, words) in zip(scene, scene[1:]):
            if speaker == prev_speaker:
                if len(run) >= 2:
                    runs.append(run)
                run = [words]
            else:
                run.append(words)
        if len(run) >= 2:
            runs.append(run)
    return runs


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
