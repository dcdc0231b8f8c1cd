"""Our int8/int4 CPU kernels (llama.layers.cpu_kernels, csrc/qmatmul.cpp): every instruction
path this CPU has against their pure-torch twins (the same arithmetic: activations quantised in
blocks of 32, integer block sums) and against the float product of the dequantised weight,
within the bound the activations' quantisation allows; the int4 layout from torch's packing
exactly; the kernel policy's choice; and the model falling back to torch's kernels where the
kernels cannot be built."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import helpers
from helpers import build
from llama.layers import cpu_kernels, prepare
from llama.layers.cpu import CpuFeatures, int8_dot_of
from llama.layers.policy import KernelPolicy
from llama.layers.products import int4_product, int8_product
from llama.layers.quantize import int4_matrix, quantize_groups_int4, quantize_rows_int8
from llama.layers.quantized import Int4FusedProjections
from llama.runtime import host

PATHS = {"avx512_vnni": ["avx2", "avx512_vnni"], "avx2": ["avx2"], None: []}[CpuFeatures.probe().int8_dot]


@pytest.fixture(scope="module")
def kernels():
    """The kernels, built once per session (cached on disk across sessions)."""
    if not PATHS:
        pytest.skip("this CPU has neither AVX2 nor AVX-512 VNNI")
    if not cpu_kernels.load():
        pytest.skip("the kernels could not be built here (no C++ compiler?)")
    return PATHS


def _activation_error_bound(d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, out) bound on |x @ W.T - (x as quantised) @ W.T|, from each value's block scale
    ``d`` (rows, in): a value moves by at most half of it."""
    return (d.double() / 2) @ weight.double().abs().t()


# widths: one block of 32; 64n + 32; fewer than 8 vectors of 64; 512n + 256 (int4's half chunk); 512n;
# one row of a width 512n (int4 takes 4 weight rows at a time there: 70 = 17 * 4 + 2, and 3)
SHAPES = [(1, 37, 96), (3, 50, 64), (8, 129, 768), (9, 64, 2048), (1, 17, 32), (5, 33, 800), (4, 20, 1120),
          (1, 70, 1024), (1, 3, 512)]


