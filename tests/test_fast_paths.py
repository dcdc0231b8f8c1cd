"""Every fast path against the plain path: ragged prefill, the fixed-shape decode step,
column-major weights, the compiled step, bfloat16, int8 and int4 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llama import Llama
from llama.layers.parallel import use_column_major_weights_
from llama.layers.packing import unpack_weights_
from llama.layers.quantize import quantize_groups_int4, quantize_rows_int8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(params=["llama2", "llama3"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_checkpoint")


def build(ckpt, **kw):
    path, tok, _, _ = ckpt
    return Llama.build(path, tok, max_seq_len=64, max_batch_size=3, device="cpu", **kw)


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
    llama = build(ckpt)
    tokens = torch.randint(0, llama.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    # Llama() re-lays float32 CPU weights column-major: compare with row-major ones.
    assert not llama.model.output.weight.is_contiguous()
    for m in llama.model.modules():
        if getattr(m, "weight", None) is not None and m.weight.dim() == 2:
            m.weight = torch.nn.Parameter(m.weight.detach().contiguous(), requires_grad=False)
    row_major = llama.model.forward(tokens, 0)
    assert use_column_major_weights_(llama.model) == 1 + 7 * llama.model.n_layers
    torch.testing.assert_close(llama.model.forward(tokens, 0), row_major, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mkl_fast", [False, True], ids=["multiply-and-sum", "mkl"])
def test_compiled_decode_step_matches_eager(llama3_checkpoint, monkeypatch, mkl_fast):
    """Compiled float32 steps write one-row products as multiply-and-sum where MKL's are
    slow (AVX2) and leave them to MKL elsewhere: both give the eager tokens."""
    import llama.layers.parallel as layers

    monkeypatch.setattr(layers, "MKL_ONE_ROW_PRODUCTS_ARE_FAST", mkl_fast)
    torch._dynamo.reset()  # a step compiled under the other setting must not be reused
    eager = build(llama3_checkpoint)
    compiled = build(llama3_checkpoint, compile=True)
    prompts = [[1, 5, 9, 11], [1, 2]]
    a, lp_a = eager.generate(prompts, max_gen_len=12, temperature=0, logprobs=True)
    b, lp_b = compiled.generate(prompts, max_gen_len=12, temperature=0, logprobs=True)
    assert a == b
    for x, y in zip(lp_a, lp_b):
        assert x == pytest.approx(y, abs=1e-4)


def test_bfloat16_close_to_float32(ckpt):
    f32, bf16 = build(ckpt), build(ckpt, dtype="bfloat16")
    tokens = torch.randint(0, f32.model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    # bf16 keeps 8 bits of mantissa; over two layers the logits stay within a few percent.
    assert rel_err(bf16.model.forward(tokens, 0), f32.model.forward(tokens, 0)) < 0.03


def test_int8_rows_match_the_dequantized_product():
    w = torch.randn(48, 64)
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and (q.abs() <= 127).all()
    # each row's largest weight maps to +-127, the rest round to the nearest step
    assert torch.equal(q.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weights_close_to_full_precision(ckpt, dtype):
    full, quant = build(ckpt, dtype=dtype), build(ckpt, dtype=dtype, quantize="int8")
    assert quant.model.output.weight is None and quant.model.output.weight_int8.dtype == torch.int8
    tokens = torch.randint(0, full.model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    # 8-bit weights with a scale per row, bf16 activations inside the int8 kernel.
    assert rel_err(quant.model.forward(tokens, 0), full.model.forward(tokens, 0)) < 0.05
    assert quant.generate([[1, 2, 3]], max_gen_len=8, temperature=0)[0][0]  # it decodes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_layers_that_read_the_same_input_multiply_as_one(ckpt, dtype):
    """quantize="int8" gives wq/wk/wv and w1/w3 one int8 weight per module, of which each
    layer's ``weight_int8`` and ``weight_scale`` are views (no second copy, state_dict as
    before): the one product's parts are each layer's product of its own int8 weight, for
    one row (a decoding step) and for many (a prompt, through converted blocks), within
    2**-7 of the largest output of the dequantised product in float64 (int8's kernels round
    the activations and the result to bfloat16, 2**-9 each)."""
    from llama.layers.parallel import Int8Projections

    llama = build(ckpt, dtype=dtype, quantize="int8")
    weights = ckpt[3]
    g = torch.Generator().manual_seed(8)
    for i, block in enumerate(llama.model.layers):
        for name, names in (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3"))):
            module = getattr(block, name)
            group = module.packed_input_projections
            assert isinstance(group, Int8Projections)
            layers = [getattr(module, n) for n in names]
            assert sum(layer.weight_int8.numel() for layer in layers) == group.weight_int8.numel()
            for layer, n in zip(layers, names):
                assert layer.weight_int8.untyped_storage().data_ptr() == group.weight_int8.untyped_storage().data_ptr()
                expected, _ = quantize_rows_int8(weights[f"layers.{i}.{name}.{n}.weight"].to(getattr(torch, dtype)))
                assert torch.equal(module.state_dict()[n + ".weight_int8"], expected)
            for rows in (1, 40):
                x = torch.randn(rows, 1, layers[0].in_features, generator=g).to(getattr(torch, dtype))
                for part, layer in zip(group(x), layers):
                    exact = x.double() @ (layer.weight_int8.double() * layer.weight_scale.double()[:, None]).t()
                    assert part.shape == exact.shape
                    assert ((part.double() - exact).abs() <= 2.0 ** -7 * exact.abs().amax() + 1e-6).all(), (name, rows)


def test_quantize_option_is_checked(ckpt):
    with pytest.raises(ValueError, match="quantize"):
        build(ckpt, quantize="int3")
    with pytest.raises(ValueError, match="group size must be one of"):
        build(ckpt, quantize="int4", quantize_group_size=48)


def test_int4_group_size_must_divide_the_layers(llama3_checkpoint):
    # This config's FFN is 224 wide: groups of 64 do not divide it; 32 do.
    with pytest.raises(ValueError, match=r"group sizes that work here: \[32\]"):
        build(llama3_checkpoint, quantize="int4", quantize_group_size=64)


def test_group_size_is_checked_before_the_weights_are_read(llama3_checkpoint, monkeypatch):
    """A group size with int8/w8a8 (which have one scale per output channel) is refused, not
    ignored; an int4 group size torch does not take, or one that does not divide the layers, is
    refused before any weight is read (reading one fails the test here).  The default is 128."""
    import llama.checkpoint.loader as loader

    def must_not_read(*args, **kwargs):
        raise AssertionError("the checkpoint's weights were read before the group size was checked")

    monkeypatch.setattr(loader, "load_rank_state_dict", must_not_read)
    for mode in ("int8", "w8a8"):
        with pytest.raises(ValueError, match=f"applies to quantize='int4' only.*quantize='{mode}' with quantize_group_size=64"):
            build(llama3_checkpoint, dtype="bfloat16", quantize=mode, quantize_group_size=64)
    with pytest.raises(ValueError, match="applies to quantize='int4' only"):
        build(llama3_checkpoint, quantize_group_size=32)
    with pytest.raises(ValueError, match="group size must be one of"):
        build(llama3_checkpoint, quantize="int4", quantize_group_size=48)
    # This config's FFN is 224 wide: the default groups of 128 do not divide it.
    with pytest.raises(ValueError, match=r"int4 groups of 128 columns .* group sizes that work here: \[32\]"):
        build(llama3_checkpoint, quantize="int4")
    with pytest.raises(AssertionError, match="were read"):  # a group size that fits goes on to load
        build(llama3_checkpoint, quantize="int4", quantize_group_size=32)
    with pytest.raises(AssertionError, match="were read"):  # int8 without a group size too
        build(llama3_checkpoint, quantize="int8")


def test_int4_groups_match_the_formula():
    w = torch.randn(40, 128)
    codes, scale, zero = quantize_groups_int4(w, 32)
    assert codes.dtype == torch.int32 and codes.min() >= 0 and codes.max() <= 15
    groups = w.reshape(40, 4, 32)
    # the group's minimum maps to code 0 and its maximum to 15 ...
    assert torch.equal(codes.reshape(40, 4, 32).amin(-1), torch.zeros(40, 4, dtype=torch.int32))
    assert torch.equal(codes.reshape(40, 4, 32).amax(-1), torch.full((40, 4), 15, dtype=torch.int32))
    # ... and every weight is within half a step of (code - 8) * scale + zero
    deq = (codes.reshape(40, 4, 32).float() - 8) * scale[..., None] + zero[..., None]
    assert ((deq - groups).abs() <= scale[..., None] / 2 + 1e-5).all()


def dequantized_int4_twin(ckpt, group_size: int, **kw) -> Llama:
    """A float model whose weights are the int4 model's, expanded by the formula."""
    twin = build(ckpt, **kw)
    unpack_weights_(twin.model)  # weights are changed in place below
    with torch.no_grad():
        for module in twin.model.modules():
            if getattr(module, "weight", None) is not None and hasattr(module, "local_matmul"):
                codes, scale, zero = quantize_groups_int4(module.weight, group_size)
                out_f, in_f = codes.shape
                deq = (codes.reshape(out_f, -1, group_size).float() - 8) * scale[..., None] + zero[..., None]
                module.weight.copy_(deq.reshape(out_f, in_f).to(module.weight.dtype))
    return twin


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_weights_compute_the_dequantized_product(ckpt, dtype):
    quant = build(ckpt, dtype=dtype, quantize="int4", quantize_group_size=32)
    assert quant.model.output.weight is None and quant.model.output.weight_int4.dtype == torch.uint8
    twin = dequantized_int4_twin(ckpt, 32, dtype=dtype)
    full = build(ckpt, dtype=dtype)
    tokens = torch.randint(0, full.model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    q_logits = quant.model.forward(tokens, 0)
    # The kernel's product equals the expanded weights' up to bfloat16 roundings: its scales,
    # zeros and activations are bfloat16 whatever the model's dtype (torch's CPU kernel is
    # vectorised for nothing else), and each product is rounded to bfloat16 (2**-8), through
    # 2 layers.  Measured 0.005-0.01 in float32 (1e-4 when it computed in float32, 20x slower).
    assert rel_err(q_logits, twin.model.forward(tokens, 0)) < 0.03
    # And 4 bits cost accuracy against the full weights, as they must (random weights
    # are the worst case for this: no outliers, every bit of spread matters).
    assert 1e-3 < rel_err(q_logits, full.model.forward(tokens, 0)) < 0.3
    assert quant.generate([[1, 2, 3]], max_gen_len=8, temperature=0)[0][0]  # it decodes


@pytest.mark.slow
def test_failed_compilation_falls_back_to_eager(llama3_checkpoint, caplog):
    import torch._dynamo.exc

    llama = build(llama3_checkpoint)
    expected = llama.generate([[1, 5, 9]], max_gen_len=8, temperature=0)

    def broken(*args):
        raise torch._dynamo.exc.InternalTorchDynamoError("simulated compiler failure")

    llama.engine.runner.use_compiled_step(broken)
    assert llama.generate([[1, 5, 9]], max_gen_len=8, temperature=0) == expected
    assert not llama.compiled and "continuing without it" in caplog.text


@pytest.mark.slow
def test_bfloat16_decode_matches_full_forward_and_restores_settings(ckpt):
    """Batch-1 bf16 decoding steps agree with a plain bf16 forward, and no process-wide
    kernel switch (oneDNN) is left changed (the engine uses none: a server has other threads)."""
    llama = build(ckpt, dtype="bfloat16")
    assert torch._C._get_mkldnn_enabled()
    (tokens,), (lps,) = llama.generate([[1, 7, 8, 9]], max_gen_len=10, temperature=0, logprobs=True, echo=True)
    assert torch._C._get_mkldnn_enabled()
    logits = llama.model.forward(torch.tensor([tokens]), 0)[0].float()
    reference = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    # bf16 activations through different kernels: a few hundredths of a nat apart at most
    assert torch.allclose(torch.tensor(lps[1:]), reference, atol=0.1)


# -- the CPU kernels chosen per shape (llama.layers.parallel.cpu_linear) --------------------------------


@pytest.mark.parametrize("dtype,unit_roundoff", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("block_rows", [1, 7, 64, 1000])
def test_float32_blocks_compute_the_low_precision_product(dtype, unit_roundoff, block_rows):
    """Blocks of weight rows converted to float32 (any block size, dividing the rows or not)
    give the exact product of the stored values, rounded once: within the unit roundoff
    (relative) of the float64 product, plus float32's accumulation error (tiny here)."""
    from llama.layers.parallel import linear_by_blocks

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
    from llama.layers.parallel import linear_split_over_threads

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(256, 64, generator=g).t().contiguous().t()  # column-major, as the model stores it
    x = torch.randn(*shape, generator=g)
    torch.testing.assert_close(linear_split_over_threads(x, weight, parts), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_cpu_linear_chooses_the_kernel_by_shape(monkeypatch):
    import llama.layers.parallel as layers

    calls = []
    monkeypatch.setattr(layers, "linear_by_blocks", lambda x, w: calls.append("blocks") or x @ w.t())
    monkeypatch.setattr(layers, "linear_split_over_threads", lambda x, w, n: calls.append(f"split{n}") or x @ w.t())
    monkeypatch.setattr(layers, "MKL_ONE_ROW_PRODUCTS_ARE_FAST", False)  # an AVX2 CPU's MKL
    bf16 = torch.randn(256, 64).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(layers, "cpu_has_native_bf16_matmul", lambda: False)
        layers.cpu_linear(torch.randn(1, 64).bfloat16(), bf16)  # one row: torch's matrix-vector kernel
        layers.cpu_linear(torch.randn(layers.CONVERT_FROM_ROWS, 64).bfloat16(), bf16)
        monkeypatch.setattr(layers, "cpu_has_native_bf16_matmul", lambda: True)
        layers.cpu_linear(torch.randn(layers.CONVERT_FROM_ROWS, 64).bfloat16(), bf16)  # oneDNN's native kernel
        column_major = torch.randn(256, 64).t().contiguous().t()
        layers.cpu_linear(torch.randn(1, 64), column_major)
        layers.cpu_linear(torch.randn(layers.SPLIT_UP_TO_ROWS + 1, 64), column_major)  # prefill: MKL as is
        layers.cpu_linear(torch.randn(1, 64), torch.randn(256, 64))  # row-major: as is
        torch.set_num_threads(1)
        layers.cpu_linear(torch.randn(1, 64), column_major)  # one thread: nothing to split over
        torch.set_num_threads(2)
        monkeypatch.setattr(layers, "MKL_ONE_ROW_PRODUCTS_ARE_FAST", True)  # AVX-512: MKL splits itself
        layers.cpu_linear(torch.randn(1, 64), column_major)
    finally:
        torch.set_num_threads(threads)
    assert calls == ["blocks", "split2"]


@pytest.mark.parametrize("threads", [1, 2])
def test_model_logits_same_with_and_without_the_cpu_kernels(ckpt, monkeypatch, threads):
    """Whole-model check of the kernel choice: a 20-token prompt (prefill: float32 blocks in
    bfloat16) and one decode step (split over threads in float32), against F.linear
    everywhere.  float32: same sums in another order (1e-5); bfloat16: each product is
    rounded to bfloat16 at slightly different points, through 2 layers (2e-2 relative)."""
    import llama.layers.parallel as layers

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype, tol in (("float32", 1e-5), ("bfloat16", 2e-2)):
            llama = build(ckpt, dtype=dtype)
            unpack_weights_(llama.model)  # bfloat16: torch's kernels here (fbgemm's is tested below)
            tokens = torch.randint(0, llama.model.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
            monkeypatch.setattr(layers, "cpu_has_native_bf16_matmul", lambda: False)
            monkeypatch.setattr(layers, "MKL_ONE_ROW_PRODUCTS_ARE_FAST", False)  # split, as on AVX2
            fast = llama.model.forward(tokens[:, :20], 0), llama.model.forward(tokens[:, 20:], 20)
            monkeypatch.setattr(layers, "cpu_linear", torch.nn.functional.linear)
            plain = llama.model.forward(tokens[:, :20], 0), llama.model.forward(tokens[:, 20:], 20)
            monkeypatch.undo()
            for a, b in zip(fast, plain):
                assert rel_err(a, b) < tol
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16])
def test_converted_blocks_work_in_and_out_of_inference_mode(block_dtype):
    """The reused buffer must be writable both ways (it is made outside inference mode)."""
    from llama.layers.parallel import linear_by_blocks

    weight, x = torch.randn(64, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    with torch.inference_mode():
        inside = linear_by_blocks(x, weight, block_bytes=1 << 30, block_dtype=block_dtype)  # a new, larger buffer
    torch.testing.assert_close(linear_by_blocks(x, weight, block_dtype=block_dtype), inside)


@pytest.mark.parametrize("native_bf16", [False, True], ids=["float32-blocks", "bfloat16-blocks"])
def test_int8_prefill_through_converted_blocks_computes_the_dequantized_product(monkeypatch, native_bf16):
    """From INT8_CONVERT_FROM_ROWS rows int8 weights go through converted blocks: float32
    ones (MKL) in general, bfloat16 ones (oneDNN) where the CPU multiplies bfloat16 natively.
    Either gives the product of the dequantised weight: float32 blocks with float32
    activations within 1e-5; bfloat16 blocks round the activations and each block's product
    to bfloat16 (2^-9 relative each: 1e-2 allowed, as for the one-row kernel)."""
    import llama.layers.parallel as layers

    monkeypatch.setattr(layers, "cpu_has_native_bf16_matmul", lambda: native_bf16)
    g = torch.Generator().manual_seed(6)
    weight_int8 = torch.randint(-127, 128, (96, 64), generator=g, dtype=torch.int8)
    scale = (torch.rand(96, generator=g) / 100).bfloat16()  # as llama.layers.quantize stores it for the CPU
    for rows in (1, layers.INT8_CONVERT_FROM_ROWS, 3 * layers.INT8_CONVERT_FROM_ROWS):
        x = torch.randn(rows, 64, generator=g)
        exact = x.double() @ (weight_int8.double() * scale.double()[:, None]).t()
        out = layers.int8_linear(x, weight_int8, scale)
        # one row: torch's kernel with bfloat16 activations (2^-8 each)
        tol = 1e-5 if rows > 1 and not native_bf16 else 1e-2
        assert out.dtype == x.dtype and rel_err(out, exact) < tol


# -- bfloat16/float16 weights packed for fbgemm's half-precision kernel ------------------------

needs_fbgemm = pytest.mark.skipif(not __import__("llama.layers.packing").layers.packing.fp16_packing_available(),
                                  reason="this torch build has no fbgemm (not x86)")


@pytest.fixture(params=["one-thread entry", "threaded entry"])
def fp16_entry(request, monkeypatch):
    """Pack every matrix for fbgemm's single-threaded entry point, or every one for its
    threaded one (the library picks by thread count and size: see FP16_ONE_THREAD_UP_TO)."""
    from llama.layers import packing
    if request.param == "one-thread entry":
        if not packing.fp16_one_thread_kernel_available():
            pytest.skip("this torch build no longer has fbgemm's single-threaded fp16 entry point")
        monkeypatch.setattr(packing, "FP16_ONE_THREAD_UP_TO", 1 << 62)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # seen by the packing only
    else:
        monkeypatch.setattr(packing, "FP16_ONE_THREAD_UP_TO", -1)
    return request.param


@needs_fbgemm
@pytest.mark.parametrize("dtype,unit_roundoff", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (2, 40, 96)])
def test_fp16_packed_product_is_the_product_of_the_stored_weights(dtype, unit_roundoff, shape, fp16_entry):
    """fbgemm converts the packed weight to float32 and accumulates in float32; the result is
    rounded to the activations' dtype once: within one unit roundoff (relative) of the
    float64 product, like torch's own bfloat16/float16 kernel."""
    from llama.layers.packing import packed_linear, pack_weight_fp16

    g = torch.Generator().manual_seed(7)
    weight = torch.randn(300, 96, generator=g).to(dtype)
    x = torch.randn(*shape, generator=g).to(dtype)
    out = packed_linear(x, pack_weight_fp16(weight))
    exact = x.double() @ weight.double().t()
    assert out.dtype == dtype and out.shape == (*shape[:-1], 300)
    torch.testing.assert_close(out.double(), exact, rtol=unit_roundoff + 1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.nn.functional.linear(x, weight).double(),
                               rtol=2 * unit_roundoff + 1e-5, atol=1e-5)


@needs_fbgemm
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 8, 40])
def test_both_fbgemm_entry_points_give_the_same_product(rows, threads):
    """A small matrix packed at 1 thread (for fbgemm's single-threaded entry point) and the
    same matrix packed at 2 threads (for its threaded one) give the same product bit for
    bit, whatever the thread count when they are called."""
    from llama.layers import packing
    if not packing.fp16_one_thread_kernel_available():
        pytest.skip("this torch build no longer has fbgemm's single-threaded fp16 entry point")
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(3000, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 256, generator=g)
    assert weight.numel() <= packing.FP16_ONE_THREAD_UP_TO
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = packing.pack_weight_fp16(weight)
        torch.set_num_threads(2)
        threaded = packing.pack_weight_fp16(weight)
        torch.set_num_threads(threads)
        a, b = packing.packed_linear(x, one_thread), packing.packed_linear(x, threaded)
    finally:
        torch.set_num_threads(before)
    assert isinstance(one_thread, packing.OneThreadFp16Matrix)
    assert not isinstance(threaded, packing.OneThreadFp16Matrix)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-4)


