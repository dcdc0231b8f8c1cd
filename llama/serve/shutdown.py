"""How a serving process ends.

On SIGTERM or SIGINT the first rank stops taking requests (new ``/v1`` requests and ``/health``
answer 503, so that a load balancer moves on), lets the requests in flight finish for up to
the grace period, then stops the engine, which ends the rest with an error (their streams get
an error event, the others a 503), and the HTTP server; it logs how many finished and how
many were ended.  A second signal ends the grace period at once.  The other ranks follow the
first rank's engine, which tells them when to stop.  A process still running
:data:`EXIT_DEADLINE_S` after the grace period is ended by force.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Optional

from llama.serve.protocols import ServedEngine

logger = logging.getLogger(__name__)

# After the grace period, seconds allowed for ending the rest and exiting.  (torchrun kills its
# workers 30 s after forwarding a signal: under torchrun keep grace + this below that.)
EXIT_DEADLINE_S = 15.0
POLL_S = 0.05


class Shutdown:
    """The shutdown of one rank's server (see the module's docstring).

    ``stop``: the event the engine's loop runs until; ``app`` and ``http``: the FastAPI
    application and the uvicorn server, on the first rank only."""

    def __init__(self, engine: ServedEngine, stop: threading.Event, *, app: Any = None, http: Any = None,
                 grace_s: float = 10.0) -> None:
        self.engine = engine
        self.stop = stop
        self.app = app
        self.http = http
        self.grace_s = grace_s
        self.begun = threading.Event()
        self._grace_over = threading.Event()

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (call from the main thread)."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)

    def on_signal(self, signum: int, frame: Any = None) -> None:
        name = signal.Signals(signum).name
        if self.begun.is_set():
            if not self._grace_over.is_set():
                logger.info("%s again: ending the requests in flight now", name)
                self._grace_over.set()
            return
        self.begin(name, self.grace_s)

    def begin(self, why: str, grace_s: float) -> None:
        """Stop taking requests; end the engine and the HTTP server once the requests in flight
        are done or ``grace_s`` has passed."""
        if self.begun.is_set():
            return
        self.begun.set()
        deadline = threading.Timer(grace_s + EXIT_DEADLINE_S, _exit_now, args=(1, "shutdown took too long"))
        deadline.daemon = True
        deadline.start()
        if self.app is None:  # another rank: the first rank's engine tells this one when to stop
            self.stop.set()
            return
        self.app.state.accepting = False
        if grace_s <= 0:
            self._finish(why, time.monotonic(), in_flight=None)
            return
        in_flight = self._in_flight()
        if in_flight:
            logger.info("%s: taking no new requests; waiting up to %g s for the %d in flight", why, grace_s, in_flight)
        else:
            logger.info("%s: no requests in flight: exiting", why)
        threading.Thread(target=self._drain, args=(why, grace_s, in_flight), name="shutdown", daemon=True).start()

    def _in_flight(self) -> int:
        try:
            stats = self.engine.stats()
        except Exception:  # an engine that failed: nothing more will finish
            return 0
        return stats["queued"] + stats["slots_in_use"]

    def _drain(self, why: str, grace_s: float, in_flight: int) -> None:
        start = time.monotonic()
        while self._in_flight() and not self._grace_over.wait(POLL_S):
            if time.monotonic() - start >= grace_s:
                break
        self._finish(why, start, in_flight)

    def _finish(self, why: str, start: float, in_flight: Optional[int]) -> None:
        left = self._in_flight()
        took = time.monotonic() - start
        if in_flight:
            finished = max(0, in_flight - left)
            if left:
                logger.info("shutdown: %d of the %d requests in flight finished in %.1f s; ending the other %d "
                            "with an error", finished, in_flight, took, left)
            else:
                logger.info("shutdown: the %d requests in flight finished in %.1f s", in_flight, took)
        elif left:
            logger.info("%s: ending the %d requests in flight with an error", why, left)
        self.stop.set()  # the engine ends what is left (EngineStopped): streams get their error event
        if self.http is not None:
            self.http.should_exit = True  # then uvicorn lets those answers go out and exits


def _exit_now(code: int, why: str) -> None:
    logger.error("%s: exiting now", why)
    logging.shutdown()
    os._exit(code)
