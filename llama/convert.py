"""Offline checkpoint tools: Hugging Face <-> Meta conversion, and resharding.

Run as ``python -m llama.convert COMMAND ...``::

    python -m llama.convert hf_to_meta HF_DIR META_DIR [--model_parallel_size N]
    python -m llama.convert meta_to_hf META_DIR HF_DIR [--max_position_embeddings L] [--max_shard_size_gb G]
    python -m llama.convert reshard META_DIR OUT_DIR --model_parallel_size N

Every split of a tensor over shards comes from :data:`llama.checkpoint.SHARD_AXES`
(through :func:`~llama.checkpoint.holder_region` / :func:`~llama.checkpoint.shard_shape`),
the table :meth:`llama.Llama.build` uses to reshard at load time, so a checkpoint
written here is laid out exactly as the loader expects.

Two conventions differ between the formats besides tensor names:

* RoPE pairs.  Meta rotates interleaved pairs of a head's dimensions, (0, 1), (2, 3), ...
  Hugging Face rotates dimension k together with k + head_dim/2 ("rotate half"), so its
  q/k projection rows are stored permuted within each head.  Converting reorders those
  rows; K uses ``n_kv_heads`` (grouped-query attention), Q uses ``n_heads``.
* The SwiGLU width.  HF states ``intermediate_size``; Meta derives it from ``dim``,
  ``multiple_of`` and ``ffn_dim_multiplier`` (:attr:`llama.args.ModelArgs.ffn_hidden_dim`),
  so ``hf_to_meta`` searches for a pair that reproduces it exactly.

Llama 4 (``Llama4ForCausalLM``, or the language model of a multimodal
``Llama4ForConditionalGeneration`` repository, whose vision tensors are skipped) differs
again: its q/k rows are *not* permuted (HF's Llama 4 rotates interleaved pairs, as Meta
does); the router is stored transposed; the experts' w1 and w3 are one ``gate_up_proj``
(E, dim, 2*hidden); the dense width is ``intermediate_size_mlp`` and the experts'
``intermediate_size`` (reproduced through ``ffn_exp``).
"""

from __future__ import annotations

if __name__ == "__main__":  # the command line: parsed (and --help answered) before torch is imported
    from llama.convert_cli import main as _main

    raise SystemExit(_main())

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from .args import ModelArgs, read_json_object
from .checkpoint import (
    CheckpointError,
    choose_embedding_layout,
    find_shards,
    full_shapes,
    holder_region,
    inspect_checkpoint,
    load_full_tensors,
    load_rank_state_dict,
    open_shard,
    shard_shape,
    tensor_names,
    valid_model_parallel_sizes,
)

logger = logging.getLogger(__name__)

__all__ = [
    "hf_to_meta",
    "meta_to_hf",
    "reshard",
    "hf_config_to_params",
    "params_to_hf_config",
    "llama4_config_to_params",
    "llama4_params_to_hf_config",
    "ffn_params_for",
    "hf_to_meta_rope_rows",
    "meta_to_hf_rope_rows",
]

PathLike = Union[str, Path]

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
# Where a multimodal Llama4ForConditionalGeneration repository keeps the language model
# (as published, and as transformers 5 saves it), and the prefix of its vision tensors.
_LLAMA4_TEXT_PREFIXES = (("model.", "lm_head."), ("language_model.model.", "language_model.lm_head."),
                         ("model.language_model.", "lm_head."))
_LLAMA4_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
                           "model.multi_modal_projector.")

# Tensors whose rows are RoPE-permuted in HF, with the ModelArgs field giving their head count.
_ROPE_PERMUTED = {"layers.*.attention.wq.weight": "n_heads", "layers.*.attention.wk.weight": "n_kv_heads"}
# Buffers some older HF saves carry; recomputed from the config.
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# transformers' rope_type names this library can run.
_ROPE_DEFAULT, _ROPE_LLAMA3 = "default", "llama3"