@needs_fbgemm
def test_packing_keeps_bfloat16_weights_and_refuses_what_float16_cannot_hold(fp16_entry):
    """bfloat16 values from 2**-14 up to 65504 survive packing exactly; smaller ones become
    float16 subnormals, off by 2**-25 at most; a weight beyond 65504 is not packed."""
    from llama.layers.packing import pack_weight_fp16, unpack_weight_fp16

    g = torch.Generator().manual_seed(8)
    magnitudes = torch.logspace(-30, 15.99, 4096, base=2.0)  # 2**-30 .. just under 65536
    signs = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    weight = (magnitudes * signs).to(torch.bfloat16)
    weight = weight[weight.abs() <= 65504]
    weight = weight[torch.randperm(len(weight), generator=g)[: 64 * 32]].reshape(64, 32)
    unpacked = unpack_weight_fp16(pack_weight_fp16(weight), 32).float()
    normal = weight.abs() >= 2.0 ** -14
    assert normal.sum() > 1000 and (~normal).sum() > 200
    assert torch.equal(unpacked[normal], weight[normal].float())
    assert (unpacked[~normal] - weight[~normal].float()).abs().max() <= 2.0 ** -25
    too_big = weight.clone()
    too_big[3, 4] = 1e6
    assert pack_weight_fp16(too_big) is None
    too_big[3, 4] = float("nan")
    assert pack_weight_fp16(too_big) is None


