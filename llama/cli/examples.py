"""What the example scripts share: their command line, the bundled demo model, logging
per rank, and ending with one clear line instead of a traceback (the interactive chat's
input is :mod:`llama.cli.terminal`).

Nothing here imports torch: ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional

from llama.checkpoint.layout import checkpoint_layout, find_tokenizer
from llama.cli.flags import (
    COMPILE_WHERE_IT_PAYS,
    Parser,
    add_flag,
    add_model_flags,
    device_name,
    fail,
    non_negative_number,
    positive_int,
    probability,
    process_rank,
)
from llama.tokenizer import check_tokenizer_file

# The bundled demo model (demo/) was trained on 256-token rows: the scripts' defaults
# when it runs, so nothing is generated at positions it never saw.
DEMO_DIR = Path(__file__).resolve().parents[2] / "demo"
DEMO_MAX_SEQ_LEN = 256


def is_first_rank() -> bool:
    return process_rank() == 0


class StreamedOutput:
    """The first rank's standard output as the examples write it (:meth:`say`), and the log
    lines that wait for it: a record logged while an answer's line is still being streamed
    is held until that line ends, so that no log line lands inside an answer."""

    def __init__(self) -> None:
        self.line_open = False
        self.held: list[str] = []

    def say(self, text: str = "", end: str = "\n") -> None:
        text += end
        sys.stdout.write(text)
        sys.stdout.flush()
        if text:
            self.line_open = not text.endswith("\n")
        if not self.line_open:
            self.release()

    def release(self) -> None:
        held, self.held = self.held, []
        for line in held:
            sys.stderr.write(line)
        sys.stderr.flush()


OUTPUT = StreamedOutput()


class _LineAwareHandler(logging.StreamHandler):
    """Log lines on standard error, held while :data:`OUTPUT` streams a line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:  # as logging's own handlers: a bad record is reported, not raised
            self.handleError(record)
            return
        if OUTPUT.line_open:
            OUTPUT.held.append(line)
            return
        try:
            self.stream.write(line)
            self.flush()
        except Exception:  # a closed stream: reported as logging's own handlers do, never raised
            self.handleError(record)


def setup_logging(verbose: bool = True) -> None:
    """Log lines on standard error: INFO on the first rank (``verbose``; else warnings only,
    as on the other ranks).  A line logged while an answer streams waits for its end."""
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig: a process that has configured logging keeps its handlers
        handler = _LineAwareHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose and is_first_rank() else logging.WARNING)


def say(*args, end: str = "\n") -> None:
    """Print on the first rank only (as :func:`print`, flushed), through :data:`OUTPUT`."""
    if is_first_rank():
        OUTPUT.say(" ".join(map(str, args)), end=end)


def check_device(device: Optional[str]) -> None:
    """``--device cuda`` (or ``cuda:N``) refused before the model loads where this machine has
    no such CUDA device, in the flag's words (RuntimeError)."""
    if not device or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: no CUDA device here (torch.cuda.is_available() is False); "
                           "use --device cpu or leave --device out")
    index = device.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise RuntimeError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                           f"numbered from 0")


