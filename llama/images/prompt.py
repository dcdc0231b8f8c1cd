"""What a prompt with images carries besides its token ids (no torch or PIL imported here).

:class:`TileLayout` is the geometry a model's vision arguments give: the tile size, the patch
size and the pixel-shuffle ratio, so how many ``<|patch|>`` tokens one tile takes (Llama 4:
336 / 14 = 24 x 24 patches, shuffled 4 to 1: 144), and at most how many tiles an image is cut
into.  :class:`EncodedDialog` is what a chat format returns for a dialog: the prompt's token ids
and one :class:`PromptImage` per image, in prompt order, each with its ``pixel_values`` and the
positions of its ``<|patch|>`` tokens, where the vision encoder's features replace the token
embeddings (``n_tiles * patches_per_tile`` positions, tile by tile, in the order of
``pixel_values``' tiles).

Llama 3.2 Vision (Meta's ``CrossAttentionTransformer``, Hugging Face's ``Mllama``) cuts an image
differently and puts one ``<|image|>`` token in the prompt for it, whose image the text after it
attends to through cross-attention layers: :class:`MllamaLayout` is its geometry (params.json's
``vision_chunk_size`` and ``vision_max_num_chunks``, and the list of tile arrangements its
aspect-ratio ids index), :class:`MllamaPromptImage` what its encoded prompt carries for each
image.  :func:`image_layout` reads either layout from a model's params.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "MAX_IMAGE_TILES",
    "TileLayout",
    "PromptImage",
    "EncodedDialog",
    "MLLAMA_IMAGE_TOKEN_ID",
    "MllamaLayout",
    "MllamaPromptImage",
    "ImageLayout",
    "image_layout",
    "attended_until",
    "supported_aspect_ratios",
]

# The largest image (width x height) taken by default: 32 Mi pixels, e.g. 8192 x 4096.  Llama 4
# sees at most a 1344 x 1344 canvas (16 tiles), Llama 3.2 Vision 4 tiles of 560 x 560, so a
# larger image only costs decoding.
DEFAULT_MAX_PIXELS = 32 * 1024 * 1024


def _side(value: Any, name: str) -> int:
    """A square size from params.json's ``{"height": h, "width": w}`` (or an object with those
    attributes, or an int)."""
    if isinstance(value, Mapping):
        height, width = value.get("height"), value.get("width")
    elif isinstance(value, int):
        height = width = value
    else:
        height, width = getattr(value, "height", None), getattr(value, "width", None)
    if not isinstance(height, int) or not isinstance(width, int) or height <= 0 or width <= 0:
        raise ValueError(f"vision_args {name} must be a positive size, got {value!r}")
    if height != width:
        raise ValueError(f"vision_args {name} must be square (as Llama 4's is), got {height} x {width}")
    return height


@dataclass(frozen=True)
class TileLayout:
    """How a model cuts an image (Llama 4 Scout's and Maverick's values by default)."""

    image_size: int = 336  # a tile's side in pixels
    patch_size: int = 14  # a ViT patch's side in pixels
    pixel_shuffle_ratio: float = 0.5  # the features' side shrinks by this factor (4x fewer)
    max_num_chunks: int = 16  # at most this many tiles, the global tile not counted

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"the tile size {self.image_size} is not a multiple of the patch size {self.patch_size}")
        if not 0 < self.pixel_shuffle_ratio <= 1:
            raise ValueError(f"pixel_shuffle_ratio must be in (0, 1], got {self.pixel_shuffle_ratio}")
        if self.max_num_chunks < 1:
            raise ValueError(f"max_num_chunks must be at least 1, got {self.max_num_chunks}")

    @classmethod
    def from_vision_args(cls, vision_args: Any, max_num_chunks: int = 16) -> "TileLayout":
        """From params.json's ``vision_args`` (a dict) or an object with the same fields
        (``image_size``, ``patch_size``, ``pixel_shuffle_ratio``)."""
        def get(key: str) -> Any:
            return vision_args.get(key) if isinstance(vision_args, Mapping) else getattr(vision_args, key, None)

        ratio = get("pixel_shuffle_ratio")
        if not isinstance(ratio, (int, float)):
            raise ValueError(f"vision_args needs a pixel_shuffle_ratio, got {ratio!r}")
        return cls(image_size=_side(get("image_size"), "image_size"), patch_size=_side(get("patch_size"), "patch_size"),
                   pixel_shuffle_ratio=float(ratio), max_num_chunks=max_num_chunks)

    @property
    def patches_per_tile(self) -> int:
        """``<|patch|>`` tokens per tile, as Meta's ``ChatFormat._encode_image`` counts them."""
        shuffle = round(1.0 / self.pixel_shuffle_ratio ** 2)
        return (self.image_size // self.patch_size) ** 2 // shuffle

    @property
    def max_tiles(self) -> int:
        """The most tiles an image gives: a grid of ``max_num_chunks`` and the global tile."""
        return self.max_num_chunks + 1


# The most tiles of one image with the layout every model is given (Meta's 16 and the global
# tile): what the memory check counts the encoder's activations for, and the most tiles the
# engine encodes in one call.
MAX_IMAGE_TILES = TileLayout().max_tiles


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of an encoded prompt.

    ``pixel_values``: float32 ``[n_tiles, 3, tile, tile]`` (:mod:`llama.images.preprocess`;
    the global tile last when there is more than one tile).  ``grid``: ``(tiles_y, tiles_x)``.
    ``start``/``end``: the prompt positions of its ``<|image_start|>`` and one past its
    ``<|image_end|>``.  ``patch_positions``: the prompt positions of its ``n_tiles *
    patches_per_tile`` ``<|patch|>`` tokens in order, so that feature ``k`` of the encoder's
    output flattened to ``[n_tiles * patches_per_tile, dim]`` goes to ``patch_positions[k]``.
    """

    pixel_values: "torch.Tensor"
    grid: tuple[int, int]
    start: int
    end: int
    patch_positions: tuple[int, ...] = field(repr=False)

    @property
    def n_tiles(self) -> int:
        return int(self.pixel_values.shape[0])

    @cached_property
    def digest(self) -> str:
        """SHA-256 of what the model sees of the image (its tile grid and pixel values): equal
        images give equal digests, so a cache of prompt blocks can key on it."""
        return _digest(self.pixel_values, self.grid)


def _digest(pixel_values: "torch.Tensor", grid: tuple[int, int]) -> str:
    h = hashlib.sha256(f"{tuple(pixel_values.shape)} {grid}".encode())
    h.update(pixel_values.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --- Llama 3.2 Vision ------------------------------------------------------------------------

# The id an image's place has in a Llama 3.2 Vision prompt: the first id past the tokenizer's
# 128,256 (params.json's vocab_size), which the text model embeds with the first of its 8
# learnable rows.  Meta's ChatFormat writes the tokenizer's <|image|> (128011) and then maps it
# to this id (``_model_input_from_tokens_images``); Hugging Face's processor writes it directly
# (MllamaConfig.image_token_index).
MLLAMA_IMAGE_TOKEN_ID = 128256


def supported_aspect_ratios(max_num_chunks: int) -> list[tuple[int, int]]:
    """Every tile arrangement ``(tiles_y, tiles_x)`` of at most ``max_num_chunks`` tiles, in the
    order of Hugging Face's ``get_all_supported_aspect_ratios`` (``tiles_y`` from 1, then
    ``tiles_x`` from 1): an image's aspect-ratio id is its arrangement's index here plus 1 (0
    stands for no image, in a batch padded to the same number of images).  For 4 tiles:
    ``[(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]``."""
    if max_num_chunks < 1:
        raise ValueError(f"max_num_chunks must be at least 1, got {max_num_chunks}")
    return [(y, x) for y in range(1, max_num_chunks + 1) for x in range(1, max_num_chunks + 1)
            if y * x <= max_num_chunks]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class MllamaLayout:
    """How a Llama 3.2 Vision model cuts an image: onto a canvas of at most ``max_num_chunks``
    tiles of ``chunk_size`` pixels (the Instruct models' and 90B's values by default; the 11B base
    model's tiles are 448)."""

    chunk_size: int = 560  # a tile's side in pixels (params.json's vision_chunk_size)
    max_num_chunks: int = 4  # at most this many tiles an image (vision_max_num_chunks)

    def __post_init__(self) -> None:
        _positive_int(self.chunk_size, "vision_chunk_size")
        _positive_int(self.max_num_chunks, "vision_max_num_chunks")

    @classmethod
    def from_params(cls, params: Any) -> "MllamaLayout":
        """From a params.json (a dict) or an object with its fields (``vision_chunk_size``,
        ``vision_max_num_chunks``; the latter 4 when absent, as Meta's ``ModelArgs`` has it)."""
        def get(key: str, default: Any = None) -> Any:
            return params.get(key, default) if isinstance(params, Mapping) else getattr(params, key, default)

        return cls(chunk_size=get("vision_chunk_size"), max_num_chunks=get("vision_max_num_chunks", 4))

    @property
    def aspect_ratios(self) -> list[tuple[int, int]]:
        """The arrangements ``(tiles_y, tiles_x)`` aspect-ratio ids index (:func:`supported_aspect_ratios`)."""
        return supported_aspect_ratios(self.max_num_chunks)

    def aspect_ratio_id(self, grid: tuple[int, int]) -> int:
        """The id (from 1) of the arrangement ``grid = (tiles_y, tiles_x)``."""
        ratios = self.aspect_ratios
        if grid not in ratios:
            raise ValueError(f"{grid} is not an arrangement of at most {self.max_num_chunks} tiles")
        return ratios.index(grid) + 1

    def grid(self, aspect_ratio_id: int) -> tuple[int, int]:
        """The arrangement ``(tiles_y, tiles_x)`` of aspect-ratio id ``aspect_ratio_id`` (from 1),
        as Meta's encoder takes it (its ``ar``)."""
        ratios = self.aspect_ratios
        if isinstance(aspect_ratio_id, bool) or not isinstance(aspect_ratio_id, int) \
                or not 1 <= aspect_ratio_id <= len(ratios):
            raise ValueError(f"an aspect-ratio id of {self.max_num_chunks} tiles is in [1, {len(ratios)}], "
                             f"got {aspect_ratio_id!r}")
        return ratios[aspect_ratio_id - 1]


@dataclass(frozen=True, eq=False)
class MllamaPromptImage:
    """One image of an encoded Llama 3.2 Vision prompt.

    ``pixel_values``: float32 ``[max_num_chunks, 3, chunk, chunk]``, the image's tiles row by
    row, zeros past them (:func:`llama.images.mllama.tile_image`).  ``grid``: ``(tiles_y,
    tiles_x)``.  ``start``: the prompt position of its ``<|image|>`` token (the text from there on
    attends to it); ``end``: one past it (the span a cache of prompt blocks keys with the image's
    :attr:`digest`).  ``attended_until``: the first position that no longer attends to it, the
    next image's ``<|image|>`` (images whose tokens follow each other are attended together, up
    to where the last of them stops), or ``None`` for the last image: every later position,
    the reply's included.  That is Meta's ``create_vision_mask``, except that for the last of
    two or more images Meta stops at the prompt's end (so its reply sees no image) where
    Hugging Face's generation, and Meta itself for a single image, go on.
    """

    pixel_values: "torch.Tensor"
    grid: tuple[int, int]
    start: int
    end: int
    attended_until: Optional[int]

    @property
    def max_num_chunks(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def num_tiles(self) -> int:
        """How many of the ``pixel_values`` are the image's tiles (the rest are zeros)."""
        return self.grid[0] * self.grid[1]

    @property
    def aspect_ratio_id(self) -> int:
        """Hugging Face's ``aspect_ratio_ids`` entry for the image (:meth:`MllamaLayout.aspect_ratio_id`)."""
        return supported_aspect_ratios(self.max_num_chunks).index(self.grid) + 1

    @cached_property
    def digest(self) -> str:
        """SHA-256 of what the model sees of the image (as :attr:`PromptImage.digest`)."""
        return _digest(self.pixel_values, self.grid)


def attended_until(positions: Sequence[int]) -> list[Optional[int]]:
    """For the ``<|image|>`` tokens at ``positions`` (increasing) of a Llama 3.2 Vision prompt,
    where the text attending to each image stops (:attr:`MllamaPromptImage.attended_until`):
    the next image's token, or, where the next image's token follows at once, wherever that
    image's attention stops; ``None`` for the last image (to the end)."""
    ends: list[Optional[int]] = [None] * len(positions)
    for k in range(len(positions) - 2, -1, -1):
        following = positions[k + 1]
        ends[k] = ends[k + 1] if following == positions[k] + 1 else following
    return ends


# A model's image layout: Llama 4's tiles and patches, or Llama 3.2 Vision's tiles.
ImageLayout = Union[TileLayout, MllamaLayout]


def image_layout(params: Any) -> Optional[ImageLayout]:
    """How the model of ``params`` (its ``ModelArgs`` or params.json as a dict) cuts images:
    a :class:`TileLayout` for Llama 4 (``vision_args``), an :class:`MllamaLayout` for Llama 3.2
    Vision (``vision_chunk_size`` > 0), ``None`` for a model that takes no images."""
    def get(key: str) -> Any:
        return params.get(key) if isinstance(params, Mapping) else getattr(params, key, None)

    if get("vision_args") is not None:
        return TileLayout.from_vision_args(get("vision_args"))
    chunk_size = get("vision_chunk_size")
    if chunk_size is None or (isinstance(chunk_size, int) and chunk_size <= 0):  # Meta's default, -1: text only
        return None
    return MllamaLayout.from_params(params)


@dataclass(frozen=True)
class EncodedDialog:
    """A prompt: its token ids and its images in prompt order (none for a text-only dialog):
    :class:`PromptImage` s for Llama 4, :class:`MllamaPromptImage` s for Llama 3.2 Vision."""

    tokens: list[int]
    images: list[Any] = field(default_factory=list)  # PromptImage or MllamaPromptImage: the engine tells them apart
