"""Images in Llama 3.2 Vision's chat format (llama.formats.chat.Llama3ChatFormat with an
MllamaLayout): token for token as Meta's ``llama3/chat_format.py`` encodes them with its tokenizer,
the same tiles as Meta's ``image_transform.py`` makes of its images (tests/mllama_images.py) and
the same cross-attention spans as its ``create_vision_mask``; the layout read from a model's
params and the choice of format by tokenizer; the path the engine takes (dialog and params to
token ids and the model's image tensors); and the limits and refusals."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from llama.formats.chat import Llama3ChatFormat, Llama4ChatFormat, chat_format_for
from llama.images import mllama
from llama.images.prompt import (
    MLLAMA_IMAGE_TOKEN_ID,
    EncodedDialog,
    MllamaLayout,
    MllamaPromptImage,
    TileLayout,
    image_layout,
)
from llama.tokenizer import load_tokenizer

llama_models = pytest.importorskip("llama_models")
import mllama_images  # noqa: E402
from mllama_images import encoded, noise  # noqa: E402

LLAMA3_TOKENIZER = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
LLAMA4_TOKENIZER = Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"

# Meta's Llama-3.2-11B-Vision params.json (the Instruct model's and 90B's tiles are 560).
PARAMS_11B = {"dim": 4096, "ffn_dim_multiplier": 1.3, "multiple_of": 1024, "n_heads": 32, "n_kv_heads": 8,
              "n_layers": 32, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
              "vision_chunk_size": 448, "vision_max_num_chunks": 4, "vision_num_cross_attention_layers": 8,
              "vocab_size": 128256}

DOG = mllama_images.photographs()["dog.jpg"].read_bytes()  # (1, 1)
SMALL = encoded(noise(300, 200, seed=1))  # (1, 1)
WIDE = encoded(noise(1500, 500, seed=2))  # (1, 3)
SQUARE = encoded(noise(700, 700, seed=3))  # (2, 2)


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(data) -> dict:
    return {"type": "image", "image": data}


DIALOGS = {
    "one image": [{"role": "user", "content": [image(DOG), text("Describe this image in two sentences")]}],
    "text before the image": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text("Look at this: "), image(WIDE), text(" What is it?")]}],
    "image mid-dialog": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [text("What is in"), image(SQUARE), text("?")]}],
    "two images together": [{"role": "user", "content": [image(SMALL), image(WIDE), text("Compare them.")]}],
    "two images apart": [
        {"role": "user", "content": [image(DOG), text("What is this?")]},
        {"role": "assistant", "content": "A dog."},
        {"role": "user", "content": [text("And this?"), image(SQUARE)]}],
    "three images": [{"role": "user", "content": [image(SMALL), text("then"), image(WIDE), image(SQUARE)]}],
}


@pytest.fixture(scope="module")
def ours() -> Llama3ChatFormat:
    fmt = chat_format_for(load_tokenizer(LLAMA3_TOKENIZER), vision=MllamaLayout())
    assert isinstance(fmt, Llama3ChatFormat)
    return fmt


@pytest.fixture(scope="module")
def meta():
    """Meta's Llama 3 ChatFormat (with its own tokenizer) and its image transform module."""
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    with pytest.MonkeyPatch.context() as mp:
        yield ChatFormat(Tokenizer(LLAMA3_TOKENIZER)), mllama_images.meta_image_transform(mp)


def meta_encode(chat, dialog):
    """Meta's encoding of a dialog in our shapes: image parts as RawMediaItem of the bytes."""
    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem

    def item(part):
        return RawTextItem(text=part["text"]) if part["type"] == "text" else RawMediaItem(data=part["image"])

    messages = [RawMessage(role=m["role"], content=m["content"] if isinstance(m["content"], str)
                           else [item(p) for p in m["content"]]) for m in dialog]
    return chat.encode_dialog_prompt(messages)


