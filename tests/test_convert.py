"""llama.convert: HF <-> Meta conversion and offline resharding.

HF models are built with transformers itself and saved with ``save_pretrained``, so the
HF side of every check is transformers' own format and forward pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

import helpers
from conftest import LLAMA2_PARAMS, LLAMA3_PARAMS
from llama import Llama, ModelArgs
from llama.checkpoint.shards import find_shards, open_shard
from llama.convert import ffn_params_for, hf_to_meta, meta_to_hf, reshard

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

VOCAB = 556  # helpers.write_tiny_tiktoken: 300 BPE ranks + 256 Llama 3 control tokens
BOS, EOS = 300, 301  # <|begin_of_text|>, <|end_of_text|> in that tokenizer
SEQ = 48


def hf_config(tie: bool = False, **overrides):
    """GQA with Llama 3.1 RoPE scaling (original context 32, so it acts within SEQ tokens);
    intermediate_size 200 is not on Meta's default grid, so the multiplier search works."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=tie,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=None,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def random_hf_model(config, seed: int = 0, dtype=torch.float32):
    """An HF Llama with O(1) activations and non-trivial norms (so swapped norms would show)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def save_hf(model, path, tokenizer: bool = True, **kw):
    model.save_pretrained(path, **kw)
    if tokenizer:  # where Llama 3 HF repos keep Meta's tokenizer file
        helpers.write_tiny_tiktoken(path / "original")
    return path


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


def llama_logits(ckpt_dir, tokens, tokenizer=None):
    llama = Llama.build(
        ckpt_dir, tokenizer or ckpt_dir / "tokenizer.model", max_seq_len=64, max_batch_size=2,
        device="cpu", dtype="float32",
    )
    return llama.model.forward(tokens, 0)


def tokens_for(vocab: int, seed: int = 0):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def safetensors_state(path):
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = set(json.loads(index.read_text())["weight_map"].values())
        return {k: v for f in files for k, v in load_file(path / f).items()}
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """(saved HF directory, the model) with a tokenizer under original/."""
    model = random_hf_model(hf_config())
    return save_hf(model, tmp_path_factory.mktemp("hf")), model


# -- HF -> Meta -> HF ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_hf_meta_hf_round_trip_is_exact(hf_dir, tmp_path, n):
    src, _ = hf_dir
    hf_to_meta(src, tmp_path / "meta", model_parallel_size=n)
    assert len(find_shards(tmp_path / "meta")) == n
    meta_to_hf(tmp_path / "meta", tmp_path / "back", max_position_embeddings=64)

    before, after = load_file(src / "model.safetensors"), safetensors_state(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k

    c0 = json.loads((src / "config.json").read_text())
    c1 = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                "max_position_embeddings", "rope_parameters", "tie_word_embeddings", "dtype",
                "bos_token_id", "eos_token_id"):
        assert c1[key] == c0[key], key
    assert (tmp_path / "back" / "tokenizer.model").read_bytes() == (src / "original" / "tokenizer.model").read_bytes()


@pytest.mark.slow
def test_bf16_stays_bf16_and_sharded_safetensors_read(tmp_path):
    """Source dtype is kept both ways; a sharded HF save (index json) converts the same."""
    model = random_hf_model(hf_config(), seed=1, dtype=torch.bfloat16)
    src = save_hf(model, tmp_path / "hf", max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    hf_to_meta(src, tmp_path / "meta", model_parallel_size=2)
    shard = open_shard(tmp_path / "meta" / "consolidated.00.pth")
    assert all(t.dtype == torch.bfloat16 for t in shard.values())
    meta_to_hf(tmp_path / "meta", tmp_path / "back", max_shard_size_gb=100e3 / 1e9)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    before, after = safetensors_state(src), safetensors_state(tmp_path / "back")
    assert sorted(before) == sorted(after)
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.dtype == torch.bfloat16


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_pytorch_model_bin_is_read(hf_dir, tmp_path):
    src, model = hf_dir
    bin_dir = tmp_path / "hf_bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((src / "config.json").read_text())
    torch.save(dict(load_file(src / "model.safetensors")), bin_dir / "pytorch_model.bin")
    hf_to_meta(bin_dir, tmp_path / "meta")
    tokens = tokens_for(VOCAB)
    got = llama_logits(tmp_path / "meta", tokens, tokenizer=src / "original" / "tokenizer.model")
    assert helpers.rel_err(got, hf_logits(model, tokens)) < 1e-4


# -- the library on converted checkpoints --------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_converted_checkpoint_matches_transformers(hf_dir, tmp_path, n):
    src, model = hf_dir
    dst = tmp_path / "meta"
    hf_to_meta(src, dst, model_parallel_size=n)
    params = json.loads((dst / "params.json").read_text())
    assert params["use_scaled_rope"] is True and params["rope_scaling_factor"] == 8.0
    assert params["rope_original_context_len"] == 32 and params["n_kv_heads"] == 2
    assert ModelArgs.from_dict(params).ffn_hidden_dim == 200
    tokens = tokens_for(VOCAB)
    assert helpers.rel_err(llama_logits(dst, tokens), hf_logits(model, tokens)) < 1e-4


def test_shards_follow_meta_layout(hf_dir, tmp_path):
    src, _ = hf_dir
    hf_to_meta(src, tmp_path / "meta", model_parallel_size=2)
    full = hf_to_meta_full(src, tmp_path / "meta1")
    shards = [open_shard(p) for p in find_shards(tmp_path / "meta")]
    for name, t in full.items():
        if t.dim() == 1:
            assert all(torch.equal(s[name], t) for s in shards), name
            continue
        row = any(k in name for k in ("attention.wo.", "feed_forward.w2."))
        axis = 1 if row else 0  # tok_embeddings: vocab split (556 % 2 == 0)
        assert torch.equal(torch.cat([s[name] for s in shards], dim=axis), t), name
    assert shards[0]["layers.0.attention.wq.weight"].shape == (32, 64)  # 4 heads * 16 / 2
    assert shards[0]["layers.0.attention.wk.weight"].shape == (16, 64)  # one of the 2 K/V heads
    assert shards[0]["tok_embeddings.weight"].shape == (VOCAB // 2, 64)


def hf_to_meta_full(src, dst):
    hf_to_meta(src, dst)
    return open_shard(dst / "consolidated.00.pth")


def test_rope_rows_are_interleaved_for_meta(hf_dir, tmp_path):
    """The q/k rows are reordered per head (K by its own head count), and the rest not."""
    src, model = hf_dir
    meta = hf_to_meta_full(src, tmp_path / "meta")
    hf = load_file(src / "model.safetensors")
    for proj, name, heads in (("q_proj", "wq", 4), ("k_proj", "wk", 2)):
        w_hf = hf[f"model.layers.1.self_attn.{proj}.weight"]
        w_meta = meta[f"layers.1.attention.{name}.weight"]
        hd = 16
        for h in range(heads):
            rows = w_hf[h * hd : (h + 1) * hd]
            # Meta row 2i is HF row i (real part), row 2i+1 is HF row i + hd/2 (imaginary part).
            assert torch.equal(w_meta[h * hd : (h + 1) * hd : 2], rows[: hd // 2])
            assert torch.equal(w_meta[h * hd + 1 : (h + 1) * hd : 2], rows[hd // 2 :])
    assert torch.equal(meta["layers.1.attention.wv.weight"], hf["model.layers.1.self_attn.v_proj.weight"])


def test_tied_embeddings_become_output_weight(tmp_path):
    model = random_hf_model(hf_config(tie=True), seed=2)
    src = save_hf(model, tmp_path / "hf")
    assert "lm_head.weight" not in load_file(src / "model.safetensors")
    hf_to_meta(src, tmp_path / "meta", model_parallel_size=2)
    shards = [open_shard(p) for p in find_shards(tmp_path / "meta")]
    output = torch.cat([s["output.weight"] for s in shards])
    assert torch.equal(output, torch.cat([s["tok_embeddings.weight"] for s in shards]))
    assert torch.equal(output, model.model.embed_tokens.weight)
    tokens = tokens_for(VOCAB, seed=2)
    assert helpers.rel_err(llama_logits(tmp_path / "meta", tokens), hf_logits(model, tokens)) < 1e-4


def test_legacy_rope_config_keys(tmp_path):
    """A transformers-4 style config (top-level rope_theta, rope_scaling with "type") converts the same."""
    model = random_hf_model(hf_config(), seed=3)
    src = save_hf(model, tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    (src / "config.json").write_text(json.dumps(config))
    hf_to_meta(src, tmp_path / "meta")
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["rope_theta"] == 500000.0 and params["use_scaled_rope"] is True
    tokens = tokens_for(VOCAB, seed=3)
    assert helpers.rel_err(llama_logits(tmp_path / "meta", tokens), hf_logits(model, tokens)) < 1e-4


@pytest.mark.parametrize(
    "dim, hidden",
    [
        (4096, 11008),  # Llama 2 7B
        (5120, 13824),  # Llama 2 13B
        (8192, 28672),  # Llama 2 70B, Llama 3 70B
        (4096, 14336),  # Llama 3 8B
        (2048, 8192),  # Llama 3.2 1B
        (3072, 8192),  # Llama 3.2 3B
        (16384, 53248),  # Llama 3.1 405B
        (64, 200),
        (64, 201),  # odd: multiple_of 1
        (64, 30),  # narrower than Meta's base width
    ],
)
def test_ffn_search_reproduces_intermediate_size(dim, hidden):
    args = ModelArgs(dim=dim, n_heads=dim // 64 if dim >= 64 else 1, vocab_size=10)
    multiple_of, multiplier = ffn_params_for(args, hidden)
    assert dataclasses.replace(args, multiple_of=multiple_of, ffn_dim_multiplier=multiplier).ffn_hidden_dim == hidden
    # Stored as JSON and read back, the pair still gives the width.
    params = json.loads(json.dumps({"multiple_of": multiple_of, "ffn_dim_multiplier": multiplier}))
    assert dataclasses.replace(args, **params).ffn_hidden_dim == hidden


# -- Meta -> HF ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama3", "llama2"])
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_meta_checkpoint_to_transformers(tmp_path, request, family):
    """A 2-shard Meta checkpoint (Llama 3: vocab split; Llama 2: dim split, vocab_size -1)
    loads in transformers and gives the library's logits."""
    if family == "llama3":
        tok = helpers.write_tiny_tiktoken(tmp_path / "tok")
        params = {**LLAMA3_PARAMS, "vocab_size": VOCAB}
        vocab, layout = VOCAB, "vocab"
    else:
        tok = request.getfixturevalue("sp_tokenizer_path")
        from llama.tokenizer import load_tokenizer

        params, vocab, layout = dict(LLAMA2_PARAMS), load_tokenizer(tok).n_words, "dim"
    weights = helpers.random_weights(params, vocab, seed=4)
    ckpt = helpers.write_checkpoint(tmp_path / "meta", params, weights, n_shards=2, embedding_layout=layout)
    (ckpt / "tokenizer.model").write_bytes(tok.read_bytes())

    meta_to_hf(ckpt, tmp_path / "hf", max_position_embeddings=64)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == vocab and config["tie_word_embeddings"] is False
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == tok.read_bytes()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert hf.dtype == torch.float32
    tokens = tokens_for(vocab, seed=4)
    assert helpers.rel_err(hf_logits(hf, tokens), llama_logits(ckpt, tokens, tokenizer=tok)) < 1e-4


