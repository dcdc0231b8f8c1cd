"""params.json: every field is type- and range-checked, naming the key and the file.

Values of the wrong type used to be accepted and change the model (``"use_scaled_rope":
"false"`` is a true string, so it turned scaled RoPE on); zero or infinite numbers
failed later inside the model code with a raw ZeroDivisionError/OverflowError.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest

from llama.args import FIELD_RULES, ModelArgs

GOOD = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=556, multiple_of=32, ffn_dim_multiplier=1.3,
            norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True, rope_scaling_factor=8.0)

# (key, bad value): wrong types, booleans where numbers belong, and out-of-range numbers.
BAD_VALUES = [
    ("use_scaled_rope", "false"),
    ("use_scaled_rope", "true"),
    ("use_scaled_rope", 0),
    ("use_scaled_rope", 1),
    ("use_scaled_rope", None),
    ("dim", "64"),
    ("dim", 64.0),
    ("dim", True),
    ("n_layers", 0),
    ("n_layers", -2),
    ("n_heads", 4.5),
    ("n_kv_heads", 0),
    ("n_kv_heads", "2"),
    ("vocab_size", -2),
    ("vocab_size", 0),
    ("vocab_size", 556.0),
    ("multiple_of", 0),
    ("ffn_dim_multiplier", math.inf),
    ("ffn_dim_multiplier", math.nan),
    ("ffn_dim_multiplier", 0),
    ("ffn_dim_multiplier", -1.3),
    ("ffn_dim_multiplier", "1.3"),
    ("ffn_dim_multiplier", True),
    ("norm_eps", 0),
    ("norm_eps", math.nan),
    ("norm_eps", "tiny"),
    ("rope_theta", math.inf),
    ("rope_theta", -10000.0),
    ("rope_scaling_factor", 0),
    ("rope_scaling_factor", math.inf),
    ("rope_scaling_factor", "8"),
    ("rope_low_freq_factor", 0),
    ("rope_low_freq_factor", -1.0),
    ("rope_high_freq_factor", math.inf),
    # (rope_high_freq_factor null means "the family's default", 4 or Llama 4's 1, like rope_scaling_factor's null)
    ("rope_original_context_len", 0),
    ("rope_original_context_len", 8192.5),
]


@pytest.mark.parametrize("key, value", BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_bad_value_is_refused_naming_key_and_file(tmp_path, key, value):
    path = tmp_path / "params.json"
    path.write_text(json.dumps({**GOOD, key: value}))  # json writes nan/inf as NaN/Infinity, as Python reads them
    with pytest.raises(ValueError) as info:
        ModelArgs.from_json(path)
    text = str(info.value)
    assert str(path) in text and f"{key} must be" in text, text


def test_string_false_no_longer_turns_scaled_rope_on(tmp_path):
    """The original bug: the string "false" is truthy."""
    path = tmp_path / "params.json"
    path.write_text(json.dumps({**GOOD, "use_scaled_rope": "false"}))
    with pytest.raises(ValueError, match=r"use_scaled_rope must be true or false, got 'false'"):
        ModelArgs.from_json(path)


def test_zero_width_feed_forward_is_refused():
    with pytest.raises(ValueError, match="feed-forward width 0"):
        ModelArgs(**{**GOOD, "ffn_dim_multiplier": 1e-9})


def test_every_field_has_a_rule():
    """One declaration per field: a field added without its rule is caught here."""
    assert set(FIELD_RULES) == {f.name for f in fields(ModelArgs)}


def test_meta_reference_params_are_accepted():
    """Every text model's params in Meta's own llama-models registry (Llama 2, 3, 3.1,
    3.2, Code Llama ...) passes the checks unchanged: the rules refuse nothing real."""
    from llama_models.sku_list import all_registered_models

    checked = 0
    for model in all_registered_models():
        params = dict(model.arch_args or {})
        if "dim" not in params or "moe_args" in params or "vision_args" in params:
            continue  # Llama 4 and vision towers are other architectures
        known = {f.name for f in fields(ModelArgs)}
        args = ModelArgs.from_dict({k: v for k, v in params.items() if k in known})
        assert args.dim == params["dim"] and args.use_scaled_rope == params.get("use_scaled_rope", False)
        checked += 1
    assert checked >= 20, checked
