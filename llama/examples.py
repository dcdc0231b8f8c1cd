"""What the example scripts share: finding the bundled demo model, logging per rank."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional


def is_first_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def setup_logging() -> None:
    """INFO on the first rank, warnings only on the others."""
    logging.basicConfig(
        level=logging.INFO if is_first_rank() else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


def resolve_checkpoint(ckpt_dir: Optional[str], tokenizer_path: Optional[str], demo_dir: Path) -> tuple[Path, Path]:
    """The checkpoint to run: the given one, or the bundled demo model (``demo_dir``)
    when none is given.  The tokenizer defaults to the checkpoint's own ``tokenizer.model``."""
    ckpt = Path(ckpt_dir) if ckpt_dir else demo_dir
    if not ckpt_dir:
        logging.getLogger(__name__).info("no --ckpt_dir given: using the bundled demo model in %s", ckpt)
    if tokenizer_path:
        return ckpt, Path(tokenizer_path)
    tokenizer = ckpt / "tokenizer.model"
    if not tokenizer.is_file():
        raise FileNotFoundError(f"no tokenizer.model in {ckpt}: pass --tokenizer_path")
    return ckpt, tokenizer
