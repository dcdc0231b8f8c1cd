"""Hugging Face ``config.json`` <-> Meta ``params.json``, including the search for the
``multiple_of`` / ``ffn_dim_multiplier`` (/ ``ffn_exp``) that reproduce a config's FFN widths
under Meta's rules.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Iterator, Mapping, Optional, cast

import torch

from llama.args import ModelArgs, MoEArgs, VisionArgs

# transformers' rope_type names this library can run.
_ROPE_DEFAULT, _ROPE_LLAMA3 = "default", "llama3"
_MULTIPLE_OF_CANDIDATES = (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
_MULTIPLIERS_PER_DECIMALS = 50  # extra ffn_dim_multiplier candidates tried per multiple_of and number of decimals

logger = logging.getLogger(__name__)


def _ffn_candidates(args: ModelArgs, intermediate_size: int) -> Iterator[tuple[int, Optional[float]]]:
    """Every (multiple_of, ffn_dim_multiplier) tried for which Meta's dense rule gives
    ``intermediate_size``, most preferred first: no multiplier (large ``multiple_of``
    first), then the ratio rounded to 1..6 decimals, then other multipliers of 1..4
    decimals that land on the same width (nearest the ratio first, at most
    ``_MULTIPLIERS_PER_DECIMALS`` each): those matter when the multiplier must also give
    Llama 4's expert width.  Every pair yielded is checked with ``ModelArgs.ffn_hidden_dim``."""
    base = args.ffn_base_width

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
    moe, dim = cast(MoEArgs, args.moe_args), args.dim  # an MoE model's

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
    dense_size, expert_size = cast(int, dense_size), cast(int, expert_size)  # checked just above
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


# transformers' Llama4VisionConfig defaults (its save_pretrained may leave out what equals them).
_HF_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "hidden_act": "gelu", "num_hidden_layers": 34, "num_attention_heads": 16, "num_channels": 3,
    "intermediate_size": 5632, "vision_output_dim": 7680, "image_size": 448, "patch_size": 14, "norm_eps": 1e-5,
    "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096, "projector_output_dim": 4096,
    "multi_modal_projector_bias": False,
}
_VISION_ROPE_THETA = 10000.0  # Meta's encoder has no setting for it


