"""A step's inputs staged through pinned host buffers on their way to a GPU
(:mod:`llama.engine.staging`).

On the CPU the staging runs with unpinned buffers and a fake stream whose copies run late
(when an event recorded after them is waited for), as a GPU's copies read pinned memory
when the stream reaches them: a buffer written again too early then sends the wrong values,
which the tests see.  The engine, staged this way, gives the tokens of the plain path (greedy
and seeded sampling, chunked prompts, steps that prefill and decode, preemption), and its
steps allocate no buffers.  On a GPU (marked cuda) the buffers are pinned and the tokens
equal the plain path's."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import build
from llama.engine import RequestSettings
from llama.engine.staging import InputStaging

CPU = torch.device("cpu")


class FakeStream:
    """Copies queued by :meth:`copy`, run in order, reading their source only then: when an
    event recorded after them is waited for, or at :meth:`run_all` (``late`` False: at once).
    ``log`` says what happened."""

    def __init__(self, late: bool = True) -> None:
        self.late = late
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ran = 0  # copies run so far
        self.log: list[str] = []
        self.events = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append((dst, src))
        self.log.append("copy")
        if not self.late:
            self.run_all()

    def run_until(self, n: int) -> None:
        for dst, src in self.queue[self.ran : n]:
            dst.copy_(src)
        self.ran = max(self.ran, n)

    def run_all(self) -> None:
        self.run_until(len(self.queue))

    def event(self) -> FakeEvent:
        return FakeEvent(self, waits=True)


class FakeEvent:
    """Recorded after the copies queued so far; waiting for it runs them (``waits``: False, a
    broken event whose wait returns at once)."""

    def __init__(self, stream: FakeStream, waits: bool) -> None:
        stream.events += 1
        self.name, self.stream, self.waits, self.position = f"e{stream.events}", stream, waits, None

    def record(self) -> None:
        self.position = len(self.stream.queue)
        self.stream.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.stream.log.append(f"wait {self.name}")
        if self.waits:
            self.stream.run_until(self.position)


def _stage_steps(staging: InputStaging, stream: FakeStream, steps: int) -> list[list[list[int]]]:
    """Stage ``steps`` steps of two inputs (step k: k and 100 + k, two rows each), then let the
    stream run every copy; what each step's device tensors hold."""
    outs = []
    for k in range(steps):
        staged = staging.take("decode", [(2, 1), (2,)])
        staged.host[0].fill_(k)
        staged.host[1].fill_(100 + k)
        outs.append(staged.to_device())
    stream.run_all()
    return [[t.flatten().tolist() for t in out] for out in outs]


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_buffer_is_written_again_only_after_its_copies_ran(slots):
    """Every step's device tensors hold that step's values, although the stream ran no copy
    before a buffer came round again: taking it waited for the copies from it."""
    stream = FakeStream()
    staging = InputStaging(CPU, pin_memory=False, new_event=stream.event, copy=stream.copy, slots=slots)
    staging.reserve("decode", 4)
    assert _stage_steps(staging, stream, 5) == [[[k, k], [100 + k, 100 + k]] for k in range(5)]


def test_the_fake_stream_sees_a_buffer_written_too_early():
    """The check above can fail: with events whose wait returns at once, the first step's
    copies run after the buffer was written again, and send the second step's values."""
    stream = FakeStream()
    staging = InputStaging(CPU, pin_memory=False, new_event=lambda: FakeEvent(stream, waits=False),
                           copy=stream.copy, slots=1)
    staging.reserve("decode", 4)
    assert _stage_steps(staging, stream, 2)[0] == [[1, 1], [101, 101]]


