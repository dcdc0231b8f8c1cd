"""LoRA adapters served unmerged (llama.layers.lora, llama.engine.lora): each row of a batch gets
its own adapter's output, checked against independent computations — the merged model
(``W + scale * B @ A`` written into a plain checkpoint) and the formula applied to the base
layer's own product — and the engine's behaviour around them (one step for mixed rows, the
prefix cache keyed by adapter, the limits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import helpers
from llama.engine import RequestSettings
from llama.layers.lora import LoraFusedProjections, LoraWeights
from lora_serve_helpers import ALL_TARGETS, merged_weights, random_adapter

WORKER = Path(__file__).parent / "lora_serve_mp_worker.py"


def _adapters(weights: dict, n_layers: int) -> dict:
    """Three adapters: all seven targets at rank 8, attention only at rank 4 (rsLoRA-like
    scale), the feed-forward's w1/w2 at rank 16."""
    return {
        "alpha": random_adapter("alpha", weights, n_layers, 8, ALL_TARGETS, seed=1, scale=2.0),
        "beta": random_adapter("beta", weights, n_layers, 4, ("attention.wq", "attention.wk", "attention.wv",
                                                             "attention.wo"), seed=2, scale=0.5),
        "gamma": random_adapter("gamma", weights, n_layers, 16, ("feed_forward.w1", "feed_forward.w2"),
                                seed=3, scale=1.0),
    }


@pytest.fixture(scope="module")
def adapters(llama3_checkpoint):
    return _adapters(llama3_checkpoint.weights, llama3_checkpoint.params["n_layers"])


@pytest.fixture(scope="module")
def served(llama3_checkpoint, adapters):
    """The base checkpoint serving the three adapters unmerged (float32, eager)."""
    return helpers.build(llama3_checkpoint, max_seq_len=96, max_batch_size=4, compile=False,
                         lora_adapters=adapters)


@pytest.fixture(scope="module")
def merged(llama3_checkpoint, adapters, tmp_path_factory):
    """Per adapter, a plain model with the adapter folded into its weights."""
    out = {}
    for name, adapter in adapters.items():
        ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp(f"merged-{name}"), llama3_checkpoint.params,
                                        merged_weights(llama3_checkpoint.weights, adapter))
        out[name] = helpers.build((ckpt, llama3_checkpoint.tokenizer_path), max_seq_len=96, max_batch_size=4,
                                  compile=False)
    return out


def test_mixed_batch_logits_match_the_merged_models(served, merged, llama3_checkpoint):
    """One forward pass over four rows — the base and three adapters — gives each row the
    logits of the base model or of that adapter's merged model (float32, within 1e-4)."""
    model = served.model
    names = [None, "alpha", "beta", "gamma"]
    slots = torch.tensor([served.engine.lora_slot(n) for n in names])
    assert sorted(slots.tolist()) == [0, 1, 2, 3]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (4, 9), generator=g)
    positions = torch.arange(9).expand(4, 9)
    cache = model.new_kv_cache(4)
    with torch.inference_mode():
        logits = model.logits(model.hidden_states(tokens, positions, 9, cache, from_start=True, lora_slots=slots))
        # then one decoding step from the cache (the rows' own adapters again)
        step = model.decode_logits(tokens[:, :1], torch.full((4, 1), 9), 10, cache, lora_slots=slots)
        base = helpers.build(llama3_checkpoint, max_seq_len=96, max_batch_size=4, compile=False).model
        for row, name in enumerate(names):
            reference = (base if name is None else merged[name].model).forward_uncached(
                torch.cat([tokens[row : row + 1], tokens[row : row + 1, :1]], dim=1))
            assert (logits[row] - reference[0, :9]).abs().max().item() < 1e-4, name
            assert (step[row] - reference[0, 9]).abs().max().item() < 1e-4, name
        # and an adapter changes the output (the test could fail)
        assert (logits[1] - base.forward_uncached(tokens[1:2])[0]).abs().max().item() > 1e-2


def _record_decoding_mixes(llama) -> list[set]:
    """The sets of adapters of the rows of every decoding step the runner takes from now on."""
    mixes: list[set] = []
    runner = llama.engine.runner
    original = runner.run

    def run(plan):
        if plan.decode:
            mixes.append({r.settings.lora for r in plan.decode})
        return original(plan)

    runner.run = run
    return mixes