def example_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags both examples take: the reference's, plus ``--device`` and ``--seed``.
    Length defaults are None here and resolved by :func:`resolve_lengths`."""
    parser = Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(parser, "ckpt_dir", metavar="DIR",
             help="checkpoint directory: Meta's params.json + consolidated.NN.pth, or a Hugging Face folder "
                  "(config.json + *.safetensors) (default: the bundled demo model)")
    add_flag(parser, "tokenizer_path", metavar="FILE",
             help="the model's tokenizer.model or tokenizer.json (default: the one in the checkpoint)")
    add_flag(parser, "temperature", type=non_negative_number, default=0.6, metavar="T",
             help="sampling temperature, 0 for greedy (default: %(default)s)")
    add_flag(parser, "top_p", type=probability, default=0.9, metavar="P",
             help="nucleus sampling threshold (default: %(default)s)")
    add_flag(parser, "max_batch_size", type=positive_int, default=4, metavar="N",
             help="most prompts per batch (default: %(default)s)")
    add_flag(parser, "device", type=device_name, default=None, metavar="{cpu,cuda,cuda:N}",
             help="where to run (default: CUDA when available, else the CPU)")
    add_flag(parser, "seed", type=int, default=1, metavar="N", help="sampling seed (default: %(default)s)")
    add_flag(parser, "verbose", action="store_true",
             help="log what loading and generating do (INFO lines on standard error); default: on, but for "
                  "--interactive, where only warnings are logged")
    add_model_flags(parser, compile_default=EXAMPLES_COMPILE_DEFAULT)
    return parser


EXAMPLES_COMPILE_DEFAULT = ("off for the example prompts and --prompt, which end before compiling would pay for "
                            f"itself; with --interactive, Llama.build's: {COMPILE_WHERE_IT_PAYS}")


def compile_choice(flag: Optional[bool], long_lived: bool, environ=os.environ) -> Optional[bool]:
    """``Llama.build``'s ``compile`` for an example run: ``--compile`` / ``--no-compile`` as
    given; unset, None (Llama.build decides: it compiles where compiled steps decode faster)
    for a long-lived run (interactive chat), and False for a one-shot run, whose few prompts
    end before a compilation (minutes on a CPU) would pay for itself, unless
    ``LLAMA_COMPILE`` is set (then it decides, as everywhere)."""
    if flag is not None:
        return flag
    if long_lived or environ.get("LLAMA_COMPILE", "").strip():
        return None
    return False


def resolve_checkpoint(ckpt_dir: Optional[str], tokenizer_path: Optional[str],
                       demo_dir: Path = DEMO_DIR) -> tuple[Path, Path]:
    """The checkpoint to run: the given one (Meta's files or a Hugging Face folder), or the
    bundled demo model (``demo_dir``) when none is given.  The tokenizer defaults to the
    checkpoint's own (:func:`llama.checkpoint.layout.find_tokenizer`).

    Raises FileNotFoundError naming what is missing: the directory itself, a checkpoint in it
    (naming both layouts), or the tokenizer; a ``tokenizer_path`` that is not a regular,
    readable file is :func:`llama.tokenizer.check_tokenizer_file`'s error.
    """
    ckpt = Path(ckpt_dir) if ckpt_dir else demo_dir
    if not ckpt_dir:
        logging.getLogger(__name__).info("no --ckpt_dir given: using the bundled demo model in %s", ckpt)
    if not ckpt.exists():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist")
    if not ckpt.is_dir():
        raise NotADirectoryError(f"--ckpt_dir {ckpt} is not a directory")
    layout = checkpoint_layout(ckpt)  # Meta's files or a Hugging Face folder; neither: one error naming both
    if tokenizer_path:
        tokenizer = Path(tokenizer_path)
        if not tokenizer.exists():
            raise FileNotFoundError(f"tokenizer file {tokenizer} does not exist")
        check_tokenizer_file(tokenizer)  # a directory or device: told before torch is imported (seconds)
        return ckpt, tokenizer
    return ckpt, find_tokenizer(ckpt, layout)


# --max_seq_len when none is given, for every command (the examples and the server): the
# checkpoint's own context length where its files state it, capped at this many positions.
# The KV cache holds --max_batch_size x --max_seq_len tokens by default, so a model's full
# context (128k for Llama 3.1) would ask for tens of GB.
MAX_SEQ_LEN_CAP = 2048
MAX_SEQ_LEN_HELP = (f"longest prompt + generation (default: the checkpoint's own context length, capped at "
                    f"{MAX_SEQ_LEN_CAP}: {MAX_SEQ_LEN_CAP} for a Meta checkpoint, whose files do not state it; "
                    f"the demo model: {DEMO_MAX_SEQ_LEN}, its training length)")


def stated_context(ckpt_dir: Optional[str]) -> Optional[int]:
    """The context length a checkpoint's files state: the demo model's training length (no
    ``ckpt_dir``), a Hugging Face ``config.json``'s ``max_position_embeddings``; else None."""
    if not ckpt_dir:
        return DEMO_MAX_SEQ_LEN
    config = Path(ckpt_dir) / "config.json"
    if not config.is_file():
        return None
    import json

    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None  # the loader names what is wrong with the file
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def resolve_lengths(ckpt_dir: Optional[str], max_seq_len: Optional[int]) -> int:
    """``--max_seq_len`` as given; else the one rule of every command (:data:`MAX_SEQ_LEN_HELP`)."""
    if max_seq_len is not None:
        return max_seq_len
    return min(stated_context(ckpt_dir) or MAX_SEQ_LEN_CAP, MAX_SEQ_LEN_CAP)


def run_script(prog: str, main: Callable[[], Optional[int]]) -> NoReturn:
    """Run ``main`` and exit: with the status it returns (0 for None) when done; a bad input
    or environment ends in one line ``prog: error: ...`` and status 1 (under torchrun, printed
    by the first rank alone: see :func:`llama.cli.flags.fail`); Ctrl-C in one line and status 130."""
    try:
        code = main()
    except KeyboardInterrupt:
        if is_first_rank():
            print("\ninterrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        fail(prog, str(e) or type(e).__name__)
    raise SystemExit(code or 0)
