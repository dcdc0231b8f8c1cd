"""The memory check counts what encoding the largest image takes (llama.checkpoint.memory's
``image_activation_bytes`` for MAX_IMAGE_TILES tiles), not only the encoder's weights; the engine
never encodes more tiles in one call than that; and the estimate bounds the peak measured when a
small encoder encodes that many tiles (tests/image_memory_worker.py, in fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import helpers
from llama.args import ModelArgs
from llama.checkpoint.memory import ALLOCATOR_SLACK, check_memory, image_activation_bytes, memory_need
from llama.engine.runner import _tile_groups
from llama.images.prompt import MAX_IMAGE_TILES
from llama.model import Transformer
from llama.runtime import distributed

WORKER = Path(__file__).parent / "image_memory_worker.py"
# A small text model (short context, one row) before a large encoder: activation-bound by the image.
TEXT = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16, max_seq_len=64,
            max_batch_size=1)
ENCODER = {"image_size": 336, "patch_size": 14, "dim": 512, "n_layers": 2, "n_heads": 8, "mlp_ratio": 4.0,
           "output_dim": 512, "pixel_shuffle_ratio": 0.5}


def meta_model(vision_args) -> Transformer:
    distributed.init_model_parallel(torch.device("cpu"))
    with torch.device("meta"):
        return Transformer(ModelArgs(**TEXT, vision_args=vision_args))


def test_the_largest_image_is_meta_s_grid_and_its_global_tile():
    assert MAX_IMAGE_TILES == 16 + 1  # Meta's max_num_chunks, then the global tile


def test_encoding_the_largest_image_is_counted():
    """A model that sees needs what encoding MAX_IMAGE_TILES tiles takes beside its weights and KV
    cache (here more than its prefill); a text-only model of the same text shape needs none of it.
    Memory for the weights, the cache and the prefill alone is refused, naming the image."""
    model, text = meta_model(ENCODER), meta_model(None)
    need, text_need = memory_need(model, torch.float32), memory_need(text, torch.float32)
    vision = model.params.vision_args
    assert need.image_activations == image_activation_bytes(vision, TEXT["dim"], MAX_IMAGE_TILES, torch.float32)
    assert text_need.image_activations == 0
    assert need.activations == text_need.activations and need.image_activations > need.activations
    assert need.total == need.weights + need.kv_cache + need.image_activations
    # The stream alone: 17 tiles x 577 tokens (24 x 24 patches and the class token) x 512 wide, float32.
    assert need.image_activations > ALLOCATOR_SLACK * MAX_IMAGE_TILES * 577 * 512 * 4
    available = need.weights + need.kv_cache + (need.activations + need.image_activations) // 2
    with pytest.raises(RuntimeError, match=r"encoding the largest image, 17 tiles, takes"):
        check_memory(model, torch.float32, torch.device("cpu"), available=available)
    check_memory(text, torch.float32, torch.device("cpu"), available=available)  # the text model fits


def test_image_activations_scale_with_tiles_dtype_and_ranks():
    """Every term is per tile, per element (all but the float32 working copies and the float32
    tiles) and, for the heads and MLPs, per rank."""
    vision = ModelArgs(**TEXT, vision_args=ENCODER).vision_args
    one = image_activation_bytes(vision, 64, 1, torch.float32)
    assert image_activation_bytes(vision, 64, MAX_IMAGE_TILES, torch.float32) == pytest.approx(
        MAX_IMAGE_TILES * one, rel=1e-6)
    assert image_activation_bytes(vision, 64, 4, torch.bfloat16) < image_activation_bytes(vision, 64, 4, torch.float32)
    assert image_activation_bytes(vision, 64, 4, torch.float32, world_size=2) < \
        image_activation_bytes(vision, 64, 4, torch.float32)


def test_the_engine_encodes_at_most_one_largest_image_a_call():
    images = [SimpleNamespace(n_tiles=n) for n in (1, 5, 17, 1, 1, 3, 9, 9)]
    groups = _tile_groups(images)  # type: ignore[arg-type]
    assert [[i.n_tiles for i in g] for g in groups] == [[1, 5], [17], [1, 1, 3, 9], [9]]
    assert [i for g in groups for i in g] == images  # in order, each once


# The measured configs: the shape of test_encoding_the_largest_image_is_counted's encoder made
# smaller (112-pixel tiles: 257 tokens a tile), 17 tiles, in float32 and bfloat16.
SMALL_ENCODER = {**ENCODER, "image_size": 112, "patch_size": 7, "dim": 128, "n_heads": 4, "output_dim": 256}
PEAK_CASES = [("float32", {**SMALL_ENCODER, "tiles": MAX_IMAGE_TILES, "dtype": "float32"}),
              ("bfloat16", {**SMALL_ENCODER, "tiles": MAX_IMAGE_TILES, "dtype": "bfloat16"})]


@pytest.fixture(scope="module")
def measured_peaks() -> dict[str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(helpers.REPO), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(WORKER), *(json.dumps(c) for _, c in PEAK_CASES)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"measured"')]
    assert len(lines) == len(PEAK_CASES), out.stdout[-3000:]
    return {name: json.loads(line) for (name, _), line in zip(PEAK_CASES, lines)}


@pytest.mark.slow  # two fresh processes build and run an encoder (seconds)
@pytest.mark.parametrize("name", [n for n, _ in PEAK_CASES])
def test_image_estimate_bounds_the_measured_peak(measured_peaks, name):
    measured, estimate = measured_peaks[name]["measured"], measured_peaks[name]["estimate"]
    print(f"{name}: measured {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB")
    assert measured > 8 * 2**20  # large enough to measure
    assert measured <= estimate <= 4 * measured  # a bound, not a wild one (as tests/test_memory.py's)
