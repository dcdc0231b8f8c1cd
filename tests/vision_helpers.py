"""Inputs for the Llama 4 vision tests (tests/test_llama4_vision.py and its torchrun worker):
image tiles, and prompts that lay out their ``<|patch|>`` tokens."""

from __future__ import annotations

import torch

# Token ids of the tiny test vocabulary (556 tokens) standing for Llama 4's image tokens; the
# model only needs IMAGE_TOKEN's positions (transformers' image_token_index).
IMAGE_TOKEN, IMAGE_START, IMAGE_END, IMAGE_MARK, TILE_X, TILE_Y = 500, 501, 502, 503, 504, 505
IMAGE_SIZE, PATCH_SIZE = 56, 7  # an 8 x 8 patch grid: 16 features a tile after the pixel shuffle


def pixels(n_tiles: int, seed: int = 0) -> torch.Tensor:
    """Tiles as preprocessing gives them: float32 [n_tiles, 3, S, S], values in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n_tiles, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g) * 2 - 1


def image_tokens(n_tiles: int, patches: int) -> list[int]:
    """An image's tokens as Meta's chat format lays them out: one tile, or a 2 x ((n - 1) / 2)
    grid of tiles with separators and the global tile after <|image|>."""
    if n_tiles == 1:
        return [IMAGE_START, IMAGE_MARK] + [IMAGE_TOKEN] * patches + [IMAGE_END]
    rows, cols = 2, (n_tiles - 1) // 2
    out = [IMAGE_START]
    for _ in range(rows):
        for x in range(cols):
            out += [IMAGE_TOKEN] * patches + ([TILE_X] if x < cols - 1 else [])
        out.append(TILE_Y)
    return out + [IMAGE_MARK] + [IMAGE_TOKEN] * patches + [IMAGE_END]


def prompt_with_images(images: list[int], patches: int, seed: int = 0) -> torch.Tensor:
    """(1, T) token ids: text, then each image (its tile count) between runs of text."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = torch.randint(3, 300, (5,), generator=g).tolist()
    for n_tiles in images:
        out += image_tokens(n_tiles, patches) + torch.randint(3, 300, (4,), generator=g).tolist()
    return torch.tensor([out])
