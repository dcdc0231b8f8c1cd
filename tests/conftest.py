"""Shared fixtures: tokenizers and tiny model configs (all written to temp dirs)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import helpers  # noqa: E402

# Tests build hundreds of models, and a bfloat16 or quantised one would compile its decoding
# steps by default where a C++ compiler is found (seconds each): tests that compile say
# compile=True, and tests of the default itself set the variable their own way.  Inherited
# by the processes tests start.
os.environ.setdefault("LLAMA_COMPILE", "0")
# Triton's interpreter, which runs the int8 kernels of llama.layers.triton_int8 on CPU tensors
# (tests/test_triton_int8.py; where Triton is installed).  Triton reads it once, when imported
# (CPU torch.compile imports it too), so it is set before any test.  Never where CUDA is
# available: it would interpret every Triton kernel, Inductor's included.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A Llama 2-shaped config (MHA, theta 1e4) and a Llama 3.1-shaped one (GQA, theta 5e5,
# scaled RoPE).  The scaled config's original context is shortened to 32 so the
# scaling changes angles within the short sequences tests use.
LLAMA2_PARAMS = dict(dim=64, n_layers=2, n_heads=4, multiple_of=32, norm_eps=1e-6, vocab_size=-1)
LLAMA3_PARAMS = dict(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    multiple_of=32,
    ffn_dim_multiplier=1.3,
    norm_eps=1e-5,
    rope_theta=500000.0,
    use_scaled_rope=True,
    rope_scaling_factor=8.0,
    rope_original_context_len=32,
)


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def sp_tokenizer_path(tmp_path_factory) -> Path:
    return helpers.train_sentencepiece(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def codellama_tokenizer_path(tmp_path_factory) -> Path:
    """A SentencePiece model with Code Llama's pieces: infilling (▁<PRE>, ▁<SUF>, ▁<MID>,
    ▁<EOT>, ids 3-6), CodeLlama-70B-Instruct's <step> (7), and the ☺ that Meta's
    infilling encoder puts before a suffix (8)."""
    return helpers.train_sentencepiece(tmp_path_factory.mktemp("codellama-spm"), user_defined_symbols=CODELLAMA_PIECES)


CODELLAMA_PIECES = ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>", "<step>", "\u263a")


@pytest.fixture(scope="session")
def tiny_tiktoken_path(tmp_path_factory) -> Path:
    return helpers.write_tiny_tiktoken(tmp_path_factory.mktemp("tiktoken"))


@pytest.fixture(scope="session")
def llama3_tokenizer_path() -> Path:
    return helpers.llama3_tokenizer_path()


@pytest.fixture(scope="session")
def llama2_checkpoint(tmp_path_factory, sp_tokenizer_path):
    """One shard, Llama 2 layout (embedding split over dim), vocab from the tokenizer."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(sp_tokenizer_path).n_words
    weights = helpers.random_weights(LLAMA2_PARAMS, vocab, seed=2)
    ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("llama2"), LLAMA2_PARAMS, weights, 1, "dim")
    return helpers.Checkpoint(ckpt, sp_tokenizer_path, {**LLAMA2_PARAMS, "vocab_size": vocab}, weights)


@pytest.fixture(scope="session")
def llama3_checkpoint(tmp_path_factory, tiny_tiktoken_path):
    """One shard, Llama 3 layout (embedding split over the vocabulary), a tiny tiktoken tokenizer."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(tiny_tiktoken_path).n_words
    params = {**LLAMA3_PARAMS, "vocab_size": vocab}
    weights = helpers.random_weights(params, vocab, seed=3)
    ckpt = helpers.write_checkpoint(tmp_path_factory.mktemp("llama3"), params, weights, 1, "vocab")
    return helpers.Checkpoint(ckpt, tiny_tiktoken_path, params, weights)


def pytest_configure(config):
    logging.getLogger("llama").setLevel(logging.INFO)


def pytest_collection_modifyitems(config, items):
    """Tests marked multiprocess or compile are slow too, so that the quick subset
    (-m "not slow") never starts torchrun jobs or compiles.  Tests marked cuda are skipped,
    saying why, where torch sees no CUDA device."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False here")
    for item in items:
        if (item.get_closest_marker("multiprocess") or item.get_closest_marker("compile")) \
                and not item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked multiprocess or compile but not slow")
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(no_cuda)
