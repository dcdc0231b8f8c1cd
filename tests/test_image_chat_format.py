"""Images in Llama 4's chat format (llama.formats.chat.Llama4ChatFormat with a TileLayout):
token for token as Meta's ``llama4/chat_format.py`` encodes them with its tokenizer (run with a
torchvision stand-in: tests/meta_images.py), the pixel values and ``<|patch|>`` positions the
prompt carries, the content-part shapes, and the refusals."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import REPO
from llama.formats.chat import Llama2ChatFormat, Llama3ChatFormat, Llama4ChatFormat, chat_format_for
from llama.images.prompt import EncodedDialog, TileLayout
from llama.tokenizer import load_tokenizer

llama_models = pytest.importorskip("llama_models")
import meta_images  # noqa: E402

LLAMA4_TOKENIZER = Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"

# Llama 4's vision_args as its params.json writes them (Scout and Maverick).
VISION_ARGS = {"image_size": {"height": 336, "width": 336}, "patch_size": {"height": 14, "width": 14},
               "dim": 1408, "n_layers": 34, "n_heads": 16, "mlp_ratio": 4.0, "output_dim": 4096,
               "pixel_shuffle_ratio": 0.5}

START, END, IMAGE, PATCH, X_SEP, Y_SEP = 200080, 200081, 200090, 200092, 200084, 200085  # Meta's ids


def png(width: int, height: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height * width * 3,), dtype=torch.uint8, generator=g).numpy().tobytes()
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), data).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


ONE_TILE = png(300, 200, seed=1)  # (1, 1)
WIDE = png(700, 300, seed=2)  # (1, 3) and the global tile
DOG = meta_images.dog_jpg().read_bytes()  # (2, 2) and the global tile


@pytest.fixture(scope="module")
def ours() -> Llama4ChatFormat:
    return Llama4ChatFormat(load_tokenizer(LLAMA4_TOKENIZER), TileLayout.from_vision_args(VISION_ARGS))


@pytest.fixture(scope="module")
def meta_chat():
    with pytest.MonkeyPatch.context() as mp:
        _, chat_format = meta_images.meta_modules(mp)
        from llama_models.llama4.args import VisionArgs
        from llama_models.llama4.tokenizer import Tokenizer

        yield chat_format.ChatFormat(Tokenizer(LLAMA4_TOKENIZER), vision_args=VisionArgs(**VISION_ARGS))


def meta_encode(meta_chat, dialog):
    """Meta's encoding of a dialog in our shapes: image parts as RawMediaItem of the bytes."""
    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem

    def item(part):
        return RawTextItem(text=part["text"]) if part["type"] == "text" else RawMediaItem(data=part["image"])

    messages = [RawMessage(role=m["role"], content=m["content"] if isinstance(m["content"], str)
                           else [item(p) for p in m["content"]]) for m in dialog]
    return meta_chat.encode_dialog_prompt(messages)


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(data) -> dict:
    return {"type": "image", "image": data}


DIALOGS = {
    "one tile": [{"role": "user", "content": [image(ONE_TILE), text("What is in this picture?")]}],
    "multi-tile": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [text("Describe"), image(DOG), text(" in a word.")]}],
    "wide": [{"role": "user", "content": [text("And this one?"), image(WIDE)]}],
    "two images": [
        {"role": "user", "content": [image(DOG), text("Compare it with"), image(ONE_TILE)]},
        {"role": "assistant", "content": "The first is a dog."},
        {"role": "user", "content": [text("And now this:"), image(WIDE), text("?")]},
    ],
}


