"""What the commands share about files: checked source and destination directories,
written whole or not at all, tokenizer copies, safetensors files opened with one-line errors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from llama.args import ModelArgs
from llama.checkpoint.shards import CheckpointError
from llama.convert.paths import PathLike, check_destination, source_dir
from llama.layers.tensor_parallel import valid_model_parallel_sizes
from llama.runtime.checks import positive_int

logger = logging.getLogger(__name__)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def writes_directory(command: Callable[..., None]) -> Callable[..., None]:
    """Run ``command(src, dst, ...)`` so that ``dst`` appears complete or not at all.

    The command writes into a fresh staging directory beside ``dst``
    (``.NAME.partial-XXXX``), which is renamed to ``dst`` once everything is written.
    If the command fails for any reason (a bad argument, a bad tensor, a full disk,
    Ctrl-C), the staging directory and any parent directories made for it are removed,
    so nothing half-written is left and the next run is not refused.  Only a killed
    process (SIGKILL, power loss) can leave a ``.NAME.partial-XXXX`` directory behind;
    it is never read, and is named in a warning on the next run.  Files and directories
    get the permissions ``open``/``mkdir`` would give them under the current umask.
    """

    @functools.wraps(command)
    def run(src: PathLike, dst: PathLike, *args: Any, **kwargs: Any) -> None:
        src = source_dir(src)
        final = check_destination(dst, src)
        parent = final.absolute().parent
        made = [p for p in [parent, *parent.parents] if not p.exists()]
        parent.mkdir(parents=True, exist_ok=True)
        leftovers = sorted(parent.glob(f".{final.name}.partial-*"))
        if leftovers:
            logger.warning("%s holds unfinished output of an earlier killed run, safe to delete: %s",
                           parent, ", ".join(p.name for p in leftovers))
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=parent))
        try:
            mask = _umask()
            command(src, staging, *args, **kwargs)
            # Some writers make private files (safetensors writes 0600, mkdtemp 0700):
            # give everything the mode a plain open()/mkdir() would.
            for path in staging.rglob("*"):
                os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
            os.chmod(staging, 0o777 & ~mask)
            os.replace(staging, final)  # atomic; replaces only an empty directory
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            for p in made:  # innermost first
                try:
                    p.rmdir()
                except OSError:
                    break
            raise
        logger.info("wrote %s", final)

    return run


def copy_tokenizer(candidates: Iterable[Path], dst: Path) -> Optional[Path]:
    for path in candidates:
        if path.exists() and not path.is_file():
            raise ValueError(f"{path} is not a regular file (a directory, FIFO or device?); a tokenizer.model is one")
        if path.is_file():
            shutil.copyfile(path, dst / "tokenizer.model")
            logger.info("copied %s to %s", path, dst / "tokenizer.model")
            return path
    logger.warning("no tokenizer.model found beside the weights; %s has none (Llama.build needs one)", dst)
    return None


def read_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None (with a warning) when it has no tokenizer.model."""
    if not path.exists():  # one that is not a regular file is refused by load_tokenizer
        logger.warning("%s has no tokenizer.model: the output will have no tokenizer files", path.parent)
        return None
    from llama.tokenizer import load_tokenizer

    return load_tokenizer(path)


def check_model_parallel_size(n: object, args: ModelArgs) -> int:
    positive_int("model_parallel_size", n)
    sizes = valid_model_parallel_sizes(args)
    if n not in sizes:
        raise ValueError(f"this model cannot be split into {n} shards; model-parallel sizes that work: {sizes}")
    return n


def slice_region(t: torch.Tensor, region) -> torch.Tensor:
    """The ``region`` of ``t`` as its own tensor (torch.save of a view would save the whole storage)."""
    return t[tuple(slice(start, end) for start, end in region)].clone()


@contextlib.contextmanager
def safetensors_file(path: Path) -> Iterator[Any]:
    """``safe_open(path)``, with a path that is not a regular file (a FIFO would block
    forever) and a damaged or truncated file refused by a :class:`CheckpointError` naming
    it, instead of safetensors' bare ``SafetensorError``."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(
            f"{path} is not a regular file (a directory, FIFO or device?); safetensors weights are one"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(
            f"cannot read {path}: its safetensors header or data is damaged or the file is truncated ({e}); "
            "download it again"
        ) from None
