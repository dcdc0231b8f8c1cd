"""Llama 4 fixtures for the tests: tiny configs, random weights, hand-split shards, and
the same weights in Hugging Face transformers' ``Llama4ForCausalLM`` and in Meta's
``llama-models`` reference.

Everything here is written out independently of ``llama.checkpoint.shards`` and ``llama.args``
(shard axes, expert width, which layer is MoE / NoPE), so the tests check the library
against a second statement of Meta's conventions.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

# Several experts, top-2 routing, MoE on every 2nd layer (dense between), a NoPE layer
# (the 4th), chunks of 8 (much shorter than the sequences tested), QK norm, scaled RoPE
# with Scout's defaults (factor 16, high-frequency factor 1: the file names neither),
# and temperature tuning that already acts at position 3 (floor_scale 4).
LLAMA4_PARAMS = dict(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    multiple_of=16,
    ffn_dim_multiplier=1.2,
    ffn_exp=2.0,
    norm_eps=1e-5,
    rope_theta=500000.0,
    use_scaled_rope=True,
    moe_args=dict(num_experts=4, capacity_factor=1.0, auto_scale_F=True, top_k=2, interleave_moe_layer_step=2),
    attention_chunk_size=8,
    nope_layer_interval=4,
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.5,
)


# For model-parallel tests: 8 heads (4 K/V heads, so 8 shards hold copies), a vocabulary
# (params.json's, larger than the tiny tokenizer's 556) that splits 8 ways.
LLAMA4_MP_PARAMS = {**LLAMA4_PARAMS, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 560}


def hidden_sizes(params: dict) -> tuple[int, int]:
    """(dense FFN width, expert width) by Meta's rules, written out (llama-models' model.py/moe.py)."""
    dim, m, mult = params["dim"], params["multiple_of"], params.get("ffn_dim_multiplier")
    dense = int(2 * 4 * dim / 3)
    if mult is not None:
        dense = int(mult * dense)
    dense = m * ((dense + m - 1) // m)
    moe = params["moe_args"]
    expert = int(2 * int(params["ffn_exp"] * dim) / 3)
    if mult is not None:
        expert = int(mult * expert)
    if moe.get("auto_scale_F", True):
        expert = int(expert / (moe.get("capacity_factor", 1.0) + 1))
    expert += -expert % m
    return dense, expert


@contextlib.contextmanager
def dense_experts(moe):
    """Within the block, ``moe`` runs every token through every expert (Meta's way)."""
    moe.expert_compute = "dense"
    try:
        yield moe
    finally:
        moe.expert_compute = "grouped"


def is_moe(params: dict, i: int) -> bool:
    return (i + 1) % params["moe_args"]["interleave_moe_layer_step"] == 0


def random_llama4_weights(params: dict, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsplit) float32 weights in the reference model's names."""
    g = torch.Generator().manual_seed(seed)
    dim, n_heads = params["dim"], params["n_heads"]
    n_kv = params.get("n_kv_heads") or n_heads
    hd = dim // n_heads
    dense, expert = hidden_sizes(params)
    n_experts = params["moe_args"]["num_experts"]

    def lin(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def norm():
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    w = {"tok_embeddings.weight": torch.randn(vocab_size, dim, generator=g)}
    for i in range(params["n_layers"]):
        p = f"layers.{i}."
        w[p + "attention.wq.weight"] = lin(n_heads * hd, dim)
        w[p + "attention.wk.weight"] = lin(n_kv * hd, dim)
        w[p + "attention.wv.weight"] = lin(n_kv * hd, dim)
        w[p + "attention.wo.weight"] = lin(dim, n_heads * hd)
        if is_moe(params, i):
            f = p + "feed_forward."
            # A router with spread-out scores, so top-k picks differ from token to token.
            w[f + "router_DE"] = 2.0 * lin(dim, n_experts)
            w[f + "experts.w1"] = torch.randn(n_experts, dim, expert, generator=g) / dim**0.5
            w[f + "experts.w3"] = torch.randn(n_experts, dim, expert, generator=g) / dim**0.5
            w[f + "experts.w2"] = torch.randn(n_experts, expert, dim, generator=g) / expert**0.5
            w[f + "shared_expert.w1.weight"] = lin(expert, dim)
            w[f + "shared_expert.w3.weight"] = lin(expert, dim)
            w[f + "shared_expert.w2.weight"] = lin(dim, expert)
        else:
            w[p + "feed_forward.w1.weight"] = lin(dense, dim)
            w[p + "feed_forward.w3.weight"] = lin(dense, dim)
            w[p + "feed_forward.w2.weight"] = lin(dim, dense)
        w[p + "attention_norm.weight"] = norm()
        w[p + "ffn_norm.weight"] = norm()
    w["norm.weight"] = norm()
    w["output.weight"] = lin(vocab_size, dim)
    return w


def _axis(name: str):
    """Meta's split of each Llama 4 text tensor (llama-models' checkpoint.py), by hand."""
    if name.endswith("router_DE") or "norm" in name:
        return None
    if name.endswith(("experts.w1", "experts.w3")):
        return 2  # (E, dim, hidden): every expert's hidden units
    if name.endswith("experts.w2"):
        return 1  # (E, hidden, dim)
    if name.endswith(("attention.wo.weight", "w2.weight")):
        return 1
    return 0  # wq/wk/wv, w1/w3, embeddings (vocabulary), output


def write_llama4_checkpoint(ckpt_dir: Path, params: dict, weights: dict, n_shards: int = 1,
                            extra: dict | None = None) -> Path:
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "params.json").write_text(json.dumps(params))
    n_kv = params.get("n_kv_heads") or params["n_heads"]
    hd = params["dim"] // params["n_heads"]
    for rank in range(n_shards):
        shard = {}
        for k, v in weights.items():
            axis = _axis(k)
            if axis is None:
                shard[k] = v.clone()
            elif k.endswith(("attention.wk.weight", "attention.wv.weight")) and n_shards > n_kv:
                head = rank * n_kv // n_shards  # more shards than K/V heads: each holds a copy of one head
                shard[k] = v[head * hd : (head + 1) * hd].clone()
            else:
                shard[k] = v.chunk(n_shards, dim=axis)[rank].clone()
        shard.update(extra or {})
        torch.save(shard, ckpt_dir / f"consolidated.{rank:02d}.pth")
    return ckpt_dir


def build_hf_llama4(params: dict, weights: dict, max_pos: int = 256):
    """The same weights in transformers' Llama4ForCausalLM (float32, eager attention)."""
    import transformers

    dense, expert = hidden_sizes(params)
    moe = params["moe_args"]
    rope = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    if params.get("use_scaled_rope"):
        rope.update(rope_type="llama3", factor=params.get("rope_scaling_factor", 16.0), low_freq_factor=1.0,
                    high_freq_factor=params.get("rope_high_freq_factor", 1.0), original_max_position_embeddings=8192)
    config = transformers.Llama4TextConfig(
        vocab_size=weights["tok_embeddings.weight"].shape[0],
        hidden_size=params["dim"],
        intermediate_size=expert,
        intermediate_size_mlp=dense,
        num_hidden_layers=params["n_layers"],
        num_attention_heads=params["n_heads"],
        num_key_value_heads=params["n_kv_heads"],
        head_dim=params["dim"] // params["n_heads"],
        num_experts_per_tok=moe["top_k"],
        num_local_experts=moe["num_experts"],
        interleave_moe_layer_step=moe["interleave_moe_layer_step"],
        use_qk_norm=params["use_qk_norm"],
        no_rope_layer_interval=params["nope_layer_interval"],
        attention_chunk_size=params["attention_chunk_size"],
        attn_temperature_tuning=params["attn_temperature_tuning"],
        floor_scale=params["floor_scale"],
        attn_scale=params["attn_scale"],
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
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            # HF's Llama 4 rotates interleaved pairs like Meta: no q/k row permutation
            sd[h + f"self_attn.{theirs}.weight"] = weights[m + f"attention.{ours}.weight"]
        sd[h + "input_layernorm.weight"] = weights[m + "attention_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = weights[m + "ffn_norm.weight"]
        f, hf = m + "feed_forward.", h + "feed_forward."
        if is_moe(params, i):
            sd[hf + "router.weight"] = weights[f + "router_DE"].t()
            sd[hf + "experts.gate_up_proj"] = torch.cat([weights[f + "experts.w1"], weights[f + "experts.w3"]], dim=2)
            sd[hf + "experts.down_proj"] = weights[f + "experts.w2"]
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                sd[hf + f"shared_expert.{theirs}.weight"] = weights[f + f"shared_expert.{ours}.weight"]
        else:
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                sd[hf + f"{theirs}.weight"] = weights[f + f"{ours}.weight"]
    model = transformers.Llama4ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by a full forward per step (no KV cache: nothing to get wrong)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt):]


@contextlib.contextmanager
def reference_on_cpu():
    """llama-models' Llama 4 reference allocates its KV cache with ``.cuda()``; on a CPU
    machine, keep those tensors where they are.  Also starts fairscale's model
    parallelism (1 process) if no group exists."""
    import torch.distributed as dist
    from fairscale.nn.model_parallel import initialize as fs_init

    if not dist.is_initialized():
        from llama.runtime import distributed
        distributed.init_model_parallel(torch.device("cpu"))
    assert fs_init.get_model_parallel_world_size() == 1
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def build_reference_llama4(params: dict, weights: dict, max_seq_len: int, max_batch_size: int):
    """Meta's own Llama 4 text model (llama-models), float32 on CPU, with these weights."""
    from llama_models.llama4.args import ModelArgs as RefArgs
    from llama_models.llama4.model import Transformer as RefTransformer

    ref_params = {k: v for k, v in params.items() if k in RefArgs.model_fields}
    ref_params.update(vocab_size=weights["tok_embeddings.weight"].shape[0], max_seq_len=max_seq_len,
                      max_batch_size=max_batch_size)
    args = RefArgs(**ref_params)
    with reference_on_cpu():
        model = RefTransformer(args)
    model.load_state_dict(weights, strict=True)
    return model.float().eval()


def write_release_checkpoint(ckpt_dir: Path, params: dict, weights: dict, n_shards: int) -> Path:
    """The same weights under the names and fused layouts of Meta's released Llama 4
    shards (those llama-models' load hooks translate), with the training leftovers
    (``_extra_state`` byte buffers, routing statistics) such files carry."""
    import io

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "params.json").write_text(json.dumps(params))
    n_kv = params.get("n_kv_heads") or params["n_heads"]
    hd = params["dim"] // params["n_heads"]
    n_experts = params["moe_args"]["num_experts"]

    def part(name, rank):
        v = weights[name]
        if name.endswith(("attention.wk.weight", "attention.wv.weight")) and n_shards > n_kv:
            head = rank * n_kv // n_shards
            return v[head * hd : (head + 1) * hd]
        axis = _axis(name)
        return v if axis is None else v.chunk(n_shards, dim=axis)[rank]

    for rank in range(n_shards):
        shard = {k: part(k, rank).clone() for k in ("tok_embeddings.weight", "norm.weight", "output.weight")}
        for i in range(params["n_layers"]):
            p = f"layers.{i}."
            a, f = p + "attention.", p + "feed_forward."
            shard[a + "wqkv.weight"] = torch.cat([part(a + x + ".weight", rank) for x in ("wq", "wk", "wv")])
            shard[a + "wqkv.layer_norm_weight"] = weights[p + "attention_norm.weight"].clone()
            shard[a + "wo.weight"] = part(a + "wo.weight", rank).clone()
            shard[a + "wqkv._extra_state"] = io.BytesIO(b"\x00\x01transformer-engine")
            if is_moe(params, i):
                shard[f + "norm.weight"] = weights[p + "ffn_norm.weight"].clone()
                shard[f + "router_DE"] = weights[f + "router_DE"].clone()
                w1, w3, w2 = (part(f + f"experts.{x}", rank) for x in ("w1", "w3", "w2"))
                shard[f + "experts.moe_w_in_eD_F"] = w1.reshape(-1, w1.shape[-1]).clone()  # (E * dim, hidden/N)
                shard[f + "experts.moe_w_swiglu_eD_F"] = w3.reshape(-1, w3.shape[-1]).clone()
                shard[f + "experts.moe_w_out_eF_D"] = w2.reshape(-1, w2.shape[-1]).clone()  # (E * hidden/N, dim)
                shard[f + "w_in_shared_FD.weight"] = part(f + "shared_expert.w1.weight", rank).clone()
                shard[f + "w_swiglu_FD.weight"] = part(f + "shared_expert.w3.weight", rank).clone()
                shard[f + "w_out_shared_DF.weight"] = part(f + "shared_expert.w2.weight", rank).clone()
                shard[f + "global_gate_stats_3E"] = torch.zeros(3, n_experts)
            else:
                shard[f + "mlp.fc1_weight"] = torch.cat([part(f + "w1.weight", rank), part(f + "w3.weight", rank)])
                shard[f + "mlp.fc2_weight"] = part(f + "w2.weight", rank).clone()
                shard[f + "mlp.layer_norm_weight"] = weights[p + "ffn_norm.weight"].clone()
        torch.save(shard, ckpt_dir / f"consolidated.{rank:02d}.pth")
    return ckpt_dir
