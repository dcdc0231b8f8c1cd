"""Llama 4's text model against Hugging Face transformers' Llama4ForCausalLM and Meta's
llama-models reference, on the same random weights (tiny config: see llama4_helpers).

Weights are mapped to the other implementations by hand in llama4_helpers, not with
llama.convert.
"""

from __future__ import annotations

import logging

import pytest
import torch

import helpers
import llama4_helpers as H
from llama import Llama, ModelArgs
from llama.layers.moe import MoE

transformers = pytest.importorskip("transformers")

SEQ = 40  # five chunks of 8


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, tiny_tiktoken_path):
    """(Llama built from a written 1-shard checkpoint, params, weights, HF model)."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(tiny_tiktoken_path).n_words
    params = {**H.LLAMA4_PARAMS, "vocab_size": vocab}
    weights = H.random_llama4_weights(params, vocab, seed=4)
    # Stop tokens get logit 0 (never the largest among 556 random logits), so greedy
    # decoding runs its full length, across several chunk boundaries.
    weights["output.weight"][sorted(load_tokenizer(tiny_tiktoken_path).stop_tokens)] = 0.0
    ckpt = H.write_llama4_checkpoint(tmp_path_factory.mktemp("llama4"), params, weights)
    llama = Llama.build(ckpt, tiny_tiktoken_path, max_seq_len=96, max_batch_size=3, device="cpu", dtype="float32")
    return llama, params, weights, H.build_hf_llama4(params, weights)


def tokens_for(params, shape, seed):
    return torch.randint(0, params["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


# -- params.json --------------------------------------------------------------------------

# Meta's Llama 4 params.json (text fields as shipped; vision_args abbreviated), with the
# widths of the released weights (Hugging Face configs: intermediate_size 8192,
# intermediate_size_mlp 16384).
SCOUT = {"dim": 5120, "n_layers": 48, "n_heads": 40, "n_kv_heads": 8, "vocab_size": 202048, "multiple_of": 2048,
         "ffn_dim_multiplier": 1.2, "ffn_exp": 4.0, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
         "moe_args": {"num_experts": 16, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                      "interleave_moe_layer_step": 1},
         "nope_layer_interval": 4, "use_qk_norm": True, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
         "floor_scale": 8192.0, "attn_scale": 0.1,
         "vision_args": {"image_size": {"height": 336, "width": 336}, "patch_size": {"height": 14, "width": 14},
                         "dim": 1408, "n_layers": 34, "n_heads": 16, "mlp_ratio": 4.0, "output_dim": 4096,
                         "pixel_shuffle_ratio": 0.5}}
MAVERICK = {**{k: v for k, v in SCOUT.items() if k not in ("use_scaled_rope", "vision_args")},
            "use_qk_norm": False,
            "moe_args": {"num_experts": 128, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                         "interleave_moe_layer_step": 2}}


def test_scout_and_maverick_params():
    scout = ModelArgs.from_dict(SCOUT)
    assert (scout.head_dim, scout.moe_hidden_dim, scout.moe_args.num_experts) == (128, 8192, 16)
    assert all(scout.is_moe_layer(i) for i in range(48))
    assert [i for i in range(48) if scout.is_nope_layer(i)] == list(range(3, 48, 4))
    assert scout.attention_chunk(0) == 8192 and scout.attention_chunk(3) is None
    # Scout's file names no RoPE scaling factors: Meta's code supplies 16 and 1.
    assert (scout.rope_scaling_factor, scout.rope_high_freq_factor, scout.rope_low_freq_factor) == (16, 1, 1)
    maverick = ModelArgs.from_dict(MAVERICK)
    assert (maverick.moe_hidden_dim, maverick.ffn_hidden_dim) == (8192, 16384)
    assert [i for i in range(6) if maverick.is_moe_layer(i)] == [1, 3, 5]
    assert not maverick.use_scaled_rope and not maverick.use_qk_norm


def test_vision_args_are_read(caplog):
    """params.json's vision_args describe the image encoder the model builds (no longer ignored)."""
    with caplog.at_level(logging.WARNING, logger="llama.args"):
        args = ModelArgs.from_dict(SCOUT)
    assert "vision_args" not in caplog.text
    assert args.dim == 5120 and args.vision_args is not None
    assert (args.vision_args.dim, args.vision_args.n_layers, args.vision_args.patches_per_tile) == (1408, 34, 144)