def test_the_event_follows_the_copies_and_is_waited_for_before_the_buffer_is_handed_out():
    stream = FakeStream()
    staging = InputStaging(CPU, pin_memory=False, new_event=stream.event, copy=stream.copy, slots=2)
    staging.reserve("prefill", 8)
    first = staging.take("prefill", [(3,), (1, 2)])
    first.to_device()
    second = staging.take("prefill", [(3,)])
    second.to_device()
    assert stream.log == ["copy", "copy", "record e1", "copy", "record e2"] and stream.ran == 0
    third = staging.take("prefill", [(3,)])
    assert stream.log[-1] == "wait e1" and stream.ran == 2  # before the caller may write it
    assert third.host[0].data_ptr() == first.host[0].data_ptr() != second.host[0].data_ptr()
    third.to_device()
    assert stream.log[-2:] == ["copy", "record e1"]  # the slot's one event, recorded again


def test_buffers_are_allocated_once_and_grow_only_when_a_step_needs_more():
    staging = InputStaging(CPU, pin_memory=False, new_event=FakeStream().event, slots=2)
    staging.reserve("decode", 10)
    allocated, pointers = staging.allocations, [b.data_ptr() for b in staging.buffers("decode")]
    for rows in (1, 4, 2, 5, 3):
        staging.take("decode", [(rows, 1), (rows, 1)]).to_device()
    assert staging.allocations == allocated
    assert [b.data_ptr() for b in staging.buffers("decode")] == pointers
    staging.take("decode", [(12,)]).to_device()  # more than reserved: that slot's buffer grows
    assert staging.allocations == allocated + 1
    assert sorted(b.numel() for b in staging.buffers("decode")) == [10, 20]  # twice its size at least


def test_on_the_cpu_nothing_is_staged(llama3_checkpoint):
    assert InputStaging.for_device(CPU) is None
    assert build(llama3_checkpoint).engine.runner.staging is None


# -- the engine, staged on the CPU ----------------------------------------------------------

def stage_on_the_cpu(engine) -> FakeStream:
    """Stage ``engine``'s inputs as on a GPU (unpinned buffers, copies run at once, fake events)."""
    stream = FakeStream(late=False)
    engine.runner.use_staging(InputStaging(CPU, pin_memory=False, new_event=stream.event, copy=stream.copy))
    return stream


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 250) for _ in range(n - 1)]


SETTINGS = [
    RequestSettings(max_new_tokens=14, temperature=0),
    RequestSettings(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=5),
    RequestSettings(max_new_tokens=14, temperature=1.0, top_k=20, seed=6, logprobs=True, top_logprobs=2),
    RequestSettings(max_new_tokens=14, temperature=0.7, seed=7, echo=True, logprobs=True),
]


def _run(checkpoint, staged: bool, *, late: int = 0, prompts=None, settings=SETTINGS, **build_kw):
    """Results of ``settings`` on ``prompts``, the last ``late`` of them submitted once the
    others decode (so that a step prefills and decodes); ``staged`` or plain; and the stream."""
    llama = build(checkpoint, max_seq_len=128, max_batch_size=4, dtype="float32", **build_kw)
    engine = llama.engine
    engine.runner.threads = None  # one thread count for both runs (another sums in another order)
    stream = stage_on_the_cpu(engine) if staged else None
    prompts = prompts or [prompt(i, 5 + 7 * i) for i in range(len(settings))]
    pairs = list(zip(prompts, settings))
    handles = [engine.submit(p, s) for p, s in pairs[: len(pairs) - late]]
    for _ in range(3):
        engine.step()
    handles += [engine.submit(p, s) for p, s in pairs[len(pairs) - late :]]
    results = [h.result() for h in handles]
    return [(r.tokens, r.logprobs, r.prompt_logprobs) for r in results], engine, stream


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("prefill_chunk", [512, 6])
def test_staged_inputs_give_the_plain_paths_tokens(llama3_checkpoint, prefill_chunk):
    """Greedy, top-p, top-k with log-probabilities, and an echoed prompt scored; prompts fed
    whole or in chunks of 6 tokens; the last request arrives while the others decode."""
    plain, _, _ = _run(llama3_checkpoint, False, late=1, prefill_chunk=prefill_chunk)
    staged, engine, stream = _run(llama3_checkpoint, True, late=1, prefill_chunk=prefill_chunk)
    assert staged == plain
    assert stream.log.count("copy") >= 3 * 14  # the staged path ran: three inputs a decoding step


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_staged_inputs_give_the_plain_paths_tokens_through_preemptions(llama3_checkpoint):
    """A pool too small for all four requests: some are preempted and resumed (their context
    prefilled again, their pending token fed by a decoding step)."""
    prompts = [prompt(10 + i, 20 + 9 * i) for i in range(4)]
    settings = [RequestSettings(max_new_tokens=40, temperature=0)] * 2 + \
        [RequestSettings(max_new_tokens=40, temperature=0.9, seed=s) for s in (1, 2)]
    kw = dict(prompts=prompts, settings=settings, kv_cache_tokens=128, kv_block_size=8)
    plain, plain_engine, _ = _run(llama3_checkpoint, False, **kw)
    staged, engine, _ = _run(llama3_checkpoint, True, **kw)
    assert plain_engine.stats()["preemptions_total"] > 0 and engine.stats()["preemptions_total"] > 0
    assert staged == plain


