"""Meta's Llama 4 image preprocessing (``llama_models/llama4/preprocess.py``) and chat format,
run in the tests without torchvision: a stand-in for the few torchvision pieces they use.

``preprocess.py`` imports ``torchvision.transforms as tv`` and ``torchvision.transforms.functional
as F`` and calls ``tv.Compose``, ``tv.Resize``, ``tv.ToTensor``, ``tv.Normalize``,
``tv.InterpolationMode.BILINEAR`` and ``F.resize``.  Torchvision has no CPU build for the torch
these tests run on, so :func:`meta_modules` puts the module-level names ``tv`` and ``F`` of Meta's
module to the stand-ins below, written from torchvision's documented behaviour on PIL images
(``torchvision/transforms/functional.py``, ``functional_pil.py`` and ``transforms.py`` of the
v1 transforms API, as recent releases define them; not checked against an installed torchvision,
which this machine cannot have) and independently of ``llama.images.preprocess`` (numpy here, not ``torch.frombuffer``):

* ``F.resize(img, [h, w], interpolation)`` of a PIL image: the image unchanged when it already
  has that size, else ``img.resize((w, h), <PIL filter of the mode>)``; torchvision's
  ``antialias`` does not apply to PIL images (PIL's filters always antialias).  Only the
  ``[h, w]`` form Meta uses is written (an int size, the shorter side, is refused here).
* ``ToTensor`` of an 8-bit RGB PIL image: ``torch.from_numpy(np.array(img, np.uint8))``, viewed
  ``[H, W, C]``, permuted to ``[C, H, W]``, ``.to(float32).div(255)``.
* ``Normalize(mean, std, inplace)``: ``tensor.sub_(mean[:, None, None]).div_(std[:, None, None])``
  with mean and std as tensors of the input's dtype (on a clone unless ``inplace``).
* ``Compose``: each transform in turn; ``Resize(size, interpolation)``: ``F.resize``.

Where it could differ from torchvision: other image modes (``ToTensor`` of ``I``/``I;16``/``F``
or ``1`` images: never reached, Meta converts to RGB first), tensor inputs (tensors are resized
by torchvision's own kernels, not PIL's: Meta's code resizes PIL images only), and the
``max_size`` and int-size forms of ``resize``, which Meta's code does not use.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, ImageFile


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


_PIL_FILTERS = {
    InterpolationMode.NEAREST: Image.Resampling.NEAREST,
    InterpolationMode.BILINEAR: Image.Resampling.BILINEAR,
    InterpolationMode.BICUBIC: Image.Resampling.BICUBIC,
    InterpolationMode.LANCZOS: Image.Resampling.LANCZOS,
}


def resize(img: Image.Image, size: Sequence[int], interpolation: InterpolationMode = InterpolationMode.BILINEAR,
           max_size: Any = None, antialias: Any = True) -> Image.Image:
    if not isinstance(img, Image.Image):
        raise NotImplementedError("stand-in: PIL images only")
    if isinstance(size, int) or len(size) != 2 or max_size is not None:
        raise NotImplementedError("stand-in: only the [height, width] form")
    height, width = size
    if img.size == (width, height):
        return img
    return img.resize((width, height), _PIL_FILTERS[interpolation])


def to_tensor(pic: Image.Image) -> torch.Tensor:
    if pic.mode != "RGB":
        raise NotImplementedError("stand-in: RGB images only")
    img = torch.from_numpy(np.array(pic, np.uint8, copy=True))
    img = img.view(pic.size[1], pic.size[0], 3).permute((2, 0, 1)).contiguous()
    return img.to(dtype=torch.get_default_dtype()).div(255)


def normalize(tensor: torch.Tensor, mean: Sequence[float], std: Sequence[float], inplace: bool = False
              ) -> torch.Tensor:
    if not inplace:
        tensor = tensor.clone()
    mean_t = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    return tensor.sub_(mean_t).div_(std_t)


class Compose:
    def __init__(self, transforms: Sequence[Any]) -> None:
        self.transforms = list(transforms)

    def __call__(self, img: Any) -> Any:
        for t in self.transforms:
            img = t(img)
        return img


class Resize:
    def __init__(self, size: Sequence[int], interpolation: InterpolationMode = InterpolationMode.BILINEAR,
                 max_size: Any = None, antialias: Any = True) -> None:
        self.size, self.interpolation, self.max_size = size, interpolation, max_size

    def __call__(self, img: Image.Image) -> Image.Image:
        return resize(img, self.size, self.interpolation, self.max_size)


class ToTensor:
    def __call__(self, pic: Image.Image) -> torch.Tensor:
        return to_tensor(pic)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> None:
        self.mean, self.std, self.inplace = mean, std, inplace

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return normalize(tensor, self.mean, self.std, self.inplace)


def fake_torchvision() -> dict[str, types.ModuleType]:
    """``torchvision``, ``torchvision.transforms`` and ``.functional`` stand-in modules."""
    tv = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.resize = resize  # type: ignore[attr-defined]
    functional.to_tensor = to_tensor  # type: ignore[attr-defined]
    functional.normalize = normalize  # type: ignore[attr-defined]
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    for name, value in dict(Compose=Compose, Resize=Resize, ToTensor=ToTensor, Normalize=Normalize,
                            InterpolationMode=InterpolationMode, functional=functional).items():
        setattr(transforms, name, value)
    tv.transforms = transforms  # type: ignore[attr-defined]
    return {"torchvision": tv, "torchvision.transforms": transforms, "torchvision.transforms.functional": functional}


def meta_modules(monkeypatch) -> tuple[types.ModuleType, types.ModuleType]:
    """Meta's ``llama4.preprocess`` and ``llama4.chat_format`` modules, their torchvision names
    pointed at the stand-ins (whatever torchvision, real or another test's empty stand-in, they
    were imported with), and PIL's global ``LOAD_TRUNCATED_IMAGES``, which Meta's module sets on
    import, put back as it was."""
    fakes = fake_torchvision()
    truncated = ImageFile.LOAD_TRUNCATED_IMAGES
    if "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            for name, module in fakes.items():
                monkeypatch.setitem(sys.modules, name, module)
    preprocess = importlib.import_module("llama_models.llama4.preprocess")
    chat_format = importlib.import_module("llama_models.llama4.chat_format")
    ImageFile.LOAD_TRUNCATED_IMAGES = truncated
    monkeypatch.setattr(preprocess, "tv", fakes["torchvision.transforms"])
    monkeypatch.setattr(preprocess, "F", fakes["torchvision.transforms.functional"])
    return preprocess, chat_format


def meta_pixel_values(preprocess: types.ModuleType, chat_format: types.ModuleType, data: bytes,
                      max_num_chunks: int = 16) -> tuple[torch.Tensor, tuple[int, int]]:
    """Meta's tiles of an image file's bytes, as its ``ChatFormat._encode_content`` makes them:
    ``PIL.Image.open``, ``convert_image_to_rgb``, ``VariableSizeImageTransform(336)``, and a
    ``ResizeNormalizeImageTransform(336, 336)`` global tile when there is more than one."""
    import io

    image = chat_format.convert_image_to_rgb(Image.open(io.BytesIO(data)))
    return meta_tiles(preprocess, image, max_num_chunks)


def meta_tiles(preprocess: types.ModuleType, image: Image.Image, max_num_chunks: int = 16
               ) -> tuple[torch.Tensor, tuple[int, int]]:
    """Meta's tiles of an RGB image (the steps of :func:`meta_pixel_values` after the RGB conversion)."""
    tiles, ar = preprocess.VariableSizeImageTransform(336)(image, max_num_chunks=max_num_chunks)
    if tiles.shape[0] > 1:
        whole = preprocess.ResizeNormalizeImageTransform(336, 336)(image)
        tiles = torch.cat((tiles, whole.unsqueeze(0)), dim=0)
    return tiles, tuple(ar)


def dog_jpg() -> Path:
    import llama_models

    return Path(llama_models.__file__).parent / "resources" / "dog.jpg"
