"""int8, int4 and w8a8 weights (llama.layers.quantize, llama.layers.quantized): the
quantisation formulas, each layer kind's product against the dequantised product, quantised
layers swapped in with Meta's state_dict keys, and the options checked before loading."""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICES, build, rel_err
from llama.layers import cpu_kernels, packing
from llama.layers.cpu import CpuFeatures
from llama.layers.packed import unpack_weights_
from llama.layers.parallel import DenseWeight, ParallelLinear
from llama.layers.policy import KernelPolicy
from llama.layers.quantize import quantize_groups_int4, quantize_rows_int8, use_int8_activations_
from llama.layers.quantized import (
    Int4Weight,
    Int8FusedProjections,
    Int8Weight,
    W8A8FusedProjections,
    W8A8Weight,
)


@pytest.fixture(params=["llama2", "llama3"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_checkpoint")


def test_int8_rows_match_the_dequantized_product():
    w = torch.randn(48, 64)
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and (q.abs() <= 127).all()
    # each row's largest weight maps to +-127, the rest round to the nearest step
    assert torch.equal(q.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weights_close_to_full_precision(ckpt, dtype, device):
    kw = dict(dtype=dtype, device=device, compile=False)  # eager on CUDA too: the products are what is tested
    full, quant = build(ckpt, **kw), build(ckpt, quantize="int8", **kw)
    assert isinstance(quant.model.output, Int8Weight) and quant.model.output.weight_int8.dtype == torch.int8
    tokens = torch.randint(0, full.model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4)).to(device)
    # 8-bit weights with a scale per row, bf16 activations inside the int8 kernel.
    assert rel_err(quant.model.forward(tokens, 0), full.model.forward(tokens, 0)) < 0.05
    assert quant.generate([[1, 2, 3]], max_gen_len=8, temperature=0)[0][0]  # it decodes


@pytest.mark.parametrize("mode, kind", [("int8", Int8Weight), ("int4", Int4Weight)])
def test_quantised_layers_are_layers_of_their_own_class_with_meta_s_keys(llama3_checkpoint, mode, kind):
    """Quantisation swaps every dense parallel linear layer for one of its own class (the same
    fairscale base class and parallel split); the state_dict keys are Meta's names with the
    quantised tensors' suffixes, and no dense weight is left behind."""
    from fairscale.nn.model_parallel import layers as fs_layers

    kw = {"quantize_group_size": 32} if mode == "int4" else {}
    llama = build(llama3_checkpoint, quantize=mode, **kw)
    layers = [m for m in llama.model.modules() if isinstance(m, ParallelLinear)]
    assert layers and all(isinstance(m, kind) and not isinstance(m, DenseWeight) for m in layers)
    assert isinstance(llama.model.layers[0].attention.wq, fs_layers.ColumnParallelLinear)
    assert isinstance(llama.model.layers[0].attention.wo, fs_layers.RowParallelLinear)
    keys = set(llama.model.state_dict())
    suffix = "weight_int8" if mode == "int8" else "weight_int4"
    assert f"layers.0.attention.wq.{suffix}" in keys and "output." + suffix in keys
    assert not any(k.endswith("wq.weight") or k == "output.weight" for k in keys)


def _through_cpu_kernel(policy, x: torch.Tensor) -> bool:
    """Whether an int8 product of ``x`` under ``policy`` takes our CPU kernel."""
    rows = x.shape[:-1].numel()
    return policy.cpu_qkernel is not None and cpu_kernels.ready() \
        and (rows < policy.int8_convert_from_rows or policy.int8_qkernel_for_prompts)


def _activations_as_quantised(x: torch.Tensor) -> torch.Tensor:
    """``x`` as our CPU kernels see it (float64): codes times their block's scale."""
    codes, d = cpu_kernels.quantize_activations_int8(x.reshape(-1, x.shape[-1]))
    return (codes.double() * d.double()).view(x.shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_layers_that_read_the_same_input_multiply_as_one(ckpt, dtype):
    """quantize="int8" gives wq/wk/wv and w1/w3 one int8 weight per module, of which each
    layer's ``weight_int8`` and ``weight_scale`` are views (no second copy, state_dict as
    before): the one product's parts are each layer's product of its own int8 weight, for
    one row (a decoding step) and for many (a prompt, through converted blocks), within
    2**-7 of the largest output of the dequantised product in float64 (int8's kernels round
    the activations and the result to bfloat16, 2**-9 each; our CPU kernel quantises the
    activations in blocks of 32, so its exact product is of those activations, and it rounds
    only the result)."""
    llama = build(ckpt, dtype=dtype, quantize="int8")
    weights = ckpt[3]
    g = torch.Generator().manual_seed(8)
    for i, block in enumerate(llama.model.layers):
        for name, names in (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3"))):
            module = getattr(block, name)
            group = module.fused
            assert isinstance(group, Int8FusedProjections) and group.policy is llama.policy
            layers = [getattr(module, n) for n in names]
            assert sum(layer.weight_int8.numel() for layer in layers) == group.weight_int8.numel()
            for layer, n in zip(layers, names):
                assert layer.weight_int8.untyped_storage().data_ptr() == group.weight_int8.untyped_storage().data_ptr()
                expected, _ = quantize_rows_int8(weights[f"layers.{i}.{name}.{n}.weight"].to(getattr(torch, dtype)))
                assert torch.equal(module.state_dict()[n + ".weight_int8"], expected)
            for rows in (1, 40):
                x = torch.randn(rows, 1, layers[0].in_features, generator=g).to(getattr(torch, dtype))
                # Where the policy sends few rows through our CPU kernel, it multiplies the
                # activations quantised in blocks of 32: the exact product is of those.
                seen = _activations_as_quantised(x) if _through_cpu_kernel(group.policy, x) else x.double()
                for part, layer in zip(group(x), layers):
                    exact = seen @ (layer.weight_int8.double() * layer.weight_scale.double()[:, None]).t()
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

    monkeypatch.setattr(loader, "iter_rank_tensors", must_not_read)
    for mode in ("int8", "w8a8"):
        with pytest.raises(ValueError,
                           match=f"applies to quantize='int4' only.*quantize='{mode}' with quantize_group_size=64"):
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


def _plain_range_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """Each group's minimum to code 0 and maximum to 15, the scale and offset in bfloat16 (as
    quantize_groups_int4 did before it searched, but for rounding the codes against the bfloat16
    values): what it must never do worse than."""
    g = w.float().reshape(w.shape[0], -1, group)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    codes = torch.round((g - zero) / scale + 8).clamp(0, 15)
    return ((codes - 8) * scale + zero).reshape(w.shape)


def _q4_0(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_0, as ggml's reference quantiser (quantize_row_q4_0_ref) rounds a row:
    blocks of 32, d = the value of largest magnitude / -8 in float16, q = min(15, (int)(x / d + 8.5))."""
    b = w.float().reshape(w.shape[0], -1, 32)
    extreme = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
    d = (extreme / -8).half().float()
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(b * inverse + 8.5), max=15)
    return ((q - 8) * d).reshape(w.shape)


def _relative_error(approx: torch.Tensor, w: torch.Tensor) -> float:
    return ((approx - w).square().sum() / w.square().sum()).sqrt().item()


def test_int4_groups_reconstruct_the_weight_better_than_their_plain_range():
    """Codes 0..15, scales and offsets that bfloat16 holds exactly (the kernels' dtype, so the
    codes were rounded against what is multiplied), and every group's squared error no larger
    than with its plain range (minimum to 0, maximum to 15), on weights with an outlier in
    some groups too."""
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(0))
    w[::7, 5] *= 12  # outliers: the plain range wastes most codes on them
    for group in (32, 64, 128):
        codes, scale, zero = quantize_groups_int4(w, group)
        assert codes.dtype == torch.int32 and codes.min() >= 0 and codes.max() <= 15
        assert torch.equal(scale, scale.to(torch.bfloat16).float()) and (scale > 0).all()
        assert torch.equal(zero, zero.to(torch.bfloat16).float())
        deq = (codes.reshape(40, -1, group).float() - 8) * scale[..., None] + zero[..., None]
        ours = (deq - w.reshape(40, -1, group)).square().sum(-1)
        plain = (_plain_range_int4(w, group).reshape(40, -1, group) - w.reshape(40, -1, group)).square().sum(-1)
        assert (ours <= plain * (1 + 1e-6)).all(), group
        assert ours.sum() < 0.9 * plain.sum(), group  # and better overall, not only no worse


def test_int4_groups_of_64_are_closer_to_the_weights_than_llama_cpp_q4_0():
    """At the same size (4.5 bits a weight: a bfloat16 scale and offset per 64 values in our
    CPU kernel's layout, a float16 scale per 32 in Q4_0) our int4 weights are closer to the
    float ones than ggml's Q4_0 on Gaussian weights (relative RMS error, measured 0.083
    against 0.086); groups of 32 closer still, and the plain range at 64 was not (0.090)."""
    w = torch.randn(256, 2048, generator=torch.Generator().manual_seed(1)) * 0.02

    def ours(group: int) -> torch.Tensor:
        codes, scale, zero = quantize_groups_int4(w, group)
        return ((codes.reshape(256, -1, group).float() - 8) * scale[..., None] + zero[..., None]).reshape(w.shape)

    q4_0 = _relative_error(_q4_0(w), w)
    assert 0.08 < q4_0 < 0.09  # the reference is Q4_0 (its error on Gaussian weights: 0.086)
    assert _relative_error(_plain_range_int4(w, 64), w) > q4_0  # what searching changed
    assert _relative_error(ours(64), w) < 0.97 * q4_0
    assert _relative_error(ours(32), w) < 0.9 * q4_0


def dequantized_int4_twin(ckpt, group_size: int, **kw):
    """A float model whose weights are the int4 model's, expanded by the formula."""
    twin = build(ckpt, **kw)
    unpack_weights_(twin.model)  # weights are changed in place below
    with torch.no_grad():
        for module in twin.model.modules():
            if isinstance(module, DenseWeight):
                codes, scale, zero = quantize_groups_int4(module.weight, group_size)
                out_f, in_f = codes.shape
                deq = (codes.reshape(out_f, -1, group_size).float() - 8) * scale[..., None] + zero[..., None]
                module.weight.copy_(deq.reshape(out_f, in_f).to(module.weight.dtype))
    return twin


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_weights_compute_the_dequantized_product(ckpt, dtype):
    quant = build(ckpt, dtype=dtype, quantize="int4", quantize_group_size=32)
    output = quant.model.output
    assert isinstance(output, Int4Weight)  # torch's packing, or our CPU kernel's layout in its place
    assert (output.weight_int4 if output.int4_kernel_rows is None else output.int4_kernel_rows).dtype == torch.uint8
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


# -- quantize="w8a8": int8 activations in one-row products -------------------------------------------

REDUCE_RANGE = CpuFeatures.probe().int8_activation_reduce_range
needs_int8_kernel = pytest.mark.skipif(REDUCE_RANGE is None, reason="this torch build has no fbgemm int8 product "
                                                                    "(x86 builds of torch have it)")


@needs_int8_kernel
@pytest.mark.parametrize("reduce_range", [False, True])
def test_w8a8_product_within_the_activation_rounding_bound(reduce_range):
    """fbgemm's int8 x int8 product against the exact product of the same int8 weights: the
    only change is the row's quantisation to codes of step s = range / 255 (127 with
    reduce_range), the range including zero.  Each value moves by at most s (s / 2 to the
    nearest code, and up to s / 2 more at the ends of the range, where the rounded zero
    point shifts the codes), so output j moves by at most s * sum_k |W[j, k]|.  The
    result must also be nearer to the exact product than 1/4 of that bound on average:
    rounding errors of independent values mostly cancel."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 256, generator=g) * 0.05
    q, scale = quantize_rows_int8(w)
    packed = packing.pack_weight_int8(q, scale, reduce_range=reduce_range)
    x = torch.randn(1, 256, generator=g) * 3
    x[0, 7] = 40.0  # an outlier widens the range: coarser codes for every other value
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    out = packing.packed_linear(x, packed)
    assert out.dtype == x.dtype and out.shape == (1, 96)
    step = (x.max().clamp(min=0) - x.min().clamp(max=0)).double() / (127 if reduce_range else 255)
    bound = step * (q.double() * scale.double()[:, None]).abs().sum(1)
    error = (out.double() - exact).abs()[0]
    assert (error <= bound + 1e-4).all()
    assert error.mean() < bound.mean() / 4
    assert error.max() > 0  # it did quantise the activations


@needs_int8_kernel
def test_w8a8_kernel_needs_no_reduced_range_where_it_sums_in_int32():
    """The probe that picks 8- or 7-bit codes: on this CPU, 8-bit codes either give exact
    sums (then w8a8 uses them) or overflow 16 bits (then it uses 7-bit codes, which cannot)."""
    q = torch.full((16, 512), 127, dtype=torch.int8)
    x = torch.ones(1, 512)  # every code 255: the largest sums a product can make
    exact = 512 * 127.0
    full = torch.ops.quantized.linear_dynamic(x, packing.pack_weight_int8(q, torch.ones(16), reduce_range=False).packed,
                                              False)
    assert REDUCE_RANGE == (not torch.allclose(full, torch.full_like(full, exact), rtol=1e-4))
    reduced = torch.ops.quantized.linear_dynamic(x,
                                                 packing.pack_weight_int8(q, torch.ones(16), reduce_range=True).packed,
                                                 True)
    torch.testing.assert_close(reduced, torch.full_like(reduced, exact), rtol=1e-4, atol=0)


@needs_int8_kernel
def test_w8a8_decoding_steps_take_int8_activations_prompts_do_not(llama3_checkpoint):
    """w8a8 holds int8's weights; prompts (many rows) go through int8's own products, so
    their logits are int8's bit for bit, while a one-row step goes through fbgemm: close to
    int8's (the activations' 8-bit rounding, about 2**-8 of each row's range, in every
    layer), not equal."""
    int8 = build(llama3_checkpoint, dtype="bfloat16", quantize="int8")
    w8a8 = build(llama3_checkpoint, dtype="bfloat16", quantize="w8a8")
    assert torch.equal(w8a8.model.output.weight_int8, int8.model.output.weight_int8)
    layers = [m for m in w8a8.model.modules() if isinstance(m, ParallelLinear)]
    assert layers and all(isinstance(m, W8A8Weight) for m in layers)
    tokens = torch.randint(0, int8.model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(5))
    assert torch.equal(w8a8.model.forward(tokens, 0), int8.model.forward(tokens, 0))
    one, ref = w8a8.model.forward(tokens[:1, :1], 0), int8.model.forward(tokens[:1, :1], 0)
    assert 0 < rel_err(one, ref) < 0.03
    assert w8a8.generate([[1, 2, 3]], max_gen_len=8, temperature=0)[0][0]  # it decodes


@needs_int8_kernel
def test_w8a8_siblings_packed_as_one_give_each_layers_own_product(llama3_checkpoint):
    """wq/wk/wv and w1/w3 share one fbgemm matrix per module under w8a8: for one row, the
    one product's parts equal each layer's own fbgemm product bit for bit (integer sums,
    a scale per output row, one quantisation of the same row); for more rows each layer's
    own int8 product runs (bfloat16 activations), as without w8a8."""
    w8a8 = build(llama3_checkpoint, dtype="bfloat16", quantize="w8a8")
    int8 = build(llama3_checkpoint, dtype="bfloat16", quantize="int8")
    g = torch.Generator().manual_seed(4)
    for block, plain in zip(w8a8.model.layers, int8.model.layers):
        for name, names in (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3"))):
            module, reference = getattr(block, name), getattr(plain, name)
            fused = module.fused
            assert isinstance(fused, W8A8FusedProjections)
            layers = [getattr(module, n) for n in names]
            one = torch.randn(1, 1, layers[0].in_features, generator=g).bfloat16()
            for part, layer in zip(fused(one), layers):
                alone = packing.pack_weight_int8(layer.weight_int8, layer.weight_scale.float(), REDUCE_RANGE)
                assert torch.equal(part, packing.packed_linear(one, alone))
                assert torch.equal(part, layer(one))  # the layer's own one-row product is the same
            rows = torch.randn(3, 1, layers[0].in_features, generator=g).bfloat16()
            for part, n in zip(fused(rows), names):
                assert torch.equal(part, getattr(reference, n)(rows))
    assert w8a8.model.state_dict().keys() == int8.model.state_dict().keys()  # the packed copy adds no entries


@needs_int8_kernel
def test_unpacking_leaves_quantized_projections_alone(llama3_checkpoint):
    """unpack_weights_ undoes bfloat16/float16 packing only: on an int8 or w8a8 model it
    changes nothing (no layer was packed that way), and w8a8's one-row steps keep their int8
    activations (dropping its grouped products made wq/wk/wv and w1/w3 weight-only int8)."""
    tokens = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(6))
    for mode in ("int8", "w8a8"):
        llama = build(llama3_checkpoint, dtype="bfloat16", quantize=mode)
        llama.model.forward(tokens, 0)
        step = llama.model.forward(tokens[:, -1:], 6)  # one row: w8a8's int8-activation products
        groups = [m.fused for m in llama.model.modules() if getattr(m, "fused", None) is not None]
        assert len(groups) == 2 * llama.model.n_layers
        assert unpack_weights_(llama.model) == 0
        assert [m.fused for m in llama.model.modules() if getattr(m, "fused", None) is not None] == groups
        assert torch.equal(llama.model.forward(tokens[:, -1:], 6), step), mode


@needs_int8_kernel
def test_w8a8_refuses_weights_off_the_cpu(llama3_checkpoint):
    model = build(llama3_checkpoint, dtype="bfloat16", quantize="int8").model
    model.output.weight_int8 = model.output.weight_int8.to("meta")
    policy = KernelPolicy.decide(torch.device("cpu"), torch.bfloat16, quantize="w8a8")
    with pytest.raises(ValueError, match='w8a8.*CPU only.*use "int8"'):
        use_int8_activations_(model, policy)
    assert not any(isinstance(m, W8A8Weight) or isinstance(m, W8A8FusedProjections)
                   for m in model.modules())  # nothing half done


def test_w8a8_without_fbgemm_s_int8_product_is_refused(llama3_checkpoint):
    """A CPU policy with no int8 product (a torch build without fbgemm) refuses w8a8 in one line."""
    import dataclasses

    model = build(llama3_checkpoint, dtype="bfloat16", quantize="int8").model
    policy = dataclasses.replace(KernelPolicy.decide(torch.device("cpu"), torch.bfloat16),
                                 int8_activation_reduce_range=None)
    with pytest.raises(RuntimeError, match="needs fbgemm's int8 product.*use quantize=\"int8\""):
        use_int8_activations_(model, policy)


def test_int8_products_off_the_cpu_copy_no_weight_for_decoding_rows():
    """On a GPU, up to ``int8_direct_up_to_rows`` rows (decoding steps and batches) go through
    the Triton op llama::int8_weight_mm (llama.layers.triton_int8), which reads the int8 weight
    as it is; before, batches made a full-precision copy of the weight (``weight.to(x.dtype)``)
    and one-row steps went through torch._weight_int8pack_mm's one-thread-per-output kernel.
    Prompts still convert it.  Traced on the meta device (no GPU here): which ops run, with
    which shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llama.layers.products import int8_product

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    weight = torch.empty(96, 256, dtype=torch.int8, device="meta")
    scale = torch.empty(96, dtype=torch.bfloat16, device="meta")
    policy = KernelPolicy()
    assert policy.int8_direct_up_to_rows == 64
    for rows, direct in ((1, True), (8, True), (64, True), (65, False), (200, False)):
        x = torch.empty(rows, 1, 256, dtype=torch.bfloat16, device="meta")
        with Ops() as ops:
            out = int8_product(x, weight, scale, policy)
        assert out.shape == (rows, 1, 96) and out.dtype == torch.bfloat16
        funcs = [f for f, _ in ops.calls]
        weight_copies = [f for f, shapes in ops.calls if "_to_copy" in str(f) and shapes[0] == (96, 256)]
        assert (torch.ops.llama.int8_weight_mm.default in funcs) == direct, (rows, funcs)
        assert torch.ops.aten._weight_int8pack_mm.default not in funcs, (rows, funcs)
        assert bool(weight_copies) != direct, (rows, funcs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_off_the_cpu_computes_the_dequantized_product(dtype):
    """The GPU int8 product's few-row and many-row paths, run here on CPU tensors (bfloat16's few
    rows by the Triton kernels under Triton's interpreter where Triton is installed, else, as
    float32's, by the converted weight): each within 2**-7 of the largest output of the
    dequantised product in float64, for a row that is not contiguous too."""
    from llama.layers.products import int8_product_off_cpu

    g = torch.Generator().manual_seed(13)
    q, scale = quantize_rows_int8(torch.randn(48, 128, generator=g))
    for rows in (1, 3, 40):
        x = torch.randn(128, rows, generator=g).to(dtype).t().unsqueeze(1)  # (rows, 1, 128), strided
        exact = x.double() @ (q.double() * scale.double()[:, None]).t()
        out = int8_product_off_cpu(x, q, scale.to(dtype), KernelPolicy())
        assert out.shape == exact.shape and out.dtype == dtype
        assert ((out.double() - exact).abs() <= 2.0 ** -7 * exact.abs().amax() + 1e-6).all(), rows