DEFAULT_MAX_SHARD_SIZE_GB = 5.0
_MULTIPLE_OF_CANDIDATES = (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
_MULTIPLIERS_PER_DECIMALS = 50  # extra ffn_dim_multiplier candidates tried per multiple_of and number of decimals


def _pattern(name: str) -> tuple[str, Optional[str]]:
    """("layers.*.attention.wq.weight", "3") for "layers.3.attention.wq.weight"."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(["layers", "*", *parts[2:]]), parts[1]
    return name, None


def hf_name(meta_name: str, llama4: bool = False) -> str:
    """The HF LlamaForCausalLM (or, with ``llama4``, Llama4ForCausalLM) name of a Meta tensor name."""
    key, layer = _pattern(meta_name)
    hf = (LLAMA4_META_TO_HF_NAMES if llama4 else META_TO_HF_NAMES)[key]
    return hf.replace("*", layer) if layer is not None else hf


# -- the RoPE row permutation ----------------------------------------------------------


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


# -- configuration -----------------------------------------------------------------------


def _ffn_candidates(args: ModelArgs, intermediate_size: int) -> Iterator[tuple[int, Optional[float]]]:
    """Every (multiple_of, ffn_dim_multiplier) tried for which Meta's dense rule gives
    ``intermediate_size``, most preferred first: no multiplier (large ``multiple_of``
    first), then the ratio rounded to 1..6 decimals, then other multipliers of 1..4
    decimals that land on the same width (nearest the ratio first, at most
    ``_MULTIPLIERS_PER_DECIMALS`` each): those matter when the multiplier must also give
    Llama 4's expert width.  Every pair yielded is checked with ``ModelArgs.ffn_hidden_dim``."""
    base = int(2 * (4 * args.dim) / 3)  # Meta's width before the multiplier

    def width(multiple_of: int, multiplier: Optional[float]) -> int:
        return dataclasses.replace(args, multiple_of=multiple_of, ffn_dim_multiplier=multiplier).ffn_hidden_dim

    multiples = [m for m in _MULTIPLE_OF_CANDIDATES if intermediate_size % m == 0]
    for m in multiples:
        if width(m, None) == intermediate_size:
            yield m, None
    if base <= 0:
        return
    ratio = intermediate_size / base
    rounded = list(dict.fromkeys([round(ratio, d) for d in range(1, 7)] + [(intermediate_size + 0.5) / base]))
    for m in multiples:
        for k in rounded:
            if k > 0 and width(m, k) == intermediate_size:
                yield m, k
    for m in multiples:
        # int(k * base) must fall in (intermediate_size - m, intermediate_size] to round up to it.
        lo, hi = (intermediate_size - m + 1) / base, (intermediate_size + 1) / base
        seen = set(rounded)
        for decimals in range(1, 5):
            scale = 10**decimals
            first, last = max(math.ceil(lo * scale), 1), math.floor(hi * scale)
            center = min(max(round(ratio * scale), first), last)
            reach = _MULTIPLIERS_PER_DECIMALS
            around = range(max(first, center - reach), min(last, center + reach) + 1)
            nearest = sorted(around, key=lambda i: abs(i - ratio * scale))[:_MULTIPLIERS_PER_DECIMALS]
            for i in nearest:
                k = round(i / scale, decimals)
                if k not in seen:
                    seen.add(k)
                    if width(m, k) == intermediate_size:
                        yield m, k


def ffn_params_for(args: ModelArgs, intermediate_size: int) -> tuple[int, Optional[float]]:
    """A (multiple_of, ffn_dim_multiplier) for which Meta's rule gives ``intermediate_size``.

    The pair is not unique; the search prefers no multiplier, then large ``multiple_of``
    values (powers of two up to 1024 that divide the size), then multipliers with few
    decimals (1.3 rather than 1.3125...).  Only the resulting width matters to the model.
    """
    if isinstance(intermediate_size, bool) or not isinstance(intermediate_size, int) or intermediate_size <= 0:
        raise ValueError(f"intermediate_size must be a positive integer, got {intermediate_size!r}")
    for pair in _ffn_candidates(args, intermediate_size):
        return pair
    raise ValueError(
        f"no (multiple_of, ffn_dim_multiplier) makes Meta's feed-forward rule give intermediate_size="
        f"{intermediate_size} for dim={args.dim}; this model cannot be written as a Meta checkpoint"
    )


def _rope_settings(config: dict) -> dict:
    """The RoPE dict of an HF config, transformers 5 (``rope_parameters``) or older
    (top-level ``rope_theta`` plus ``rope_scaling``)."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type")) or _ROPE_DEFAULT
    return rope


def _scaled_rope_params(rope: dict) -> dict:
    """params.json's scaled-RoPE keys for an HF RoPE dict (see :func:`_rope_settings`):
    Llama 3.1-style scaling, or none."""
    if rope["rope_type"] == _ROPE_LLAMA3:
        return dict(
            use_scaled_rope=True,
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_context_len=int(rope.get("original_max_position_embeddings", 8192)),
        )
    if rope["rope_type"] != _ROPE_DEFAULT:
        raise ValueError(
            f"config.json uses RoPE type {rope['rope_type']!r}; only 'default' and 'llama3' scaling are supported"
        )
    return {}


def _llama4_text_config(config: dict) -> Optional[dict]:
    """The text model's config of a Llama 4 ``config.json`` (Llama4ForCausalLM, or the
    ``text_config`` of a multimodal Llama4ForConditionalGeneration); None for other models."""
    if config.get("model_type") == "llama4_text":
        return config
    if config.get("model_type") == "llama4":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("config.json (model_type 'llama4') has no text_config object")
        return text
    return None


def _expert_ffn_exp(args: ModelArgs, expert_size: int) -> Optional[tuple[float, bool]]:
    """An (ffn_exp, auto_scale_F) for which Meta's expert-width rule gives ``expert_size``
    with ``args``' multiple_of and ffn_dim_multiplier; None when there is none up to
    ffn_exp 64.  Preferred: Meta's own auto_scale_F (True), and ffn_exp in quarters (as
    Meta's are), smallest first; else any ffn_exp, as (j + 0.5) / dim for the integer
    j = int(ffn_exp * dim) the rule takes.  The width never decreases as ffn_exp grows, so
    each search is a binary search."""
    moe, dim = args.moe_args, args.dim

    def width(exp: float, auto: bool) -> int:
        trial = dataclasses.replace(args, ffn_exp=exp, moe_args=dataclasses.replace(moe, auto_scale_F=auto))
        return trial.moe_hidden_dim

    def smallest(steps: int, exp_of: Callable[[int], float], auto: bool) -> Optional[float]:
        lo, hi = 1, steps
        if width(exp_of(hi), auto) < expert_size:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if width(exp_of(mid), auto) >= expert_size:
                hi = mid
            else:
                lo = mid + 1
        return exp_of(lo) if width(exp_of(lo), auto) == expert_size else None

    for steps, exp_of in ((256, lambda q: q / 4), (64 * dim, lambda j: (j + 0.5) / dim)):
        for auto in (True, False):
            exp = smallest(steps, exp_of, auto)
            if exp is not None:
                return exp, auto
    return None


def llama4_config_to_params(config: dict) -> dict:
    """Meta ``params.json`` contents for a Llama 4 text config (a ``Llama4TextConfig`` dict)."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "intermediate_size_mlp", "vocab_size", "num_local_experts") if k not in config]
    if missing:
        raise ValueError(f"config.json (Llama 4 text config) lacks {missing}")
    if config.get("attention_bias"):
        raise ValueError("config.json sets attention_bias=true; Meta's Llama 4 layout has no bias terms")
    n_layers = config["num_hidden_layers"]
    step = config.get("interleave_moe_layer_step", 1)
    nope = config.get("no_rope_layer_interval", 4)
    # Both lists are compared item by item, never expanded to n_layers entries: a hostile
    # num_hidden_layers (10**9) is refused later against the weights, not by exhausting memory here.
    moe_layers = config.get("moe_layers")
    if moe_layers is not None:
        ok = isinstance(step, int) and step > 0 and isinstance(n_layers, int)
        want = range(step - 1, n_layers, step) if ok else range(0)
        if not ok or len(moe_layers) != len(want) or any(a != b for a, b in zip(moe_layers, want)):
            raise ValueError(
                f"config.json's moe_layers {moe_layers} are not every {step}-th layer, as Meta's layout needs"
            )
    no_rope = config.get("no_rope_layers")
    if no_rope and isinstance(n_layers, int) and isinstance(nope, int) and nope > 0 and (
        len(no_rope) < n_layers or any(int(x) != int((i + 1) % nope != 0) for i, x in enumerate(no_rope[:n_layers]))
    ):
        raise ValueError(f"config.json's no_rope_layers are not every {nope}-th layer, as Meta's layout needs")
    rope = _rope_settings(config)
    params: dict[str, Any] = {
        "dim": config["hidden_size"],
        "n_layers": n_layers,
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": float(rope["rope_theta"]),
        "moe_args": {"num_experts": config["num_local_experts"], "capacity_factor": 1.0,
                     "top_k": config.get("num_experts_per_tok", 1), "interleave_moe_layer_step": step},
        "attention_chunk_size": config.get("attention_chunk_size"),
        "nope_layer_interval": nope,
        "use_qk_norm": bool(config.get("use_qk_norm", True)),
        "attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True)),
        "floor_scale": config.get("floor_scale", 8192),
        "attn_scale": config.get("attn_scale", 0.1),
    }
    if config.get("head_dim") is not None and config["head_dim"] != params["dim"] // params["n_heads"]:
        params["head_dim"] = config["head_dim"]
    params.update(_scaled_rope_params(rope))
    args = ModelArgs.from_dict({**params, "multiple_of": 256, "ffn_exp": 4.0})
    multiple_of, multiplier, ffn_exp, auto_scale = _llama4_ffn_params(
        args, config["intermediate_size_mlp"], config["intermediate_size"])
    params["multiple_of"] = multiple_of
    if multiplier is not None:
        params["ffn_dim_multiplier"] = multiplier
    params["ffn_exp"], params["moe_args"]["auto_scale_F"] = ffn_exp, auto_scale
    return params