@pytest.mark.parametrize("name", list(DIALOGS))
def test_tokens_and_pixels_match_meta(ours, meta_chat, name):
    dialog = DIALOGS[name]
    expected = meta_encode(meta_chat, dialog)
    got = ours.encode_dialog(dialog)
    assert isinstance(got, EncodedDialog)
    assert got.tokens == list(expected.tokens)
    assert len(got.images) == len(expected.images)
    # Meta's <|patch|> positions, image by image: the patch tokens in prompt order, n_tiles * 144 each
    patches = [k for k, t in enumerate(expected.tokens) if t == PATCH]
    for img, pixels in zip(got.images, expected.images):
        assert torch.allclose(img.pixel_values, pixels, rtol=0, atol=1e-6)
        n = pixels.shape[0] * 144
        assert list(img.patch_positions) == patches[:n]
        patches = patches[n:]
        assert got.tokens[img.start] == START and got.tokens[img.end - 1] == END
        assert got.tokens[img.start:img.end].count(PATCH) == n
    assert not patches


def test_image_layout_written_out(ours):
    """An independent statement of the layout, labelled, for a 2 x 3 grid on a layout with one
    patch per tile (28-pixel tiles of 14-pixel patches, shuffled 4 to 1)."""
    fmt = Llama4ChatFormat(ours.tokenizer, TileLayout(image_size=28, patch_size=14))
    assert fmt.image_layout.patches_per_tile == 1
    P = PATCH
    assert fmt.image_tokens((2, 3)) == [
        START,
        P, X_SEP, P, X_SEP, P, Y_SEP,  # row 1
        P, X_SEP, P, X_SEP, P, Y_SEP,  # row 2
        IMAGE, P, END,  # the global tile
    ]
    assert fmt.image_tokens((1, 1)) == [START, IMAGE, P, END]
    assert ours.image_tokens((1, 1)) == [START, IMAGE] + [P] * 144 + [END]
    special = ours.tokenizer.special_tokens
    assert (START, END, IMAGE, PATCH, X_SEP, Y_SEP) == tuple(special[n] for n in (
        "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
        "<|tile_y_separator|>"))


def test_grid_and_positions(ours):
    got = ours.encode_dialog(DIALOGS["two images"])
    assert [i.grid for i in got.images] == [(2, 2), (1, 1), (1, 3)]
    assert [i.n_tiles for i in got.images] == [5, 1, 4]
    dog = got.images[0]
    first_row = list(dog.patch_positions[:288])
    assert first_row == list(range(dog.start + 1, dog.start + 145)) + list(range(dog.start + 146, dog.start + 290))
    assert got.tokens[dog.start + 145] == X_SEP and got.tokens[dog.start + 290] == Y_SEP


def test_part_shapes_agree(ours, tmp_path):
    """An image given as bytes, a path, a PIL image or llama-models' RawMediaItem; text as a
    dict or a RawTextItem: the same prompt."""
    from llama_models.datatypes import RawMediaItem, RawTextItem

    path = tmp_path / "wide.png"
    path.write_bytes(WIDE)
    expected = ours.encode_dialog(DIALOGS["wide"])
    for source in (path, str(path), Image.open(io.BytesIO(WIDE)), io.BytesIO(WIDE)):
        part = RawMediaItem(data=source) if isinstance(source, io.BytesIO) else image(source)
        got = ours.encode_dialog([{"role": "user", "content": [text("And this one?"), part]}])
        assert got.tokens == expected.tokens and torch.equal(got.images[0].pixel_values,
                                                             expected.images[0].pixel_values)
    got = ours.encode_dialog([{"role": "user", "content": [RawTextItem(text="And this one?"),
                                                            RawMediaItem(data=WIDE)]}])
    assert got.tokens == expected.tokens


def test_text_only_dialogs_are_unchanged(ours):
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = ours.encode_dialog(dialog)
    assert got.images == [] and got.tokens == ours.encode_dialog_prompt(dialog)
    assert got.tokens == Llama4ChatFormat(ours.tokenizer).encode_dialog_prompt(dialog)  # without vision too
    # text parts only: one string, the parts joined (as the server joins OpenAI's text parts)
    parts = [{"role": "user", "content": [text("H"), text("i")]}]
    assert ours.encode_dialog_prompt(parts) == ours.encode_dialog_prompt([{"role": "user", "content": "Hi"}])


