"""Llama 4's image preprocessing (llama.images.preprocess) against Meta's reference
(``llama_models/llama4/preprocess.py``, run here with a torchvision stand-in: tests/meta_images.py):
the same tiles to 1e-6 and the same tile grid, on Meta's own photograph and on synthetic images of
awkward sizes; then the file formats and modes, and every way an image is refused."""

from __future__ import annotations

import io
import math
import types
import warnings

import pytest
import torch
from PIL import Image, ImageFile

from llama.images.preprocess import (
    _fit_size,
    best_canvas,
    canvases,
    load_image,
    preprocess_image,
    tile_image,
)

pytest.importorskip("llama_models")
import meta_images  # noqa: E402


@pytest.fixture(scope="module")
def meta():
    with pytest.MonkeyPatch.context() as mp:
        yield meta_images.meta_modules(mp)


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A random image: every pixel differs, so a tile or a row out of place shows."""
    channels = len(Image.new(mode, (1, 1)).getbands())
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height * width * channels,), dtype=torch.uint8, generator=g)
    return Image.frombytes(mode, (width, height), data.numpy().tobytes())


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    if fmt == "PNG":
        save.setdefault("compress_level", 1)  # noise does not compress: spend no time trying
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def assert_close(ours, expected: torch.Tensor, grid: tuple[int, int]) -> None:
    assert ours.grid == grid
    assert ours.pixel_values.dtype == torch.float32 and ours.pixel_values.shape == expected.shape
    assert (ours.pixel_values - expected).abs().max().item() <= 1e-6


def assert_same_as_meta(meta, data: bytes):
    """Our tiles of an image file against Meta's, from the file's bytes on."""
    ours = preprocess_image(data)
    assert_close(ours, *meta_images.meta_pixel_values(*meta, data))
    return ours


# --- parity with Meta ------------------------------------------------------------------------


def test_meta_photograph(meta):
    """Meta's dog.jpg (512 x 512): a 2 x 2 grid and the global tile."""
    ours = assert_same_as_meta(meta, meta_images.dog_jpg().read_bytes())
    assert ours.grid == (2, 2) and ours.n_tiles == 5


# (width, height) -> the grid (tiles_y, tiles_x) Meta's canvas rule gives, worked out by hand:
# the least upscaling (scale >= 1) that fits, else the least downscaling, then the least area.
SIZES = {
    (1, 1): (1, 1),  # fits one tile: no global tile
    (1, 2000): (6, 1),  # 2016 px is the first height >= 2000 in one column
    (2000, 1): (1, 6),
    (337, 335): (1, 2),  # one pixel too wide for a tile
    (336, 336): (1, 1),
    (600, 600): (2, 2),  # a square
    (1100, 1100): (4, 4),  # 16 tiles: upscaled to 1344 x 1344
    (6000, 20): (1, 16),  # wider than any canvas: downscaled into 16 tiles in a row
    (700, 300): (1, 3),  # wide: 1008 x 336 upscales least
    (5, 4000): (12, 1),  # tall: 4032 px is the first height >= 4000 in one column
}


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("size", list(SIZES), ids=[f"{w}x{h}" for w, h in SIZES])
def test_awkward_sizes(meta, size):
    """Synthetic RGB images (the file formats are the tests below): Meta's steps after its RGB
    conversion against :func:`tile_image`."""
    preprocess, _ = meta
    image = noise(*size)
    ours = tile_image(image)
    assert_close(ours, *meta_images.meta_tiles(preprocess, image))
    assert ours.grid == SIZES[size]
    tiles = ours.grid[0] * ours.grid[1]
    assert ours.n_tiles == tiles + (tiles > 1)


def test_canvases_and_best_canvas_follow_meta(meta):
    preprocess, _ = meta
    t = preprocess.VariableSizeImageTransform(336)
    for n in (1, 4, 16):
        assert [(a * 336, b * 336) for a, b in canvases(n)] == t.find_supported_resolutions(n, 336)
    resolutions = torch.tensor(t.find_supported_resolutions(16, 336))
    for w, h in [(1, 1), (333, 777), (1000, 1), (4096, 2160), (10, 10_000), (673, 673)]:
        assert best_canvas(w, h) == t.get_best_fit((w, h), resolutions), (w, h)


