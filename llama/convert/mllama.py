"""Llama 3.2 Vision between Meta's layout and Hugging Face's ``MllamaForConditionalGeneration``:
the config (:func:`mllama_config_to_params`, :func:`mllama_params_to_hf_config`) and the tensors
(:func:`mllama_hf_to_meta`, :func:`mllama_meta_to_hf`), whole tensors in memory.

Meta's checkpoint keeps the text model under ``text_model.`` (self-attention ``layers.N`` and,
apart, ``cross_attention_layers.J``; ``learnable_embedding`` the 8 rows after the vocabulary) and
the encoder under ``vision_model.`` (llama-models' module names).  Hugging Face's interleaves the
two kinds of text layers in one list (cross-attention layer J sits at index ``schedule[J] + J``),
appends the 8 rows to ``embed_tokens``, stores self-attention q/k rows in its RoPE order, the
patch projection as a convolution, and the tile tables precomputed per aspect ratio: row ``i`` of
``pre_tile_positional_embedding.embedding`` (and of the other two) holds Meta's
``table[:a, :b]`` for the i-th supported canvas ``(a, b)``, zero past its ``a * b`` tiles and in
row 0 (no image).  Those rows, read back, must agree where canvases overlap (they do in every
checkpoint converted from Meta's); a checkpoint whose rows were trained apart cannot be written in
Meta's layout, and :func:`mllama_hf_to_meta` says so.

``intermediate_layers_indices`` of Hugging Face's config is read as the published configs were
written (transformers 4: the *input* of each listed block, Meta's ``return_intermediate``).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from llama.args import MllamaVisionArgs, ModelArgs
from llama.convert.config import hf_config_to_params
from llama.convert.names import hf_to_meta_rope_rows, meta_to_hf_rope_rows
from llama.vision_mllama import supported_aspect_ratios

__all__ = ["mllama_config_to_params", "mllama_params_to_hf_config", "mllama_hf_to_meta", "iter_mllama_hf_to_meta",
           "mllama_meta_to_hf", "hf_cross_attention_layers", "model_name"]

_LEARNABLE_ROWS = 8
# Where a MllamaForConditionalGeneration's parts are: (text body, lm_head, vision, projector)
# as published (transformers 4) and as transformers 5 saves it.
_HF_PREFIXES = (
    ("language_model.model.", "language_model.lm_head.", "vision_model.", "multi_modal_projector."),
    ("model.language_model.", "lm_head.", "model.vision_model.", "model.multi_modal_projector."),
)
_TEXT_LAYER = {  # Meta (under layers.N.) -> HF (under layers.M.), self-attention layers
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_CROSS_LAYER = {  # Meta (under cross_attention_layers.J.) -> HF (under layers.M.)
    "attention.wq.weight": "cross_attn.q_proj.weight",
    "attention.wk.weight": "cross_attn.k_proj.weight",
    "attention.wv.weight": "cross_attn.v_proj.weight",
    "attention.wo.weight": "cross_attn.o_proj.weight",
    "attention.q_norm.weight": "cross_attn.q_norm.weight",
    "attention.k_norm.weight": "cross_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "gate_attn": "cross_attn_attn_gate",
    "gate_ffwd": "cross_attn_mlp_gate",
}
_VISION_BLOCK = {  # Meta (under resblocks.N.) -> HF (under layers.N.)
    **{f"attn.w{a}.weight": f"self_attn.{a}_proj.weight" for a in "qkvo"},
    "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
    "ln_1.weight": "input_layernorm.weight", "ln_1.bias": "input_layernorm.bias",
    "ln_2.weight": "post_attention_layernorm.weight", "ln_2.bias": "post_attention_layernorm.bias",
}
_VISION_TOP = {  # Meta (under vision_model.vision_encoder.) -> HF (under vision_model.), plain copies
    "class_embedding": "class_embedding",
    "positional_embedding": "gated_positional_embedding.embedding",
    "gated_positional_embedding_gate": "gated_positional_embedding.gate",
    "pre_tile_pos_embed.gate": "pre_tile_positional_embedding.gate",
    "post_tile_pos_embed.gate": "post_tile_positional_embedding.gate",
    "ln_pre.weight": "layernorm_pre.weight", "ln_pre.bias": "layernorm_pre.bias",
    "ln_post.weight": "layernorm_post.weight", "ln_post.bias": "layernorm_post.bias",
}
_VISION_TABLES = {  # Meta table [T, T, n, dim] -> HF per-aspect-ratio rows [ratios + 1, T * n * dim]
    "pre_tile_pos_embed.embedding": "pre_tile_positional_embedding.embedding.weight",
    "post_tile_pos_embed.embedding": "post_tile_positional_embedding.embedding.weight",
    "gated_positional_embedding": "gated_positional_embedding.tile_embedding.weight",
}


def hf_cross_attention_layers(args: ModelArgs) -> list[int]:
    """Hugging Face's ``cross_attention_layers``: cross-attention layer J, run before self-attention
    layer ``schedule[J]``, is entry ``schedule[J] + J`` of the interleaved list (11B: 3, 8, ..., 38)."""
    return [layer + j for j, layer in enumerate(args.fusion_schedule())]


def mllama_config_to_params(config: Mapping[str, Any]) -> dict:
    """Meta ``params.json`` contents for a ``MllamaForConditionalGeneration`` ``config.json`` (a dict).
    ValueError for what Meta's layout cannot express (cross-attention layers off Meta's schedule,
    other canvases, an ``<|image|>`` id other than the first row past the vocabulary)."""
    text, vision = config.get("text_config"), config.get("vision_config")
    if config.get("model_type") != "mllama" or not isinstance(text, Mapping) or not isinstance(vision, Mapping):
        raise ValueError("config.json is not a MllamaForConditionalGeneration's (model_type 'mllama' with "
                         "text_config and vision_config)")
    cross = sorted(text.get("cross_attention_layers") or [])
    total = text["num_hidden_layers"]
    params = hf_config_to_params({**text, "model_type": "llama", "num_hidden_layers": total - len(cross)})
    image_size, patch = vision.get("image_size", 448), vision.get("patch_size", 14)
    hidden = vision["hidden_size"]
    intermediate = tuple(vision.get("intermediate_layers_indices") or (3, 7, 15, 23, 30))
    encoder = MllamaVisionArgs(
        dim=hidden, n_layers=vision["num_hidden_layers"], n_global_layers=vision.get("num_global_layers", 8),
        n_heads=vision.get("attention_heads", vision.get("num_attention_heads", 16)), patch_size=patch,
        mlp_ratio=vision["intermediate_size"] / hidden, intermediate_layers=intermediate)
    encoder.validate()
    if encoder.hidden_dim != vision["intermediate_size"]:
        raise ValueError(f"vision_config: intermediate_size={vision['intermediate_size']} is no whole multiple of "
                         f"hidden_size={hidden}")
    if vision.get("vision_output_dim", encoder.output_dim) != encoder.output_dim:
        raise ValueError(f"vision_config: vision_output_dim={vision['vision_output_dim']} is not hidden_size x "
                         f"(intermediate layers + 1) = {encoder.output_dim}")
    if vision.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"vision_config: hidden_act={vision['hidden_act']!r}; Meta's encoder uses 'gelu'")
    chunks = vision.get("max_num_tiles", 4)
    ratios = vision.get("supported_aspect_ratios")
    if ratios is not None and [tuple(r) for r in ratios] != list(supported_aspect_ratios(chunks)):
        raise ValueError(f"vision_config: supported_aspect_ratios={ratios} are not Meta's canvases of at most "
                         f"{chunks} tiles {list(supported_aspect_ratios(chunks))}")
    image_token = config.get("image_token_index", 128256)
    if image_token != text["vocab_size"]:
        raise ValueError(f"config.json: image_token_index={image_token} is not the first row past the vocabulary "
                         f"({text['vocab_size']}), where Meta's model keeps <|image|>")
    params.update(vision_chunk_size=image_size, vision_max_num_chunks=chunks,
                  vision_num_cross_attention_layers=len(cross))
    if encoder != MllamaVisionArgs():
        params["mllama_vision_args"] = encoder.to_params()
    args = ModelArgs.from_dict(params)
    if hf_cross_attention_layers(args) != cross:
        raise ValueError(f"text_config: cross_attention_layers={cross} are not Meta's schedule for {args.n_layers} "
                         f"layers and {len(cross)} cross-attention layers ({hf_cross_attention_layers(args)})")
    return params


def mllama_params_to_hf_config(args: ModelArgs, text_config: dict, image_token_index: int) -> dict:
    """A ``MllamaForConditionalGeneration`` ``config.json`` (a dict) for ``args``, around the text
    model's ``text_config`` (as written for Llama 3.x; its layer count and type are changed here)."""
    encoder = args.mllama_vision_args
    if encoder is None:
        raise ValueError("params: not a Llama 3.2 Vision model (no vision_chunk_size)")
    cross = hf_cross_attention_layers(args)
    text = {**text_config, "model_type": "mllama_text_model", "num_hidden_layers": args.n_layers + len(cross),
            "cross_attention_layers": cross}
    text.pop("architectures", None)
    vision = {"model_type": "mllama_vision_model", "hidden_size": encoder.dim, "num_hidden_layers": encoder.n_layers,
              "num_global_layers": encoder.n_global_layers, "attention_heads": encoder.n_heads,
              "intermediate_size": encoder.hidden_dim, "vision_output_dim": encoder.output_dim,
              "image_size": args.vision_chunk_size, "patch_size": encoder.patch_size,
              "max_num_tiles": args.vision_max_num_chunks, "hidden_act": "gelu", "norm_eps": 1e-5,
              "intermediate_layers_indices": list(encoder.intermediate_layers),
              "supported_aspect_ratios": [list(r) for r in supported_aspect_ratios(args.vision_max_num_chunks)]}
    return {"model_type": "mllama", "architectures": ["MllamaForConditionalGeneration"],
            "image_token_index": image_token_index, "text_config": text, "vision_config": vision}