@pytest.mark.slow
def test_mixed_rows_decode_in_one_step_as_each_alone(served, merged):
    """Four greedy requests, three adapters and the base, submitted together: they decode in
    the same steps and each gets exactly the tokens it gets alone, which are the merged
    model's."""
    names = [None, "alpha", "beta", "gamma"]
    prompts = [[1, 5, 9, 33, 41], [1, 7, 7, 2], [1, 50, 3, 8, 8, 12], [1, 4]]
    alone = {}
    for name, prompt in zip(names, prompts):
        result = served.engine.submit(prompt, RequestSettings(max_new_tokens=10, temperature=0, lora=name)).result()
        alone[name] = result.tokens
        reference = merged[name] if name is not None else None
        if reference is not None:
            tokens = reference.engine.submit(prompt, RequestSettings(max_new_tokens=10, temperature=0)).result()
            assert tokens.tokens == result.tokens, name
    mixes = _record_decoding_mixes(served)
    handles = [served.engine.submit(p, RequestSettings(max_new_tokens=10, temperature=0, lora=n))
               for n, p in zip(names, prompts)]
    together = {n: h.result().tokens for n, h in zip(names, handles)}
    del served.engine.runner.run
    assert together == alone
    assert set(names) in mixes, mixes  # a step decoded all four at once
    assert len({tuple(t) for t in alone.values()}) == 4  # the adapters change the tokens


def test_prefix_cache_is_keyed_by_adapter(served):
    """A prompt's blocks computed under one adapter are reused by the same adapter only: never
    by another adapter, nor by the base (nor the base's by an adapter)."""
    prompt = [1] + [(7 * i) % 97 + 3 for i in range(40)]  # over two blocks of 16

    def cached(name):
        settings = RequestSettings(max_new_tokens=1, temperature=0, lora=name)
        return served.engine.submit(prompt, settings).result().n_cached_prompt_tokens

    assert cached(None) == 0
    assert cached("alpha") == 0
    assert cached("beta") == 0
    assert cached("alpha") >= 32
    assert cached(None) >= 32
    assert cached("beta") >= 32


def test_lora_option_of_the_calls(served):
    """``text_completion(..., lora=name)`` generates with the adapter; an unknown name is a
    ValueError listing the loaded ones, before anything runs."""
    base = served.text_completion(["a b"], temperature=0, max_gen_len=6)
    alpha = served.text_completion(["a b"], temperature=0, max_gen_len=6, lora="alpha")
    again = served.text_completion(["a b"], temperature=0, max_gen_len=6, lora="alpha")
    assert alpha == again and alpha != base
    with pytest.raises(ValueError, match="'nope'.*'alpha', 'beta', 'gamma'"):
        served.text_completion(["a b"], max_gen_len=4, lora="nope")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        served.chat_completion([[{"role": "user", "content": "hi"}]], max_gen_len=4, lora="nope")
    with pytest.raises(TypeError, match="lora must be"):
        served.engine.submit([1, 2], RequestSettings(max_new_tokens=2, lora=3))  # type: ignore[arg-type]


def test_limits_and_bad_adapters_are_clear_errors(llama3_checkpoint, adapters):
    """Too many adapters, a rank above max_lora_rank, factors that do not fit the model, a layer
    adapters cannot change unmerged, speculative decoding: each a ValueError saying what to do,
    before the engine is built."""
    def build(**kw):
        return helpers.build(llama3_checkpoint, max_seq_len=64, max_batch_size=2, compile=False, **kw)

    with pytest.raises(ValueError, match="3 LoRA adapters given for max_loras=2"):
        build(lora_adapters=adapters, max_loras=2)
    with pytest.raises(ValueError, match="'gamma' has rank 16, above max_lora_rank=8"):
        build(lora_adapters=adapters, max_lora_rank=8)
    bad = random_adapter("bad", llama3_checkpoint.weights, 1, 4, ("attention.wq",))
    bad.factors["layers.0.attention.wq"] = type(bad.factors["layers.0.attention.wq"])(
        torch.zeros(4, 32), torch.zeros(64, 4))
    with pytest.raises(ValueError,
                       match=r"'bad': layers.0.attention.wq's A \[4, 32\] and B \[64, 4\] do not fit its weight "
                             r"\[64, 64\]"):
        build(lora_adapters={"bad": bad})
    other = random_adapter("other", llama3_checkpoint.weights, 1, 4, ("attention.wq",))
    vocab = llama3_checkpoint.params["vocab_size"]
    other.factors = {"output": type(bad.factors["layers.0.attention.wq"])(torch.zeros(4, 64), torch.zeros(vocab, 4))}
    with pytest.raises(ValueError, match="changes 'output', which is not a layer LoRA adapters can change"):
        build(lora_adapters={"other": other})
    with pytest.raises(ValueError, match="speculative decoding with LoRA adapters"):
        build(lora_adapters=adapters, speculative={"method": "ngram"})
    with pytest.raises(ValueError, match="give lora_adapters too"):
        build(max_loras=2)
    plain = build()
    with pytest.raises(ValueError, match="serves no adapters"):
        plain.text_completion(["a"], max_gen_len=2, lora="alpha")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4", "bfloat16-packed"])
