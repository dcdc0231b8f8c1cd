"""Images through the engine: a prompt's image features fed at its ``<|patch|>`` positions when
the prompt is prefilled (whole, in chunks that cut an image, after a preemption), the prefix cache
keyed by the image, and ``Llama.chat_completion`` with image parts, against a second
implementation: the model's own ``forward`` with the encoder's features at the same positions,
recomputing the whole sequence for every token (and transformers' ``Llama4ForConditionalGeneration``,
which encodes the pixels itself).

The model: test_llama4_vision's tiny random Llama 4 with its encoder (56-pixel tiles, 16 features
a tile), but with Llama 4's vocabulary (202,048 ids, the embedding 64 wide) and Llama 4's
tokenizer, so that its chat format lays out image tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from llama import Llama
from llama.convert import hf_to_meta
from llama.engine import RequestSettings
from llama.engine.build import assemble_engine
from llama.images.prompt import PromptImage

transformers = pytest.importorskip("transformers")
llama_models = pytest.importorskip("llama_models")
Image = pytest.importorskip("PIL.Image")

from test_llama4_vision import hf_config, random_hf_model  # noqa: E402
from vision_helpers import IMAGE_SIZE  # noqa: E402

pytestmark = pytest.mark.slow  # every test here loads the model (a module fixture, ~10 s)

LLAMA4_TOKENIZER = Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"
VOCAB, PATCH = 202048, 200092  # Llama 4's vocabulary and its <|patch|> id
GREEDY = dict(temperature=0.0, stop_tokens=frozenset())  # every token counts: none ends a request


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """(transformers' model, our Llama built from its conversion with Llama 4's tokenizer)."""
    root = tmp_path_factory.mktemp("engine_images")
    hf = random_hf_model(hf_config(vocab_size=VOCAB, image_token=PATCH))
    hf.save_pretrained(root / "hf")
    shutil.copyfile(LLAMA4_TOKENIZER, root / "hf" / "tokenizer.model")
    hf_to_meta(root / "hf", root / "meta")
    llama = Llama.build(root / "meta", max_seq_len=128, max_batch_size=4, device="cpu", dtype="float32")
    assert llama.formatter.image_layout is not None
    return hf, llama


def engine_of(llama: Llama, **options) -> Llama:
    """Another engine over the same model (its own KV cache and prefix cache)."""
    return Llama._holding(assemble_engine(llama.model, llama.tokenizer, kv_block_size=8, **options))


def picture(color: tuple[int, int, int], size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)):
    """An image with a gradient, so that its tiles differ."""
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 4):
        for y in range(0, size[1], 4):
            image.putpixel((x, y), ((x * 5) % 256, (y * 7) % 256, (x + y) % 256))
    return image


def dialog(*images, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": i} for i in images]
             + [{"type": "text", "text": text}]}]


def encode(llama: Llama, messages: list[dict]) -> tuple[list[int], list[PromptImage]]:
    encoded = llama.formatter.encode_dialog(messages)
    return encoded.tokens, encoded.images


def reference_greedy(llama: Llama, tokens: list[int], images: list[PromptImage], n: int) -> list[int]:
    """``n`` greedy tokens from ``model.forward`` over the whole sequence each time, the images'
    features (one ``encode_images`` call) at their patch positions."""
    model = llama.model
    features = model.encode_images(torch.cat([i.pixel_values for i in images])).flatten(0, 1)
    positions = [p for i in images for p in i.patch_positions]
    out = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            mask = torch.zeros(1, len(out), dtype=torch.bool)
            mask[0, positions] = True
            logits = model.forward(torch.tensor([out]), 0, image_features=features, image_positions=mask)
            out.append(int(logits[0, -1].argmax()))
    return out[len(tokens):]


def greedy_after_each(llama: Llama, tokens: list[int], images: list[PromptImage], reply: list[int]) -> list[int]:
    """The greedy token after the prompt and each prefix of ``reply`` (``reply[:0]`` to
    ``reply[:-1]``), from one ``model.forward`` over the whole sequence (the images' features as
    :func:`reference_greedy` gives them): ``reply`` is :func:`reference_greedy`'s ``len(reply)``
    tokens exactly when it equals this list, for the n forwards of reference_greedy then see the
    same sequences; one forward instead of ``len(reply)``."""
    model = llama.model
    features = model.encode_images(torch.cat([i.pixel_values for i in images])).flatten(0, 1)
    sequence = list(tokens) + list(reply[:-1])
    mask = torch.zeros(1, len(sequence), dtype=torch.bool)
    mask[0, [p for i in images for p in i.patch_positions]] = True
    with torch.inference_mode():
        logits = model.forward(torch.tensor([sequence]), 0, image_features=features, image_positions=mask)
    return logits[0, len(tokens) - 1 :].argmax(dim=-1).tolist()


def hf_greedy(hf, tokens: list[int], images: list[PromptImage], n: int) -> list[int]:
    pixels = torch.cat([i.pixel_values for i in images])
    out = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(input_ids=torch.tensor([out]), pixel_values=pixels).logits[0, -1].argmax()))
    return out[len(tokens):]


def run(llama: Llama, tokens: list[int], images: list[PromptImage], n: int, **settings):
    return llama.engine.submit(tokens, RequestSettings(max_new_tokens=n, **{**GREEDY, **settings}),
                               images=images).result()


def test_greedy_tokens_with_an_image_are_the_models_and_transformers(vision):
    """(a) One prefill: the engine's tokens are model.forward's with the same features and
    transformers' from the pixels; the image changes them (another image, other logits)."""
    hf, llama = vision
    tokens, images = encode(llama, dialog(picture((200, 30, 30))))
    assert [tokens[p] for p in images[0].patch_positions] == [PATCH] * 16
    expected = reference_greedy(llama, tokens, images, 8)
    assert hf_greedy(hf, tokens, images, 8) == expected
    got = run(engine_of(llama), tokens, images, 8)
    assert got.tokens == expected
    # the features are used: a prompt without them (the <|patch|> embeddings) continues otherwise
    plain = llama.engine.submit(tokens, RequestSettings(max_new_tokens=8, **GREEDY)).result()  # type: ignore[arg-type]
    assert plain.tokens != expected


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunks_that_cut_an_image_give_the_same_tokens(vision, chunk):
    """(b) Prefill chunks of 7 and 16 tokens cut the image's 16 patches (and two images' of a
    wider image's tiles) anywhere: the same tokens as one prefill."""
    _, llama = vision
    tokens, images = encode(llama, dialog(picture((20, 200, 30)), picture((10, 10, 220), (2 * IMAGE_SIZE, 40))))
    assert images[0].n_tiles == 1 and images[1].n_tiles > 1  # a grid of tiles and its global tile
    expected = reference_greedy(llama, tokens, images, 6)
    engine = engine_of(llama, prefill_chunk=chunk)
    assert run(engine, tokens, images, 6).tokens == expected
    assert not engine.engine.runner.image_features  # kept only while the prompt is prefilled


