"""Llama 4 conversion: Hugging Face <-> Meta round trips and resharding, checked against
transformers' own Llama4ForCausalLM (saved and loaded with save_pretrained/from_pretrained)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

import helpers
import llama4_helpers as H
from llama import Llama
from llama.convert import hf_to_meta, meta_to_hf, reshard

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_tiktoken_path):
    """A transformers-saved Llama4ForCausalLM (tiny, random weights) with a tokenizer.model."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(tiny_tiktoken_path).n_words
    params = {**H.LLAMA4_PARAMS, "vocab_size": vocab}
    model = H.build_hf_llama4(params, H.random_llama4_weights(params, vocab, seed=12), max_pos=256)
    path = tmp_path_factory.mktemp("llama4_hf") / "hf"
    model.save_pretrained(path)
    shutil.copyfile(tiny_tiktoken_path, path / "tokenizer.model")
    return path, model, vocab


def tokens_for(vocab, seed=0):
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(seed))


def hf_state(path):
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


@pytest.mark.parametrize("shards", [1, 2])
def test_hf_to_meta_to_hf_round_trip_is_exact(hf_dir, tmp_path, shards):
    src, hf, vocab = hf_dir
    hf_to_meta(src, tmp_path / "meta", model_parallel_size=shards)
    assert len(list((tmp_path / "meta").glob("consolidated.*.pth"))) == shards
    meta_to_hf(tmp_path / "meta", tmp_path / "hf2")
    before, after = hf_state(src), hf_state(tmp_path / "hf2")
    assert set(before) == set(after)
    for name, t in before.items():
        assert torch.equal(t, after[name]), name
    # ... and transformers loads the written directory as the same model.
    again = transformers.Llama4ForCausalLM.from_pretrained(tmp_path / "hf2", dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    tokens = tokens_for(vocab)
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, hf(tokens).logits)


def test_converted_weights_give_transformers_logits(hf_dir, tmp_path):
    src, hf, vocab = hf_dir
    hf_to_meta(src, tmp_path / "meta")
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["moe_args"]["num_experts"] == 4 and params["attention_chunk_size"] == 8
    llama = Llama.build(tmp_path / "meta", tmp_path / "meta" / "tokenizer.model", max_seq_len=64, max_batch_size=2,
                        device="cpu", dtype="float32")
    tokens = tokens_for(vocab, 1)
    with torch.no_grad():
        assert helpers.rel_err(llama.model.forward(tokens, 0), hf(tokens).logits) < 1e-4