def test_quantized_base_keeps_its_product(llama3_checkpoint, adapters, kind):
    """QLoRA's serving shape: with an int8 (or int4) base, a LoRA layer's output is the
    quantised layer's own product plus ``scale * (x @ A.T) @ B.T`` computed directly from the
    adapter's float factors — through the fused wq/wk/wv and w1/w3 products too — and rows
    without an adapter get the quantised product alone.  Likewise a bfloat16 base whose weights
    are packed for a CPU kernel (its product rounds to bfloat16: the bound is bfloat16's)."""
    from llama.layers.packed import PackedWeight

    kw: dict = {"quantize": kind} if kind != "bfloat16-packed" else {"dtype": "bfloat16"}
    if kind == "int4":
        kw["quantize_group_size"] = 32
    llama = helpers.build(llama3_checkpoint, max_seq_len=64, max_batch_size=4, compile=False,
                          lora_adapters=adapters, **kw)
    model = llama.model
    attention, ffn = model.layers[1].attention, model.layers[1].feed_forward
    dtype = model.dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if kind == "bfloat16-packed" and not isinstance(attention.wo, PackedWeight):
        pytest.skip("this CPU packs no bfloat16 weights")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 64, generator=g).to(dtype)
    slots = torch.tensor([0, llama.engine.lora_slot("alpha"), llama.engine.lora_slot("beta")])
    adapter_of = [None, adapters["alpha"], adapters["beta"]]
    checked = 0
    with torch.inference_mode():
        for full, layer in (("attention.wq", attention.wq), ("attention.wv", attention.wv),
                            ("attention.wo", attention.wo), ("feed_forward.w2", ffn.w2)):
            assert isinstance(layer, LoraWeights), full
            inputs = torch.randn(3, 2, layer.in_features, generator=g).to(dtype)
            out = layer(inputs, slots).float()
            base = layer.local_matmul(inputs).float()  # the base's own product (quantised, packed)
            full = f"layers.1.{full}"
            for row, adapter in enumerate(adapter_of):
                expected = base[row].clone()
                if adapter is not None and full in adapter.factors:
                    f = adapter.factors[full]
                    expected += adapter.scale * (inputs[row].float() @ f.a.T) @ f.b.T
                    checked += 1
                assert torch.allclose(out[row], expected, atol=tol, rtol=tol), (full, row)
        # int8 and packed weights fuse; int4 where it holds our CPU kernel's layout
        fuses = kind != "int4" or getattr(attention.wq, "int4_kernel_rows", None) is not None
        assert (attention.fused is not None) == fuses
        for parent, names in ((attention, ("wq", "wk", "wv")), (ffn, ("w1", "w3"))):
            fused = parent.fused
            if fused is None:
                continue
            assert isinstance(fused, LoraFusedProjections)
            outs = fused(x, slots)
            for name, out in zip(names, outs):
                layer = getattr(parent, name)
                full = f"layers.1.{'attention' if parent is attention else 'feed_forward'}.{name}"
                for row, adapter in enumerate(adapter_of):
                    expected = layer.local_matmul(x[row]).float()
                    if adapter is not None and full in adapter.factors:
                        f = adapter.factors[full]
                        expected += adapter.scale * (x[row].float() @ f.a.T) @ f.b.T
                        checked += 1
                    assert torch.allclose(out[row].float(), expected, atol=tol, rtol=tol), (full, row)
    assert checked >= 6
    # and it generates, each adapter its own tokens
    outs = {n: llama.text_completion(["a b"], temperature=0, max_gen_len=5, lora=n)[0]["generation"]
            for n in (None, "alpha")}
    assert outs[None] != outs["alpha"]


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_step_does_not_recompile_when_the_adapter_mix_changes(llama3_checkpoint, tmp_path):
    """With the decoding step compiled, the adapters of the rows are step inputs: after the
    warm-up, steps of every mix of adapters compile nothing more, and give the eager engine's
    tokens.  On llama3_checkpoint's first layer alone, with the module's three adapters made for
    it: compiling takes longer the more layers a step has, and a layer's adapters are step inputs
    as every other layer's are."""
    from llama.engine.runner import _compiled_graphs

    params = {**llama3_checkpoint.params, "n_layers": 1}
    weights = {name: w for name, w in llama3_checkpoint.weights.items()
               if not name.startswith("layers.") or name.startswith("layers.0.")}
    one_layer = (helpers.write_checkpoint(tmp_path, params, weights, 1, "vocab"), llama3_checkpoint.tokenizer_path)
    adapters = _adapters(weights, 1)
    served = helpers.build(one_layer, max_seq_len=96, max_batch_size=4, compile=False, lora_adapters=adapters)
    # two rows at most: one-row steps (a graph of their own) and several-row steps (dynamic rows)
    llama = helpers.build(one_layer, max_seq_len=64, max_batch_size=2, compile=True, lora_adapters=adapters)
    assert llama.compiled
    graphs = _compiled_graphs()
    mixes = [[None, None], ["alpha", "beta"], ["gamma", None], ["beta", "beta"], ["gamma"], ["alpha"], [None]]
    alone = {}  # adapter -> the eager tokens of the first prompt alone
    for mix in mixes:
        prompts = [[1, 3 + i, 9, 4 * i + 2] for i in range(len(mix))]
        handles = [llama.engine.submit(p, RequestSettings(max_new_tokens=6, temperature=0, lora=n))
                   for p, n in zip(prompts, mix)]
        got = [h.result().tokens for h in handles]
        want = [served.engine.submit(p, RequestSettings(max_new_tokens=6, temperature=0, lora=n)).result().tokens
                for p, n in zip(prompts, mix)]
        assert got == want, mix
        if len(mix) == 1:
            alone[mix[0]] = want[0]
    assert _compiled_graphs() == graphs
    # the adapters change the tokens, so that a row given another row's adapter would show
    assert len({tuple(tokens) for tokens in alone.values()}) == 3, alone


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_equal_one(llama3_checkpoint, tmp_path):
    """Tensor parallelism: two ranks on gloo, each holding its slices of the adapters (A whole
    and B's rows in column-parallel layers, A's columns and B whole in row-parallel ones, the
    partial product summed by the layer's all-reduce), give the logits and the greedy tokens
    of one process (this one), for a mixed batch."""
    from lora_serve_mp_worker import workload

    run = helpers.torchrun(WORKER, [str(llama3_checkpoint.ckpt_dir), str(llama3_checkpoint.tokenizer_path),
                                    str(tmp_path)], nproc=2, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    tokens, logits = workload(llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path)
    assert json.loads((tmp_path / "tokens.json").read_text()) == tokens
    assert (torch.load(tmp_path / "logits.pt") - logits).abs().max().item() < 1e-4
    assert len({tuple(t) for t in tokens}) == 4


def test_no_adapter_layers_without_adapters(llama3_checkpoint):
    """A model built without adapters has no LoRA layer and its steps take no slots."""
    llama = helpers.build(llama3_checkpoint, max_seq_len=64, max_batch_size=2, compile=False)
    assert not any(isinstance(m, LoraWeights) for m in llama.model.modules())
    assert llama.engine.runner.lora is None


@pytest.mark.slow  # over ~1 s: two engines
def test_staged_steps_give_each_row_its_adapter(llama3_checkpoint, adapters):
    """On a GPU the rows' adapter slots reach the step through the staging buffers, beside the
    tokens and positions (driven here on the CPU with unpinned buffers and fake events): mixed
    adapters, prompts prefilled in chunks of 6 tokens with a request arriving while others
    decode, give the plain path's tokens."""
    from test_staging import _run

    names = [None, "alpha", "beta", "gamma"]
    settings = [RequestSettings(max_new_tokens=8, temperature=0, lora=n) for n in names]
    prompts = [[1] + [(11 * i + 5 * k) % 200 + 3 for k in range(4 + 5 * i)] for i in range(4)]
    kw = dict(late=1, prompts=prompts, settings=settings, lora_adapters=adapters, prefill_chunk=6)
    plain, _, _ = _run(llama3_checkpoint, False, **kw)
    staged, _, stream = _run(llama3_checkpoint, True, **kw)
    assert staged == plain
    assert stream.log.count("copy") >= 4 * 8  # the staged path ran: four inputs a decoding step
    assert len({tuple(tokens) for tokens, _, _ in plain}) == 4


# -- PEFT's adapters end to end ------------------------------------------------------------------

PEFT_ADAPTERS = {  # family -> name -> (r, alpha, PEFT's target modules, rsLoRA, other LoraConfig fields)
    "llama3": {"r8-all": (8, 16, None, False, {}),
               "r16-subset-rslora": (16, 8, ("q_proj", "k_proj", "down_proj"), True, {}),
               "r8-pattern": (8, 16, ("q_proj", "v_proj", "o_proj", "up_proj"), False,
                              {"rank_pattern": {"v_proj": 4}, "alpha_pattern": {"up_proj": 5}})},
    "llama2": {"r16-all": (16, 32, None, False, {}),
               "r8-subset-rslora": (8, 8, ("k_proj", "o_proj", "gate_proj"), True, {})},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "llama2"])