def test_steps_allocate_no_buffers(llama3_checkpoint):
    """Buffers reserved for max_batch_size rows and the prefill chunk serve every step: none
    allocated, none replaced, while rows and prompts come and go."""
    engine = build(llama3_checkpoint, max_seq_len=128, max_batch_size=4).engine
    stage_on_the_cpu(engine)
    staging = engine.runner.staging
    allocated = staging.allocations
    pointers = {group: [b.data_ptr() for b in staging.buffers(group)] for group in ("decode", "prefill")}
    handles = [engine.submit(prompt(i, 3 + 11 * i), RequestSettings(max_new_tokens=3 + 4 * i, temperature=0))
               for i in range(4)]
    for h in handles:
        h.result()
    later = engine.submit(prompt(9, 60), RequestSettings(max_new_tokens=5, temperature=0))
    later.result()
    assert staging.allocations == allocated
    assert {group: [b.data_ptr() for b in staging.buffers(group)] for group in pointers} == pointers


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=[pytest.mark.compile, pytest.mark.slow])])
def test_on_a_gpu_inputs_are_pinned_and_tokens_equal_the_plain_paths(llama3_checkpoint, compile):
    """Eager and compiled (CUDA graphs).  Both runs on one engine, so on the same compiled
    graphs (two compilations may tune their kernels differently, and logits then differ in
    rounding: an H100 run gave the same tokens, log-probabilities apart in the 7th digit), each
    run in a cache scope of its own (the second must not find the first's prompts cached)."""
    llama = build(llama3_checkpoint, max_seq_len=128, max_batch_size=4, dtype="float32", device="cuda",
                  compile=compile)
    assert llama.compiled == compile
    runner = llama.engine.runner
    staging = runner.staging
    assert staging is not None
    assert all(b.is_pinned() for group in ("decode", "prefill") for b in staging.buffers(group))
    seen = []

    def copy(dst, src):  # what the engine copies: pinned host memory to the GPU
        seen.append((src.is_pinned(), src.device.type, dst.device.type))
        dst.copy_(src, non_blocking=True)

    staging.copy = copy
    prompts = [prompt(i, 5 + 7 * i) for i in range(4)]
    outcomes = []
    for staged in (True, False):
        runner.use_staging(staging if staged else None)
        settings = [RequestSettings(**{**s.__dict__, "cache_scope": str(staged)}) for s in SETTINGS]
        handles = [llama.engine.submit(p, s) for p, s in zip(prompts, settings)]
        outcomes.append([(r.tokens, r.logprobs, r.prompt_logprobs) for r in (h.result() for h in handles)])
    assert outcomes[0] == outcomes[1]
    assert seen and set(seen) == {(True, "cpu", "cuda")}
