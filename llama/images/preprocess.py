"""An image made into Llama 4's tiles, in PIL and torch (no torchvision).

Two steps:

1. :func:`load_image` reads a ``PIL.Image``, the bytes of a file or a path, and checks it
   before any pixel buffer beyond the decoder's own is made: a file PIL calls a decompression
   bomb (over ``PIL.Image.MAX_IMAGE_PIXELS``; PIL only warns up to twice that, we refuse), an
   image over ``max_pixels``, a zero-sized image, a truncated or unreadable file, a format
   other than JPEG, PNG, WebP or GIF: each a ``ValueError`` saying what is wrong and the limit.
   Then the EXIF orientation is applied, a GIF or animated WebP gives its first frame, an
   image with transparency is composited on white, and palette, greyscale and other modes
   are converted to RGB.
2. :func:`tile_image` is Meta's Llama 4 preprocessing (``llama_models/llama4/preprocess.py``
   and its use in ``chat_format.py``), step for step:

   * the canvases: every arrangement of ``a x b`` tiles with ``a * b <= max_num_chunks`` (16);
   * the best canvas for the image: the smallest scale >= 1 at which the image fits one of
     them without distortion (the least upscaling), or if none, the largest scale < 1 (the
     least downscaling); among canvases at that scale, the smallest area;
   * the image resized without distortion into that canvas (bilinear, as PIL does it), but
     never upscaled past one tile's size (336) along a side that is smaller than that;
   * padded with black to the canvas (at the top left), scaled to [0, 1], normalised with
     mean 0.5 and std 0.5 (so [-1, 1]), and cut into 336 x 336 tiles, row by row;
   * when there is more than one tile, a global tile last: the whole image resized (with
     distortion) to 336 x 336 and normalised the same way.

The result is a :class:`PreprocessedImage`: ``pixel_values`` ``[n_tiles, 3, 336, 336]``
float32 and the tile grid ``(tiles_y, tiles_x)``.  The steps before the global tile are
:func:`canvas_tiles`, which Llama 3.2 Vision's tiling (:mod:`llama.images.mllama`) shares.
"""

from __future__ import annotations

import io
import logging
import math
import os
import struct
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union, cast

import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from llama.images.prompt import DEFAULT_MAX_PIXELS

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "FORMATS",
    "ImageSource",
    "PreprocessedImage",
    "best_canvas",
    "canvas_tiles",
    "canvases",
    "load_image",
    "preprocess_image",
    "tile_image",
]


# The file formats load_image decodes (PIL's names; PIL's JPEG reader also reads MPO, the JPEG
# variant many cameras write).
FORMATS = ("JPEG", "PNG", "WEBP", "GIF")

logger = logging.getLogger(__name__)

TILE_SIZE = 336  # Llama 4's vision_args.image_size
MAX_NUM_CHUNKS = 16  # Meta's ChatFormat's default max_num_chunks
MEAN = STD = 0.5

ImageSource = Union[Image.Image, bytes, bytearray, str, "os.PathLike[str]"]


@dataclass(frozen=True)
class PreprocessedImage:
    """One image as the vision encoder takes it.

    ``pixel_values``: float32 ``[n_tiles, 3, tile, tile]`` in [-1, 1], the tiles row by row
    (left to right, top to bottom) and, when there is more than one, the global tile last.
    ``grid``: ``(tiles_y, tiles_x)``, the tiles down and across (``(1, 1)``: one tile, no
    global tile), so ``n_tiles == tiles_y * tiles_x + (1 if tiles_y * tiles_x > 1 else 0)``.
    """

    pixel_values: torch.Tensor
    grid: tuple[int, int]

    @property
    def n_tiles(self) -> int:
        return int(self.pixel_values.shape[0])


# --- loading and checking --------------------------------------------------------------------

_strict_lock = threading.Lock()


