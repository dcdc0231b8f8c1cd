"""Images in chat requests: OpenAI's ``image_url`` content parts read into the bytes the chat
format takes, under the server's limits (no web stack here: the endpoint runs
:func:`resolve_dialog_images` on a thread).

An ``image_url``'s ``url`` is one of:

* a data URI, ``data:image/png;base64,...`` (always taken);
* an ``http(s)`` URL: refused unless its host is one of ``--allowed_media_domains`` (exactly,
  as vLLM's flag of that name), then fetched with a timeout and at most ``--max_image_bytes``
  read; a redirect is not followed (it could lead off the listed hosts);
* a ``file://`` URL or a path: refused unless ``--allowed_local_media_path`` is set and the
  file, resolved (``..`` and symbolic links followed), lies under that folder.

Every image is then decoded once here (:func:`llama.images.preprocess.load_image`, under
``--max_image_pixels``) so that a bad one is refused naming its part before anything else is
spent on the request.  Every refusal is an :class:`~llama.serve.openai_api.APIError` (400)
whose ``param`` is ``messages.{i}.content.{j}`` and whose message starts with
``messages[i].content[j]``.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from llama.serve.limits import MediaLimits
from llama.serve.openai_api import APIError, ImageRef

__all__ = ["MediaLimits", "resolve_dialog_images", "image_bytes"]

_DATA_URI = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)


def _refuse(ref: ImageRef, message: str) -> APIError:
    return APIError(400, f"{ref.where}: {message}", param=ref.param)


def _from_data_uri(ref: ImageRef, limits: MediaLimits) -> bytes:
    match = _DATA_URI.fullmatch(ref.url)
    if match is None:
        raise _refuse(ref, "a data URI is data:<media type>;base64,<data>")
    media_type = match["type"].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise _refuse(ref, f"the data URI holds {media_type!r}, not an image (image/png, image/jpeg, image/webp, "
                           "image/gif)")
    if "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
        raise _refuse(ref, "the data URI must be base64-encoded (data:image/png;base64,...)")
    data = re.sub(r"\s+", "", match["data"])
    if len(data) // 4 * 3 > limits.max_image_bytes + 2:  # refused before it is decoded
        raise _refuse(ref, f"the image has about {len(data) // 4 * 3:,} bytes, over the limit of "
                           f"{limits.max_image_bytes:,} (--max_image_bytes)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _refuse(ref, f"the data URI's base64 is not valid ({e})") from None
    return raw


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirected to {newurl} (redirects are not followed)",
                                     headers, fp)


def _read_by(response: Any, limit: int, deadline: float) -> bytes:
    """At most ``limit`` bytes of ``response``, read by ``deadline`` (``time.monotonic()``; the
    socket's timeout bounds each read, this the whole: a server that sends a byte a second
    cannot hold a thread for long); ``TimeoutError`` past it."""
    read = getattr(response, "read1", response.read)  # read1: what has come, not a full 64 KiB
    chunks, n = [], 0
    while n < limit:
        if time.monotonic() > deadline:
            raise TimeoutError
        chunk = read(min(64 * 1024, limit - n))
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


def _fetch(ref: ImageRef, limits: MediaLimits) -> bytes:
    host = (urllib.parse.urlsplit(ref.url).hostname or "").lower().rstrip(".")
    if not host or host not in limits.allowed_media_domains:
        listed = ", ".join(limits.allowed_media_domains)
        raise _refuse(ref, f"images are not fetched from {host or 'that URL'!r}: this server fetches only from the "
                           "hosts --allowed_media_domains lists (" + (listed or "none") + "); send the image "
                           "inline as a data URI (data:image/png;base64,...)")
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(urllib.request.Request(ref.url, headers={"User-Agent": "llama-serve"}),
                         timeout=limits.fetch_timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_image_bytes:
                raise _refuse(ref, f"the image at that URL has {int(length):,} bytes, over the limit of "
                                   f"{limits.max_image_bytes:,} (--max_image_bytes)")
            raw = _read_by(response, limits.max_image_bytes + 1, time.monotonic() + limits.fetch_timeout_s)
    except TimeoutError:
        raise _refuse(ref, f"fetching the image took longer than {limits.fetch_timeout_s:g} s") from None
    except APIError:
        raise
    except urllib.error.HTTPError as e:
        raise _refuse(ref, f"fetching the image failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # TimeoutError is an OSError
        reason = getattr(e, "reason", e)
        raise _refuse(ref, f"fetching the image failed: {reason}") from None
    if len(raw) > limits.max_image_bytes:
        raise _refuse(ref, f"the image at that URL is over the limit of {limits.max_image_bytes:,} bytes "
                           "(--max_image_bytes)")
    return raw


def _local(ref: ImageRef, limits: MediaLimits) -> bytes:
    if limits.allowed_local_media_path is None:
        raise _refuse(ref, "local files are not read by this server (it reads them only under "
                           "--allowed_local_media_path); send the image inline as a data URI "
                           "(data:image/png;base64,...)")
    url = ref.url
    if url.startswith("file:"):
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise _refuse(ref, f"a file URL names a file on this machine (file:///path), not on {parts.netloc!r}")
        text = urllib.parse.unquote(parts.path)
    else:
        text = url
    root = Path(limits.allowed_local_media_path).resolve()
    path = root / text  # a relative path is under the folder; an absolute one stays as it is
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        resolved = None
    if resolved is None or not resolved.is_relative_to(root):
        # The same answer for a file that is missing and one outside the folder: a client learns
        # nothing of the files it may not read.
        raise _refuse(ref, f"no image file under the allowed folder (--allowed_local_media_path) at {text!r}")
    if not resolved.is_file():
        raise _refuse(ref, f"{text!r} is not a file")
    if resolved.stat().st_size > limits.max_image_bytes:
        raise _refuse(ref, f"the file has {resolved.stat().st_size:,} bytes, over the limit of "
                           f"{limits.max_image_bytes:,} (--max_image_bytes)")
    with open(resolved, "rb") as f:
        raw = f.read(limits.max_image_bytes + 1)
    if len(raw) > limits.max_image_bytes:
        raise _refuse(ref, f"the file is over the limit of {limits.max_image_bytes:,} bytes (--max_image_bytes)")
    return raw


def image_bytes(ref: ImageRef, limits: MediaLimits) -> bytes:
    """The bytes of the image ``ref``'s URL names, under ``limits``; a 400 otherwise (not yet
    decoded: :func:`resolve_dialog_images` checks them)."""
    url = ref.url
    scheme = url.split(":", 1)[0].lower() if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", url) else ""
    if scheme == "data":
        raw = _from_data_uri(ref, limits)
    elif scheme in ("http", "https"):
        raw = _fetch(ref, limits)
    elif scheme == "file" or (not scheme or os.path.isabs(url)):
        raw = _local(ref, limits)
    else:
        raise _refuse(ref, f"image URLs are data: URIs (or http(s) and file URLs where the server allows them), "
                           f"not {scheme}:")
    if not raw:
        raise _refuse(ref, "the image is empty (0 bytes)")
    if len(raw) > limits.max_image_bytes:
        raise _refuse(ref, f"the image has {len(raw):,} bytes, over the limit of {limits.max_image_bytes:,} "
                           "(--max_image_bytes)")
    return raw


def resolve_dialog_images(dialog: Sequence[dict], limits: MediaLimits, *, takes_images: bool,
                          why_not: str = "") -> list[dict]:
    """``dialog`` (:meth:`~llama.serve.openai_api.ChatCompletionRequest.dialog`'s) with each
    :class:`~llama.serve.openai_api.ImageRef` made the chat format's image part
    (``{"type": "image", "image": <bytes>}``), checked and decoded once under ``limits``.

    A 400 naming the part for an image to a model that takes none (``takes_images`` False;
    ``why_not`` says why), an image in a message that is not the user's, more images than
    ``max_images_per_request``, and any image that cannot be had or read."""
    from llama.images.preprocess import load_image

    refs = [(i, p) for i, m in enumerate(dialog) if isinstance(m["content"], list)
            for p in m["content"] if isinstance(p, ImageRef)]
    if not refs:
        return list(dialog)
    for i, ref in refs:
        if not takes_images:
            raise _refuse(ref, "this model takes no images" + (f" ({why_not})" if why_not else ""))
        if dialog[i]["role"] != "user":
            raise _refuse(ref, f"an image in a {dialog[i]['role']!r} message; images go in user messages")
    if len(refs) > limits.max_images_per_request:
        ref = refs[limits.max_images_per_request][1]
        raise _refuse(ref, f"the request holds {len(refs)} images, more than this server takes in one request "
                           f"({limits.max_images_per_request}, --max_images_per_request)")
    out = []
    for m in dialog:
        if not isinstance(m["content"], list):
            out.append(m)
            continue
        parts: list[Any] = []
        for part in m["content"]:
            if not isinstance(part, ImageRef):
                parts.append(part)
                continue
            raw = image_bytes(part, limits)
            try:
                load_image(raw, max_pixels=limits.max_image_pixels).close()
            except ValueError as e:
                message = str(e)
                if "pixels, over the limit" in message:
                    message += " (--max_image_pixels)"
                raise _refuse(part, message) from None
            parts.append({"type": "image", "image": raw})
        out.append({**m, "content": parts})
    return out
