"""The model's products and the kernel policy that picks them: each fast product against the
plain one (float64 or torch's own kernel), the policy's choices for the CPUs measured (built
by hand, not probed), and whole models on those paths against the plain ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import build, rel_err
from llama.layers.cpu import CpuFeatures, vendor_of
from llama.layers.packed import unpack_weights_
from llama.layers.policy import KernelPolicy, fastest_packing
from llama.layers.prepare import use_column_major_weights_
from llama.layers.products import dense_product, int8_product, linear_by_blocks, linear_split_over_threads

# The three kinds of CPU the benchmarks measured, as the probe reports them (BENCHMARKS.md).
AMX = CpuFeatures(vendor="intel", capability="AVX512", amx_bf16=True, native_bf16=True, onednn_bf16=True,
                  onednn_fp16=True, fbgemm_fp16=True, fbgemm_fp16_one_thread=True, int8_activation_reduce_range=False)
ZEN4 = dataclasses.replace(AMX, vendor="amd", amx_bf16=False, onednn_fp16=False)
ZEN3 = dataclasses.replace(ZEN4, capability="AVX2", native_bf16=False, onednn_bf16=False,
                           int8_activation_reduce_range=True)


@pytest.fixture(params=["llama2", "llama3"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_checkpoint")


# -- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu, bf16, fp16", [(AMX, "onednn", "fbgemm"), (ZEN4, "fbgemm", "fbgemm"),
                                             (ZEN3, "fbgemm", "fbgemm")], ids=["amx", "zen4", "zen3"])
def test_packing_follows_the_cpu(cpu, bf16, fp16):
    """bfloat16 goes to oneDNN only where the CPU has AMX: on an AVX-512 BF16 CPU without it
    fbgemm's one-row products were 1.5-2x faster (BENCHMARKS.md); float16 always to fbgemm."""
    assert fastest_packing(torch.bfloat16, cpu) == bf16
    assert fastest_packing(torch.float16, cpu) == fp16
    assert KernelPolicy.decide(torch.device("cpu"), torch.bfloat16, cpu=cpu).packing == bf16
    assert KernelPolicy.decide(torch.device("cpu"), torch.float32, cpu=cpu).packing is None
    assert fastest_packing(torch.bfloat16, dataclasses.replace(cpu, fbgemm_fp16=False, onednn_bf16=False)) is None


@pytest.mark.parametrize("cpu", [AMX, ZEN4, ZEN3], ids=["amx", "zen4", "zen3"])
@pytest.mark.parametrize("compile", [False, True])
def test_policy_follows_the_cpu_and_compile(cpu, compile):
    """MKL's few-row float32 products are fast by themselves only on Intel with AVX-512: there
    nothing is split or written as a reduction, and float32 weights stay column-major even
    compiled; elsewhere compiled steps multiply and sum row-major weights."""
    policy = KernelPolicy.decide(torch.device("cpu"), torch.float32, compile=compile, cpu=cpu)
    mkl_fast = cpu is AMX
    assert policy.split_few_rows == policy.one_row_as_reduction == (not mkl_fast)
    assert policy.column_major == (not compile or mkl_fast)
    assert policy.low_precision_by_blocks == (not cpu.native_bf16)
    assert policy.int8_block_dtype == (torch.bfloat16 if cpu.native_bf16 else torch.float32)
    assert KernelPolicy.decide(torch.device("cuda"), torch.bfloat16, compile=compile, cpu=cpu) == KernelPolicy()


