"""The tensor-parallel plan: how a model's tensors are split over model-parallel ranks.  The one
table (:data:`SHARD_AXES`), the full shape of every tensor from the model's arguments, the part
each rank holds (heads per rank included), and the process counts a model can be split over,
all derived from that table.  The model's layers, loading (:mod:`llama.checkpoint.shards`) and
the offline tools in :mod:`llama.convert` read it; nothing here touches a file.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Literal, Optional, Sequence, cast

from llama.args import ModelArgs


class Split(Enum):
    """How a tensor is divided over model-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds all of it (norm weights)
    COLUMN = "column"  # split along dim 0, the output features (ColumnParallelLinear)
    ROW = "row"  # split along dim 1, the input features (RowParallelLinear)
    KV_COLUMN = "kv_column"  # like COLUMN, in whole K/V heads; heads are copied when ranks > heads
    EMBEDDING = "embedding"  # dim 1 for Llama 2 checkpoints, dim 0 (vocab) for Llama 3
    EXPERT_IN = "expert_in"  # dim 2 of stacked experts' (E, dim, hidden) w1/w3: every expert's hidden units
    EXPERT_OUT = "expert_out"  # dim 1 of stacked experts' (E, hidden, dim) w2


# Tensor name (layer index written as "*") -> split.  The one place shard axes live.
# A layer holds the attention and norm tensors, and either the dense feed-forward
# tensors or (Llama 4's MoE layers) the mixture-of-experts ones.
SHARD_AXES: dict[str, Split] = {
    "tok_embeddings.weight": Split.EMBEDDING,
    "layers.*.attention.wq.weight": Split.COLUMN,
    "layers.*.attention.wk.weight": Split.KV_COLUMN,
    "layers.*.attention.wv.weight": Split.KV_COLUMN,
    "layers.*.attention.wo.weight": Split.ROW,
    "layers.*.feed_forward.w1.weight": Split.COLUMN,
    "layers.*.feed_forward.w3.weight": Split.COLUMN,
    "layers.*.feed_forward.w2.weight": Split.ROW,
    "layers.*.feed_forward.router_DE": Split.REPLICATED,
    "layers.*.feed_forward.experts.w1": Split.EXPERT_IN,
    "layers.*.feed_forward.experts.w3": Split.EXPERT_IN,
    "layers.*.feed_forward.experts.w2": Split.EXPERT_OUT,
    "layers.*.feed_forward.shared_expert.w1.weight": Split.COLUMN,
    "layers.*.feed_forward.shared_expert.w3.weight": Split.COLUMN,
    "layers.*.feed_forward.shared_expert.w2.weight": Split.ROW,
    "layers.*.attention_norm.weight": Split.REPLICATED,
    "layers.*.ffn_norm.weight": Split.REPLICATED,
    "norm.weight": Split.REPLICATED,
    "output.weight": Split.COLUMN,
}
# The same for Llama 4's image encoder (``params.json``'s ``vision_args``), in Meta's names and Meta's split
# (llama-models' vision/encoder.py and embedding.py: fairscale's Column/RowParallelLinear; a
# row-parallel layer's bias, added after the sum over ranks, is whole on every rank).  Block
# index written as "*".
_VE = "vision_embeddings.vision_encoder."
_VB = _VE + "transformer.resblocks.*."
VISION_SHARD_AXES: dict[str, Split] = {
    _VE + "conv1._linear.weight": Split.COLUMN,
    _VE + "class_embedding": Split.REPLICATED,
    _VE + "positional_embedding_vlm": Split.REPLICATED,
    _VE + "ln_pre.weight": Split.REPLICATED,
    _VE + "ln_pre.bias": Split.REPLICATED,
    **{_VB + f"attn.{w}.{p}": Split.COLUMN for w in ("wq", "wk", "wv") for p in ("weight", "bias")},
    _VB + "attn.wo.weight": Split.ROW,
    _VB + "attn.wo.bias": Split.REPLICATED,
    _VB + "ln_1.weight": Split.REPLICATED,
    _VB + "ln_1.bias": Split.REPLICATED,
    _VB + "mlp.c_fc.weight": Split.COLUMN,
    _VB + "mlp.c_fc.bias": Split.COLUMN,
    _VB + "mlp.c_proj.weight": Split.ROW,
    _VB + "mlp.c_proj.bias": Split.REPLICATED,
    _VB + "ln_2.weight": Split.REPLICATED,
    _VB + "ln_2.bias": Split.REPLICATED,
    _VE + "ln_post.weight": Split.REPLICATED,
    _VE + "ln_post.bias": Split.REPLICATED,
    "vision_embeddings.vision_adapter.mlp.c_fc.weight": Split.COLUMN,
    "vision_embeddings.vision_adapter.mlp.c_proj.weight": Split.ROW,
    "vision_projection.weight": Split.COLUMN,
}
# Llama 3.2 Vision (``vision_chunk_size`` > 0), in Meta's names (llama-models' ``llama3/multimodal/model.py``,
# its ``text_model.`` prefix dropped as the model holds them; fairscale's layers split as they split).
# The cross-attention layers (index "*") split as the self-attention layers do; ``learnable_embedding``,
# Meta's VocabParallelEmbedding of 8 rows, along its rows.
_XA = "cross_attention_layers.*."
CROSS_ATTENTION_SHARD_AXES: dict[str, Split] = {
    "learnable_embedding.weight": Split.COLUMN,
    _XA + "attention.wq.weight": Split.COLUMN,
    _XA + "attention.wk.weight": Split.KV_COLUMN,
    _XA + "attention.wv.weight": Split.KV_COLUMN,
    _XA + "attention.wo.weight": Split.ROW,
    _XA + "attention.q_norm.weight": Split.REPLICATED,
    _XA + "attention.k_norm.weight": Split.REPLICATED,
    _XA + "attention_norm.weight": Split.REPLICATED,
    _XA + "gate_attn": Split.REPLICATED,
    _XA + "feed_forward.w1.weight": Split.COLUMN,
    _XA + "feed_forward.w3.weight": Split.COLUMN,
    _XA + "feed_forward.w2.weight": Split.ROW,
    _XA + "ffn_norm.weight": Split.REPLICATED,
    _XA + "gate_ffwd": Split.REPLICATED,
}
# Its tiled image encoder and projection (block index "*" in both transformers): patch projection,
# q/k/v, the MLPs' first layers and the projection (bias with it) column-parallel; attention's output
# and the MLPs' second layers row-parallel (their bias whole); embeddings, norms and gates replicated.
_MV = "vision_model.vision_encoder."
_MB = {part: f"{_MV}{part}.resblocks.*." for part in ("transformer", "global_transformer")}
MLLAMA_VISION_SHARD_AXES: dict[str, Split] = {
    _MV + "conv1._linear.weight": Split.COLUMN,
    **{_MV + name: Split.REPLICATED for name in (
        "class_embedding", "positional_embedding", "gated_positional_embedding", "gated_positional_embedding_gate",
        "pre_tile_pos_embed.embedding", "pre_tile_pos_embed.gate", "ln_pre.weight", "ln_pre.bias")},
    **{block + name: split for block in _MB.values() for name, split in (
        ("attn.wq.weight", Split.COLUMN), ("attn.wk.weight", Split.COLUMN), ("attn.wv.weight", Split.COLUMN),
        ("attn.wo.weight", Split.ROW), ("ln_1.weight", Split.REPLICATED), ("ln_1.bias", Split.REPLICATED),
        ("mlp.c_fc.weight", Split.COLUMN), ("mlp.c_fc.bias", Split.COLUMN), ("mlp.c_proj.weight", Split.ROW),
        ("mlp.c_proj.bias", Split.REPLICATED), ("ln_2.weight", Split.REPLICATED), ("ln_2.bias", Split.REPLICATED))},
    _MB["global_transformer"] + "gate_attn": Split.REPLICATED,
    _MB["global_transformer"] + "gate_ffn": Split.REPLICATED,
    **{_MV + name: Split.REPLICATED for name in (
        "ln_post.weight", "ln_post.bias", "post_tile_pos_embed.embedding", "post_tile_pos_embed.gate")},
    "vision_model.vision_projection.weight": Split.COLUMN,
    "vision_model.vision_projection.bias": Split.COLUMN,
}
_DENSE_FFN_KEYS = tuple(f"layers.*.feed_forward.{w}.weight" for w in ("w1", "w3", "w2"))
_MOE_KEYS = tuple(k for k in SHARD_AXES if ".router_DE" in k or ".experts." in k or ".shared_expert." in k)
# Found in some Meta checkpoints; recomputed from params.json instead.
IGNORED_KEYS = ("rope.freqs",)
# Llama 4's image encoder and projection: a run without the encoder never reads them.
# Llama 3.2 Vision's encoder, cross-attention layers and learnt rows: a text-only run never reads them.
VISION_PREFIXES = ("vision_embeddings.", "vision_projection.", "vision_model.", "cross_attention_layers.",
                   "learnable_embedding.")

