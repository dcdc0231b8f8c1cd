"""How many CPU threads a step runs on, decided by timing steps rather than guessed.

A process gets a share of the machine's CPUs (:func:`llama.runtime.host.choose_cpu_threads`).
That is right on a quiet machine, but when another process keeps a CPU busy, OpenMP's threads
spin-wait for a core they do not get and every parallel product waits for the slowest of
them: on a 2-CPU machine beside one CPU-bound process, 2 threads decode 2.5-4x slower than 1
(BENCHMARKS.md, "CPU threads").  No setting fixed in advance is right in both cases, and a
machine's load changes while a server runs.

:class:`ThreadTuner` times the decoding steps themselves: now and then (after the first
decoding steps, then at growing intervals while nothing changes) it runs a few steps at each
candidate count, interleaved, and keeps the count whose steps were fastest.  A trial only
compares steps of the same number of rows.  It is used where the library chose the thread
count (not where the user set ``LLAMA_NUM_THREADS`` or ``OMP_NUM_THREADS``), on the CPU, for
eager steps (a compiled step fixes its threads when it is compiled).
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)


class ThreadTuner:
    """Chooses among ``candidates`` thread counts (the first is used until a trial says
    otherwise) by timing decoding steps.

    Call :meth:`before_step` with the step's decoding rows (0 for a step that prefills) and
    :meth:`after_step` with its seconds.  A trial runs ``trial_rounds`` rounds of one step per
    candidate (the order rotating), then switches to the candidate with the lowest median if
    it beats the current one's by ``margin``.  Trials start after ``first_trial_after``
    decoding steps and then every ``trial_every`` steps, an interval that doubles (up to
    ``longest_interval``) each time a trial confirms the current count and starts over when
    one changes it.

    ``set_threads`` sets the count (torch's by default) and ``get_threads`` reads the count in
    force: by default torch's own where torch's is the one set, so that a count other code set
    between steps (torch.set_num_threads in the user's code, or a test's) is set back at the
    next step; otherwise the count last set here.
    """

    def __init__(self, candidates: Sequence[int], *, first_trial_after: int = 2, trial_every: int = 64,
                 longest_interval: int = 1024, trial_rounds: int = 3, margin: float = 0.05,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Optional[Callable[[], int]] = None) -> None:
        counts = list(dict.fromkeys(int(c) for c in candidates))
        if not counts or min(counts) < 1:
            raise ValueError(f"thread counts must be positive, got {list(candidates)}")
        self.candidates = counts
        self.current = counts[0]
        self.trial_every = trial_every
        self.longest_interval = longest_interval
        self.trial_rounds = trial_rounds
        self.margin = margin
        self._set = set_threads
        self._get: Callable[[], Optional[int]] = get_threads or (
            torch.get_num_threads if set_threads is torch.set_num_threads else lambda: self._applied)
        self._interval = trial_every
        self._until_trial = first_trial_after
        self._schedule: list[int] = []  # the counts the trial's remaining steps run on
        self._times: dict[int, list[float]] = {}
        self._rows: Optional[int] = None  # the rows every step of the running trial has
        self._step_threads: Optional[int] = None  # the count the step in progress runs on
        self._applied: Optional[int] = None  # the count last set
        self.trials = 0  # completed trials (for tests and logs)

    @staticmethod
    def candidates_for(threads: int) -> list[int]:
        """The counts worth trying beside ``threads``: it, half of it, and one."""
        return list(dict.fromkeys([threads, max(1, threads // 2), 1]))

    def before_step(self, decode_rows: int) -> None:
        """Set the threads for the next step (``decode_rows``: its decoding rows, 0 when it
        prefills: such a step is never timed)."""
        threads = self.current
        if decode_rows > 0:
            if not self._schedule and self._until_trial <= 0:
                self._start_trial(decode_rows)
            if self._schedule:
                if decode_rows != self._rows:  # another batch: start over later
                    self._abandon_trial()
                else:
                    threads = self._schedule[0]
            else:
                self._until_trial -= 1
        elif self._schedule:
            self._abandon_trial()
        self._step_threads = threads if self._schedule else None
        self._apply(threads)

    def after_step(self, seconds: float) -> None:
        """The time the step begun by :meth:`before_step` took."""
        if self._step_threads is None or not self._schedule:
            return
        self._times.setdefault(self._step_threads, []).append(seconds)
        self._schedule.pop(0)
        self._step_threads = None
        if not self._schedule:
            self._finish_trial()

    def _start_trial(self, rows: int) -> None:
        n = len(self.candidates)
        self._schedule = [self.candidates[(r + k) % n] for r in range(self.trial_rounds) for k in range(n)]
        self._times = {}
        self._rows = rows

    def _abandon_trial(self) -> None:
        self._schedule, self._times, self._rows = [], {}, None
        self._until_trial = self.trial_every

    def _finish_trial(self) -> None:
        self.trials += 1
        medians = {c: statistics.median(t) for c, t in self._times.items()}
        best = min(medians, key=medians.__getitem__)
        if best != self.current and medians[best] < (1 - self.margin) * medians[self.current]:
            logger.info("CPU threads: %d instead of %d (decoding steps of %d row(s): %.2f against %.2f ms)",
                        best, self.current, self._rows, 1e3 * medians[best], 1e3 * medians[self.current])
            self.current = best
            self._interval = self.trial_every
        else:
            self._interval = min(2 * self._interval, self.longest_interval)
        self._until_trial = self._interval
        self._rows = None
        self._apply(self.current)

    def _apply(self, threads: int) -> None:
        if threads != self._get():
            self._set(threads)
        self._applied = threads
