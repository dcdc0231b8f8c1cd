"""The CPU thread count of decoding steps is chosen by timing them (llama.engine.cpu_threads):
simulated step times stand in for a quiet and a busy machine; the engine tunes only a count
the library chose."""

from __future__ import annotations

import pytest
import torch

import helpers
from llama.engine.cpu_threads import ThreadTuner


class Machine:
    """Step times by thread count, and the thread count the tuner sets."""

    def __init__(self, seconds_by_threads: dict[int, float]) -> None:
        self.seconds = dict(seconds_by_threads)
        self.threads = torch.get_num_threads()
        self.calls: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.calls.append(n)

    def decode(self, tuner: ThreadTuner, steps: int, rows: int = 1) -> list[int]:
        """Run ``steps`` decoding steps; the thread count each ran on."""
        used = []
        for _ in range(steps):
            tuner.before_step(rows)
            used.append(self.threads)
            tuner.after_step(self.seconds[self.threads])
        return used


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tuner_on(machine: Machine, **kw) -> ThreadTuner:
    machine.threads = 2
    return ThreadTuner([2, 1], set_threads=machine.set_threads, **kw)


def test_a_busy_machine_moves_decoding_to_fewer_threads():
    """Beside a CPU-bound process, 2 threads decode 2.5x slower than 1 (BENCHMARKS.md): the
    first trial, two steps in, moves to 1 thread and decoding stays there."""
    machine = Machine({2: 0.025, 1: 0.010})
    tuner = tuner_on(machine)
    used = machine.decode(tuner, 200)
    assert tuner.current == 1 and tuner.trials >= 1
    assert used[:2] == [2, 2] and used[2:8].count(2) == 3 and used[2:8].count(1) == 3  # the trial, interleaved
    assert set(used[8:72]) == {1}  # decoding after the trial, until the next one
    assert used.count(2) <= 2 + 3 * tuner.trials  # only trials go back to 2


def test_a_quiet_machine_keeps_its_threads_and_tries_less_often():
    """Where 2 threads are faster, they stay; trials, which confirm them, come at doubling
    intervals (so a quiet machine pays little for them)."""
    machine = Machine({2: 0.018, 1: 0.025})
    tuner = tuner_on(machine, trial_every=16, longest_interval=64)
    used = machine.decode(tuner, 400)
    assert tuner.current == 2
    one_thread = used.count(1)
    assert one_thread == 3 * tuner.trials
    # trials after 2, then 32, 64, 64, ... steps: far fewer than one every 16 steps
    assert 5 <= tuner.trials <= 8, tuner.trials


def test_a_machine_that_gets_busy_later_is_followed():
    machine = Machine({2: 0.018, 1: 0.025})
    tuner = tuner_on(machine, trial_every=16, longest_interval=64)
    machine.decode(tuner, 100)
    assert tuner.current == 2
    machine.seconds = {2: 0.060, 1: 0.025}  # another process starts
    machine.decode(tuner, 100)
    assert tuner.current == 1
    machine.seconds = {2: 0.018, 1: 0.025}  # and ends
    machine.decode(tuner, 200)
    assert tuner.current == 2


def test_a_small_difference_does_not_switch():
    machine = Machine({2: 0.0200, 1: 0.0195})  # 2.5 % faster: within the margin
    tuner = tuner_on(machine)
    machine.decode(tuner, 50)
    assert tuner.current == 2 and tuner.trials >= 1


def test_a_trial_compares_steps_of_one_batch_only():
    """A step of another row count, or one that prefills, ends the trial without a decision
    (its time says nothing about the other rows' steps)."""
    machine = Machine({2: 0.025, 1: 0.010})
    tuner = tuner_on(machine)
    machine.decode(tuner, 4, rows=1)  # 2 steps, then a trial's first 2 steps
    tuner.before_step(2)  # another batch size: the trial is dropped
    tuner.after_step(0.001)
    assert tuner.trials == 0 and tuner.current == 2 and machine.threads == 2
    tuner.before_step(0)  # a prefilling step is not timed
    tuner.after_step(100.0)
    assert tuner.trials == 0
    machine.decode(tuner, 200, rows=2)
    assert tuner.current == 1 and tuner.trials >= 1


def test_a_count_that_other_code_set_between_steps_is_set_back():
    """torch's thread count set behind the tuner's back between steps (the user's code; a test
    fixture before each test, under a model shared by many) used to stay for every later step:
    the tuner set a count only when its own choice changed.  Its count is set again at the
    next step, a trial's counts too."""
    tuner = ThreadTuner([1, 2], first_trial_after=3, trial_rounds=1)  # torch's own setter
    tuner.before_step(1)
    assert torch.get_num_threads() == 1
    tuner.after_step(0.01)
    torch.set_num_threads(2)
    tuner.before_step(1)
    assert torch.get_num_threads() == 1
    tuner.after_step(0.01)
    used = []
    for _ in range(4):  # a step, the trial's two (one at each count: 1 is faster), a step
        torch.set_num_threads(3)
        tuner.before_step(1)
        used.append(torch.get_num_threads())
        tuner.after_step({1: 0.01, 2: 0.05}.get(torch.get_num_threads(), 1.0))
    assert used == [1, 1, 2, 1] and tuner.trials == 1 and tuner.current == 1


def test_candidates_and_bad_counts():
    assert ThreadTuner.candidates_for(2) == [2, 1]
    assert ThreadTuner.candidates_for(16) == [16, 8, 1]
    assert ThreadTuner.candidates_for(1) == [1]
    with pytest.raises(ValueError, match="positive"):
        ThreadTuner([2, 0])


@pytest.mark.parametrize("env, tuned",
                         [({}, True), ({"LLAMA_NUM_THREADS": "2"}, False), ({"OMP_NUM_THREADS": "2"}, False)])
def test_only_a_count_the_library_chose_is_tuned(env, tuned, monkeypatch, llama3_checkpoint):
    """The user's LLAMA_NUM_THREADS or OMP_NUM_THREADS is kept as given; a count the library
    chose (its share of 2 or more CPUs) is tuned.  In this process, as a fresh one builds: the
    environment as the user set it, and the library's once-per-process choice not yet made
    (each case was a process of its own, another import of torch, ~3 s)."""
    from llama.runtime import host

    if host.cpu_count() < 2 and not env:
        pytest.skip("one CPU: nothing to tune")
    for name in ("LLAMA_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(host, "_threads_configured", None)
    llama = helpers.build(llama3_checkpoint, compile=False)
    assert host._threads_configured is not None  # Llama.build made the choice, from this environment
    assert (llama.engine.runner.threads is not None) == tuned


def test_compiled_steps_are_not_tuned(llama3_checkpoint, monkeypatch):
    """The tuner times eager steps; a compiled step keeps the process's threads (with or
    without the engine's other options, kv_cache_memory's sizing among them)."""
    from llama.engine import Engine
    from llama.engine.runner import ModelRunner
    from llama.runtime import host

    llama = helpers.build(llama3_checkpoint, compile=False)
    monkeypatch.setattr(host, "threads_chosen_here", lambda: 4)
    monkeypatch.setattr(ModelRunner, "compile", lambda self: setattr(self, "fixed_shape", True))
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: None)
    for compile in (False, True):
        engine = Engine(llama.model, llama.tokenizer, generator=torch.Generator(), compile=compile)
        assert (engine.runner.threads is None) == compile
