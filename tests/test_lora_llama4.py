"""LoRA adapters on Llama 4 served unmerged: the shared expert's LoRA layers (a dense
feed-forward layer's) and the routed experts' low-rank products per expert and per adapter
(llama.layers.lora.LoraExperts, as vLLM's fused_moe_lora keeps A and B per expert per slot).

Checked against independent computations: the experts with each adapter merged into their
matrices (``W[e] + scale * b[e] @ a[e]``, the formula), and PEFT + transformers' own Llama 4
text model with PEFT's adapters (its ``ParamWrapper`` on the experts' parameters): logits
within 1e-4 in float32; a mixed batch gives each row what it gets alone, eager and compiled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import helpers
import llama4_helpers as H
import lora_helpers as L
from llama.engine import RequestSettings
from llama.layers.lora import LoraExperts
from llama.layers.moe import Experts

SEQ = 20  # past two attention chunks of 8


def _random_experts(n_experts: int, dim: int, hidden: int, seed: int) -> Experts:
    from llama.runtime import distributed

    distributed.init_model_parallel(torch.device("cpu"))  # one process: the experts' split is whole
    experts = Experts(n_experts, dim, hidden)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in Experts.matrices:
            w = getattr(experts, name)
            w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
    return experts


def test_expert_low_rank_products_equal_the_experts_with_each_adapter_merged():
    """Tokens of the base and of two adapters (ranks 4 and 8, in slots of rank 8, one of them
    changing w2 only) routed through the experts together: each token gets what the experts with
    its adapter merged (``W[e] + scale * b[e] @ a[e]``) give it, by the grouped computation and
    by the dense one."""
    n_experts, dim, hidden, top_k = 4, 16, 24, 2
    experts = _random_experts(n_experts, dim, hidden, seed=0)
    g = torch.Generator().manual_seed(1)
    shapes = {"w1": (dim, hidden), "w3": (dim, hidden), "w2": (hidden, dim)}
    adapters = {  # slot -> (scale, {matrix: (a [E, r, out], b [E, in, r])})
        1: (2.0, {m: (torch.randn(n_experts, 4, o, generator=g) / o ** 0.5,
                      torch.randn(n_experts, i, 4, generator=g) * 0.3 / i ** 0.5) for m, (i, o) in shapes.items()}),
        2: (0.5, {"w2": (torch.randn(n_experts, 8, dim, generator=g) / dim ** 0.5,
                         torch.randn(n_experts, hidden, 8, generator=g) / hidden ** 0.5)}),
    }
    experts.lora = LoraExperts(experts, ["w1", "w2", "w3"], n_slots=3, max_rank=8, dtype=torch.float32)
    for slot, (scale, factors) in adapters.items():
        for name in Experts.matrices:
            a, b = factors.get(name, (None, None))
            experts.lora.set_lora_slot(name, slot, a, b, scale)

    n = 30
    x = torch.randn(n, dim, generator=g)
    chosen = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(n)])  # (N, k)
    gates = torch.rand(n, top_k, generator=g)
    token_slots = torch.randint(0, 3, (n,), generator=g)
    assert set(token_slots.tolist()) == {0, 1, 2}
    with torch.no_grad():
        grouped = experts.grouped(x, chosen, gates, token_slots)
        dense = experts.dense(x, chosen, gates, token_slots)
        base = experts.grouped(x, chosen, gates)  # no slots: the base experts
        for slot in range(3):
            merged = _random_experts(n_experts, dim, hidden, seed=0)  # the same base matrices
            if slot:
                scale, factors = adapters[slot]
                for name, (a, b) in factors.items():
                    getattr(merged, name).add_(scale * b @ a)
            want = merged.grouped(x, chosen, gates)
            rows = token_slots == slot
            assert helpers.rel_err(grouped[rows], want[rows]) < 1e-5, slot
            assert helpers.rel_err(dense[rows], want[rows]) < 1e-5, slot
            if slot:
                assert helpers.rel_err(base[rows], want[rows]) > 0.05, slot  # the adapter changes its tokens


# -- against PEFT + transformers ------------------------------------------------------------------

# Two layers, as tests/test_llama4_model.py's compiled test: a dense one with RoPE and chunked
# attention, and a MoE one (routed experts and a shared expert) without RoPE.
PARAMS = {**H.LLAMA4_PARAMS, "n_layers": 2, "nope_layer_interval": 2}
# name -> (r, alpha, rsLoRA, target_modules, target_parameters): the first changes the routed
# experts' both parameters and, through gate_proj/down_proj, the dense layer's and the shared
# expert's; the second the experts' down_proj only, at another rank.
ADAPTERS = {
    "experts": (8, 16, False, ["q_proj", "v_proj", "gate_proj", "down_proj"],
                ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]),
    "down": (16, 8, True, ["o_proj", "up_proj"], ["feed_forward.experts.down_proj"]),
}


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, tiny_tiktoken_path):
    """(HF folder, transformers model, {name: adapter folder}, the folder served unmerged)."""
    from llama.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_tiktoken_path)
    params = {**PARAMS, "vocab_size": tokenizer.n_words}
    weights = H.random_llama4_weights(params, tokenizer.n_words, seed=61)
    weights["output.weight"][sorted(tokenizer.stop_tokens)] = 0.0  # greedy decoding runs its full length
    model = H.build_hf_llama4(params, weights, max_pos=256)
    root = tmp_path_factory.mktemp("hf4")
    model.save_pretrained(root)
    shutil.copyfile(tiny_tiktoken_path, root / "tokenizer.model")
    adapters = {}
    for i, (name, (r, alpha, rslora, modules, parameters)) in enumerate(ADAPTERS.items()):
        adapters[name] = L.make_peft_adapter(model, tmp_path_factory.mktemp(name), r=r, alpha=alpha, seed=62 + i,
                                             use_rslora=rslora, target_modules=modules, target_parameters=parameters)
    return root, model, adapters


def build(hf, adapters, **kw):
    from llama import Llama

    kw = {"max_seq_len": 64, "max_batch_size": 3, **kw}
    return Llama.build(hf, device="cpu", dtype="float32", lora_adapters=adapters, **kw)


@pytest.fixture(scope="module")
def served(llama4):
    hf, _, adapters = llama4
    return build(hf, adapters, compile=False)


@pytest.mark.slow
def test_mixed_batch_logits_match_peft(llama4, served):
    """One pass over three rows — the "experts" adapter, the base, the "down" adapter — gives
    each row PEFT's logits for it (transformers' Llama 4 alone for the base), within 1e-4."""
    hf, model, adapters = llama4
    names = ["experts", None, "down"]
    slots = torch.tensor([served.engine.lora_slot(n) for n in names])
    layers = served.model.layers
    assert isinstance(layers[1].feed_forward.experts.lora, LoraExperts)
    assert layers[1].feed_forward.experts.lora.names == ("w1", "w2", "w3")
    tokens = torch.randint(0, model.config.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ).expand(3, SEQ)
    with torch.inference_mode():
        ours = served.model.logits(served.model.hidden_states(tokens, positions, SEQ, served.model.new_kv_cache(3),
                                                              from_start=True, lora_slots=slots))
    base = L.reference_logits(model, tokens)
    for row, name in enumerate(names):
        theirs = base[row] if name is None else L.reference_logits(L.peft_model(model, adapters[name]),
                                                                   tokens[row : row + 1])[0]
        assert helpers.rel_err(ours[row], theirs) < 1e-4, name
        if name is not None:
            assert helpers.rel_err(base[row], theirs) > 0.05, name  # the adapter changes the logits


@pytest.mark.slow
def test_routed_experts_factors_count(llama4, served):
    """Without its routed experts' factors the "down" adapter's logits are not PEFT's: the
    experts' low-rank products are part of what the parity test checks."""
    _, model, adapters = llama4
    lora = served.model.layers[1].feed_forward.experts.lora
    slot = served.engine.lora_slot("down")
    tokens = torch.randint(0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(6))
    theirs = L.reference_logits(L.peft_model(model, adapters["down"]), tokens)[0]
    a, b = lora.factors("w2")
    saved = b[slot].clone()
    try:
        b[slot].zero_()
        with torch.inference_mode():
            without = served.model.logits(served.model.hidden_states(
                tokens, torch.arange(SEQ)[None], SEQ, served.model.new_kv_cache(1), from_start=True,
                lora_slots=torch.tensor([slot])))[0]
    finally:
        b[slot] = saved
    assert helpers.rel_err(without, theirs) > 1e-2