# -- reshard -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta_ckpt(tmp_path_factory):
    """One-shard Llama 3-shaped checkpoint: 4 heads, 2 K/V heads, vocab 556; sizes 1, 2, 4 allowed."""
    root = tmp_path_factory.mktemp("reshard")
    tok = helpers.write_tiny_tiktoken(root / "tok")
    params = {**LLAMA3_PARAMS, "vocab_size": VOCAB}
    weights = helpers.random_weights(params, VOCAB, seed=5)
    ckpt = helpers.write_checkpoint(root / "src", params, weights, n_shards=1)
    (ckpt / "tokenizer.model").write_bytes(tok.read_bytes())
    return ckpt, weights


def test_reshard_chain_preserves_logits_and_layout(meta_ckpt, tmp_path):
    src, weights = meta_ckpt
    tokens = tokens_for(VOCAB, seed=5)
    expected = llama_logits(src, tokens)
    prev = src
    for n in (2, 4, 1):  # 1 -> 2 -> 4 (K/V heads replicated) -> 1
        dst = tmp_path / f"mp{n}"
        reshard(prev, dst, model_parallel_size=n)
        shards = [open_shard(p) for p in find_shards(dst)]
        assert len(shards) == n
        assert (dst / "params.json").read_text() == (src / "params.json").read_text()
        assert (dst / "tokenizer.model").is_file()
        for s in shards:
            assert s["layers.0.attention.wq.weight"].shape == (64 // n, 64)
            assert s["layers.0.attention.wo.weight"].shape == (64, 64 // n)
            assert s["layers.0.attention.wk.weight"].shape == (16 * max(1, 2 // n), 64)
            assert s["tok_embeddings.weight"].shape == (VOCAB // n, 64)
        if n == 4:  # 2 K/V heads over 4 shards: shards 0, 1 hold head 0; shards 2, 3 head 1
            wk = weights["layers.1.attention.wk.weight"]
            for rank, s in enumerate(shards):
                head = rank // 2
                assert torch.equal(s["layers.1.attention.wk.weight"], wk[head * 16 : (head + 1) * 16])
        assert torch.equal(llama_logits(dst, tokens), expected), n
        prev = dst
    back = open_shard(tmp_path / "mp1" / "consolidated.00.pth")
    assert sorted(back) == sorted(weights) and all(torch.equal(back[k], weights[k]) for k in weights)


def test_reshard_keeps_dim_embedding_split(tmp_path, sp_tokenizer_path):
    """A Llama 2 checkpoint split over the embedding dim keeps that split when it divides."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(sp_tokenizer_path).n_words
    weights = helpers.random_weights(LLAMA2_PARAMS, vocab, seed=6)
    src = helpers.write_checkpoint(tmp_path / "src", LLAMA2_PARAMS, weights, n_shards=2, embedding_layout="dim")
    reshard(src, tmp_path / "mp4", model_parallel_size=4)
    shard = open_shard(tmp_path / "mp4" / "consolidated.00.pth")
    assert shard["tok_embeddings.weight"].shape == (vocab, 16)
    tokens = tokens_for(vocab, seed=6)
    assert torch.equal(
        llama_logits(tmp_path / "mp4", tokens, sp_tokenizer_path), llama_logits(src, tokens, sp_tokenizer_path)
    )


def test_reshard_rejects_impossible_size(meta_ckpt, tmp_path):
    src, _ = meta_ckpt
    with pytest.raises(ValueError, match=r"sizes that work: \[1, 2, 4\]"):
        reshard(src, tmp_path / "mp3", model_parallel_size=3)
    assert not (tmp_path / "mp3").exists()


# -- errors ------------------------------------------------------------------------------


def test_errors(hf_dir, meta_ckpt, tmp_path):
    src, _ = hf_dir
    with pytest.raises(FileNotFoundError, match="source directory"):
        hf_to_meta(tmp_path / "nope", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_to_meta(meta_ckpt[0], tmp_path / "out")
    with pytest.raises(ValueError, match=r"sizes that work: \[1, 2, 4\]"):
        hf_to_meta(src, tmp_path / "out", model_parallel_size=3)
    with pytest.raises(FileExistsError, match="already holds"):
        reshard(meta_ckpt[0], src, model_parallel_size=1)  # an HF dir holds config.json + safetensors

    config = json.loads((src / "config.json").read_text())
    for change, match in (
        ({"attention_bias": True}, "attention_bias"),
        ({"model_type": "mistral"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"head_dim": 32}, "head_dim"),
    ):
        bad = tmp_path / f"bad_{match}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        (bad / "model.safetensors").symlink_to(src / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            hf_to_meta(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def hostile_copy(src, dst, **change):
    """``src``'s weights (linked) under a config.json with ``change`` applied."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **change}))
    for f in src.glob("*.safetensors"):
        (dst / f.name).symlink_to(f)
    return dst


@pytest.mark.parametrize("change, says", [
    ({"num_hidden_layers": 10**9},
     "holds 2 layers (model.layers.0 .. 1), but config.json says num_hidden_layers=1000000000"),
    ({"vocab_size": 10**12},
     "'model.embed_tokens.weight' has shape [556, 64], but config.json says vocab_size=1000000000000"),
])
def test_absurd_config_sizes_are_refused_against_the_weights(hf_dir, tmp_path, change, says):
    """num_hidden_layers 10**9 used to end in a MemoryError while Meta's tensor names were
    listed: config.json is checked against the weights' names and header shapes first."""
    bad = hostile_copy(hf_dir[0], tmp_path / "bad", **change)
    with helpers.memory_cap(2.0), pytest.raises(ValueError) as info:
        hf_to_meta(bad, tmp_path / "out")
    assert says in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the FIFO's case: a command-line process that imports torch (2 s)
@pytest.mark.parametrize("damage", ["garbage-header", "truncated-header", "truncated-data", "fifo"])
def test_damaged_safetensors_is_one_line_naming_the_file(hf_dir, tmp_path, damage):
    """A model.safetensors with a garbage or cut header was a raw SafetensorError
    traceback; a FIFO named model.safetensors made the conversion wait forever.

    The FIFO goes through the command line (a process, so that a wait is bounded by its
    timeout), which prints the error as one line; the damaged files through hf_to_meta in this
    process, whose error is one the command line prints that way (its except clause's types),
    in one line.  (Each case was a process of its own: ~3.4 s each.)"""
    src = hf_dir[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((src / "config.json").read_bytes())
    weights = bad / "model.safetensors"
    data = (src / "model.safetensors").read_bytes()
    if damage == "garbage-header":
        weights.write_bytes(os.urandom(8) + data[8:])
    elif damage == "truncated-header":
        weights.write_bytes(data[:20])
    elif damage == "truncated-data":
        weights.write_bytes(data[: len(data) // 2])
    else:
        os.mkfifo(weights)
    expected = "is not a regular file" if damage == "fifo" else "damaged or the file is truncated"
    if damage == "fifo":
        proc = run_cli("-m", "llama.convert", "hf_to_meta", str(bad), str(tmp_path / "out"), timeout=60)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("python -m llama.convert hf_to_meta: error: "), proc.stderr
        assert "Traceback" not in proc.stderr
        line = lines[0]
    else:
        # the types llama.convert.cli.main prints as "python -m llama.convert hf_to_meta: error: <message>"
        with pytest.raises((ValueError, TypeError, OSError, RuntimeError)) as info:
            hf_to_meta(bad, tmp_path / "out")
        line = str(info.value)
        assert "\n" not in line.strip(), line
    assert str(weights) in line, line
    assert expected in line, line
    assert not (tmp_path / "out").exists()


def test_settings_files_that_are_too_deep_or_not_regular_files(hf_dir, meta_ckpt, tmp_path):
    """config.json nested 100,000 deep was a raw RecursionError; a FIFO config.json or
    weight index, or tokenizer.model, was taken as absent."""
    src = hf_dir[0]
    deep = hostile_copy(src, tmp_path / "deep")
    (deep / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"config\.json nests lists or objects more than"):
        hf_to_meta(deep, tmp_path / "out")

    fifo = hostile_copy(src, tmp_path / "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    with pytest.raises(ValueError, match=r"config\.json is not a regular file"):
        hf_to_meta(fifo, tmp_path / "out")

    index = hostile_copy(src, tmp_path / "index")
    os.mkfifo(index / "model.safetensors.index.json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not a regular file"):
        hf_to_meta(index, tmp_path / "out")

    meta = tmp_path / "meta"
    meta.mkdir()
    for f in meta_ckpt[0].iterdir():
        if f.name != "tokenizer.model":
            (meta / f.name).symlink_to(f)
    os.mkfifo(meta / "tokenizer.model")
    with pytest.raises(ValueError, match=r"tokenizer\.model is not a regular file"):
        meta_to_hf(meta, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- the command line --------------------------------------------------------------------


def test_cli_hf_to_meta(hf_dir, tmp_path, capsys, root_logger_kept):
    """The command line's main in this process (a process of its own was another import of
    torch; the command line as a process: the --help and FIFO tests)."""
    from llama.convert.cli import main

    src, _ = hf_dir
    dst = tmp_path / "meta"
    capsys.readouterr()
    assert main(["hf_to_meta", str(src), str(dst), "--model_parallel_size", "2"]) == 0
    assert capsys.readouterr().out == ""  # commands return None: nothing is printed
    assert [p.name for p in find_shards(dst)] == ["consolidated.00.pth", "consolidated.01.pth"]
    assert (dst / "params.json").is_file() and (dst / "tokenizer.model").is_file()


# -- files the conversion writes: arguments first, all or nothing, no mixing ------------


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_position_embeddings": "abc"},
        {"max_position_embeddings": -5},
        {"max_position_embeddings": 0},
        {"max_position_embeddings": float("nan")},
        {"max_position_embeddings": True},
        {"max_position_embeddings": 64.5},
        {"max_shard_size_gb": float("nan")},
        {"max_shard_size_gb": float("inf")},
        {"max_shard_size_gb": -1.0},
        {"max_shard_size_gb": "big"},
    ],
    ids=repr,
)
def test_meta_to_hf_refuses_bad_arguments_before_writing(meta_ckpt, tmp_path, kwargs):
    """A value of the wrong type is a TypeError, one out of range a ValueError (the library's one
    wording of argument checks, llama.runtime.checks), each naming the argument."""
    src, _ = meta_ckpt
    dst = tmp_path / "deeper" / "hf"
    value = next(iter(kwargs.values()))
    wrong_type = isinstance(value, (str, bool)) or (next(iter(kwargs)) == "max_position_embeddings"
                                                    and isinstance(value, float))
    with pytest.raises(TypeError if wrong_type else ValueError, match=next(iter(kwargs))):
        meta_to_hf(src, dst, **kwargs)
    assert not dst.exists() and not (tmp_path / "deeper").exists()  # not even the parent it would have made


def _listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else None) for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["sub", "sub/deeper", "link-to-sub"])
@pytest.mark.parametrize("command", ["reshard", "meta_to_hf"])
def test_destination_inside_the_source_is_refused_before_writing(meta_ckpt, tmp_path, command, where):
    """`convert reshard ckpt/ ckpt/sub` wrote its output into the checkpoint it was reading."""
    src = tmp_path / "ckpt"
    src.mkdir()
    for f in meta_ckpt[0].iterdir():
        (src / f.name).symlink_to(f)
    dst = src / where
    if where == "link-to-sub":  # a path outside the source that leads into it
        dst = tmp_path / "elsewhere"
        (src / "sub").mkdir()
        dst.symlink_to(src / "sub")
    before = _listing(tmp_path)
    args = ["--model_parallel_size", "2"] if command == "reshard" else []
    proc = run_cli("-m", "llama.convert", command, str(src), str(dst), *args)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"python -m llama.convert {command}: error: destination {dst} is inside the source directory {src}; "
        "write to a directory outside it (the output would be mixed into the checkpoint it is read from)"
    ], proc.stderr
    assert _listing(tmp_path) == before


def test_source_inside_the_destination_is_refused(meta_ckpt, tmp_path):
    src = tmp_path / "out" / "ckpt"
    src.mkdir(parents=True)
    for f in meta_ckpt[0].iterdir():
        (src / f.name).symlink_to(f)
    before = _listing(tmp_path)
    with pytest.raises(ValueError, match=f"the source directory {src} is inside the destination {tmp_path / 'out'}"):
        reshard(src, tmp_path / "out", model_parallel_size=2)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("size", ["2", 0, -1, 1.0, True])
def test_shard_count_is_checked_before_writing(meta_ckpt, hf_dir, tmp_path, size):
    error = ValueError if type(size) is int else TypeError  # out of range, or not an int at all
    with pytest.raises(error, match="model_parallel_size"):
        reshard(meta_ckpt[0], tmp_path / "a", model_parallel_size=size)
    with pytest.raises(error, match="model_parallel_size"):
        hf_to_meta(hf_dir[0], tmp_path / "b", model_parallel_size=size)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full", "ctrl-c"])
def test_failed_conversion_leaves_nothing_and_the_next_run_works(hf_dir, tmp_path, monkeypatch, error):
    """A failure after the first shard is written (a full disk, Ctrl-C) leaves no
    directory and no partial files; running again succeeds without cleaning up by hand."""
    src, model = hf_dir
    dst = tmp_path / "meta"
    real_save, calls = torch.save, []

    def failing_save(obj, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise error
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(type(error)):
        hf_to_meta(src, dst, model_parallel_size=2)
    assert len(calls) == 2  # the first shard had been written
    assert not dst.exists() and _leftovers(tmp_path) == []
    monkeypatch.setattr(torch, "save", real_save)
    hf_to_meta(src, dst, model_parallel_size=2)
    tokens = tokens_for(VOCAB)
    assert helpers.rel_err(llama_logits(dst, tokens), hf_logits(model, tokens)) < 1e-4


def test_destination_with_files_is_refused_and_left_alone(meta_ckpt, tmp_path):
    """A directory holding only a tokenizer.model (no checkpoint files) is refused too:
    its file is never overwritten, and no new file lands beside it."""
    src, _ = meta_ckpt
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "tokenizer.model").write_bytes(b"my own tokenizer")
    for convert in (lambda: meta_to_hf(src, dst), lambda: reshard(src, dst, model_parallel_size=2)):
        with pytest.raises(FileExistsError, match="already holds files .*tokenizer.model"):
            convert()
        assert sorted(p.name for p in dst.iterdir()) == ["tokenizer.model"]
        assert (dst / "tokenizer.model").read_bytes() == b"my own tokenizer"
    assert _leftovers(tmp_path) == []


def test_empty_destination_is_filled(meta_ckpt, tmp_path):
    src, _ = meta_ckpt
    (tmp_path / "out").mkdir()
    reshard(src, tmp_path / "out", model_parallel_size=2)
    assert [p.name for p in find_shards(tmp_path / "out")] == ["consolidated.00.pth", "consolidated.01.pth"]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_permissions_of_ordinary_files(meta_ckpt, tmp_path, umask):
    src, _ = meta_ckpt
    old = os.umask(umask)
    try:
        reference_dir = tmp_path / "reference"
        reference_dir.mkdir()
        (reference_dir / "file").write_text("x")
        meta_to_hf(src, tmp_path / "hf", max_position_embeddings=64)
        reshard(src, tmp_path / "mp2", model_parallel_size=2)
    finally:
        os.umask(old)
    dir_mode = stat.S_IMODE(reference_dir.stat().st_mode)
    file_mode = stat.S_IMODE((reference_dir / "file").stat().st_mode)
    assert dir_mode == 0o777 & ~umask and file_mode == 0o666 & ~umask
    for out in (tmp_path / "hf", tmp_path / "mp2"):
        assert stat.S_IMODE(out.stat().st_mode) == dir_mode, out
        for f in out.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == file_mode, f


# -- the command line: fast help, one-line errors, nothing written on a bad argument -----


def run_cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(helpers.REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=helpers.REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_help_is_complete_and_does_not_import_torch():
    for args in ([], ["meta_to_hf"], ["hf_to_meta"], ["reshard"]):
        proc = run_cli("-X", "importtime", "-m", "llama.convert", *args, "--help")
        assert proc.returncode == 0, proc.stderr
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "torch" not in imported and "transformers" not in imported
        assert "Optional[" not in proc.stdout
    top = run_cli("-m", "llama.convert", "--help").stdout
    assert "Convert Llama checkpoints" in top and all(c in top for c in ("hf_to_meta", "meta_to_hf", "reshard"))
    sub = run_cli("-m", "llama.convert", "meta_to_hf", "--help").stdout
    for flag in ("--max_position_embeddings", "--max_shard_size_gb", "META_DIR", "HF_DIR", "generation_config.json"):
        assert flag in sub


def test_cli_wrong_directories_are_told_before_torch_is_imported(tmp_path):
    """The source and destination are checked first, as each command does, but before torch is
    imported (1.8 s on a 2-CPU machine, against 0.06 s for the message alone)."""
    src = tmp_path / "ckpt"
    src.mkdir()
    cases = [(tmp_path / "missing", tmp_path / "out", f"source directory not found: {tmp_path / 'missing'}"),
             (src, src / "sub", f"destination {src / 'sub'} is inside the source directory {src}"),
             (src, src, f"destination {src} is the source directory")]
    for source, dest, message in cases:
        proc = run_cli("-X", "importtime", "-m", "llama.convert", "reshard", str(source), str(dest),
                       "--model_parallel_size", "2")
        errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert proc.returncode == 1 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert errors[0].startswith("python -m llama.convert reshard: error: ")
        assert "torch" not in imported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and not list(src.iterdir())


@pytest.mark.parametrize("value", ["abc", "-5", "nan", "0", "inf", "1e3"])
def test_cli_bad_value_is_one_line_and_writes_nothing(meta_ckpt, tmp_path, value):
    proc = run_cli("-m", "llama.convert", "meta_to_hf", str(meta_ckpt[0]), str(tmp_path / "hf"),
                   "--max_position_embeddings", value)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert "max_position_embeddings" in proc.stderr and repr(value) in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_failure_is_one_line(tmp_path):
    proc = run_cli("-m", "llama.convert", "reshard", str(tmp_path / "missing"), str(tmp_path / "out"),
                   "--model_parallel_size", "2")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"python -m llama.convert reshard: error: source directory not found: {tmp_path / 'missing'}"
    ]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# -- meta_to_hf output used end to end by transformers -------------------------------------

HF_TEXTS = [
    "Hello world",
    "  two  spaces\n\nnew lines\tand a tab ",
    "",
    " ",
    "\n",
    "Ünïcödé café 東京 😀 Москва",
    "don't I'LL you've 1234567 3.14",
    "[INST] not a tag here [/INST]",
]
HF_DIALOGS = [
    [{"role": "user", "content": "Hi there "}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": " Because. "},
        {"role": "user", "content": "And the sea?"},
    ],
]


CONVERTED_FAMILIES = ("llama2", "llama3")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, llama3_checkpoint) -> dict[str, tuple]:
    """family -> (Meta source dir, its meta_to_hf output, prompt, what AutoTokenizer made of the
    output in a process where the tokenizer libraries are hidden).  Llama 2: the bundled demo
    model; Llama 3: the tiny llama3 checkpoint with its tiktoken file.  One probe process reads
    both outputs."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for family in CONVERTED_FAMILIES:
        if family == "llama2":
            src, prompt = helpers.REPO / "demo", "KING.\nMy lords,"
        else:
            ckpt, tok_path, _, _ = llama3_checkpoint
            src, prompt = root / "meta", "the quick brown fox"
            src.mkdir()
            for f in ckpt.iterdir():
                (src / f.name).symlink_to(f)
            (src / "tokenizer.model").symlink_to(tok_path)
        dst = root / f"hf-{family}"
        meta_to_hf(src, dst, max_position_embeddings=256)
        out[family] = (src, dst, prompt)
    dsts = [str(out[family][1]) for family in CONVERTED_FAMILIES]
    probe = (
        "import json, sys\n"
        "sys.modules['sentencepiece'] = None; sys.modules['tiktoken'] = None\n"  # nothing but the written files
        "from transformers import AutoTokenizer\n"
        f"texts, dialogs = {HF_TEXTS!r}, {HF_DIALOGS!r}\n"
        f"for dst in {dsts!r}:\n"
        "    tok = AutoTokenizer.from_pretrained(dst)\n"
        "    enc = [tok(t)['input_ids'] for t in texts]\n"
        "    chats = [list(tok.apply_chat_template(d, tokenize=True, return_dict=True)['input_ids'])\n"
        "             for d in dialogs]\n"
        "    print(json.dumps({'enc': enc, 'chats': chats, 'eos': tok.eos_token_id, 'bos': tok.bos_token_id}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()[-len(CONVERTED_FAMILIES):]
    return {family: (*out[family], json.loads(line)) for family, line in zip(CONVERTED_FAMILIES, lines)}


@pytest.mark.slow
@pytest.mark.parametrize("family", CONVERTED_FAMILIES)
def test_converted_directory_works_in_transformers_end_to_end(converted, family):
    """AutoTokenizer (from the written files alone: the tokenizer libraries are hidden)
    encodes as the library does, BOS included, renders chats to the library's tokens,
    and AutoTokenizer + generate give the library's greedy text from the same prompt.

    Llama 2: the bundled demo model (a real SentencePiece model and trained weights, so
    the greedy text is words); Llama 3: a tiny random checkpoint with a tiktoken file.
    """
    src, dst, prompt, got = converted[family]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (dst / name).is_file(), name

    llama = Llama.build(src, src / "tokenizer.model", max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    assert got["enc"] == [llama.tokenizer.encode(t, bos=True, eos=False) for t in HF_TEXTS]
    assert got["chats"] == [llama.formatter.encode_dialog_prompt(d) for d in HF_DIALOGS]
    assert (got["bos"], got["eos"]) == (llama.tokenizer.bos_id, llama.tokenizer.eos_id)

    tokenizer = transformers.AutoTokenizer.from_pretrained(dst)
    model = transformers.LlamaForCausalLM.from_pretrained(dst, attn_implementation="eager", dtype=torch.float32).eval()
    stops = model.generation_config.eos_token_id
    stops = {stops} if isinstance(stops, int) else set(stops)
    assert stops == set(llama.tokenizer.stop_tokens)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=24, pad_token_id=llama.tokenizer.eos_id)
    hf_ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    hf_ids = hf_ids[: next((i for i, t in enumerate(hf_ids) if t in stops), len(hf_ids))]
    hf_text = tokenizer.decode(hf_ids)  # stop tokens cut above, as the library does
    ours = llama.text_completion([prompt], temperature=0, max_gen_len=24)[0]["generation"]
    assert hf_ids == llama.generate([llama.tokenizer.encode(prompt, bos=True, eos=False)], 24, temperature=0)[0][0]
    assert hf_text == ours and len(ours.split()) >= (4 if family == "llama2" else 1), (hf_text, ours)