def _llama4_ffn_params(
    args: ModelArgs, dense_size: object, expert_size: object
) -> tuple[int, Optional[float], float, bool]:
    """params.json's (multiple_of, ffn_dim_multiplier, ffn_exp, moe_args.auto_scale_F) for
    which Meta's rules give both the dense width (``intermediate_size_mlp``) and the
    experts' (``intermediate_size``).  The two share multiple_of and the multiplier, so
    they are chosen together: each (multiple_of, multiplier) that gives the dense width,
    most preferred first (see :func:`_ffn_candidates`), is kept if some ffn_exp then
    gives the experts' width too."""
    for name, size in (("intermediate_size_mlp", dense_size), ("intermediate_size", expert_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"config.json's {name} must be a positive integer, got {size!r}")
    for multiple_of, multiplier in _ffn_candidates(args, dense_size):
        if expert_size % multiple_of:  # Meta's expert width is a multiple of multiple_of
            continue
        trial = dataclasses.replace(args, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        found = _expert_ffn_exp(trial, expert_size)
        if found is not None:
            return (multiple_of, multiplier, *found)
    raise ValueError(
        f"no Meta parameters (multiple_of, ffn_dim_multiplier, ffn_exp) give both intermediate_size_mlp="
        f"{dense_size} (dense layers) and intermediate_size={expert_size} (experts) for hidden_size={args.dim} "
        "(ffn_exp searched up to 64): this model cannot be written as a Meta checkpoint"
    )


def hf_config_to_params(config: dict) -> dict:
    """Meta ``params.json`` contents for an HF Llama ``config.json`` (as a dict).

    Raises ``ValueError`` for configs this library cannot run (not Llama, biases,
    another activation, an unsupported RoPE variant, a head_dim other than dim/n_heads).
    """
    text = _llama4_text_config(config)
    if text is not None:
        return llama4_config_to_params(text)
    model_type = config.get("model_type")
    if model_type != "llama":
        raise ValueError(
            f"config.json has model_type={model_type!r}; supported: 'llama' (LlamaForCausalLM), 'llama4_text' "
            "(Llama4ForCausalLM) and 'llama4' (the text model of Llama4ForConditionalGeneration)"
        )
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"config.json sets {key}=true; Meta's Llama layout has no bias terms")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json has hidden_act={config['hidden_act']!r}; Llama's SwiGLU uses 'silu'")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and n_heads and head_dim * n_heads != dim:
        raise ValueError(
            f"config.json has head_dim={head_dim} but hidden_size/num_attention_heads={dim}/{n_heads}; "
            "Meta's layout needs head_dim == hidden_size // num_attention_heads"
        )
    rope = _rope_settings(config)
    params: dict[str, Any] = {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads") or n_heads,
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope["rope_theta"]),
    }
    params.update(_scaled_rope_params(rope))
    args = ModelArgs.from_dict({**params, "multiple_of": 256})  # validates the shape fields
    multiple_of, multiplier = ffn_params_for(args, config["intermediate_size"])
    params["multiple_of"] = multiple_of
    if multiplier is not None:
        params["ffn_dim_multiplier"] = multiplier
    return params


