"""``kv_cache_memory`` with LoRA adapters served unmerged: their slots' factors, allocated when
the adapters are loaded (before the engine), are held when the sizing reads the device, so
they come out of the KV cache's share; the profiling passes and the compiled steps warmed up
are those of rows served with adapters.  Checked on the CPU with the fake device of
test_kv_cache_memory.py, whose allocator here also holds the model's LoRA factors."""

from __future__ import annotations

import logging

import pytest
import torch

import helpers
from llama.engine import Engine
from llama.layers.lora import lora_factor_bytes
from lora_serve_helpers import ALL_TARGETS, random_adapter
from test_kv_cache_memory import MIB, FakeDevice, per_token, pool_bytes

N_SLOTS = 3  # adapters, slot 0 (no adapter) aside
RANK = 16


class LoraFakeDevice(FakeDevice):
    """:class:`FakeDevice` whose allocator also holds the LoRA factors ``model`` has when it is
    read, as a GPU's would (they are allocated when the adapters are loaded)."""

    def __init__(self, model, **kw) -> None:
        self.model = model
        super().__init__(model, **kw)

    @property
    def reserved(self) -> int:
        return super().reserved + lora_factor_bytes(self.model)


@pytest.fixture(scope="module")
def served(llama3_checkpoint):
    """A float32 model serving three adapters of every layer (ranks 16, 8, 4) unmerged."""
    weights, n = llama3_checkpoint.weights, llama3_checkpoint.params["n_layers"]
    adapters = {f"a{i}": random_adapter(f"a{i}", weights, n, RANK >> i, ALL_TARGETS, seed=i) for i in range(N_SLOTS)}
    return helpers.build(llama3_checkpoint, max_seq_len=256, max_batch_size=4, dtype="float32", compile=False,
                         lora_adapters=adapters)


def expected_factor_bytes(model) -> int:
    """Every targeted layer's slots (and slot 0) of rank RANK: (slots, r, in) and (slots, r, out),
    float32 (unfused layers: a float32 model on the CPU is not packed)."""
    total = 0
    for block in model.layers:
        for layer in [*(getattr(block.attention, n) for n in ("wq", "wk", "wv", "wo")),
                      *(getattr(block.feed_forward, n) for n in ("w1", "w2", "w3"))]:
            out_features, in_features = layer.weight.shape
            total += (N_SLOTS + 1) * RANK * (in_features + out_features) * 4
    return total


@pytest.mark.slow  # over ~1 s: two models built
def test_lora_factor_bytes_counts_every_slot_of_every_layer(served, llama3_checkpoint):
    assert lora_factor_bytes(served.model) == expected_factor_bytes(served.model)
    plain = helpers.build(llama3_checkpoint, max_seq_len=64, max_batch_size=1, dtype="float32", compile=False)
    assert lora_factor_bytes(plain.model) == 0


def sized(llama, device_class, record: list, *, lora: bool = True, **device):
    """An engine over ``llama``'s model sized by kv_cache_memory=0.5 on a fake device of
    ``device_class``, serving its adapters if ``lora``; ``record`` gets each pass's LoRA slots."""
    model = llama.model
    fake = device_class(model, **device)
    spied = model.hidden_states

    def recording(*args, **kw):
        slots = kw.get("lora_slots")
        record.append(None if slots is None else slots.tolist())
        return spied(*args, **kw)

    model.hidden_states = recording
    try:
        engine = Engine(model, llama.tokenizer, generator=torch.Generator(), prefill_chunk=64, kv_cache_memory=0.5,
                        device_memory=fake, lora=llama.engine.lora if lora else None)
    finally:
        del model.new_kv_cache, model.hidden_states  # the class's methods again
    return engine, fake


@pytest.mark.slow  # over ~1 s: two sized engines
def test_the_adapters_factors_come_out_of_the_kv_caches_share(served, caplog):
    """total 64 MiB, fraction 0.5, weights 4 MiB, activations 10 MiB: without adapters the pool
    is the most whole blocks within 18 MiB; with the adapters' factors held (0.64 MiB here) it
    is that much smaller, and the log says how much of the weights they are."""
    factors = expected_factor_bytes(served.model)
    block = per_token(served.model) * 16
    assert factors > 4 * block  # more than the sizing's rounding to whole blocks
    device = dict(total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    plain, _ = sized(served, FakeDevice, [], lora=False, **device)
    assert pool_bytes(plain.kv.cache) <= 18 * MIB < pool_bytes(plain.kv.cache) + block
    with caplog.at_level(logging.INFO, logger="llama.engine.kv_sizing"):
        engine, _ = sized(served, LoraFakeDevice, [], **device)
    allocated = pool_bytes(engine.kv.cache)
    assert allocated <= 18 * MIB - factors < allocated + block
    assert f"(LoRA adapters {factors / 2**30:.3f} GiB)" in caplog.text


@pytest.mark.slow  # over ~1 s: a sized engine
def test_the_profiling_passes_serve_an_adapter_on_every_row(served):
    """The largest prefill (4 rows) and the largest decoding batch (4 rows) each give every row
    an adapter, the three in turn: the low-rank products' memory is in the passes' peak."""
    record: list = []
    sized(served, LoraFakeDevice, record, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    assert record == [[1, 2, 3, 1], [1, 2, 3, 1]]


@pytest.mark.slow  # over ~1 s: a sized engine
def test_the_compiled_steps_warmed_up_for_the_sizing_serve_the_adapters(served, monkeypatch):
    """The provisional runner's compiled steps are the engine's: with the rows' LoRA slots (a
    step without them is another graph, which the engine never runs)."""
    from llama.engine.runner import ModelRunner

    seen: list = []
    monkeypatch.setattr(ModelRunner, "compile", lambda self: setattr(self, "fixed_shape", True))
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: seen.append(self.lora))
    model = served.model
    fake = LoraFakeDevice(model, total=64 * MIB, weights=4 * MIB, activations=10 * MIB)
    try:
        Engine(model, served.tokenizer, generator=torch.Generator(), prefill_chunk=64, compile=True,
               kv_cache_memory=0.5, device_memory=fake, lora=served.engine.lora)
    finally:
        del model.new_kv_cache, model.hidden_states
    assert seen == [served.engine.lora, served.engine.lora]  # the provisional runner's, then the real one's