def test_policy_refuses_what_it_cannot_honour():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="packing kind must be None or one of"):
        KernelPolicy.decide(cpu, torch.bfloat16, cpu_packing="mkl", cpu=AMX)
    with pytest.raises(ValueError, match="oneDNN's packed torch.bfloat16 product does not run here"):
        KernelPolicy.decide(cpu, torch.bfloat16, cpu_packing="onednn", cpu=ZEN3)
    with pytest.raises(ValueError, match="no fbgemm half-precision product"):
        KernelPolicy.decide(cpu, torch.float16, cpu_packing="fbgemm", cpu=dataclasses.replace(AMX, fbgemm_fp16=False))
    with pytest.raises(ValueError, match="not to a torch.float32 model on cpu"):
        KernelPolicy.decide(cpu, torch.float32, cpu_packing="fbgemm", cpu=AMX)
    with pytest.raises(ValueError, match="keep their own kernels"):
        KernelPolicy.decide(cpu, torch.bfloat16, cpu_packing="fbgemm", quantize="int8", cpu=AMX)
    assert KernelPolicy.decide(cpu, torch.bfloat16, cpu_packing="onednn", cpu=ZEN4).packing == "onednn"


def test_cpu_vendor_is_read_from_cpuinfo_then_the_name():
    assert vendor_of("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n", "") == "amd"
    assert vendor_of("vendor_id\t: GenuineIntel\n", "AMD EPYC") == "intel"  # cpuinfo's line wins
    assert vendor_of("vendor_id\t: HygonGenuine\n", "Intel Xeon") == ""
    assert vendor_of("", "Intel Xeon Platinum 8488C") == "intel"
    assert vendor_of("", "AMD EPYC") == "amd"
    assert vendor_of("", "") == ""


def test_a_model_runs_under_the_policy_it_was_given(llama3_checkpoint):
    """Llama.build decides one policy and every layer that multiplies holds it."""
    llama = build(llama3_checkpoint, dtype="bfloat16")
    assert llama.policy == KernelPolicy.decide(torch.device("cpu"), torch.bfloat16)
    layers = [m for m in llama.model.modules() if hasattr(m, "local_matmul")]
    assert layers and all(m.policy is llama.policy for m in layers)


