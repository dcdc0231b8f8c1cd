"""What a prompt with images carries besides its token ids (no torch or PIL imported here).

:class:`TileLayout` is the geometry a model's vision arguments give: the tile size, the patch
size and the pixel-shuffle ratio, so how many ``<|patch|>`` tokens one tile takes (Llama 4:
336 / 14 = 24 x 24 patches, shuffled 4 to 1: 144), and at most how many tiles an image is cut
into.  :class:`EncodedDialog` is what a chat format returns for a dialog: the prompt's token ids
and one :class:`PromptImage` per image, in prompt order, each with its ``pixel_values`` and the
positions of its ``<|patch|>`` tokens, where the vision encoder's features replace the token
embeddings (``n_tiles * patches_per_tile`` positions, tile by tile, in the order of
``pixel_values``' tiles).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_MAX_PIXELS", "MAX_IMAGE_TILES", "TileLayout", "PromptImage", "EncodedDialog"]

# The largest image (width x height) taken by default: 32 Mi pixels, e.g. 8192 x 4096.  Llama 4
# sees at most a 1344 x 1344 canvas (16 tiles), so a larger image only costs decoding.
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
        h = hashlib.sha256(f"{tuple(self.pixel_values.shape)} {self.grid}".encode())
        h.update(self.pixel_values.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class EncodedDialog:
    """A prompt: its token ids and its images in prompt order (none for a text-only dialog)."""

    tokens: list[int]
    images: list[PromptImage] = field(default_factory=list)