needs_onednn_bf16 = pytest.mark.skipif(not __import__("llama.layers.packing").layers.packing.onednn_packing_available(torch.bfloat16),
                                       reason="torch runs no oneDNN bfloat16 product on this CPU (it needs AVX-512)")


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("shape", [(300, 64), (64, 300), (1000, 512)])
def test_onednn_packed_product_is_the_product_of_the_stored_weights(rows, shape):
    """oneDNN's blocked layout keeps a bfloat16 weight exactly (unpacking gives the same
    bits), and its product is the float64 product of those values rounded once to
    bfloat16: within 2**-8 of each output's magnitude, plus float32 accumulation's error
    over the inner dimension (in * 2**-24 * sum |x w|; 1e-6 absolute covers it here)."""
    from llama.layers.packing import OneDnnMatrix, pack_weight, packed_linear, unpack_weight

    g = torch.Generator().manual_seed(11)
    weight = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    packed = pack_weight(weight, "onednn")
    assert isinstance(packed, OneDnnMatrix)
    unpacked = unpack_weight(packed, shape[1])
    assert unpacked.dtype == torch.bfloat16 and torch.equal(unpacked, weight)
    x = torch.randn(rows, 1, shape[1], generator=g).to(torch.bfloat16)
    out = packed_linear(x, packed)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1, shape[0])
    exact = x.double() @ weight.double().t()
    bound = 2.0 ** -8 * exact.abs() + shape[1] * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().t()) + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("features, native, expected", [
    ({"amx_bf16": True, "avx512_bf16": True}, True, "onednn"),  # the AMX benchmark machine
    ({"amx_bf16": False, "avx512_bf16": True}, True, "fbgemm"),  # AMD Zen 4: oneDNN's one-row products are slow
    ({"amx_bf16": False, "avx512_bf16": False}, False, "fbgemm"),  # AVX2
    ({}, True, "onednn"),  # no CPU probe in this torch: the choice made before the probe
])
def test_bfloat16_packing_kind_follows_the_cpu(monkeypatch, features, native, expected):
    """bfloat16 goes to oneDNN only where the CPU has AMX: on an AVX-512 BF16 CPU without it
    fbgemm's one-row products were 1.5-2x faster (BENCHMARKS.md); float16 always to fbgemm."""
    from llama.layers import packing
    if not (packing.fp16_packing_available() and packing.onednn_packing_available(torch.bfloat16)):
        pytest.skip("needs both fbgemm and oneDNN's bfloat16 packing in this torch build")
    monkeypatch.setattr(packing, "cpu_features", lambda: features)
    monkeypatch.setattr(packing, "cpu_has_native_bf16_matmul", lambda: native)
    assert packing.cpu_packing_kind(torch.bfloat16) == expected
    assert packing.cpu_packing_kind(torch.float16) == "fbgemm"


