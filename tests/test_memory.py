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
from llama.runtime import distributed
from llama.checkpoint.params import ModelArgs
from llama.checkpoint.memory import check_memory, memory_need
from llama.model import Transformer

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


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for _, c in PEAK_CASES], ids=[n for n, _ in PEAK_CASES])
def test_activation_estimate_bounds_the_measured_peak(config):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(helpers.REPO), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(WORKER), json.dumps(config)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    measured, estimate = result["measured"], result["estimate"]
    print(f"{config}: measured {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB")
    assert measured > 8 * 2**20  # the prefill is large enough to measure
    assert measured <= estimate <= 4 * measured  # a bound, not a wild one (1.2-3x measured here)


def _meta_model(**params) -> Transformer:
    distributed.init_model_parallel(torch.device("cpu"))
    with torch.device("meta"):
        return Transformer(ModelArgs(**params))


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
    with pytest.raises(RuntimeError) as info:
        check_memory(model, torch.float32, torch.device("cpu"), available=need.weights // 2)
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
    # KV cache by hand: 2 (K and V) x layers x rows x length x kv heads x head dim x 4 bytes, + RoPE table;
    # the length is max_seq_len + 1 (the cache's scratch position for padding, see model.py).
    assert need.kv_cache == 2 * 2 * 2 * 65 * 2 * hd * 4 + 65 * (hd // 2) * 8
