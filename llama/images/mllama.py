"""An image made into Llama 3.2 Vision's tiles, in PIL and torch (no torchvision).

Meta's ``llama3/multimodal/image_transform.py`` (``VariableSizeImageTransform`` with
``size = vision_chunk_size``, ``max_num_chunks = vision_max_num_chunks``), step for step; it is
Llama 4's tiling with other numbers and without a global tile, so the steps are
:func:`llama.images.preprocess.canvas_tiles`'s:

* the canvases: every arrangement of ``a x b`` tiles with ``a * b <= max_num_chunks`` (4);
* the best canvas for the image: the least upscaling (scale >= 1) at which it fits one without
  distortion, or if none the least downscaling; among canvases at that scale, the smallest;
* the image resized without distortion into that canvas (bilinear, as PIL does it), but never
  upscaled past one tile's size along a side that is smaller than that;
* padded with black to the canvas (at the top left), scaled to [0, 1], normalised with CLIP's
  mean and std per channel, and cut into ``chunk x chunk`` tiles, row by row;
* zero tiles after them up to ``max_num_chunks``, as Meta's model (``_stack_images``) and
  Hugging Face's processor (``pack_images``) pad them, so that every image has the same shape.

The image is read and checked by :func:`llama.images.preprocess.load_image`, shared with Llama 4
(its limits, decompression-bomb checks and EXIF orientation).  One difference from Meta's
Llama 3.2 chat format, which makes an image RGB with ``convert("RGB")``: an image with
transparency is composited on white, as Hugging Face's ``MllamaImageProcessor`` (and Meta's
Llama 4 code) do, where ``convert("RGB")`` would show whatever colour the transparent pixels
hold (often black).

:func:`stack_images` lays the images of a batch of prompts out as Hugging Face's
``MllamaForConditionalGeneration.forward`` takes them (``pixel_values`` ``[B, n_images,
max_num_chunks, 3, S, S]``, ``aspect_ratio_ids``, ``aspect_ratio_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch
from PIL import Image

from llama.images.preprocess import ImageSource, canvas_tiles, load_image
from llama.images.prompt import DEFAULT_MAX_PIXELS, MllamaLayout, MllamaPromptImage, supported_aspect_ratios

__all__ = ["CLIP_MEAN", "CLIP_STD", "MllamaImage", "MllamaBatch", "tile_image", "preprocess_image", "stack_images"]

# OpenAI CLIP's per-channel mean and std (RGB), Meta's VariableSizeImageTransform's.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class MllamaImage:
    """One image as Llama 3.2 Vision's encoder takes it.

    ``pixel_values``: float32 ``[max_num_chunks, 3, chunk, chunk]``, the image's
    ``tiles_y * tiles_x`` tiles row by row (left to right, top to bottom), normalised with CLIP's
    mean and std, then zeros.  ``grid``: ``(tiles_y, tiles_x)``, the tiles down and across.
    """

    pixel_values: torch.Tensor
    grid: tuple[int, int]

    @property
    def num_tiles(self) -> int:
        """How many of the ``pixel_values`` are the image's tiles (the rest are zeros)."""
        return self.grid[0] * self.grid[1]

    @property
    def aspect_ratio_id(self) -> int:
        """Hugging Face's ``aspect_ratio_ids`` entry for the image: its grid's index (from 1) in
        :func:`llama.images.prompt.supported_aspect_ratios`."""
        return supported_aspect_ratios(int(self.pixel_values.shape[0])).index(self.grid) + 1


def tile_image(image: Image.Image, layout: MllamaLayout = MllamaLayout()) -> MllamaImage:
    """An RGB image (as :func:`~llama.images.preprocess.load_image` gives) cut into Llama 3.2
    Vision's tiles (module doc)."""
    size, chunks = layout.chunk_size, layout.max_num_chunks
    tiles, grid = canvas_tiles(image, tile_size=size, max_num_chunks=chunks, mean=CLIP_MEAN, std=CLIP_STD)
    pixel_values = torch.zeros(chunks, 3, size, size, dtype=torch.float32)
    pixel_values[: tiles.shape[0]] = tiles
    return MllamaImage(pixel_values=pixel_values, grid=grid)


def preprocess_image(source: ImageSource, layout: MllamaLayout = MllamaLayout(), *,
                     max_pixels: int = DEFAULT_MAX_PIXELS) -> MllamaImage:
    """:func:`~llama.images.preprocess.load_image` then :func:`tile_image`: ``source`` (a
    ``PIL.Image``, a file's bytes or a path) checked, decoded and tiled; ``ValueError`` (or
    ``FileNotFoundError``) saying what is wrong with an image that cannot be."""
    return tile_image(load_image(source, max_pixels=max_pixels), layout)


@dataclass(frozen=True)
class MllamaBatch:
    """The images of a batch of prompts, as Hugging Face's ``MllamaForConditionalGeneration``
    takes them (``N``: the most images a prompt of the batch has; a prompt with fewer has zero
    images after its own).

    ``pixel_values``: float32 ``[B, N, max_num_chunks, 3, chunk, chunk]``.
    ``aspect_ratio_ids``: int64 ``[B, N]``, each image's id (from 1), 0 for padding.
    ``aspect_ratio_mask``: int64 ``[B, N, max_num_chunks]``, 1 for an image's tiles (and, as
    Hugging Face's processor writes it, for the first tile of every entry, padding included).
    ``num_tiles``: each prompt's images' tile counts.
    """

    pixel_values: torch.Tensor
    aspect_ratio_ids: torch.Tensor
    aspect_ratio_mask: torch.Tensor
    num_tiles: list[list[int]]


def stack_images(images: Sequence[Sequence[Union[MllamaImage, MllamaPromptImage]]]) -> MllamaBatch:
    """Each prompt's images (:class:`MllamaImage` or the chat format's
    :class:`~llama.images.prompt.MllamaPromptImage`, in prompt order) laid out as one batch
    (:class:`MllamaBatch`).  ``ValueError`` when no prompt has an image, or when the images were
    cut for different layouts."""
    flat = [image for row in images for image in row]
    if not flat:
        raise ValueError("none of the prompts holds an image: there is nothing to stack")
    shape = tuple(flat[0].pixel_values.shape)
    for image in flat:
        if tuple(image.pixel_values.shape) != shape:
            raise ValueError(f"the images were cut for different layouts: pixel_values {tuple(shape)} and "
                             f"{tuple(image.pixel_values.shape)}")
    chunks = shape[0]
    n = max(len(row) for row in images)
    pixel_values = torch.zeros(len(images), n, *shape, dtype=torch.float32)
    ids = torch.zeros(len(images), n, dtype=torch.int64)
    mask = torch.zeros(len(images), n, chunks, dtype=torch.int64)
    mask[:, :, 0] = 1
    for b, row in enumerate(images):
        for k, image in enumerate(row):
            pixel_values[b, k] = image.pixel_values
            ids[b, k] = image.aspect_ratio_id
            mask[b, k, : image.num_tiles] = 1
    return MllamaBatch(pixel_values=pixel_values, aspect_ratio_ids=ids, aspect_ratio_mask=mask,
                       num_tiles=[[image.num_tiles for image in row] for row in images])
