"""Reading PEFT LoRA adapters (:func:`llama.lora.adapter.read_adapter`) and splitting them over
ranks (:func:`llama.lora.adapter.local_factors`).

The reference is PEFT itself: ``merge_and_unload()`` of PEFT's model gives the merged
Hugging Face weights, and the factors read here, applied to the Meta conversion of the base
(``W + scale * B @ A``), must give the same weights in Meta's names and row order (the q/k
rows permuted by hand here, not with the library's function).  Every refusal is a quick
test on a copy of one adapter with one field or tensor changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import lora_helpers as L
from llama.args import ModelArgs
from llama.lora.adapter import LoraAdapter, LoraFactors, local_factors, read_adapter

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402


def meta_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows of each head (x0..x_{h/2-1}, y0..) in Meta's interleaved
    order (x0, y0, x1, y1, ...), written out here."""
    out, width = w.shape
    hd = out // n_heads
    idx = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], dim=1).reshape(-1)
    return w.view(n_heads, hd, width)[:, idx].reshape(out, width)


# Meta layer -> Hugging Face module, written out (not the library's table).
HF_MODULES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
              "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
              "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
              "feed_forward.w2": "mlp.down_proj"}


def params_of(hf_dir: Path, **change) -> ModelArgs:
    """The base's ModelArgs, from its config.json by the converter's rule (``change``: fields of
    config.json changed first)."""
    from llama.convert.config import hf_config_to_params

    config = {**json.loads((hf_dir / "config.json").read_text()), **change}
    return ModelArgs.from_dict(hf_config_to_params(config))


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tiktoken_path):
    """(HF folder, transformers model, params) of a tiny Llama 3 (grouped-query attention)."""
    hf, model = L.tiny_hf_llama(tmp_path_factory.mktemp("hf"), "llama3", seed=11, tokenizer_path=tiny_tiktoken_path)
    return hf, model, params_of(hf)


@pytest.fixture(scope="module")
def adapter_dir(base, tmp_path_factory):
    """All seven layers, rank 8, per-layer ranks and alphas (rank_pattern, alpha_pattern)."""
    return L.make_peft_adapter(base[1], tmp_path_factory.mktemp("adapter"), r=8, alpha=16, seed=12,
                               rank_pattern={"q_proj": 4}, alpha_pattern={"down_proj": 5})


def hf_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_against_pefts_merge(adapter: LoraAdapter, hf_model, adapter_dir: Path, n_heads: int, n_kv: int) -> None:
    merged = hf_weights(L.peft_model(hf_model, adapter_dir).merge_and_unload())
    plain = hf_weights(hf_model)
    changed = {k for k in plain if not torch.equal(plain[k], merged[k])}
    assert {f"model.layers.{n.split('.')[1]}.{HF_MODULES[n.split('.', 2)[2]]}.weight"
            for n in adapter.factors} == changed
    for name, f in adapter.factors.items():
        layer, which = name.split(".")[1], name.split(".", 2)[2]
        key = f"model.layers.{layer}.{HF_MODULES[which]}.weight"
        want, w = merged[key], plain[key]
        if which in ("attention.wq", "attention.wk"):
            heads = n_heads if which == "attention.wq" else n_kv
            want, w = meta_rope_rows(want, heads), meta_rope_rows(w, heads)
        got = w + adapter.scale * f.b.float() @ f.a.float()
        assert (got - want).abs().max() < 1e-5, name
        assert (w - want).abs().max() > 1e-2  # the adapter changes this layer


def test_read_adapter_gives_pefts_merged_weights(base, adapter_dir, tmp_path):
    hf, model, params = base
    adapter = read_adapter(adapter_dir, params)
    assert adapter.name == adapter_dir.name and adapter.path == adapter_dir
    assert adapter.rank == 8 and adapter.scale == 2.0 and len(adapter.factors) == 14
    assert adapter.factors["layers.0.attention.wq"].a.shape == (4, 64)  # rank_pattern
    named = edited(adapter_dir, tmp_path, {"base_model_name_or_path": "meta-llama/Llama-3.2-1B"})
    assert read_adapter(named, params).base_model == "meta-llama/Llama-3.2-1B"
    check_against_pefts_merge(adapter, model, adapter_dir, params.n_heads, params.n_kv_heads)


