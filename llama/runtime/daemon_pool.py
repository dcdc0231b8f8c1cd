"""A thread pool whose threads never hold up the process's exit.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so a
task that runs for minutes (a grammar's mask that cannot be interrupted) would keep a
stopped server or a finished script alive for as long.  These threads are daemons: the
process exits with them still running.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable

__all__ = ["DaemonPool"]


class DaemonPool(Executor):
    """``threads`` daemon threads, named ``{name}_{i}``, taking tasks first come, first served
    (started as tasks come)."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads!r}")
        self.threads = threads
        self.name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._idle = threading.Semaphore(0)  # threads done with a task and not yet given another
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"{self.name}: cannot take tasks after shutdown")
            future: Future = Future()
            self._tasks.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and self._started < self.threads:
                threading.Thread(target=self._work, name=f"{self.name}_{self._started}", daemon=True).start()
                self._started += 1
        return future

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, fn, args, kwargs = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # the task's error is its future's
                    future.set_exception(e)
            del task, future
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more tasks; the threads end once the tasks before are done (never waited for,
        whatever ``wait`` says; queued tasks are not cancelled)."""
        with self._lock:
            self._shutdown = True
            for _ in range(self._started):
                self._tasks.put(None)