def _hf_size(value: Any) -> Any:
    """An HF size (an int, or a [height, width] pair) as params.json's ``{"height", "width"}``."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    return {"height": value, "width": value}


def llama4_vision_config_to_params(vision: Mapping[str, Any]) -> dict:
    """params.json's ``vision_args`` for an HF ``Llama4VisionConfig`` (``vision_config`` of a
    ``Llama4ForConditionalGeneration``; keys it leaves out take transformers' defaults).
    ValueError where Meta's encoder has no such model: its MLP width must be the pixel-shuffled
    width (``hidden_size / pixel_shuffle_ratio**2``, which transformers' adapter takes as
    ``intermediate_size``), the projector's input, output and ``vision_output_dim`` one width,
    GELU, no projector bias, 3 channels, LayerNorm eps 1e-5, RoPE theta 10000."""
    c = {**_HF_VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
    rope = dict(c.get("rope_parameters") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", _VISION_ROPE_THETA))
    problems = []
    if c["hidden_act"] != "gelu":
        problems.append(f"hidden_act={c['hidden_act']!r} (Meta's encoder uses 'gelu')")
    if c["multi_modal_projector_bias"]:
        problems.append("multi_modal_projector_bias=true (Meta's projection has no bias)")
    if c["num_channels"] != 3:
        problems.append(f"num_channels={c['num_channels']} (Meta's encoder takes RGB)")
    if c["norm_eps"] != 1e-5:
        problems.append(f"norm_eps={c['norm_eps']} (Meta's LayerNorm uses 1e-5)")
    if theta != _VISION_ROPE_THETA:
        problems.append(f"rope_theta={theta} (Meta's encoder uses {_VISION_ROPE_THETA:g})")
    widths = {c["vision_output_dim"], c["projector_input_dim"], c["projector_output_dim"]}
    if len(widths) != 1:
        problems.append(f"vision_output_dim={c['vision_output_dim']}, projector_input_dim={c['projector_input_dim']} "
                        f"and projector_output_dim={c['projector_output_dim']} differ (Meta's adapter has one width)")
    hidden, ratio = c["hidden_size"], c["pixel_shuffle_ratio"]
    if not isinstance(hidden, int) or not isinstance(ratio, (int, float)) or ratio <= 0 \
            or c["intermediate_size"] != hidden / ratio**2:
        problems.append(f"intermediate_size={c['intermediate_size']} is not hidden_size / pixel_shuffle_ratio**2 "
                        f"({hidden} / {ratio}**2), the width Meta's adapter takes")
    if problems:
        raise ValueError("config.json's vision_config has no Meta equivalent: " + "; ".join(problems))
    params = {
        "image_size": _hf_size(c["image_size"]),
        "patch_size": _hf_size(c["patch_size"]),
        "dim": hidden,
        "n_layers": c["num_hidden_layers"],
        "n_heads": c["num_attention_heads"],
        "mlp_ratio": c["intermediate_size"] / hidden,
        "output_dim": c["vision_output_dim"],
        "pixel_shuffle_ratio": float(ratio),
    }
    vision_args = VisionArgs.from_value(params)  # ValueError for shapes Meta's encoder cannot take
    if vision_args.hidden_dim != c["intermediate_size"]:
        raise ValueError(f"config.json's vision_config: intermediate_size={c['intermediate_size']} is no whole "
                         f"mlp_ratio of hidden_size={hidden}")
    return params


def hf_config_to_params(config: dict) -> dict:
    """Meta ``params.json`` contents for an HF Llama ``config.json`` (as a dict).

    A ``Llama4ForConditionalGeneration``'s gives the text model's and, from its
    ``vision_config``, ``vision_args`` (:func:`llama4_vision_config_to_params`); a vision
    config Meta's encoder cannot take is logged and left out (the text model is converted).
    Raises ``ValueError`` for configs this library cannot run (not Llama, biases,
    another activation, an unsupported RoPE variant, a head_dim other than dim/n_heads).
    """
    text = _llama4_text_config(config)
    if text is not None:
        llama4 = llama4_config_to_params(text)
        vision = config.get("vision_config") if config.get("model_type") == "llama4" else None
        if isinstance(vision, Mapping):
            try:
                llama4["vision_args"] = llama4_vision_config_to_params(vision)
            except ValueError as e:
                logger.warning("%s: only the text model is taken", e)
        return llama4
    model_type = config.get("model_type")
    if model_type == "mllama":
        raise ValueError("config.json is a Llama 3.2 Vision model's (MllamaForConditionalGeneration): convert it to "
                         "Meta's layout first (python -m llama.convert hf_to_meta SRC DST) and load that")
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
    """An HF ``config.json`` (as a dict) for a model of shape ``args`` (vocab_size resolved):
    a ``LlamaForCausalLM``'s, or a ``Llama4ForCausalLM``'s for a Llama 4 shape.

    RoPE settings are written both ways: ``rope_parameters`` (transformers 5) and
    top-level ``rope_theta`` + ``rope_scaling`` (transformers 4).
    """
    if max_position_embeddings is None and args.is_llama4:
        max_position_embeddings = 262144
    if max_position_embeddings is None:
        max_position_embeddings = _default_max_position_embeddings(args)
    rope_scaling = None
    rope_parameters: dict[str, Any] = {"rope_type": _ROPE_DEFAULT, "rope_theta": float(args.rope_theta)}
    if args.use_scaled_rope:
        rope_scaling = {
            "rope_type": _ROPE_LLAMA3,
            "factor": float(cast(float, args.rope_scaling_factor)),  # set with use_scaled_rope
            "low_freq_factor": float(args.rope_low_freq_factor),
            "high_freq_factor": float(args.rope_high_freq_factor),
            "original_max_position_embeddings": int(args.rope_original_context_len),
        }
        rope_parameters = {**rope_scaling, "rope_theta": float(args.rope_theta)}
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
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
    return _llama4_config(config, args) if args.is_llama4 else config


def vision_args_to_hf_config(vision: VisionArgs) -> dict:
    """An HF ``Llama4VisionConfig`` (as a dict) for Meta's ``vision_args``."""
    return {
        "model_type": "llama4_vision_model",
        "hidden_size": vision.dim,
        "hidden_act": "gelu",
        "num_hidden_layers": vision.n_layers,
        "num_attention_heads": vision.n_heads,
        "num_channels": 3,
        "intermediate_size": vision.hidden_dim,
        "vision_output_dim": vision.output_dim,
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "norm_eps": 1e-5,
        "pixel_shuffle_ratio": vision.pixel_shuffle_ratio,
        "projector_input_dim": vision.output_dim,
        "projector_output_dim": vision.output_dim,
        "multi_modal_projector_bias": False,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "rope_theta": _VISION_ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": _VISION_ROPE_THETA},
    }


def multimodal_hf_config(text_config: dict, vision: VisionArgs, image_token_index: int,
                         boi_token_index: int, eoi_token_index: int) -> dict:
    """A ``Llama4ForConditionalGeneration``'s ``config.json`` around a ``Llama4ForCausalLM``'s
    (:func:`params_to_hf_config`) and the image encoder's; the image tokens' ids (``<|patch|>``,
    ``<|image_start|>``, ``<|image_end|>``) from the tokenizer."""
    text = {k: v for k, v in text_config.items() if k != "architectures"}
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "vision_config": vision_args_to_hf_config(vision),
        "image_token_index": image_token_index,
        "boi_token_index": boi_token_index,
        "eoi_token_index": eoi_token_index,
        "tie_word_embeddings": False,
        "dtype": text_config["dtype"],
        "torch_dtype": text_config["dtype"],
    }


def _llama4_config(config: dict, args: ModelArgs) -> dict:
    """``config`` (a LlamaForCausalLM's) made a ``Llama4ForCausalLM``'s for the Llama 4 shape ``args``."""
    for key in ("mlp_bias",):
        config.pop(key)
    moe = cast(MoEArgs, args.moe_args)  # a Llama 4 shape: an MoE model
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
