"""The memory check counts the largest prefill's activations (measured here on a small
model: the estimate must bound the real peak) and gives advice that fits the cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
from llama.args import ModelArgs
from llama.checkpoint.memory import check_memory, memory_need
from llama.model import Transformer
from llama.runtime import distributed

WORKER = Path(__file__).parent / "memory_peak_worker.py"
SMALL = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, multiple_of=64)

PEAK_CASES = [
    # (name, config): a masked prefill (any prefill after cached history), a causal one,
    # one whose FFN dominates, and bfloat16 with a large vocabulary.
    ("masked", {**SMALL, "batch": 4, "tokens": 512, "masked": True, "dtype": "float32"}),
    ("causal", {**SMALL, "batch": 4, "tokens": 512, "masked": False, "dtype": "float32"}),
    ("wide-ffn", {**SMALL, "dim": 128, "n_heads": 2, "n_kv_heads": 2, "ffn_dim_multiplier": 8.0, "batch": 2,
                  "tokens": 1024, "masked": False, "dtype": "float32"}),
    ("bf16", {**SMALL, "n_heads": 8, "vocab_size": 32000, "batch": 8, "tokens": 256, "masked": True,
              "dtype": "bfloat16"}),
]


@pytest.fixture(scope="module")
def measured_peaks() -> dict[str, dict]:
    """name -> {measured, estimate} for every PEAK_CASES config: one worker process, each
    config measured in a fresh child of it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(helpers.REPO), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(WORKER), *(json.dumps(c) for _, c in PEAK_CASES)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"measured"')]
    assert len(lines) == len(PEAK_CASES), out.stdout[-3000:]
    return {name: json.loads(line) for (name, _), line in zip(PEAK_CASES, lines)}


@pytest.mark.slow
@pytest.mark.parametrize("name, config", PEAK_CASES, ids=[n for n, _ in PEAK_CASES])
def test_activation_estimate_bounds_the_measured_peak(measured_peaks, name, config):
    result = measured_peaks[name]
    measured, estimate = result["measured"], result["estimate"]
    print(f"{config}: measured {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB")
    assert measured > 8 * 2**20  # the prefill is large enough to measure
    assert measured <= estimate <= 4 * measured  # a bound, not a wild one (1.2-3x measured here)


def _meta_model(**params) -> Transformer:
    distributed.init_model_parallel(torch.device("cpu"))
    with torch.device("meta"):
        return Transformer(ModelArgs(**params))


def test_int4_weights_without_a_group_size_are_refused_by_name():
    """int4's bytes depend on its group size: counting them without one says so (a ValueError
    naming it), on a CPU whose kernel layout is counted and where torch's packing is."""
    from llama.layers.quantize import quantized_weight_bytes

    model = _meta_model(dim=64, n_layers=1, n_heads=4, vocab_size=96, max_batch_size=1, max_seq_len=16)
    with pytest.raises(ValueError, match="int4 quantisation needs a group size"):
        quantized_weight_bytes(model, "int4", None, torch.device("cpu"), torch.bfloat16)
    assert quantized_weight_bytes(model, "int4", 32, torch.device("cpu"), torch.bfloat16)[0] > 0


def test_activations_are_counted(monkeypatch):
    """Weights and KV cache fit, the largest prefill does not: refused (the old check,
    weights + KV cache only, let it through to be killed for memory)."""
    model = _meta_model(**SMALL, max_batch_size=8, max_seq_len=2048)
    need = memory_need(model, torch.float32)
    assert need.activations > need.weights + need.kv_cache  # this shape is activation-bound
    available = need.weights + need.kv_cache + need.activations // 2
    with pytest.raises(RuntimeError) as info:
        check_memory(model, torch.float32, torch.device("cpu"), available=available)
    text = str(info.value)
    assert "activations of the largest prefill" in text and "Lower max_batch_size or max_seq_len" in text, text
    # An engine that prefills 256 tokens per row per step needs far less, and fits.
    small = check_memory(model, torch.float32, torch.device("cpu"), prefill_tokens=256, available=available)
    assert small.activations < need.activations / 4