def _hf_parts(state: Mapping[str, torch.Tensor]) -> tuple[str, str, str, str]:
    for prefixes in _HF_PREFIXES:
        if prefixes[0] + "embed_tokens.weight" in state:
            return prefixes
    raise ValueError("no MllamaForConditionalGeneration text model in these weights (no '*embed_tokens.weight')")


def _precompute(table: torch.Tensor, chunks: int) -> torch.Tensor:
    """Meta's per-place table [T, T, n, dim] -> Hugging Face's rows per aspect-ratio id."""
    n, dim = table.shape[2:]
    ratios = supported_aspect_ratios(chunks)
    rows = table.new_zeros(len(ratios) + 1, chunks, n, dim)
    for i, (a, b) in enumerate(ratios, start=1):
        rows[i, : a * b] = table[:a, :b].reshape(a * b, n, dim)
    return rows.flatten(1)


def _unprecompute(rows: torch.Tensor, chunks: int, n: int, name: str) -> torch.Tensor:
    """Inverse of :func:`_precompute`; ValueError where the rows are not one table's."""
    ratios = supported_aspect_ratios(chunks)
    if rows.shape[0] != len(ratios) + 1 or rows.shape[1] % (chunks * n):
        raise ValueError(f"{name}: shape {list(rows.shape)} is not one row per aspect ratio (+1) of {chunks} tiles")
    rows = rows.reshape(len(ratios) + 1, chunks, n, -1)
    table = rows.new_zeros(chunks, chunks, n, rows.shape[-1])
    filled = torch.zeros(chunks, chunks, dtype=torch.bool)
    for i, (a, b) in enumerate(ratios, start=1):
        for tile in range(chunks):
            if tile >= a * b:
                if rows[i, tile].any():
                    raise ValueError(f"{name}: aspect ratio {i} {(a, b)} has a non-zero row for tile {tile}, past its "
                                     f"{a * b} tiles; Meta's layout has none there")
                continue
            r, c = divmod(tile, b)  # the tile's place on the canvas, row-major
            if filled[r, c] and not torch.equal(table[r, c], rows[i, tile]):
                raise ValueError(f"{name}: aspect ratios disagree on the embedding of canvas place {(r, c)}; "
                                 "Meta's layout holds one per place (these rows were trained apart and cannot be "
                                 "written as a Meta checkpoint)")
            table[r, c], filled[r, c] = rows[i, tile], True
    if rows[0].any():
        raise ValueError(f"{name}: the row of aspect ratio 0 (no image) is not zero; Meta's layout has none")
    return table


