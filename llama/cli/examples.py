"""What the example scripts share: their command line, the bundled demo model, logging
per rank, and ending with one clear line instead of a traceback (the interactive chat's
input is :mod:`llama.cli.terminal`).

Nothing here imports torch: ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional

from llama.checkpoint.layout import checkpoint_layout, find_tokenizer
from llama.cli.flags import (
    Parser,
    add_flag,
    add_model_flags,
    fail,
    non_negative_number,
    positive_int,
    probability,
    process_rank,
)

# The bundled demo model (demo/) was trained on 256-token rows: the scripts' defaults
# when it runs, so nothing is generated at positions it never saw.
DEMO_DIR = Path(__file__).resolve().parents[2] / "demo"
DEMO_MAX_SEQ_LEN = 256


def is_first_rank() -> bool:
    return process_rank() == 0


def setup_logging() -> None:
    """INFO on the first rank, warnings only on the others."""
    logging.basicConfig(
        level=logging.INFO if is_first_rank() else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


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
    add_flag(parser, "device", choices=["cuda", "cpu"], default=None,
             help="where to run (default: CUDA when available, else the CPU)")
    add_flag(parser, "seed", type=int, default=1, metavar="N", help="sampling seed (default: %(default)s)")
    add_model_flags(parser)
    return parser


def resolve_checkpoint(ckpt_dir: Optional[str], tokenizer_path: Optional[str],
                       demo_dir: Path = DEMO_DIR) -> tuple[Path, Path]:
    """The checkpoint to run: the given one (Meta's files or a Hugging Face folder), or the
    bundled demo model (``demo_dir``) when none is given.  The tokenizer defaults to the
    checkpoint's own (:func:`llama.checkpoint.layout.find_tokenizer`).

    Raises FileNotFoundError naming what is missing: the directory itself, a checkpoint in it
    (naming both layouts), or the tokenizer.
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
        if not tokenizer.exists():  # one that is not a regular file is named as such by load_tokenizer
            raise FileNotFoundError(f"tokenizer file {tokenizer} does not exist")
        return ckpt, tokenizer
    return ckpt, find_tokenizer(ckpt, layout)


def resolve_lengths(ckpt_dir: Optional[str], max_seq_len: Optional[int], default_max_seq_len: int) -> int:
    """``--max_seq_len`` as given; else the demo model's training length when it runs, else
    ``default_max_seq_len`` (the reference scripts' default)."""
    if max_seq_len is not None:
        return max_seq_len
    return default_max_seq_len if ckpt_dir else DEMO_MAX_SEQ_LEN


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