def test_cpu_vendor_is_read_from_cpuinfo_then_the_name():
    from llama.layers.packing import vendor_of

    assert vendor_of("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n", "") == "amd"
    assert vendor_of("vendor_id\t: GenuineIntel\n", "AMD EPYC") == "intel"  # cpuinfo's line wins
    assert vendor_of("vendor_id\t: HygonGenuine\n", "Intel Xeon") == ""
    assert vendor_of("", "Intel Xeon Platinum 8488C") == "intel"
    assert vendor_of("", "AMD EPYC") == "amd"
    assert vendor_of("", "") == ""


def test_packing_kind_must_be_known(ckpt):
    from llama.layers.packing import use_packed_weights_

    llama = build(ckpt, dtype="bfloat16")
    with pytest.raises(ValueError, match="packing kind must be None or one of"):
        use_packed_weights_(llama.model, "mkl")


@needs_onednn_bf16
@needs_fbgemm
def test_build_packs_for_the_kernel_it_is_asked_for(ckpt):
    """Llama.build(cpu_packing=...) overrides the CPU's choice (prompts or decoding first),
    with the same logits up to bfloat16 roundings; a kind that is unknown, cannot run for the
    dtype, or has nothing to pack is refused with a ValueError, not ignored."""
    from llama.layers.packing import OneDnnMatrix

    tokens = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(2))
    logits = {}
    for kind in ("onednn", "fbgemm"):
        llama = build(ckpt, dtype="bfloat16", cpu_packing=kind)
        packed = [m.weight_packed for m in llama.model.modules() if hasattr(m, "weight_packed")]
        assert packed and all(isinstance(p, OneDnnMatrix) == (kind == "onednn") for p in packed)
        logits[kind] = llama.model.forward(tokens, 0)
    assert rel_err(logits["onednn"], logits["fbgemm"]) < 2e-2
    with pytest.raises(ValueError, match="packing kind must be None or one of"):
        build(ckpt, dtype="bfloat16", cpu_packing="mkl")
    if not __import__("llama.layers.packing").layers.packing.onednn_packing_available(torch.float16):  # no AVX-512 FP16 / AMX-FP16
        with pytest.raises(ValueError, match="oneDNN's packed torch.float16 product does not run here"):
            build(ckpt, dtype="float16", cpu_packing="onednn")
    with pytest.raises(ValueError, match="applies to bfloat16 and float16 models on the CPU"):
        build(ckpt, dtype="float32", cpu_packing="fbgemm")
    with pytest.raises(ValueError, match="found no bfloat16/float16 linear weight to pack"):
        build(ckpt, dtype="bfloat16", quantize="int8", cpu_packing="fbgemm")