# Two of the dialogs are slow only to keep the quick run short: "three images" holds what they hold.
QUICK = ("one image", "image mid-dialog", "two images apart", "three images")


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in DIALOGS])
def test_tokens_tiles_and_spans_match_meta(ours, meta, name):
    chat, transform = meta
    expected = meta_encode(chat, DIALOGS[name])
    got = ours.encode_dialog(DIALOGS[name])
    assert isinstance(got, EncodedDialog)
    assert got.tokens == list(expected.tokens)
    assert len(got.images) == len(expected.vision.images)
    for img, pil in zip(got.images, expected.vision.images):
        assert isinstance(img, MllamaPromptImage)
        tiles, ar = mllama_images.meta_tiles(transform, pil)
        assert img.grid == ar and img.num_tiles == tiles.shape[0]
        assert (img.pixel_values[: img.num_tiles] - tiles).abs().max().item() <= 1e-6
        assert not img.pixel_values[img.num_tiles:].any()
        assert got.tokens[img.start] == MLLAMA_IMAGE_TOKEN_ID and img.end == img.start + 1
    # Meta's create_vision_mask: [start, end) per image, -1 (to the end) for a lone image, the
    # prompt's length for the last of several (ours: None, to the end, the reply included)
    n = len(got.images)
    last = -1 if n == 1 else len(got.tokens)
    spans = [[i.start, last if i.attended_until is None else i.attended_until] for i in got.images]
    assert spans == expected.vision.mask


def test_the_format_written_out(ours):
    """An independent statement of the prompt, labelled, for one image before a word."""
    tok = ours.tokenizer
    assert [tok.encode(s, bos=False, eos=False) for s in ("user", "assistant", "\n\n", "Hi")] == [
        [882], [78191], [271], [13347]]
    got = ours.encode_dialog([{"role": "user", "content": [image(SMALL), text("Hi")]}])
    assert got.tokens == [
        128000,  # <|begin_of_text|>
        128006, 882, 128007, 271,  # <|start_header_id|>user<|end_header_id|>\n\n
        128256,  # the image (Meta's ChatFormat hands the model 128256 for <|image|>, 128011)
        13347,  # Hi
        128009,  # <|eot_id|>
        128006, 78191, 128007, 271,  # <|start_header_id|>assistant<|end_header_id|>\n\n
    ]
    assert tok.special_tokens["<|image|>"] == 128011 and tok.n_words == MLLAMA_IMAGE_TOKEN_ID
    image_ = got.images[0]
    assert (image_.start, image_.end, image_.attended_until, image_.grid, image_.aspect_ratio_id) == (
        5, 6, None, (1, 1), 1)


def test_cross_attention_spans_written_out(ours):
    got = ours.encode_dialog(DIALOGS["three images"])
    small, wide, square = got.images
    assert wide.start == small.start + 2 and square.start == wide.start + 1  # image, "then", image, image
    assert (small.attended_until, wide.attended_until, square.attended_until) == (wide.start, None, None)


def test_text_only_dialogs_are_unchanged(ours):
    """With a layout or without, Llama 3's text prompts are the same (and tool calls stay as they were)."""
    plain = Llama3ChatFormat(ours.tokenizer)
    call = {"tool_name": "get_weather", "arguments": {"city": "Paris"}, "call_id": "c1"}
    dialogs = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "ipython", "content": "sunny"}],
        [{"role": "user", "content": [text("H"), text("i")]}],  # text parts: one string
    ]
    for dialog in dialogs:
        got = ours.encode_dialog(dialog)
        assert got.images == []
        assert got.tokens == ours.encode_dialog_prompt(dialog) == plain.encode_dialog_prompt(dialog)


def test_part_shapes_agree(ours, tmp_path):
    """An image given as bytes, a path, a PIL image or llama-models' RawMediaItem: the same prompt."""
    from llama_models.datatypes import RawMediaItem

    path = tmp_path / "wide.png"
    path.write_bytes(WIDE)
    expected = ours.encode_dialog([{"role": "user", "content": [text("And this one?"), image(WIDE)]}])
    for source in (path, str(path), Image.open(io.BytesIO(WIDE)), io.BytesIO(WIDE)):
        part = RawMediaItem(data=source) if isinstance(source, io.BytesIO) else image(source)
        got = ours.encode_dialog([{"role": "user", "content": [text("And this one?"), part]}])
        assert got.tokens == expected.tokens
        assert torch.equal(got.images[0].pixel_values, expected.images[0].pixel_values)