def _default_max_position_embeddings(args: ModelArgs) -> int:
    # Not stored in params.json.  These are the published context lengths:
    # Llama 3.1+ (scaled RoPE) 131072, Llama 3 (theta 5e5) 8192, Llama 2 4096.
    if args.use_scaled_rope:
        return 131072
    return 8192 if args.rope_theta >= 500000 else 4096


def params_to_hf_config(
    args: ModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: Optional[int] = None,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
) -> dict:
    """An HF ``config.json`` (as a dict) for a model of shape ``args`` (vocab_size resolved).

    RoPE settings are written both ways: ``rope_parameters`` (transformers 5) and
    top-level ``rope_theta`` + ``rope_scaling`` (transformers 4).
    """
    if max_position_embeddings is None:
        max_position_embeddings = _default_max_position_embeddings(args)
    rope_scaling = None
    rope_parameters: dict[str, Any] = {"rope_type": _ROPE_DEFAULT, "rope_theta": float(args.rope_theta)}
    if args.use_scaled_rope:
        rope_scaling = {
            "rope_type": _ROPE_LLAMA3,
            "factor": float(args.rope_scaling_factor),
            "low_freq_factor": float(args.rope_low_freq_factor),
            "high_freq_factor": float(args.rope_high_freq_factor),
            "original_max_position_embeddings": int(args.rope_original_context_len),
        }
        rope_parameters = {**rope_scaling, "rope_theta": float(args.rope_theta)}
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": int(max_position_embeddings),
        "rope_theta": float(args.rope_theta),
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }


def llama4_params_to_hf_config(
    args: ModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: Optional[int] = None,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
) -> dict:
    """A ``Llama4ForCausalLM`` ``config.json`` (as a dict) for a Llama 4 model of shape ``args``."""
    config = params_to_hf_config(args, dtype, max_position_embeddings or 262144, bos_token_id, eos_token_id)
    for key in ("mlp_bias",):
        config.pop(key)
    moe = args.moe_args
    n = args.n_layers
    nope = args.nope_layer_interval if args.nope_layer_interval is not None else n + 1
    config.update(
        architectures=["Llama4ForCausalLM"],
        model_type="llama4_text",
        intermediate_size=args.moe_hidden_dim,
        intermediate_size_mlp=args.ffn_hidden_dim,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        interleave_moe_layer_step=moe.interleave_moe_layer_step,
        moe_layers=[i for i in range(n) if args.is_moe_layer(i)],
        no_rope_layer_interval=nope,
        no_rope_layers=[int(not args.is_nope_layer(i)) for i in range(n)],
        attention_chunk_size=args.attention_chunk_size,
        use_qk_norm=args.use_qk_norm,
        attn_temperature_tuning=args.attn_temperature_tuning,
        floor_scale=args.floor_scale,
        attn_scale=args.attn_scale,
    )
    return config


# -- files -------------------------------------------------------------------------------


def _source_dir(src: PathLike) -> Path:
    src = Path(str(src))
    if not src.is_dir():
        raise FileNotFoundError(f"source directory not found: {src}")
    return src


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_destination(dst: PathLike, src: Path) -> Path:
    """``dst`` as a Path, refused unless it is absent or an empty directory, and neither the
    source, nor inside it, nor around it.

    The rule: a conversion never writes into a directory that already holds something,
    so it can neither overwrite a file there (a ``tokenizer.model``) nor leave stale files
    (old shards, Hugging Face files) beside the new ones.
    """
    if not isinstance(dst, (str, os.PathLike)) or not str(dst):
        raise TypeError(f"the destination must be a directory path, got {dst!r}")
    dst = Path(dst)
    real_src, real_dst = src.resolve(), dst.resolve()  # links followed: where the files really go
    if real_dst == real_src:
        raise ValueError(f"destination {dst} is the source directory; write to a new directory")
    if real_src in real_dst.parents:
        raise ValueError(
            f"destination {dst} is inside the source directory {src}; write to a directory outside it "
            "(the output would be mixed into the checkpoint it is read from)"
        )
    if real_dst in real_src.parents:
        raise ValueError(f"the source directory {src} is inside the destination {dst}; write to a directory outside it")
    if dst.is_dir():
        existing = sorted(p.name for p in dst.iterdir())
        if existing:
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            raise FileExistsError(
                f"destination {dst} already holds files ({shown}); write to a new or empty directory "
                "(a conversion never mixes its files with files already there)"
            )
    elif dst.exists() or dst.is_symlink():
        raise FileExistsError(f"destination {dst} exists and is not a directory")
    return dst


