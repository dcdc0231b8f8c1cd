"""Model hyper-parameters (:class:`ModelArgs`), as a checkpoint's ``params.json`` gives them.

Llama 2, Llama 3.x and Llama 4 differ only in the values here (and in the tokenizer
file that ships beside them); the model code has no family switch.  Llama 4's
mixture of experts, no-RoPE layers and chunked attention are fields like any other.
The model (:mod:`llama.model`) reads these; the checkpoint code reads ``params.json``
into them (:meth:`ModelArgs.from_json`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from llama.runtime.json_file import read_json_object

logger = logging.getLogger(__name__)

# Keys Meta's params.json files carry that describe things this library does not run
# (quantised/LoRA variants; ``vision_model``, an older spelling of the cross-attention layer
# count).  They are accepted with a warning so such a checkpoint's text part can still be tried.
_IGNORED_KEYS = {
    "vision_model",
    "quantization_args",
    "lora_args",
}


@dataclass
class MoEArgs:
    """Llama 4's mixture-of-experts settings (``moe_args`` in ``params.json``)."""

    num_experts: int = -1  # routed experts per MoE layer (Scout 16, Maverick 128)
    capacity_factor: float = 1.0  # only enters the expert width, through auto_scale_F
    auto_scale_F: bool = True  # noqa: N815 (Meta's key) shrink each expert so active parameters match a dense layer
    top_k: int = 1  # experts each token is sent to
    interleave_moe_layer_step: int = 1  # every step-th layer is MoE (1: all; Maverick 2: every other)

    @classmethod
    def from_value(cls, value: Any) -> "MoEArgs":
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"params: moe_args must be an object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            logger.warning("params.json: ignoring unknown moe_args keys %s", unknown)
        try:
            return cls(**{k: v for k, v in value.items() if k in known})
        except TypeError as e:
            raise ValueError(f"params: moe_args: {e}") from None

    def validate(self, n_layers: int) -> None:
        for name in ("num_experts", "top_k", "interleave_moe_layer_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"params: moe_args.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"params: moe_args.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if not isinstance(self.capacity_factor, (int, float)) or not self.capacity_factor > 0:
            raise ValueError(f"params: moe_args.capacity_factor must be positive, got {self.capacity_factor!r}")
        if self.interleave_moe_layer_step > n_layers:
            raise ValueError(
                f"params: moe_args.interleave_moe_layer_step={self.interleave_moe_layer_step} leaves no MoE layer "
                f"among n_layers={n_layers}"
            )


def _square_size(value: Any, what: str) -> int:
    """``{"height": h, "width": w}`` (Meta's ``Size``) with h == w, or a plain integer: the side."""
    if isinstance(value, Mapping):
        height, width = value.get("height"), value.get("width")
        if height != width:
            raise ValueError(f"params: vision_args.{what} must be square (Meta's encoder and its pixel shuffle "
                             f"take square tiles), got height={height!r}, width={width!r}")
        value = height
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"params: vision_args.{what} must be a positive integer or {{\"height\": n, \"width\": n}}, "
                         f"got {value!r}")
    return value


