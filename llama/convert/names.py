"""Tensor names and row orders: Meta's checkpoint keys against Hugging Face's
(``LlamaForCausalLM`` and ``Llama4ForCausalLM``), and the RoPE row permutation between them.
"""

from __future__ import annotations

from typing import Optional

import torch

# Meta tensor name (layer index "*") -> Hugging Face LlamaForCausalLM name.
META_TO_HF_NAMES: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.*.attention.wq.weight": "model.layers.*.self_attn.q_proj.weight",
    "layers.*.attention.wk.weight": "model.layers.*.self_attn.k_proj.weight",
    "layers.*.attention.wv.weight": "model.layers.*.self_attn.v_proj.weight",
    "layers.*.attention.wo.weight": "model.layers.*.self_attn.o_proj.weight",
    "layers.*.feed_forward.w1.weight": "model.layers.*.mlp.gate_proj.weight",
    "layers.*.feed_forward.w3.weight": "model.layers.*.mlp.up_proj.weight",
    "layers.*.feed_forward.w2.weight": "model.layers.*.mlp.down_proj.weight",
    "layers.*.attention_norm.weight": "model.layers.*.input_layernorm.weight",
    "layers.*.ffn_norm.weight": "model.layers.*.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Llama 4 (transformers' Llama4ForCausalLM).  Its attention rotates interleaved pairs as
# Meta's code does, so q/k rows are copied as they are.  The MoE tensors need more than a
# name: the router is stored transposed, and the experts' w1 and w3 as one
# ``gate_up_proj`` (E, dim, 2*hidden) with w1 in the first half.
LLAMA4_META_TO_HF_NAMES: dict[str, str] = {
    **{k: v for k, v in META_TO_HF_NAMES.items() if ".feed_forward." not in k},
    "layers.*.feed_forward.w1.weight": "model.layers.*.feed_forward.gate_proj.weight",
    "layers.*.feed_forward.w3.weight": "model.layers.*.feed_forward.up_proj.weight",
    "layers.*.feed_forward.w2.weight": "model.layers.*.feed_forward.down_proj.weight",
    "layers.*.feed_forward.router_DE": "model.layers.*.feed_forward.router.weight",
    "layers.*.feed_forward.experts.w1": "model.layers.*.feed_forward.experts.gate_up_proj",
    "layers.*.feed_forward.experts.w3": "model.layers.*.feed_forward.experts.gate_up_proj",
    "layers.*.feed_forward.experts.w2": "model.layers.*.feed_forward.experts.down_proj",
    "layers.*.feed_forward.shared_expert.w1.weight": "model.layers.*.feed_forward.shared_expert.gate_proj.weight",
    "layers.*.feed_forward.shared_expert.w3.weight": "model.layers.*.feed_forward.shared_expert.up_proj.weight",
    "layers.*.feed_forward.shared_expert.w2.weight": "model.layers.*.feed_forward.shared_expert.down_proj.weight",
}
# Llama 4's image encoder (Meta's names, vision block index "*") -> transformers'
# Llama4VisionModel / Llama4MultiModalProjector names in a Llama4ForConditionalGeneration.  Its
# vision attention rotates interleaved pairs as Meta's does: q/k rows are copied as they are.
_VE, _HV = "vision_embeddings.vision_encoder.", "vision_model."
_VB, _HB = _VE + "transformer.resblocks.*.", _HV + "model.layers.*."
LLAMA4_VISION_META_TO_HF_NAMES: dict[str, str] = {
    _VE + "conv1._linear.weight": _HV + "patch_embedding.linear.weight",
    _VE + "class_embedding": _HV + "class_embedding",
    _VE + "positional_embedding_vlm": _HV + "positional_embedding_vlm",
    **{_VE + f"ln_{a}.{p}": _HV + f"layernorm_{a}.{p}" for a in ("pre", "post") for p in ("weight", "bias")},
    **{_VB + f"attn.w{a}.{p}": _HB + f"self_attn.{a}_proj.{p}" for a in "qkvo" for p in ("weight", "bias")},
    **{_VB + f"mlp.{a}.{p}": _HB + f"mlp.{b}.{p}" for a, b in (("c_fc", "fc1"), ("c_proj", "fc2"))
       for p in ("weight", "bias")},
    _VB + "ln_1.weight": _HB + "input_layernorm.weight",
    _VB + "ln_1.bias": _HB + "input_layernorm.bias",
    _VB + "ln_2.weight": _HB + "post_attention_layernorm.weight",
    _VB + "ln_2.bias": _HB + "post_attention_layernorm.bias",
    "vision_embeddings.vision_adapter.mlp.c_fc.weight": _HV + "vision_adapter.mlp.fc1.weight",
    "vision_embeddings.vision_adapter.mlp.c_proj.weight": _HV + "vision_adapter.mlp.fc2.weight",
    "vision_projection.weight": "multi_modal_projector.linear_1.weight",
}
# Where a multimodal Llama4ForConditionalGeneration repository keeps the language model
# (as published, and as transformers 5 saves it), and the prefix of its vision tensors.
LLAMA4_TEXT_PREFIXES = (("model.", "lm_head."), ("language_model.model.", "language_model.lm_head."),
                         ("model.language_model.", "lm_head."))
LLAMA4_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
                           "model.multi_modal_projector.")

# Tensors whose rows are RoPE-permuted in HF, with the ModelArgs field giving their head count.
ROPE_PERMUTED = {"layers.*.attention.wq.weight": "n_heads", "layers.*.attention.wk.weight": "n_kv_heads"}
# Buffers some older HF saves carry; recomputed from the config.
HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


DEFAULT_MAX_SHARD_SIZE_GB = 5.0


def layer_pattern(name: str) -> tuple[str, Optional[str]]:
    """("layers.*.attention.wq.weight", "3") for "layers.3.attention.wq.weight" (and likewise for
    the image encoder's blocks, ``...transformer.resblocks.3.``)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(["layers", "*", *parts[2:]]), parts[1]
    if name.startswith(_VE + "transformer.resblocks."):
        return ".".join([*parts[:4], "*", *parts[5:]]), parts[4]
    return name, None


def hf_name(meta_name: str, llama4: bool = False) -> str:
    """The HF LlamaForCausalLM (or, with ``llama4``, Llama4ForCausalLM; for the image encoder's
    tensors, Llama4ForConditionalGeneration's) name of a Meta tensor name."""
    key, layer = layer_pattern(meta_name)
    if llama4 and key in LLAMA4_VISION_META_TO_HF_NAMES:
        hf = LLAMA4_VISION_META_TO_HF_NAMES[key]
    else:
        hf = (LLAMA4_META_TO_HF_NAMES if llama4 else META_TO_HF_NAMES)[key]
    return hf.replace("*", layer) if layer is not None else hf


def meta_to_hf_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows within each head from Meta's interleaved pairs (x0, y0, x1, y1, ...)
    to HF's halves (x0, x1, ..., y0, y1, ...)."""
    out, width = w.shape
    hd = out // n_heads
    return w.view(n_heads, hd // 2, 2, width).transpose(1, 2).reshape(out, width)


def hf_to_meta_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`meta_to_hf_rope_rows`: HF's halves back to Meta's interleaved pairs."""
    out, width = w.shape
    hd = out // n_heads
    return w.view(n_heads, 2, hd // 2, width).transpose(1, 2).reshape(out, width)
