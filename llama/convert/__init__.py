"""Offline checkpoint tools: Hugging Face <-> Meta conversion, and resharding.

Run as ``python -m llama.convert COMMAND ...`` (:mod:`llama.convert.cli`)::

    python -m llama.convert hf_to_meta HF_DIR META_DIR [--model_parallel_size N]
    python -m llama.convert meta_to_hf META_DIR HF_DIR [--max_position_embeddings L] [--max_shard_size_gb G]
    python -m llama.convert reshard META_DIR OUT_DIR --model_parallel_size N
    python -m llama.convert merge_lora META_DIR ADAPTER_DIR OUT_DIR [--model_parallel_size N]

Every split of a tensor over shards comes from :data:`llama.layers.tensor_parallel.SHARD_AXES`
(through :func:`~llama.layers.tensor_parallel.holder_region` / :func:`~llama.layers.tensor_parallel.shard_shape`),
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

Modules: :mod:`~llama.convert.commands` (the three commands), :mod:`~llama.convert.config`
(config.json <-> params.json), :mod:`~llama.convert.names` (tensor names, RoPE rows),
:mod:`~llama.convert.hf_weights` (reading HF weights), :mod:`~llama.convert.files` (what
the commands share about files; the directories' checks, without torch, in
:mod:`~llama.convert.paths`), :mod:`~llama.convert.hf_tokenizer` (HF tokenizer files).

Llama 4 (``Llama4ForCausalLM``, or a multimodal ``Llama4ForConditionalGeneration``: its
language model and its image encoder, ``vision_config`` <-> params.json's ``vision_args``)
differs again: its q/k rows are *not* permuted (HF's Llama 4 rotates interleaved pairs, as
Meta does, in the text model and the image encoder alike); the router is stored transposed;
the experts' w1 and w3 are one ``gate_up_proj`` (E, dim, 2*hidden); the dense width is
``intermediate_size_mlp`` and the experts' ``intermediate_size`` (reproduced through
``ffn_exp``).  The image encoder's tensors are renamed only (``vision_embeddings.*`` <->
``vision_model.*``, ``vision_projection`` <-> ``multi_modal_projector.linear_1``); a
``vision_config`` with no Meta equivalent is logged and its tensors skipped.
"""

from __future__ import annotations

from llama.runtime.lazy import lazy_exports

# module -> the public names it defines; imported on first use, so that ``python -m
# llama.convert --help`` answers before torch is imported
_EXPORTS = {
    "commands": ("hf_to_meta", "meta_to_hf", "reshard", "merge_lora"),
    "config": ("hf_config_to_params", "params_to_hf_config", "llama4_config_to_params", "ffn_params_for"),
    "names": ("hf_name", "hf_to_meta_rope_rows", "meta_to_hf_rope_rows"),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
