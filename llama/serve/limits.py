"""The server's limits on what one client may cost it, with the reasons for their defaults
(the command line's ``--help`` shows them; nothing here imports the web stack or torch).
"""

from __future__ import annotations

from dataclasses import dataclass

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
