"""Measure the peak resident memory of encoding one image's tiles on a small Llama 4 encoder
(a fresh process, so that the peak RSS is this encoding's own).

Usage: python tests/image_memory_worker.py JSON_CONFIG [JSON_CONFIG ...]
Prints a JSON object per config, one a line, in order: measured (bytes the resident size peaked
above its value just before ``encode_images``) and estimate
(llama.checkpoint.memory.image_activation_bytes for the same call).  Each config is measured in a
child forked from this process (tests/memory_peak_worker.py's way).
"""

import json
import os
import sys
import traceback

import torch

from llama.args import ModelArgs
from llama.checkpoint.memory import image_activation_bytes
from llama.model import Transformer
from llama.runtime import distributed
from memory_peak_worker import reset_peak, status_bytes

TEXT = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16, max_seq_len=32,
            max_batch_size=1)


def main(config: dict) -> None:
    tiles, dtype = config.pop("tiles"), getattr(torch, config.pop("dtype"))
    distributed.init_model_parallel(torch.device("cpu"))
    args = ModelArgs(**TEXT, vision_args=config)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    model.to(dtype)
    model.setup_rope()
    size = args.vision_args.image_size
    with torch.inference_mode():
        model.encode_images(torch.rand(1, 3, size, size) * 2 - 1)  # load kernels before the baseline
        reset_peak()
        before = status_bytes("VmRSS")
        features = model.encode_images(torch.rand(tiles, 3, size, size) * 2 - 1)  # the tiles counted too
        measured = status_bytes("VmHWM") - before
    assert features.shape[0] == tiles
    estimate = image_activation_bytes(args.vision_args, args.dim, tiles, dtype)
    print(json.dumps({"measured": measured, "estimate": estimate}))


def in_fresh_child(config: dict) -> None:
    """``main(config)`` in a child forked now; fails if the child does."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            main(config)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"measuring {config} failed (exit status {os.waitstatus_to_exitcode(status)})")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        in_fresh_child(json.loads(arg))
