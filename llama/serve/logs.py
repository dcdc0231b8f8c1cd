"""The server's log under a flood: a message that repeats (the same logger, level and first
line) is written once per interval, and the next one written says how many were dropped.

Clients control what some messages say and how often they come (a malformed request is one
warning; thousands of them were megabytes of log in seconds), so the server's log handlers
get a :class:`RepeatFilter` while it serves.  The access log (``llama.serve.access``) is not
filtered: one line per request is its point.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional, cast

ACCESS_LOGGER = "llama.serve.access"  # the access log's module (llama/serve/access.py)


class RepeatFilter(logging.Filter):
    """Let one message of a kind through per ``interval_s``; the next one let through tells how
    many of its kind were dropped meanwhile (:meth:`flush` tells of those still pending)."""

    MAX_KINDS = 1024  # the oldest kinds are forgotten past this many

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._kinds: dict[tuple, list] = {}  # kind -> [when last let through, dropped since, a record]
        self._lock = threading.Lock()

    @staticmethod
    def kind(record: logging.LogRecord) -> tuple:
        # The message before its arguments are filled in, first line only: asyncio's messages
        # add a line per detail (a socket's file descriptor, ...) after a fixed first one.
        first_line = str(record.msg).split("\n", 1)[0][:200]
        return record.name, record.levelno, first_line

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == ACCESS_LOGGER:
            return True
        verdict = record.__dict__.get("_repeat_filter")  # the same record through another handler
        if verdict is not None and verdict[0] is self:
            return verdict[1]
        kind = self.kind(record)
        now = time.monotonic()
        with self._lock:
            entry = self._kinds.get(kind)
            passes = entry is None or now - entry[0] >= self.interval_s
            if passes:
                dropped = entry[1] if entry is not None else 0
                self._kinds[kind] = [now, 0, None]
                if len(self._kinds) > self.MAX_KINDS:
                    del self._kinds[next(iter(self._kinds))]
            else:
                entry = cast(list, entry)  # kept: passes is false only for a kind seen before
                entry[1] += 1
                entry[2] = record
        if passes and dropped:
            _note_dropped(record, dropped, self.interval_s)
        record.__dict__["_repeat_filter"] = (self, passes)
        return passes

    def flush(self) -> list[logging.LogRecord]:
        """The last dropped record of each kind that dropped some, noting how many others were
        dropped (for the caller to log, e.g. at shutdown); the counts restart."""
        with self._lock:
            pending = [(e[2], e[1]) for e in self._kinds.values() if e[1]]
            for entry in self._kinds.values():
                entry[1], entry[2] = 0, None
        for record, dropped in pending:
            record.__dict__.pop("_repeat_filter", None)
            if dropped > 1:
                _note_dropped(record, dropped - 1, self.interval_s)
        return [record for record, _ in pending]


def _note_dropped(record: logging.LogRecord, dropped: int, interval_s: float) -> None:
    record.msg = f"{record.msg} ({dropped} more like this within {interval_s:g} s were not logged)"


def install(interval_s: float = 10.0, logger: Optional[logging.Logger] = None) -> RepeatFilter:
    """Put a :class:`RepeatFilter` on ``logger``'s handlers (default: the root logger's, where
    the server's and uvicorn's messages go); :func:`uninstall` takes it off again."""
    f = RepeatFilter(interval_s)
    for handler in (logger or logging.getLogger()).handlers:
        handler.addFilter(f)
    return f


def uninstall(f: RepeatFilter, logger: Optional[logging.Logger] = None) -> None:
    """Take ``f`` off the handlers and log what it still held back."""
    for handler in (logger or logging.getLogger()).handlers:
        handler.removeFilter(f)
    for record in f.flush():
        logging.getLogger(record.name).handle(record)
