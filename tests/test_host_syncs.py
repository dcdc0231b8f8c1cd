"""A decoding step reads the device once: the chosen token ids (and, when a request asks for
log-probabilities, those too).  On a GPU every read makes the host wait for the device and
stops it from queueing the next step's work.

The CPU has no separate device, so the reads are counted as they would happen on one: every
call that turns a tensor into Python values (``tolist``, ``item``, ``bool()`` ...) and every
operation whose output size depends on tensor values (``nonzero``, boolean indexing), which
make the host wait on a GPU.  The sampler runs as it does off the CPU (``sync_free``).

Copies the other way wait too: on a GPU, a copy of pageable host memory made without
``non_blocking`` (``.to(device)``, ``torch.tensor(..., device=...)``, indexing with a Python
list) is queued, then the host waits for the whole stream (``cudaStreamSynchronize``), for
everything queued before it.  :func:`host_waits_of` counts those as well; a staged step
(:mod:`llama.engine.staging`, driven here as on a GPU) makes none."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import build
from llama.engine import RequestSettings
from llama.engine.staging import InputStaging

# Python-level calls that copy tensor data to the host.
HOST_READ_CALLS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
# Operators that read the device (values become Python numbers, or set an output's size).
HOST_READ_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                 "aten.unique_consecutive.default", "aten._unique2.default"}


class _Calls(TorchFunctionMode):
    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READ_CALLS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        boolean_index = name.startswith(("aten.index.", "aten.index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        )
        if name in HOST_READ_OPS or boolean_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def host_reads_of(fn) -> list[str]:
    """What ``fn()`` reads from the device, as above; a tolist's own ``_local_scalar_dense``
    calls (none: tolist reads memory directly) are not double-counted."""
    reads: list[str] = []
    with _Calls(reads), _Ops(reads):
        fn()
    return reads


class _Transfers(TorchFunctionMode):
    """Host-to-device copies that wait for the stream on a GPU (see the module's docstring)."""

    def __init__(self, waits: list[str]) -> None:
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "to" and not kwargs.get("non_blocking", False) and (
                kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args[1:])):
            self.waits.append("to(device)")
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.waits.append(f"{name}(device=)")
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and (
                isinstance(args[1], list) or isinstance(args[1], tuple) and any(isinstance(i, list) for i in args[1])):
            self.waits.append("index by list")
        return func(*args, **kwargs)


def host_waits_of(fn) -> list[str]:
    """What ``fn()`` would make the host wait for on a GPU: its reads (:func:`host_reads_of`),
    then its host-to-device copies that wait, sorted."""
    waits: list[str] = []
    with _Transfers(waits):
        reads = host_reads_of(fn)
    return reads + sorted(waits)


class _DoneEvent:
    """A CUDA event's stand-in on the CPU, where a copy is done when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


REQUESTS = [
    ([1, 5, 9], RequestSettings(max_new_tokens=12, temperature=0)),
    ([1, 2], RequestSettings(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5)),
    ([1, 7, 7, 3], RequestSettings(max_new_tokens=12, temperature=1.0, top_k=20, seed=6)),
    ([4, 4], RequestSettings(max_new_tokens=12, temperature=0.7, top_p=1.0, seed=7)),
]


def _decode_step_reads(llama, requests) -> tuple[list[list[str]], list]:
    """Submit ``requests``; run the first step (prompts), then count the reads of each later
    step (decoding only) until every request has finished."""
    engine = llama.engine
    engine.sampler.sync_free = True  # as off the CPU
    handles = [engine.submit(prompt, settings) for prompt, settings in requests]
    engine.step()  # the prompts
    per_step = []
    while not all(h.finished for h in handles):
        per_step.append(host_reads_of(engine.step))
    return per_step, [h.result() for h in handles]


def test_a_decoding_step_reads_the_device_once(llama3_checkpoint):
    """Greedy, top-p, top-k and plain temperature rows decoded together: one read a step (the
    token ids; the finite check travels with them).  Before, the finite check alone was a
    read, and each top-p row several."""
    llama = build(llama3_checkpoint, max_batch_size=4)
    per_step, results = _decode_step_reads(llama, REQUESTS)
    assert len(per_step) >= 10
    assert all(reads == ["tolist"] for reads in per_step), per_step


def test_log_probabilities_cost_one_more_read(llama3_checkpoint):
    llama = build(llama3_checkpoint, max_batch_size=4)
    asking = [(p, RequestSettings(**{**s.__dict__, "logprobs": True, "top_logprobs": 3})) for p, s in REQUESTS[:2]]
    per_step, results = _decode_step_reads(llama, asking + REQUESTS[2:])
    assert all(reads == ["tolist", "tolist"] for reads in per_step), per_step
    for result in results[:2]:
        assert len(result.logprobs) == len(result.tokens) and all(lp <= 0 for lp in result.logprobs)


@pytest.mark.parametrize("logprobs", [False, True])
def test_sync_free_sampling_chooses_the_same_tokens(llama3_checkpoint, logprobs):
    """The sampler off the CPU (whole-row sorts, failures marked on the device) chooses what
    the CPU's sampler chooses for the same seeds, and gives the same log-probabilities."""
    requests = [(p, RequestSettings(**{**s.__dict__, "logprobs": logprobs, "top_logprobs": 2 if logprobs else 0}))
                for p, s in REQUESTS]
    outcomes = []
    for sync_free in (False, True):
        llama = build(llama3_checkpoint, max_batch_size=4)
        llama.engine.sampler.sync_free = sync_free
        # the same thread count in both runs (the tuner may choose another on a busy machine,
        # and another count sums the logits in another order)
        llama.engine.runner.threads = None
        handles = [llama.engine.submit(p, s) for p, s in requests]
        outcomes.append([(r.tokens, r.logprobs) for r in (h.result() for h in handles)])
    assert outcomes[0] == outcomes[1]