def test_build_refuses_a_packing_it_cannot_honour_before_reading_weights(ckpt, monkeypatch):
    """Llama.build(cpu_packing=...) on a model that would not be bfloat16/float16 on the CPU,
    or would be quantized, or with a kind this CPU cannot run, is refused with a ValueError
    before the checkpoint is read (load_model here fails the test if it is reached)."""
    import llama.generation as generation
    from llama.layers.packing import fp16_packing_available, onednn_packing_available

    def must_not_load(*args, **kwargs):
        raise AssertionError("the checkpoint was read before cpu_packing was checked")

    monkeypatch.setattr(generation, "load_model", must_not_load)
    with pytest.raises(ValueError, match="packing kind must be None or one of"):
        build(ckpt, dtype="bfloat16", cpu_packing="mkl")
    with pytest.raises(ValueError, match="applies to bfloat16 and float16 models on the CPU; this one would be torch.float32"):
        build(ckpt, dtype="float32", cpu_packing="fbgemm")
    with pytest.raises(ValueError, match="applies to bfloat16 and float16 models on the CPU; this one would be torch.float32"):
        build(ckpt, cpu_packing="fbgemm")  # the CPU's default dtype
    for mode in ("int8", "w8a8", "int4"):
        with pytest.raises(ValueError, match=f"quantize='{mode}' layers keep their own kernels"):
            build(ckpt, dtype="bfloat16", quantize=mode, cpu_packing="fbgemm")
    for dtype in (torch.bfloat16, torch.float16):
        if not onednn_packing_available(dtype):
            with pytest.raises(ValueError, match=f"oneDNN's packed {dtype} product does not run here"):
                build(ckpt, dtype=dtype, cpu_packing="onednn")
    if fp16_packing_available():
        with pytest.raises(AssertionError, match="was read"):  # a packing it can honour goes on to load
            build(ckpt, dtype="bfloat16", cpu_packing="fbgemm")