def test_canvas_and_resized_size_follow_meta_on_many_sizes(meta, monkeypatch):
    """400 sizes drawn log-uniformly from 1 to 20,000 pixels a side: the canvas, and the size the
    image is resized to in it (Meta's resize_without_distortion, its resize call recorded
    instead of run: no pixels are needed for the sizes)."""
    preprocess, _ = meta
    t = preprocess.VariableSizeImageTransform(336)
    resolutions = torch.tensor(t.find_supported_resolutions(16, 336))

    class Sized:  # what Meta's resize_without_distortion reads of an image: its size
        def __init__(self, size):
            self.size = size

    monkeypatch.setattr(preprocess, "F", types.SimpleNamespace(resize=lambda image, hw, interpolation: hw))
    g = torch.Generator().manual_seed(0)
    for w, h in torch.exp(torch.rand(400, 2, generator=g) * math.log(20_000)).long().clamp(min=1).tolist():
        canvas = best_canvas(w, h)
        assert canvas == t.get_best_fit((w, h), resolutions), (w, h)
        meta_h, meta_w = t.resize_without_distortion(Sized((w, h)), canvas, 336)
        assert _fit_size(w, h, canvas, 336) == (meta_w, meta_h), (w, h)


def test_fewer_chunks(meta):
    preprocess, _ = meta
    image = noise(500, 300)
    for n in (1, 2, 6):
        assert_close(tile_image(image, max_num_chunks=n), *meta_images.meta_tiles(preprocess, image, max_num_chunks=n))


# --- formats and modes -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_formats(meta, fmt):
    image = noise(360, 200) if fmt != "GIF" else noise(360, 200).convert("P")  # (1, 2) and the global tile
    assert_same_as_meta(meta, encoded(image, fmt))


