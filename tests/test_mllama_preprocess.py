"""Llama 3.2 Vision's image preprocessing (llama.images.mllama) against two independent makers of
its tiles (tests/mllama_images.py): Meta's ``llama3/multimodal/image_transform.py`` (with a
torchvision stand-in) and Hugging Face's ``MllamaImageProcessorPil`` configured as Meta's Instruct
models: the same tiles to 1e-6, the same tile grid and aspect-ratio id, on photographs and on
synthetic images of awkward sizes and modes; then the canvas rule over many sizes, the batch
layout, and the refusals (part 1's loading checks, shared).

Meta's comparisons are quick; Hugging Face's are ``slow`` (importing its image processor takes
seconds), each over all the cases at once."""

from __future__ import annotations

import io
import math
import types

import pytest
import torch
from PIL import Image

from llama.images import mllama
from llama.images.preprocess import _fit_size, best_canvas, load_image
from llama.images.prompt import MllamaLayout, supported_aspect_ratios

pytest.importorskip("llama_models")
import mllama_images  # noqa: E402
from mllama_images import encoded, noise  # noqa: E402

# Both references compute in float32 from the same bytes; Meta's (ToTensor, then Normalize)
# does our operations in our order, Hugging Face's scales by 1/255 in float64 before rounding to
# float32, which may move a value by an ulp (2.4e-7 at 2): 1e-6 bounds both.
ATOL = 1e-6


@pytest.fixture(scope="module")
def meta():
    with pytest.MonkeyPatch.context() as mp:
        yield mllama_images.meta_image_transform(mp)


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    return mllama_images.hf_processor()


def assert_same_as_meta(ours: mllama.MllamaImage, tiles: torch.Tensor, ar: tuple[int, int]) -> None:
    n = tiles.shape[0]
    assert ours.grid == ar and ours.num_tiles == n
    assert ours.pixel_values.dtype == torch.float32 and ours.pixel_values.shape == (4, 3, 560, 560)
    assert (ours.pixel_values[:n] - tiles).abs().max().item() <= ATOL
    assert not ours.pixel_values[n:].any()  # zeros past the image's tiles


def assert_same_as_hf(ours: mllama.MllamaImage, expected: tuple[torch.Tensor, int, int]) -> None:
    pixels, aspect_ratio_id, num_tiles = expected
    assert (ours.aspect_ratio_id, ours.num_tiles) == (aspect_ratio_id, num_tiles)
    assert pixels.shape == ours.pixel_values.shape
    assert (ours.pixel_values - pixels).abs().max().item() <= ATOL


# --- parity on photographs and awkward sizes -------------------------------------------------


PHOTOGRAPHS = {"dog.jpg": (1, 1), "pasta.jpeg": (2, 2)}  # 512 x 512: upscaled; 1280 x 1280: downscaled


@pytest.mark.parametrize("name", list(PHOTOGRAPHS))
def test_photographs(meta, name):
    """Meta's photographs from their files' bytes, as Meta's chat format opens and converts them."""
    data = mllama_images.photographs()[name].read_bytes()
    ours = mllama.preprocess_image(data)
    assert ours.grid == PHOTOGRAPHS[name]
    assert_same_as_meta(ours, *mllama_images.meta_tiles(meta, mllama_images.meta_chat_image(data)))


# (width, height) -> the grid (tiles_y, tiles_x) Meta's canvas rule gives for 560-pixel tiles, at
# most 4, worked out by hand: the least upscaling (scale >= 1) that fits without distortion,
# else the least downscaling, then the smallest canvas.
SIZES = {
    (1, 1): (1, 1),  # upscaled to one whole tile
    (300, 200): (1, 1),  # small: upscaled to 560 x 373 in one tile
    (560, 560): (1, 1),  # exactly a tile
    (561, 560): (1, 2),  # one pixel too wide: 1120 x 560 is the least upscaling (x 1.0)
    (561, 561): (2, 2),
    (1120, 1120): (2, 2),  # exactly four tiles
    (1121, 1121): (2, 2),  # too large for any canvas: the least downscaling
    (1500, 500): (1, 3),  # 1680 x 560 and 2240 x 560 both scale by 1.12: the smaller
    (2240, 560): (1, 4),  # exactly four tiles in a row
    (4000, 30): (1, 4),  # very wide: downscaled to 2240 x 16
    (30, 4000): (4, 1),  # very tall
}


