"""The checks of arguments that every entry point shares (``Llama.build``'s options, the
conversion commands), with one wording: TypeError for a value of the wrong type, ValueError
for one out of range, each naming the argument.  (Command-line flags are parsed from text by
:mod:`llama.cli.flags`, whose messages speak of what was typed.)"""

from __future__ import annotations

import math


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int > 0 (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def positive_number(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number > 0 (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)