# -- the products ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,unit_roundoff", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("block_rows", [1, 7, 64, 1000])
def test_float32_blocks_compute_the_low_precision_product(dtype, unit_roundoff, block_rows):
    """Blocks of weight rows converted to float32 (any block size, dividing the rows or not)
    give the exact product of the stored values, rounded once: within the unit roundoff
    (relative) of the float64 product, plus float32's accumulation error (tiny here)."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 96, generator=g).to(dtype)
    x = torch.randn(2, 5, 96, generator=g).to(dtype)
    out = linear_by_blocks(x, weight, block_bytes=block_rows * 96 * 4)
    exact = x.double() @ weight.double().t()
    assert out.dtype == dtype and out.shape == (2, 5, 300)
    torch.testing.assert_close(out.double(), exact, rtol=unit_roundoff + 1e-5, atol=1e-5)
    # torch's own kernel rounds float32 sums of the same products: both within one roundoff.
    torch.testing.assert_close(out.double(), torch.nn.functional.linear(x, weight).double(),
                               rtol=2 * unit_roundoff + 1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (2, 3, 64)])
def test_split_over_threads_equals_the_product(parts, shape):
    """Column slices of a column-major float32 weight, one batched call: the same sums
    (float32 order may differ: 1e-5)."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(256, 64, generator=g).t().contiguous().t()  # column-major, as the model stores it
    x = torch.randn(*shape, generator=g)
    torch.testing.assert_close(linear_split_over_threads(x, weight, parts), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_dense_product_chooses_the_kernel_by_shape_and_policy(monkeypatch):
    """Which product runs, seen through the two the policy can choose (both wrapped to record)."""
    import llama.layers.products as products

    calls = []
    blocks, split = products.linear_by_blocks, products.linear_split_over_threads
    monkeypatch.setattr(products, "linear_by_blocks", lambda x, w, **kw: calls.append("blocks") or blocks(x, w, **kw))
    monkeypatch.setattr(products, "linear_split_over_threads",
                        lambda x, w, n: calls.append(f"split{n}") or split(x, w, n))
    avx2 = KernelPolicy.decide(torch.device("cpu"), torch.float32, cpu=ZEN3)
    native = KernelPolicy.decide(torch.device("cpu"), torch.float32, cpu=AMX)
    bf16 = torch.randn(256, 64).bfloat16()
    column_major = torch.randn(256, 64).t().contiguous().t()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        dense_product(torch.randn(1, 64).bfloat16(), bf16, avx2)  # one row: torch's matrix-vector kernel
        dense_product(torch.randn(avx2.convert_from_rows, 64).bfloat16(), bf16, avx2)  # blocks
        dense_product(torch.randn(avx2.convert_from_rows, 64).bfloat16(), bf16, native)  # oneDNN's native kernel
        dense_product(torch.randn(1, 64), column_major, avx2)  # split
        dense_product(torch.randn(avx2.split_up_to_rows + 1, 64), column_major, avx2)  # prefill: MKL as is
        dense_product(torch.randn(1, 64), torch.randn(256, 64), avx2)  # row-major: as is
        dense_product(torch.randn(1, 64), column_major, native)  # AVX-512 Intel: MKL splits itself
        dense_product(torch.randn(1, 64), column_major, KernelPolicy())  # the plain policy: as is
        torch.set_num_threads(1)
        dense_product(torch.randn(1, 64), column_major, avx2)  # one thread: nothing to split over
    finally:
        torch.set_num_threads(threads)
    assert calls == ["blocks", "split2"]


@pytest.mark.parametrize("threads", [1, 2])
def test_model_logits_same_with_and_without_the_cpu_kernels(ckpt, threads):
    """Whole-model check of the kernel choice: a 20-token prompt (prefill: float32 blocks in
    bfloat16) and one decode step (split over threads in float32) under an AVX2 CPU's policy,
    against torch's plain products everywhere (the default policy).  float32: same sums in
    another order (1e-5); bfloat16: each product is rounded to bfloat16 at slightly different
    points, through 2 layers (2e-2 relative)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            avx2 = dataclasses.replace(KernelPolicy.decide(torch.device("cpu"), dtype, cpu=ZEN3), packing=None)
            fast, plain = build(ckpt, dtype=dtype, policy=avx2), build(ckpt, dtype=dtype, policy=KernelPolicy())
            tokens = torch.randint(0, fast.model.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
            for a, b in zip((fast.model.forward(tokens[:, :20], 0), fast.model.forward(tokens[:, 20:], 20)),
                            (plain.model.forward(tokens[:, :20], 0), plain.model.forward(tokens[:, 20:], 20))):
                assert rel_err(a, b) < tol
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16])
def test_converted_blocks_work_in_and_out_of_inference_mode(block_dtype):
    """The reused buffer must be writable both ways (it is made outside inference mode)."""
    weight, x = torch.randn(64, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    with torch.inference_mode():
        inside = linear_by_blocks(x, weight, block_bytes=1 << 30, block_dtype=block_dtype)  # a new, larger buffer
    torch.testing.assert_close(linear_by_blocks(x, weight, block_dtype=block_dtype), inside)


@pytest.mark.parametrize("cpu", [ZEN3, AMX], ids=["float32-blocks", "bfloat16-blocks"])
def test_int8_prefill_through_converted_blocks_computes_the_dequantized_product(cpu):
    """From int8_convert_from_rows rows int8 weights go through converted blocks: float32 ones
    (MKL) in general, bfloat16 ones (oneDNN) where the CPU multiplies bfloat16 natively.
    Either gives the product of the dequantised weight: float32 blocks with float32
    activations within 1e-5; bfloat16 blocks round the activations and each block's product
    to bfloat16 (2^-9 relative each: 1e-2 allowed, as for the one-row kernel)."""
    if cpu.native_bf16 and not CpuFeatures.probe().native_bf16:
        pytest.skip("this CPU multiplies no bfloat16 natively")
    policy = KernelPolicy.decide(torch.device("cpu"), torch.float32, cpu=cpu)
    g = torch.Generator().manual_seed(6)
    weight_int8 = torch.randint(-127, 128, (96, 64), generator=g, dtype=torch.int8)
    scale = (torch.rand(96, generator=g) / 100).bfloat16()  # as llama.layers.quantize stores it for the CPU
    for rows in (1, policy.int8_convert_from_rows, 3 * policy.int8_convert_from_rows):
        x = torch.randn(rows, 64, generator=g)
        exact = x.double() @ (weight_int8.double() * scale.double()[:, None]).t()
        out = int8_product(x, weight_int8, scale, policy)
        # one row: torch's kernel with bfloat16 activations (2^-8 each)
        tol = 1e-5 if rows > 1 and not cpu.native_bf16 else 1e-2
        assert out.dtype == x.dtype and rel_err(out, exact) < tol


# -- whole models on the fast paths ------------------------------------------------------------


def test_ragged_prefill_equals_one_prompt_at_a_time(ckpt):
    llama = build(ckpt)
    vocab = llama.model.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (5, 40, 17)]
    alone = [llama.model.forward(p.unsqueeze(0), 0)[0] for p in prompts]
    batch = torch.zeros(3, 40, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    positions = torch.arange(40).expand(3, 40)
    with torch.inference_mode():
        cache = llama.model.new_kv_cache()
        masked = llama.model.logits(llama.model.hidden_states(batch, positions, 40, cache))
        causal = llama.model.logits(llama.model.hidden_states(batch, positions, 40, cache, from_start=True))
    for logits in (masked, causal):  # the explicit mask and SDPA's causal path agree
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i, : len(p)], alone[i], rtol=1e-5, atol=1e-5)


def test_fixed_shape_decode_step_equals_forward(ckpt):
    """The compiled step attends to the whole cache with a mask; same logits."""
    llama = build(ckpt)
    tokens = torch.randint(0, llama.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    full = llama.model.forward(tokens, 0)
    llama.model.forward(tokens[:, :19], 0)
    with torch.inference_mode():
        step = llama.model.decode_logits(tokens[:, 19:], torch.full((2, 1), 19), kv_len=llama.max_seq_len,
                                         cache=llama.model.forward_cache())
    torch.testing.assert_close(step, full[:, -1], rtol=1e-5, atol=1e-5)


def test_column_major_weights_same_logits(ckpt):
    llama = build(ckpt, policy=KernelPolicy())  # the plain policy keeps the checkpoint's row-major layout
    tokens = torch.randint(0, llama.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    assert llama.model.output.weight.is_contiguous()
    row_major = llama.model.forward(tokens, 0)
    assert use_column_major_weights_(llama.model) == 1 + 7 * llama.model.n_layers
    assert not llama.model.output.weight.is_contiguous()
    torch.testing.assert_close(llama.model.forward(tokens, 0), row_major, rtol=1e-5, atol=1e-5)
    column_major = build(ckpt, policy=KernelPolicy(column_major=True))  # what a CPU policy says for float32
    assert not column_major.model.output.weight.is_contiguous()


def test_bfloat16_close_to_float32(ckpt):
    f32, bf16 = build(ckpt), build(ckpt, dtype="bfloat16")
    tokens = torch.randint(0, f32.model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    # bf16 keeps 8 bits of mantissa; over two layers the logits stay within a few percent.
    assert rel_err(bf16.model.forward(tokens, 0), f32.model.forward(tokens, 0)) < 0.03


@pytest.mark.slow
def test_bfloat16_decode_matches_full_forward_and_restores_settings(ckpt):
    """Batch-1 bf16 decoding steps agree with a plain bf16 forward, and no process-wide
    kernel switch (oneDNN) is left changed (the engine uses none: a server has other threads)."""
    llama = build(ckpt, dtype="bfloat16")
    assert torch._C._get_mkldnn_enabled()
    (tokens,), (lps,) = llama.generate([[1, 7, 8, 9]], max_gen_len=10, temperature=0, logprobs=True, echo=True)
    assert torch._C._get_mkldnn_enabled()
    unpack_weights_(llama.model)  # torch's own bfloat16 kernels for the reference
    logits = llama.model.forward(torch.tensor([tokens]), 0)[0].float()
    reference = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    # bf16 activations through different kernels: a few hundredths of a nat apart at most
    assert torch.allclose(torch.tensor(lps[1:]), reference, atol=0.1)