def test_same_image_same_digest(ours):
    a = ours.encode_dialog(DIALOGS["one tile"]).images[0]
    b = ours.encode_dialog([{"role": "user", "content": [image(ONE_TILE)]}]).images[0]
    c = ours.encode_dialog([{"role": "user", "content": [image(png(300, 200, seed=9))]}]).images[0]
    assert a.digest == b.digest != c.digest and len(a.digest) == 64


def test_vision_args_give_the_layout():
    from llama_models.llama4.args import VisionArgs

    for args in (VISION_ARGS, VisionArgs(**VISION_ARGS)):
        layout = TileLayout.from_vision_args(args)
        assert (layout.image_size, layout.patch_size, layout.pixel_shuffle_ratio) == (336, 14, 0.5)
        assert layout.patches_per_tile == 144  # (336 / 14)^2 / 4
    with pytest.raises(ValueError, match="square"):
        TileLayout.from_vision_args({**VISION_ARGS, "image_size": {"height": 336, "width": 448}})
    with pytest.raises(ValueError, match="pixel_shuffle_ratio"):
        TileLayout.from_vision_args({k: v for k, v in VISION_ARGS.items() if k != "pixel_shuffle_ratio"})


# --- refusals --------------------------------------------------------------------------------

WITH_IMAGE = [{"role": "user", "content": [text("What is this?"), image(ONE_TILE)]}]


def test_text_models_take_no_images(ours, llama3_tokenizer_path, sp_tokenizer_path):
    llama3 = load_tokenizer(llama3_tokenizer_path)
    formats = [Llama3ChatFormat(llama3),
               Llama2ChatFormat(load_tokenizer(sp_tokenizer_path)),
               Llama4ChatFormat(ours.tokenizer)]  # Llama 4 without a vision layout
    for fmt in formats:
        for encode in (fmt.encode_dialog, fmt.encode_dialog_prompt):
            with pytest.raises(ValueError, match=r"message 0 holds an image, but this model takes no images"):
                encode(WITH_IMAGE)
    with pytest.raises(ValueError, match="made without the model's vision layout"):
        Llama4ChatFormat(ours.tokenizer).image_tokens((1, 1))
    with pytest.raises(ValueError, match="image input is for Llama 4"):
        chat_format_for(llama3, vision=TileLayout())
    assert chat_format_for(ours.tokenizer, vision=TileLayout()).image_layout == TileLayout()


def test_refusals(ours):
    with pytest.raises(ValueError, match="encode it with encode_dialog"):
        ours.encode_dialog_prompt(WITH_IMAGE)
    with pytest.raises(ValueError, match="images go in user messages"):
        ours.encode_dialog([{"role": "system", "content": [image(ONE_TILE)]}, {"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 0 content part 1: the image could not be decoded"):
        ours.encode_dialog([{"role": "user", "content": [text("x"), image(ONE_TILE[:300])]}])
    with pytest.raises(ValueError, match=r"message 0 content part 0: .*over the limit of 1,000 pixels"):
        Llama4ChatFormat(ours.tokenizer, TileLayout(), max_image_pixels=1000).encode_dialog(
            [{"role": "user", "content": [image(ONE_TILE)]}])
    with pytest.raises(ValueError, match="type must be 'text' or 'image'"):
        ours.encode_dialog([{"role": "user", "content": [{"type": "audio", "audio": b""}]}])
    with pytest.raises(ValueError, match="holds its image under 'image'"):
        ours.encode_dialog([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}])
    with pytest.raises(TypeError, match="an image is a PIL.Image, bytes or a path"):
        ours.encode_dialog([{"role": "user", "content": [image(3)]}])
    with pytest.raises(TypeError, match="a dialog must be a list of messages"):
        ours.encode_dialog_prompt("not a dialog")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="content must be a str or a list of content parts"):
        ours.encode_dialog([{"role": "user", "content": ["bare strings are not parts"]}])


def test_the_chat_formats_stay_light_to_import():
    """PIL and torch are imported when a dialog holds an image, not with the chat formats."""
    code = "import sys, llama.formats.chat; print('torch' in sys.modules, 'PIL' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.split() == ["False", "False"], out.stderr
