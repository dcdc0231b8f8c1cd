"""Llama 4 checkpoints: the shard table covers the MoE tensors, any shard count loads on
any valid process count, and torchrun jobs agree with one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import helpers
import llama4_helpers as H
from llama import Llama, ModelArgs
from llama.layers.tensor_parallel import SHARD_AXES, full_shapes, holder_region, split_of, valid_model_parallel_sizes
from llama.model import Transformer
from llama.runtime import distributed
from llama4_mp_worker import workload

WORKER = Path(__file__).parent / "llama4_mp_worker.py"


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_shard_table_matches_the_llama4_model(world):
    """Every tensor of a Llama 4 model (dense and MoE layers) has an entry in SHARD_AXES,
    and the table's slice is what the model's layers hold on rank 0 of ``world``."""
    args = ModelArgs.from_dict(H.LLAMA4_MP_PARAMS)
    shapes = full_shapes(args)
    import fairscale.nn.model_parallel.initialize as fs_init

    distributed.init_model_parallel(torch.device("cpu"))
    real = fs_init.get_model_parallel_world_size
    fs_init.get_model_parallel_world_size = lambda: world
    try:
        with torch.device("meta"):
            model = Transformer(args, embedding_layout="vocab")
    finally:
        fs_init.get_model_parallel_world_size = real
    state = model.state_dict()
    assert set(state) == set(shapes)
    for name, t in state.items():
        split_of(name)
        region = holder_region(name, shapes[name], world, 0, "vocab", args.head_dim)
        assert tuple(t.shape) == tuple(e - s for s, e in region), name
    used = {re.sub(r"^layers\.\d+\.", "layers.*.", name) for name in state}
    assert used == set(SHARD_AXES)  # dense and MoE layers together use every entry


def test_valid_process_counts_of_scout_and_maverick():
    from test_llama4_model import MAVERICK, SCOUT

    # 40 query heads, 8 K/V heads, 202,048 tokens, expert width 8192: 1, 2, 4 or 8 processes.
    assert valid_model_parallel_sizes(ModelArgs.from_dict(SCOUT)) == [1, 2, 4, 8]
    assert valid_model_parallel_sizes(ModelArgs.from_dict(MAVERICK)) == [1, 2, 4, 8]


@pytest.fixture(scope="module")
def mp_checkpoints(tmp_path_factory, tiny_tiktoken_path):
    """(1-shard dir, 8-shard dir, tokenizer, 8-shard dir in Meta's release naming) of the
    same tiny Llama 4 weights."""
    params = H.LLAMA4_MP_PARAMS
    from llama.tokenizer import load_tokenizer

    weights = H.random_llama4_weights(params, params["vocab_size"], seed=11)
    weights["output.weight"][sorted(load_tokenizer(tiny_tiktoken_path).stop_tokens)] = 0.0  # decode full length
    root = tmp_path_factory.mktemp("llama4_mp")
    one = H.write_llama4_checkpoint(root / "mp1", params, weights, n_shards=1)
    eight = H.write_llama4_checkpoint(root / "mp8", params, weights, n_shards=8)
    release = H.write_release_checkpoint(root / "release8", params, weights, n_shards=8)
    return one, eight, tiny_tiktoken_path, release


def single_process(ckpt: Path, tok: Path) -> dict:
    return workload(Llama.build(ckpt, tok, max_seq_len=48, max_batch_size=3, device="cpu"))


@pytest.fixture(scope="module")
def single(mp_checkpoints) -> dict:
    """The workload's results in one process from the 1-shard checkpoint: the reference."""
    one, _, tok, _ = mp_checkpoints
    return single_process(one, tok)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_eight_shards_merge_into_one_process(mp_checkpoints, single):
    _, eight, tok, _ = mp_checkpoints
    a, b = single, single_process(eight, tok)
    assert torch.equal(a["logits"], b["logits"])  # the same numbers, read from 8 files
    assert a["greedy"] == b["greedy"] and a["text"] == b["text"]
    assert sum(len(x) for x in a["greedy"]) == 60  # full-length decoding past chunk boundaries


@pytest.mark.slow
# Four processes take each path: the 1-shard checkpoint split four ways, the 8 shards merged
# two to a rank, the 8 in Meta's release naming.  (Two processes, the same paths at a coarser
# split, were a second torchrun job of ~16 s; test_llama4_quantize.py runs a Llama 4 model on
# two processes.)
@pytest.mark.parametrize("nproc", [4])
@pytest.mark.multiprocess
def test_torchrun_matches_one_process(mp_checkpoints, single, tmp_path, nproc):
    one, eight, tok, release = mp_checkpoints
    args = [str(tok), str(tmp_path), str(one), str(eight), str(release)]
    proc = helpers.torchrun(WORKER, args, nproc=nproc, timeout=400)
    assert proc.returncode == 0, proc.stderr[:6000] + "\n...\n" + proc.stderr[-2000:]
    for rank in range(nproc):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert len(results) == 3
        for result in results:  # from 1 shard, from 8, from 8 in Meta's release naming
            assert result["rank"] == rank
            rel = ((result["logits"] - single["logits"]).norm() / single["logits"].norm()).item()
            assert rel < 1e-5, rel
            assert result["greedy"] == single["greedy"]
            assert result["text"] == single["text"]


# -- Meta's release naming ------------------------------------------------------------------------

def test_release_named_shards_load_as_the_reference_reads_them(tmp_path, tiny_tiktoken_path):
    """A shard written with Meta's release names (fused wqkv and fc1, flattened experts,
    _extra_state buffers): llama-models' load hooks read it into its reference model,
    and this library's loader gives the same logits."""
    pytest.importorskip("llama_models")
    params = {**H.LLAMA4_PARAMS, "vocab_size": 556}
    weights = H.random_llama4_weights(params, 556, seed=13)
    ckpt = H.write_release_checkpoint(tmp_path / "release", params, weights, n_shards=1)
    reference = H.build_reference_llama4(params, weights, max_seq_len=64, max_batch_size=2)
    release_state = torch.load(ckpt / "consolidated.00.pth", weights_only=False)
    release_state = {k: v for k, v in release_state.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = reference.load_state_dict(release_state, strict=False)
    assert not missing and all(k.endswith("global_gate_stats_3E") for k in unexpected)
    from llama_models.llama4.datatypes import TransformerInput

    tokens = torch.randint(0, 556, (2, 40), generator=torch.Generator().manual_seed(0))
    with H.reference_on_cpu():
        want = reference.forward(TransformerInput(tokens=tokens, tokens_position=0)).logits
    llama = Llama.build(ckpt, tiny_tiktoken_path, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32")
    got = llama.model.forward(tokens, 0)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_eight_release_named_shards_merge_into_one_process(mp_checkpoints, single):
    _, _, tok, release = mp_checkpoints
    a, b = single, single_process(release, tok)
    assert torch.equal(a["logits"], b["logits"])
    assert a["greedy"] == b["greedy"]
