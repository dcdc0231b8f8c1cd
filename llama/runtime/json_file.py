"""Reading the small JSON settings files a checkpoint carries (``params.json``, ``config.json``,
a weight index) safely: bounded in size and nesting, refused with the file named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The settings files read here (params.json, config.json, a weight index) are a few KB
# to a few hundred KB and nest a few levels: far larger or deeper is not such a file,
# and is refused before it can fill memory or overflow the stack (or later a repr).
MAX_JSON_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 32


def _nesting_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests lists/objects more than ``limit`` deep; iterative."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def read_json_object(path: Path, where: str, what: str) -> dict:
    """The JSON object in ``path``; ``FileNotFoundError``/``ValueError`` naming the file otherwise.
    ``where`` says where the file should be, ``what`` what it should describe.

    Refused unread: a path that is not a regular file (a FIFO or device would block or
    never end) and a file over :data:`MAX_JSON_BYTES`; refused after parsing: nesting
    deeper than :data:`MAX_JSON_DEPTH`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path.name} not found at {path}: {where}")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file (a directory, FIFO or device?): {where}")
    data = None
    if path.stat().st_size <= MAX_JSON_BYTES:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # bounded even if the file grows meanwhile
    if data is None or len(data) > MAX_JSON_BYTES:
        raise ValueError(
            f"{path} is larger than {MAX_JSON_BYTES // 2**20} MiB, far more than a file of {what} holds: "
            "is it the right file?"
        )
    too_deep = f"{path} nests lists or objects more than {MAX_JSON_DEPTH} levels deep; a file of {what} nests a few"
    try:
        value = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:  # deeper than the parser's own stack
        raise ValueError(too_deep) from None
    if _nesting_depth_exceeds(value, MAX_JSON_DEPTH):
        raise ValueError(too_deep)
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object of {what}, got {type(value).__name__}")
    return value