def test_gif_first_frame(meta):
    frames = [Image.new("RGB", (50, 40), c).convert("P") for c in ((250, 10, 10), (10, 10, 250))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    ours = assert_same_as_meta(meta, data)
    red = ours.pixel_values[0, :, 0, 0]  # the top-left pixel, normalised to [-1, 1]
    assert red[0] > 0.9 and red[2] < -0.9


def test_rgba_is_composited_on_white(meta):
    image = noise(300, 200, "RGBA")
    image.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black -> white
    image.putpixel((1, 0), (0, 0, 0, 255))  # opaque black stays black
    ours = assert_same_as_meta(meta, encoded(image))  # Meta pastes RGBA on white through the alpha
    assert ours.grid == (1, 1)
    rgb = load_image(encoded(image))
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((1, 0)) == (0, 0, 0)


@pytest.mark.parametrize("mode", ["L", "P", "LA", "PA", "1", "CMYK"])
def test_other_modes_become_rgb(meta, mode):
    preprocess, chat_format = meta
    image = noise(120, 90, "RGB").convert(mode) if mode != "PA" else noise(120, 90, "RGBA").convert("PA")
    rgb = load_image(image)
    assert rgb.mode == "RGB" and rgb.size == (120, 90)
    # Meta's rule: RGBA pasted on white, anything else converted; ours composites every mode
    # with an alpha channel as RGBA (as Hugging Face's convert_to_rgb does), so the reference
    # for LA and PA is Meta's RGBA rule on the image made RGBA.
    reference = image.convert("RGBA") if mode in ("LA", "PA") else image
    ours = tile_image(rgb)
    assert_close(ours, *meta_images.meta_tiles(preprocess, chat_format.convert_image_to_rgb(reference)))
    if mode in ("L", "1"):
        assert torch.equal(ours.pixel_values[:, 0], ours.pixel_values[:, 1])  # grey: R == G == B


def test_palette_with_transparency_is_composited_on_white():
    image = Image.new("P", (10, 10), 0)
    image.putpalette([0, 0, 0] + [200, 0, 0] * 255)
    image.putpixel((5, 5), 1)
    image.info["transparency"] = 0  # palette index 0 (black) is transparent
    rgb = load_image(encoded(image))
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((5, 5)) == (200, 0, 0)


def test_exif_orientation_is_applied(meta):
    preprocess, chat_format = meta
    image = noise(700, 300)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the stored image is shown turned 90 degrees clockwise
    data = encoded(image, "JPEG", exif=exif.tobytes(), quality=95)
    ours = preprocess_image(data)
    upright = Image.open(io.BytesIO(data)).transpose(Image.Transpose.ROTATE_270)  # 300 x 700
    assert ours.grid == (3, 1)  # tall, as shown; the stored 700 x 300 is (1, 3)
    assert_close(ours, *meta_images.meta_tiles(preprocess, chat_format.convert_image_to_rgb(upright)))


def test_sources_agree(tmp_path):
    image = noise(90, 60)
    data = encoded(image)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    expected = preprocess_image(image).pixel_values
    for source in (data, bytearray(data), path, str(path), Image.open(path)):
        assert torch.equal(preprocess_image(source).pixel_values, expected), type(source)


def test_a_given_image_is_not_changed():
    image = noise(50, 40, "RGBA")
    before = image.tobytes()
    load_image(image)
    assert image.mode == "RGBA" and image.tobytes() == before


# --- refusals --------------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["strict", "pil-truncated-loading-on"])
def truncated_flag(request, monkeypatch):
    """PIL's process-wide LOAD_TRUNCATED_IMAGES (Meta's module turns it on when imported): a
    truncated file is refused either way, and the flag is left as it was."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", request.param)
    yield request.param
    assert ImageFile.LOAD_TRUNCATED_IMAGES is request.param


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_file(truncated_flag, fmt):
    data = encoded(noise(200, 200), fmt)
    with pytest.raises(ValueError, match="could not be decoded.*truncated"):
        preprocess_image(data[: len(data) // 2])


@pytest.mark.parametrize("data, match", [
    (b"not an image at all", "not a readable JPEG, PNG, WEBP or GIF image"),
    (b"", "empty"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "not a readable|could not be read"),
])
def test_unreadable(data, match):
    with pytest.raises(ValueError, match=match):
        preprocess_image(data)


def test_other_formats_are_refused():
    with pytest.raises(ValueError, match="not a readable"):
        preprocess_image(encoded(noise(10, 10), "BMP"))


def test_zero_sized():
    with pytest.raises(ValueError, match=r"0 x 5 pixels: an image must be at least 1 x 1"):
        preprocess_image(Image.new("RGB", (0, 5)))
    with pytest.raises(ValueError, match="at least 1 x 1"):
        tile_image(Image.new("RGB", (7, 0)))


def test_over_the_pixel_limit():
    with pytest.raises(ValueError, match=r"20 x 30 = 600 pixels, over the limit of 599 pixels"):
        preprocess_image(encoded(noise(20, 30)), max_pixels=599)
    assert preprocess_image(encoded(noise(20, 30)), max_pixels=600).grid == (1, 1)


def test_the_size_is_checked_before_decoding():
    """A truncated file over the limit is refused for its size, read from the header: its
    pixels are never decoded."""
    data = encoded(noise(200, 200))
    data = data[: len(data) // 2]
    with pytest.raises(ValueError, match="truncated"):
        preprocess_image(data)
    with pytest.raises(ValueError, match="over the limit"):
        preprocess_image(data, max_pixels=10_000)


@pytest.mark.parametrize("side", [40, 100], ids=["pil-warns", "pil-refuses"])
@pytest.mark.parametrize("as_file", [True, False], ids=["file", "pil-image"])
def test_decompression_bomb(monkeypatch, side, as_file):
    """Over PIL.Image.MAX_IMAGE_PIXELS (here lowered to 1,000): PIL only warns up to twice the
    limit (40 x 40) and refuses beyond (100 x 100); both are a ValueError, and no warning."""
    image = noise(side, side)
    data = encoded(image)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning escaping would fail the test
        with pytest.raises(ValueError, match=r"decompression bomb.*MAX_IMAGE_PIXELS = 1,000"):
            preprocess_image(data if as_file else image)


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no image file"):
        preprocess_image(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="not a URL"):
        preprocess_image("https://example.com/cat.png")
    with pytest.raises(TypeError, match="PIL.Image, bytes or a path"):
        preprocess_image(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pixels must be positive"):
        preprocess_image(noise(2, 2), max_pixels=0)
    with pytest.raises(ValueError, match="RGB image"):
        tile_image(noise(2, 2, "RGBA"))


def test_a_bomb_header_is_refused_unpatched(monkeypatch):
    """A 57-byte PNG whose header declares 100,000 x 100,000 pixels, under PIL's own limit
    (not lowered): refused from the header, nothing decoded; and without PIL's limit, by ours."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)  # 8-bit RGB
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
    with pytest.raises(ValueError, match="decompression bomb"):
        preprocess_image(data, max_pixels=10**12)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(ValueError, match="over the limit of 33,554,432 pixels"):
        preprocess_image(data)