def test_the_prefix_cache_shares_blocks_only_with_the_same_image(vision):
    """(c) The same image and text again reuses the prompt's blocks (image included) and gives the
    same tokens; the same text with another image reuses only the blocks before the image."""
    _, llama = vision
    engine = engine_of(llama)
    red, blue = picture((200, 30, 30)), picture((30, 30, 200))
    tokens, images = encode(engine, dialog(red))
    first = run(engine, tokens, images, 6)
    assert first.n_cached_prompt_tokens == 0
    again = run(engine, *encode(engine, dialog(red)), 6)
    assert again.tokens == first.tokens
    assert again.n_cached_prompt_tokens > images[0].end  # past the image: its blocks were shared
    other_tokens, other_images = encode(engine, dialog(blue))
    assert other_tokens == tokens  # the same ids: only the image differs
    other = run(engine, other_tokens, other_images, 6)
    assert other.n_cached_prompt_tokens <= images[0].start  # nothing of the image's blocks is reused
    assert other.tokens == reference_greedy(llama, other_tokens, other_images, 6)


def test_preempted_requests_with_images_give_their_tokens(vision):
    """(d) Four requests with images in a pool for about one and a half of them, prefilled 8
    tokens a step: requests are preempted (mid-prefill and mid-decode) and resumed, their features
    computed again; each gets the tokens it gets alone."""
    _, llama = vision
    engine = engine_of(llama, prefill_chunk=8, kv_cache_tokens=128)
    prompts = [encode(llama, dialog(picture((60 * k, 20, 200 - 40 * k)), text=f"Picture {k}?")) for k in range(4)]
    settings = RequestSettings(max_new_tokens=40, **GREEDY)  # type: ignore[arg-type]
    handles = [engine.engine.submit(t, settings, images=i) for t, i in prompts]
    results = [h.result() for h in handles]
    assert engine.engine.stats()["preemptions_total"] > 0
    for (tokens, images), result in zip(prompts, results):
        assert len(result.tokens) == 40
        assert result.tokens == greedy_after_each(llama, tokens, images, result.tokens)
    assert not engine.engine.runner.image_features


def test_chat_completion_and_its_stream_see_the_image(vision):
    """Llama.chat_completion with an image part: its tokens are the reference's greedy ones; the
    stream's text is the same reply."""
    _, llama = vision
    messages = dialog(picture((200, 200, 30)))
    (reply,) = llama.chat_completion([messages], temperature=0.0, max_gen_len=6, logprobs=True)
    tokens, images = encode(llama, messages)
    expected = reference_greedy(llama, tokens, images, 6)
    assert reply["tokens"] == [llama.tokenizer.decode([t]) for t in expected[: len(reply["tokens"])]]
    stream = llama.chat_completion_stream(messages, temperature=0.0, max_gen_len=6)
    assert "".join(stream) == reply["generation"]["content"]


def test_a_text_only_model_refuses_images(vision):
    """A model without an encoder refuses a prompt with images rather than dropping them."""
    _, llama = vision
    tokens, images = encode(llama, dialog(picture((1, 2, 3))))
    engine = llama.engine
    encoder, engine.model.vision_embeddings = engine.model.vision_embeddings, None
    try:
        with pytest.raises(ValueError, match="takes no images"):
            engine.submit(tokens, RequestSettings(max_new_tokens=1), images=images)
    finally:
        engine.model.vision_embeddings = encoder
    with pytest.raises(ValueError, match="not within the prompt"):
        engine.submit(tokens[:10], RequestSettings(max_new_tokens=1), images=images)
