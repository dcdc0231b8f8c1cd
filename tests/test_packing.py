"""bfloat16/float16 weights packed for a CPU kernel (llama.layers.packing, llama.layers.packed):
each kernel's product against the float64 product of the stored weights, the values kept,
packed layers swapped in and back bit for bit, whole models against torch's own kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import build, rel_err
from llama import Llama
from llama.layers import packing
from llama.layers.cpu import CpuFeatures
from llama.layers.packed import PackedFusedProjections, PackedWeight, packed_bytes, unpack_weights_, use_packed_weights_
from llama.layers.parallel import ColumnParallelLinear, DenseWeight, ParallelLinear, RowParallelLinear
from llama.layers.policy import KernelPolicy

CPU = CpuFeatures.probe()
needs_fbgemm = pytest.mark.skipif(not CPU.fbgemm_fp16, reason="this torch build has no fbgemm (not x86)")
needs_onednn_bf16 = pytest.mark.skipif(not CPU.onednn_bf16,
                                       reason="torch runs no oneDNN bfloat16 product on this CPU (it needs AVX-512)")


@pytest.fixture(params=["llama2", "llama3"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_checkpoint")


def policy_packing(kind: str) -> KernelPolicy:
    """This CPU's bfloat16 policy, packing for ``kind``."""
    return KernelPolicy.decide(torch.device("cpu"), torch.bfloat16, cpu_packing=kind)


@pytest.fixture(params=["one-thread entry", "threaded entry"])
def one_thread_up_to(request, monkeypatch):
    """Pack every matrix for fbgemm's single-threaded entry point, or every one for its
    threaded one (the library picks by thread count and size: KernelPolicy.fp16_one_thread)."""
    if request.param == "one-thread entry":
        if not CPU.fbgemm_fp16_one_thread:
            pytest.skip("this torch build no longer has fbgemm's single-threaded fp16 entry point")
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # seen by the packing only
        return 1 << 62
    return 0