def _writes_directory(command: Callable[..., None]) -> Callable[..., None]:
    """Run ``command(src, dst, ...)`` so that ``dst`` appears complete or not at all.

    The command writes into a fresh staging directory beside ``dst``
    (``.NAME.partial-XXXX``), which is renamed to ``dst`` once everything is written.
    If the command fails for any reason (a bad argument, a bad tensor, a full disk,
    Ctrl-C), the staging directory and any parent directories made for it are removed,
    so nothing half-written is left and the next run is not refused.  Only a killed
    process (SIGKILL, power loss) can leave a ``.NAME.partial-XXXX`` directory behind;
    it is never read, and is named in a warning on the next run.  Files and directories
    get the permissions ``open``/``mkdir`` would give them under the current umask.
    """

    @functools.wraps(command)
    def run(src: PathLike, dst: PathLike, *args: Any, **kwargs: Any) -> None:
        src = _source_dir(src)
        final = _check_destination(dst, src)
        parent = final.absolute().parent
        made = [p for p in [parent, *parent.parents] if not p.exists()]
        parent.mkdir(parents=True, exist_ok=True)
        leftovers = sorted(parent.glob(f".{final.name}.partial-*"))
        if leftovers:
            logger.warning("%s holds unfinished output of an earlier killed run, safe to delete: %s",
                           parent, ", ".join(p.name for p in leftovers))
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=parent))
        try:
            mask = _umask()
            command(src, staging, *args, **kwargs)
            # Some writers make private files (safetensors writes 0600, mkdtemp 0700):
            # give everything the mode a plain open()/mkdir() would.
            for path in staging.rglob("*"):
                os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
            os.chmod(staging, 0o777 & ~mask)
            os.replace(staging, final)  # atomic; replaces only an empty directory
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            for p in made:  # innermost first
                try:
                    p.rmdir()
                except OSError:
                    break
            raise
        logger.info("wrote %s", final)

    return run


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _copy_tokenizer(candidates: Iterable[Path], dst: Path) -> Optional[Path]:
    for path in candidates:
        if path.exists() and not path.is_file():
            raise ValueError(f"{path} is not a regular file (a directory, FIFO or device?); a tokenizer.model is one")
        if path.is_file():
            shutil.copyfile(path, dst / "tokenizer.model")
            logger.info("copied %s to %s", path, dst / "tokenizer.model")
            return path
    logger.warning("no tokenizer.model found beside the weights; %s has none (Llama.build needs one)", dst)
    return None


def _read_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None (with a warning) when it has no tokenizer.model."""
    if not path.exists():  # one that is not a regular file is refused by load_tokenizer
        logger.warning("%s has no tokenizer.model: the output will have no tokenizer files", path.parent)
        return None
    from .tokenizer import load_tokenizer

    return load_tokenizer(path)


def _check_model_parallel_size(n: object, args: ModelArgs) -> int:
    _positive_int("model_parallel_size", n)
    sizes = valid_model_parallel_sizes(args)
    if n not in sizes:
        raise ValueError(f"this model cannot be split into {n} shards; model-parallel sizes that work: {sizes}")
    return n


def _slice(t: torch.Tensor, region) -> torch.Tensor:
    """The ``region`` of ``t`` as its own tensor (torch.save of a view would save the whole storage)."""
    return t[tuple(slice(start, end) for start, end in region)].clone()


@contextlib.contextmanager
def _safetensors_file(path: Path) -> Iterator[Any]:
    """``safe_open(path)``, with a path that is not a regular file (a FIFO would block
    forever) and a damaged or truncated file refused by a :class:`CheckpointError` naming
    it, instead of safetensors' bare ``SafetensorError``."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(
            f"{path} is not a regular file (a directory, FIFO or device?); safetensors weights are one"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(
            f"cannot read {path}: its safetensors header or data is damaged or the file is truncated ({e}); "
            "download it again"
        ) from None


class _HFWeights:
    """Lazy access to an HF checkpoint's tensors by name, one tensor in memory at a time."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.location: dict[str, Path] = {}
        self._bin_states: dict[Path, dict[str, torch.Tensor]] = {}
        st_index = src / "model.safetensors.index.json"
        bin_index = src / "pytorch_model.bin.index.json"
        if st_index.exists():  # one that is not a regular file is refused by read_json_object
            self._read_index(st_index)
            self.kind = "safetensors"
        elif list(src.glob("*.safetensors")):
            self.kind = "safetensors"
            for path in sorted(src.glob("*.safetensors")):
                with _safetensors_file(path) as f:
                    for name in f.keys():
                        self.location[name] = path
        elif bin_index.exists():
            self._read_index(bin_index)
            self.kind = "bin"
        elif list(src.glob("pytorch_model*.bin")):
            self.kind = "bin"
            for path in sorted(src.glob("pytorch_model*.bin")):
                for name in self._bin_state(path):
                    self.location[name] = path
        else:
            raise FileNotFoundError(
                f"no weights in {src}: expected model.safetensors, model-*.safetensors with "
                "model.safetensors.index.json, or pytorch_model*.bin"
            )

    def _read_index(self, index: Path) -> None:
        weight_map = read_json_object(index, "beside the weights it lists", "tensor locations").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} is not a valid weight index (no 'weight_map' from tensor names to files)")
        for name, file in weight_map.items():
            path = self.src / file
            if not path.exists():  # one that is not a regular file is refused when opened
                raise FileNotFoundError(f"{index} lists {file} for {name!r}, but {path} does not exist")
            self.location[name] = path

    def _bin_state(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._bin_states:
            self._bin_states[path] = open_shard(path)  # mmap + weights_only: nothing read yet, no code run
        return self._bin_states[path]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (in the location table), from the file's header only."""
        path = self.location[name]
        if self.kind == "bin":
            state = self._bin_state(path)
            if name not in state:
                raise CheckpointError(f"{path} has no tensor {name!r}, though its weight index lists it there")
            return tuple(state[name].shape)
        with _safetensors_file(path) as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise CheckpointError(f"{self.src} has no tensor {name!r}: is it a LlamaForCausalLM checkpoint?")
        path = self.location[name]
        if self.kind == "bin":
            return self._bin_state(path)[name]
        with _safetensors_file(path) as f:
            return f.get_tensor(name)


