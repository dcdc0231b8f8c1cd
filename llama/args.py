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
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.use_scaled_rope and self.rope_scaling_factor is None:
            self.rope_scaling_factor = self._default_rope_scaling_factor()
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` for values no model can be built from."""
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "max_batch_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"params: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.vocab_size, int) or (self.vocab_size <= 0 and self.vocab_size != -1):
            raise ValueError(f"params: vocab_size must be a positive integer or -1, got {self.vocab_size!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"params: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"params: head dim {self.dim // self.n_heads} must be even for rotary embeddings")
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"params: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"params: {name} must be a positive number, got {value!r}")
        if self.ffn_dim_multiplier is not None and not (
            isinstance(self.ffn_dim_multiplier, (int, float)) and self.ffn_dim_multiplier > 0
        ):
            raise ValueError(f"params: ffn_dim_multiplier must be a positive number, got {self.ffn_dim_multiplier!r}")
        if self.rope_scaling_factor is not None and not self.rope_scaling_factor > 0:
            raise ValueError(f"params: rope_scaling_factor must be positive, got {self.rope_scaling_factor!r}")
        if self.use_scaled_rope and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ValueError("params: rope_high_freq_factor must be greater than rope_low_freq_factor")

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