@contextmanager
def _strict_decoding() -> Iterator[None]:
    """PIL's size warning raised as an error, and truncated files refused.

    ``ImageFile.LOAD_TRUNCATED_IMAGES`` is a process-wide switch that other code sets (Meta's
    llama-models sets it on import); while it is on, PIL silently pads a truncated file.  Here
    it is off for the decoding, and set back after it (under a lock, so that two loads never
    restore each other's value).  ``warnings.catch_warnings`` is process-wide too (before Python
    3.14): two loads in two threads at once may leave the error filter for PIL's size warning in
    place, which only makes that warning an error elsewhere as well.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        if not ImageFile.LOAD_TRUNCATED_IMAGES:
            yield
            return
        with _strict_lock:
            ImageFile.LOAD_TRUNCATED_IMAGES = False
            try:
                yield
            finally:
                ImageFile.LOAD_TRUNCATED_IMAGES = True


def _check_size(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ValueError(f"the image is {width} x {height} pixels: an image must be at least 1 x 1")
    if width * height > max_pixels:
        raise ValueError(
            f"the image is {width} x {height} = {width * height:,} pixels, over the limit of {max_pixels:,} "
            "pixels: send a smaller image (the models see far fewer: Llama 4 at most 1344 x 1344 pixels, Llama 3.2 "
            "Vision 4 tiles of 560 x 560)"
        )


def _bomb_message(error: object) -> str:
    return (f"refused as a possible decompression bomb: {error} (PIL's limit, PIL.Image.MAX_IMAGE_PIXELS = "
            f"{Image.MAX_IMAGE_PIXELS:,} pixels)")


def _open(source: ImageSource) -> Image.Image:
    """The image file ``source`` names or holds, opened (its header read, not its pixels)."""
    if isinstance(source, (bytes, bytearray)):
        if not source:
            raise ValueError("the image is empty (0 bytes)")
        fp: Union[io.BytesIO, Path] = io.BytesIO(bytes(source))
        what = f"the image ({len(source):,} bytes)"
    elif isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, str) and text.startswith(("http://", "https://", "data:")):
            raise ValueError(f"an image is a PIL.Image, bytes or a local path, not a URL ({text[:40]!r}...): "
                             "fetch or decode it first")
        fp = Path(text)
        if not fp.is_file():
            raise FileNotFoundError(f"no image file at {fp}")
        what = str(fp)
    else:
        raise TypeError(f"an image must be a PIL.Image, bytes or a path, got {type(source).__name__}")
    try:
        return Image.open(fp, formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # the warning: as an error here
        raise ValueError(f"{what} was {_bomb_message(e)}") from None
    except UnidentifiedImageError:
        raise ValueError(f"{what} is not a readable {', '.join(FORMATS[:-1])} or {FORMATS[-1]} image") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ValueError(f"{what} could not be read as an image: {e}") from None


def load_image(source: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """``source`` (a ``PIL.Image``, a file's bytes or a path) checked and decoded as an RGB
    ``PIL.Image``, upright (EXIF orientation applied).

    Raises ``ValueError`` for a decompression bomb (over PIL's ``MAX_IMAGE_PIXELS``, refused
    also in the band where PIL only warns), an image over ``max_pixels`` (width x height) or
    with a zero side, a truncated or unreadable file, or a file that is not JPEG, PNG, WebP or
    GIF; ``FileNotFoundError`` for a path with no file.  The sizes are checked from the file's
    header, before its pixels are decoded.  A given ``PIL.Image`` is not changed.
    """
    if max_pixels <= 0:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}")
    opened = not isinstance(source, Image.Image)
    with _strict_decoding():
        image = _open(source) if opened else cast(Image.Image, source)
        try:
            width, height = image.size
            if Image.MAX_IMAGE_PIXELS is not None and width * height > Image.MAX_IMAGE_PIXELS:
                raise ValueError(f"the image ({width} x {height}) was " + _bomb_message(
                    f"{width * height:,} pixels"))
            _check_size(image.size, max_pixels)
            try:
                image.load()
                rgb = _to_rgb(_upright(image))
            except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
                raise ValueError("the image was " + _bomb_message(e)) from None
            except (OSError, SyntaxError, EOFError, ValueError) as e:
                raise ValueError(f"the image could not be decoded (a truncated or corrupt file?): {e}") from None
        finally:
            if opened:
                image.close()
    return rgb


def _upright(image: Image.Image) -> Image.Image:
    """The image as its EXIF orientation says it is shown; as it is when that tag is unreadable."""
    try:
        return ImageOps.exif_transpose(image)
    except (struct.error, KeyError, TypeError, ValueError, OSError, SyntaxError, UnicodeDecodeError) as e:
        logger.warning("the image's EXIF data could not be read (%s): its orientation is not applied", e)
        return image


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB: an image with transparency pasted on white through its alpha, as Meta's
    ``convert_image_to_rgb`` does for RGBA (and Hugging Face's ``convert_to_rgb`` for every
    mode with transparency); any other mode converted as PIL converts it.  Always a new image."""
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode in ("P", "L", "RGB") and "transparency" in image.info)
    if has_alpha:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