def _llama4_prefixes(weights: _HFWeights) -> tuple[str, str]:
    """(prefix of the text model's body, prefix of its lm_head) in a Llama 4 repository."""
    for body, head in _LLAMA4_TEXT_PREFIXES:
        if body + "embed_tokens.weight" in weights.location:
            return body, head
    raise CheckpointError(f"{weights.src} has no Llama 4 text model (no '*embed_tokens.weight' tensor)")


def _hf_source_name(name: str, args: ModelArgs, prefixes: tuple[str, str]) -> str:
    """The HF tensor holding Meta's ``name`` (a Llama 4 repository's own prefixes applied)."""
    if not args.is_llama4:
        return hf_name(name)
    hf = hf_name(name, llama4=True)
    body, head = prefixes
    return head + hf[len("lm_head."):] if hf.startswith("lm_head.") else body + hf[len("model."):]


def _from_hf_tensor(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Meta's tensor ``name`` from the HF tensor that holds it (RoPE rows, router, experts)."""
    key = _pattern(name)[0]
    heads_field = _ROPE_PERMUTED.get(key)
    if heads_field is not None and not args.is_llama4:
        return hf_to_meta_rope_rows(t, getattr(args, heads_field))
    if key.endswith("router_DE"):
        return t.t()
    if key.endswith(("experts.w1", "experts.w3")):  # gate_up_proj (E, dim, 2*hidden): w1 | w3
        half = t.shape[-1] // 2
        return t[..., :half] if key.endswith("w1") else t[..., half:]
    return t


def _hf_shape(name: str, args: ModelArgs, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the HF tensor holding Meta's ``name`` of ``shape``."""
    key = _pattern(name)[0]
    if args.is_llama4 and key.endswith("router_DE"):
        return shape[::-1]
    if args.is_llama4 and key.endswith(("experts.w1", "experts.w3")):
        return shape[:-1] + (2 * shape[-1],)
    return shape


def _meta_tensor_reader(weights: _HFWeights, args: ModelArgs, tied: bool) -> Callable[[str], torch.Tensor]:
    """A function giving the full Meta tensor ``name`` (renamed, RoPE rows reordered;
    Llama 4's router transposed and experts' w1/w3 taken from gate_up_proj)."""
    shapes = full_shapes(args)
    prefixes = _llama4_prefixes(weights) if args.is_llama4 else ("model.", "lm_head.")

    def read(name: str) -> torch.Tensor:
        source = _hf_source_name(name, args, prefixes)
        if name == "output.weight" and source not in weights.location and tied:
            source = _hf_source_name("tok_embeddings.weight", args, prefixes)  # tied: the output layer reuses them
        t = weights.get(source)
        if tuple(t.shape) != _hf_shape(name, args, shapes[name]):
            raise CheckpointError(
                f"{weights.location[source]}: tensor {source!r} has shape {list(t.shape)}, but config.json "
                f"implies {list(_hf_shape(name, args, shapes[name]))} for Meta's {name!r}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"{weights.location[source]}: tensor {source!r} has dtype {t.dtype}")
        return _from_hf_tensor(name, t, args)

    return read


def _check_config_against_weights(weights: _HFWeights, args: ModelArgs, body: str) -> None:
    """Refuse a config.json whose layer count, vocabulary or width the weights do not have,
    from the weights' names and header shapes alone (nothing is read), before anything is
    listed or sized per layer: a config.json claiming 10**9 layers or a 10**12-token
    vocabulary ends here in one line, not in a MemoryError."""
    pattern = re.compile(re.escape(body) + r"layers\.(\d+)\.")
    layers = {int(m.group(1)) for m in map(pattern.match, weights.location) if m}
    if len(layers) != args.n_layers or max(layers, default=-1) != args.n_layers - 1:
        held = f"{len(layers)} layers ({body}layers.{min(layers)} .. {max(layers)})" if layers else "no layers"
        raise CheckpointError(
            f"{weights.src} holds {held}, but config.json says num_hidden_layers={args.n_layers}: "
            "use the config.json that came with these weights"
        )
    embedding = body + "embed_tokens.weight"
    if embedding not in weights.location:
        raise CheckpointError(f"{weights.src} has no tensor {embedding!r}: is it a Llama checkpoint?")
    shape = weights.shape(embedding)
    if shape != (args.vocab_size, args.dim):
        raise CheckpointError(
            f"{weights.location[embedding]}: tensor {embedding!r} has shape {list(shape)}, but config.json says "
            f"vocab_size={args.vocab_size}, hidden_size={args.dim}: use the config.json that came with these weights"
        )


def _read_meta_args(src: Path, shards: list[Path]) -> ModelArgs:
    """params.json, with vocab_size -1 (Llama 2) resolved from the embedding's shape."""
    args = ModelArgs.from_json(src / "params.json")
    if args.vocab_size == -1:
        emb = open_shard(shards[0]).get("tok_embeddings.weight")
        if emb is None or emb.dim() != 2:
            raise CheckpointError(f"{shards[0]} has no 2-D tensor 'tok_embeddings.weight'")
        # Split over the vocabulary, the rows are 1/N of it; over dim, all of it.
        vocab = emb.shape[0] * len(shards) if emb.shape[1] == args.dim else emb.shape[0]
        args.vocab_size = vocab
    return args


# -- commands ------------------------------------------------------------------------------


@_writes_directory
def hf_to_meta(src: PathLike, dst: PathLike, model_parallel_size: int = 1) -> None:
    """Convert a Hugging Face Llama directory to a Meta checkpoint.

    Reads ``config.json`` and the weights (``model.safetensors``, sharded safetensors
    with ``model.safetensors.index.json``, or ``pytorch_model*.bin``); writes
    ``params.json`` and ``consolidated.00.pth .. consolidated.{N-1}.pth`` split over
    ``model_parallel_size`` ranks, in the weights' own dtype.  ``tok_embeddings`` is
    split over the vocabulary when it divides, else over dim (the rule ``Llama.build``
    applies to an unsplit checkpoint).  ``output.weight`` is always split over the
    vocabulary, so every allowed size divides it and the result is a vocabulary split.
    Tied HF embeddings (no ``lm_head``) are written as ``output.weight`` too.
    ``tokenizer.model`` is copied from ``original/`` (Llama 3 repos) or the top level.

    Args:
        src: the HF model directory.
        dst: output directory: absent or empty; written complete or not at all.
        model_parallel_size: number of shards to write.
    """
    _positive_int("model_parallel_size", model_parallel_size)
    src = _source_dir(src)
    config = read_json_object(src / "config.json", "is it a Hugging Face model directory?", "model settings")
    params = hf_config_to_params(config)
    args = ModelArgs.from_dict(params)
    weights = _HFWeights(src)
    prefixes = _llama4_prefixes(weights) if args.is_llama4 else ("model.", "lm_head.")
    _check_config_against_weights(weights, args, prefixes[0])  # before anything is listed per layer
    n = _check_model_parallel_size(model_parallel_size, args)
    tied = bool(config.get("tie_word_embeddings", False))
    layout = choose_embedding_layout(None, args, n)  # vocab split whenever vocab % n == 0
    read = _meta_tensor_reader(weights, args, tied)
    shapes = full_shapes(args)
    expected = {_hf_source_name(name, args, prefixes) for name in tensor_names(args)}
    extra = sorted(k for k in set(weights.location) - expected if not k.endswith(_HF_IGNORED_SUFFIXES))
    vision = [k for k in extra if k.startswith(_LLAMA4_VISION_PREFIXES)]
    if vision:
        logger.info("%s: skipping %d vision tensors (only the text model is converted)", src, len(vision))
    extra = [k for k in extra if k not in vision]
    if extra:
        logger.warning("%s: ignoring tensors a Meta checkpoint has no place for: %s", src, extra[:5])

    (dst / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    # One output shard at a time: memory holds that shard plus one source tensor;
    # each source tensor is read once per shard (from the page cache after the first).
    for rank in range(n):
        shard = {}
        for name in tensor_names(args):
            region = holder_region(name, shapes[name], n, rank, layout, args.head_dim)
            shard[name] = _slice(read(name), region)
        path = dst / f"consolidated.{rank:02d}.pth"
        torch.save(shard, path)
        logger.info("wrote %s (%d tensors)", path, len(shard))
        del shard
    _copy_tokenizer([src / "original" / "tokenizer.model", src / "tokenizer.model"], dst)


def _shard_groups(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    total = 0
    for name in names:
        if groups[-1] and total + sizes[name] > max_bytes:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += sizes[name]
    return groups


def _keep_experts_together(groups: list[list[str]]) -> list[list[str]]:
    """Move an experts' w3 into the group of its w1 (they form one HF tensor)."""
    out = [list(g) for g in groups]
    for i, group in enumerate(out):
        for name in list(group):
            if name.endswith("experts.w1"):
                partner = name[: -len("w1")] + "w3"
                for other in out[i + 1 :]:
                    if partner in other:
                        other.remove(partner)
                        group.append(partner)
    return [g for g in out if g]


def _to_hf_tensors(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names and layouts for full Meta tensors (a Llama 4 experts' w1 and w3 together)."""
    state = {}
    for name, t in tensors.items():
        key = _pattern(name)[0]
        heads_field = _ROPE_PERMUTED.get(key)
        if heads_field is not None and not args.is_llama4:
            t = meta_to_hf_rope_rows(t, getattr(args, heads_field))
        elif key.endswith("router_DE"):
            t = t.t()
        elif key.endswith("experts.w3"):
            continue  # written with w1
        elif key.endswith("experts.w1"):
            t = torch.cat([t, tensors[name[: -len("w1")] + "w3"]], dim=-1)
        state[hf_name(name, llama4=args.is_llama4)] = t.contiguous()
    return state


@_writes_directory
def meta_to_hf(
    src: PathLike,
    dst: PathLike,
    max_position_embeddings: Optional[int] = None,
    max_shard_size_gb: float = DEFAULT_MAX_SHARD_SIZE_GB,
) -> None:
    """Convert a Meta checkpoint (any number of shards) to a Hugging Face Llama directory.

    Writes ``config.json`` and the weights as ``model.safetensors``, or, when larger
    than ``max_shard_size_gb``, as ``model-0000K-of-0000M.safetensors`` with
    ``model.safetensors.index.json``.  With a ``tokenizer.model``, copies it and writes
    the Hugging Face tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with
    the chat template, ``special_tokens_map.json``) and ``generation_config.json`` (the
    stop tokens), made by :mod:`llama.hf_tokenizer`: ``LlamaForCausalLM`` and
    ``AutoTokenizer.from_pretrained`` load the directory with nothing else installed.

    Args:
        src: the Meta checkpoint directory (``params.json``, ``consolidated.*.pth``).
        dst: output directory: absent or empty; written complete or not at all.
        max_position_embeddings: written to config.json (Meta's params.json has no such
            field); default 131072 with scaled RoPE, 8192 for rope_theta >= 5e5, else 4096.
        max_shard_size_gb: largest safetensors file, in GB (10**9 bytes).
    """
    if max_position_embeddings is not None:
        _positive_int("max_position_embeddings", max_position_embeddings)
    max_shard_size_gb = _positive_number("max_shard_size_gb", max_shard_size_gb)
    src = _source_dir(src)
    shards = find_shards(src)
    args = _read_meta_args(src, shards)
    info = inspect_checkpoint(shards, args)
    tokenizer = _read_tokenizer(src / "tokenizer.model")

    from safetensors.torch import save_file

    # One output file's tensors are merged in memory at a time, in the checkpoint's dtype.
    itemsize = torch.empty(0, dtype=info.dtype).element_size()
    shapes = full_shapes(args)
    names = tensor_names(args)
    sizes = {name: math.prod(shapes[name]) * itemsize for name in names}
    groups = _shard_groups(names, sizes, int(max_shard_size_gb * 1e9))
    if args.is_llama4:
        groups = _keep_experts_together(groups)
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
    ]
    weight_map = {}
    for file, group in zip(files, groups):
        state = _to_hf_tensors(load_full_tensors(info, args, group), args)
        save_file(state, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in state})
        del state
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    logger.info("wrote %d tensors to %d safetensors file(s) in %s", len(names), len(groups), dst)

    to_config = llama4_params_to_hf_config if args.is_llama4 else params_to_hf_config
    config = to_config(
        args, info.dtype, max_position_embeddings,
        tokenizer.bos_id if tokenizer else None, tokenizer.eos_id if tokenizer else None,
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        _copy_tokenizer([src / "tokenizer.model"], dst)
        from .hf_tokenizer import hf_tokenizer_files

        for name, content in hf_tokenizer_files(tokenizer, config["max_position_embeddings"]).items():
            (dst / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@_writes_directory
def reshard(src: PathLike, dst: PathLike, model_parallel_size: int) -> None:
    """Rewrite a Meta checkpoint split over ``model_parallel_size`` shards.

    The offline form of what ``Llama.build`` does at load time, with the same shard
    table and code: with more shards than K/V heads, each K/V head is copied into
    consecutive shards.  The embedding keeps the source's split when it divides, else
    the vocabulary is split.  Shards are built one at a time (memory: one output shard),
    in the checkpoint's dtype; ``params.json`` and ``tokenizer.model`` are copied.

    Args:
        src: the Meta checkpoint directory.
        dst: output directory: absent or empty; written complete or not at all.
        model_parallel_size: number of shards to write; must be one the model allows.
    """
    _positive_int("model_parallel_size", model_parallel_size)
    src = _source_dir(src)
    shards = find_shards(src)
    args = _read_meta_args(src, shards)
    info = inspect_checkpoint(shards, args)
    n = _check_model_parallel_size(model_parallel_size, args)
    layout = choose_embedding_layout(info.embedding_layout, args, n)
    shapes = full_shapes(args)
    cpu = torch.device("cpu")
    for rank in range(n):
        local = {
            name: torch.Size(shard_shape(name, shapes[name], n, rank, layout, args.head_dim))
            for name in tensor_names(args)
        }
        state = load_rank_state_dict(info, args, local, layout, n, rank, cpu, info.dtype)
        path = dst / f"consolidated.{rank:02d}.pth"
        torch.save(state, path)
        logger.info("wrote %s", path)
        del state
    shutil.copyfile(src / "params.json", dst / "params.json")
    if (src / "tokenizer.model").is_file():
        shutil.copyfile(src / "tokenizer.model", dst / "tokenizer.model")
    logger.info("resharded %s (%d shards) into %s (%d shards, %s embedding split)", src, info.n_shards, dst, n, layout)


def main(argv: Optional[list[str]] = None) -> int:
    """The command line (``python -m llama.convert``); see :mod:`llama.convert_cli`."""
    from .convert_cli import main as cli_main

    return cli_main(argv)
