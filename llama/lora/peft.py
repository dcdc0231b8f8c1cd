"""Reading a Hugging Face PEFT LoRA adapter folder into Meta's names (:class:`~llama.lora.adapter.LoraAdapter`).

A PEFT adapter is ``adapter_config.json`` and ``adapter_model.safetensors`` (or an older
``adapter_model.bin``) holding, for each layer it changes,
``base_model.model.<the layer's name in transformers' model>.lora_A.weight`` ([r, in]) and
``.lora_B.weight`` ([out, r]).  Reading it here:

* maps each layer's name to Meta's with :mod:`llama.convert.names`' table, the one the
  converter uses (``model.layers.3.self_attn.q_proj`` -> ``layers.3.attention.wq``; Llama 4's
  ``feed_forward.{gate,up,down}_proj`` and ``shared_expert.*`` too, under whichever prefix its
  repository keeps the text model);
* permutes the rows of ``wq``'s and ``wk``'s B from Hugging Face's rotary order back to
  Meta's, with the converter's :func:`~llama.convert.names.hf_to_meta_rope_rows` (n_heads for
  q, n_kv_heads for k; Llama 4's q/k rows are Meta's already);
* reads the scale, ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), and
  per-layer ranks and alphas (``rank_pattern`` / ``alpha_pattern``, matched as PEFT matches
  them): a layer whose scale differs from the adapter's has its B scaled by the ratio, so
  every layer's change is ``adapter.scale * B @ A``;
* checks everything against the base's ``params.json`` from the config and the files'
  headers before any tensor is read: a ValueError names the field or key and what to do.

Llama 4's routed experts (PEFT's ``target_parameters``: ``feed_forward.experts.gate_up_proj``
and ``down_proj``, which PEFT 0.21 wraps with its ``ParamWrapper``) are read where asked
(``experts=True``: merging and serving unmerged both ask), as 3-D factors
(:class:`_ExpertParameter`).

What this library does not run is refused, naming the field: DoRA (``use_dora``), trained
whole modules (``modules_to_save``), biases (``bias``, ``lora_bias``), the embedding and the
output layer (``embed_tokens``, ``lm_head``), and PEFT's variants that are not plain LoRA
(aLoRA, QALoRA, trainable tokens, PiSSA/OLoRA bases, ...).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from llama.args import ModelArgs
from llama.checkpoint.shards import open_shard
from llama.convert.files import safetensors_file
from llama.convert.names import (
    LLAMA4_META_TO_HF_NAMES,
    LLAMA4_TEXT_PREFIXES,
    META_TO_HF_NAMES,
    ROPE_PERMUTED,
    hf_to_meta_rope_rows,
)
from llama.layers.tensor_parallel import full_shapes
from llama.lora.adapter import LoraAdapter, LoraFactors

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
_LINEAR_LAYERS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
# lora_A / lora_B of one layer; PEFT drops the adapter's name ("default") when saving, older
# saves may keep it.
_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[A-Za-z0-9_-]+))?\.weight$")
_SAFETENSORS_FLOATS = {"F64", "F32", "F16", "BF16"}

# adapter_config.json fields that must be unset (None, False, empty) for plain LoRA, and why.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported: train the adapter with use_dora=False, "
                "or merge it into the base with PEFT's merge_and_unload() and load the merged model",
    "modules_to_save": "the adapter holds whole trained copies of these modules, which this library does not "
                       "load: train with modules_to_save=None, or merge it with PEFT's merge_and_unload()",
    "lora_bias": "LoRA biases (lora_bias=True) are not supported: train with lora_bias=False",
    "trainable_token_indices": "trained token embeddings are not supported: train without trainable_token_indices",
    "layer_replication": "layer replication changes the base model's layers: not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported: it applies only after its invocation "
                               "tokens",
    "use_qalora": "QALoRA adapters are not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing over several adapters is not supported",
    "kasa_config": "KaSA adapters are not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
    "megatron_config": "Megatron-sharded LoRA layers are not supported",
}
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # transformers' Llama4TextExperts
# PEFT wraps a module's targeted parameters one inside the other: the first one's factors are
# the innermost module's (``experts.base_layer.lora_A``), the last one's the outermost's.
_EXPERTS_MODULE = re.compile(r"^(?P<experts>.*\.experts)(?:\.base_layer)*$")
_UNSUPPORTED_EMBEDDINGS = {"embed_tokens": "the token embedding", "lm_head": "the output layer (lm_head)"}


def _refuse(path: Path, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {message}")


def _module_table(llama4: bool) -> dict[str, str]:
    """Hugging Face module name pattern -> Meta's, for the linear layers an adapter may change
    (``"model.layers.*.self_attn.q_proj"`` -> ``"layers.*.attention.wq"``): the converter's table."""
    names = LLAMA4_META_TO_HF_NAMES if llama4 else META_TO_HF_NAMES
    return {hf.removesuffix(".weight"): meta.removesuffix(".weight") for meta, hf in names.items()
            if meta.startswith("layers.*.") and meta.endswith(".weight") and meta.split(".")[-2] in _LINEAR_LAYERS}


