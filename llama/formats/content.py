"""A message's content as a list of parts: text and images.

A message's ``content`` is a string, or a list of parts in Hugging Face's chat-template shapes
(OpenAI's for text)::

    {"type": "text", "text": "What is in this picture?"}
    {"type": "image", "image": <PIL.Image | bytes | path>}

or Meta's llama-models items (``RawTextItem``, ``RawMediaItem``: read by their ``type``,
``text`` and ``data`` fields, without importing llama-models).  :func:`split_dialog` gives every
format a dialog it can check as it always has: a message whose parts are all text becomes one
string (the texts joined, as the server joins OpenAI's text parts); only a user message with
images keeps its parts, as a list of strings and :class:`ImagePart` s, for a format that takes
images.  Images are not decoded here (no PIL or torch): the format preprocesses them when it
encodes the dialog.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

__all__ = ["ImagePart", "Part", "content_parts", "split_dialog", "dialog_has_images"]


@dataclass(frozen=True)
class ImagePart:
    """An image in a message: ``image`` is a ``PIL.Image``, a file's bytes or a path."""

    image: Any


Part = Union[str, ImagePart]


def _is_pil_image(value: Any) -> bool:
    return any(cls.__module__.startswith("PIL.") and cls.__name__ == "Image" for cls in type(value).__mro__)


def _image_source(value: Any, where: str) -> Any:
    if isinstance(value, io.BytesIO):  # RawMediaItem.data may be one
        return value.getvalue()
    if isinstance(value, (bytes, bytearray, str, os.PathLike)) or _is_pil_image(value):
        return value
    raise TypeError(f"{where}: an image is a PIL.Image, bytes or a path, got {type(value).__name__}")


_SHAPES = "a str or a list of content parts ({'type': 'text', 'text': ...} or {'type': 'image', 'image': ...})"


def _part(part: Any, where: str, j: int) -> Part:
    """Part ``j`` of ``where``'s content (``where``: e.g. ``"message 2"``)."""
    if isinstance(part, Mapping):
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise TypeError(f"{where} content part {j}: 'text' must be a str, got {type(text).__name__}")
            return text
        if kind == "image":
            if "image" not in part:
                raise ValueError(f"{where} content part {j}: an image part holds its image under 'image' "
                                 "(a PIL.Image, bytes or a path)")
            return ImagePart(_image_source(part["image"], f"{where} content part {j}"))
        raise ValueError(f"{where} content part {j}: the type must be 'text' or 'image', got {kind!r}")
    kind = getattr(part, "type", None)  # llama-models' RawTextItem / RawMediaItem
    if kind == "text" and isinstance(getattr(part, "text", None), str):
        return part.text
    if kind == "image" and hasattr(part, "data"):
        return ImagePart(_image_source(part.data, f"{where} content part {j}"))
    raise TypeError(f"{where} content must be {_SHAPES}; part {j} is a {type(part).__name__}")


def content_parts(content: Any, where: str = "the message") -> list[Part]:
    """``content`` (a string, one part or a list of parts) as a list of strings and
    :class:`ImagePart` s; ``TypeError``/``ValueError`` naming ``where`` for anything else."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, (list, tuple)):
        return [_part(p, where, j) for j, p in enumerate(content)]
    return [_part(content, where, 0)]


def _has_parts(content: Any) -> bool:
    return isinstance(content, (list, tuple, Mapping)) or getattr(content, "type", None) in ("text", "image")


def dialog_has_images(dialog: Sequence[Any]) -> bool:
    """Whether any message of ``dialog`` holds an image (the content is not decoded)."""
    if not isinstance(dialog, (list, tuple)):
        return False  # not a dialog: the format's check names the problem
    for i, msg in enumerate(dialog):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if _has_parts(content):
            if any(isinstance(p, ImagePart) for p in content_parts(content, f"message {i}")):
                return True
    return False


def split_dialog(dialog: Sequence[Any], *, takes_images: bool, why_not: str = "") -> list[Any]:
    """``dialog`` with each message's content a string, except a user message with images
    (kept as a list of :class:`Part` s) when ``takes_images``.

    ``ValueError`` for an image when not ``takes_images`` (the message says that the model
    takes no images, and ``why_not``) and for an image in a message that is not the user's.
    Messages that are not dicts, or content of another type, are left for the format's checks
    to refuse.
    """
    if not isinstance(dialog, (list, tuple)):
        return dialog  # type: ignore[return-value]  # the format's check names the problem
    out: list[Any] = []
    for i, msg in enumerate(dialog):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not _has_parts(content):  # a string, or something the format's check refuses
            out.append(msg)
            continue
        parts = content_parts(content, f"message {i}")
        if not any(isinstance(p, ImagePart) for p in parts):
            out.append({**msg, "content": "".join(p for p in parts if isinstance(p, str))})
            continue
        if not takes_images:
            raise ValueError(f"message {i} holds an image, but this model takes no images" + (
                f" ({why_not})" if why_not else ""))
        if msg.get("role") != "user":
            raise ValueError(f"message {i} holds an image in a {msg.get('role')!r} message; images go in user "
                             "messages")
        out.append({**msg, "content": parts})
    return out