def test_rslora_subset_and_bin_file(base, tmp_path):
    """rsLoRA's scale (alpha / sqrt(r)), a subset of layers and one layer index, an old-style
    adapter_model.bin, and a name given."""
    _, model, params = base
    folder = L.make_peft_adapter(model, tmp_path / "a", r=16, alpha=8, target_modules=["k_proj", "o_proj", "up_proj"],
                                 use_rslora=True, layers_to_transform=[1], safe_serialization=False, seed=13)
    assert (folder / "adapter_model.bin").is_file() and not (folder / "adapter_model.safetensors").exists()
    adapter = read_adapter(folder, params, name="tuned")
    assert adapter.name == "tuned" and adapter.scale == 2.0  # 8 / sqrt(16)
    assert sorted(adapter.factors) == ["layers.1.attention.wk", "layers.1.attention.wo", "layers.1.feed_forward.w3"]
    check_against_pefts_merge(adapter, model, folder, params.n_heads, params.n_kv_heads)


def test_llama2_multi_head_rows(tmp_path, sp_tokenizer_path):
    """Multi-head attention (K rows permuted over n_heads K heads), a regex target_modules."""
    hf, model = L.tiny_hf_llama(tmp_path / "hf", "llama2", seed=14, tokenizer_path=sp_tokenizer_path,
                                num_hidden_layers=1, intermediate_size=96)
    params = params_of(hf)
    folder = L.make_peft_adapter(model, tmp_path / "a", r=8, target_modules=r".*\.(q_proj|k_proj|gate_proj)", seed=15)
    adapter = read_adapter(folder, params)
    assert sorted(adapter.factors) == ["layers.0.attention.wk", "layers.0.attention.wq", "layers.0.feed_forward.w1"]
    check_against_pefts_merge(adapter, model, folder, 4, 4)


# -- refusals ------------------------------------------------------------------------------