def read_peft_config(path: Path, experts: bool = False) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter folder ``path``, checked to be a plain LoRA adapter
    this library can apply: ValueError naming the field otherwise; FileNotFoundError where the
    folder or the file is missing.  ``experts``: ``target_parameters`` naming Llama 4's routed
    experts (``feed_forward.experts.gate_up_proj`` / ``down_proj``) are accepted."""
    if not path.exists():
        raise FileNotFoundError(f"LoRA adapter folder {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"LoRA adapter {path} is not a folder: give the folder PEFT's save_pretrained "
                                f"wrote ({ADAPTER_CONFIG} and adapter_model.safetensors)")
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG}: is it a PEFT adapter folder (what PEFT's "
                                "save_pretrained writes)?")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(path, f"peft_type is {peft_type!r}: only LoRA adapters (peft_type 'LORA') are supported")
    for field, why in _UNSUPPORTED_FIELDS.items():
        if config.get(field) not in (None, False, [], {}, ""):
            raise _refuse(path, f"{field}={config[field]!r}: {why}")
    _check_target_parameters(path, config.get("target_parameters"), experts)
    bias = config.get("bias", "none")
    if bias != "none":
        raise _refuse(path, f"bias={bias!r}: adapters that train biases are not supported: train with bias='none'")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "loftq")):
        raise _refuse(path, f"init_lora_weights={init!r}: such an adapter belongs to a base model whose weights "
                            "PEFT changed when it was made: convert it to a plain LoRA adapter with PEFT "
                            "(path_initial_model_for_weight_conversion) first")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _refuse(path, f"{field} must be a positive number, got {value!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in pattern.values()):
            raise _refuse(path, f"{field} must map layer-name patterns to positive numbers, got {pattern!r}")
        for key in pattern:
            try:
                re.compile(key)
            except re.error as e:
                raise _refuse(path, f"{field} key {key!r} is not a valid regular expression ({e})") from None
    if config.get("fan_in_fan_out"):
        # PEFT sets it back to False for nn.Linear (every Llama layer): A and B are stored as usual.
        logger.info("%s: fan_in_fan_out=True has no effect on Llama's linear layers (PEFT ignores it there)", path)
    _check_target_modules(path, config.get("target_modules"))
    return config


def _check_target_modules(path: Path, targets: Union[None, str, list]) -> None:
    """Refuses target_modules that name the embedding or the output layer (a list, as PEFT
    matches it: a name or its last parts; a regex string, matched whole)."""
    if targets is None:
        return
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise _refuse(path, f"target_modules {targets!r} is not a valid regular expression ({e})") from None
        for leaf, what in _UNSUPPORTED_EMBEDDINGS.items():
            for candidate in (f"model.{leaf}", leaf, f"model.language_model.{leaf}"):
                if re.fullmatch(targets, candidate):
                    raise _refuse(path, f"target_modules {targets!r} matches {candidate!r}: LoRA on {what} is not "
                                        "supported: target the attention and MLP layers only")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _refuse(path, f"target_modules must be a list of module names or a regex string, got {targets!r}")
    supported = {part for hf in _module_table(False) | _module_table(True) for part in hf.split(".")}
    for target in targets:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in _UNSUPPORTED_EMBEDDINGS:
            raise _refuse(path, f"target_modules names {target!r}: LoRA on {_UNSUPPORTED_EMBEDDINGS[leaf]} is not "
                                "supported: target the attention and MLP layers only (q_proj k_proj v_proj o_proj "
                                "gate_proj up_proj down_proj)")
        if target != "all-linear" and leaf not in supported and not leaf.isdigit():
            raise _refuse(path, f"target_modules names {target!r}, which is not a layer this library applies LoRA to "
                                "(q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)")


def _check_target_parameters(path: Path, targets: Any, experts: bool) -> None:
    if targets in (None, [], ""):
        return
    if not experts:
        raise _refuse(path, f"target_parameters={targets!r}: the factors of Llama 4's routed experts are read with "
                            "read_adapter(..., experts=True), as Llama.build(..., lora=, lora_adapters=) and "
                            "merge_lora read them")
    if not isinstance(targets, list) or not all(isinstance(t, str) and t.split(".")[-2:-1] == ["experts"]
                                                and t.endswith(_EXPERT_PARAMETERS) for t in targets):
        raise _refuse(path, f"target_parameters={targets!r}: only Llama 4's routed experts' parameters "
                            "(feed_forward.experts.gate_up_proj, feed_forward.experts.down_proj) are supported")


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's rule (``peft.utils.other.get_pattern_key``): the first pattern that matches the end
    of the module's name, after a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class _AdapterFile:
    """The adapter's weight file: tensor names and shapes from its header, tensors when asked."""

    def __init__(self, folder: Path) -> None:
        for name in ADAPTER_WEIGHTS:
            if (folder / name).exists():
                self.path = folder / name
                break
        else:
            raise FileNotFoundError(f"{folder} has no adapter weights: expected {' or '.join(ADAPTER_WEIGHTS)} "
                                    "(what PEFT's save_pretrained writes)")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._state: Optional[dict[str, torch.Tensor]] = None
        if self.path.suffix == ".safetensors":
            with safetensors_file(self.path) as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    if sl.get_dtype() not in _SAFETENSORS_FLOATS:
                        raise _refuse(folder, f"tensor {key!r} in {self.path.name} has dtype {sl.get_dtype()}; "
                                              "LoRA factors are floating point")
                    self.shapes[key] = tuple(sl.get_shape())
        else:
            self._state = open_shard(self.path)  # memory-mapped, weights_only: nothing read, no code run
            for key, t in self._state.items():
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise _refuse(folder, f"entry {key!r} in {self.path.name} is not a floating-point tensor")
                self.shapes[key] = tuple(t.shape)

    def read(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        if self._state is not None:
            for key in keys:
                yield key, self._state[key].clone()
            return
        with safetensors_file(self.path) as f:
            for key in keys:
                yield key, f.get_tensor(key)


def _text_model_name(name: str) -> str:
    """A Llama 4 module's name with its repository's text-model prefix (``model.language_model.``,
    ``language_model.model.``, as a multimodal repository has it) made ``model.``."""
    for body, _ in sorted(LLAMA4_TEXT_PREFIXES, key=lambda prefixes: -len(prefixes[0])):  # the longest first
        if name.startswith(body):
            return "model." + name[len(body):]
    return name


def _meta_module(path: Path, module: str, args: ModelArgs, table: dict[str, str]) -> str:
    """Meta's name of the Hugging Face module ``module`` (as in the transformers model: PEFT's
    prefix removed); ValueError naming it where it is not a layer this library applies LoRA to."""
    name = module
    if args.is_llama4:
        name = _text_model_name(name)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _UNSUPPORTED_EMBEDDINGS:
        raise _refuse(path, f"it changes {module!r}: LoRA on {_UNSUPPORTED_EMBEDDINGS[leaf]} is not supported: "
                            "use an adapter of the attention and MLP layers only")
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        pattern = ".".join(["model", "layers", "*", *parts[3:]])
        if pattern in table:
            return table[pattern].replace("*", parts[2])
    if ".experts" in name:
        raise _refuse(path, f"it changes {module!r}, routed experts: " + (
            "their factors are read with read_adapter(..., experts=True), as Llama.build(..., lora=, lora_adapters=) "
            "and merge_lora read them" if args.is_llama4 else
            "the base is not a Llama 4 model (no routed experts): is the adapter for another model?"))
    family = "Llama 4" if args.is_llama4 else "Llama"
    raise _refuse(path, f"it changes {module!r}, which is not one of the linear layers of a {family} decoder layer "
                        f"this library applies LoRA to ({', '.join(sorted({k.rsplit('.', 1)[-1] for k in table}))}): "
                        "is the adapter for another kind of model?")


def read_peft_adapter(path: Union[str, Path], params: ModelArgs, name: Optional[str] = None, *,
                      experts: bool = False) -> LoraAdapter:
    """The PEFT LoRA adapter in folder ``path``, for the base model of ``params``: see
    :func:`llama.lora.adapter.read_adapter`."""
    path = Path(path)
    config = read_peft_config(path, experts)
    if params.has_cross_attention:
        raise _refuse(path, "LoRA adapters for Llama 3.2 Vision are not supported (its text model's layers are "
                            "numbered with its cross-attention layers): use a text model")
    weights = _AdapterFile(path)
    table = _module_table(params.is_llama4)
    shapes = full_shapes(params)
    r, alpha = config["r"], config["lora_alpha"]
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    base_scale = alpha / math.sqrt(r) if rslora else alpha / r

    # Everything checked from the header: names, pairs, layer indices, shapes.
    found: dict[str, dict[str, str]] = {}  # Meta module -> {"lora_A": key, "lora_B": key}
    hf_module: dict[str, str] = {}
    expert_keys: dict[str, dict[str, str]] = {}  # PEFT's module (experts[.base_layer...]) -> {"lora_A": key, ...}
    for key in weights.shapes:
        m = _KEY.match(key)
        if m is None or not key.startswith(_PEFT_PREFIX):
            what = ("DoRA's magnitude vector: train with use_dora=False" if "lora_magnitude_vector" in key else
                    "a LoRA bias: train with bias='none' and lora_bias=False" if key.endswith(".bias") else
                    "an embedding's LoRA factor: LoRA on the embedding is not supported" if "lora_embedding" in key
                    else "not a LoRA factor of a linear layer (base_model.model.<layer>.lora_A.weight / "
                         ".lora_B.weight)")
            raise _refuse(path, f"{weights.path.name} holds {key!r}: {what}")
        module = m["module"][len(_PEFT_PREFIX):]
        if experts and params.is_llama4 and _EXPERTS_MODULE.match(module):
            expert_keys.setdefault(module, {})[m["kind"]] = key
            continue
        meta = _meta_module(path, module, params, table)
        slots = found.setdefault(meta, {})
        if m["kind"] in slots:
            raise _refuse(path, f"{weights.path.name} holds two {m['kind']} for {module!r} ({slots[m['kind']]!r} and "
                                f"{key!r}): save one adapter per folder")
        slots[m["kind"]] = key
        hf_module[meta] = module
    if not found and not expert_keys:
        raise _refuse(path, f"{weights.path.name} holds no LoRA factors")
    scales: dict[str, float] = {}
    for meta, slots in found.items():
        module = hf_module[meta]
        if set(slots) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(slots)).pop()
            raise _refuse(path, f"{weights.path.name} has no {missing} for {module!r}: the file is incomplete")
        weight = meta + ".weight"
        if weight not in shapes:
            layer = int(meta.split(".")[1])
            why = (f"the base has {params.n_layers} layers (0..{params.n_layers - 1})" if layer >= params.n_layers
                   else f"layer {layer} of the base has no {meta.split('.', 2)[2]} (a mixture-of-experts layer?)")
            raise _refuse(path, f"it changes {module!r}, but {why}: the adapter was made for another base model")
        out_features, in_features = shapes[weight]
        a_shape, b_shape = weights.shapes[slots["lora_A"]], weights.shapes[slots["lora_B"]]
        layer_r = _pattern_value(rank_pattern, module, r)
        if (len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_features or b_shape[0] != out_features
                or a_shape[0] != b_shape[1]):
            raise _refuse(path, f"{module!r}'s lora_A is {list(a_shape)} and lora_B {list(b_shape)}, but the base's "
                                f"{meta} is [{out_features}, {in_features}] (A must be [r, {in_features}], B "
                                f"[{out_features}, r]): the adapter was made for another base model")
        if a_shape[0] != layer_r:
            raise _refuse(path, f"{module!r}'s factors have rank {a_shape[0]}, but adapter_config.json gives it "
                                f"r={layer_r}{' (rank_pattern)' if layer_r != r else ''}: the config and the weights "
                                "do not belong together")
        layer_alpha = _pattern_value(alpha_pattern, module, alpha)
        scales[meta] = layer_alpha / math.sqrt(layer_r) if rslora else layer_alpha / layer_r
    layers = config.get("layers_to_transform")
    if layers is not None:
        for i in [layers] if isinstance(layers, int) else layers:
            if not isinstance(i, int) or not 0 <= i < params.n_layers:
                raise _refuse(path, f"layers_to_transform names layer {i!r}, but the base has {params.n_layers} "
                                    "layers: the adapter was made for another base model")

    expert_plan = _plan_experts(path, expert_keys, weights.shapes, params, rank_pattern, alpha_pattern, r, alpha,
                                rslora)

    # Only now read the tensors (small: r * (in + out) numbers a layer).
    keys = [key for slots in found.values() for key in slots.values()]
    keys += [key for plan in expert_plan for key in (plan.a_key, plan.b_key)]
    tensors = dict(weights.read(keys))
    factors: dict[str, LoraFactors] = {}
    for meta in sorted(found, key=_layer_order):
        a, b = tensors[found[meta]["lora_A"]], tensors[found[meta]["lora_B"]]
        heads_field = ROPE_PERMUTED.get(".".join(["layers", "*", *meta.split(".")[2:]]) + ".weight")
        if heads_field is not None and not params.is_llama4:  # Llama 4's q/k rows are in Meta's order already
            b = hf_to_meta_rope_rows(b, getattr(params, heads_field))
        if scales[meta] != base_scale:  # rank_pattern / alpha_pattern: this layer's own scale, folded into B
            b = (b.float() * (scales[meta] / base_scale)).to(b.dtype)
        factors[meta] = LoraFactors(a=a.contiguous(), b=b.contiguous())
    for plan in expert_plan:
        for meta, factors_ in plan.factors(tensors[plan.a_key], tensors[plan.b_key], params).items():
            if plan.scale != base_scale:
                b = (factors_.b.float() * (plan.scale / base_scale)).to(factors_.b.dtype)
                factors_ = LoraFactors(a=factors_.a, b=b)
            factors[meta] = factors_
    adapter = LoraAdapter(name=name if name is not None else path.name, path=path,
                          rank=max(f.a.shape[-2] for f in factors.values()), scale=base_scale, factors=factors,
                          base_model=config.get("base_model_name_or_path") or None)
    logger.info("read LoRA adapter %r from %s: rank %d, scale %g, %d layers%s", adapter.name, path, adapter.rank,
                adapter.scale, len(factors), " (rsLoRA)" if rslora else "")
    return adapter