@pytest.mark.parametrize("size", list(SIZES), ids=[f"{w}x{h}" for w, h in SIZES])
def test_awkward_sizes(meta, size):
    image = noise(*size)
    ours = mllama.tile_image(image)
    assert ours.grid == SIZES[size]
    assert_same_as_meta(ours, *mllama_images.meta_tiles(meta, image))


def test_one_pixel_high_and_very_wide(meta):
    """10000 x 1 fits 2240 x 560 at a scale of 0.224, which leaves it 0.224 pixels high: Meta's
    transform asks for a 0-pixel-high image (and fails), ours keeps 1 (as Hugging Face's does:
    :func:`test_hugging_face_s_tiles`)."""
    image = noise(10_000, 1)
    ours = mllama.tile_image(image)
    assert ours.grid == (1, 4)
    black = (-torch.tensor(mllama_images.CLIP_MEAN) / torch.tensor(mllama_images.CLIP_STD)).view(3, 1, 1)
    assert (ours.pixel_values[:, :, 1:] - black).abs().max() < 1e-6  # one row of image, the rest padding
    with pytest.raises(ValueError, match="height and width must be > 0"):
        mllama_images.meta_tiles(meta, image)


BASE_SIZES = ((448, 448), (449, 300), (900, 1000))


def test_base_model_tiles(meta):
    """Llama-3.2-11B-Vision (base) cuts 448-pixel tiles."""
    layout = MllamaLayout(chunk_size=448)
    for size in BASE_SIZES:
        image = noise(*size, seed=size[0])
        ours = mllama.tile_image(image, layout)
        assert ours.pixel_values.shape == (4, 3, 448, 448)
        tiles, ar = mllama_images.meta_tiles(meta, image, chunk_size=448)
        assert ours.grid == ar and (ours.pixel_values[: tiles.shape[0]] - tiles).abs().max() <= ATOL


# --- modes -----------------------------------------------------------------------------------


def mode_file(mode: str) -> bytes:
    """A 700 x 500 file (a (1, 2) grid) in ``mode``; ``"P+t"``: a palette with a transparent colour."""
    if mode in ("L", "P", "CMYK"):
        return encoded(noise(700, 500).convert(mode), "JPEG" if mode == "CMYK" else "PNG")
    if mode == "P+t":
        image = noise(700, 500, seed=3).convert("P")  # the web palette: index 0 is black
        image.putpixel((0, 0), 0)
        image.putpixel((1, 0), 1)
        image.info["transparency"] = 0  # written as the PNG's tRNS chunk
        return encoded(image)
    image = noise(700, 500, "RGBA", seed=3)
    image.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black -> white
    image.putpixel((1, 0), (0, 0, 0, 255))  # opaque black stays black
    return encoded(image.convert(mode))


@pytest.mark.parametrize("mode", ["L", "P", "CMYK"])
def test_modes_without_transparency(meta, mode):
    """Greyscale, palette and CMYK files: made RGB as Meta's chat format does (``convert("RGB")``)."""
    data = mode_file(mode)
    ours = mllama.preprocess_image(data)
    assert ours.grid == (1, 2)
    assert_same_as_meta(ours, *mllama_images.meta_tiles(meta, mllama_images.meta_chat_image(data)))
    if mode == "L":  # grey: the channels equal once the normalisation is undone
        std = torch.tensor(mllama_images.CLIP_STD).view(3, 1, 1)
        x = ours.pixel_values[:2] * std + torch.tensor(mllama_images.CLIP_MEAN).view(3, 1, 1)
        assert (x[:, 0] - x[:, 1]).abs().max() < 1e-6 and (x[:, 0] - x[:, 2]).abs().max() < 1e-6


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P+t"])
def test_transparency_is_composited_on_white(meta, mode):
    """An image with transparency (an alpha channel, or a palette's transparent colour) is
    composited on white, as Hugging Face's ``convert_to_rgb`` does (:func:`test_hugging_face_s_tiles`);
    Meta's Llama 3 chat format drops the alpha channel instead (``convert("RGB")``), so the
    reference taken from Meta is its transform of the image composited as we do."""
    data = mode_file(mode)
    ours = mllama.preprocess_image(data)
    rgb = load_image(data)
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((1, 0)) == (0, 0, 0)
    assert_same_as_meta(ours, *mllama_images.meta_tiles(meta, rgb))
    assert mllama_images.meta_chat_image(data).getpixel((0, 0)) == (0, 0, 0)  # Meta's: black