def test_non_finite_logits_still_fail_their_request_alone(llama3_checkpoint):
    """With the check on the device, a row of NaN logits still ends its request with the
    finite check's error, and the others finish."""
    from llama.runtime.finite import NonFiniteError

    llama = build(llama3_checkpoint, max_batch_size=4)
    llama.engine.sampler.sync_free = True
    real = llama.engine.runner.run
    poisoned = {"done": False}

    def run(plan):
        out = real(plan)
        if out.logits is not None and not poisoned["done"] and len(out.requests) == 2:
            out.logits = out.logits.clone()
            out.logits[1, 3] = float("nan")
            poisoned["done"] = True
        return out

    llama.engine.runner.run = run
    good = llama.engine.submit([1, 5, 9], RequestSettings(max_new_tokens=6, temperature=0))
    bad = llama.engine.submit([1, 2], RequestSettings(max_new_tokens=6, temperature=0.8, seed=1))
    assert len(good.result().tokens) == 6
    with pytest.raises(NonFiniteError, match="1 NaN"):
        bad.result()


def _waits_per_step(llama, waits_of=host_waits_of) -> tuple[list, list]:
    """Submit :data:`REQUESTS` but the last, which comes after two decoding steps (a step that
    prefills and decodes) and ends with the others (a row alone would make the CPU's attention
    look at its slots, :func:`llama.layers.kv_cache.consecutive_start`, which a GPU does not);
    the waits of every step (``waits_of(engine.step)``) until all have finished."""
    engine = llama.engine
    engine.sampler.sync_free = True  # as off the CPU
    handles = [engine.submit(prompt, settings) for prompt, settings in REQUESTS[:-1]]
    per_step = [waits_of(engine.step) for _ in range(3)]
    prompt, settings = REQUESTS[-1]
    handles.append(engine.submit(prompt, RequestSettings(**{**settings.__dict__, "max_new_tokens": 9})))
    while not all(h.finished for h in handles):
        per_step.append(waits_of(engine.step))
    return per_step, [h.result() for h in handles]


def test_a_staged_step_waits_for_the_device_once(llama3_checkpoint):
    """Inputs staged as on a GPU: every step, prompts, decoding or both, waits once, for the
    chosen tokens.  The step where the last prompt is prefilled while the others decode waits
    nine times on the plain path (below): five for the prefill's inputs and the rows of its
    logits, three for the decoding inputs, one for the tokens."""
    llama = build(llama3_checkpoint, max_batch_size=4)
    llama.engine.runner.use_staging(InputStaging(torch.device("cpu"), pin_memory=False, new_event=_DoneEvent))
    per_step, results = _waits_per_step(llama)
    assert len(per_step) == 12
    assert all(waits == ["tolist"] for waits in per_step), per_step


def test_a_plain_step_waits_for_every_input_it_copies(llama3_checkpoint):
    """The plain path (the CPU's, and a GPU's before staging), for comparison, and as a check
    that the copies are seen: a decoding step copies its tokens, positions and block table."""
    llama = build(llama3_checkpoint, max_batch_size=4)
    per_step, results = _waits_per_step(llama)
    assert len(per_step) == 12
    prefill = ["tensor(device=)"] * 2 + ["to(device)"] * 3  # tokens, positions, tables; logit rows, columns
    decode = ["to(device)"] * 3
    assert per_step[0] == ["tolist"] + prefill
    assert per_step[1] == ["tolist"] + decode
    assert per_step[3] == ["tolist"] + sorted(prefill + decode)  # the late request's prompt, and decoding
    assert per_step[4:] == [["tolist"] + decode] * 8


def cuda_syncs_of(fn) -> int:
    """How many times ``fn()`` made the host wait for the GPU, as torch's sync debug mode sees
    it (a warning at each synchronising call: reads, and copies without non_blocking)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.cuda
def test_on_a_gpu_a_step_synchronises_once(llama3_checkpoint):
    """Counted by CUDA itself: every step of the staged engine waits once (its tokens); the
    plain path waits for each input it copies as well.  Each engine first generates once: the
    first eager forward pass of a process waited once more on an H100 (not in the staged
    code: it came before any buffer was waited for, and not after a compiled warm-up)."""
    counts = {}
    for staged in (True, False):
        llama = build(llama3_checkpoint, max_batch_size=4, device="cuda")
        if not staged:
            llama.engine.runner.use_staging(None)
        llama.engine.submit([8, 8, 8], RequestSettings(max_new_tokens=2, temperature=0)).result()
        counts[staged], _ = _waits_per_step(llama, cuda_syncs_of)
    assert counts[True] == [1] * 12, counts
    assert counts[False] == [6, 4, 4, 9] + [4] * 8, counts