@needs_fbgemm
@pytest.mark.parametrize("dtype,unit_roundoff", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (2, 40, 96)])
def test_fp16_packed_product_is_the_product_of_the_stored_weights(dtype, unit_roundoff, shape, one_thread_up_to):
    """fbgemm converts the packed weight to float32 and accumulates in float32; the result is
    rounded to the activations' dtype once: within one unit roundoff (relative) of the
    float64 product, like torch's own bfloat16/float16 kernel."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(300, 96, generator=g).to(dtype)
    x = torch.randn(*shape, generator=g).to(dtype)
    out = packing.packed_linear(x, packing.pack_weight_fp16(weight, one_thread_up_to))
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
    if not CPU.fbgemm_fp16_one_thread:
        pytest.skip("this torch build no longer has fbgemm's single-threaded fp16 entry point")
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(3000, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 256, generator=g)
    up_to = KernelPolicy().fp16_one_thread_up_to
    assert weight.numel() <= up_to
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = packing.pack_weight_fp16(weight, up_to)
        torch.set_num_threads(2)
        threaded = packing.pack_weight_fp16(weight, up_to)
        torch.set_num_threads(threads)
        a, b = packing.packed_linear(x, one_thread), packing.packed_linear(x, threaded)
    finally:
        torch.set_num_threads(before)
    assert isinstance(one_thread, packing.OneThreadFp16Matrix)
    assert not isinstance(threaded, packing.OneThreadFp16Matrix)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-4)


@needs_fbgemm
def test_packing_keeps_bfloat16_weights_and_refuses_what_float16_cannot_hold(one_thread_up_to):
    """bfloat16 values from 2**-14 up to 65504 survive packing exactly; smaller ones become
    float16 subnormals, off by 2**-25 at most; a weight beyond 65504 is not packed."""
    g = torch.Generator().manual_seed(8)
    magnitudes = torch.logspace(-30, 15.99, 4096, base=2.0)  # 2**-30 .. just under 65536
    signs = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    weight = (magnitudes * signs).to(torch.bfloat16)
    weight = weight[weight.abs() <= 65504]
    weight = weight[torch.randperm(len(weight), generator=g)[: 64 * 32]].reshape(64, 32)
    unpacked = packing.unpack_weight_fp16(packing.pack_weight_fp16(weight, one_thread_up_to), 32).float()
    normal = weight.abs() >= 2.0 ** -14
    assert normal.sum() > 1000 and (~normal).sum() > 200
    assert torch.equal(unpacked[normal], weight[normal].float())
    assert (unpacked[~normal] - weight[~normal].float()).abs().max() <= 2.0 ** -25
    too_big = weight.clone()
    too_big[3, 4] = 1e6
    assert packing.pack_weight_fp16(too_big, one_thread_up_to) is None
    too_big[3, 4] = float("nan")
    assert packing.pack_weight_fp16(too_big, one_thread_up_to) is None


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("shape", [(300, 64), (64, 300), (1000, 512)])
def test_onednn_packed_product_is_the_product_of_the_stored_weights(rows, shape):
    """oneDNN's blocked layout keeps a bfloat16 weight exactly (unpacking gives the same
    bits), and its product is the float64 product of those values rounded once to
    bfloat16: within 2**-8 of each output's magnitude, plus float32 accumulation's error
    over the inner dimension (in * 2**-24 * sum |x w|; 1e-6 absolute covers it here)."""
    g = torch.Generator().manual_seed(11)
    weight = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    packed = packing.pack_weight(weight, "onednn")
    assert isinstance(packed, packing.OneDnnMatrix)
    unpacked = packing.unpack_weight(packed, shape[1])
    assert unpacked.dtype == torch.bfloat16 and torch.equal(unpacked, weight)
    x = torch.randn(rows, 1, shape[1], generator=g).to(torch.bfloat16)
    out = packing.packed_linear(x, packed)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1, shape[0])
    exact = x.double() @ weight.double().t()
    bound = 2.0 ** -8 * exact.abs() + shape[1] * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().t()) + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()


@needs_fbgemm
def test_packed_layers_are_swapped_in_and_back(ckpt):
    """Packing replaces each dense layer by a packed layer of its own class (same parallel
    split, same fairscale base class, no ``weight`` parameter left behind), the siblings that
    read the same input by rows of one shared matrix; unpacking swaps dense layers back, with
    the checkpoint's weights bit for bit (the values fbgemm's float16 matrix rounds, below
    2**-14, are kept aside)."""
    from fairscale.nn.model_parallel import layers as fs_layers

    llama = build(ckpt, dtype="bfloat16", policy=policy_packing("fbgemm"))
    model = llama.model
    attention = model.layers[0].attention
    assert isinstance(attention.wq, PackedWeight) and isinstance(attention.wq, fs_layers.ColumnParallelLinear)
    assert isinstance(attention.wo, PackedWeight) and isinstance(attention.wo, fs_layers.RowParallelLinear)
    assert not isinstance(attention.wq, DenseWeight) and "weight" not in dict(attention.wq.named_parameters())
    assert isinstance(attention.fused, PackedFusedProjections) and attention.wq.weight_packed is attention.fused.packed
    linear = [w.to(torch.bfloat16) for n, w in ckpt[3].items()
              if n.endswith(".weight") and "norm" not in n and "tok_embeddings" not in n]
    # two bytes a value, and 4 + 2 for each value float16 holds only to within 2**-25 (kept aside)
    below_float16_normals = sum(int(((w.abs() < 2.0 ** -14) & (w != 0)).sum()) for w in linear)
    assert below_float16_normals > 0  # the fixture has some: the exact unpacking below is tested
    assert packed_bytes(model) == 2 * sum(w.numel() for w in linear) + 6 * below_float16_normals
    n = sum(isinstance(m, ParallelLinear) for m in model.modules())
    assert unpack_weights_(model) == n
    assert attention.fused is None
    assert isinstance(attention.wq, ColumnParallelLinear) and isinstance(attention.wo, RowParallelLinear)
    assert all(isinstance(m, DenseWeight) for m in model.modules() if isinstance(m, ParallelLinear))
    for name, value in ckpt[3].items():
        if name.endswith(".weight") and "norm" not in name and "tok_embeddings" not in name:
            got = model.state_dict()[name]
            assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), name


@needs_onednn_bf16
@needs_fbgemm
def test_build_packs_for_the_kernel_it_is_asked_for(ckpt):
    """Llama.build(cpu_packing=...) overrides the CPU's choice (prompts or decoding first),
    with the same logits up to bfloat16 roundings; a kind that is unknown, cannot run for the
    dtype, or has nothing to pack is refused with a ValueError, not ignored."""
    tokens = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(2))
    logits = {}
    for kind in ("onednn", "fbgemm"):
        llama = build(ckpt, dtype="bfloat16", cpu_packing=kind)
        packed = [m.weight_packed for m in llama.model.modules() if isinstance(m, PackedWeight)]
        assert packed and all(isinstance(p, packing.OneDnnMatrix) == (kind == "onednn") for p in packed)
        logits[kind] = llama.model.forward(tokens, 0)
    assert rel_err(logits["onednn"], logits["fbgemm"]) < 2e-2
    with pytest.raises(ValueError, match="packing kind must be None or one of"):
        build(ckpt, dtype="bfloat16", cpu_packing="mkl")
    if not CPU.onednn_fp16:  # no AVX-512 FP16 / AMX-FP16
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
    import llama.engine.build as building  # where Llama.build reads the checkpoint

    def must_not_load(*args, **kwargs):
        raise AssertionError("the checkpoint was read before cpu_packing was checked")

    monkeypatch.setattr(building, "load_model", must_not_load)
    with pytest.raises(ValueError, match="packing kind must be None or one of"):
        build(ckpt, dtype="bfloat16", cpu_packing="mkl")
    with pytest.raises(ValueError,
                       match="applies to bfloat16 and float16 models on the CPU, not to a torch.float32 model"):
        build(ckpt, dtype="float32", cpu_packing="fbgemm")
    with pytest.raises(ValueError,
                       match="applies to bfloat16 and float16 models on the CPU, not to a torch.float32 model"):
        build(ckpt, cpu_packing="fbgemm")  # the CPU's default dtype
    for mode in ("int8", "w8a8", "int4"):
        with pytest.raises(ValueError, match=f"quantize='{mode}' layers keep their own kernels"):
            build(ckpt, dtype="bfloat16", quantize=mode, cpu_packing="fbgemm")
    for dtype, runs in ((torch.bfloat16, CPU.onednn_bf16), (torch.float16, CPU.onednn_fp16)):
        if not runs:
            with pytest.raises(ValueError, match=f"oneDNN's packed {dtype} product does not run here"):
                build(ckpt, dtype=dtype, cpu_packing="onednn")
    if CPU.fbgemm_fp16:
        with pytest.raises(AssertionError, match="was read"):  # a packing it can honour goes on to load
            build(ckpt, dtype="bfloat16", cpu_packing="fbgemm")


@needs_onednn_bf16
@needs_fbgemm
def test_either_kind_packs_a_model_and_unpacks_to_the_same_weights(ckpt):
    """Whichever kind this CPU picks, the other can be asked for: oneDNN's and fbgemm's
    packed models give the unpacked model's logits up to bfloat16 roundings, and
    unpacking gives back the same weights bit for bit (fbgemm's float16 matrix rounds
    bfloat16 values below 2**-14; the layers keep those values aside)."""
    plain = build(ckpt, dtype="bfloat16")
    unpack_weights_(plain.model)
    state = {k: v.clone() for k, v in plain.model.state_dict().items()}
    tokens = torch.randint(0, plain.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    reference = plain.model.forward(tokens, 0)
    total = sum(isinstance(m, ParallelLinear) for m in plain.model.modules())
    for kind in ("onednn", "fbgemm"):
        assert use_packed_weights_(plain.model, policy_packing(kind)) == total
        packed = [m.weight_packed for m in plain.model.modules() if isinstance(m, PackedWeight)]
        assert all(isinstance(p, packing.OneDnnMatrix) == (kind == "onednn") for p in packed)
        assert rel_err(plain.model.forward(tokens, 0), reference) < 2e-2
        kept = [m.weight_exact for m in plain.model.modules() if isinstance(m, PackedWeight)]
        assert all(k is None for k in kept) if kind == "onednn" else any(k is not None for k in kept)
        for name, value in plain.model.state_dict().items():  # read through the packed layers
            assert value.dtype == state[name].dtype and torch.equal(value, state[name]), (kind, name)
        assert unpack_weights_(plain.model) == total
        for name, value in plain.model.state_dict().items():
            assert value.dtype == state[name].dtype and torch.equal(value, state[name]), (kind, name)


def packed_kind_is_this_cpus(modules, threads: int) -> bool:
    """Whether every packed layer holds the matrix this CPU's kind makes at ``threads``:
    oneDNN's blocked layout where that is its kind (AMX); else fbgemm's, for its
    single-threaded entry point at 1 thread (the fixture's matrices are small)."""
    if KernelPolicy.decide(torch.device("cpu"), torch.bfloat16).packing == "onednn":
        return all(isinstance(m.weight_packed, packing.OneDnnMatrix) for m in modules)
    one_thread = threads == 1 and CPU.fbgemm_fp16_one_thread
    return all(isinstance(m.weight_packed, packing.OneThreadFp16Matrix) == one_thread for m in modules)


@needs_fbgemm
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_bfloat16_model_packs_its_weights_and_computes_what_torch_does(ckpt, threads):
    """Llama.build in bfloat16 on this CPU packs every linear layer for the kernel this CPU
    decodes fastest (oneDNN's where it has AMX, fbgemm's otherwise); prefill and a
    decode step give torch's bfloat16 logits (each product rounded once either way, 2
    layers: 2e-2), and state_dict() still returns the checkpoint's weights."""
    from llama.runtime import host

    host.configure_cpu_threads()  # its once-per-process choice, before ours
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = build(ckpt, dtype="bfloat16")
        plain = build(ckpt, dtype="bfloat16")
        unpack_weights_(plain.model)
        modules = [m for m in packed.model.modules() if isinstance(m, ParallelLinear)]
        assert modules and all(isinstance(m, PackedWeight) for m in modules)
        assert packed_kind_is_this_cpus(modules, threads)
        tokens = torch.randint(0, packed.model.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
        for llama in (packed, plain):
            llama.logits = llama.model.forward(tokens[:, :20], 0), llama.model.forward(tokens[:, 20:], 20)
        for a, b in zip(packed.logits, plain.logits):
            assert rel_err(a, b) < 2e-2
        state = packed.model.state_dict()
        for name, value in ckpt[3].items():
            if name.endswith(".weight") and "norm" not in name and "tok_embeddings" not in name:
                assert state[name].dtype == torch.bfloat16
                assert (state[name].float() - value.to(torch.bfloat16).float()).abs().max() <= 2.0 ** -25, name
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
        assert isinstance(module.fused, PackedFusedProjections)
        parts = module.fused(x)
        state = module.state_dict()
        for name, part in zip(names, parts):
            layer = getattr(module, name)
            assert isinstance(layer, PackedWeight) and layer.weight_packed_rows is not None
            assert torch.equal(layer(x), part)
            weight = state[name + ".weight"]
            assert weight.shape == layer.weight_packed_shape
            exact = x.double() @ weight.double().t()
            assert ((part.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-6).all(), name
    assert torch.equal(block.feed_forward.hidden(x), F.silu(block.feed_forward.w1(x)) * block.feed_forward.w3(x))


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@needs_fbgemm
def test_packed_matrices_are_forgotten_with_their_model(ckpt):
    """Compiled steps find packed matrices by key in a module-level table; an entry goes
    when its layer does, so building models one after another does not keep their weights."""
    import gc

    before = set(packing._PACKED_BY_KEY)
    llama = build(ckpt, dtype="bfloat16")
    keys = set(packing._PACKED_BY_KEY) - before
    # One matrix per attention (wq, wk, wv), per feed-forward (w1, w3), per wo and w2, and the output.
    assert len(keys) == 4 * llama.model.n_layers + 1
    del llama
    gc.collect()
    assert not keys & set(packing._PACKED_BY_KEY)


@needs_fbgemm
def test_a_weight_beyond_float16_is_left_to_torch(ckpt):
    llama = build(ckpt, dtype="bfloat16")
    unpack_weights_(llama.model)
    with torch.no_grad():
        llama.model.layers[0].attention.wq.weight[0, 0] = 1e6
    total = sum(isinstance(m, ParallelLinear) for m in llama.model.modules())
    assert use_packed_weights_(llama.model, policy_packing("fbgemm")) == total - 1
    attention = llama.model.layers[0].attention
    assert isinstance(attention.wq, DenseWeight)
    # Its siblings could not share a matrix with it: each is packed on its own.
    assert attention.fused is None
    assert attention.wk.weight_packed_rows is None and attention.wv.weight_packed_rows is None
    assert llama.model.layers[1].attention.fused is not None
    assert torch.isfinite(llama.model.forward(torch.tensor([[1, 2, 3]]), 0)).all()


@needs_fbgemm
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
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


def test_a_policy_that_packs_nothing_leaves_the_layers_dense(ckpt):
    """The plain policy (and any without a packing) keeps torch's product: nothing swapped."""
    for policy in (KernelPolicy(), dataclasses.replace(KernelPolicy.decide(torch.device("cpu"), torch.bfloat16),
                                                       packing=None)):
        llama = build(ckpt, dtype="bfloat16", policy=policy)
        assert all(isinstance(m, DenseWeight) for m in llama.model.modules() if isinstance(m, ParallelLinear))
        assert llama.model.layers[0].attention.fused is None
