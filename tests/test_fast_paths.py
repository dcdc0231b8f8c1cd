"""Every fast path against the plain path: ragged prefill, the fixed-shape decode step,
column-major weights, the compiled step, bfloat16, int8 and int4 weights."""

from __future__ import annotations

import pytest
import torch

from llama import Llama
from llama.layers import use_column_major_weights_
from llama.quantize import quantize_groups_int4, quantize_rows_int8


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
        masked = llama.model.logits(llama.model.hidden_states(batch, positions, 40))
        causal = llama.model.logits(llama.model.hidden_states(batch, positions, 40, from_start=True))
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
        step = llama.model.decode_logits(tokens[:, 19:], torch.full((2, 1), 19), kv_len=llama.max_seq_len)
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
def test_compiled_decode_step_matches_eager(llama3_checkpoint):
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


def test_quantize_option_is_checked(ckpt):
    with pytest.raises(ValueError, match="quantize"):
        build(ckpt, quantize="int3")
    with pytest.raises(ValueError, match="group size must be one of"):
        build(ckpt, quantize="int4", quantize_group_size=48)


def test_int4_group_size_must_divide_the_layers(llama3_checkpoint):
    # This config's FFN is 224 wide: groups of 64 do not divide it; 32 do.
    with pytest.raises(ValueError, match=r"group sizes that work here: \[32\]"):
        build(llama3_checkpoint, quantize="int4", quantize_group_size=64)


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
    # The kernel's product equals the expanded weights' (float32: rounding only; bf16:
    # the scales and activations are rounded to bf16 as in any bf16 product).
    assert rel_err(q_logits, twin.model.forward(tokens, 0)) < (1e-4 if dtype == "float32" else 0.03)
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

    llama.engine.fixed_shape_decode = True
    llama.engine.decode_step = llama._with_eager_fallback(broken)
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
