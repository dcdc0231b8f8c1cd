"""Model math: params.json handling, RMSNorm, RoPE, the KV cache and its mask."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from llama import Llama, ModelArgs
from llama.model import RMSNorm, apply_rotary_emb, precompute_freqs_cis

# -- params.json ------------------------------------------------------------------------

# Meta's published params.json files (as shipped), with the SwiGLU hidden size of the
# released weights (the w1 rows), which Meta's rule must reproduce.
META_PARAMS = {
    "llama-2-7b": ({"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-06,
                    "vocab_size": -1}, 11008),
    "llama-2-70b": ({"dim": 8192, "multiple_of": 4096, "ffn_dim_multiplier": 1.3, "n_heads": 64, "n_kv_heads": 8,
                     "n_layers": 80, "norm_eps": 1e-05, "vocab_size": -1}, 28672),
    "codellama-7b": ({"dim": 4096, "n_layers": 32, "n_heads": 32, "multiple_of": 256, "ffn_dim_multiplier": 1.0,
                      "norm_eps": 1e-5, "rope_theta": 1000000, "vocab_size": 32016}, 11008),
    "llama-3-8b": ({"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
                    "multiple_of": 1024,
                    "ffn_dim_multiplier": 1.3, "norm_eps": 1e-05, "rope_theta": 500000.0}, 14336),
    "llama-3.1-8b": ({"dim": 4096, "ffn_dim_multiplier": 1.3, "multiple_of": 1024, "n_heads": 32, "n_kv_heads": 8,
                      "n_layers": 32, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
                      "vocab_size": 128256}, 14336),
    "llama-3.2-1b": ({"dim": 2048, "ffn_dim_multiplier": 1.5, "multiple_of": 256, "n_heads": 32, "n_kv_heads": 8,
                      "n_layers": 16, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
                      "vocab_size": 128256}, 8192),
    "llama-3.2-3b": ({"dim": 3072, "ffn_dim_multiplier": 1.0, "multiple_of": 256, "n_heads": 24, "n_kv_heads": 8,
                      "n_layers": 28, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
                      "vocab_size": 128256}, 8192),
}


@pytest.mark.parametrize("name", sorted(META_PARAMS))
def test_meta_params_files_load(name):
    params, hidden = META_PARAMS[name]
    args = ModelArgs.from_dict(params)
    assert args.ffn_hidden_dim == hidden
    assert args.n_kv_heads == params.get("n_kv_heads", params["n_heads"])
    if params.get("use_scaled_rope"):
        # Meta's files name no factor: 8 for Llama 3.1, 32 for the Llama 3.2 1B/3B shapes
        assert args.rope_scaling_factor == (32.0 if name.startswith("llama-3.2") else 8.0)


def test_rope_scaling_factor_from_file():
    for name in ("llama-3.1-8b", "llama-3.2-1b"):  # the file's value wins over either default
        args = ModelArgs.from_dict({**META_PARAMS[name][0], "rope_scaling_factor": 16})
        assert args.rope_scaling_factor == 16


def test_unknown_key_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="llama.args"):
        args = ModelArgs.from_dict({"dim": 64, "n_heads": 4, "n_layers": 1, "vocab_size": 10, "shiny_new_knob": 3})
    assert args.dim == 64
    assert "shiny_new_knob" in caplog.text


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"dim": 65, "n_heads": 4}, "not divisible by n_heads"),
        ({"dim": 64, "n_heads": 4, "n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"dim": 64, "n_heads": 4, "n_kv_heads": 8}, "multiple of n_kv_heads"),
        ({"dim": 64, "n_heads": 4, "n_layers": 0}, "n_layers"),
        ({"dim": "64", "n_heads": 4}, "dim"),
        ({"dim": 64, "n_heads": 4, "norm_eps": -1}, "norm_eps"),
    ],
)
def test_impossible_params_raise_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict({"n_layers": 1, "vocab_size": 10, **bad})


def test_params_json_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        ModelArgs.from_json(tmp_path / "params.json")
    (tmp_path / "params.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelArgs.from_json(tmp_path / "params.json")
    (tmp_path / "params.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        ModelArgs.from_json(tmp_path / "params.json")


# -- math ---------------------------------------------------------------------------------

def test_rmsnorm_computes_in_float32():
    x = (torch.randn(3, 64) * 100).to(torch.bfloat16)
    norm = RMSNorm(64, eps=1e-5)
    x32 = x.float()
    expected = (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(norm(x), expected)


def test_scaled_rope_matches_transformers_llama3_rule():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for factor, original in ((8.0, 8192), (32.0, 8192), (8.0, 64)):
        args = ModelArgs(dim=2048, n_heads=32, n_layers=1, vocab_size=10, rope_theta=500000.0, use_scaled_rope=True,
                         rope_scaling_factor=factor, rope_original_context_len=original)
        config = transformers.LlamaConfig(
            hidden_size=2048, num_attention_heads=32, max_position_embeddings=original * 16,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": original},
        )
        inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        freqs = precompute_freqs_cis(args.head_dim, 2, args.rope_theta, args)
        ours = torch.angle(freqs[1])  # angle at position 1 = the frequency itself
        torch.testing.assert_close(ours, inv_freq.float(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("form", ["complex", "real view"])
def test_rotary_uses_interleaved_pairs(form):
    """Dims (2k, 2k+1) rotate together by pos * theta^(-2k/D): check against the formula, with
    the rotations as complex numbers (eager) and as their real view (compiled forward passes)."""
    head_dim, pos = 8, 5
    freqs = precompute_freqs_cis(head_dim, pos + 1, theta=10000.0)[pos : pos + 1].unsqueeze(0)  # (1, 1, D/2)
    if form == "real view":
        freqs = torch.view_as_real(freqs)  # (1, 1, D/2, 2)
    x = torch.randn(1, 1, 1, head_dim)
    rq, _ = apply_rotary_emb(x, x, freqs)
    for k in range(head_dim // 2):
        angle = pos * 10000.0 ** (-2 * k / head_dim)
        a, b = x[0, 0, 0, 2 * k], x[0, 0, 0, 2 * k + 1]
        expected = torch.tensor([a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle)])
        torch.testing.assert_close(rq[0, 0, 0, 2 * k : 2 * k + 2], expected, rtol=1e-5, atol=1e-6)


# -- the KV cache ---------------------------------------------------------------------------

@pytest.fixture(params=["llama2", "llama3"])
def built(request):
    ckpt, tok, params, _ = request.getfixturevalue(f"{request.param}_checkpoint")
    return Llama.build(ckpt, tok, max_seq_len=64, max_batch_size=2, device="cpu"), params


@pytest.mark.slow
def test_step_by_step_decode_equals_full_forward(built):
    llama, params = built
    tokens = torch.randint(0, params["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    full = llama.model.forward(tokens, 0)
    steps = [llama.model.forward(tokens[:, :1], 0)]
    for pos in range(1, 40):
        steps.append(llama.model.forward(tokens[:, pos : pos + 1], pos))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_several_tokens_after_a_cached_prefix(built):
    """A later chat turn: several tokens fed at start_pos > 0 on top of the cache."""
    llama, params = built
    tokens = torch.randint(0, params["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    full = llama.model.forward(tokens, 0)
    chunks = [llama.model.forward(tokens[:, a:b], a) for a, b in ((0, 13), (13, 14), (14, 31), (31, 40))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-4, atol=1e-4)


def test_forward_rejects_out_of_range(built):
    llama, params = built
    with pytest.raises(ValueError, match="max_seq_len"):
        llama.model.forward(torch.zeros(1, 10, dtype=torch.long), 60)
    with pytest.raises(ValueError, match="max_batch_size"):
        llama.model.forward(torch.zeros(3, 1, dtype=torch.long), 0)


def test_rope_freqs_buffer_in_checkpoint_is_ignored(tmp_path, sp_tokenizer_path, llama2_checkpoint):
    import helpers

    _, tok, params, weights = llama2_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path, params, weights, extra={"rope.freqs": torch.randn(8)})
    llama = Llama.build(ckpt, tok, max_seq_len=16, max_batch_size=1, device="cpu")
    assert "rope.freqs" not in llama.model.state_dict()


def test_uncached_forward_equals_cached(built):
    llama, params = built
    tokens = torch.randint(0, params["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(llama.model.forward_uncached(tokens), llama.model.forward(tokens, 0), rtol=1e-5,
                               atol=1e-5)


def test_consecutive_slots_are_found_exactly():
    from llama.layers.kv_cache import consecutive_start, context_slots

    table = torch.tensor([[3, 4, 5, 0]])
    assert consecutive_start(context_slots(table, 40, 16)) == 48
    # first and last slot 63 apart, yet not one run: blocks 3 5 4 6
    assert consecutive_start(context_slots(torch.tensor([[3, 5, 4, 6]]), 64, 16)) is None
    assert consecutive_start(context_slots(torch.tensor([[3, 4], [5, 6]]), 32, 16)) is None  # two rows: gathered


def test_a_row_in_consecutive_blocks_reads_them_in_place_with_the_same_logits(built):
    """One row whose blocks are consecutive is read as a slice of the pool (no gather); the
    logits equal those of the same contents in scattered blocks, which are gathered."""
    import llama.model as model_module

    llama, params = built
    model = llama.model
    cache = model.new_kv_cache(n_blocks=12, block_size=8)
    tokens = torch.randint(0, params["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name, blocks in (("consecutive", [4, 5, 6, 7]), ("scattered", [9, 2, 7, 5])):
        table = torch.tensor([blocks + [0] * 5])
        starts = []
        real = model_module.consecutive_start

        def spy(slots, real=real, starts=starts):
            starts.append(real(slots))
            return starts[-1]

        model_module.consecutive_start = spy
        try:
            with torch.inference_mode():
                model.hidden_states(tokens[:, :20], torch.arange(20)[None], 20, cache, from_start=True,
                                    block_table=table)
                positions = torch.arange(20, 30)[None]
                logits[name] = model.logits(model.hidden_states(tokens[:, 20:], positions, 30, cache,
                                                                block_table=table))
        finally:
            model_module.consecutive_start = real
        assert starts == ([32] if name == "consecutive" else [None])
    torch.testing.assert_close(logits["consecutive"], logits["scattered"], rtol=1e-5, atol=1e-5)
