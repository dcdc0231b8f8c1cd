"""What the command lines share (``python -m llama.convert``, the example scripts):
an argument parser whose errors are one line, and argument types that refuse
non-numbers, NaN, infinities and out-of-range values when the command line is read.

Nothing here imports torch, so ``--help`` and a mistyped value answer at once.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

__all__ = ["Parser", "add_flag", "positive_int", "non_negative_int", "positive_number", "non_negative_number",
           "probability", "fail"]


def fail(prog: str, message: str, status: int = 1) -> NoReturn:
    """Print ``prog: error: message`` as one line on stderr and exit with ``status``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors (exit status 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (see --help)", 2)


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """``--name_with_underscores``, also accepted as ``--name-with-hyphens``."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*flags, dest=name, **kwargs)


def _number(text: str, kind: type, what: str, ok) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a positive whole number", lambda v: v > 0)


def non_negative_int(text: str) -> int:
    return _number(text, int, "a whole number >= 0", lambda v: v >= 0)


def positive_number(text: str) -> float:
    return _number(text, float, "a positive finite number", lambda v: v > 0)


def non_negative_number(text: str) -> float:
    return _number(text, float, "a finite number >= 0", lambda v: v >= 0)


def probability(text: str) -> float:
    return _number(text, float, "a number in (0, 1]", lambda v: 0 < v <= 1)