# --- Meta's tiling ---------------------------------------------------------------------------


def canvases(max_num_chunks: int = MAX_NUM_CHUNKS) -> list[tuple[int, int]]:
    """Every tile arrangement ``(a, b)`` with ``a * b <= max_num_chunks``, in the order Meta's
    ``find_supported_resolutions`` lists them (which decides ties): by tile count from the most,
    grouped by aspect ratio in the order each ratio first appears."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for n in range(max_num_chunks, 0, -1):
        for a in sorted({d for d in range(1, n + 1) if n % d == 0}):
            by_ratio.setdefault(a / (n // a), []).append((a, n // a))
    return [arrangement for group in by_ratio.values() for arrangement in group]


def best_canvas(width: int, height: int, *, tile_size: int = TILE_SIZE,
                max_num_chunks: int = MAX_NUM_CHUNKS) -> tuple[int, int]:
    """The canvas ``(width, height)`` in pixels (multiples of ``tile_size``) a ``width x height``
    image is tiled on, as Meta's ``get_best_fit`` chooses it (module doc).  The scales are
    float32, as Meta's are (torch), so that near-ties resolve as they do there."""
    sizes = torch.tensor(canvases(max_num_chunks), dtype=torch.int64) * tile_size  # [n, 2]: (width, height)
    scale_w = sizes[:, 0].to(torch.float32) / torch.tensor(width, dtype=torch.float32)
    scale_h = sizes[:, 1].to(torch.float32) / torch.tensor(height, dtype=torch.float32)
    scales = torch.minimum(scale_w, scale_h)  # the limiting side: fits without distortion
    up = scales[scales >= 1]
    chosen_scale = up.min() if len(up) else scales[scales < 1].max()
    candidates = sizes[scales == chosen_scale]
    areas = candidates[:, 0] * candidates[:, 1]
    best = candidates[int(torch.argmin(areas))]  # the first of the smallest, as torch.argmin
    return int(best[0]), int(best[1])


def _fit_size(width: int, height: int, canvas: tuple[int, int], tile_size: int) -> tuple[int, int]:
    """The size ``(width, height)`` the image is resized to in ``canvas``: as large as fits
    without distortion, but a side no longer than ``tile_size`` is not stretched past it
    (Meta's ``resize_without_distortion`` with ``max_upscaling_size = tile_size``)."""
    target_w = min(max(width, tile_size), canvas[0])
    target_h = min(max(height, tile_size), canvas[1])
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        new_w, new_h = target_w, min(math.floor(height * scale_w), target_h)
    else:
        new_w, new_h = min(math.floor(width * scale_h), target_w), target_h
    return max(new_w, 1), max(new_h, 1)


