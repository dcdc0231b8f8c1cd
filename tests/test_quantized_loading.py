"""Quantising while loading (llama.checkpoint.loader.load_quantized_): each layer is quantised
as its slice is read, which gives the tensors and logits of loading in full precision then
quantising, bit for bit, with a peak memory near the quantised size (measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
import llama4_helpers as H
from llama import Llama
from llama.checkpoint.loader import LoadOptions, load_model
from llama.layers.cpu import CpuFeatures
from llama.layers.policy import KernelPolicy
from llama.layers.quantize import (
    int4_matrix,
    quantize_int4_,
    quantize_int8_,
    quantize_rows_int8,
    use_int8_activations_,
)

REDUCE_RANGE = CpuFeatures.probe().int8_activation_reduce_range
MODES = ["int8", "int4", pytest.param("w8a8", marks=pytest.mark.skipif(
    REDUCE_RANGE is None, reason="this torch build has no fbgemm int8 product"))]


@pytest.fixture(scope="module")
def two_shard_llama3(tmp_path_factory, llama3_checkpoint):
    """The llama3 fixture's weights in two shards: one process's slice of each column- and
    row-parallel weight is put together from both files."""
    ckpt, tok, params, weights = llama3_checkpoint
    two = helpers.write_checkpoint(tmp_path_factory.mktemp("llama3_mp2"), params, weights, 2)
    return helpers.Checkpoint(two, tok, params, weights)


@pytest.fixture(scope="module")
def llama4_checkpoint(tmp_path_factory, tiny_tiktoken_path):
    """A tiny Llama 4 (MoE layers with stacked experts, a shared expert and a router), in two shards."""
    params = {**H.LLAMA4_MP_PARAMS, "multiple_of": 64}
    weights = H.random_llama4_weights(params, params["vocab_size"], seed=21)
    ckpt = H.write_llama4_checkpoint(tmp_path_factory.mktemp("llama4_qload"), params, weights, n_shards=2)
    return helpers.Checkpoint(ckpt, tiny_tiktoken_path, params, weights)


def _options(mode, dtype):
    return dict(max_seq_len=32, max_batch_size=2, device="cpu", dtype=dtype,
                quantize_group_size=32 if mode == "int4" else None)


def quantised_after_loading(ckpt, mode: str, dtype: str, policy: KernelPolicy):
    """The way it was done before: the whole slice loaded in full precision, then quantised."""
    kw = _options(mode, dtype)
    group_size = kw.pop("quantize_group_size")
    model, _ = load_model(ckpt.ckpt_dir, ckpt.tokenizer_path, LoadOptions(**kw), policy)
    if mode == "int4":
        quantize_int4_(model, group_size)
    else:
        quantize_int8_(model)
        if mode == "w8a8":
            use_int8_activations_(model, policy)
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, dtype", [("llama2_checkpoint", "bfloat16"), ("two_shard_llama3", "bfloat16"),
                                         ("two_shard_llama3", "float32"), ("llama4_checkpoint", "bfloat16")])
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_quantised_while_loading_equals_quantised_after(request, name, dtype, mode):
    ckpt = request.getfixturevalue(name)
    policy = KernelPolicy.decide(torch.device("cpu"), getattr(torch, dtype), quantize=mode)
    before = quantised_after_loading(ckpt, mode, dtype, policy)
    model, tokenizer = load_model(ckpt.ckpt_dir, ckpt.tokenizer_path,
                                  LoadOptions(quantize=mode, **_options(mode, dtype)), policy)
    ours, theirs = model.state_dict(), before.state_dict()
    assert ours.keys() == theirs.keys()
    assert any(k.endswith("_int4" if mode == "int4" else "_int8") for k in ours)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    for a, b in zip(model.modules(), before.modules()):
        assert type(a) is type(b)
        if getattr(a, "fused", None) is not None:  # int8's fused siblings: one tensor, the layers' views of it
            assert type(a.fused) is type(b.fused) and a.fused.sizes == b.fused.sizes
            if mode == "int8":
                assert torch.equal(a.fused.weight_int8, b.fused.weight_int8)
                assert a.fused.weight_int8.untyped_storage().data_ptr() == \
                    getattr(a, a.packable_input_projections[0]).weight_int8.untyped_storage().data_ptr()
    tokens = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for step in (tokens, tokens[:1, :1]):  # a prompt, and a one-row step (w8a8's int8 activations)
            new = Llama(model, tokenizer, policy=policy).model.forward(step, 0)
            old = Llama(before, tokenizer, policy=policy).model.forward(step, 0)
            assert torch.equal(new, old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantising_by_blocks_of_rows_is_quantising_in_one_piece(dtype):
    """Quantisation bounds its float32 temporaries by working through blocks of rows: the
    result is the one-piece result bit for bit, for int8 and for int4 (whose CPU packing is
    by blocks of 64 rows, and whose padding rows join the last block)."""
    g = torch.Generator().manual_seed(5)
    for rows in (72, 200, 1000):
        w = (torch.randn(rows, 128, generator=g) * 2).to(dtype)
        whole = quantize_rows_int8(w, block_bytes=1 << 40)
        w_t = w.t().contiguous().t()  # a transposed view, as the experts' matrices are quantised
        for block_bytes in (1, 4096, 64 * 128 * 4 * 3):
            for q, s in (quantize_rows_int8(w, block_bytes), quantize_rows_int8(w_t, block_bytes)):
                assert torch.equal(q, whole[0]) and torch.equal(s, whole[1])
        # by hand: the formula of llama.layers.quantize's docstring
        scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
        assert torch.equal(whole[0], torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8))
        assert torch.equal(whole[1], scale)
        packed, sz, out = int4_matrix(w, 32, block_bytes=1 << 40)
        for block_bytes in (1, 64 * 128 * 4 * 2):
            p2, sz2, out2 = int4_matrix(w, 32, block_bytes=block_bytes)
            assert torch.equal(p2, packed) and torch.equal(sz2, sz) and out2 == out == rows


# -- peak memory, measured -----------------------------------------------------------------------

WORKER = Path(__file__).parent / "memory_worker.py"


@pytest.mark.slow
def test_int8_load_peaks_near_the_quantised_size(tmp_path):
    """A model whose linear weights are nearly all of it (210 MB in bfloat16): loaded with
    quantize="int8", the process's resident memory peaks at under 60 % of the bfloat16 load's
    peak (int8 weights are half, plus one layer in flight; measured 57 %), where quantising
    after loading peaked above the bfloat16 load (the whole slice in bfloat16, then int8 beside it)."""
    tok = helpers.write_tiny_tiktoken(tmp_path)
    params = dict(dim=512, n_layers=32, n_heads=8, n_kv_heads=8, vocab_size=556, multiple_of=256, norm_eps=1e-5)
    # Zeros: only the bytes loaded are measured, no value is compared (as in test_checkpoint.py's
    # test_memory_per_rank_is_its_slice; ~105M random ones were seconds to draw)
    weights = helpers.zero_weights(params, 556, torch.bfloat16)
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, weights, 1, dtype=torch.bfloat16)
    del weights
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO), str(helpers.REPO / "tests")])}
    peaks = {}
    for mode in ("bfloat16", "int8"):
        out = tmp_path / mode
        out.mkdir()
        args = [str(ckpt), str(tok), str(out)] + (["int8"] if mode == "int8" else [])
        proc = subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        m = json.loads((out / "rank0.json").read_text())
        peaks[mode] = m["load_peak"]
        held = m["weights"] + m["buffers"]
        print(f"{mode}: load peak {m['load_peak'] / 2**20:.0f} MiB for {held / 2**20:.0f} MiB of weights")
        assert m["load_peak"] >= 0.9 * held  # the measurement sees the weights
    assert peaks["int8"] <= 0.6 * peaks["bfloat16"], peaks