@dataclass
class VisionArgs:
    """Llama 4's image encoder (``vision_args`` in ``params.json``, Meta's ``VisionArgs``): a ViT
    over square tiles of ``image_size`` pixels cut into ``patch_size`` patches, ``n_layers``
    blocks of width ``dim``, then a pixel shuffle (``pixel_shuffle_ratio``: 0.5 merges 2x2
    patches) and an MLP adapter to ``output_dim`` (the text model's ``vision_projection``
    takes it to the text width).  Scout and Maverick: 336, 14, 1408, 34 layers, 16 heads, MLP
    ratio 4, output 4096, ratio 0.5: 144 features a tile."""

    image_size: int  # the tile's side in pixels (params.json: {"height": 336, "width": 336})
    patch_size: int  # a patch's side in pixels
    dim: int
    n_layers: int
    n_heads: int
    mlp_ratio: float  # the blocks' MLP width, as a multiple of dim
    output_dim: int  # the adapter's output width
    pixel_shuffle_ratio: float

    @classmethod
    def from_value(cls, value: Any) -> "VisionArgs":
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"params: vision_args must be an object, got {value!r}")
        known = {f.name for f in fields(cls)}
        missing = sorted(known - set(value))
        if missing:
            raise ValueError(f"params: vision_args lacks {missing}")
        unknown = sorted(set(value) - known)
        if unknown:
            logger.warning("params.json: ignoring unknown vision_args keys %s", unknown)
        kwargs = {k: v for k, v in value.items() if k in known}
        kwargs["image_size"] = _square_size(kwargs["image_size"], "image_size")
        kwargs["patch_size"] = _square_size(kwargs["patch_size"], "patch_size")
        args = cls(**kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        """ValueError naming the field for values Meta's encoder cannot be built from."""
        for name in ("image_size", "patch_size", "dim", "n_layers", "n_heads", "output_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"params: vision_args.{name} must be a positive integer, got {value!r}")
        for name in ("mlp_ratio", "pixel_shuffle_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"params: vision_args.{name} must be a positive number, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"params: vision_args.image_size={self.image_size} is not a multiple of "
                             f"patch_size={self.patch_size}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ValueError(f"params: vision_args.dim={self.dim} over n_heads={self.n_heads} must give a head "
                             "width divisible by 4 (its 2-D rotary embedding turns x and y by halves of it)")
        ratio = self.pixel_shuffle_ratio
        if not ratio <= 1 or self.grid * ratio != int(self.grid * ratio) or self.dim / ratio**2 != self.adapter_dim:
            raise ValueError(f"params: vision_args.pixel_shuffle_ratio={ratio} must be at most 1 and merge whole "
                             f"patches of the {self.grid}x{self.grid} grid and whole channels of dim={self.dim}")
        if self.hidden_dim <= 0:
            raise ValueError(f"params: vision_args.mlp_ratio={self.mlp_ratio} gives no MLP width")

    @property
    def grid(self) -> int:
        """Patches along a tile's side (336 / 14 = 24)."""
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The width of the blocks' MLPs (Meta's ``int(mlp_ratio * dim)``)."""
        return int(self.mlp_ratio * self.dim)

    @property
    def adapter_dim(self) -> int:
        """The width of a patch after the pixel shuffle: the adapter's input (dim / ratio**2)."""
        return int(self.dim // self.pixel_shuffle_ratio**2)

    @property
    def patches_per_tile(self) -> int:
        """Features (``<|patch|>`` tokens) one tile gives after the pixel shuffle (144 for Scout)."""
        return int(self.grid * self.pixel_shuffle_ratio) ** 2

    def to_params(self) -> dict[str, Any]:
        """As ``params.json`` writes it (Meta's sizes as ``{"height", "width"}``)."""
        return {"image_size": {"height": self.image_size, "width": self.image_size},
                "patch_size": {"height": self.patch_size, "width": self.patch_size},
                "dim": self.dim, "n_layers": self.n_layers, "n_heads": self.n_heads, "mlp_ratio": self.mlp_ratio,
                "output_dim": self.output_dim, "pixel_shuffle_ratio": self.pixel_shuffle_ratio}


# Llama 3.2 Vision's image encoder, as llama-models hard-codes it (``CrossAttentionTransformerVision``).
MLLAMA_INTERMEDIATE_LAYERS = (3, 7, 15, 23, 30)


@dataclass
class MllamaVisionArgs:
    """The tiled image encoder of Llama 3.2 Vision (11B and 90B).  Meta's ``params.json`` names
    none of these (llama-models hard-codes them: the defaults here); ``params.json`` may carry
    them as ``mllama_vision_args`` for other shapes (a small model converted from Hugging Face).

    A ViT of ``n_layers`` blocks of width ``dim`` over each tile's ``patch_size`` patches, then a
    gated ``n_global_layers``-block transformer over all of an image's tiles; the inputs of the
    blocks ``intermediate_layers`` (0-based) are concatenated after the final output, so the
    encoder's output width is ``dim * (len(intermediate_layers) + 1)`` (7680 for 11B/90B)."""

    dim: int = 1280
    n_layers: int = 32
    n_global_layers: int = 8
    n_heads: int = 16
    patch_size: int = 14
    mlp_ratio: float = 4.0
    intermediate_layers: tuple[int, ...] = MLLAMA_INTERMEDIATE_LAYERS

    @classmethod
    def from_value(cls, value: Any) -> "MllamaVisionArgs":
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"params: mllama_vision_args must be an object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            logger.warning("params.json: ignoring unknown mllama_vision_args keys %s", unknown)
        kwargs = {k: v for k, v in value.items() if k in known}
        if "intermediate_layers" in kwargs:
            layers = kwargs["intermediate_layers"]
            if not isinstance(layers, (list, tuple)):
                raise ValueError(f"params: mllama_vision_args.intermediate_layers must be a list, got {layers!r}")
            kwargs["intermediate_layers"] = tuple(layers)
        args = cls(**kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        """ValueError naming the field for shapes the encoder cannot be built with."""
        for name in ("dim", "n_layers", "n_global_layers", "n_heads", "patch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"params: mllama_vision_args.{name} must be a positive integer, got {value!r}")
        if isinstance(self.mlp_ratio, bool) or not isinstance(self.mlp_ratio, (int, float)) \
                or not 0 < self.mlp_ratio < math.inf or self.hidden_dim <= 0:
            raise ValueError(f"params: mllama_vision_args.mlp_ratio must be a positive number, got {self.mlp_ratio!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"params: mllama_vision_args.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        layers = self.intermediate_layers
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in layers) \
                or list(layers) != sorted(set(layers)):
            raise ValueError(f"params: mllama_vision_args.intermediate_layers must be increasing block indices "
                             f"below n_layers={self.n_layers}, got {list(layers)}")

    @property
    def hidden_dim(self) -> int:
        """The blocks' MLP width."""
        return int(self.mlp_ratio * self.dim)

    @property
    def output_dim(self) -> int:
        """Width of the encoder's output: the final features and each intermediate layer's."""
        return self.dim * (len(self.intermediate_layers) + 1)

    def to_params(self) -> dict[str, Any]:
        return {"dim": self.dim, "n_layers": self.n_layers, "n_global_layers": self.n_global_layers,
                "n_heads": self.n_heads, "patch_size": self.patch_size, "mlp_ratio": self.mlp_ratio,
                "intermediate_layers": list(self.intermediate_layers)}


# (dim, n_layers, n_heads, n_kv_heads) of the models whose default RoPE scale factor is 32.
_LLAMA_3_2_SMALL_SHAPES = {(2048, 16, 32, 8): "1B", (3072, 28, 24, 8): "3B"}


@dataclass(frozen=True)
class FieldRule:
    """What one ``params.json`` field may hold.

    ``kind``: ``int`` (not bool), ``float`` (any finite int or float, not bool) or
    ``bool`` (only ``true``/``false``: the string ``"false"`` is refused, not read as
    true).  ``above``: values must be greater than this.  ``also``: extra values
    allowed besides the range (``vocab_size`` -1).  ``optional``: ``null`` allowed.
    """

    kind: type
    above: Optional[float] = None
    also: tuple = ()
    optional: bool = False

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` breaks the rule, or None when it does not."""
        if value is None:
            return None if self.optional else f"must be {self.describe()}, got null"
        if self.kind is object:  # a structured value with its own checks (moe_args)
            return None
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else int):
            ok = False
        elif value in self.also:
            ok = True
        elif not math.isfinite(value):
            return f"must be finite ({self.describe()}), got {value!r}"
        else:
            ok = self.above is None or value > self.above
        return None if ok else f"must be {self.describe()}, got {value!r}"

    def describe(self) -> str:
        if self.kind is bool:
            return "true or false"
        text = "integer" if self.kind is int else "number"
        if self.above == 0:
            text = f"positive {text}"
        elif self.above is not None:
            text = f"{text} greater than {self.above}"
        text = f"a {text}" + "".join(f" or {v}" for v in self.also)
        return text + (" or null" if self.optional else "")


_POSITIVE_INT = FieldRule(int, above=0)
_POSITIVE_NUMBER = FieldRule(float, above=0)

# Every ModelArgs field, one line each: add a field here when adding it to ModelArgs.
FIELD_RULES: dict[str, FieldRule] = {
    "dim": _POSITIVE_INT,
    "n_layers": _POSITIVE_INT,
    "n_heads": _POSITIVE_INT,
    "n_kv_heads": FieldRule(int, above=0, optional=True),
    "vocab_size": FieldRule(int, above=0, also=(-1,)),
    "multiple_of": _POSITIVE_INT,
    "ffn_dim_multiplier": FieldRule(float, above=0, optional=True),
    "norm_eps": _POSITIVE_NUMBER,
    "rope_theta": _POSITIVE_NUMBER,
    "use_scaled_rope": FieldRule(bool),
    "rope_scaling_factor": FieldRule(float, above=0, optional=True),
    "rope_low_freq_factor": _POSITIVE_NUMBER,
    "rope_high_freq_factor": FieldRule(float, above=0, optional=True),
    "rope_original_context_len": _POSITIVE_INT,
    "head_dim": FieldRule(int, above=0, optional=True),
    "ffn_exp": FieldRule(float, above=0, optional=True),
    "moe_args": FieldRule(object, optional=True),  # checked by MoEArgs.validate
    "attention_chunk_size": FieldRule(int, above=0, optional=True),
    "nope_layer_interval": FieldRule(int, above=0, optional=True),
    "use_qk_norm": FieldRule(bool),
    "attn_temperature_tuning": FieldRule(bool),
    "floor_scale": _POSITIVE_NUMBER,
    "attn_scale": _POSITIVE_NUMBER,
    "vision_args": FieldRule(object, optional=True),  # checked by VisionArgs.validate
    "vision_chunk_size": FieldRule(int, above=0, also=(-1,)),
    "vision_max_num_chunks": _POSITIVE_INT,
    "vision_num_cross_attention_layers": FieldRule(int, above=0, also=(-1,)),
    "mllama_vision_args": FieldRule(object, optional=True),  # checked by MllamaVisionArgs.validate
    "max_batch_size": _POSITIVE_INT,
    "max_seq_len": _POSITIVE_INT,
}


@dataclass
class ModelArgs:
    """Shape of a Llama transformer.

    Field names are Meta's ``params.json`` keys, so a checkpoint's file loads as is.
    """

    dim: int = 4096  # width of the residual stream
    n_layers: int = 32
    n_heads: int = 32  # query heads
    # Fields whose None is a default filled in by __post_init__ are typed as what they hold after it (the
    # type system cannot say "None in the constructor only"): n_kv_heads, rope_high_freq_factor, head_dim.
    n_kv_heads: int = None  # type: ignore[assignment]  # key/value heads (grouped-query attention); None = n_heads
    vocab_size: int = -1  # -1 (Llama 2): take it from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None  # scales the SwiGLU hidden size (Llama 2 70B, Llama 3)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base: 1e4 Llama 2, 1e6 Code Llama, 5e5 Llama 3
    use_scaled_rope: bool = False  # Llama 3.1+: stretch low RoPE frequencies for long context
    # Llama 3.1-style RoPE scaling.  Meta's params.json rarely writes these; the
    # defaults are Llama 3.1's (Llama 4 Scout's: factor 16, high-frequency factor 1).
    rope_scaling_factor: Optional[float] = None  # None with use_scaled_rope: 8, 32 for Llama 3.2 1B/3B, 16 Llama 4
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = None  # type: ignore[assignment]  # None: 4, or 1 for Llama 4
    rope_original_context_len: int = 8192  # context length the unscaled model was trained for

    # Llama 4 (all None/False for earlier families, which leaves their model unchanged).
    head_dim: int = None  # type: ignore[assignment]  # width of one attention head; None: dim // n_heads
    ffn_exp: Optional[float] = None  # experts' FFN width before Meta's rule, as a multiple of dim (None: 4)
    moe_args: Optional[MoEArgs] = None  # mixture-of-experts layers; None: every layer is dense
    attention_chunk_size: Optional[int] = None  # RoPE layers attend only within chunks of this many positions
    nope_layer_interval: Optional[int] = None  # every n-th layer has no positional encoding (global attention)
    use_qk_norm: bool = False  # RMS-normalise queries and keys (no weight) in RoPE layers
    attn_temperature_tuning: bool = False  # scale no-RoPE layers' queries up slowly with the position
    floor_scale: float = 8192.0  # ... by 1 + attn_scale * log(floor((pos + 1) / floor_scale) + 1)
    attn_scale: float = 0.1
    # Llama 4's image encoder (None: a text-only model, or one loaded with vision=False).
    vision_args: Optional[VisionArgs] = None
    # Llama 3.2 Vision (11B, 90B): with vision_chunk_size > 0 the model has a tiled image encoder
    # (llama.vision_mllama) and gated cross-attention layers that attend to its output.
    vision_chunk_size: int = -1  # a tile's side in pixels (448 for 11B-Vision base, 560 Instruct and 90B)
    vision_max_num_chunks: int = 4  # tiles an image is cut into at most
    vision_num_cross_attention_layers: int = -1  # cross-attention layers (8 for 11B, 20 for 90B)
    mllama_vision_args: Optional[MllamaVisionArgs] = None  # the encoder's shape; None: Meta's (MllamaVisionArgs())

    max_batch_size: int = 32  # KV-cache rows (set by Llama.build)
    max_seq_len: int = 2048  # KV-cache length (set by Llama.build)

    def __post_init__(self) -> None:
        self._check_fields()  # before deriving defaults from them
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.moe_args is not None:
            self.moe_args = MoEArgs.from_value(self.moe_args)
        if self.vision_args is not None:
            self.vision_args = VisionArgs.from_value(self.vision_args)
        if self.mllama_vision_args is not None:
            self.mllama_vision_args = MllamaVisionArgs.from_value(self.mllama_vision_args)
        elif self.vision_chunk_size > 0:
            self.mllama_vision_args = MllamaVisionArgs()
        if self.head_dim is None and isinstance(self.dim, int) and isinstance(self.n_heads, int) and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if self.use_scaled_rope and self.rope_scaling_factor is None:
            self.rope_scaling_factor = self._default_rope_scaling_factor()
        if self.rope_high_freq_factor is None:
            # Llama 4 Scout's params.json names neither; Meta's code supplies 16 and 1.
            self.rope_high_freq_factor = 1.0 if self.is_llama4 else 4.0
        self.validate()

    @property
    def is_llama4(self) -> bool:
        """Whether ``params.json`` describes the Llama 4 architecture (it names one of
        the fields only Llama 4 has).  Decides defaults only, never code paths."""
        return self.moe_args is not None or any(
            v is not None for v in (self.attention_chunk_size, self.nope_layer_interval, self.ffn_exp)
        )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field for values no model can be built from:
        each field against its :data:`FIELD_RULES` entry, then the rules between fields."""
        self._check_fields()
        if self.dim % self.n_heads:
            raise ValueError(f"params: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim <= 0:
            raise ValueError(f"params: head_dim must be a positive integer, got {self.head_dim!r}")
        if self.head_dim % 2:
            raise ValueError(f"params: head dim {self.head_dim} must be even for rotary embeddings")
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"params: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.ffn_hidden_dim <= 0:
            raise ValueError(
                f"params: ffn_dim_multiplier={self.ffn_dim_multiplier} makes the feed-forward width "
                f"{self.ffn_hidden_dim}; it must give a positive width"
            )
        if self.use_scaled_rope and not self.rope_high_freq_factor >= self.rope_low_freq_factor:
            raise ValueError("params: rope_high_freq_factor must not be less than rope_low_freq_factor")
        if self.moe_args is not None:
            self.moe_args.validate(self.n_layers)
        if self.vision_args is not None:
            self.vision_args.validate()
        if self.has_cross_attention:
            self._validate_cross_attention()

    @property
    def has_cross_attention(self) -> bool:
        """Llama 3.2 Vision: a tiled image encoder and cross-attention layers (``vision_chunk_size`` > 0)."""
        return self.vision_chunk_size > 0

    def _validate_cross_attention(self) -> None:
        encoder = self.mllama_vision_args
        assert encoder is not None  # set by __post_init__ with vision_chunk_size
        encoder.validate()
        if not 0 < self.vision_num_cross_attention_layers <= self.n_layers:
            raise ValueError(f"params: vision_num_cross_attention_layers={self.vision_num_cross_attention_layers} "
                             f"must be between 1 and n_layers={self.n_layers} (vision_chunk_size is set)")
        if self.vision_chunk_size % encoder.patch_size:
            raise ValueError(f"params: vision_chunk_size={self.vision_chunk_size} is not a multiple of the encoder's "
                             f"patch_size={encoder.patch_size}")
        if self.vision_args is not None or self.is_llama4:
            raise ValueError("params: vision_chunk_size (Llama 3.2 Vision) cannot be combined with Llama 4's fields")

    def fusion_schedule(self) -> list[int]:
        """The self-attention layers (0-based) each cross-attention layer runs before, in order:
        Meta's schedule, spread evenly from the last layer down (11B: 3, 7, ..., 31)."""
        if not self.has_cross_attention:
            return []
        n, k = self.n_layers, self.vision_num_cross_attention_layers
        step = math.ceil(n / k)
        return list(range(n))[::-1][::step][:k][::-1]

    def _check_fields(self) -> None:
        for f in fields(self):
            rule = FIELD_RULES.get(f.name)
            if rule is None:  # a field added without its rule: a bug in this file, not in params.json
                raise TypeError(f"ModelArgs.{f.name} has no entry in FIELD_RULES")
            problem = rule.problem(getattr(self, f.name))
            if problem:
                raise ValueError(f"params: {f.name} {problem}")

    def _default_rope_scaling_factor(self) -> float:
        """8 (Llama 3.1), 16 for Llama 4, and 32 for the shapes of Llama 3.2 1B and 3B, whose params.json
        also name no factor but which were trained with 32 (their Hugging Face configs
        say 32, and Meta's maintainers confirmed it)."""
        if self.is_llama4:
            return 16.0  # Llama 4 Scout, the one Llama 4 with scaled RoPE (llama-models' rule)
        shape = (self.dim, self.n_layers, self.n_heads, self.n_kv_heads)
        if shape in _LLAMA_3_2_SMALL_SHAPES:
            logger.info("params.json: Llama 3.2 %s shape without rope_scaling_factor: using 32",
                        _LLAMA_3_2_SMALL_SHAPES[shape])
            return 32.0
        return 8.0

    @property
    def ffn_base_width(self) -> int:
        """A dense layer's SwiGLU width before ``ffn_dim_multiplier`` and rounding: 2/3 of 4*dim."""
        return int(2 * (4 * self.dim) / 3)

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size of a dense layer, by Meta's rule: :attr:`ffn_base_width`,
        scaled by ``ffn_dim_multiplier``, rounded up to ``multiple_of``."""
        hidden = self.ffn_base_width
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def moe_hidden_dim(self) -> int:
        """Hidden size of each expert (and of the shared expert) in an MoE layer, by
        Meta's Llama 4 rule: 2/3 of ffn_exp*dim, scaled by ffn_dim_multiplier, divided
        by (capacity_factor + 1) with auto_scale_F, rounded up to ``multiple_of``
        (Scout and Maverick: 8192)."""
        if self.moe_args is None:
            raise ValueError("params: this model has no moe_args, so no experts")
        hidden = int(2 * int((4.0 if self.ffn_exp is None else self.ffn_exp) * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        if self.moe_args.auto_scale_F:
            hidden = int(hidden / (self.moe_args.capacity_factor + 1))
        return hidden + (-hidden % self.multiple_of)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layer ``layer_id`` (0-based) is a mixture of experts: every
        ``interleave_moe_layer_step``-th layer, counting from 1."""
        return self.moe_args is not None and (layer_id + 1) % self.moe_args.interleave_moe_layer_step == 0

    def is_nope_layer(self, layer_id: int) -> bool:
        """Layer ``layer_id`` (0-based) has no positional encoding: every
        ``nope_layer_interval``-th layer, counting from 1."""
        return self.nope_layer_interval is not None and (layer_id + 1) % self.nope_layer_interval == 0

    def attention_chunk(self, layer_id: int) -> Optional[int]:
        """Chunk size of layer ``layer_id``'s local attention; None: global attention
        (no-RoPE layers and models without chunking)."""
        return None if self.is_nope_layer(layer_id) else self.attention_chunk_size

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], **overrides: Any) -> "ModelArgs":
        """Build from a ``params.json`` mapping; unknown keys are logged and skipped.
        (Some Llama 4 files nest the fields under ``"model"``; that is unwrapped.)"""
        if isinstance(params.get("model"), Mapping) and "dim" not in params:
            params = params["model"]
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in {**params, **overrides}.items():
            if key in known:
                kwargs[key] = value
            elif key in _IGNORED_KEYS:
                logger.warning("params.json: ignoring %r (not used by this text-only library)", key)
            else:
                logger.warning("params.json: ignoring unknown key %r", key)
        try:
            return cls(**kwargs)
        except TypeError as e:  # e.g. a string where a number belongs
            raise ValueError(f"params: {e}") from None

    @classmethod
    def from_json(cls, path: Union[str, Path], **overrides: Any) -> "ModelArgs":
        """Read ``params.json``; raise ``FileNotFoundError`` / ``ValueError`` with the path when it is unusable."""
        path = Path(path)
        params = read_json_object(path, "a Meta checkpoint directory holds one", "model parameters")
        try:
            return cls.from_dict(params, **overrides)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