def test_same_image_same_digest(ours):
    a = ours.encode_dialog(DIALOGS["one image"]).images[0]
    b = ours.encode_dialog([{"role": "user", "content": [image(DOG)]}]).images[0]
    c = ours.encode_dialog([{"role": "user", "content": [image(SMALL)]}]).images[0]
    assert a.digest == b.digest != c.digest and len(a.digest) == 64


# --- the layout from a model's params, and the format from its tokenizer ---------------------


def test_the_layout_comes_from_the_params():
    from llama_models.llama3.args import ModelArgs as MetaLlama3Args

    assert image_layout(PARAMS_11B) == MllamaLayout(chunk_size=448, max_num_chunks=4)
    assert image_layout({**PARAMS_11B, "vision_chunk_size": 560}) == MllamaLayout()
    assert image_layout(MetaLlama3Args(vision_chunk_size=560)) == MllamaLayout()  # an object's fields
    assert image_layout(MetaLlama3Args()) is None  # vision_chunk_size -1: a text model
    text_params = {k: v for k, v in PARAMS_11B.items() if not k.startswith("vision_")}
    assert image_layout(text_params) is None
    llama4 = {"vision_args": {"image_size": {"height": 336, "width": 336}, "patch_size": {"height": 14, "width": 14},
                              "pixel_shuffle_ratio": 0.5}}
    assert image_layout(llama4) == TileLayout()
    assert MllamaLayout.from_params({"vision_chunk_size": 560}) == MllamaLayout()  # 4 tiles when unsaid
    for bad in ({"vision_chunk_size": "560"}, {"vision_chunk_size": 560, "vision_max_num_chunks": 0}):
        with pytest.raises(ValueError, match="must be a positive integer"):
            image_layout(bad)


def test_the_tokenizer_picks_the_format(ours, sp_tokenizer_path):
    llama3 = ours.tokenizer
    llama4 = load_tokenizer(LLAMA4_TOKENIZER)
    for name in (None, "llama3"):
        fmt = chat_format_for(llama3, name, vision=MllamaLayout())
        assert type(fmt) is Llama3ChatFormat and fmt.image_layout == MllamaLayout()
    assert type(chat_format_for(llama4, vision=TileLayout())) is Llama4ChatFormat
    with pytest.raises(ValueError, match="Llama 3.2 Vision layout .* needs a Llama 3 tokenizer.model, not a "
                                         "Llama4Tokenizer"):
        chat_format_for(llama4, vision=MllamaLayout())
    with pytest.raises(ValueError, match="needs a Llama 3 tokenizer.model, not a SentencePieceTokenizer"):
        chat_format_for(load_tokenizer(sp_tokenizer_path), vision=MllamaLayout())
    with pytest.raises(ValueError, match="image input is for Llama 4"):
        chat_format_for(llama3, vision=TileLayout())
    with pytest.raises(TypeError, match="vision must be a TileLayout .* or an MllamaLayout"):
        chat_format_for(llama3, vision={"vision_chunk_size": 560})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="message 0 holds an image, but this model takes no images .*3.2 Vision"):
        chat_format_for(llama3).encode_dialog(DIALOGS["one image"])


# --- the engine's path: dialog and params to token ids and image tensors ---------------------