@pytest.mark.parametrize("rows,out_features,width", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_against_its_twin_and_the_float_product(kernels, rows, out_features, width, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + width)
    weight = torch.randn(out_features, width, generator=g) * 0.05
    x = (torch.randn(rows, width, generator=g) * 2).to(dtype)
    codes, scale = quantize_rows_int8(weight)
    twin = cpu_kernels.q8_reference(x.float(), codes, scale).double()
    dequantised = codes.double() * scale.double()[:, None]
    exact = x.double() @ dequantised.t()
    bound = _activation_error_bound(cpu_kernels.quantize_activations_int8(x)[1], dequantised)
    output_rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6
    for isa in kernels:
        out = cpu_kernels.q8_linear(x, codes, scale.to(dtype), isa)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        tolerance = output_rounding * twin.abs() + 1e-5 * twin.abs().amax() + 1e-6
        if dtype == torch.bfloat16:  # the scale itself rounded to bfloat16: 2**-9 relative
            tolerance = tolerance + 2.0 ** -8 * twin.abs()
        assert ((out.double() - twin).abs() <= tolerance).all(), isa
        assert ((out.double() - exact).abs() <= bound * 1.001 + tolerance + 2.0 ** -8 * exact.abs()).all(), isa


@pytest.mark.parametrize("width,group", [(96, 32), (800, 32), (1280, 128), (768, 64)])
def test_every_tile_height_against_the_twin(kernels, width, group):
    """Every number of activation rows a tile takes (1-8), and more (two tiles), for output
    counts that leave partial tiles and blocks of outputs (weight rows not a multiple of the
    tile's, more than one block of 64), on widths of 64n + 32 and with a partial group, and
    int4 with a scale per 2 and 4 blocks: each row of the product is the twin's and does not
    depend on the rows around it."""
    g = torch.Generator().manual_seed(width)
    out_features = 131
    weight = torch.randn(out_features, width, generator=g) * 0.05
    codes, scale = quantize_rows_int8(weight)
    c4, s4, z4 = quantize_groups_int4(weight, group)
    s4, z4 = s4.to(torch.bfloat16), z4.to(torch.bfloat16)
    packed = cpu_kernels.pack_int4(c4, s4, z4)
    x = torch.randn(11, width, generator=g)
    twin8 = cpu_kernels.q8_reference(x, codes, scale).double()
    twin4 = cpu_kernels.q4_reference(x, c4, s4, z4).double()
    for isa in kernels:
        for rows in range(1, 12):
            out8 = cpu_kernels.q8_linear(x[:rows], codes, scale, isa).double()
            out4 = cpu_kernels.q4_linear(x[:rows], packed, width, isa).double()
            assert out8.shape == out4.shape == (rows, out_features)
            for out, twin in ((out8, twin8[:rows]), (out4, twin4[:rows])):
                tolerance = 1e-5 * twin.abs().amax() + 1e-6
                assert ((out - twin).abs() <= tolerance).all(), (isa, rows)


@pytest.mark.parametrize("rows,out_features,width", [s for s in SHAPES])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_int4_kernel_against_its_twin_and_the_float_product(kernels, rows, out_features, width, group):
    if width % group:
        pytest.skip("groups must divide the width")
    g = torch.Generator().manual_seed(rows * 1000 + width + group)
    weight = torch.randn(out_features, width, generator=g) * 0.05
    x = torch.randn(rows, width, generator=g) * 2
    codes, scale, zero = quantize_groups_int4(weight, group)
    scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
    packed = cpu_kernels.pack_int4(codes, scale, zero)
    assert packed.shape == (out_features, cpu_kernels.int4_row_bytes(width, group))
    twin = cpu_kernels.q4_reference(x, codes, scale, zero).double()
    dequantised = ((codes.double() - 8) * scale.double().repeat_interleave(group, 1)
                   + zero.double().repeat_interleave(group, 1))
    exact = x.double() @ dequantised.t()
    bound = _activation_error_bound(cpu_kernels.quantize_activations(x)[1].repeat_interleave(32, dim=1), dequantised)
    for isa in kernels:
        out = cpu_kernels.q4_linear(x, packed, width, isa).double()
        tolerance = 1e-5 * twin.abs().amax() + 1e-6
        assert ((out - twin).abs() <= tolerance).all(), isa
        assert ((out - exact).abs() <= bound * 1.001 + tolerance).all(), isa


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_kernel_at_its_largest_sums(kernels, sign):
    """Codes all 15 against activations all at their block's largest code (+-127): the largest
    integer sums the kernels form (the AVX2 path adds 8 vectors' pair sums in 16 bits, up to
    8 * 2 * 15 * 127 = 30,480 < 2**15), at one row and at tiles of several, equal the twin's."""
    out_features, width = 70, 1024
    codes = torch.full((out_features, width), 15, dtype=torch.int32)
    scale = torch.full((out_features, width // 32), 1.0, dtype=torch.bfloat16)
    zero = torch.zeros_like(scale)
    packed = cpu_kernels.pack_int4(codes, scale, zero)
    x = torch.full((5, width), sign)
    twin = cpu_kernels.q4_reference(x, codes, scale, zero).double()
    assert twin.abs().amin() > 0
    for isa in kernels:
        for rows in (1, 5):
            out = cpu_kernels.q4_linear(x[:rows], packed, width, isa).double()
            assert ((out - twin[:rows]).abs() <= 1e-6 * twin.abs().amax()).all(), (isa, rows)


def test_int4_layout_stores_a_scale_and_offset_per_group():
    """A row's bytes: half a byte a value plus 4 (a bfloat16 scale and offset) per group of up
    to 256 values, over the width padded to 256: groups of 128 read 4.25 bits a weight (Q4_0
    reads 4.5), of 32 five.  Larger groups store their scale once per 256 values.  Rows of
    another length are refused, by the unpacking and by the kernel."""
    for width in (256, 512, 1024, 1280, 2048):
        for group in (32, 64, 128, 256, 512):
            stored = min(group, 256)
            assert cpu_kernels.int4_row_bytes(width, group) == width // 2 + 4 * width // stored, (width, group)
    assert 8 * cpu_kernels.int4_row_bytes(2048, 128) / 2048 == 4.25
    assert 8 * cpu_kernels.int4_row_bytes(2048, 32) / 2048 == 5.0
    weight = torch.randn(6, 1024, generator=torch.Generator().manual_seed(3))
    codes, scale, zero = quantize_groups_int4(weight, 512)
    packed = cpu_kernels.pack_int4(codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16))
    assert packed.shape == (6, cpu_kernels.int4_row_bytes(1024, 256))
    again, s_again, z_again = cpu_kernels.unpack_int4(packed, 1024)
    assert torch.equal(again, codes.to(torch.uint8))
    assert torch.equal(s_again, scale.to(torch.bfloat16).repeat_interleave(16, dim=1))
    assert torch.equal(z_again, zero.to(torch.bfloat16).repeat_interleave(16, dim=1))
    with pytest.raises(ValueError, match="not the int4 layout"):
        cpu_kernels.unpack_int4(packed[:, :-4], 1024)
    if PATHS and cpu_kernels.load():
        with pytest.raises(RuntimeError, match="do not match the width"):
            cpu_kernels.q4_linear(torch.randn(1, 1024), packed[:, :-4].contiguous(), 1024, PATHS[0])


def test_int8_activation_blocks():
    """32 values each (a last group of fewer vectors: 4 a vector), strided as the kernel's lanes."""
    for width in (32, 96, 512, 800, 1120, 2048):
        counts = torch.bincount(cpu_kernels.q8_block_index(width))
        vectors = width // 64
        full = vectors // 8 * 16
        rest = counts[full : full + (16 if vectors % 8 else 0)]
        assert (counts[:full] == 32).all() and (rest == 4 * (vectors % 8)).all()
        assert counts.sum() == width and (width % 64 == 0 or counts[-1] == 32)
    assert cpu_kernels.q8_block_index(512)[[0, 3, 4, 64, 67, 511]].tolist() == [0, 0, 1, 0, 0, 15]


@pytest.mark.parametrize("rows", [64, 80, 144, 200])
def test_int4_codes_come_back_from_torch_packing_exactly(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(rows, 96, generator=g)
    packed, scales_and_zeros, _ = int4_matrix(weight, 32)  # rows padded to a multiple of 16
    codes, scale, zero = quantize_groups_int4(weight, 32)
    unpacked = cpu_kernels.codes_from_torch_int4(packed, 96)
    assert torch.equal(unpacked[:rows], codes.to(torch.uint8))
    assert (unpacked[rows:] == 8).all()  # the padding rows: code 8, offset 0
    ours = cpu_kernels.pack_int4_from_torch(packed, scales_and_zeros, 96, block_rows=64)
    assert torch.equal(ours[:rows], cpu_kernels.pack_int4(codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16)))


@pytest.mark.parametrize("rows,width,group", [(64, 96, 32), (80, 768, 64), (200, 512, 128), (144, 800, 32),
                                              (16, 2048, 256)])
def test_torch_packing_comes_back_from_the_kernel_layout_exactly(rows, width, group):
    """What a layer holding only the kernel's layout gives state_dict(): torch's packing, bit for bit."""
    weight = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows + width))
    packed, scales_and_zeros, _ = int4_matrix(weight, group)
    ours = cpu_kernels.pack_int4_from_torch(packed, scales_and_zeros, width)
    codes, scale, zero = cpu_kernels.unpack_int4(ours, width)
    assert torch.equal(codes, cpu_kernels.codes_from_torch_int4(packed, width))
    assert torch.equal(scale, scales_and_zeros[:, :, 0].t().repeat_interleave(group // 32, dim=1))
    assert torch.equal(zero, scales_and_zeros[:, :, 1].t().repeat_interleave(group // 32, dim=1))
    again, sz_again = cpu_kernels.torch_int4_from_kernel_layout(ours, width, group, block_rows=64)
    assert torch.equal(again, packed) and torch.equal(sz_again, scales_and_zeros)


def test_widths_not_a_multiple_of_32(kernels):
    """The kernels refuse them with a clear error; int8_product sends them to torch's kernel."""
    weight = torch.randn(24, 48)
    codes, scale = quantize_rows_int8(weight)
    x = torch.randn(1, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.q8_linear(x, codes, scale, kernels[0])
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.pack_int4(torch.zeros(4, 48, dtype=torch.int32), torch.ones(4, 1), torch.zeros(4, 1))
    policy = KernelPolicy(cpu_qkernel=kernels[0])
    out = int8_product(x, codes, scale.to(torch.bfloat16), policy)
    expected = torch._weight_int8pack_mm(x.to(torch.bfloat16), codes, scale.to(torch.bfloat16)).float()
    assert torch.equal(out, expected)


def test_products_take_the_kernel_the_policy_names(kernels):
    """int8: fewer than int8_convert_from_rows rows through the kernel (its twin's result),
    more through torch's; int4: through the kernel where the layer holds its layout."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 64, generator=g)
    codes, scale = quantize_rows_int8(weight)
    scale = scale.to(torch.bfloat16)
    policy = KernelPolicy(cpu_qkernel=kernels[-1])
    few, many = torch.randn(2, 64, generator=g), torch.randn(policy.int8_convert_from_rows, 64, generator=g)
    twin = cpu_kernels.q8_reference(few, codes, scale)
    assert torch.allclose(int8_product(few, codes, scale, policy), twin, rtol=1e-5, atol=1e-5)
    assert torch.equal(int8_product(many, codes, scale, policy), int8_product(many, codes, scale, KernelPolicy()))
    prompts = dataclasses.replace(policy, int8_qkernel_for_prompts=True)
    twin_many = cpu_kernels.q8_reference(many, codes, scale)
    assert torch.allclose(int8_product(many, codes, scale, prompts), twin_many, rtol=1e-5, atol=1e-5)
    packed, scales_and_zeros, _ = int4_matrix(weight, 32)
    rows = cpu_kernels.pack_int4_from_torch(packed, scales_and_zeros, 64)
    c, s, z = quantize_groups_int4(weight, 32)
    twin4 = cpu_kernels.q4_reference(few, c, s.to(torch.bfloat16), z.to(torch.bfloat16))
    out = int4_product(few, packed, scales_and_zeros, 32, rows, policy)[:, :40]
    assert torch.allclose(out, twin4, rtol=1e-5, atol=1e-5)
    torch_kernel = int4_product(few, packed, scales_and_zeros, 32, rows, KernelPolicy())[:, :40]
    assert torch.equal(torch_kernel, int4_product(few, packed, scales_and_zeros, 32)[:, :40])


def test_the_policy_takes_the_cpus_dot_product_path():
    base = CpuFeatures(vendor="intel", capability="AVX512", amx_bf16=False, native_bf16=False, onednn_bf16=True,
                       onednn_fp16=True, fbgemm_fp16=True, fbgemm_fp16_one_thread=True,
                       int8_activation_reduce_range=False)
    for path in ("avx512_vnni", "avx2", None):
        cpu = dataclasses.replace(base, int8_dot=path)
        policy = KernelPolicy.decide(torch.device("cpu"), torch.bfloat16, quantize="int8", cpu=cpu)
        assert policy.cpu_qkernel == path
        assert policy.int8_qkernel_for_prompts == (path == "avx512_vnni")  # prompts: VNNI's tiles only
    # the compiled attention's weighted sum: a matrix product where Inductor writes 256-bit code
    for capability, by_matmul in (("AVX512", False), ("AVX2", True), ("DEFAULT", False)):
        cpu = dataclasses.replace(base, capability=capability)
        policy = KernelPolicy.decide(torch.device("cpu"), torch.bfloat16, cpu=cpu)
        assert policy.attention_as_reduction and policy.attention_values_by_matmul == by_matmul, capability
    amx = dataclasses.replace(base, int8_dot="avx512_vnni", amx_bf16=True, native_bf16=True)
    with_amx = KernelPolicy.decide(torch.device("cpu"), torch.bfloat16, quantize="int8", cpu=amx)
    assert with_amx.cpu_qkernel == "avx512_vnni" and not with_amx.int8_qkernel_for_prompts
    assert KernelPolicy.decide(torch.device("meta"), torch.bfloat16, quantize="int8").cpu_qkernel is None
    avx512 = {f: True for f in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_vnni", "avx2", "fma3")}
    assert int8_dot_of(avx512) == "avx512_vnni"
    assert int8_dot_of({**avx512, "avx512_vnni": False}) == "avx2"
    assert int8_dot_of({"avx2": True, "fma3": False}) is None
    assert int8_dot_of({}) is None
    # no wider than torch's own kernels (ATEN_CPU_CAPABILITY)
    assert int8_dot_of(avx512, "AVX2") == "avx2"
    assert int8_dot_of(avx512, "DEFAULT") is None


def test_aten_cpu_capability_keeps_the_kernels_on_avx2():
    """``ATEN_CPU_CAPABILITY=avx2`` in a fresh process: torch's kernels and ours both take their AVX2
    paths, whatever wider instructions the CPU has."""
    if CpuFeatures.probe().int8_dot is None:
        pytest.skip("this CPU has neither kernel path")
    code = ("import torch; from llama.layers.cpu import CpuFeatures; "
            "print(torch.backends.cpu.get_cpu_capability(), CpuFeatures.probe().int8_dot)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                         cwd=helpers.REPO, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out[-2:] == ["AVX2", "avx2"]


def test_no_compiler_keeps_torch_kernels(monkeypatch, llama3_checkpoint):
    """Where the kernels cannot be built, load() says so and a quantised model keeps torch's
    kernels (its policy without cpu_qkernel, no int4 layout)."""
    monkeypatch.setattr(host, "cpp_compiler", lambda environ=None: None)
    assert cpu_kernels.load.__wrapped__() is False
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    llama = build(llama3_checkpoint, quantize="int4", quantize_group_size=32)
    layer = llama.model.layers[0].attention.wq
    assert llama.policy.cpu_qkernel == CpuFeatures.probe().int8_dot  # asked for, not available
    assert layer.policy.cpu_qkernel is None and layer.int4_kernel_rows is None


def test_int4_model_layers_hold_the_kernel_layout(kernels, llama3_checkpoint):
    """A model built with quantize="int4" on this CPU multiplies through the kernel: each layer
    holds its matrix in the kernel's layout only (torch's packing dropped: one copy), its
    product is the twin's, layers that read the same input multiply as one, and state_dict()
    still gives torch's packing, which loads back."""
    llama = build(llama3_checkpoint, quantize="int4", quantize_group_size=32)
    layer = llama.model.layers[0].attention.wq
    assert layer.policy.cpu_qkernel is not None and layer.int4_kernel_rows is not None
    assert layer.weight_int4 is None and layer.weight_scales_and_zeros is None
    assert prepare.use_cpu_int4_layout_(llama.model) == 0  # laid out once
    state = llama.model.state_dict()
    assert not any("kernel" in key for key in state)
    packed, sz = state["layers.0.attention.wq.weight_int4"], state["layers.0.attention.wq.weight_scales_and_zeros"]
    width = packed.shape[1] * 2
    assert packed.dtype == torch.uint8 and sz.shape == (width // 32, layer.int4_kernel_rows.shape[0], 2)
    codes = cpu_kernels.codes_from_torch_int4(packed, width)
    x = torch.randn(3, width)
    twin = cpu_kernels.q4_reference(x, codes, sz[:, :, 0].t(), sz[:, :, 1].t())[:, : layer.int4_out_features]
    assert torch.allclose(layer.local_matmul(x), twin, rtol=1e-5, atol=1e-5)
    # wq, wk, wv as one matrix (the layers' rows views of it): the same outputs, bit for bit
    attention = llama.model.layers[0].attention
    assert isinstance(attention.fused, Int4FusedProjections)
    assert layer.int4_kernel_rows.untyped_storage().data_ptr() == \
        attention.fused.int4_kernel_rows.untyped_storage().data_ptr()
    x = torch.randn(2, width).to(torch.bfloat16)
    own = torch.cat([getattr(attention, n).local_matmul(x) for n in ("wq", "wk", "wv")], dim=-1)
    assert torch.equal(torch.cat(attention.fused(x), dim=-1), own)
    before = attention.fused.int4_kernel_rows.clone()
    attention.fused.int4_kernel_rows.zero_()  # the layers' views with it
    llama.model.load_state_dict(state)  # strict: every key taken, torch's packing laid out again in place
    assert torch.equal(attention.fused.int4_kernel_rows, before) and layer.weight_int4 is None
    assert torch.equal(torch.cat(attention.fused(x), dim=-1), own)


def test_int4_model_in_groups_of_128_holds_a_scale_per_group_where_that_is_faster(kernels, tmp_path,
                                                                                 tiny_tiktoken_path, monkeypatch):
    """Groups of 128 on a model 128 wide (FFN 512): on this CPU's kernel path its layers hold a
    scale per group (AVX-512 VNNI: 4.25 bits a weight) or per block of 32 (AVX2: 5 bits), as
    cpu_kernels.scale_per_group says and the memory count expects; the other layout holds the
    same codes, scales and offsets and gives the same logits bit for bit (each lane multiplies
    by the same scale either way) and the same state_dict (torch's packing)."""
    from conftest import LLAMA3_PARAMS
    from llama.layers.quantized import Int4Weight

    params = {**LLAMA3_PARAMS, "dim": 128, "n_layers": 1, "multiple_of": 128, "vocab_size": 556}
    weights = helpers.random_weights(params, 556, seed=3)
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, weights, 1, "vocab")
    kw = dict(dtype="bfloat16", quantize="int4", quantize_group_size=128)
    tokens = torch.tensor([[1, 5, 9, 11, 40, 2]])
    isa = CpuFeatures.probe().int8_dot
    assert cpu_kernels.expected_scale_spacing(128) == (128 if isa == "avx512_vnni" else 32)
    results = {}
    for per_group in (cpu_kernels.scale_per_group(isa), not cpu_kernels.scale_per_group(isa)):
        monkeypatch.setattr(cpu_kernels, "scale_per_group", lambda isa, per_group=per_group: per_group)
        llama = build((ckpt, tiny_tiktoken_path), **kw)
        layers = [m for m in llama.model.modules() if isinstance(m, Int4Weight)]
        assert layers and all(m.int4_kernel_rows is not None for m in layers)
        for m in layers:
            spacing = 128 if per_group else 32
            assert m.int4_kernel_rows.shape[1] == cpu_kernels.int4_row_bytes(m.int4_in_features, spacing)
            assert cpu_kernels.holds_scale_per_group(m.int4_kernel_rows, m.int4_in_features) == per_group
        with torch.inference_mode():
            results[per_group] = (llama.model.forward(tokens, 0), llama.model.state_dict())
    (logits, state), (logits_other, state_other) = results.values()
    assert torch.equal(logits, logits_other)
    assert state.keys() == state_other.keys() and all(torch.equal(state[k], state_other[k]) for k in state)


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_products_equal_eager(kernels):
    """Under torch.compile the kernels are opaque operators (their fake kernels give the
    shapes): a compiled product gives the eager one's result bit for bit, for 1 and 8 rows."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(72, 256, generator=g)
    codes, scale = quantize_rows_int8(weight)
    scale = scale.to(torch.bfloat16)
    packed, scales_and_zeros, _ = int4_matrix(weight, 32)
    rows4 = cpu_kernels.pack_int4_from_torch(packed, scales_and_zeros, 256)
    policy = KernelPolicy(cpu_qkernel=kernels[-1])

    def both(x: torch.Tensor) -> torch.Tensor:
        int4 = int4_product(x, packed, scales_and_zeros, 32, rows4, policy)[:, :72]
        return int8_product(x, codes, scale, policy) + int4

    compiled = torch.compile(both, fullgraph=True, dynamic=False)
    for rows in (1, 8):
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        assert torch.equal(compiled(x), both(x))


def test_small_products_run_on_one_thread_with_the_same_results(kernels):
    """Products that read less than the bound (512 KiB of weights times activation rows) stay on
    the calling thread; the rest are split over torch's threads, each output row summed by one of
    them: the same results bit for bit whichever way a product runs, at 2 threads, for one row
    and for several, int8 and int4, on every path this CPU has."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(1000, 1024, generator=g) * 0.05  # 1 MB int8, 0.5 MB int4 (groups of 64)
    codes8, scale8 = quantize_rows_int8(weight)
    codes4, scale4, zero4 = quantize_groups_int4(weight, 64)
    scale4, zero4 = scale4.to(torch.bfloat16), zero4.to(torch.bfloat16)
    packed4 = cpu_kernels.pack_int4(codes4, scale4, zero4)
    weights8 = codes8.float() * scale8.float()[:, None]
    weights4 = (codes4.float() - 8) * scale4.float().repeat_interleave(64, 1) + zero4.float().repeat_interleave(64, 1)
    threads = torch.get_num_threads()
    default = cpu_kernels.set_parallel_min_bytes(0)
    try:
        assert default == 512 * 1024
        torch.set_num_threads(2)
        for rows in (1, 5):
            x = torch.randn(rows, 1024, generator=g).to(torch.bfloat16)
            for isa in kernels:
                results = []
                for bound in (0, 1 << 40):  # every product split; none
                    cpu_kernels.set_parallel_min_bytes(bound)
                    results.append((cpu_kernels.q8_linear(x, codes8, scale8, isa),
                                    cpu_kernels.q4_linear(x, packed4, 1024, isa)))
                (split8, split4), (alone8, alone4) = results
                assert torch.equal(split8, alone8) and torch.equal(split4, alone4), (isa, rows)
                # against the weights the codes stand for (the activations' 8-bit codes: ~1 %)
                assert helpers.rel_err(alone8.float(), x.float() @ weights8.t()) < 0.02, (isa, rows)
                assert helpers.rel_err(alone4.float(), x.float() @ weights4.t()) < 0.02, (isa, rows)
    finally:
        cpu_kernels.set_parallel_min_bytes(default)
        torch.set_num_threads(threads)
