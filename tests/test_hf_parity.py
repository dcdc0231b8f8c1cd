"""Our model against Hugging Face transformers' LlamaForCausalLM, an independent implementation.

The weights are converted here by hand (names, and the q/k permutation that turns
Meta's interleaved RoPE pairs into HF's half-split ones), not with llama.convert.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from llama import Llama

transformers = pytest.importorskip("transformers")


def meta_to_hf_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k output rows per head from (x0, y0, x1, y1, ...) to (x0, x1, ..., y0, y1, ...)."""
    out, dim = w.shape
    hd = out // n_heads
    return w.view(n_heads, hd // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def build_hf(params: dict, weights: dict[str, torch.Tensor], max_pos: int):
    n_heads = params["n_heads"]
    n_kv = params.get("n_kv_heads") or n_heads
    hidden = weights["layers.0.feed_forward.w1.weight"].shape[0]
    rope = {"rope_type": "default", "rope_theta": params.get("rope_theta", 10000.0)}
    if params.get("use_scaled_rope"):
        rope.update(
            rope_type="llama3",
            factor=params.get("rope_scaling_factor", 8.0),
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=params.get("rope_original_context_len", 8192),
        )
    config = transformers.LlamaConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["dim"],
        intermediate_size=hidden,
        num_hidden_layers=params["n_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        rms_norm_eps=params["norm_eps"],
        max_position_embeddings=max_pos,
        rope_parameters=rope,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "eager"
    sd = {"model.embed_tokens.weight": weights["tok_embeddings.weight"], "model.norm.weight": weights["norm.weight"],
          "lm_head.weight": weights["output.weight"]}
    for i in range(params["n_layers"]):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        sd[h + "self_attn.q_proj.weight"] = meta_to_hf_rope_rows(weights[m + "attention.wq.weight"], n_heads)
        sd[h + "self_attn.k_proj.weight"] = meta_to_hf_rope_rows(weights[m + "attention.wk.weight"], n_kv)
        sd[h + "self_attn.v_proj.weight"] = weights[m + "attention.wv.weight"]
        sd[h + "self_attn.o_proj.weight"] = weights[m + "attention.wo.weight"]
        sd[h + "mlp.gate_proj.weight"] = weights[m + "feed_forward.w1.weight"]
        sd[h + "mlp.up_proj.weight"] = weights[m + "feed_forward.w3.weight"]
        sd[h + "mlp.down_proj.weight"] = weights[m + "feed_forward.w2.weight"]
        sd[h + "input_layernorm.weight"] = weights[m + "attention_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = weights[m + "ffn_norm.weight"]
    model = transformers.LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


@pytest.fixture(params=["llama2", "llama3"])
def checkpoint(request):
    return request.getfixturevalue(f"{request.param}_checkpoint")


def test_logits_match_transformers(checkpoint):
    ckpt, tok, params, weights = checkpoint
    llama = Llama.build(ckpt, tok, max_seq_len=64, max_batch_size=2, dtype="float32", device="cpu")
    hf = build_hf(params, weights, 64)
    tokens = torch.randint(0, params["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    ours = llama.model.forward(tokens, 0)
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (2, 48, params["vocab_size"])
    assert helpers.rel_err(ours, theirs) < 1e-4


def test_scaled_rope_is_exercised(llama3_checkpoint):
    """The Llama 3.1 config's RoPE scaling changes the logits far beyond the tolerance
    above, so the parity test would catch a wrong scaling rule."""
    ckpt, tok, params, weights = llama3_checkpoint
    unscaled = {**params, "use_scaled_rope": False}
    hf_scaled, hf_plain = build_hf(params, weights, 64), build_hf(unscaled, weights, 64)
    tokens = torch.randint(0, params["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert helpers.rel_err(hf_plain(tokens).logits, hf_scaled(tokens).logits) > 1e-2


@pytest.mark.slow
def test_greedy_ragged_batch_matches_transformers(checkpoint):
    ckpt, tok, params, weights = checkpoint
    llama = Llama.build(ckpt, tok, max_seq_len=64, max_batch_size=3, device="cpu")
    hf = build_hf(params, weights, 64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, params["vocab_size"], (n,), generator=g).tolist() for n in (3, 17, 9)]
    ours, _ = llama.generate(prompts, max_gen_len=20, temperature=0)
    stops = llama.tokenizer.stop_tokens
    for prompt, got in zip(prompts, ours):
        # Reference: HF greedy decoding of the prompt alone, cut at our first stop token.
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
        expected = out[0, len(prompt):].tolist()
        for i, t in enumerate(expected):
            if t in stops:
                expected = expected[:i]
                break
        assert got == expected
    assert sum(len(x) for x in ours) > 20  # the comparison covered real decoding
