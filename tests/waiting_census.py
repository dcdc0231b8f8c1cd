"""A pytest plugin that records, per test, where its wall time went: a census of waiting.

Enabled only on request: ``python -m pytest tests/test_x.py -p waiting_census`` (or with
``LLAMA_WAITING_CENSUS=path.tsv`` set, which ``tests/conftest.py`` reads), never by default.
It appends one row per test to a TSV file (``LLAMA_WAITING_CENSUS``, default
``waiting_census.tsv`` in the current directory)::

    nodeid  wall_s  self_cpu_s  children_cpu_s  live_cpu_s  idle_s

measured over setup + call + teardown of the test. ``self_cpu_s`` is this worker's own CPU time
(``time.process_time``: user + system, all its threads). ``children_cpu_s`` is the change in
``resource.getrusage(RUSAGE_CHILDREN)`` user + system: it counts only children that have ended and
been waited for during the test, so a server or torchrun job started by a module fixture is
charged to the test whose teardown reaps it (usually the module's last), and a child that is never
waited for is not counted there.  ``live_cpu_s`` is the change in the CPU time (user + system, and
their own reaped children's) of this worker's descendants alive as the test begins or ends, read
from /proc: a module's server or fork server, working for the test but reaped later.  (A descendant
alive at the start and reaped by this process during the test is counted in both, from its start:
a few such tests overstate their CPU.)  ``idle_s`` is ``wall - self - children - live``: on a
loaded machine it includes time spent waiting for a CPU, so compare tests with each other, not
with zero.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Generator
from typing import Any

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _live_descendants_cpu() -> dict[int, float]:
    """pid -> CPU seconds (utime + stime + cutime + cstime) of each live descendant of this process."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        pid = int(entry)
        parent[pid] = int(fields[1])
        cpu[pid] = sum(int(x) for x in fields[11:15]) / _TICK
    me = os.getpid()
    out = {}
    for pid in cpu:
        p, seen = parent.get(pid), 0
        while p is not None and p > 1 and seen < 64:
            if p == me:
                out[pid] = cpu[pid]
                break
            p, seen = parent.get(p), seen + 1
    return out


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Census:
    def __init__(self, path: str) -> None:
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
        live0 = _live_descendants_cpu()
        wall0, self0, child0 = time.perf_counter(), time.process_time(), _children_cpu()
        yield
        wall = time.perf_counter() - wall0
        own = time.process_time() - self0
        children = _children_cpu() - child0
        live1 = _live_descendants_cpu()
        live = sum(t - live0.get(pid, 0.0) for pid, t in live1.items())
        idle = wall - own - children - live
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{item.nodeid}\t{wall:.2f}\t{own:.2f}\t{children:.2f}\t{live:.2f}\t{idle:.2f}\n")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_CURRENT_TEST"):
        return  # a pytest run that a test started (it inherits the variable): its parent counts it
    path = os.environ.get("LLAMA_WAITING_CENSUS") or "waiting_census.tsv"
    if not config.pluginmanager.has_plugin("llama-waiting-census"):
        config.pluginmanager.register(_Census(path), "llama-waiting-census")