EMBEDDING_AXIS = {"dim": 1, "vocab": 0}  # by embedding layout

LAYER_INDEX = re.compile(r"^(layers|cross_attention_layers)\.\d+\.")
VISION_BLOCK_INDEX = re.compile(r"^((?:vision_embeddings\.vision_encoder\.transformer"
                                r"|vision_model\.vision_encoder\.(?:global_)?transformer)\.resblocks\.)\d+\.")


def shard_key(name: str) -> str:
    """``name`` with its layer (or vision block) index written as "*": its row of :data:`SHARD_AXES`
    (or of the vision and cross-attention tables)."""
    return VISION_BLOCK_INDEX.sub(r"\1*.", LAYER_INDEX.sub(r"\1.*.", name))


_ALL_SHARD_AXES = {**SHARD_AXES, **VISION_SHARD_AXES, **CROSS_ATTENTION_SHARD_AXES, **MLLAMA_VISION_SHARD_AXES}


def split_of(name: str) -> Split:
    key = shard_key(name)
    split = _ALL_SHARD_AXES.get(key)
    if split is None:
        raise KeyError(f"no shard axis is known for tensor {name!r}")
    return split


_SPLIT_AXIS = {Split.COLUMN: 0, Split.KV_COLUMN: 0, Split.ROW: 1, Split.EXPERT_IN: 2, Split.EXPERT_OUT: 1}


