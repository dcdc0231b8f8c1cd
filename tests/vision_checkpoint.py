"""A tiny Llama 4 checkpoint that sees, for the tests that run it as a user would (the example
script, the server, torchrun): tests/test_engine_images.py's model, written to disk once per
test process.

A random ``Llama4ForConditionalGeneration`` (test_llama4_vision's tiny shape: 56-pixel tiles in
7-pixel patches, 16 ``<|patch|>`` tokens a tile; a text model of width 64) with Llama 4's
vocabulary (202,048 ids), saved by transformers and converted with ``hf_to_meta`` into Meta's
files, Meta's Llama 4 tokenizer beside them (so ``--ckpt_dir`` alone finds it, and its chat
format lays out image tokens).  Also a picture helper: PNG files whose tiles differ.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest

VOCAB, PATCH = 202048, 200092  # Llama 4's vocabulary and its <|patch|> id
PATCHES_PER_TILE = 16  # (56 / 7)^2 patches, 4x fewer after the pixel shuffle (ratio 0.5)
TILE = 56  # a tile's side in pixels


class VisionCheckpoint(NamedTuple):
    hf_dir: Path  # transformers' folder (config.json, model.safetensors, tokenizer.model)
    ckpt_dir: Path  # Meta's files: params.json (with vision_args), consolidated.00.pth, tokenizer.model

    @property
    def tokenizer_path(self) -> Path:
        return self.ckpt_dir / "tokenizer.model"


_made: dict[str, VisionCheckpoint] = {}


def llama4_tokenizer_path() -> Path:
    llama_models = pytest.importorskip("llama_models")
    return Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"


def vision_checkpoint(tmp_path_factory) -> VisionCheckpoint:
    """The checkpoint (made on the first call in this test process, about 10 s)."""
    if "one" not in _made:
        pytest.importorskip("transformers")
        from llama.convert import hf_to_meta
        from test_llama4_vision import hf_config, random_hf_model

        root = tmp_path_factory.mktemp("llama4_vision_ckpt")
        hf = random_hf_model(hf_config(vocab_size=VOCAB, image_token=PATCH))
        hf.save_pretrained(root / "hf")
        shutil.copyfile(llama4_tokenizer_path(), root / "hf" / "tokenizer.model")
        hf_to_meta(root / "hf", root / "meta")
        assert (root / "meta" / "tokenizer.model").is_file()
        _made["one"] = VisionCheckpoint(root / "hf", root / "meta")
    return _made["one"]


def picture_png(color: tuple[int, int, int], size: tuple[int, int] = (TILE, TILE)) -> bytes:
    """A PNG of ``size`` in ``color`` with a gradient dotted over it (so that its tiles differ)."""
    from PIL import Image

    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 4):
        for y in range(0, size[1], 4):
            image.putpixel((x, y), ((x * 5) % 256, (y * 7) % 256, (x + y) % 256))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
