"""The server's limits on what one client may cost it, with the reasons for their defaults
(the command line's ``--help`` shows them; nothing here imports the web stack or torch).
"""

from __future__ import annotations

# 4 MiB: a full 128k-token context is about 0.5 MB of English text (some 4 bytes a token), up
# to about 3 MB once JSON escapes non-ASCII text (6 bytes for \uXXXX), and a list of 128k token
# ids about 1 MB; what is left covers a chat history's overhead and tool definitions.  Past
# it, a body only costs the server memory and parsing time before it is refused anyway.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

# The library's caps on stop strings (llama.engine.detokenize), written out so that --help does
# not import torch; tests/test_serve_api.py checks that they agree.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
