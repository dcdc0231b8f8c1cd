"""The source and destination directories of a conversion, checked without torch: the command
line checks them before it imports torch (a second or more), so a wrong path is told at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]


def source_dir(src: PathLike) -> Path:
    src = Path(str(src))
    if not src.is_dir():
        raise FileNotFoundError(f"source directory not found: {src}")
    return src


def check_destination(dst: PathLike, src: Path) -> Path:
    """``dst`` as a Path, refused unless it is absent or an empty directory, and neither the
    source, nor inside it, nor around it.

    The rule: a conversion never writes into a directory that already holds something,
    so it can neither overwrite a file there (a ``tokenizer.model``) nor leave stale files
    (old shards, Hugging Face files) beside the new ones.
    """
    if not isinstance(dst, (str, os.PathLike)) or not str(dst):
        raise TypeError(f"the destination must be a directory path, got {dst!r}")
    dst = Path(dst)
    real_src, real_dst = src.resolve(), dst.resolve()  # links followed: where the files really go
    if real_dst == real_src:
        raise ValueError(f"destination {dst} is the source directory; write to a new directory")
    if real_src in real_dst.parents:
        raise ValueError(
            f"destination {dst} is inside the source directory {src}; write to a directory outside it "
            "(the output would be mixed into the checkpoint it is read from)"
        )
    if real_dst in real_src.parents:
        raise ValueError(f"the source directory {src} is inside the destination {dst}; write to a directory outside it")
    if dst.is_dir():
        existing = sorted(p.name for p in dst.iterdir())
        if existing:
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            raise FileExistsError(
                f"destination {dst} already holds files ({shown}); write to a new or empty directory "
                "(a conversion never mixes its files with files already there)"
            )
    elif dst.exists() or dst.is_symlink():
        raise FileExistsError(f"destination {dst} exists and is not a directory")
    return dst
