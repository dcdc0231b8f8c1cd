"""``kv_cache_memory``: the KV cache sized from the GPU's total memory after profiling the
largest passes (llama.engine.kv_sizing), checked on the CPU against a fake device whose
readings follow what the engine allocates and runs: this process's allocator holds the
weights and every live KV pool, and peaks ``activations`` above that during a forward pass.
The sizes are checked against the pools the engine really allocated; the CUDA readings
themselves need a GPU (benchmarks/gpu_check.py)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

import helpers
from llama.engine import Engine, RequestSettings
from llama.engine.kv_sizing import MemoryReading, kv_cache_tokens_for_memory, largest_prefill
from llama.layers.kv_cache import kv_cache_bytes

MIB = 2**20


def build(checkpoint, **kw):
    return helpers.build(checkpoint, **{"max_seq_len": 256, "max_batch_size": 4, "dtype": "float32",
                                        "compile": False, **kw})


def pool_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.buffers())


def per_token(model) -> int:
    attention = model.layers[0].attention
    return kv_cache_bytes(len(model.layers), 1, attention.n_local_kv_heads, attention.head_dim, model.dtype)


class FakeDevice:
    """A GPU of ``total`` bytes as the sizing reads it.  This process's allocator holds
    ``weights`` and every KV pool the model (and the ``draft`` model) makes while it is alive;
    a forward pass raises its peak ``activations`` above what it holds.  ``outside`` bytes are
    held outside torch (the CUDA context, other processes).  ``calls`` records what happened,
    in order (the draft's pools and passes as ``"draft pool"`` and ``"draft forward"``)."""

    def __init__(self, model, *, total: int, weights: int, activations: int, outside: int = 0, draft=None) -> None:
        self.total, self.weights, self.activations, self.outside = total, weights, activations, outside
        self.calls: list = []
        self.pools: dict[int, int] = {}  # live pools' bytes, by id
        self.peak = weights
        self.spy(model, "")
        if draft is not None:
            self.spy(draft, "draft ")

    def spy(self, model, label: str) -> None:
        new_kv_cache, hidden_states = model.new_kv_cache, model.hidden_states

        def spy_new_kv_cache(*args, **kw):
            cache = new_kv_cache(*args, **kw)
            key, size = id(cache), pool_bytes(cache)
            self.pools[key] = size
            weakref.finalize(cache, self.pools.pop, key, None)
            self.calls.append((label + "pool", size))
            self.peak = max(self.peak, self.reserved)
            return cache

        def spy_hidden_states(tokens, positions, kv_len, cache, *args, **kw):
            self.calls.append((label + "forward", tuple(tokens.shape), kv_len))
            self.peak = max(self.peak, self.reserved + self.activations)
            return hidden_states(tokens, positions, kv_len, cache, *args, **kw)

        model.new_kv_cache, model.hidden_states = spy_new_kv_cache, spy_hidden_states

    @property
    def reserved(self) -> int:
        return self.weights + sum(self.pools.values())

    def read(self) -> MemoryReading:
        self.calls.append("read")
        reserved = self.reserved
        return MemoryReading(total=self.total, free=self.total - self.outside - reserved, reserved=reserved,
                             peak_reserved=max(self.peak, reserved))

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")
        self.peak = self.reserved

    def release_cached(self) -> None:
        self.calls.append("release_cached")
        gc.collect()


def sized_engine(llama, fraction: float = 0.5, **device):
    """An engine over ``llama``'s model sized by ``kv_cache_memory=fraction`` on a fake device,
    and the device (its spies removed again from the model afterwards)."""
    model = llama.model
    fake = FakeDevice(model, **device)
    try:
        engine = Engine(model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64,
                        kv_cache_memory=fraction, device_memory=fake)
    finally:
        del model.new_kv_cache, model.hidden_states  # the class's methods again
    return engine, fake


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_the_pool_gets_the_fraction_of_total_memory_less_weights_and_the_profiled_peak(llama3_checkpoint):
    """total 64 MiB, fraction 0.5, weights 4 MiB, activations 10 MiB: the pool the engine
    allocated is the most whole blocks within 32 - 4 - 10 = 18 MiB; 5 MiB more activations
    take 5 MiB from it (within a block)."""
    llama = build(llama3_checkpoint)
    block = per_token(llama.model) * 16
    engine, _ = sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    allocated = pool_bytes(engine.kv.cache)
    assert allocated <= 18 * MIB < allocated + block
    assert engine.kv.capacity == allocated // (per_token(llama.model) * 16) * 16 - 16  # the scratch block aside
    assert engine.stats()["kv_blocks_total"] * block == allocated - block

    smaller, _ = sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=15 * MIB)
    assert abs((allocated - pool_bytes(smaller.kv.cache)) - 5 * MIB) < block


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_memory_held_outside_torch_before_the_engine_does_not_count_but_must_be_free(llama3_checkpoint):
    """Other processes holding 20 MiB leave the pool as it was (the fraction is this process's
    share, as vLLM's gpu_memory_utilization); holding 40 MiB, the 32 MiB asked for is not free:
    refused, naming the fraction that fits."""
    llama = build(llama3_checkpoint)
    alone, _ = sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    shared, _ = sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=10 * MIB, outside=20 * MIB)
    assert pool_bytes(shared.kv.cache) == pool_bytes(alone.kv.cache)
    with pytest.raises(RuntimeError, match=r"asks for 0.03 GiB.*give kv_cache_memory=0.37 or less"):
        sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=10 * MIB, outside=40 * MIB)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_the_profiling_passes_run_before_the_sizing_and_the_real_pool_after(llama3_checkpoint):
    """Order: cached memory released, a reading, the peak reset, a provisional pool of
    max_seq_len tokens, the largest prefill (max_batch_size rows, the width the chunk leaves
    them, attending to all max_seq_len positions) and the largest decoding batch, then the
    reading that sizes; only then the real pool."""
    llama = build(llama3_checkpoint)
    engine, fake = sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    calls = fake.calls
    rows, width = largest_prefill(4, 64, 256)
    assert (rows, width) == (4, 61)  # 4 rows share 64 tokens: the longest holds 61
    assert calls[:3] == ["release_cached", "read", "reset_peak"]
    assert calls[3] == ("pool", (1 + 256 // 16) * 16 * per_token(llama.model))  # max_seq_len and the scratch block
    assert calls[4:6] == [("forward", (rows, width), 256), ("forward", (4, 1), 256)]
    sizing_read = 6
    assert calls[sizing_read] == "read"
    real_pool = calls.index(("pool", pool_bytes(engine.kv.cache)))
    assert real_pool > sizing_read
    assert not [c for c in calls[sizing_read:] if c[0] == "forward"]  # nothing ran after the sizing read


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_compiled_steps_are_warmed_up_before_the_sizing_and_again_against_the_real_pool(llama3_checkpoint,
                                                                                       monkeypatch):
    """Their CUDA graphs' memory is measured, and the graphs captured against the provisional
    pool are never used: the real pool's runner compiles and warms up its own step."""
    from llama.engine.runner import ModelRunner

    llama = build(llama3_checkpoint)
    log: list = []
    runners: list = []

    def compile(self):
        log.append(("compile", id(self)))
        runners.append(self)
        self.fixed_shape = True

    monkeypatch.setattr(ModelRunner, "compile", compile)
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: log.append(("warm_up", id(self))))
    model = llama.model
    fake = FakeDevice(model, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    log = fake.calls  # one record of the readings, the passes and the compilations
    try:
        engine = Engine(model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64, compile=True,
                        kv_cache_memory=0.5, device_memory=fake)
    finally:
        del model.new_kv_cache, model.hidden_states
    provisional, real = runners
    assert real is engine.runner and provisional is not real and provisional.kv is not engine.kv
    real_pool = ("pool", pool_bytes(engine.kv.cache))
    assert log == [
        "release_cached", "read", "reset_peak", ("pool", (1 + 256 // 16) * 16 * per_token(model)),
        # the graphs first, so that the passes' peak is measured over their memory
        ("compile", id(provisional)), ("warm_up", id(provisional)), "release_cached",
        ("forward", largest_prefill(4, 64, 256), 256), ("forward", (4, 1), 256), "read",  # the sizing
        "release_cached", "read", real_pool, ("compile", id(real)), ("warm_up", id(real)), "read"]


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_step_that_fails_to_compile_while_profiling_is_not_compiled_again(llama3_checkpoint, monkeypatch):
    from llama.engine.runner import ModelRunner

    llama = build(llama3_checkpoint)
    compiled: list = []
    monkeypatch.setattr(ModelRunner, "compile", lambda self: compiled.append(self))  # fails: stays eager
    model = llama.model
    fake = FakeDevice(model, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    try:
        engine = Engine(model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64, compile=True,
                        kv_cache_memory=0.5, device_memory=fake)
    finally:
        del model.new_kv_cache, model.hidden_states
    assert len(compiled) == 1 and not engine.runner.compiled


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_too_little_memory_for_one_request_is_refused_with_what_to_change(llama3_checkpoint):
    """32 MiB allowed, less 4 of weights and 28 MiB - 64 KiB of activations, leave 64 KiB: 8
    blocks of 16 tokens (the scratch block among them), fewer than max_seq_len."""
    llama = build(llama3_checkpoint)
    assert per_token(llama.model) * 16 == 8 * 1024
    with pytest.raises(RuntimeError) as refused:
        sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=28 * MIB - 64 * 1024)
    message = str(refused.value)
    assert "fewer than max_seq_len=256" in message
    for advice in ("Lower max_batch_size=4 or prefill_chunk=64", "larger kv_cache_memory (below 1)",
                   "smaller dtype", "quantize='int8'"):
        assert advice in message, message


@pytest.mark.parametrize("fraction", [1, 1.0, 1.5, 0, 0.0, -0.5, float("nan"), True, "0.9"])
def test_a_fraction_outside_0_to_1_is_refused_with_the_range(llama3_checkpoint, fraction):
    llama = build(llama3_checkpoint)
    with pytest.raises(ValueError, match=r"kv_cache_memory must be a fraction in \(0, 1\) of the GPU's total memory"):
        sized_engine(llama, fraction, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        helpers.build(llama3_checkpoint, max_seq_len=64, kv_cache_memory=fraction)  # before reading the checkpoint


def test_on_the_cpu_kv_cache_memory_is_refused_as_before(llama3_checkpoint):
    """kv_cache_memory reads GPU memory: on the CPU it is refused (give kv_cache_tokens)."""
    llama = build(llama3_checkpoint)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        helpers.build(llama3_checkpoint, max_seq_len=64, kv_cache_memory=0.5)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(llama.model, llama.tokenizer, generator=torch.Generator(), kv_cache_memory=0.5)
    with pytest.raises(ValueError, match="not both"):
        helpers.build(llama3_checkpoint, max_seq_len=64, kv_cache_memory=0.5, kv_cache_tokens=64)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_sized_engine_generates_what_an_engine_of_that_size_does(llama3_checkpoint):
    """The profiling passes wrote only the provisional pool's scratch block, and that pool is gone."""
    llama = build(llama3_checkpoint)
    engine, _ = sized_engine(llama, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    reference = Engine(llama.model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64,
                       kv_cache_tokens=engine.kv.capacity)
    settings = RequestSettings(max_new_tokens=12, temperature=0)
    prompts = [[1] + list(range(20, 20 + n)) for n in (5, 70, 130)]
    got = [engine.submit(p, settings) for p in prompts]
    want = [reference.submit(p, settings) for p in prompts]
    assert [h.result().tokens for h in got] == [h.result().tokens for h in want]


@pytest.fixture(scope="module")
def one_layer_draft(tmp_path_factory, llama3_checkpoint):
    """A draft for the tiny Llama 3 checkpoint: its tokenizer and vocabulary, one layer of the
    target's two (half its K/V bytes per token)."""
    params = {**llama3_checkpoint.params, "n_layers": 1}
    weights = helpers.random_weights(params, params["vocab_size"], seed=5)
    ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("draft"), params, weights, 1, "vocab")
    return helpers.Checkpoint(ckpt, llama3_checkpoint.tokenizer_path, params, weights)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_with_a_draft_the_two_pools_share_what_is_left_by_their_bytes_per_token(llama3_checkpoint, one_layer_draft):
    """A draft of one layer beside a target of two: the same 18 MiB as without a draft (32 MiB
    allowed, 4 of weights, 10 of activations) holds both pools, as many blocks each, the
    draft's half the target's bytes; the draft's provisional pool and its largest pass (4
    rows, disable_by_batch_size, of a whole 64-token chunk over 256 positions) come before the
    sizing read.  And the sized engine generates what one given that many tokens does."""
    llama = build(llama3_checkpoint)
    draft = build(one_layer_draft).model
    model = llama.model
    assert per_token(draft) * 2 == per_token(model)
    fake = FakeDevice(model, total=64 * MIB, weights=4 * MIB, activations=10 * MIB, draft=draft)
    drafting = {"method": "draft", "draft_ckpt_dir": str(one_layer_draft[0]), "num_tokens": 4}
    try:
        engine = Engine(model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64, kv_cache_memory=0.5,
                        device_memory=fake, speculative=drafting, draft=draft)
    finally:
        for m in (model, draft):
            del m.new_kv_cache, m.hidden_states  # the class's methods again
    assert engine.draft is not None
    target_pool, draft_pool = pool_bytes(engine.kv.cache), pool_bytes(engine.draft.cache)
    assert draft_pool * 2 == target_pool  # as many blocks
    block = 16 * (per_token(model) + per_token(draft))  # a block of each
    assert target_pool + draft_pool <= 18 * MIB < target_pool + draft_pool + block
    assert engine.kv.capacity == target_pool // (per_token(model) * 16) * 16 - 16  # the scratch block aside

    calls = fake.calls
    provisional = 1 + 256 // 16
    assert calls[:5] == ["release_cached", "read", "reset_peak", ("pool", provisional * 16 * per_token(model)),
                         ("draft pool", provisional * 16 * per_token(draft))]
    sizing_read = calls.index("read", 5)
    assert ("draft forward", (4, 64), 256) in calls[5:sizing_read]
    assert calls.index(("draft pool", draft_pool)) > sizing_read

    reference = Engine(model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64,
                       kv_cache_tokens=engine.kv.capacity, speculative=drafting, draft=draft)
    settings = RequestSettings(max_new_tokens=12, temperature=0)
    prompts = [[1] + list(range(20, 20 + n)) for n in (5, 70)]
    got = [engine.submit(p, settings) for p in prompts]
    want = [reference.submit(p, settings) for p in prompts]
    assert [h.result().tokens for h in got] == [h.result().tokens for h in want]
    assert engine.stats()["spec_proposed_tokens_total"] > 0  # the draft proposed in its own pool


def test_kv_cache_tokens_for_memory_counts_whole_blocks_less_the_scratch_one(llama3_checkpoint):
    model = build(llama3_checkpoint).model
    unit = per_token(model)
    assert kv_cache_tokens_for_memory(model, 500 * unit, 16) == 480  # 31 blocks of 16, one the scratch block
    assert kv_cache_tokens_for_memory(model, 512 * unit - 1, 16) == 480
    assert kv_cache_tokens_for_memory(model, -unit, 16) == -16  # below max_seq_len: the caller refuses


@pytest.mark.parametrize("batch, chunk, max_seq_len, shape", [
    (4, 64, 256, (4, 61)),  # every row gets one token but the longest
    (1, 512, 256, (1, 256)),  # one request's chunk: at most max_seq_len
    (64, 64, 256, (64, 33)),  # past half the chunk: the most rows by the width 32 rows can have
    (1000, 513, 8192, (513, 257)),
])
def test_the_largest_prefill_bounds_every_pass_the_scheduler_can_make(batch, chunk, max_seq_len, shape):
    """Against every padded pass r rows can make (the longest of r chunks sharing ``chunk``
    tokens is at most chunk + 1 - r): no pass has more rows, or more tokens in its box."""
    rows, width = largest_prefill(batch, chunk, max_seq_len)
    assert (rows, width) == shape
    for r in range(1, min(batch, chunk) + 1):
        longest = min(chunk + 1 - r, max_seq_len)
        assert r <= rows and r * longest <= rows * width


@pytest.mark.slow  # a torchrun job of two processes
@pytest.mark.multiprocess
def test_every_rank_gets_the_pool_of_the_rank_with_the_least_memory(llama3_checkpoint, tmp_path):
    """The first rank's block tables index every rank's pool: ranks whose GPUs leave different
    room agree on the least; where one rank's leaves too little, every rank refuses (none waits
    for the others)."""
    from pathlib import Path

    worker = Path(__file__).parent / "kv_sizing_worker.py"

    # Both cases in one torchrun job: each rank sizes an engine for the first case, then another
    # over the same model for the second (where rank 1 refuses).
    cases = {"a": "64,48", "b": "64,28"}
    args = [str(llama3_checkpoint[0]), str(llama3_checkpoint[1])]
    for name, totals in cases.items():
        (tmp_path / name).mkdir()
        args += [str(tmp_path / name), totals]
    proc = helpers.torchrun(worker, args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, second = [json.loads((tmp_path / "a" / f"rank{r}.json").read_text()) for r in range(2)]
    block = first["per_token"] * 16
    # rank 1: 24 MiB allowed, less 4 of weights and 10 of activations: 10 MiB, whole blocks less the scratch one
    assert first["tokens"] == second["tokens"] == (10 * MIB // block - 1) * 16
    refused = [json.loads((tmp_path / "b" / f"rank{r}.json").read_text()) for r in range(2)]  # rank 1: 14 - 14 = 0
    assert "fewer than max_seq_len=256" in refused[1]["error"]
    assert refused[0]["error"].startswith("another model-parallel rank's GPU leaves its KV cache")