def test_dialog_to_model_inputs():
    """What the engine does with a Llama 3.2 Vision checkpoint: the format from its tokenizer
    and params, a dialog encoded, its images stacked as the model takes them."""
    params = {**PARAMS_11B, "vision_chunk_size": 560}  # the Instruct model's
    fmt = chat_format_for(load_tokenizer(LLAMA3_TOKENIZER), vision=image_layout(params))
    got = fmt.encode_dialog(DIALOGS["two images apart"])
    assert got.tokens.count(MLLAMA_IMAGE_TOKEN_ID) == 2
    assert [(i.num_tiles, i.aspect_ratio_id) for i in got.images] == [(1, 1), (4, 6)]
    batch = mllama.stack_images([got.images, []])  # with a text-only prompt beside it
    assert batch.pixel_values.shape == (2, 2, 4, 3, 560, 560)
    assert batch.aspect_ratio_ids.tolist() == [[1, 6], [0, 0]]
    assert batch.num_tiles == [[1, 4], []]
    assert torch.equal(batch.pixel_values[0, 1], got.images[1].pixel_values) and not batch.pixel_values[1].any()
    # the prefix cache's keys (part 1's): each image's token paired with the image's digest
    from llama.engine.requests import keyed_tokens

    keys = keyed_tokens(got.tokens, got.images)
    assert [k for k, key in enumerate(keys) if isinstance(key, tuple)] == [i.start for i in got.images]
    assert keys[got.images[1].start] == (MLLAMA_IMAGE_TOKEN_ID, got.images[1].digest)


@pytest.mark.slow  # importing Hugging Face's processor module takes seconds
def test_spans_match_hugging_face_s_processor(ours):
    """The spans against Hugging Face's ``get_cross_attention_token_mask`` (its processor's, over
    the prompt's ids), which writes -1 for a lone image and the prompt's length for the last of several."""
    pytest.importorskip("transformers")
    from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

    for dialog in DIALOGS.values():
        got = ours.encode_dialog(dialog)
        last = -1 if len(got.images) == 1 else len(got.tokens)
        spans = [[i.start, last if i.attended_until is None else i.attended_until] for i in got.images]
        assert spans == get_cross_attention_token_mask(got.tokens, MLLAMA_IMAGE_TOKEN_ID)


# --- limits and refusals ---------------------------------------------------------------------


def test_limits(ours):
    few = Llama3ChatFormat(ours.tokenizer, MllamaLayout(), max_images=2)
    assert len(few.encode_dialog(DIALOGS["two images apart"]).images) == 2
    broken = [{"role": "user", "content": [image(SMALL), image(SMALL), image(SMALL[:100])]}]
    with pytest.raises(ValueError, match=r"the dialog holds 3 images, more than this model takes in one prompt \(2"):
        few.encode_dialog(broken)  # refused for the count, before the broken image is decoded
    with pytest.raises(ValueError, match=r"message 0 content part 2: the image could not be decoded"):
        ours.encode_dialog(broken)
    small = Llama3ChatFormat(ours.tokenizer, MllamaLayout(), max_image_pixels=1000)
    with pytest.raises(ValueError, match=r"message 0 content part 1: .*over the limit of 1,000 pixels"):
        small.encode_dialog([{"role": "user", "content": [text("x"), image(SMALL)]}])


def test_refusals(ours):
    with pytest.raises(ValueError, match="encode it with encode_dialog"):
        ours.encode_dialog_prompt(DIALOGS["one image"])
    with pytest.raises(ValueError, match="images go in user messages"):
        ours.encode_dialog([{"role": "system", "content": [image(SMALL)]}, {"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="type must be 'text' or 'image'"):
        ours.encode_dialog([{"role": "user", "content": [{"type": "audio", "audio": b""}]}])
    with pytest.raises(TypeError, match="an image is a PIL.Image, bytes or a path"):
        ours.encode_dialog([{"role": "user", "content": [image(3)]}])
    with pytest.raises(FileNotFoundError, match="message 0 content part 0: no image file"):
        ours.encode_dialog([{"role": "user", "content": [image(Path("/nonexistent/x.png"))]}])


def test_tools_beside_images(ours):
    """Declared tools come before the dialog (Llama 3.1's system and user messages, as for
    text), the image where it stands after them."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}
    dialog = DIALOGS["one image"]
    got = ours.encode_dialog(dialog, tools=[weather])
    plain = ours.encode_dialog(dialog)
    assert got.tokens[-len(plain.tokens) + 1:] == plain.tokens[1:]  # the dialog's own tokens, after the tools'
    assert len(got.images) == 1 and got.images[0].start == len(got.tokens) - len(plain.tokens) + plain.images[0].start
    assert "get_weather" in ours.tokenizer.decode(got.tokens[: got.images[0].start])