def test_earlier_families_keep_their_rope_defaults():
    args = ModelArgs.from_dict({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 10, "use_scaled_rope": True})
    assert (args.rope_scaling_factor, args.rope_high_freq_factor) == (8.0, 4.0)


@pytest.mark.parametrize("bad, match", [
    ({"moe_args": {"num_experts": 4, "top_k": 5}}, "top_k"),
    ({"moe_args": {"num_experts": 0}}, "num_experts"),
    ({"moe_args": [1, 2]}, "moe_args must be an object"),
    ({"attention_chunk_size": 0}, "attention_chunk_size"),
    ({"nope_layer_interval": -1}, "nope_layer_interval"),
    ({"head_dim": 7}, "even"),
])
def test_bad_llama4_params(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_dict({**H.LLAMA4_PARAMS, "vocab_size": 100, **bad})


# -- parity with transformers ---------------------------------------------------------------

def test_logits_match_transformers(llama4):
    llama, params, _, hf = llama4
    tokens = tokens_for(params, (2, SEQ), 0)
    ours = llama.model.forward(tokens, 0)
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    assert helpers.rel_err(ours, theirs) < 1e-4


def test_uncached_forward_matches_transformers(llama4):
    llama, params, _, hf = llama4
    tokens = tokens_for(params, (1, SEQ), 1)
    with torch.no_grad():
        assert helpers.rel_err(llama.model.forward_uncached(tokens), hf(tokens).logits) < 1e-4


@pytest.mark.parametrize("change", [
    {"attention_chunk_size": 1024},  # no chunking within the sequence
    {"attn_temperature_tuning": False},
    {"use_qk_norm": False},
    {"nope_layer_interval": 100},  # no NoPE layer
])
def test_each_llama4_feature_changes_the_logits(llama4, change):
    """Every feature the tiny config turns on moves transformers' logits far beyond the
    parity tolerance, so the parity tests above would catch a mistake in any of them."""
    _, params, weights, hf = llama4
    other = H.build_hf_llama4({**params, **change}, weights)
    tokens = tokens_for(params, (1, SEQ), 2)
    with torch.no_grad():
        assert helpers.rel_err(other(tokens).logits, hf(tokens).logits) > 1e-3


def test_scout_rope_scaling_matches_transformers_and_meta(llama4):
    """Scaled RoPE with Scout's defaults changes the logits of short test sequences too
    little to show, so the rotation table itself is compared, over 64k positions,
    with transformers' llama3-type RoPE and with llama-models' table for factor 16 / 1."""
    from llama.model import precompute_freqs_cis

    llama, params, _, hf = llama4
    args = llama.model.params
    hd = params["dim"] // params["n_heads"]
    ours = precompute_freqs_cis(hd, 65536, args.rope_theta, args)
    positions = torch.arange(65536).unsqueeze(0)
    theirs = hf.model.rotary_emb(torch.zeros(1), positions)[0]
    assert (ours - theirs).abs().max() < 1e-3  # float32 angles up to ~6.5e4 rad
    plain = precompute_freqs_cis(hd, 65536, args.rope_theta, None)
    assert (plain - theirs).abs().max() > 0.5  # scaling does change the table
    ref_models = pytest.importorskip("llama_models.llama4.model")
    meta = ref_models.precompute_freqs_cis(hd, 65536, args.rope_theta, True, 16, 1)
    assert (ours - meta).abs().max() < 1e-3


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_later_turn_fed_at_start_pos_matches_one_pass(llama4):
    """A history cached first, then a turn fed at start_pos > 0 that starts mid-chunk
    and crosses chunk boundaries, then single tokens: the logits of one full pass."""
    llama, params, _, hf = llama4
    tokens = tokens_for(params, (2, SEQ), 3)
    with torch.no_grad():
        full = hf(tokens).logits
    first = llama.model.forward(tokens[:, :11], 0)
    second = llama.model.forward(tokens[:, 11:30], 11)
    steps = [llama.model.forward(tokens[:, i : i + 1], i) for i in range(30, SEQ)]
    assert helpers.rel_err(torch.cat([first, second, *steps], dim=1), full) < 1e-4


def test_ragged_positions_in_one_pass(llama4):
    """Rows at different positions in one call (what a batch of decoding rows is)."""
    llama, params, _, hf = llama4
    tokens = tokens_for(params, (2, SEQ), 5)
    model = llama.model
    with torch.inference_mode():
        cache = model.new_kv_cache()
        model.hidden_states(tokens[:, :SEQ - 4], torch.arange(SEQ - 4).expand(2, -1), SEQ - 4, cache, from_start=True)
        # row 0 feeds positions 17..20 (mid-chunk), row 1 positions 30..33 (across a boundary)
        starts = [17, 30]
        positions = torch.tensor([list(range(s, s + 4)) for s in starts])
        fed = torch.stack([tokens[r, s : s + 4] for r, s in enumerate(starts)])
        got = model.logits(model.hidden_states(fed, positions, SEQ, cache))
    with torch.no_grad():
        for r, s in enumerate(starts):
            want = hf(tokens[r : r + 1, : s + 4]).logits[0, s:]
            assert helpers.rel_err(got[r], want) < 1e-4


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_greedy_ragged_batch_matches_transformers(llama4):
    """One-pass ragged prefill, then decoding well past several chunk boundaries."""
    llama, params, _, hf = llama4
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, params["vocab_size"], (n,), generator=g).tolist() for n in (3, 13, 6)]
    n_new = 24  # the shortest row ends at position 27: past three chunk boundaries
    ours, _ = llama.generate(prompts, max_gen_len=n_new, temperature=0)
    stops = llama.tokenizer.stop_tokens
    for prompt, got in zip(prompts, ours):
        expected = H.hf_greedy(hf, prompt, n_new)
        for i, t in enumerate(expected):
            if t in stops:
                expected = expected[:i]
                break
        assert got == expected
        assert len(prompt) + len(got) > 3 * params["attention_chunk_size"]  # decoding crossed chunk boundaries