def _layer_order(meta: str) -> tuple[int, str]:
    parts = meta.split(".")
    return int(parts[1]), meta


@dataclass
class _ExpertParameter:
    """One targeted parameter of a Llama 4 experts module (transformers' ``Llama4TextExperts``):
    its factors' keys and how PEFT laid them out.

    PEFT (``ParamWrapper``) keeps ``lora_A`` as [E*r, X] (expert-major rows) and ``lora_B`` as
    [Y, r*E] (rank-major columns), and adds ``scale * B_e @ A_e`` ([Y, X]) to each expert's
    [d1, d2] slice of the parameter when it takes the parameter as [E, out, in] (``swapped``: Y =
    d1, X = d2, transformers 5's Llama 4 experts, which it does not mark ``is_transposed``), else
    ``scale * A_e.T @ B_e.T`` (X = d1, Y = d2)."""

    layer: int
    parameter: str  # "gate_up_proj" or "down_proj"
    a_key: str
    b_key: str
    n_experts: int
    swapped: Optional[bool]  # None until decided (a square parameter: its sibling's layout)
    scale: float

    def factors(self, a: torch.Tensor, b: torch.Tensor, params: ModelArgs) -> dict[str, LoraFactors]:
        """Meta's expert tensors it changes -> factors with ``b @ a`` of the Meta tensor's shape
        ([E, dim, hidden] for w1 and w3, [E, hidden, dim] for w2)."""
        e = self.n_experts
        a3 = a.reshape(e, -1, a.shape[-1])  # [E, r, X]
        b3 = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)  # [E, Y, r]
        left, right = (b3, a3) if self.swapped else (a3.transpose(1, 2), b3.transpose(1, 2))  # [E, d1, r], [E, r, d2]
        left, right = left.contiguous(), right.contiguous()
        prefix = f"layers.{self.layer}.feed_forward.experts."
        if self.parameter == "down_proj":
            return {prefix + "w2": LoraFactors(a=right, b=left)}
        hidden = right.shape[-1] // 2  # gate_up_proj: w1's columns, then w3's
        return {prefix + "w1": LoraFactors(a=right[..., :hidden].contiguous(), b=left),
                prefix + "w3": LoraFactors(a=right[..., hidden:].contiguous(), b=left)}