@needs_onednn_bf16
@needs_fbgemm
def test_either_kind_packs_a_model_and_unpacks_to_the_same_weights(ckpt):
    """Whichever kind this CPU picks, the other can be asked for: oneDNN's and fbgemm's
    packed models give the unpacked model's logits up to bfloat16 roundings, and
    unpacking gives back the same weights (fbgemm's within its float16 subnormals)."""
    from llama.layers.packing import OneDnnMatrix, use_packed_weights_

    plain = build(ckpt, dtype="bfloat16")
    unpack_weights_(plain.model)
    state = {k: v.clone() for k, v in plain.model.state_dict().items()}
    tokens = torch.randint(0, plain.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    reference = plain.model.forward(tokens, 0)
    total = sum(hasattr(m, "local_matmul") for m in plain.model.modules())
    for kind in ("onednn", "fbgemm"):
        assert use_packed_weights_(plain.model, kind) == total
        packed = [m.weight_packed for m in plain.model.modules() if hasattr(m, "weight_packed")]
        assert all(isinstance(p, OneDnnMatrix) == (kind == "onednn") for p in packed)
        assert rel_err(plain.model.forward(tokens, 0), reference) < 2e-2
        assert unpack_weights_(plain.model) == total
        for name, value in plain.model.state_dict().items():
            assert (value.float() - state[name].float()).abs().max() <= 2.0 ** -25, (kind, name)


@needs_fbgemm
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_model_packs_its_weights_and_computes_what_torch_does(ckpt, threads):
    """Llama.build in bfloat16 on this CPU packs every linear layer for the kernel this CPU
    decodes fastest (oneDNN's where it has AMX, fbgemm's otherwise); prefill and a
    decode step give torch's bfloat16 logits (each product rounded once either way, 2
    layers: 2e-2), and state_dict() still returns the checkpoint's weights."""
    import llama.layers.parallel as layers
    from llama.runtime import distributed
    distributed.configure_cpu_threads()  # its once-per-process choice, before ours
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = build(ckpt, dtype="bfloat16")
        plain = build(ckpt, dtype="bfloat16")
        unpack_weights_(plain.model)
        modules = [m for m in packed.model.modules() if isinstance(m, layers._LocalMatmul)]
        assert modules and all(m.weight is None and hasattr(m, "weight_packed") for m in modules)
        assert _packed_kind_is_this_cpus(modules, threads)
        tokens = torch.randint(0, packed.model.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
        for llama in (packed, plain):
            llama.logits = llama.model.forward(tokens[:, :20], 0), llama.model.forward(tokens[:, 20:], 20)
        for a, b in zip(packed.logits, plain.logits):
            assert rel_err(a, b) < 2e-2
        weights = ckpt[3]
        state = packed.model.state_dict()
        for name, value in weights.items():
            if name.endswith(".weight") and "norm" not in name and "tok_embeddings" not in name:
                expected = value.to(torch.bfloat16)
                assert state[name].dtype == torch.bfloat16
                assert (state[name].float() - expected.float()).abs().max() <= 2.0 ** -25, name
        assert packed.generate([[1, 2, 3]], max_gen_len=6, temperature=0)[0] == \
            plain.generate([[1, 2, 3]], max_gen_len=6, temperature=0)[0]
    finally:
        torch.set_num_threads(saved)


@needs_fbgemm
def test_layers_packed_as_one_matrix_each_give_their_own_product(ckpt):
    """wq/wk/wv and w1/w3 are packed as one matrix per module: the one product's parts are
    each layer's product, a layer called on its own gives the same, and each is its
    weight's product (float64 reference, one bfloat16 rounding: 2**-8 relative)."""
    llama = build(ckpt, dtype="bfloat16")
    block = llama.model.layers[0]
    x = torch.randn(3, 1, block.attention.wq.in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    for module, names in ((block.attention, ("wq", "wk", "wv")), (block.feed_forward, ("w1", "w3"))):
        assert module.packed_input_projections is not None
        parts = module.packed_input_projections(x)
        state = module.state_dict()
        for name, part in zip(names, parts):
            layer = getattr(module, name)
            assert layer.weight is None and layer.weight_packed_rows is not None
            assert torch.equal(layer(x), part)
            weight = state[name + ".weight"]
            assert weight.shape == layer.weight_packed_shape
            exact = x.double() @ weight.double().t()
            assert ((part.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-6).all(), name
    assert torch.equal(block.feed_forward.hidden(x), F.silu(block.feed_forward.w1(x)) * block.feed_forward.w3(x))


@needs_fbgemm
def test_packed_matrices_are_forgotten_with_their_model(ckpt):
    """Compiled steps find packed matrices by key in a module-level table; an entry goes
    when its layer does, so building models one after another does not keep their weights."""
    import gc

    from llama.layers.packing import _PACKED_BY_KEY

    before = set(_PACKED_BY_KEY)
    llama = build(ckpt, dtype="bfloat16")
    keys = set(_PACKED_BY_KEY) - before
    # One matrix per attention (wq, wk, wv), per feed-forward (w1, w3), per wo and w2, and the output.
    assert len(keys) == 4 * llama.model.n_layers + 1
    del llama
    gc.collect()
    assert not keys & set(_PACKED_BY_KEY)


@pytest.mark.slow
@needs_fbgemm
@pytest.mark.parametrize("threads", [1, 2])  # fbgemm's single-threaded and threaded entry points
def test_compiled_step_uses_the_packed_weights(ckpt, monkeypatch, threads):
    """compile=True in bfloat16 keeps the fbgemm-packed weights: the compiled step calls
    them through the llama::packed_linear operator (once per packed matrix), and its
    logits are the eager step's up to bfloat16 roundings that Inductor's fused kernels skip
    (they keep intermediates in float32; measured 0.7% relative, 2e-2 allowed, as between
    fbgemm's and torch's bfloat16).  Greedy tokens of a random model are not compared: its
    near-ties flip at that level."""
    from llama.runtime import distributed
    distributed.configure_cpu_threads()  # its once-per-process choice, before ours
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_compiled_step_uses_the_packed_weights(ckpt, monkeypatch, threads)
    finally:
        torch.set_num_threads(saved)


def _packed_kind_is_this_cpus(modules, threads: int) -> bool:
    """Whether every packed layer holds the matrix this CPU's kind makes at ``threads``:
    oneDNN's blocked layout where that is its kind (AMX); else fbgemm's, for its
    single-threaded entry point at 1 thread (the fixture's matrices are small)."""
    from llama.layers import packing
    if packing.cpu_packing_kind(torch.bfloat16) == "onednn":
        return all(isinstance(m.weight_packed, packing.OneDnnMatrix) for m in modules)
    one_thread = threads == 1 and packing.fp16_one_thread_kernel_available()
    return all(isinstance(m.weight_packed, packing.OneThreadFp16Matrix) == one_thread for m in modules)


def _check_compiled_step_uses_the_packed_weights(ckpt, monkeypatch, threads):
    from llama.layers import packing
    compiled = build(ckpt, dtype="bfloat16", compile=True)
    model = compiled.model
    assert model.output.weight is None and model.layers[0].attention.packed_input_projections is not None
    assert _packed_kind_is_this_cpus([m for m in model.modules() if hasattr(m, "weight_packed")], threads)
    calls = []

    class CountingTable(dict):
        def __getitem__(self, key):
            calls.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(packing, "_PACKED_BY_KEY", CountingTable(packing._PACKED_BY_KEY))
    tokens, positions = torch.tensor([[5], [7]]), torch.tensor([[4], [2]])
    with torch.inference_mode():
        model.forward(torch.tensor([[1, 5, 9, 11], [1, 2, 3, 4]]), 0)
        eager = model.decode_logits(tokens, positions, model.params.max_seq_len, model.forward_cache())
        assert not calls  # eager steps call fbgemm directly
        step = compiled.engine.runner.decode_step
        out = step(tokens, positions, model.params.max_seq_len, model.forward_cache())
        calls.clear()
        out = step(tokens, positions, model.params.max_seq_len, model.forward_cache())
    assert compiled.compiled  # no fallback to eager
    assert len(calls) == 4 * model.n_layers + 1
    assert rel_err(out, eager) < 2e-2
    assert len(compiled.generate([[1, 5, 9]], max_gen_len=5, temperature=0)[0][0]) == 5 and compiled.compiled


@needs_fbgemm
def test_a_weight_beyond_float16_is_left_to_torch(ckpt):
    from llama.layers.packing import use_packed_weights_

    llama = build(ckpt, dtype="bfloat16")
    unpack_weights_(llama.model)
    with torch.no_grad():
        llama.model.layers[0].attention.wq.weight[0, 0] = 1e6
    total = sum(isinstance(m, __import__("llama.layers.parallel").layers.parallel._LocalMatmul) for m in llama.model.modules())
    assert use_packed_weights_(llama.model, "fbgemm") == total - 1
    attention = llama.model.layers[0].attention
    assert attention.wq.weight is not None
    # Its siblings could not share a matrix with it: each is packed on its own.
    assert attention.packed_input_projections is None
    assert attention.wk.weight_packed_rows is None and attention.wv.weight_packed_rows is None
    assert llama.model.layers[1].attention.packed_input_projections is not None
    assert torch.isfinite(llama.model.forward(torch.tensor([[1, 2, 3]]), 0)).all()


@needs_fbgemm
def test_packed_bfloat16_is_as_close_to_float32_as_torchs_bfloat16():
    """On the trained demo model, fbgemm's packed products and torch's bf16 kernels are
    equally far from the float32 model, in prefill and token by token (measured: relative
    logit error 0.0030-0.0032 for both; allowed: 10% more than torch's)."""
    from pathlib import Path

    demo = Path(__file__).resolve().parents[1] / "demo"
    models = {dtype: Llama.build(demo, demo / "tokenizer.model", max_seq_len=256, max_batch_size=2, device="cpu",
                                 dtype=dtype) for dtype in ("float32", "bfloat16")}
    models["torch"] = Llama.build(demo, demo / "tokenizer.model", max_seq_len=256, max_batch_size=2, device="cpu",
                                  dtype="bfloat16")
    assert unpack_weights_(models["torch"].model) > 0
    text = "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 10
    tokens = torch.tensor(models["float32"].tokenizer.encode(text, bos=True, eos=False)[:2 * 100]).view(2, 100)
    errors = {}
    with torch.inference_mode():
        for name, llama in models.items():
            prefill = llama.model.forward(tokens[:, :60], 0)
            steps = [llama.model.forward(tokens[:, i : i + 1], i) for i in range(60, 100)]
            errors[name] = torch.cat([prefill, *steps], 1).double()
    reference = errors.pop("float32")
    rel = {name: ((out - reference).norm() / reference.norm()).item() for name, out in errors.items()}
    assert 0 < rel["bfloat16"] < 1.1 * rel["torch"] + 1e-4, rel


_COMPILED_RUN = """
import sys
import torch
from llama import Llama
llama = Llama.build(sys.argv[1], sys.argv[2], max_seq_len=64, max_batch_size=2, device="cpu",
                    dtype="bfloat16", compile=True)
out = llama.generate([[1, 5, 9]], max_gen_len=3, temperature=0)[0][0]
assert len(out) == 3 and llama.compiled, (out, llama.compiled)
print("vocab", llama.model.vocab_size)
"""


@pytest.mark.slow
@needs_fbgemm
def test_compiled_steps_of_another_model_cached_on_disk_are_not_reused(llama2_checkpoint, llama3_checkpoint,
                                                                       tmp_path):
    """Inductor caches compiled graphs on disk.  Two processes that build models of
    different vocabularies number their packed matrices alike, so key 32 is a 400-wide
    output projection in one and a 556-wide one in the other: the second process must
    not take the first one's graph (it did when the operator found the width by key)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    vocabs = []
    for path, tok, _, _ in (llama2_checkpoint, llama3_checkpoint):
        run = subprocess.run([sys.executable, "-c", _COMPILED_RUN, str(path), str(tok)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        vocabs.append(int(run.stdout.split()[-1]))
    assert vocabs[0] != vocabs[1]


# -- quantize="w8a8": int8 activations in one-row products -------------------------------------------


def _needs_int8_kernel():
    from llama.layers.packing import int8_activation_kernel

    if int8_activation_kernel() is None:
        pytest.skip("this torch build has no fbgemm int8 product (not x86)")


@pytest.mark.parametrize("reduce_range", [False, True])
def test_w8a8_product_within_the_activation_rounding_bound(reduce_range):
    """fbgemm's int8 x int8 product against the exact product of the same int8 weights: the
    only change is the row's quantisation to codes of step s = range / 255 (127 with
    reduce_range), the range including zero.  Each value moves by at most s (s / 2 to the
    nearest code, and up to s / 2 more at the ends of the range, where the rounded zero
    point shifts the codes), so output j moves by at most s * sum_k |W[j, k]|.  The
    result must also be nearer to the exact product than 1/4 of that bound on average:
    rounding errors of independent values mostly cancel."""
    _needs_int8_kernel()
    from llama.layers.packing import pack_weight_int8, packed_linear

    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 256, generator=g) * 0.05
    q, scale = quantize_rows_int8(w)
    packed = pack_weight_int8(q, scale, reduce_range=reduce_range)
    x = torch.randn(1, 256, generator=g) * 3
    x[0, 7] = 40.0  # an outlier widens the range: coarser codes for every other value
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    out = packed_linear(x, packed)
    assert out.dtype == x.dtype and out.shape == (1, 96)
    step = (x.max().clamp(min=0) - x.min().clamp(max=0)).double() / (127 if reduce_range else 255)
    bound = step * (q.double() * scale.double()[:, None]).abs().sum(1)
    error = (out.double() - exact).abs()[0]
    assert (error <= bound + 1e-4).all()
    assert error.mean() < bound.mean() / 4
    assert error.max() > 0  # it did quantise the activations


def test_w8a8_kernel_needs_no_reduced_range_where_it_sums_in_int32():
    """The probe that picks 8- or 7-bit codes: on this CPU, 8-bit codes either give exact
    sums (then w8a8 uses them) or overflow 16 bits (then it uses 7-bit codes, which cannot)."""
    _needs_int8_kernel()
    from llama.layers.packing import int8_activation_kernel, pack_weight_int8

    q = torch.full((16, 512), 127, dtype=torch.int8)
    x = torch.ones(1, 512)  # every code 255: the largest sums a product can make
    exact = 512 * 127.0
    full = torch.ops.quantized.linear_dynamic(x, pack_weight_int8(q, torch.ones(16), reduce_range=False).packed, False)
    assert int8_activation_kernel() == (not torch.allclose(full, torch.full_like(full, exact), rtol=1e-4))
    reduced = torch.ops.quantized.linear_dynamic(x, pack_weight_int8(q, torch.ones(16), reduce_range=True).packed, True)
    torch.testing.assert_close(reduced, torch.full_like(reduced, exact), rtol=1e-4, atol=0)


def test_w8a8_decoding_steps_take_int8_activations_prompts_do_not(llama3_checkpoint):
    """w8a8 holds int8's weights; prompts (many rows) go through int8's own products, so
    their logits are int8's bit for bit, while a one-row step goes through fbgemm: close to
    int8's (the activations' 8-bit rounding, about 2**-8 of each row's range, in every
    layer), not equal."""
    _needs_int8_kernel()
    int8 = build(llama3_checkpoint, dtype="bfloat16", quantize="int8")
    w8a8 = build(llama3_checkpoint, dtype="bfloat16", quantize="w8a8")
    assert torch.equal(w8a8.model.output.weight_int8, int8.model.output.weight_int8)
    packed = [m for m in w8a8.model.modules() if getattr(m, "weight_int8_packed", None) is not None]
    assert len(packed) == 2 * w8a8.model.n_layers + 1  # wo, w2 and the output; wq/wk/wv and w1/w3 as one each
    tokens = torch.randint(0, int8.model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(5))
    assert torch.equal(w8a8.model.forward(tokens, 0), int8.model.forward(tokens, 0))
    one, ref = w8a8.model.forward(tokens[:1, :1], 0), int8.model.forward(tokens[:1, :1], 0)
    assert 0 < rel_err(one, ref) < 0.03
    assert w8a8.generate([[1, 2, 3]], max_gen_len=8, temperature=0)[0][0]  # it decodes


def test_w8a8_siblings_packed_as_one_give_each_layers_own_product(llama3_checkpoint):
    """wq/wk/wv and w1/w3 share one fbgemm matrix per module under w8a8: for one row, the
    one product's parts equal each layer's own fbgemm product bit for bit (integer sums,
    a scale per output row, one quantisation of the same row); for more rows each layer's
    own int8 product runs (bfloat16 activations), as without w8a8."""
    _needs_int8_kernel()
    from llama.layers.packing import Int8ActivationProjections, pack_weight_int8, packed_linear

    w8a8 = build(llama3_checkpoint, dtype="bfloat16", quantize="w8a8")
    int8 = build(llama3_checkpoint, dtype="bfloat16", quantize="int8")
    g = torch.Generator().manual_seed(4)
    for block, plain in zip(w8a8.model.layers, int8.model.layers):
        for name, names in (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3"))):
            module, reference = getattr(block, name), getattr(plain, name)
            fused = module.packed_input_projections
            assert isinstance(fused, Int8ActivationProjections)
            assert [getattr(module, n) for n in names] == list(fused.layers)
            assert not any(hasattr(getattr(module, n), "weight_int8_packed") for n in names)
            one = torch.randn(1, 1, fused.layers[0].in_features, generator=g).bfloat16()
            for part, layer in zip(fused(one), fused.layers):
                alone = pack_weight_int8(layer.weight_int8, layer.weight_scale.float())
                assert torch.equal(part, packed_linear(one, alone))
            rows = torch.randn(3, 1, fused.layers[0].in_features, generator=g).bfloat16()
            for part, n in zip(fused(rows), names):
                assert torch.equal(part, getattr(reference, n)(rows))
    assert w8a8.model.state_dict().keys() == int8.model.state_dict().keys()  # the packed copy adds no entries


def test_unpacking_leaves_quantized_projections_alone(llama3_checkpoint):
    """unpack_weights_ undoes bfloat16/float16 packing only: on an int8 or w8a8 model it
    changes nothing (no layer was packed that way), and w8a8's one-row steps keep their int8
    activations (dropping its grouped products made wq/wk/wv and w1/w3 weight-only int8)."""
    _needs_int8_kernel()
    tokens = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(6))
    for mode in ("int8", "w8a8"):
        llama = build(llama3_checkpoint, dtype="bfloat16", quantize=mode)
        llama.model.forward(tokens, 0)
        step = llama.model.forward(tokens[:, -1:], 6)  # one row: w8a8's int8-activation products
        groups = [m.packed_input_projections for m in llama.model.modules()
                  if getattr(m, "packed_input_projections", None) is not None]
        assert len(groups) == 2 * llama.model.n_layers
        assert unpack_weights_(llama.model) == 0
        assert [m.packed_input_projections for m in llama.model.modules()
                if getattr(m, "packed_input_projections", None) is not None] == groups
        assert torch.equal(llama.model.forward(tokens[:, -1:], 6), step), mode


def test_w8a8_refuses_weights_off_the_cpu(llama3_checkpoint):
    _needs_int8_kernel()
    from llama.layers.quantize import use_int8_activations_

    model = build(llama3_checkpoint, dtype="bfloat16", quantize="int8").model
    model.output.weight_int8 = model.output.weight_int8.to("meta")
    with pytest.raises(ValueError, match='w8a8.*CPU only.*use "int8"'):
        use_int8_activations_(model)
    assert not any(hasattr(m, "weight_int8_packed") for m in model.modules())  # nothing half done


@pytest.mark.slow
def test_w8a8_compiled_step_matches_eager(llama3_checkpoint):
    """Compiled steps reach fbgemm's int8 product through the llama::packed_linear operator
    (by key): the same kernel on the same rows, so the same tokens as eager steps up to the
    first step where eager's two best logits are within the two paths' rounding difference
    (either token is then right), and log-probabilities within that difference."""
    _needs_int8_kernel()
    torch._dynamo.reset()
    eager = build(llama3_checkpoint, dtype="bfloat16", quantize="w8a8")
    compiled = build(llama3_checkpoint, dtype="bfloat16", quantize="w8a8", compile=True)
    prompt = [1, 5, 9, 11]
    a, lp_a = eager.generate([prompt], max_gen_len=10, temperature=0, logprobs=True)
    b, lp_b = compiled.generate([prompt], max_gen_len=10, temperature=0, logprobs=True)
    # Compiled bfloat16 steps fuse the ops around the products without rounding between them:
    # their log-probabilities differ from eager ones by up to 0.02 already with int8 (0.017
    # measured on an AVX-512 CPU, 0.042 on an AVX2 one), and an activation near a code
    # boundary then lands on the next code.  On the AVX2 CPU the sixth token's two best eager
    # logits are one bfloat16 step (0.016) apart, and the compiled step picks the other one.
    rounding = 5e-2
    with torch.inference_mode():
        logits = eager.model.forward(torch.tensor([prompt + a[0]]), 0)[0, len(prompt) - 1 : -1].float()
    best_two = logits.topk(2, dim=-1).values
    ties = (best_two[:, 0] - best_two[:, 1] <= rounding).nonzero().flatten().tolist()
    decided = ties[0] if ties else len(a[0])  # tokens before the first near-tie
    assert decided >= 5, "the prompt gives too few clear steps to compare"
    assert a[0][:decided] == b[0][:decided]
    if not ties:
        assert a == b
    assert lp_a[0][:decided + 1] == pytest.approx(lp_b[0][:decided + 1], abs=rounding)