def test_multimodal_repository_converts_its_language_model(hf_dir, tmp_path, caplog):
    """A Llama4ForConditionalGeneration layout (as published: language_model.* names,
    text_config inside a 'llama4' config, vision tensors beside): the text model converts,
    the vision tensors are skipped with a note."""
    src, hf, vocab = hf_dir
    mm = tmp_path / "mm"
    mm.mkdir()
    text_config = json.loads((src / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "llama4", "architectures": [
        "Llama4ForConditionalGeneration"], "text_config": text_config, "vision_config": {"hidden_size": 8}}))
    state = {("language_model." + k): v for k, v in hf_state(src).items()}
    state["vision_model.patch_embedding.linear.weight"] = torch.randn(8, 12)
    state["multi_modal_projector.linear_1.weight"] = torch.randn(64, 8)
    save_file(state, str(mm / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="llama.convert"):
        hf_to_meta(mm, tmp_path / "meta")
    assert "skipping 2 vision tensors" in caplog.text
    llama = Llama.build(tmp_path / "meta", src / "tokenizer.model", max_seq_len=64, max_batch_size=2,
                        device="cpu", dtype="float32")
    tokens = tokens_for(vocab, 2)
    with torch.no_grad():
        assert helpers.rel_err(llama.model.forward(tokens, 0), hf(tokens).logits) < 1e-4


def test_reshard_llama4(hf_dir, tmp_path):
    src, hf, vocab = hf_dir
    hf_to_meta(src, tmp_path / "meta")
    reshard(tmp_path / "meta", tmp_path / "mp4", model_parallel_size=4)
    shard = torch.load(tmp_path / "mp4" / "consolidated.01.pth", weights_only=True)
    full = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)
    name = "layers.1.feed_forward.experts.w1"  # (E, dim, hidden): rank 1 holds every expert's 2nd quarter
    hidden = full[name].shape[2]
    assert torch.equal(shard[name], full[name][:, :, hidden // 4 : hidden // 2])
    w2 = "layers.1.feed_forward.experts.w2"
    assert torch.equal(shard[w2], full[w2][:, hidden // 4 : hidden // 2])
    reshard(tmp_path / "mp4", tmp_path / "mp1", model_parallel_size=1)
    back = torch.load(tmp_path / "mp1" / "consolidated.00.pth", weights_only=True)
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)


@pytest.mark.parametrize("change, says", [
    ({"num_hidden_layers": 10**9}, "moe_layers [1, 3] are not every 2-th layer"),
    ({"num_hidden_layers": 10**9, "moe_layers": None, "no_rope_layers": None},
     "holds 4 layers (model.layers.0 .. 3), but config.json says num_hidden_layers=1000000000"),
    ({"hidden_size": 2**30, "num_attention_heads": 2**29, "num_key_value_heads": 2**29, "head_dim": 2},
     "'model.embed_tokens.weight' has shape [556, 64], but config.json says vocab_size=556, hidden_size=1073741824"),
])
def test_absurd_config_sizes_are_refused_against_the_weights(hf_dir, tmp_path, monkeypatch, change, says):
    """A Llama 4 config.json claiming 10**9 layers used to end in a MemoryError (the layer
    lists were expanded, then Meta's tensor names listed); a 2**30 width spent minutes
    listing process counts before the weights were looked at."""
    import helpers

    src = hf_dir[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    for f in src.glob("*.safetensors"):
        (bad / f.name).symlink_to(f)

    def listed(*args, **kwargs):
        raise AssertionError("process counts were listed before config.json was checked against the weights")

    monkeypatch.setattr("llama.convert.files.valid_model_parallel_sizes", listed)
    with helpers.memory_cap(2.0), pytest.raises(ValueError) as info:
        hf_to_meta(bad, tmp_path / "out")
    assert says in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()


# -- the FFN widths: multiple_of, ffn_dim_multiplier and ffn_exp chosen together ----------------

def _text_config(hidden, experts, dense, **kw):
    return {"model_type": "llama4_text", "hidden_size": hidden, "intermediate_size": experts,
            "intermediate_size_mlp": dense, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 556, "num_local_experts": 4, **kw}


@pytest.mark.parametrize("hidden, experts, dense", [
    # transformers' Llama 4 test sizes: fitting 128 alone picked multiple_of 128, and 96 could not follow
    (64, 96, 128),
    (256, 64, 128),
    (128, 512, 256),
    (64, 32, 112),
    (64, 97, 128),  # odd experts' width: multiple_of 1
    (64, 96, 130),  # no ffn_exp in quarters fits: found among finer ones
    (5120, 8192, 16384),  # Llama 4 Maverick's widths (dense layers between the MoE ones)
])
def test_ffn_widths_are_reproduced_together(hidden, experts, dense):
    from llama.convert import llama4_config_to_params

    params = llama4_config_to_params(_text_config(hidden, experts, dense))
    # Meta's rules, written out independently of llama.args
    assert H.hidden_sizes(params) == (dense, experts), params
    assert json.loads(json.dumps(params)) == params  # and they survive params.json


def test_ffn_widths_no_meta_parameters_give_are_one_line():
    """dim 64 and a dense width of 1700 force a multiplier of ~10, after which the experts'
    width moves in steps of 5 (auto_scale_F) or 10: 7 cannot be reached."""
    from llama.convert import llama4_config_to_params

    with pytest.raises(ValueError) as info:
        llama4_config_to_params(_text_config(64, 7, 1700))
    text = str(info.value)
    assert "\n" not in text and "intermediate_size_mlp=1700" in text and "intermediate_size=7" in text, text


def test_transformers_test_sized_model_converts_with_its_logits(tmp_path, tiny_tiktoken_path):
    """Llama4ForCausalLM at transformers' own test widths (hidden 64, experts 96, dense 128)
    converts, and the Meta checkpoint gives transformers' logits."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=556, hidden_size=64, intermediate_size=96, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=1, num_local_experts=4,
        interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=8, use_qk_norm=True,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = "eager"
    hf = transformers.Llama4ForCausalLM(config).float().eval()
    with torch.no_grad():  # O(1) activations, so the comparison means something
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[-2 if "experts" in name else -1] ** -0.5)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_meta(tmp_path / "hf", tmp_path / "meta")
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert H.hidden_sizes(params) == (128, 96)
    llama = Llama.build(tmp_path / "meta", tiny_tiktoken_path, max_seq_len=64, max_batch_size=2, device="cpu",
                        dtype="float32")
    tokens = tokens_for(556, 3)
    with torch.no_grad():
        assert helpers.rel_err(llama.model.forward(tokens, 0), hf(tokens).logits) < 1e-4