def test_huge_ffn_is_not_told_to_lower_the_batch():
    model = _meta_model(**{**SMALL, "ffn_dim_multiplier": 2000.0}, max_batch_size=1, max_seq_len=16)
    need = memory_need(model, torch.float32)
    # 60 % of the float32 weights: bfloat16 (half of them, plus the rest) fits, so the advice
    # may name it (it names only what fits; at 50 % bfloat16 would not).
    with pytest.raises(RuntimeError) as info:
        check_memory(model, torch.float32, torch.device("cpu"), available=need.weights * 3 // 5)
    text = str(info.value)
    assert "weights alone do not fit, whatever the batch size" in text, text
    assert "more processes" in text and "bfloat16" in text and "quantize='int8'" in text
    assert "Lower max_batch_size" not in text


def test_huge_kv_cache_is_told_to_lower_the_batch_or_length():
    model = _meta_model(**SMALL, max_batch_size=64, max_seq_len=10**6)
    need = memory_need(model, torch.bfloat16, prefill_tokens=128)
    assert need.kv_cache > 100 * need.weights
    with pytest.raises(RuntimeError) as info:
        check_memory(model, torch.bfloat16, torch.device("cpu"), prefill_tokens=128, available=need.kv_cache // 2)
    text = str(info.value)
    assert "Lower max_batch_size or max_seq_len" in text and "max_seq_len=1000000" in text
    assert "weights alone" not in text and "use a smaller dtype" not in text  # already 2-byte


def test_fits_returns_the_need():
    model = _meta_model(**SMALL, max_batch_size=2, max_seq_len=64)
    need = check_memory(model, torch.float32, torch.device("cpu"), available=2**40)
    hd = SMALL["dim"] // SMALL["n_heads"]
    # KV cache by hand: 2 (K and V) x layers x slots x kv heads x head dim x 4 bytes, + RoPE table
    # (max_seq_len + 1 positions: the scratch position of padding tokens, see model.py).  The paged
    # pool's default holds max_batch_size x max_seq_len = 128 tokens: 8 blocks of 16, and the
    # scratch block.
    assert need.kv_cache == 2 * 2 * (8 + 1) * 16 * 2 * hd * 4 + 65 * (hd // 2) * 8
    smaller = check_memory(model, torch.float32, torch.device("cpu"), available=2**40, kv_cache_slots=5 * 16)
    assert need.kv_cache - smaller.kv_cache == 2 * 2 * 4 * 16 * 2 * hd * 4


# -- quantised weights: counted as stored, and only advice that fits ------------------------------

LINEAR_HEAVY = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, multiple_of=256, norm_eps=1e-5)


@pytest.fixture(scope="module")
def linear_heavy_checkpoint(tmp_path_factory, tiny_tiktoken_path):
    """A checkpoint whose linear layers are nearly all of its weights (the vocabulary is 556)."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(tiny_tiktoken_path).n_words
    params = {**LINEAR_HEAVY, "vocab_size": vocab}
    weights = helpers.random_weights(params, vocab, seed=9)
    ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("linear_heavy"), params, weights, 1, dtype=torch.bfloat16)
    return helpers.Checkpoint(ckpt, tiny_tiktoken_path, params, weights)


def _needs(ckpt, **kw) -> dict:
    """This checkpoint's need in bfloat16 for max_batch_size 2 x max_seq_len 32, by quantisation."""
    from llama.checkpoint.loader import LoadOptions, load_model

    options = LoadOptions(max_seq_len=32, max_batch_size=2, device="cpu", dtype="bfloat16", **kw)
    model = _meta_model(**{**ckpt.params}, max_batch_size=2, max_seq_len=32)
    chunk = dict(prefill_batch=2, prefill_tokens=min(options.prefill_chunk, 32), prefill_masked=True)
    return {mode: memory_need(model, torch.bfloat16, quantize=mode, group_size=32 if mode == "int4" else None,
                              **chunk)
            for mode in (None, "int8", "int4", "w8a8")}, load_model


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_quantised_weights_are_counted_as_stored(linear_heavy_checkpoint, mode):
    """The need's weights are the bytes of the loaded model's tensors, exactly: int8 ~1 byte a
    weight and a bfloat16 scale per row, int4 half a byte and a bfloat16 scale and offset per
    group of 32 (rows padded to 16), embeddings and norms in bfloat16."""
    from llama.checkpoint.loader import LoadOptions, load_model
    from llama.layers.policy import KernelPolicy
    from llama.layers.prepare import prepare_model_
    from llama.layers.quantized import Int4Weight

    needs, _ = _needs(linear_heavy_checkpoint)
    kw = {"quantize_group_size": 32} if mode == "int4" else {}
    options = LoadOptions(max_seq_len=32, max_batch_size=2, device="cpu", dtype="bfloat16", quantize=mode, **kw)
    policy = KernelPolicy.decide(options.device, options.dtype, quantize=mode)
    model, _ = load_model(linear_heavy_checkpoint.ckpt_dir, linear_heavy_checkpoint.tokenizer_path, options, policy)
    stored = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # fused views add up to the whole
    # On a CPU where our int4 kernel runs, preparing the model lays each int4 matrix out in the
    # kernel's layout and drops torch's packing (state_dict makes it again on demand): the need
    # counts what the prepared model holds, one copy.
    prepare_model_(model, policy)
    int4_layers = [m for m in model.modules() if isinstance(m, Int4Weight)]
    kernel_rows = [m.int4_kernel_rows for m in int4_layers if m.int4_kernel_rows is not None]
    if kernel_rows:
        assert mode == "int4" and all(m.weight_int4 is None for m in int4_layers)
        state = model.state_dict()  # torch's packing made again from the kernel's layout
        assert sum(t.numel() * t.element_size() for t in state.values()) == stored
        torch_packing = sum(t.numel() * t.element_size() for k, t in state.items()
                            if k.endswith(("_int4", "_scales_and_zeros")))
        assert needs[mode].weights == stored - torch_packing + sum(t.numel() for t in kernel_rows)
    else:
        assert needs[mode].weights == stored
    full = needs[None].weights
    assert full == sum(t.numel() for t in linear_heavy_checkpoint.weights.values()) * 2  # bfloat16
    # int8: 1 + 2 / 256 bytes a weight against 2; int4: 0.5 + 4 / 32 against 2 (the kernel's
    # layout: 5 bits a weight too); the embedding table is ~4 %
    assert 0.5 * full < stored < 0.54 * full if mode == "int8" else 0.31 * full < stored < 0.36 * full
    assert 0.31 * full < needs[mode].weights < 0.36 * full if mode == "int4" else True
    assert needs[mode].loading > 0 and needs[None].loading == 0
    assert needs["w8a8"].weights > 1.9 * needs["int8"].weights  # int8's, and fbgemm's packed copy


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_int8_loads_where_bfloat16_is_refused(linear_heavy_checkpoint, monkeypatch):
    """With the memory the check sees limited between the int8 and the bfloat16 need, the
    bfloat16 load is refused, its advice names int8, and the int8 load (which the check
    once refused too, counting bfloat16 weights whatever ``quantize`` said) goes through."""
    from llama.runtime import host

    needs, load_model = _needs(linear_heavy_checkpoint)
    # The linear layers are most of the weights.  (Of the whole need, the KV cache and activations are
    # a share that grows as a model shrinks: in this tiny one the paged cache's scratch block alone is
    # a fifth of the cache, which a model of real size does not notice.)
    assert needs["int8"].weights < 0.6 * needs[None].weights
    assert needs["int8"].total < 0.65 * needs[None].total
    limit = (needs["int8"].total + needs[None].total) // 2
    monkeypatch.setattr(host, "available_memory", lambda device: limit)
    with pytest.raises(RuntimeError, match="not enough memory") as info:
        helpers.build(linear_heavy_checkpoint, dtype="bfloat16", max_seq_len=32, max_batch_size=2)
    text = str(info.value)
    assert "weights alone do not fit" in text and "quantize='int8'" in text and "int4" not in text, text
    llama = helpers.build(linear_heavy_checkpoint, dtype="bfloat16", max_seq_len=32, max_batch_size=2,
                          quantize="int8")
    assert llama.generate([[1, 2, 3]], max_gen_len=4, temperature=0)[0][0]


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [None, "int8", "w8a8"])
def test_advice_names_only_what_then_fits(quantize, dtype):
    """At every memory size from 1/50 of the need up to it, each dtype or quantisation the
    refusal names passes the same check when asked for (int4 with the group size it names:
    this FFN is 10944 wide, which groups of 128 do not divide)."""
    import re

    model = _meta_model(**{**SMALL, "ffn_dim_multiplier": 16.0}, max_batch_size=4, max_seq_len=256)
    cpu = torch.device("cpu")
    need = memory_need(model, dtype, quantize=quantize)
    suggested = set()
    for step in range(1, 50):
        available = need.total * step // 50
        with pytest.raises(RuntimeError) as info:
            check_memory(model, dtype, cpu, available=available, quantize=quantize)
        text = str(info.value)
        if "smaller dtype (bfloat16)" in text:
            check_memory(model, torch.bfloat16, cpu, available=available, quantize=quantize)
            suggested.add("bfloat16")
        for mode in ("int8", "int4"):
            if f"quantize='{mode}'" in text:
                group = re.search(r"quantize_group_size=(\d+)", text)
                assert mode == "int8" or group, text
                check_memory(model, dtype, cpu, available=available, quantize=mode,
                             group_size=int(group.group(1)) if group else None)
                suggested.add(mode)
    assert suggested >= ({"int4"} | ({"int8"} if quantize is None else set()))  # some advice was tested


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_int4_is_not_suggested_where_its_cuda_kernel_cannot_run():
    """Llama-2-7B's shape at 4 processes on CUDA: w2's input is 11008 / 4 = 2752 columns per
    process, not a multiple of 128, so int4 is refused there (naming the layer, its width, and
    the process counts that work) and the memory check's advice does not name it."""
    import fairscale.nn.model_parallel.initialize as fs_init

    from llama.layers.quantize import check_int4_group_size

    distributed.init_model_parallel(torch.device("cpu"))
    real = fs_init.get_model_parallel_world_size
    fs_init.get_model_parallel_world_size = lambda: 4  # shape-only: the layers of rank 0 of 4
    try:
        with torch.device("meta"):
            model = Transformer(ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256,
                                          max_batch_size=1, max_seq_len=64))
    finally:
        fs_init.get_model_parallel_world_size = real
    assert model.layers[0].feed_forward.w2.weight.shape[1] == 2752
    cuda = torch.device("cuda")
    with pytest.raises(ValueError) as info:
        check_int4_group_size(model, 64, cuda, model_parallel_sizes=[1, 2, 4, 8])
    text = str(info.value)
    assert "layers.0.feed_forward.w2 takes 2752 (11008 over 4 processes)" in text, text
    assert "multiple of 128" in text and "model_parallel_size in [1, 2]" in text and "quantize='int8'" in text
    check_int4_group_size(model, 64, torch.device("cpu"))  # the CPU kernel takes any width its groups divide
    # int4 would fit in this memory, int8 would not: nothing is suggested on CUDA; int4 is on the CPU.
    needs = {mode: memory_need(model, torch.bfloat16, quantize=mode, group_size=64 if mode == "int4" else None,
                               device=cuda) for mode in ("int8", "int4")}
    available = (needs["int4"].total + needs["int8"].total) // 2
    for device, named in ((cuda, False), (torch.device("cpu"), True)):
        with pytest.raises(RuntimeError) as info:
            check_memory(model, torch.bfloat16, device, available=available)
        assert ("quantize='int4'" in str(info.value)) == named, str(info.value)