def split_axis(split: Split, embedding_layout: str) -> Optional[int]:
    if split is Split.REPLICATED:
        return None
    if split is Split.EMBEDDING:
        return EMBEDDING_AXIS[embedding_layout]
    return _SPLIT_AXIS[split]


def tensor_names(args: ModelArgs) -> list[str]:
    """Every tensor a checkpoint of this model holds, in Meta's order (the image encoder's last,
    when ``args.vision_args`` is set)."""
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        skip = _DENSE_FFN_KEYS if args.is_moe_layer(i) else _MOE_KEYS
        for key in SHARD_AXES:
            if key.startswith("layers.*.") and key not in skip:
                names.append(key.replace("*", str(i)))
    return names + ["norm.weight", "output.weight"] + vision_tensor_names(args) + cross_attention_tensor_names(args)


def cross_attention_tensor_names(args: ModelArgs) -> list[str]:
    """Llama 3.2 Vision's learnt rows, cross-attention layers, image encoder and projection (none
    for other models), in Meta's order."""
    encoder = args.mllama_vision_args
    if not args.has_cross_attention or encoder is None:
        return []
    names = ["learnable_embedding.weight"]
    for j in range(len(args.fusion_schedule())):
        names += [k.replace("*", str(j)) for k in CROSS_ATTENTION_SHARD_AXES if k.startswith(_XA)]
    blocks = {part: [k for k in MLLAMA_VISION_SHARD_AXES if k.startswith(block)] for part, block in _MB.items()}
    rest = [k for k in MLLAMA_VISION_SHARD_AXES if not any(k.startswith(block) for block in _MB.values())]
    # The encoder's own tensors up to ln_pre, its two transformers' blocks, then the rest.
    cut = rest.index(_MV + "ln_pre.bias") + 1
    names += rest[:cut]
    for part, count in (("transformer", encoder.n_layers), ("global_transformer", encoder.n_global_layers)):
        for i in range(count):
            names += [k.replace("*", str(i)) for k in blocks[part]]
    return names + rest[cut:]