PROMPTS = {"experts": [5, 6, 7, 8, 9], None: [9, 10, 11], "down": [40, 3, 17, 2, 23, 8]}


def _greedy(llama, names: list, max_new_tokens: int = 12) -> list[list[int]]:
    """The greedy tokens of requests of ``names``' adapters (their PROMPTS), submitted together."""
    handles = [llama.engine.submit(PROMPTS[n], RequestSettings(max_new_tokens=max_new_tokens, temperature=0, lora=n))
               for n in names]
    return [h.result().tokens for h in handles]


@pytest.mark.slow
def test_mixed_rows_decode_as_each_alone_and_as_peft(llama4, served):
    """Greedy requests of both adapters and the base, together, get the tokens each gets alone,
    which are PEFT's (a full forward per token)."""
    _, model, adapters = llama4
    alone = {n: _greedy(served, [n])[0] for n in PROMPTS}
    assert _greedy(served, list(PROMPTS)) == list(alone.values())
    for name, prompt in PROMPTS.items():
        reference = model if name is None else L.peft_model(model, adapters[name])
        assert alone[name] == H.hf_greedy(reference, prompt, 12), name


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_steps_give_the_eager_tokens(llama4, served):
    """With the decoding step compiled (the routed experts run eagerly inside it), a row of
    either adapter or of the base gets the eager engine's tokens, and another adapter compiles
    nothing more.  (One row of 32 positions at most: one shape to compile, the slowest part; the
    mixed rows of dense layers compiled are test_lora_engine.py's.)"""
    from llama.engine.runner import _compiled_graphs

    hf, _, adapters = llama4
    compiled = build(hf, adapters, compile=True, max_batch_size=1, max_seq_len=32)
    assert compiled.compiled
    graphs = _compiled_graphs()
    for name in ("experts", None, "down"):
        assert _greedy(compiled, [name], 8) == _greedy(served, [name], 8), name
    assert _compiled_graphs() == graphs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_equal_one(llama4, tmp_path):
    """Tensor parallelism: two ranks on gloo, each holding its slice of the experts' hidden
    units and of their factors (w1/w3's by output columns, w2's by input rows; w2's partial products summed
    with the MoE layer's all-reduce) and of the shared expert's, give one process's logits and
    greedy tokens for a mixed batch."""
    from lora_llama4_mp_worker import workload

    hf, _, adapters = llama4
    run = helpers.torchrun(Path(__file__).parent / "lora_llama4_mp_worker.py",
                           [str(hf), str(tmp_path), *(f"{n}={p}" for n, p in adapters.items())], nproc=2, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    tokens, logits = workload(hf, adapters)
    assert json.loads((tmp_path / "tokens.json").read_text()) == tokens
    assert (torch.load(tmp_path / "logits.pt") - logits).abs().max().item() < 1e-4
    assert len({tuple(t) for t in tokens}) == 3


@pytest.mark.slow
def test_int8_base_serves_the_adapters_on_its_own_products(llama4, served):
    """QLoRA's serving shape on Llama 4: an int8 base (its experts' matrices int8 per expert) with
    the float adapters gives each row the float model's logits (PEFT's, by the tests above) within
    about the error int8 gives the base alone (1.5% here; the adapters move the logits by 35-45%).
    Compared position by position, by the median: a token whose router scores int8 moves across
    the top-k boundary goes to another expert, a jump of its own (one position of the 40 here)."""
    hf, model, adapters = llama4
    int8 = build(hf, adapters, compile=False, quantize="int8")
    tokens = torch.randint(0, model.config.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(9))
    adapter_slots = torch.tensor([served.engine.lora_slot(n) for n in ("experts", None, "down")])

    def logits(llama, slots):
        with torch.inference_mode():
            return llama.model.logits(llama.model.hidden_states(tokens, torch.arange(SEQ).expand(3, SEQ), SEQ,
                                                                llama.model.new_kv_cache(3), from_start=True,
                                                                lora_slots=slots))

    def median_error(ours, theirs):  # over the positions of the rows of an adapter (0 and 2)
        return torch.tensor([helpers.rel_err(ours[r, p], theirs[r, p]) for r in (0, 2) for p in range(SEQ)]).median()

    base_slots = torch.zeros_like(adapter_slots)
    base_error = median_error(logits(int8, base_slots), logits(served, base_slots))
    assert 1e-3 < base_error < 0.03
    exact = logits(served, adapter_slots)
    assert median_error(exact, logits(served, base_slots)) > 0.2  # the adapters' change
    assert median_error(logits(int8, adapter_slots), exact) < 1.3 * base_error