def _normalized(image: Image.Image, mean: tuple[float, float, float] = (MEAN,) * 3,
                std: tuple[float, float, float] = (STD,) * 3) -> torch.Tensor:
    """An RGB image as float32 ``[3, H, W]``: bytes / 255, then (x - mean) / std per channel,
    the operations (and so the roundings) of torchvision's ``ToTensor`` and ``Normalize``
    (mean and std as float32 tensors)."""
    width, height = image.size
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
    x = pixels.permute(2, 0, 1).to(torch.float32).div(255)
    return x.sub_(torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)).div_(
        torch.tensor(std, dtype=torch.float32).view(3, 1, 1))


def _resize(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Bilinear, as torchvision resizes a PIL image (PIL's own filter, which antialiases)."""
    return image if image.size == size else image.resize(size, Image.Resampling.BILINEAR)


def canvas_tiles(image: Image.Image, *, tile_size: int, max_num_chunks: int,
                 mean: tuple[float, float, float] = (MEAN,) * 3, std: tuple[float, float, float] = (STD,) * 3,
                 ) -> tuple[torch.Tensor, tuple[int, int]]:
    """The steps Meta's ``VariableSizeImageTransform`` takes, the same in Llama 4 and Llama 3.2
    Vision (``llama3/multimodal/image_transform.py``): an RGB image on its best canvas, resized
    without distortion, padded, normalised with ``mean`` and ``std`` and cut into tiles (module
    doc).  Returns the tiles, float32 ``[tiles_y * tiles_x, 3, tile, tile]`` row by row, and
    the grid ``(tiles_y, tiles_x)``."""
    if image.mode != "RGB":
        raise ValueError(f"tiling takes an RGB image, got mode {image.mode!r} (use load_image)")
    if max_num_chunks < 1:
        raise ValueError(f"max_num_chunks must be at least 1, got {max_num_chunks}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"the image is {width} x {height} pixels: an image must be at least 1 x 1")
    canvas = best_canvas(width, height, tile_size=tile_size, max_num_chunks=max_num_chunks)
    resized = _resize(image, _fit_size(width, height, canvas, tile_size))
    padded = Image.new("RGB", canvas, (0, 0, 0))
    padded.paste(resized)
    x = _normalized(padded, mean, std)  # [3, H, W]
    tiles_x, tiles_y = canvas[0] // tile_size, canvas[1] // tile_size
    tiles = (x.view(3, tiles_y, tile_size, tiles_x, tile_size)
              .permute(1, 3, 0, 2, 4)  # [tiles_y, tiles_x, 3, tile, tile]
              .reshape(tiles_y * tiles_x, 3, tile_size, tile_size))
    return tiles, (tiles_y, tiles_x)


def tile_image(image: Image.Image, *, tile_size: int = TILE_SIZE,
               max_num_chunks: int = MAX_NUM_CHUNKS) -> PreprocessedImage:
    """An RGB image (as :func:`load_image` gives) cut into Llama 4's tiles (module doc)."""
    tiles, (tiles_y, tiles_x) = canvas_tiles(image, tile_size=tile_size, max_num_chunks=max_num_chunks)
    if tiles_y * tiles_x > 1:
        whole = _normalized(_resize(image, (tile_size, tile_size)))  # the global tile, distorted to a square
        tiles = torch.cat([tiles, whole.unsqueeze(0)])
    return PreprocessedImage(pixel_values=tiles.contiguous(), grid=(tiles_y, tiles_x))


def preprocess_image(source: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS, tile_size: int = TILE_SIZE,
                     max_num_chunks: int = MAX_NUM_CHUNKS) -> PreprocessedImage:
    """:func:`load_image` then :func:`tile_image`: ``source`` checked, decoded and tiled."""
    return tile_image(load_image(source, max_pixels=max_pixels), tile_size=tile_size, max_num_chunks=max_num_chunks)
