"""Two independent makers of Llama 3.2 Vision's tiles, for the tests of ``llama.images.mllama``:

* Meta's ``llama_models/llama3/multimodal/image_transform.py`` (``VariableSizeImageTransform``),
  run with the torchvision stand-in of tests/meta_images.py (it calls ``tv.ToTensor``,
  ``tv.Normalize``, ``tv.InterpolationMode.BILINEAR`` and ``F.resize``, all written there);
* Hugging Face's ``MllamaImageProcessorPil`` (numpy and PIL, no torchvision) configured as the
  ``preprocessor_config.json`` of Meta's Llama-3.2-11B-Vision-Instruct and 90B-Vision-Instruct is
  written: 560-pixel tiles, at most 4, CLIP's mean and std, bilinear, RGB conversion on.
"""

from __future__ import annotations

import importlib
import io
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import meta_images

# Meta's and Hugging Face's numbers, written out here (not read from llama.images.mllama).
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def meta_image_transform(monkeypatch) -> types.ModuleType:
    """Meta's ``llama3.multimodal.image_transform`` module, its torchvision names pointed at the
    stand-ins (whatever torchvision, real or another test's stand-in, it was imported with).  The
    stand-ins are in ``sys.modules`` only while Meta's module is imported: a torchvision there
    would make transformers, imported later, take it for the real one."""
    fakes = meta_images.fake_torchvision()
    with pytest.MonkeyPatch.context() as importing:
        if "torchvision" not in sys.modules:
            try:
                import torchvision  # noqa: F401
            except ImportError:
                for name, module in fakes.items():
                    importing.setitem(sys.modules, name, module)
        module = importlib.import_module("llama_models.llama3.multimodal.image_transform")
    monkeypatch.setattr(module, "tv", fakes["torchvision.transforms"])
    monkeypatch.setattr(module, "F", fakes["torchvision.transforms.functional"])
    return module


def meta_tiles(module: types.ModuleType, image: Image.Image, chunk_size: int = 560, max_num_chunks: int = 4
               ) -> tuple[torch.Tensor, tuple[int, int]]:
    """Meta's tiles of an RGB image, ``[n_tiles, 3, S, S]``, and its ``ar`` ``(tiles_y, tiles_x)``,
    as ``CrossAttentionTransformer.compute_vision_tokens_masks`` calls the transform."""
    tiles, ar = module.VariableSizeImageTransform(size=chunk_size)(image, max_num_chunks=max_num_chunks)
    return tiles, tuple(ar)


def meta_chat_image(data: bytes) -> Image.Image:
    """What Meta's Llama 3 ``ChatFormat._encode_content`` makes of an image's bytes."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def hf_processor(chunk_size: int = 560, max_num_chunks: int = 4) -> Any:
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    return MllamaImageProcessorPil(size={"height": chunk_size, "width": chunk_size}, max_image_tiles=max_num_chunks,
                                   image_mean=CLIP_MEAN, image_std=CLIP_STD, do_convert_rgb=True,
                                   do_rescale=True, rescale_factor=1 / 255, do_normalize=True, resample=2)


def hf_batch(processor: Any, images: list[list[Image.Image]]) -> dict[str, Any]:
    """Hugging Face's processing of a batch (a list of each prompt's images)."""
    out = processor(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "aspect_ratio_ids": out["aspect_ratio_ids"],
            "aspect_ratio_mask": out["aspect_ratio_mask"], "num_tiles": out["num_tiles"]}


def hf_one(processor: Any, image: Image.Image) -> tuple[torch.Tensor, int, int]:
    """Hugging Face's ``pixel_values`` ``[max_num_chunks, 3, S, S]``, aspect-ratio id and tile
    count of one image."""
    out = hf_batch(processor, [[image]])
    return out["pixel_values"][0, 0], int(out["aspect_ratio_ids"][0, 0]), out["num_tiles"][0][0]


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A random image: every pixel differs, so a tile or a row out of place shows."""
    channels = len(Image.new(mode, (1, 1)).getbands())
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=height * width * channels, dtype=np.uint8)
    return Image.frombytes(mode, (width, height), data.tobytes())


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"compress_level": 1} if fmt == "PNG" else {}))
    return buf.getvalue()


def photographs() -> dict[str, Path]:
    """The photographs shipped with llama-models (Meta's dog.jpg, the one part 1's tests use, and pasta.jpeg)."""
    import llama_models

    resources = Path(llama_models.__file__).parent / "resources"
    return {"dog.jpg": resources / "dog.jpg", "pasta.jpeg": resources / "pasta.jpeg"}
