"""The server's limits on what one client may cost it, with the reasons for their defaults
(the command line's ``--help`` shows them; nothing here imports the web stack or torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llama.images.prompt import DEFAULT_MAX_PIXELS

# 4 MiB: a full 128k-token context is about 0.5 MB of English text (some 4 bytes a token), up
# to about 3 MB once JSON escapes non-ASCII text (6 bytes for \uXXXX), and a list of 128k token
# ids about 1 MB; what is left covers a chat history's overhead and tool definitions.  Past
# it, a body only costs the server memory and parsing time before it is refused anyway.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

# Open client connections: every streaming client holds one for its whole answer, and a model
# server answers at most --max_batch_size + --max_queue generations at once (72 by default); the
# rest is room for clients that poll, retry or keep connections alive.  Past it, the connection
# that has waited longest without sending a request is closed (llama.serve.connections).
DEFAULT_MAX_CONNECTIONS = 1024
# A connection must send a whole request's headers within this many seconds of opening (or of
# its previous answer): any client sends them at once, only a stalled or hostile one takes longer.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# A kept-alive connection silent for this long is closed (uvicorn's default).  Behind a load
# balancer that reuses connections, set it above the balancer's idle timeout (65 for AWS's 60 s),
# else the balancer may send a request down a connection the server has just closed.
DEFAULT_KEEP_ALIVE_S = 5.0

# After SIGTERM, how long the requests in flight may go on before they are ended: most answers
# take a few seconds, and process managers wait about this long before they kill (Kubernetes
# 30 s, systemd 90 s, torchrun 30 s after forwarding the signal).
DEFAULT_SHUTDOWN_GRACE_S = 10.0

# The library's caps on stop strings (checked in llama.engine.detokenize), from the torch-free
# module the library and the command lines share.
from llama.runtime.options import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS  # noqa: E402,F401


@dataclass(frozen=True)
class ServerLimits:
    """The limits :func:`llama.serve.serve` runs under (the command line's flags of the same names)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S


# Images one request may hold: each costs its decoding and, for Llama 4, up to 17 tiles of 144
# prompt tokens (2,448 tokens); eight of those already fill a 16k context.
DEFAULT_MAX_IMAGES_PER_REQUEST = 8
# A file's bytes: a 12-megapixel JPEG from a phone is 3-5 MB.  A data URI travels base64-encoded
# in the body (4/3 as large), so one that large also needs a larger --max_request_bytes.
DEFAULT_MAX_IMAGE_BYTES = 8 * 1024 * 1024
# Seconds a remote image (an allowed host's) may take to fetch, whole.
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaLimits:
    """Where the server takes images from and how many, how large (the command line's flags of
    the same names).  ``allowed_media_domains``: hosts whose ``http(s)`` URLs are fetched (none
    by default); ``allowed_local_media_path``: the folder whose files may be named (None: no
    local file)."""

    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: Optional[str] = None
    fetch_timeout_s: float = FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains if d.strip())
        for d in domains:
            if "/" in d or ":" in d or " " in d:
                raise ValueError(f"--allowed_media_domains lists host names (e.g. images.example.com), not {d!r}")
        object.__setattr__(self, "allowed_media_domains", domains)
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path)
            if not root.is_dir():
                raise ValueError(f"--allowed_local_media_path {root} is not a folder")