def edited(adapter_dir: Path, tmp_path: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of ``adapter_dir`` with ``config``'s fields set in adapter_config.json and
    ``tensors(state)`` applied to its tensors."""
    out = tmp_path / "edited"
    shutil.copytree(adapter_dir, out)
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(out / "adapter_model.safetensors")
        tensors(state)
        save_file(state, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("config, says", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all'"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"lora_bias": True}, "lora_bias"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ({"target_modules": ".*(q_proj|lm_head)"}, "lm_head"),
    ({"target_modules": ["q_proj", "conv1"]}, "conv1"),
    ({"target_parameters": ["feed_forward.experts.gate_up_proj"]}, "target_parameters"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"r": 0}, "r must be"),
    ({"r": 16}, "rank 8"),  # the config and the tensors disagree
    ({"rank_pattern": {"q_proj": "four"}}, "rank_pattern"),
    ({"layers_to_transform": [7]}, "layers_to_transform"),
    ({"init_lora_weights": "pissa"}, "pissa"),
    ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
])
def test_unsupported_config_is_a_clear_error(base, adapter_dir, tmp_path, config, says):
    with pytest.raises(ValueError, match=f"edited.*{says.replace('(', '.').replace(')', '.')}"):
        read_adapter(edited(adapter_dir, tmp_path, config), base[2])


def _rename(old: str, new: str):
    def change(state: dict) -> None:
        for factor in ("lora_A", "lora_B"):
            state[f"{new}.{factor}.weight"] = state.pop(f"{old}.{factor}.weight")
    return change


def _add(key: str, shape: tuple[int, ...]):
    def change(state: dict) -> None:
        state[key] = torch.zeros(shape)
    return change


P = "base_model.model.model.layers."


@pytest.mark.parametrize("change, says", [
    (_add("base_model.model.lm_head.lora_A.weight", (8, 64)), "output layer"),
    (_add("base_model.model.model.embed_tokens.lora_embedding_A", (8, 556)), "embedding"),
    (_add(P + "0.self_attn.q_proj.lora_magnitude_vector", (64,)), "DoRA"),
    (_add(P + "0.self_attn.q_proj.lora_B.bias", (64,)), "bias"),
    (_add(P + "0.input_layernorm.lora_A.weight", (8, 64)), "input_layernorm"),
    (_rename(P + "1.mlp.up_proj", P + "5.mlp.up_proj"), "has 2 layers"),
    (lambda s: s.pop(P + "1.mlp.up_proj.lora_B.weight"), "no lora_B"),
    (lambda s: s.update({P + "0.self_attn.v_proj.lora_A.weight": torch.zeros(8, 48)}), r"\[8, 48\]"),
    (lambda s: s.update({P + "0.self_attn.v_proj.lora_B.weight": torch.zeros(64, 8)}), r"\[64, 8\]"),
    (lambda s: s.update({P + "0.self_attn.v_proj.lora_B.weight": torch.zeros(32, 8, dtype=torch.int32)}), "dtype"),
])
def test_unsupported_tensor_is_a_clear_error(base, adapter_dir, tmp_path, change, says):
    with pytest.raises(ValueError, match=says):
        read_adapter(edited(adapter_dir, tmp_path, tensors=change), base[2])


def test_shapes_are_checked_from_the_header_before_any_tensor_is_read(base, adapter_dir, monkeypatch):
    """An adapter for another base (here: the base with twice the heads' width) is refused from
    the safetensors header: no tensor is read."""
    import llama.lora.peft as reader

    def no_reading(self, keys):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(reader._AdapterFile, "read", no_reading)
    other = params_of(base[0], hidden_size=128, head_dim=32)
    with pytest.raises(ValueError, match="another base model"):
        read_adapter(adapter_dir, other)


def test_missing_files(base, adapter_dir, tmp_path):
    params = base[2]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_adapter(tmp_path / "nowhere", params)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        read_adapter(tmp_path / "empty", params)
    shutil.copy(adapter_dir / "adapter_config.json", tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        read_adapter(tmp_path / "empty", params)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        read_adapter(adapter_dir / "adapter_config.json", params)


def test_build_refuses_an_adapter_for_another_base_before_reading_the_checkpoint(llama3_checkpoint, adapter_dir,
                                                                                   monkeypatch):
    """Llama.build(..., lora=) reads and checks the adapter before the process group is joined
    and before any tensor of the checkpoint is read (the conftest's Llama 3 checkpoint has a
    SwiGLU width of 224, the adapter's base 200)."""
    import llama.checkpoint.loader as loader
    from llama import Llama

    def no_reading(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(loader, "iter_rank_tensors", no_reading)
    monkeypatch.setattr(loader.distributed, "init_model_parallel", no_reading)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj.*feed_forward.*224.*another base model"):
        Llama.build(llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path, max_seq_len=32, max_batch_size=1,
                    device="cpu", lora=adapter_dir)


# -- local_factors ---------------------------------------------------------------------------


def _factors(out: int, inp: int, r: int = 4, seed: int = 0) -> LoraFactors:
    g = torch.Generator().manual_seed(seed)
    return LoraFactors(a=torch.randn(r, inp, generator=g), b=torch.randn(out, r, generator=g))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_column_parallel_ranks_hold_their_rows_of_the_change(world):
    f = _factors(32, 24)
    whole = f.b @ f.a
    placed = torch.zeros_like(whole)
    for rank in range(world):
        part = local_factors(f, column_parallel=True, rank=rank, world=world)
        assert torch.equal(part.a, f.a)  # A whole
        rows = slice(rank * 32 // world, (rank + 1) * 32 // world)
        placed[rows] += part.b @ part.a
    torch.testing.assert_close(placed, whole)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_row_parallel_partial_products_sum_to_the_change(world):
    """Row-parallel: each rank's x_local @ A_local.T, summed over ranks (the layer's all-reduce),
    then @ B.T is x @ (B @ A).T."""
    f = _factors(24, 32)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    total = torch.zeros(3, 4)
    for rank in range(world):
        part = local_factors(f, column_parallel=False, rank=rank, world=world)
        assert torch.equal(part.b, f.b)  # B whole
        cols = slice(rank * 32 // world, (rank + 1) * 32 // world)
        total += x[:, cols] @ part.a.T
    torch.testing.assert_close(total @ f.b.T, x @ (f.b @ f.a).T)


def test_local_factors_refuses_an_uneven_split_and_bad_ranks():
    f = _factors(30, 24)
    with pytest.raises(ValueError, match="evenly"):
        local_factors(f, column_parallel=True, rank=0, world=4)
    with pytest.raises(ValueError, match="rank"):
        local_factors(f, column_parallel=True, rank=2, world=2)
    part = local_factors(f, column_parallel=True, rank=0, world=4, region=(0, 10))
    assert part.b.shape == (10, 4)


def test_kv_heads_copied_over_more_ranks_than_heads(base, adapter_dir):
    """wk with 2 K/V heads over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1 (copies),
    and each rank's factors give the change of the rows it holds."""
    from llama.lora.merge import rank_factors

    params = base[2]
    adapter = read_adapter(adapter_dir, params)
    f = adapter.factors["layers.1.attention.wk"]
    whole, hd = f.b @ f.a, params.head_dim
    for rank in range(4):
        part = rank_factors(adapter, "layers.1.attention.wk", params, 4, rank)
        head = rank // 2
        torch.testing.assert_close(part.b @ part.a, whole[head * hd:(head + 1) * hd])


# -- Llama 4 ---------------------------------------------------------------------------------

EXPERT_PARAMETERS = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, tiny_tiktoken_path):
    """(HF folder, transformers model, params, adapter folder): tests/llama4_helpers.py's tiny Llama 4
    (MoE layers 1 and 3 with a shared expert, dense layers 0 and 2) and a PEFT adapter of its seven
    linear layers (dense and shared-expert MLPs) and its routed experts (target_parameters)."""
    from llama.checkpoint.hf import open_hf_checkpoint

    hf, model = L.tiny_hf_llama4(tmp_path_factory.mktemp("hf4"), tiny_tiktoken_path, seed=16)
    params = open_hf_checkpoint(hf, max_seq_len=64, max_batch_size=1).args
    adapter = L.make_peft_adapter(model, tmp_path_factory.mktemp("adapter4"), r=4, alpha=8, seed=17,
                                  target_parameters=EXPERT_PARAMETERS)
    return hf, model, params, adapter


@pytest.mark.slow  # PEFT's merge of a Llama 4: over a second
def test_llama4_adapter_gives_pefts_merged_weights(llama4):
    """Dense, shared-expert and attention layers (q/k rows as they are: Llama 4's Hugging Face
    attention rotates Meta's interleaved pairs) and the routed experts' stacks (w1 and w3 the two
    halves of gate_up_proj's change)."""
    _, model, params, folder = llama4
    adapter = read_adapter(folder, params, experts=True)
    merged = hf_weights(L.peft_model(model, folder).merge_and_unload())
    plain = hf_weights(model)
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             **{f"feed_forward.{ours}": f"feed_forward.{theirs}"
                for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
             **{f"feed_forward.shared_expert.{ours}": f"feed_forward.shared_expert.{theirs}"
                for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}}
    hidden = params.moe_hidden_dim
    experts = {"feed_forward.experts.w1": ("feed_forward.experts.gate_up_proj", slice(0, hidden)),
               "feed_forward.experts.w3": ("feed_forward.experts.gate_up_proj", slice(hidden, 2 * hidden)),
               "feed_forward.experts.w2": ("feed_forward.experts.down_proj", slice(None))}
    changed = {k for k in plain if not torch.equal(plain[k], merged[k])}
    assert len(changed) == 2 * 3 + 2 * (3 + 2) + 4 * 4  # dense MLPs, shared + routed experts, attention
    covered = set()
    for name, f in adapter.factors.items():
        layer, which = name.split(".")[1], name.split(".", 2)[2]
        if which in experts:
            key, cols = experts[which]
            key = f"model.layers.{layer}.{key}"
            want, w = merged[key][..., cols], plain[key][..., cols]
        else:
            key = f"model.layers.{layer}.{names[which]}.weight"
            want, w = merged[key], plain[key]
        covered.add(key)
        got = w + adapter.scale * f.b.float() @ f.a.float()
        assert (got - want).abs().max() < 1e-5, name
        assert (w - want).abs().max() > 1e-2, name
    assert covered == changed
    assert adapter.factors["layers.1.feed_forward.experts.w1"].a.shape == (4, 4, hidden)  # [E, r, hidden]


def test_llama4_experts_are_read_only_when_asked(llama4):
    """Read without ``experts=True`` (what merging and serving give), an adapter of the routed
    experts is refused, saying how it is read."""
    _, _, params, folder = llama4
    with pytest.raises(ValueError, match=r"target_parameters.*read_adapter\(\.\.\., experts=True\)"):
        read_adapter(folder, params)


def test_llama4_expert_factors_split_over_ranks(llama4):
    """Each rank's part of an expert stack's change is its slice of the whole one: w1/w3 split
    over the experts' hidden units (the last axis), w2 over its rows (the hidden units too)."""
    from llama.lora.merge import rank_factors

    _, _, params, folder = llama4
    adapter = read_adapter(folder, params, experts=True)
    for name, axis in (("layers.3.feed_forward.experts.w1", 2), ("layers.3.feed_forward.experts.w2", 1)):
        f = adapter.factors[name]
        whole = f.b @ f.a
        parts = [rank_factors(adapter, name, params, 2, rank) for rank in range(2)]
        torch.testing.assert_close(torch.cat([p.b @ p.a for p in parts], dim=axis), whole)


def test_expert_factors_that_fit_no_parameter_are_refused(llama4, tmp_path):
    _, _, params, folder = llama4
    key = "base_model.model.model.layers.1.feed_forward.experts.lora_A.weight"
    bad = edited(folder, tmp_path, tensors=lambda s: s.update({key: torch.zeros(s[key].shape[0], 40)}))
    with pytest.raises(ValueError, match="fit neither gate_up_proj"):
        read_adapter(bad, params, experts=True)
    with pytest.raises(ValueError, match="feed_forward.experts.gate_up_proj, feed_forward.experts.down_proj"):
        read_adapter(edited(folder, tmp_path / "2", {"target_parameters": ["feed_forward.router.weight"]}), params,
                     experts=True)


def test_memory_check_counts_the_merge(adapter_dir, base):
    """Merging holds, besides the weights, the largest changed weight's float32 copy and change
    and its result (here w2's [64, 200] in bfloat16, the widest): counted by the memory check."""
    from llama.checkpoint.memory import check_memory
    from llama.lora.merge import merge_memory_bytes
    from llama.model import Transformer
    from llama.runtime import distributed

    params = base[2]
    distributed.init_model_parallel(torch.device("cpu"))  # one process: as tests/test_memory.py builds
    with torch.device("meta"):
        model = Transformer(params)
    adapter = read_adapter(adapter_dir, params)
    extra = merge_memory_bytes(model, adapter, torch.bfloat16)
    assert extra == 64 * 200 * (4 + 4 + 2)
    cpu = torch.device("cpu")
    plain = check_memory(model, torch.bfloat16, cpu, available=1 << 40)
    with_lora = check_memory(model, torch.bfloat16, cpu, available=1 << 40, merge_bytes=extra)
    assert with_lora.loading == plain.loading + extra


def test_llama4_multimodal_repository_names(llama4, tmp_path):
    """An adapter trained on a multimodal Llama4ForConditionalGeneration names its text model's
    layers under model.language_model. (transformers 5): the same factors are read."""
    _, _, params, folder = llama4

    def rename(state: dict) -> None:
        for key in list(state):
            state[key.replace(".model.layers.", ".model.language_model.layers.")] = state.pop(key)

    renamed = read_adapter(edited(folder, tmp_path, tensors=rename), params, experts=True)
    original = read_adapter(folder, params, experts=True)
    assert sorted(renamed.factors) == sorted(original.factors)
    assert all(torch.equal(renamed.factors[k].b, f.b) for k, f in original.factors.items())


def test_invalid_regular_expressions_are_clear_errors(base, adapter_dir, tmp_path):
    with pytest.raises(ValueError, match="target_modules.*not a valid regular expression"):
        read_adapter(edited(adapter_dir, tmp_path, {"target_modules": "(q_proj"}), base[2])
    with pytest.raises(ValueError, match="rank_pattern key.*not a valid regular expression"):
        read_adapter(edited(adapter_dir, tmp_path / "2", {"rank_pattern": {"[q": 4}}), base[2])


# -- merging's arithmetic ------------------------------------------------------------------------


def test_merged_weight_sums_in_float32_and_rounds_once():
    """A bfloat16 weight: W + scale * B @ A taken in float32 and rounded to bfloat16 once (adding a
    change already rounded to bfloat16 would round twice); a stack of experts, each expert so."""
    from llama.lora.merge import merged_weight

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    f = LoraFactors(a=torch.randn(4, 32, generator=g), b=torch.randn(48, 4, generator=g) * 0.01)
    expected = (w.float() + 0.5 * (f.b @ f.a)).to(torch.bfloat16)
    got = merged_weight(w, f, 0.5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert not torch.equal(got, w + (0.5 * f.b @ f.a).to(torch.bfloat16))  # the double rounding differs
    stack = torch.randn(3, 48, 32, generator=g).to(torch.bfloat16)
    f3 = LoraFactors(a=torch.randn(3, 4, 32, generator=g), b=torch.randn(3, 48, 4, generator=g))
    got3 = merged_weight(stack, f3, 2.0)
    for e in range(3):
        assert torch.equal(got3[e], (stack[e].float() + 2.0 * (f3.b[e] @ f3.a[e])).to(torch.bfloat16))


def test_merge_lora_refuses_a_hugging_face_base(base, adapter_dir, tmp_path):
    from llama.convert import merge_lora

    with pytest.raises(ValueError, match="hf_to_meta"):
        merge_lora(base[0], adapter_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
