"""LoRA fixtures for the tests: tiny Hugging Face Llamas saved by transformers, their Meta
conversions, and PEFT adapters for them made and saved by PEFT itself (``get_peft_model`` +
``save_pretrained``), so the adapter files are PEFT's own format and PEFT's model is the
reference the library is checked against.

PEFT initialises ``lora_B`` to zeros (an adapter that changes nothing, so a test using it
could not fail): :func:`make_peft_adapter` gives A and B random values scaled so that the
adapter changes each layer's output by a sizeable fraction of the base's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

import helpers

# PEFT's names of the seven linear layers of a Llama decoder layer (Meta's wq wk wv wo w1 w3 w2).
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Tiny shapes (as tests/test_hf_folders.py's): Llama 2 / Code Llama (multi-head attention, theta
# 1e4, SentencePiece) and Llama 3.1/3.2 (grouped-query attention, scaled RoPE with original
# context 32 so it acts within the sequences tested, tiktoken).  Untied output in both.
_LLAMA2 = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2)
_LLAMA3 = dict(hidden_size=64, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32},
               bos_token_id=300, eos_token_id=301)
HF_SHAPES = {"llama2": _LLAMA2, "llama3": _LLAMA3}


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """O(1) activations and non-trivial norms (so a swapped norm or a wrong row order shows)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.float().eval()


def tiny_hf_llama(root: Path, family: str = "llama3", seed: int = 0, tokenizer_path: Optional[Path] = None,
                  **config_overrides):
    """(folder, model): a random tiny ``LlamaForCausalLM`` of ``family`` ("llama2" or "llama3"),
    float32, eager attention, saved with ``save_pretrained`` in ``root`` with its tokenizer
    (``tokenizer.model`` beside the weights for Llama 2, under ``original/`` for Llama 3, as the
    published repositories have it).  ``tokenizer_path``: a tokenizer.model to copy (the
    conftest's ``sp_tokenizer_path`` / ``tiny_tiktoken_path``); one is made when not given."""
    import transformers

    from llama.tokenizer import load_tokenizer

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if tokenizer_path is None:
        tokenizer_path = (helpers.train_sentencepiece(root / "_spm") if family == "llama2"
                          else helpers.write_tiny_tiktoken(root / "_tiktoken"))
    vocab = load_tokenizer(tokenizer_path).n_words
    kw = {**HF_SHAPES[family], "vocab_size": vocab, "tie_word_embeddings": False, "pad_token_id": None,
          **config_overrides}
    config = transformers.LlamaConfig(**kw)
    config._attn_implementation = "eager"
    model = randomize_(transformers.LlamaForCausalLM(config), seed)
    model.save_pretrained(root)
    where = root if family == "llama2" else root / "original"
    where.mkdir(exist_ok=True)
    shutil.copyfile(tokenizer_path, where / "tokenizer.model")
    return root, model


def meta_conversion(hf_dir: Path, out_dir: Path, model_parallel_size: int = 1) -> Path:
    """``hf_dir`` converted to a Meta checkpoint (``llama.convert.hf_to_meta``) in ``out_dir``."""
    from llama.convert import hf_to_meta

    hf_to_meta(hf_dir, Path(out_dir), model_parallel_size=model_parallel_size)
    return Path(out_dir)


def load_hf(hf_dir: Path):
    """The float32 ``LlamaForCausalLM`` saved in ``hf_dir`` (eager attention), in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def make_peft_adapter(hf_model_dir: Union[Path, torch.nn.Module], out_dir: Path, r: int = 8, alpha: float = 16,
                      target_modules: Union[Sequence[str], str] = ALL_TARGETS, use_rslora: bool = False,
                      seed: int = 0, strength: float = 0.3, safe_serialization: bool = True,
                      **config_kw) -> Path:
    """A PEFT LoRA adapter for the model in ``hf_model_dir`` (a folder, or the model itself, which is
    left unchanged), saved by PEFT's ``save_pretrained`` in ``out_dir`` (returned):
    ``adapter_config.json`` + ``adapter_model.safetensors`` (``adapter_model.bin`` with
    ``safe_serialization=False``).

    A and B are random (seeded), B scaled so the adapter moves each targeted layer's output by
    about ``strength`` times a typical output of the base layer.  ``config_kw`` go to
    ``LoraConfig`` as they are (``layers_to_transform``, ``rank_pattern``, ``use_dora``,
    ``bias``, ``modules_to_save``, ...)."""
    import copy

    import peft

    base = hf_model_dir if isinstance(hf_model_dir, torch.nn.Module) else load_hf(Path(hf_model_dir))
    base = copy.deepcopy(base) if isinstance(hf_model_dir, torch.nn.Module) else base
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules if isinstance(target_modules, str)
                             else list(target_modules), use_rslora=use_rslora, lora_dropout=0.0, **config_kw)
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not (hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {})):
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            rank = a.shape[0]
            scale = module.scaling["default"]
            # x ~ O(1) per feature: x @ A.T ~ O(1) with A ~ N(0, 1/in); B ~ N(0, s^2) gives
            # scale * B @ (A x) ~ scale * s * sqrt(rank), the base layer's output ~ O(1).
            a.copy_(torch.randn(a.shape, generator=g) * a.shape[1] ** -0.5)
            b.copy_(torch.randn(b.shape, generator=g) * strength / (scale * rank ** 0.5))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    return out_dir


def peft_model(hf_model_dir: Union[Path, torch.nn.Module], adapter_dir: Path):
    """PEFT's model: the base in ``hf_model_dir`` (a folder, or the model itself, copied) with the
    adapter in ``adapter_dir`` loaded by ``PeftModel.from_pretrained``, float32, eval mode."""
    import copy

    import peft

    base = copy.deepcopy(hf_model_dir) if isinstance(hf_model_dir, torch.nn.Module) else load_hf(Path(hf_model_dir))
    return peft.PeftModel.from_pretrained(base, adapter_dir).float().eval()


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """A transformers (or PEFT) model's float32 logits for ``tokens`` [batch, seq]."""
    with torch.no_grad():
        return model(tokens).logits.float()


def tiny_hf_llama4(root: Path, tokenizer_path: Path, seed: int = 0):
    """(folder, model): tests/llama4_helpers.py's tiny Llama 4 text model (MoE every 2nd layer,
    with a shared expert; dense layers between) as transformers' ``Llama4ForCausalLM``, saved with
    ``save_pretrained`` in ``root`` with ``tokenizer.model`` beside it."""
    import llama4_helpers as H
    from llama.tokenizer import load_tokenizer

    root = Path(root)
    vocab = load_tokenizer(tokenizer_path).n_words
    params = {**H.LLAMA4_PARAMS, "vocab_size": vocab}
    model = H.build_hf_llama4(params, H.random_llama4_weights(params, vocab, seed=seed), max_pos=256)
    model.save_pretrained(root)
    shutil.copyfile(tokenizer_path, root / "tokenizer.model")
    return root, model.float().eval()