def _plan_experts(path: Path, expert_keys: dict[str, dict[str, str]], shapes: dict[str, tuple[int, ...]],
                  params: ModelArgs, rank_pattern: dict, alpha_pattern: dict, r: int, alpha: float,
                  rslora: bool) -> list[_ExpertParameter]:
    """The expert parameters an adapter changes, checked from the header against the base."""
    if not expert_keys:
        return []
    full = full_shapes(params)
    by_layer: dict[int, list[tuple[str, str, str]]] = {}
    for module, slots in expert_keys.items():
        if set(slots) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(slots)).pop()
            raise _refuse(path, f"the adapter's file has no {missing} for {module!r}: the file is incomplete")
        name = _EXPERTS_MODULE.match(module)["experts"]  # type: ignore[index]  # matched when collected
        name = _text_model_name(name)
        parts = name.split(".")
        if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or parts[3] != "feed_forward":
            raise _refuse(path, f"it changes {module!r}, which is not a Llama 4 layer's routed experts")
        by_layer.setdefault(int(parts[2]), []).append((module, slots["lora_A"], slots["lora_B"]))
    plans: list[_ExpertParameter] = []
    for layer, entries in sorted(by_layer.items()):
        w1 = f"layers.{layer}.feed_forward.experts.w1"
        if w1 not in full:
            why = (f"the base has {params.n_layers} layers" if layer >= params.n_layers
                   else f"layer {layer} of the base is dense (no routed experts)")
            raise _refuse(path, f"it changes layer {layer}'s routed experts, but {why}: the adapter was made for "
                                "another base model")
        e, dim, hidden = full[w1]
        expected = {"gate_up_proj": (dim, 2 * hidden), "down_proj": (hidden, dim)}  # the parameter's [d1, d2]
        seen: dict[str, _ExpertParameter] = {}
        for module, a_key, b_key in entries:
            (ra, x), (y, rb) = shapes[a_key], shapes[b_key]
            if len(shapes[a_key]) != 2 or len(shapes[b_key]) != 2 or ra != rb or ra % e:
                raise _refuse(path, f"{module!r}'s lora_A is {list(shapes[a_key])} and lora_B {list(shapes[b_key])}: "
                                    f"not the factors of {e} experts ([{e}*r, in] and [out, r*{e}])")
            for parameter, (d1, d2) in expected.items():
                if (y, x) == (d1, d2) or (x, y) == (d1, d2):
                    break
            else:
                raise _refuse(path, f"{module!r}'s factors ({list(shapes[a_key])}, {list(shapes[b_key])}) fit neither "
                                    f"gate_up_proj [{e}, {dim}, {2 * hidden}] nor down_proj [{e}, {hidden}, {dim}] of "
                                    f"layer {layer}: the adapter was made for another base model")
            if parameter in seen:
                raise _refuse(path, f"the adapter changes layer {layer}'s {parameter} twice")
            layer_r = ra // e
            expected_r = _pattern_value(rank_pattern, module, r)
            if layer_r != expected_r:
                raise _refuse(path, f"{module!r}'s factors have rank {layer_r} per expert, but adapter_config.json "
                                    f"gives it r={expected_r}: the config and the weights do not belong together")
            layer_alpha = _pattern_value(alpha_pattern, module, alpha)
            scale = layer_alpha / math.sqrt(layer_r) if rslora else layer_alpha / layer_r
            # PEFT takes a 3-D parameter as [E, out, in] (Y = d1) unless its module says otherwise; where
            # d1 == d2 the shapes cannot tell, and the layout of the same module's other parameter decides.
            swapped = (y, x) == (d1, d2) if d1 != d2 else None
            seen[parameter] = _ExpertParameter(layer, parameter, a_key, b_key, e, swapped, scale)
        layouts = {p.swapped for p in seen.values() if p.swapped is not None}
        for p in seen.values():
            if p.swapped is None:
                p.swapped = layouts.pop() if layouts else True  # PEFT 0.21 with transformers 5: [E, out, in]
        plans.extend(seen.values())
    return plans
