"""What the command lines share (``python -m llama.convert``, the example scripts,
``python -m llama.serve``): an argument parser whose errors are one line, argument types
that refuse non-numbers, NaN, infinities and out-of-range values when the command line is
read, and the flags that pass ``Llama.build``'s model options (:func:`add_model_flags`).

Nothing here imports torch, so ``--help`` and a mistyped value answer at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Callable, NoReturn, TypeVar

# Llama.build's accepted values: llama.runtime.options imports nothing heavy, so reading a
# command line does not import torch.
from llama.runtime.options import DTYPE_NAMES, INT4_GROUP_SIZES, PACKING_KINDS, QUANTIZATION_MODES

__all__ = ["Parser", "add_flag", "add_model_flags", "model_options", "positive_int", "non_negative_int",
           "positive_number", "non_negative_number", "probability", "fraction_below_one", "port", "fail",
           "process_rank", "device_name"]

# How long a process other than the first waits, after an error, before it exits (see fail):
# torchrun ends every process of the job as soon as one exits with an error, and the ranks
# meet most errors before they join the process group, each at its own pace (importing
# torch, reading files), seconds apart on a busy machine.
OTHER_RANKS_EXIT_DELAY_S = 5.0


# What the first rank adds below its error line under torchrun (see fail).
TORCHRUN_REPORT_NOTE = ("(torchrun's own report of the failed process follows, ending in ChildFailedError; "
                        "the error is the line above)")


def process_rank() -> int:
    """This process's rank in a torchrun job (``RANK``); 0 outside a job."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def fail(prog: str, message: str, status: int = 1) -> NoReturn:
    """Print ``prog: error: message`` as one line on stderr and exit with ``status``.

    In a job of several processes the first rank alone prints the line, and leaves it in the
    error file torchrun gives each process (``TORCHELASTIC_ERROR_FILE``), so that torchrun's
    failure summary names it; under torchrun it adds :data:`TORCHRUN_REPORT_NOTE`, a line
    saying that torchrun's traceback which follows repeats it.  Another rank waits
    :data:`OTHER_RANKS_EXIT_DELAY_S` first: the first rank usually fails at the same point, and
    torchrun then ends the others quietly.
    One still running after the wait met an error of its own: it leaves its line in its error
    file (or, with none, prints it naming its rank) and exits with ``status``.
    """
    line = f"{prog}: error: {message}"
    rank = process_rank()
    if rank == 0:
        # Under torchrun (an error file to record in), torchrun then reports the failed process
        # in ~40 lines of its own that no process can switch off: one line says so.
        _write_line(line + ("\n" + TORCHRUN_REPORT_NOTE if _record_for_torchrun(line) else ""))
    else:
        time.sleep(OTHER_RANKS_EXIT_DELAY_S)
        if not _record_for_torchrun(line):
            _write_line(f"{prog} (rank {rank}): error: {message}")
    raise SystemExit(status)


def _write_line(line: str) -> None:
    # One write, so that lines from several processes sharing the terminal never run together.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _record_for_torchrun(line: str) -> bool:
    """Write ``line`` to the error file torchrun gave this process, in the layout of
    ``torch.distributed.elastic``'s ``@record`` (read back into torchrun's summary as the
    process's "traceback"); False where there is none or it cannot be written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors (exit status 2) instead of usage + error."""

    def parse_known_args(self, args=None, namespace=None):
        # argparse spells a BooleanOptionalAction's negation --no-compile only: --no_compile too
        args = list(sys.argv[1:] if args is None else args)
        negations = {s for a in self._actions for s in a.option_strings if s.startswith("--no-")}
        args = [a.replace("_", "-") if a.startswith("--no_") and a.replace("_", "-") in negations else a
                for a in args]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        # "argument --max_seq_len/--max-seq-len: ..." names a flag once, as --help lists it first
        message = re.sub(r"^argument (--[\w-]+)(?:/--[\w-]+)+:", r"argument \1:", message)
        fail(self.prog, f"{message} (see --help)", 2)


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """``--name_with_underscores``, also accepted as ``--name-with-hyphens``."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*flags, dest=name, **kwargs)


# Llama.build's compile default, as --help says it (llama.layers.policy.compile_by_default)
COMPILE_WHERE_IT_PAYS = ("on for CUDA, and on the CPU for bfloat16 and quantised models where a C++ compiler is "
                         "found; the first start compiles every shape, with its progress shown")


def add_model_flags(parser: argparse.ArgumentParser, compile_default: str = COMPILE_WHERE_IT_PAYS) -> None:
    """The flags that choose how ``Llama.build`` holds and runs the model: ``--dtype``,
    ``--quantize``, ``--quantize_group_size``, ``--compile`` / ``--no-compile`` and
    ``--cpu_packing`` (each default: ``Llama.build``'s own; ``compile_default`` says, in
    --help, what an unset ``--compile`` does in this command).  :func:`model_options` turns
    the parsed flags into its keyword arguments."""
    add_flag(parser, "dtype", type=dtype_name, default=None, metavar="{float32,bfloat16,float16}",
             help="weights and activations (default: bfloat16 on CUDA, float32 on the CPU)")
    add_flag(parser, "quantize", choices=QUANTIZATION_MODES, default=None,
             help="int8 or int4 weights (w8a8: int8 weights and, at batch 1 on the CPU, int8 activations); "
                  "default: none")
    add_flag(parser, "quantize_group_size", type=int, choices=INT4_GROUP_SIZES, default=None, metavar="N",
             help="input columns per int4 scale: 32, 64, 128 or 256 (default: 128; --quantize int4 only)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help=f"compile the decoding step with torch.compile (default: {compile_default}; "
                             "LLAMA_COMPILE=0/1 overrides the default)")
    add_flag(parser, "cpu_packing", choices=PACKING_KINDS, default=None,
             help="bfloat16/float16 on the CPU: the kernel the weights are packed for (default: the one that "
                  "decodes fastest on this CPU; onednn favours long prompts where the CPU has AVX-512 BF16)")


def dtype_name(text: str) -> str:
    """``float32``, ``bfloat16`` or ``float16`` from any name ``Llama.build`` accepts for it
    (``bf16``, ``fp16``, ``torch.float32``, ...)."""
    name = DTYPE_NAMES.get(text.lower().removeprefix("torch."))
    if name is None:
        raise argparse.ArgumentTypeError(f"expected float32, bfloat16 or float16, got {text!r}")
    return name


def model_options(args: argparse.Namespace) -> dict:
    """``Llama.build`` keyword arguments from the flags :func:`add_model_flags` added."""
    return {name: getattr(args, name) for name in ("dtype", "quantize", "quantize_group_size", "compile",
                                                   "cpu_packing")}


Number = TypeVar("Number", int, float)


def _number(text: str, kind: Callable[[str], Number], what: str, ok: Callable[[Number], bool]) -> Number:
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


def fraction_below_one(text: str) -> float:
    return _number(text, float, "a number between 0 and 1, both excluded (e.g. 0.9)", lambda v: 0 < v < 1)


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, the devices ``Llama.build`` runs on (refused here in a
    line of our own, before torch would list every device type it knows)."""
    kind, colon, index = text.strip().lower().partition(":")
    if kind == "cpu" and not colon or kind == "cuda" and (not colon or index.isdigit() and index.isascii()):
        return text.strip().lower()
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def port(text: str) -> int:
    """A TCP port, 1..65535, or 0: any free port (the server logs the one it got)."""
    return _number(text, int, "a port number from 1 to 65535 (or 0: any free port)", lambda v: 0 <= v <= 65535)