@pytest.mark.slow  # importing Hugging Face's image processor takes seconds
def test_hugging_face_s_tiles(hf):
    """Every image above (photographs, awkward sizes, modes with and without transparency, the
    one-pixel-high one, the base model's 448-pixel tiles) against Hugging Face's processor,
    which takes the image as PIL opens it (or the synthetic one) and makes it RGB itself."""
    cases = [(Image.open(path), MllamaLayout()) for path in mllama_images.photographs().values()]
    cases += [(noise(*size), MllamaLayout()) for size in [*SIZES, (10_000, 1)]]
    cases += [(Image.open(io.BytesIO(mode_file(mode))), MllamaLayout())
              for mode in ("L", "P", "CMYK", "RGBA", "LA", "P+t")]
    cases += [(noise(*size, seed=size[0]), MllamaLayout(chunk_size=448)) for size in BASE_SIZES]
    processors = {560: hf, 448: mllama_images.hf_processor(chunk_size=448)}
    for image, layout in cases:
        ours = mllama.tile_image(load_image(image), layout)
        assert_same_as_hf(ours, mllama_images.hf_one(processors[layout.chunk_size], image))


# --- the canvas rule on many sizes -----------------------------------------------------------


def many_sizes() -> list[tuple[int, int]]:
    """400 sizes drawn log-uniformly from 1 to 20,000 pixels a side."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.exp(torch.rand(400, 2, generator=g) * math.log(20_000)).long().clamp(min=1)
    return [(w, h) for w, h in sizes.tolist()]


def test_canvas_and_resized_size_follow_meta_on_many_sizes(meta, monkeypatch):
    """For both tile sizes: the canvas and the size the image is resized to in it, against Meta's
    ``get_best_fit`` and ``resize_without_distortion`` (its resize call recorded, not run).
    Where Meta's resized side rounds down to 0 (a side under 1 / scale pixels) Meta's transform
    fails (:func:`test_one_pixel_high_and_very_wide`); ours keeps 1."""
    class Sized:  # what Meta's resize_without_distortion reads of an image: its size
        def __init__(self, size):
            self.size = size

    monkeypatch.setattr(meta, "F", types.SimpleNamespace(resize=lambda image, hw, interpolation: hw))
    for chunk in (560, 448):
        t = meta.VariableSizeImageTransform(size=chunk)
        resolutions = torch.tensor(t.find_supported_resolutions(4, chunk))
        for w, h in many_sizes():
            canvas = best_canvas(w, h, tile_size=chunk, max_num_chunks=4)
            assert canvas == t.get_best_fit((w, h), resolutions), (w, h)
            meta_h, meta_w = t.resize_without_distortion(Sized((w, h)), canvas, chunk)
            assert _fit_size(w, h, canvas, chunk) == (max(meta_w, 1), max(meta_h, 1)), (w, h)


@pytest.mark.slow  # importing Hugging Face's image processor takes seconds
def test_canvas_resized_size_and_aspect_ratio_id_follow_hugging_face():
    """The same sizes against Hugging Face's ``get_optimal_tiled_canvas``,
    ``get_image_size_fit_to_canvas`` and ``convert_aspect_ratios_to_ids_np``; and its list of
    arrangements, which the ids index, for other tile counts."""
    pytest.importorskip("transformers")
    from transformers.models.mllama import image_processing_pil_mllama as hf_mllama

    for n in (1, 2, 3, 4, 6, 8, 16):
        assert supported_aspect_ratios(n) == hf_mllama.get_all_supported_aspect_ratios(n)
    for chunk in (560, 448):
        layout = MllamaLayout(chunk_size=chunk)
        for w, h in many_sizes():
            canvas = best_canvas(w, h, tile_size=chunk, max_num_chunks=4)
            hf_h, hf_w = hf_mllama.get_optimal_tiled_canvas(h, w, 4, chunk)
            assert canvas == (hf_w, hf_h), (w, h)
            assert _fit_size(w, h, canvas, chunk)[::-1] == hf_mllama.get_image_size_fit_to_canvas(
                h, w, hf_h, hf_w, chunk), (w, h)
            grid = (canvas[1] // chunk, canvas[0] // chunk)
            assert layout.aspect_ratio_id(grid) == hf_mllama.convert_aspect_ratios_to_ids_np([[grid]], 4)[0, 0]


def test_supported_aspect_ratios():
    """The list aspect-ratio ids index, written out for 4 tiles (Hugging Face's order)."""
    assert supported_aspect_ratios(4) == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]
    assert supported_aspect_ratios(1) == [(1, 1)]
    layout = MllamaLayout()
    assert [layout.grid(i) for i in range(1, 9)] == supported_aspect_ratios(4)
    assert [layout.aspect_ratio_id(g) for g in supported_aspect_ratios(4)] == list(range(1, 9))
    assert mllama.tile_image(noise(1500, 500)).aspect_ratio_id == 3  # (1, 3)
    for bad in (0, 9, True, "1"):
        with pytest.raises(ValueError, match=r"aspect-ratio id of 4 tiles is in \[1, 8\]"):
            layout.grid(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an arrangement of at most 4 tiles"):
        layout.aspect_ratio_id((2, 3))


# --- a batch ---------------------------------------------------------------------------------


@pytest.mark.slow  # importing Hugging Face's image processor takes seconds
def test_stack_images_is_hugging_face_s_batch(hf):
    """Two prompts, with two images and one: the tensors Hugging Face's processor makes for
    ``MllamaForConditionalGeneration`` (the second prompt padded with a zero image, id 0)."""
    pasta = Image.open(mllama_images.photographs()["pasta.jpeg"])
    wide, tall = noise(1500, 500, seed=1), noise(30, 4000, seed=2)
    expected = mllama_images.hf_batch(hf, [[pasta, wide], [tall]])
    got = mllama.stack_images([[mllama.preprocess_image(pasta), mllama.tile_image(wide)],
                               [mllama.tile_image(tall)]])
    assert got.pixel_values.shape == expected["pixel_values"].shape == (2, 2, 4, 3, 560, 560)
    assert (got.pixel_values - expected["pixel_values"]).abs().max().item() <= ATOL
    assert torch.equal(got.aspect_ratio_ids, expected["aspect_ratio_ids"])
    assert torch.equal(got.aspect_ratio_mask, expected["aspect_ratio_mask"])
    assert got.num_tiles == expected["num_tiles"] == [[4, 3], [4]]
    assert got.aspect_ratio_ids.tolist() == [[6, 3], [8, 0]]  # (2, 2), (1, 3); (4, 1), padding


def test_stack_images_refusals():
    with pytest.raises(ValueError, match="none of the prompts holds an image"):
        mllama.stack_images([[], []])
    a = mllama.tile_image(noise(20, 20))
    b = mllama.tile_image(noise(20, 20), MllamaLayout(chunk_size=448))
    with pytest.raises(ValueError, match="cut for different layouts"):
        mllama.stack_images([[a], [b]])


# --- refusals: part 1's loading, shared ------------------------------------------------------


def test_refusals_are_part_1_s():
    data = encoded(noise(200, 100))
    with pytest.raises(ValueError, match=r"200 x 100 = 20,000 pixels, over the limit of 19,999 pixels"):
        mllama.preprocess_image(data, max_pixels=19_999)
    with pytest.raises(ValueError, match="could not be decoded.*truncated"):
        mllama.preprocess_image(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable"):
        mllama.preprocess_image(b"not an image")
    with pytest.raises(ValueError, match="RGB image"):
        mllama.tile_image(noise(2, 2, "RGBA"))
    with pytest.raises(ValueError, match="vision_chunk_size must be a positive integer"):
        MllamaLayout(chunk_size=0)