def mllama_hf_to_meta(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Meta's checkpoint tensors (``text_model.*``, ``vision_model.*``) from a
    ``MllamaForConditionalGeneration`` state dict (either prefix layout) for the model ``args``
    (:func:`mllama_config_to_params`' params)."""
    return dict(iter_mllama_hf_to_meta(state, args))


def iter_mllama_hf_to_meta(state: Mapping[str, torch.Tensor], args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`mllama_hf_to_meta` one tensor at a time (a lazy ``state`` is read as each is asked for)."""
    encoder = args.mllama_vision_args
    if encoder is None:
        raise ValueError("params: not a Llama 3.2 Vision model (no vision_chunk_size)")
    body, head, vision, projector = _hf_parts(state)
    embed = state[body + "embed_tokens.weight"]
    if embed.shape[0] != args.vocab_size + _LEARNABLE_ROWS:
        raise ValueError(f"{body}embed_tokens.weight has {embed.shape[0]} rows; a Llama 3.2 Vision model has the "
                         f"vocabulary ({args.vocab_size}) and {_LEARNABLE_ROWS} learnt rows")
    yield "text_model.tok_embeddings.weight", embed[: args.vocab_size]
    yield "text_model.learnable_embedding.weight", embed[args.vocab_size:]
    del embed
    yield "text_model.norm.weight", state[body + "norm.weight"]
    yield "text_model.output.weight", state[head + "weight"]
    cross = hf_cross_attention_layers(args)
    self_layer = 0
    for hf_index in range(args.n_layers + len(cross)):
        src = f"{body}layers.{hf_index}."
        if hf_index in cross:
            dst = f"text_model.cross_attention_layers.{cross.index(hf_index)}."
            for meta, hf in _CROSS_LAYER.items():
                yield dst + meta, state[src + hf]
            continue
        dst = f"text_model.layers.{self_layer}."
        for meta, hf in _TEXT_LAYER.items():
            t = state[src + hf]
            if meta == "attention.wq.weight":
                t = hf_to_meta_rope_rows(t, args.n_heads)
            elif meta == "attention.wk.weight":
                t = hf_to_meta_rope_rows(t, args.n_kv_heads)
            yield dst + meta, t
        self_layer += 1
    ve = "vision_model.vision_encoder."
    patch = state[vision + "patch_embedding.weight"]
    yield ve + "conv1._linear.weight", patch.reshape(patch.shape[0], -1)  # (channel, row, column): Unfold's order
    for meta, hf in _VISION_TOP.items():
        yield ve + meta, state[vision + hf]
    n_tokens = (args.vision_chunk_size // encoder.patch_size) ** 2 + 1
    for meta, hf in _VISION_TABLES.items():
        n = n_tokens if meta == "gated_positional_embedding" else 1
        yield ve + meta, _unprecompute(state[vision + hf], args.vision_max_num_chunks, n, vision + hf)
    for part, count in (("transformer", encoder.n_layers), ("global_transformer", encoder.n_global_layers)):
        for i in range(count):
            for meta, hf in _VISION_BLOCK.items():
                yield f"{ve}{part}.resblocks.{i}.{meta}", state[f"{vision}{part}.layers.{i}.{hf}"]
            if part == "global_transformer":
                for gate in ("gate_attn", "gate_ffn"):
                    yield f"{ve}{part}.resblocks.{i}.{gate}", state[f"{vision}{part}.layers.{i}.{gate}"]
    yield "vision_model.vision_projection.weight", state[projector + "weight"]
    yield "vision_model.vision_projection.bias", state[projector + "bias"]


def model_name(meta_name: str) -> str:
    """The name the model (and :mod:`llama.layers.tensor_parallel`'s tables) give a tensor of
    Meta's Llama 3.2 Vision checkpoint: its ``text_model.`` prefix dropped."""
    return meta_name.removeprefix("text_model.")


def mllama_meta_to_hf(tensors: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The inverse of :func:`mllama_hf_to_meta`: transformers 5's names (``model.language_model.`` ...)."""
    encoder = args.mllama_vision_args
    if encoder is None:
        raise ValueError("params: not a Llama 3.2 Vision model (no vision_chunk_size)")
    body, head, vision, projector = _HF_PREFIXES[1]
    out: dict[str, torch.Tensor] = {}
    out[body + "embed_tokens.weight"] = torch.cat([tensors["text_model.tok_embeddings.weight"],
                                                   tensors["text_model.learnable_embedding.weight"]])
    out[body + "norm.weight"] = tensors["text_model.norm.weight"]
    out[head + "weight"] = tensors["text_model.output.weight"]
    cross = hf_cross_attention_layers(args)
    self_layer = 0
    for hf_index in range(args.n_layers + len(cross)):
        dst = f"{body}layers.{hf_index}."
        if hf_index in cross:
            src = f"text_model.cross_attention_layers.{cross.index(hf_index)}."
            for meta, hf in _CROSS_LAYER.items():
                out[dst + hf] = tensors[src + meta]
            continue
        src = f"text_model.layers.{self_layer}."
        for meta, hf in _TEXT_LAYER.items():
            t = tensors[src + meta]
            if meta == "attention.wq.weight":
                t = meta_to_hf_rope_rows(t, args.n_heads)
            elif meta == "attention.wk.weight":
                t = meta_to_hf_rope_rows(t, args.n_kv_heads)
            out[dst + hf] = t
        self_layer += 1
    ve = "vision_model.vision_encoder."
    out[vision + "patch_embedding.weight"] = tensors[ve + "conv1._linear.weight"].reshape(
        encoder.dim, 3, encoder.patch_size, encoder.patch_size)
    for meta, hf in _VISION_TOP.items():
        out[vision + hf] = tensors[ve + meta]
    for meta, hf in _VISION_TABLES.items():
        out[vision + hf] = _precompute(tensors[ve + meta], args.vision_max_num_chunks)
    for part, count in (("transformer", encoder.n_layers), ("global_transformer", encoder.n_global_layers)):
        for i in range(count):
            for meta, hf in _VISION_BLOCK.items():
                out[f"{vision}{part}.layers.{i}.{hf}"] = tensors[f"{ve}{part}.resblocks.{i}.{meta}"]
            if part == "global_transformer":
                for gate in ("gate_attn", "gate_ffn"):
                    out[f"{vision}{part}.layers.{i}.{gate}"] = tensors[f"{ve}{part}.resblocks.{i}.{gate}"]
    out[projector + "weight"] = tensors["vision_model.vision_projection.weight"]
    out[projector + "bias"] = tensors["vision_model.vision_projection.bias"]
    return out