def vision_tensor_names(args: ModelArgs) -> list[str]:
    """The image encoder's tensors (none without ``vision_args``), in Meta's order."""
    if args.vision_args is None:
        return []
    blocks = [k for k in VISION_SHARD_AXES if k.startswith(_VB)]
    names = [k for k in VISION_SHARD_AXES if k.startswith(_VE) and k not in blocks and "ln_post" not in k]
    for i in range(args.vision_args.n_layers):
        names += [k.replace("*", str(i)) for k in blocks]
    return names + [k for k in VISION_SHARD_AXES if "ln_post" in k or not k.startswith(_VE)]


def _vision_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The full shape of every kind of image-encoder tensor (block index "*")."""
    v = args.vision_args
    if v is None:
        return {}
    dim, hidden = v.dim, v.hidden_dim
    shapes: dict[str, tuple[int, ...]] = {
        _VE + "conv1._linear.weight": (dim, 3 * v.patch_size**2),
        _VE + "class_embedding": (dim,),
        _VE + "positional_embedding_vlm": (v.grid**2 + 1, dim),
        _VB + "attn.wo.weight": (dim, dim),
        _VB + "mlp.c_fc.weight": (hidden, dim),
        _VB + "mlp.c_fc.bias": (hidden,),
        _VB + "mlp.c_proj.weight": (dim, hidden),
        "vision_embeddings.vision_adapter.mlp.c_fc.weight": (v.output_dim, v.adapter_dim),
        "vision_embeddings.vision_adapter.mlp.c_proj.weight": (v.output_dim, v.output_dim),
        "vision_projection.weight": (args.dim, v.output_dim),
    }
    for key in VISION_SHARD_AXES:
        if key not in shapes:  # q/k/v, the norms and the remaining biases: dim wide
            shapes[key] = (dim, dim) if key.endswith(("wq.weight", "wk.weight", "wv.weight")) else (dim,)
    return shapes


def _cross_attention_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The full shape of every kind of Llama 3.2 Vision tensor (layer and block index "*")."""
    v = args.mllama_vision_args
    if not args.has_cross_attention or v is None:
        return {}
    hd, dim, hidden = args.head_dim, args.dim, args.ffn_hidden_dim
    tokens, chunks = (args.vision_chunk_size // v.patch_size) ** 2 + 1, args.vision_max_num_chunks
    shapes: dict[str, tuple[int, ...]] = {
        "learnable_embedding.weight": (8, dim),
        _XA + "attention.wq.weight": (args.n_heads * hd, dim),
        _XA + "attention.wk.weight": (args.n_kv_heads * hd, dim),
        _XA + "attention.wv.weight": (args.n_kv_heads * hd, dim),
        _XA + "attention.wo.weight": (dim, args.n_heads * hd),
        _XA + "attention.q_norm.weight": (hd,),
        _XA + "attention.k_norm.weight": (hd,),
        _XA + "feed_forward.w1.weight": (hidden, dim),
        _XA + "feed_forward.w3.weight": (hidden, dim),
        _XA + "feed_forward.w2.weight": (dim, hidden),
        _MV + "conv1._linear.weight": (v.dim, 3 * v.patch_size**2),
        _MV + "positional_embedding": (tokens, v.dim),
        _MV + "gated_positional_embedding": (chunks, chunks, tokens, v.dim),
        _MV + "pre_tile_pos_embed.embedding": (chunks, chunks, 1, v.dim),
        _MV + "post_tile_pos_embed.embedding": (chunks, chunks, 1, v.dim),
        "vision_model.vision_projection.weight": (dim, v.output_dim),
        "vision_model.vision_projection.bias": (dim,),
    }
    for key in CROSS_ATTENTION_SHARD_AXES:
        shapes.setdefault(key, (1,) if key.endswith(("gate_attn", "gate_ffwd")) else (dim,))
    for key in MLLAMA_VISION_SHARD_AXES:
        if key in shapes:
            continue
        if key.endswith(("gate", "gate_attn", "gate_ffn")):
            shapes[key] = (1,)
        elif key.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight")):
            shapes[key] = (v.dim, v.dim)
        elif key.endswith("c_fc.weight"):
            shapes[key] = (v.hidden_dim, v.dim)
        elif key.endswith("c_fc.bias"):
            shapes[key] = (v.hidden_dim,)
        elif key.endswith("c_proj.weight"):
            shapes[key] = (v.dim, v.hidden_dim)
        else:  # class embedding, norms, the second MLP layers' bias
            shapes[key] = (v.dim,)
    return shapes


def full_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The unsplit ("logical") shape of every tensor, from ``params.json``."""
    hd, dim, hidden = args.head_dim, args.dim, args.ffn_hidden_dim
    per_key = {
        "tok_embeddings.weight": (args.vocab_size, dim),
        "layers.*.attention.wq.weight": (args.n_heads * hd, dim),
        "layers.*.attention.wk.weight": (args.n_kv_heads * hd, dim),
        "layers.*.attention.wv.weight": (args.n_kv_heads * hd, dim),
        "layers.*.attention.wo.weight": (dim, args.n_heads * hd),
        "layers.*.feed_forward.w1.weight": (hidden, dim),
        "layers.*.feed_forward.w3.weight": (hidden, dim),
        "layers.*.feed_forward.w2.weight": (dim, hidden),
        "layers.*.attention_norm.weight": (dim,),
        "layers.*.ffn_norm.weight": (dim,),
        "norm.weight": (dim,),
        "output.weight": (args.vocab_size, dim),
    }
    if args.moe_args is not None:
        n_experts, expert_hidden = args.moe_args.num_experts, args.moe_hidden_dim
        per_key.update({
            "layers.*.feed_forward.router_DE": (dim, n_experts),
            "layers.*.feed_forward.experts.w1": (n_experts, dim, expert_hidden),
            "layers.*.feed_forward.experts.w3": (n_experts, dim, expert_hidden),
            "layers.*.feed_forward.experts.w2": (n_experts, expert_hidden, dim),
            "layers.*.feed_forward.shared_expert.w1.weight": (expert_hidden, dim),
            "layers.*.feed_forward.shared_expert.w3.weight": (expert_hidden, dim),
            "layers.*.feed_forward.shared_expert.w2.weight": (dim, expert_hidden),
        })
    per_key.update(_vision_shapes(args))
    per_key.update(_cross_attention_shapes(args))
    return {name: per_key[shard_key(name)] for name in tensor_names(args)}


def is_vision_tensor(name: str) -> bool:
    """A tensor of an image encoder (Llama 4's; Llama 3.2 Vision's, its cross-attention layers and
    learnt rows too): skipped when the model is built without its encoder."""
    return name.startswith(VISION_PREFIXES)


# Query heads are never cut: wq's rows and wo's columns are split in whole heads, like K/V's.
_IN_WHOLE_HEADS = {f"{layers}.*.attention.{w}.weight" for layers in ("layers", "cross_attention_layers")
                   for w in ("wq", "wk", "wv", "wo")}


def split_unit(name: str, head_dim: int) -> int:
    """The smallest piece of ``name`` a rank holds along its split axis: a head of attention's
    projections, else one row or column."""
    return head_dim if LAYER_INDEX.sub(r"\1.*.", name) in _IN_WHOLE_HEADS else 1


def rank_range(split: Split, full_len: int, world_size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """The [start, end) a rank holds along the split axis of a tensor ``full_len`` long,
    split in pieces of ``unit`` (see :func:`split_unit`); ValueError where the pieces do not
    divide evenly over ``world_size`` ranks.

    With more ranks than K/V heads, consecutive ranks hold copies of the same K/V head.
    """
    n_units = full_len // unit
    if world_size <= n_units:
        if n_units % world_size:
            raise ValueError(f"{n_units} {'heads' if unit > 1 else 'rows'} cannot be split evenly over "
                             f"{world_size} ranks")
        per_rank = n_units // world_size
        return rank * per_rank * unit, (rank + 1) * per_rank * unit
    if split is not Split.KV_COLUMN or world_size % n_units:
        raise ValueError(f"{n_units} {'heads' if unit > 1 else 'rows'} cannot be split evenly over {world_size} ranks")
    start = (rank * n_units) // world_size * unit
    return start, start + unit


def shard_shape(
    name: str, full_shape: tuple[int, ...], n_shards: int, shard: int, embedding_layout: str, head_dim: int
) -> tuple[int, ...]:
    """Shape of ``name`` in shard ``shard`` of a checkpoint saved with ``n_shards`` ranks."""
    region = holder_region(name, full_shape, n_shards, shard, embedding_layout, head_dim)
    return tuple(end - start for start, end in region)


def _shapes_by_key(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """One full tensor of every kind this model has (layer index as written in its first layer)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in full_shapes(args).items():
        shapes.setdefault(shard_key(name), shape)
    return shapes


def splits_over(args: ModelArgs, world_size: int, embedding_layout: str) -> bool:
    """Whether every tensor of this model divides evenly over ``world_size`` ranks, by
    :data:`SHARD_AXES` (the embedding split as ``embedding_layout`` says), the image encoder's
    attention heads whole."""
    return _splits_over(args, _shapes_by_key(args), world_size, embedding_layout)


def _splits_over(args: ModelArgs, shapes: dict[str, tuple[int, ...]], world_size: int, embedding_layout: str) -> bool:
    """:func:`splits_over` given the model's :func:`_shapes_by_key` (computed once by callers that
    try many process counts: listing every tensor name is the costly part)."""
    if args.vision_args is not None and args.vision_args.n_heads % world_size:
        return False
    if args.mllama_vision_args is not None and args.mllama_vision_args.n_heads % world_size:
        return False
    try:
        for key, shape in shapes.items():
            holder_region(key, shape, world_size, 0, embedding_layout, args.head_dim)
    except ValueError:
        return False
    return True


def valid_model_parallel_sizes(args: ModelArgs, embedding_layouts: Sequence[str] = ("vocab", "dim")) -> list[int]:
    """Process counts this model can be split over: those over which every tensor divides
    (:func:`splits_over`; query heads, the text model's and the image encoder's, are never cut,
    so at most n_heads)."""
    shapes = _shapes_by_key(args)
    return [m for m in range(1, args.n_heads + 1)
            if any(_splits_over(args, shapes, m, layout) for layout in embedding_layouts)]


def heads_per_rank(args: ModelArgs, world_size: int) -> tuple[int, int, int]:
    """(query heads a rank holds, K/V heads it holds, copies of each K/V head over all ranks),
    from how wq and wk split (:func:`rank_range`).  With more ranks than K/V heads each K/V
    head is copied so that every rank holds one whole head (8 K/V heads on 16 ranks: 2
    copies each).  ValueError where the heads do not divide over ``world_size``."""
    hd = args.head_dim
    try:
        q_start, q_end = rank_range(Split.COLUMN, args.n_heads * hd, world_size, 0, hd)
        kv_start, kv_end = rank_range(Split.KV_COLUMN, args.n_kv_heads * hd, world_size, 0, hd)
    except ValueError:
        raise ValueError(f"n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads} cannot be split over {world_size} "
                         f"model-parallel processes: sizes that work: {valid_model_parallel_sizes(args)}") from None
    q_heads, kv_heads = (q_end - q_start) // hd, (kv_end - kv_start) // hd
    return q_heads, kv_heads, world_size * kv_heads // args.n_kv_heads


def choose_embedding_layout(checkpoint_layout: Optional[str], args: ModelArgs,
                            world_size: int) -> Literal["dim", "vocab"]:
    """Keep the checkpoint's embedding split; for an unsplit one, split the vocabulary when it divides."""
    if checkpoint_layout is not None:
        size = args.dim if checkpoint_layout == "dim" else args.vocab_size
        if size % world_size == 0:
            return cast(Literal["dim", "vocab"], checkpoint_layout)  # detect_embedding_layout's: one of the two
    return "vocab" if args.vocab_size % world_size == 0 else "dim"


Region = tuple[tuple[int, int], ...]  # [start, end) along every axis


def holder_region(
    name: str, full_shape: tuple[int, ...], world_size: int, rank: int, embedding_layout: str, head_dim: int
) -> Region:
    """The part of the full tensor ``name`` that rank ``rank`` of ``world_size`` holds."""
    region = [(0, n) for n in full_shape]
    split = split_of(name)
    axis = split_axis(split, embedding_layout)
    if axis is not None:
        region[axis] = rank_range(split, full_shape[axis], world_size, rank, split_unit(name, head_dim))
    return tuple(region)
