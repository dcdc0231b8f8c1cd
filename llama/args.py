"""Model hyper-parameters, read from a checkpoint's ``params.json``.

Llama 2 and Llama 3.x differ only in the values here (and in the tokenizer file
that ships beside them); the model code has no family switch.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Union

logger = logging.getLogger(__name__)

# Keys Meta's params.json files carry that describe things this text-only library
# does not run (vision towers, quantised/LoRA variants).  They are accepted with a
# warning so such a checkpoint's text part can still be tried.
_IGNORED_KEYS = {
    "vision_chunk_size",
    "vision_max_num_chunks",
    "vision_num_cross_attention_layers",
    "vision_model",
    "quantization_args",
    "lora_args",
}


def read_json_object(path: Path, where: str, what: str) -> dict:
    """The JSON object in ``path``; ``FileNotFoundError``/``ValueError`` naming the file otherwise.
    ``where`` says where the file should be, ``what`` what it should describe."""
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found at {path}: {where}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object of {what}, got {type(value).__name__}")
    return value


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
    "rope_high_freq_factor": _POSITIVE_NUMBER,
    "rope_original_context_len": _POSITIVE_INT,
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
    n_kv_heads: Optional[int] = None  # key/value heads (grouped-query attention); None = n_heads
    vocab_size: int = -1  # -1 (Llama 2): take it from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None  # scales the SwiGLU hidden size (Llama 2 70B, Llama 3)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base: 1e4 Llama 2, 1e6 Code Llama, 5e5 Llama 3
    use_scaled_rope: bool = False  # Llama 3.1+: stretch low RoPE frequencies for long context
    # Llama 3.1-style RoPE scaling.  Meta's params.json rarely writes these; the
    # defaults are Llama 3.1's.
    rope_scaling_factor: Optional[float] = None  # None with use_scaled_rope: 8, or 32 for Llama 3.2 1B/3B shapes
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context_len: int = 8192  # context length the unscaled model was trained for

    max_batch_size: int = 32  # KV-cache rows (set by Llama.build)
    max_seq_len: int = 2048  # KV-cache length (set by Llama.build)

    def __post_init__(self) -> None:
        self._check_fields()  # before deriving defaults from them
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.use_scaled_rope and self.rope_scaling_factor is None:
            self.rope_scaling_factor = self._default_rope_scaling_factor()
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field for values no model can be built from:
        each field against its :data:`FIELD_RULES` entry, then the rules between fields."""
        self._check_fields()
        if self.dim % self.n_heads:
            raise ValueError(f"params: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"params: head dim {self.dim // self.n_heads} must be even for rotary embeddings")
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"params: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.ffn_hidden_dim <= 0:
            raise ValueError(
                f"params: ffn_dim_multiplier={self.ffn_dim_multiplier} makes the feed-forward width "
                f"{self.ffn_hidden_dim}; it must give a positive width"
            )
        if self.use_scaled_rope and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ValueError("params: rope_high_freq_factor must be greater than rope_low_freq_factor")

    def _check_fields(self) -> None:
        for f in fields(self):
            rule = FIELD_RULES.get(f.name)
            if rule is None:  # a field added without its rule: a bug in this file, not in params.json
                raise TypeError(f"ModelArgs.{f.name} has no entry in FIELD_RULES")
            problem = rule.problem(getattr(self, f.name))
            if problem:
                raise ValueError(f"params: {f.name} {problem}")

    def _default_rope_scaling_factor(self) -> float:
        """8 (Llama 3.1), except for the shapes of Llama 3.2 1B and 3B, whose params.json
        also name no factor but which were trained with 32 (their Hugging Face configs
        say 32, and Meta's maintainers confirmed it)."""
        shape = (self.dim, self.n_layers, self.n_heads, self.n_kv_heads)
        if shape in _LLAMA_3_2_SMALL_SHAPES:
            logger.info("params.json: Llama 3.2 %s shape without rope_scaling_factor: using 32",
                        _LLAMA_3_2_SMALL_SHAPES[shape])
            return 32.0
        return 8.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, by Meta's rule: 2/3 of 4*dim, scaled, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], **overrides: Any) -> "ModelArgs":
        """Build from a ``params.json`` mapping; unknown keys are logged and skipped."""
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