# -- experts ------------------------------------------------------------------------------------

def test_grouped_experts_equal_dense_and_skip_unrouted_experts(llama4):
    llama, params, _, _ = llama4
    moe = next(m for m in llama.model.modules() if isinstance(m, MoE))
    x = torch.randn(3, 5, params["dim"], generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        grouped = moe(x)
        with H.dense_experts(moe):
            dense = moe(x)
        assert helpers.rel_err(grouped, dense) < 1e-6
        # An expert no token is routed to is never computed: poison the one chosen least
        # for a single token, route it away, and the grouped result stays finite.
        one = x[:1, :1]
        chosen = torch.topk(one.reshape(1, -1) @ moe.router_DE, moe.top_k).indices[0].tolist()
        unused = next(e for e in range(moe.experts.num_experts) if e not in chosen)
        saved = moe.experts.w1[unused].clone()
        moe.experts.w1[unused] = float("nan")
        try:
            assert torch.isfinite(moe(one)).all()
            with H.dense_experts(moe):
                assert not torch.isfinite(moe(one)).all()  # the dense way touches every expert
        finally:
            moe.experts.w1[unused] = saved


# -- loading ------------------------------------------------------------------------------------

def test_vision_weights_are_skipped_with_a_note(tmp_path, tiny_tiktoken_path, caplog):
    """With vision=False the image encoder's tensors are skipped (logged, never read); by default
    they are loaded (tests/test_llama4_vision.py), so shards holding only some of them, of the
    wrong shapes, are refused by name."""
    from llama.checkpoint.shards import CheckpointError
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(tiny_tiktoken_path).n_words
    params = {**H.LLAMA4_PARAMS, "n_layers": 2, "vocab_size": vocab, "vision_args": SCOUT["vision_args"]}
    weights = H.random_llama4_weights(params, vocab, seed=8)
    vision = {"vision_embeddings.vision_encoder.conv1._linear.weight": torch.randn(8, 4),
              "vision_projection.weight": torch.randn(64, 8)}
    ckpt = H.write_llama4_checkpoint(tmp_path, params, weights, extra=vision)
    with caplog.at_level(logging.INFO, logger="llama"):
        llama = Llama.build(ckpt, tiny_tiktoken_path, max_seq_len=16, max_batch_size=1, device="cpu", vision=False)
    assert "skipping 2 vision tensors" in caplog.text
    assert not any("vision" in name for name in llama.model.state_dict())
    with pytest.raises(CheckpointError, match="missing tensor 'vision_embeddings.vision_encoder.class_embedding'"):
        Llama.build(ckpt, tiny_tiktoken_path, max_seq_len=16, max_batch_size=1, device="cpu")


# -- Meta's reference (llama-models) ----------------------------------------------------------

@pytest.fixture(scope="module")
def reference(llama4):
    pytest.importorskip("llama_models")
    _, params, weights, _ = llama4
    return H.build_reference_llama4(params, weights, max_seq_len=64, max_batch_size=2)


def reference_logits(ref, tokens, start_pos):
    from llama_models.llama4.datatypes import TransformerInput

    with H.reference_on_cpu():
        return ref.forward(TransformerInput(tokens=tokens, tokens_position=start_pos)).logits


def test_prompt_logits_match_meta_reference(llama4, reference):
    """A whole prompt from position 0: Meta's reference builds its chunked mask, and agrees."""
    llama, params, _, _ = llama4
    tokens = tokens_for(params, (2, SEQ), 9)
    assert helpers.rel_err(llama.model.forward(tokens, 0), reference_logits(reference, tokens, 0)) < 1e-4


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_meta_reference_decode_past_a_chunk_boundary_is_wrong(llama4, reference):
    """Meta's reference builds the chunked mask only for multi-token calls, so a one-token
    decoding step attends to the whole cache.  Before the first boundary that is the
    same thing; past it, its step disagrees with its own one-pass logits, and this
    library (which masks every step by position) agrees with the one-pass logits."""
    llama, params, _, _ = llama4
    chunk = params["attention_chunk_size"]
    tokens = tokens_for(params, (1, 2 * chunk + 4), 10)
    one_pass = reference_logits(reference, tokens, 0)
    reference_logits(reference, tokens[:, : chunk - 2], 0)
    ref_steps = [reference_logits(reference, tokens[:, i : i + 1], i) for i in range(chunk - 2, tokens.shape[1])]
    ours_steps = [llama.model.forward(tokens[:, : chunk - 2], 0)[:, :0]]
    ours_steps += [llama.model.forward(tokens[:, i : i + 1], i) for i in range(chunk - 2, tokens.shape[1])]
    ref_steps, ours = torch.cat(ref_steps, dim=1), torch.cat(ours_steps, dim=1)
    want = one_pass[:, chunk - 2 :]
    before = 2  # positions chunk-2, chunk-1: still in the first chunk
    assert helpers.rel_err(ref_steps[:, :before], want[:, :before]) < 1e-4  # right before the boundary
    assert helpers.rel_err(ref_steps[:, before:], want[:, before:]) > 1e-2  # wrong past it
    assert helpers.rel_err(ours, want) < 1e-4  # ours right everywhere


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_decoding_matches_eager(tmp_path, tiny_tiktoken_path):
    """The compiled decoding step (CUDA's default) runs the grouped experts eagerly
    inside it, so it neither recompiles per routing (no graph is made after the warm-up's,
    whatever the tokens route to) nor changes the tokens.  On a model of two layers
    (compiling takes longer the more layers a step has) that still has every kind of layer
    the module's model has: a dense one with RoPE and chunked attention, and one of experts
    without RoPE (global attention, temperature tuning)."""
    import torch._dynamo

    from llama.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_tiktoken_path)
    params = {**H.LLAMA4_PARAMS, "n_layers": 2, "nope_layer_interval": 2, "vocab_size": tokenizer.n_words}
    args = ModelArgs.from_dict(params)
    assert [(args.is_moe_layer(i), args.is_nope_layer(i)) for i in range(2)] == [(False, False), (True, True)]
    weights = H.random_llama4_weights(params, tokenizer.n_words, seed=4)
    weights["output.weight"][sorted(tokenizer.stop_tokens)] = 0.0  # greedy decoding runs its full length
    ckpt = H.write_llama4_checkpoint(tmp_path, params, weights)
    llama = Llama.build(ckpt, tiny_tiktoken_path, max_seq_len=96, max_batch_size=3, device="cpu", dtype="float32")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    others = [[40, 3, 17, 2], [23, 8, 31]]  # other tokens, other routings, the same shapes
    # Eager first: its steps may change the CPU thread count (llama.engine.cpu_threads), which
    # compiled graphs guard on.
    eager = [llama.generate(p, max_gen_len=20, temperature=0)[0] for p in (prompts, others)]
    compiled = Llama(llama.model, llama.tokenizer, compile=True)  # compiles every shape (on padding tokens)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert [compiled.generate(p, max_gen_len=20, temperature=0)[0] for p in (prompts, others)] == eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_bfloat16_llama4_packs_its_linear_layers_and_computes_what_torch_does(tmp_path, tiny_tiktoken_path):
    """In bfloat16 on an x86 CPU the attention, shared-expert and output weights are packed
    for this CPU's kernel (oneDNN's or fbgemm's; the routed experts are stacked tensors,
    left as they are); the logits equal those of the same model on torch's kernels up to
    bfloat16 roundings (2e-2 relative)."""
    from llama.layers.packed import PackedWeight, unpack_weights_
    from llama.layers.policy import KernelPolicy
    from llama.tokenizer import load_tokenizer

    if KernelPolicy.decide(torch.device("cpu"), torch.bfloat16).packing is None:
        pytest.skip("this torch build has no packed bfloat16 kernel here (not x86)")
    vocab = load_tokenizer(tiny_tiktoken_path).n_words
    params = {**H.LLAMA4_PARAMS, "vocab_size": vocab}
    ckpt = H.write_llama4_checkpoint(tmp_path, params, H.random_llama4_weights(params, vocab, seed=4))
    packed, plain = (Llama.build(ckpt, tiny_tiktoken_path, max_seq_len=96, max_batch_size=3, device="cpu",
                                 dtype="bfloat16") for _ in range(2))
    assert unpack_weights_(plain.model) == sum(isinstance(m, PackedWeight) for m in packed.model.modules())
    assert isinstance(packed.model.output, PackedWeight)
    assert isinstance(packed.model.layers[0].attention.wq, PackedWeight)
    tokens = tokens_for(params, (2, SEQ), seed=9)
    assert helpers.rel_err(packed.model.forward(tokens, 0), plain.model.forward(tokens, 0)) < 2e-2
    prompt = [[1, 5, 9, 13]]
    greedy = [llama.generate(prompt, max_gen_len=12, temperature=0)[0] for llama in (packed, plain)]
    assert greedy[0] == greedy[1]
