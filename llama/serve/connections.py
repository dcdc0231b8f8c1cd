"""The client connections the HTTP server holds: how many, and how long one may wait before
it sends a request.

uvicorn closes a kept-alive connection that stays silent for ``timeout_keep_alive``, but has
no timeout for a request's headers and no bound on connections: thousands of sockets that
never send a byte (or send their headers a byte at a time) are held forever, until the
process runs out of file descriptors and can accept no one.  :func:`guarded_protocol` adds
both to uvicorn's HTTP protocol:

* a header timeout: a connection must have sent a whole request's headers within
  ``header_timeout_s`` of opening (or of its previous answer), else it is closed;
* a connection cap: past ``max_connections``, a new connection closes the one that has waited
  longest without sending a request (the new one itself if every other is being answered), so
  that idle sockets cannot keep a client with a request out.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from typing import Any, Optional

logger = logging.getLogger(__name__)

# File descriptors kept for everything but client connections (the listening socket, the
# collective's sockets, files, pipes): a connection cap is lowered to fit under the limit.
FD_RESERVE = 64
# Connections waiting to be accepted; also how many asyncio accepts in one go.  Under a flood
# it accepts up to three such bursts before the protocols of the first have run and the idle
# connections they close have freed their descriptors: the cap leaves room for them.
ACCEPT_BACKLOG = 128
ACCEPT_BURSTS = 3


def connection_budget(wanted: int) -> int:
    """``wanted`` connections, or fewer where the process's file-descriptor limit would not
    hold them with :data:`FD_RESERVE` and :data:`ACCEPT_BURSTS` bursts of :data:`ACCEPT_BACKLOG`
    new ones (its soft limit is raised to the hard one first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    spare = FD_RESERVE + ACCEPT_BURSTS * ACCEPT_BACKLOG
    if soft == resource.RLIM_INFINITY or wanted + spare <= soft:
        return wanted
    budget = max(1, soft - spare)
    logger.warning("--max_connections %d lowered to %d: this process may open %d files (ulimit -n)",
                   wanted, budget, soft)
    return budget


def guarded_protocol(base: type[asyncio.Protocol], *, max_connections: int,
                     header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``base`` (h11 or httptools), with a header timeout and a
    connection cap (see the module's docstring).  It relies on what both of uvicorn's
    implementations have: ``connections`` (the server's open connections), ``cycle`` (the
    request being answered, replaced when a new request's headers have come),
    ``on_response_complete``, ``transport`` and ``loop``."""

    # The connections waiting for a request's headers, longest-waiting first (one that has begun
    # a request is dropped when met at the front, and comes back after its answer).
    waiting: OrderedDict[GuardedHTTPProtocol, None] = OrderedDict()

    class GuardedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        _waiting_for: Any = None  # the cycle that was current when the wait for headers began
        _armed = False  # a wait for headers has begun
        _header_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._wait_for_headers()
            if len(self.connections) > max_connections:
                self._make_room()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._wait_for_headers()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            waiting.pop(self, None)
            super().connection_lost(exc)

        def _waiting(self) -> bool:
            """No request has begun since the wait began (its headers have not all come)."""
            return self._armed and self.cycle is self._waiting_for

        def _wait_for_headers(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._waiting_for = self.cycle
            self._armed = True
            self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout)
            waiting.pop(self, None)
            waiting[self] = None

        def _on_header_timeout(self) -> None:
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()

        def _make_room(self) -> None:
            """Close the connection that has waited longest for a request (this new one if no
            other waits)."""
            while waiting:
                oldest = next(iter(waiting))
                del waiting[oldest]
                if oldest is self or (oldest._waiting() and not oldest.transport.is_closing()):
                    oldest.transport.close()
                    return
            self.transport.close()

    GuardedHTTPProtocol.__name__ = GuardedHTTPProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol
