"""Llama 3.2 Vision fixtures for the tests: a tiny random ``MllamaForConditionalGeneration`` and
inputs for it, written independently of ``llama.vision_mllama`` / ``llama.convert.mllama`` where
they state a convention (the canvases, Hugging Face's per-aspect-ratio tile rows).

The tiny shape: tiles of 28 pixels in 14-pixel patches (a 2 x 2 grid: 5 tokens a tile with the
class token), up to 4 tiles an image; a 4-block ViT of width 32 (2 heads) and a 2-block gated
global transformer; a text model of width 64 with 4 self-attention layers and 2 cross-attention
layers (Meta's schedule: before layers 1 and 3, Hugging Face's layers 1 and 4 of 6).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

VOCAB = 556  # the tiny tiktoken tokenizer's; <|image|> is id 556, the first learnt row after the vocabulary
IMAGE = VOCAB
TILE = 28
CHUNKS = 4
# Hugging Face's canvases for 4 tiles, as its MllamaVisionConfig documents them (id = index + 1).
CANVASES = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]
# transformers 5 collects a block's *output* as intermediate layer i (transformers 4 and Meta: its
# input).  The HF model is built with these, Meta's encoder takes each + 1: the same features.
HF_INTERMEDIATE = [0, 2]
META_INTERMEDIATE = [1, 3]


def ratio_id(a: int, b: int) -> int:
    return CANVASES.index((a, b)) + 1


def precomputed_rows(table: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rows per aspect-ratio id of Meta's per-place table [T, T, n, dim] (as its
    conversion script writes them): row i holds ``table[:a, :b]`` of canvas i, zero elsewhere."""
    t, _, n, dim = table.shape
    rows = torch.zeros(len(CANVASES) + 1, t, n, dim)
    for i, (a, b) in enumerate(CANVASES, start=1):
        for tile in range(a * b):
            rows[i, tile] = table[tile // b, tile % b]
    return rows.flatten(1)


def hf_config(vocab: int = VOCAB):
    """The tiny config; ``vocab``: the text model's vocabulary (``<|image|>`` is id ``vocab``)."""
    import transformers

    text = transformers.MllamaTextConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=176, cross_attention_layers=[1, 4], rms_norm_eps=1e-5, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    vision = transformers.MllamaVisionConfig(
        hidden_size=32, num_hidden_layers=4, num_global_layers=2, attention_heads=2, intermediate_size=64,
        vision_output_dim=96, image_size=TILE, patch_size=14, max_num_tiles=CHUNKS,
        intermediate_layers_indices=HF_INTERMEDIATE)
    return transformers.MllamaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     image_token_index=vocab)


def random_hf_model(seed: int = 0, vocab: int = VOCAB):
    """A float32 MllamaForConditionalGeneration with every weight random (gates included: zero
    gates would hide the cross-attention), its tile rows those of one Meta table each (as every
    checkpoint converted from Meta's)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.MllamaForConditionalGeneration(hf_config(vocab)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if "gate" in name else 0.1)
        vision = model.model.vision_model
        vision.pre_tile_positional_embedding.embedding.weight.copy_(precomputed_rows(torch.randn(4, 4, 1, 32) * 0.1))
        vision.post_tile_positional_embedding.embedding.weight.copy_(precomputed_rows(torch.randn(4, 4, 1, 32) * 0.1))
        vision.gated_positional_embedding.tile_embedding.weight.copy_(precomputed_rows(torch.randn(4, 4, 5, 32) * 0.1))
    return model


def pixels(canvases: list[tuple[int, int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [1, N, 4, 3, 28, 28], zero past each image's tiles; aspect_ratio_ids [1, N])."""
    g = torch.Generator().manual_seed(seed)
    values = torch.zeros(1, len(canvases), CHUNKS, 3, TILE, TILE)
    for i, (a, b) in enumerate(canvases):
        values[0, i, : a * b] = torch.randn(a * b, 3, TILE, TILE, generator=g)
    return values, torch.tensor([[ratio_id(a, b) for a, b in canvases]])


def hf_masks(tokens: list[int], canvases: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross_attention_mask [1, L, N, 4], aspect_ratio_mask [1, N, 4]) as Hugging Face's processor
    makes them (its own functions)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    tiles = [[a * b for a, b in canvases]]
    dense = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(tokens, IMAGE)], tiles, CHUNKS, len(tokens))
    aspect = torch.zeros(1, len(canvases), CHUNKS, dtype=torch.long)
    for i, n in enumerate(tiles[0]):
        aspect[0, i, :n] = 1
    return torch.tensor(dense), aspect


@contextlib.contextmanager
def meta_row_masking() -> Iterator[None]:
    """Hugging Face's cross-attention with Meta's rule for text before any image.  Meta's
    ``CrossAttention`` multiplies its output by ``full_text_row_masked_out_mask`` (such rows add
    nothing); transformers applies that mask to the feed-forward branch only, so its attention
    branch adds an average over all vision tokens to those rows.  Within this context the
    attention output is masked as Meta's is (the mask is the one transformers computes itself)."""
    from transformers.models.mllama import modeling_mllama as mm

    layer_forward, attention_forward = mm.MllamaCrossAttentionDecoderLayer.forward, mm.MllamaTextCrossAttention.forward
    rows: dict[str, torch.Tensor] = {}

    def patched_layer(self, hidden_states, *args, full_text_row_masked_out_mask=None, **kwargs):
        rows["mask"] = full_text_row_masked_out_mask
        return layer_forward(self, hidden_states, *args, full_text_row_masked_out_mask=full_text_row_masked_out_mask,
                             **kwargs)

    def patched_attention(self, *args, **kwargs):
        out, weights = attention_forward(self, *args, **kwargs)
        return out * rows["mask"][:, 0], weights

    mm.MllamaCrossAttentionDecoderLayer.forward, mm.MllamaTextCrossAttention.forward = patched_layer, patched_attention
    try:
        yield
    finally:
        mm.MllamaCrossAttentionDecoderLayer.forward, mm.MllamaTextCrossAttention.forward = (layer_forward,
                                                                                            attention_forward)


def meta_multimodal():
    """llama-models' ``llama3.multimodal.model`` (Meta's Llama 3.2 Vision reference), imported with
    the test stand-in for torchvision (``meta_images``) where torchvision is missing: its
    ``image_transform`` imports torchvision, which the model code itself never calls."""
    import importlib
    import sys

    import pytest

    from meta_images import fake_torchvision

    with pytest.MonkeyPatch.context() as patch:
        if "torchvision" not in sys.modules:
            try:
                import torchvision  # noqa: F401
            except ImportError:
                for name, module in fake_torchvision().items():
                    patch.setitem(sys.modules, name, module)
        return importlib.import_module("llama_models.llama3.multimodal.model")


# Llama 3's vocabulary: a model of it takes the prompts Llama 3's tokenizer and chat format write
# (<|image|> is 128256, the first learnt row after it).
LLAMA3_VOCAB = 128256


def write_llama3_vocab_checkpoint(root, seed: int = 0):
    """(the tiny random HF model with Llama 3's vocabulary, the folder of its ``hf_to_meta``
    conversion with Llama 3's tokenizer.model), written under ``root``; params.json's
    intermediate layers moved by transformers 5's shift (see HF_INTERMEDIATE)."""
    import shutil

    import helpers

    hf = random_hf_model(seed, vocab=LLAMA3_VOCAB)
    hf.save_pretrained(root / "hf")
    shutil.copyfile(helpers.llama3_tokenizer_path(), root / "hf" / "tokenizer.model")
    return hf, convert_hf_folder(root / "hf", root / "meta")


def convert_hf_folder(hf_dir, dest, model_parallel_size: int = 1):
    """``hf_to_meta`` of a folder of the tiny model into ``model_parallel_size`` shards, params.json's
    intermediate layers moved by transformers 5's shift (see HF_INTERMEDIATE); ``dest``."""
    import json

    from llama.convert import hf_to_meta

    hf_to_meta(hf_dir, dest, model_parallel_size=model_parallel_size)
    params = json.loads((dest / "params.json").read_text())
    params["mllama_vision_args"]["intermediate_layers"] = META_INTERMEDIATE
    (dest / "params.json").write_text(json.dumps(params))
    return dest