def test_peft_adapters_served_unmerged_give_pefts_logits(family, tmp_path, sp_tokenizer_path, tiny_tiktoken_path):
    """PEFT's own adapter files (made and saved by PEFT for a tiny transformers Llama, converted to
    Meta's format): one forward pass over a batch of the base and every adapter (Llama 3: three,
    rank 8 and 16, all seven layers and subsets, rsLoRA, per-layer ranks and alphas; Llama 2 with
    its multi-head K rows: two) gives each row PEFT's model's logits (float32, within 1e-4), the
    model merged at load (``lora=``) the same, and the engine's greedy tokens of the mixed batch
    are the merged model's."""
    pytest.importorskip("peft")
    import lora_helpers as L

    tokenizer = tiny_tiktoken_path if family == "llama3" else sp_tokenizer_path
    hf_dir, hf_model = L.tiny_hf_llama(tmp_path / "hf", family, seed=7, tokenizer_path=tokenizer)
    meta = L.meta_conversion(hf_dir, tmp_path / "meta")
    folders = {}
    for i, (name, (r, alpha, targets, rslora, extra)) in enumerate(PEFT_ADAPTERS[family].items()):
        folders[name] = L.make_peft_adapter(hf_model, tmp_path / name, r=r, alpha=alpha,
                                            target_modules=targets or L.ALL_TARGETS, use_rslora=rslora,
                                            seed=20 + i, **extra)
    llama = helpers.build((meta, tokenizer), max_seq_len=64, max_batch_size=4, compile=False,
                          lora_adapters={name: str(path) for name, path in folders.items()})
    names = [None, *folders]
    tokens = torch.randint(3, hf_model.config.vocab_size, (len(names), 12), generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([llama.engine.lora_slot(n) for n in names])
    model = llama.model
    with torch.inference_mode():
        ours = model.logits(model.hidden_states(tokens, torch.arange(12).expand(len(names), 12), 12,
                                                model.new_kv_cache(len(names)), from_start=True, lora_slots=slots))
    base = L.reference_logits(hf_model, tokens)
    for row, name in enumerate(names):
        theirs = base[row] if name is None else L.reference_logits(L.peft_model(hf_model, folders[name]),
                                                                     tokens[row : row + 1])[0]
        assert (ours[row] - theirs).abs().max().item() < 1e-4, name
        if name is not None:
            assert helpers.rel_err(base[row], theirs) > 0.05  # the adapter changes the logits
    # merged at load gives the same logits, and the mixed batch's greedy tokens
    name = names[1]
    merged = helpers.build((meta, tokenizer), max_seq_len=64, max_batch_size=4, compile=False,
                           lora=str(folders[name]))
    with torch.inference_mode():
        assert (merged.model.forward_uncached(tokens[1:2])[0] - ours[1]).abs().max().item() < 1e-4
    prompts = [[1] + tokens[row, :5].tolist() for row in range(len(names))]
    handles = [llama.engine.submit(p, RequestSettings(max_new_tokens=8, temperature=0, lora=n))
               for p, n in zip(prompts, names)]
    mixed = [h.result().tokens for h in handles]
    alone = merged.engine.submit(prompts[1], RequestSettings(max_new_tokens=8, temperature=0)).result().tokens
    assert mixed[1] == alone
