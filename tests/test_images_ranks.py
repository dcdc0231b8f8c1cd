"""Images on two model-parallel ranks (torchrun, gloo): the tiny Llama 4 that sees
(tests/vision_checkpoint.py) written in two shards, its encoder and text model split over two
processes, answers chats about pictures (one tile, a grid of tiles) with the greedy tokens and
log-probabilities that one process gives from the one-shard checkpoint.

(tests/test_llama4_vision.py's ``test_two_ranks_equal_one`` checks the encoder's features and the
model's logits on two ranks; this runs the whole path a user takes: preprocessing, the chat
format, the engine's prefill with the images' features, decoding.)"""

from __future__ import annotations

import pytest
import torch

import helpers
from images_mp_worker import answer
from vision_checkpoint import TILE, picture_png, vision_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # a torchrun job of two ranks (seconds)


def test_two_ranks_give_one_ranks_greedy_tokens(tmp_path_factory, tmp_path):
    from llama import Llama
    from llama.convert import hf_to_meta

    ckpt = vision_checkpoint(tmp_path_factory)
    two_shards = tmp_path / "meta2"
    hf_to_meta(ckpt.hf_dir, two_shards, model_parallel_size=2)
    images = []
    for name, color, size in (("red", (200, 30, 30), (TILE, TILE)), ("wide", (30, 200, 30), (2 * TILE, TILE))):
        images.append(tmp_path / f"{name}.png")
        images[-1].write_bytes(picture_png(color, size))
    out = tmp_path / "out"
    out.mkdir()
    result = helpers.torchrun(helpers.REPO / "tests" / "images_mp_worker.py",
                              [str(two_shards), str(out), *map(str, images)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    one = Llama.build(ckpt.ckpt_dir, max_seq_len=128, max_batch_size=len(images) + 1, device="cpu", dtype="float32")
    expected = answer(one, [str(p) for p in images])
    assert len({r["content"] for r in expected}) == len(expected)  # each picture, and none, its own reply
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]
        assert [r["content"] for r in got] == [r["content"] for r in expected]
        for g, e in zip(got, expected):
            assert g["logprobs"] == pytest.approx(e["logprobs"], abs=1e-4)
