"""Checkpoint loading: resharding on load, per-rank memory, and files that must be refused."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import helpers
from llama import Llama, ModelArgs
from llama.checkpoint.shards import CheckpointError
from llama.layers.tensor_parallel import SHARD_AXES, full_shapes, holder_region, split_of
from llama.model import Transformer
from llama.runtime import distributed
from mp_worker import workload
from test_multiprocess import assert_same_as_single, read_results, run_plan, single_workload


def gqa(params: dict) -> dict:
    return {**params, "n_kv_heads": 2}  # 4 query heads share 2 K/V heads: 4 ranks replicate K/V


SPLITS = {"dim-split": ("llama2", "dim"), "vocab-split": ("llama3", "vocab")}


@pytest.fixture(scope="module")
def gqa_checkpoints(request, tmp_path_factory) -> dict[str, tuple]:
    """split -> (unsharded dir, 2-shard dir, tokenizer, one process's workload on the unsharded
    dir) for a GQA model in each embedding layout."""
    out = {}
    for split, (family, layout) in SPLITS.items():
        _, tok, params, _ = request.getfixturevalue(f"{family}_checkpoint")
        params = gqa(params)
        weights = helpers.random_weights(params, params["vocab_size"], seed=11)
        root = tmp_path_factory.mktemp(f"gqa-{split}")
        one = helpers.write_checkpoint(root / "one", params, weights, 1)
        two = helpers.write_checkpoint(root / "two", params, weights, 2, embedding_layout=layout)
        out[split] = (one, two, tok, single_workload(one, tok))
    return out


@pytest.fixture(scope="module")
def four_process_job(gqa_checkpoints, tmp_path_factory) -> dict[str, list[dict]]:
    """One torchrun job of four processes that loads each layout's two shards in turn:
    split -> each rank's results."""
    out = tmp_path_factory.mktemp("mp4")
    plan = {split: (two, tok, "") for split, (_, two, tok, _) in gqa_checkpoints.items()}
    proc = run_plan(plan, out, nproc=4)
    assert proc.returncode == 0, proc.stderr[:6000] + "\n...\n" + proc.stderr[-2000:]
    return {split: read_results(out / split, 4) for split in plan}


@pytest.mark.slow
@pytest.mark.parametrize("split", list(SPLITS))
def test_two_shards_merge_into_one_process(gqa_checkpoints, split):
    one, two, tok, single = gqa_checkpoints[split]
    merged = workload(Llama.build(two, tok, max_seq_len=64, max_batch_size=3, device="cpu"))
    assert_same_as_single([merged], single)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("split", list(SPLITS))
def test_two_shards_split_over_four_processes(gqa_checkpoints, four_process_job, split):
    single = gqa_checkpoints[split][3]
    assert_same_as_single(four_process_job[split], single)


@pytest.fixture(scope="module")
def three_process_job(tmp_path_factory, llama3_checkpoint):
    """One torchrun job of three processes: first 2 shards with one K/V head (neither count
    divides the other), then the llama3 checkpoint, which 3 processes cannot split: the job
    ends with that error.  (the completed process, the first step's results or None, the
    first step's unsharded dir and tokenizer)"""
    root = tmp_path_factory.mktemp("mp3")
    tok = helpers.train_sentencepiece(root / "tok", vocab_size=402)  # 402 = 2 * 3 * 67
    params = dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=1, multiple_of=48, norm_eps=1e-5, vocab_size=402)
    weights = helpers.random_weights(params, 402, seed=4)
    one = helpers.write_checkpoint(root / "one", params, weights, 1)
    two = root / "two"
    helpers.write_checkpoint(two, params, weights, 2, embedding_layout="dim")
    # Meta's MP>n_kv layout: each shard carries a copy of the one K/V head.
    for r in range(2):
        shard = torch.load(two / f"consolidated.0{r}.pth")
        for i in range(2):
            for w in ("wk", "wv"):
                shard[f"layers.{i}.attention.{w}.weight"] = weights[f"layers.{i}.attention.{w}.weight"].clone()
        torch.save(shard, two / f"consolidated.0{r}.pth")
    plan = {"neither": (two, tok, ""), "impossible": (llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path, "")}
    proc = run_plan(plan, root / "out", nproc=3)
    done = all((root / "out" / "neither" / f"rank{r}.pt").is_file() for r in range(3))
    return proc, read_results(root / "out" / "neither", 3) if done else None, one, tok


@pytest.mark.slow
@pytest.mark.multiprocess
def test_neither_count_divides_the_other(three_process_job):
    """2 shards on 3 processes, with one K/V head (replicated in the shards and on every rank)."""
    proc, results, one, tok = three_process_job
    # Every rank saved this step's results (the job then fails on the next step, as it must: below).
    assert results is not None, proc.stderr[:6000] + "\n...\n" + proc.stderr[-2000:]
    assert_same_as_single(results, single_workload(one, tok))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_impossible_process_count_lists_what_works(three_process_job):
    proc = three_process_job[0]
    assert proc.returncode != 0
    assert "cannot be split over 3 processes" in proc.stderr and "[1, 2, 4]" in proc.stderr


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_table_matches_the_model(llama3_checkpoint, world):
    """Every model tensor has an entry in SHARD_AXES, and the table's slice shapes are
    what fairscale's layers hold on each rank (checked on rank 0 of ``world``)."""
    params = llama3_checkpoint.params
    args = ModelArgs.from_dict(gqa(params))
    shapes = full_shapes(args)
    import fairscale.nn.model_parallel.initialize as fs_init

    distributed.init_model_parallel(torch.device("cpu"))
    real = fs_init.get_model_parallel_world_size
    fs_init.get_model_parallel_world_size = lambda: world  # shape-only: build the layers as rank 0 of `world`
    try:
        with torch.device("meta"):
            model = Transformer(args, embedding_layout="vocab")
    finally:
        fs_init.get_model_parallel_world_size = real
    for name, t in model.state_dict().items():
        split_of(name)  # raises if missing from the table
        region = holder_region(name, shapes[name], world, 0, "vocab", args.head_dim)
        assert tuple(t.shape) == tuple(e - s for s, e in region), name
    # A dense (Llama 2/3) model uses 12 of the table's entries; the others are Llama 4's
    # mixture-of-experts tensors (covered in test_llama4_loading.py).
    used = {re.sub(r"^layers\.\d+\.", "layers.*.", name) for name in model.state_dict()}
    assert len(used) == 12 and used <= set(SHARD_AXES)


def _sizes_by_hand(args: ModelArgs) -> list[int]:
    """The process counts a model splits over, written out rule by rule (Meta's reference
    layers: whole query heads per rank; K/V heads divided, or copied whole when there are
    more ranks; FFN, expert and vocabulary widths divided; the embedding over either axis)."""
    dense = not all(args.is_moe_layer(i) for i in range(args.n_layers))
    sizes = []
    for m in range(1, args.n_heads + 1):
        kv_ok = args.n_kv_heads % m == 0 if m <= args.n_kv_heads else m % args.n_kv_heads == 0
        if (args.n_heads % m == 0 and kv_ok and args.vocab_size % m == 0
                and not (dense and args.ffn_hidden_dim % m)
                and not (args.moe_args is not None and args.moe_hidden_dim % m)):
            sizes.append(m)
    return sizes


@pytest.mark.parametrize("shape", [(8, 8, 96, 64), (8, 2, 96, 64), (12, 4, 100, 96), (6, 3, 90, 48), (16, 1, 128, 32),
                                   (32, 8, 128256, 4096), (64, 8, 128256, 8192), (5, 5, 55, 40)])
def test_process_counts_follow_from_the_shard_table(shape):
    """valid_model_parallel_sizes and heads_per_rank derive from SHARD_AXES; they agree with
    the rules written out by hand, and name the sizes that work when a count does not."""
    from llama.layers.tensor_parallel import heads_per_rank, valid_model_parallel_sizes

    n_heads, n_kv_heads, vocab, dim = shape
    args = ModelArgs(dim=dim, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab, multiple_of=16)
    sizes = valid_model_parallel_sizes(args)
    assert sizes == _sizes_by_hand(args)
    for m in range(1, n_heads + 1):
        if n_heads % m == 0 and (n_kv_heads % m == 0 if m <= n_kv_heads else m % n_kv_heads == 0):
            q, kv, copies = heads_per_rank(args, m)
            assert (q, kv, copies) == (n_heads // m, max(n_kv_heads // m, 1), max(m // n_kv_heads, 1))
        else:
            with pytest.raises(ValueError, match=rf"cannot be split over {m} .*sizes that work: "):
                heads_per_rank(args, m)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_memory_per_rank_is_its_slice(tmp_path):
    """Two ranks load a ~290 MB one-shard checkpoint: each rank's resident memory grows
    by about its half of the weights plus one tensor, not by the whole shard."""
    tok = helpers.write_tiny_tiktoken(tmp_path)
    params = dict(dim=1024, n_layers=12, n_heads=8, n_kv_heads=4, vocab_size=556, multiple_of=256, norm_eps=1e-5)
    # Zeros: only the bytes loaded are measured, no value is compared (random ones were ~1.5 s to draw).
    weights = helpers.zero_weights(params, 556, torch.bfloat16)
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, weights, 1, dtype=torch.bfloat16)
    del weights
    shard_bytes = (ckpt / "consolidated.00.pth").stat().st_size
    out = tmp_path / "out"
    out.mkdir()
    proc = helpers.torchrun(Path(__file__).parent / "memory_worker.py", [str(ckpt), str(tok), str(out)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        m = json.loads((out / f"rank{rank}.json").read_text())
        rise = m["after"] - m["before"]
        print(f"rank {rank}: peak RSS rise {rise / 2**20:.0f} MiB for {m['weights'] / 2**20:.0f} MiB of weights "
              f"(shard {shard_bytes / 2**20:.0f} MiB)")
        # Own slice + KV cache + one full tensor in flight + 40 MiB for the process
        # group and libraries.  Reading the whole shard would add another ~290 MiB.
        assert rise < m["weights"] + m["buffers"] + m["largest_local"] * 2 + 40 * 2**20
        assert rise < 0.6 * shard_bytes
        # Packing bfloat16 weights for a CPU kernel (x86: oneDNN's or fbgemm's) copies them out of the mapped shard: the
        # built model holds its packed weights in memory, and no second copy (freed
        # conversions are handed back to the system).
        print(f"rank {rank}: {m['anon_rise'] / 2**20:.0f} MiB held after packing {m['packed'] / 2**20:.0f} MiB")
        assert m["anon_rise"] < m["packed"] + m["buffers"] + m["largest_local"] + 40 * 2**20


# -- files that must be refused ------------------------------------------------------------

class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _build(ckpt, tok):
    return helpers.build((ckpt, tok), max_seq_len=16, max_batch_size=1)


def test_pickle_that_runs_code_is_refused(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    marker = tmp_path / "pwned"
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, weights, extra={"payload": _RunsCode(str(marker))})
    with pytest.raises(CheckpointError, match=r"consolidated\.00\.pth.*would run code"):
        _build(ckpt, tok)
    assert not marker.exists()


def test_truncated_shard_is_named(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, weights, 2)
    path = ckpt / "consolidated.01.pth"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth.*truncated"):
        _build(ckpt, tok)


def test_shard_that_is_a_fifo_is_refused(tmp_path, llama3_checkpoint):
    """torch.load waited forever on a FIFO named consolidated.01.pth."""
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, weights, 2)
    (ckpt / "consolidated.01.pth").unlink()
    os.mkfifo(ckpt / "consolidated.01.pth")
    with helpers.fifo_feeder(ckpt / "consolidated.01.pth"), \
            pytest.raises(CheckpointError, match=r"consolidated\.01\.pth is not a regular file"):
        _build(ckpt, tok)


def test_missing_tensor_is_named(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    partial = {k: v for k, v in weights.items() if k != "layers.1.feed_forward.w3.weight"}
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, partial)
    with pytest.raises(CheckpointError,
                       match=r"consolidated\.00\.pth is missing tensor 'layers\.1\.feed_forward\.w3\.weight'"):
        _build(ckpt, tok)


def test_wrong_shape_is_named(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    bad = dict(weights)
    bad["layers.0.attention.wo.weight"] = bad["layers.0.attention.wo.weight"][:, :32]
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, bad)
    with pytest.raises(CheckpointError,
                       match=r"consolidated\.00\.pth: tensor 'layers\.0\.attention\.wo\.weight' has shape \[64, 32\]"):
        _build(ckpt, tok)


def test_params_disagreeing_with_embedding_is_named(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", {**params, "dim": 128}, weights)
    with pytest.raises(CheckpointError, match="tok_embeddings.weight has shape"):
        _build(ckpt, tok)


def test_gap_in_shard_numbers_is_named(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, weights, 4)
    (ckpt / "consolidated.02.pth").unlink()
    with pytest.raises(FileNotFoundError, match=r"consolidated\.02\.pth"):
        _build(ckpt, tok)


def test_shards_are_ordered_by_number(tmp_path):
    from llama.checkpoint.shards import find_shards

    for i in range(102):  # consolidated.00 .. consolidated.101: "100" sorts before "11" as text
        (tmp_path / f"consolidated.{i:02d}.pth").touch()
    (tmp_path / "optimizer.pth").touch()
    assert [int(p.name.split(".")[1]) for p in find_shards(tmp_path)] == list(range(102))


# -- params.json against the shards, and non-finite weights ---------------------------------

@pytest.mark.parametrize("n_layers, held", [(3, "2 layers"), (1, "2 layers"), (10**6, "2 layers")])
def test_n_layers_disagreeing_with_the_shards_is_refused_before_building(tmp_path, llama3_checkpoint, monkeypatch,
                                                                         n_layers, held):
    """More layers declared than stored (a huge n_layers used to run for minutes and be
    killed for memory) or fewer (used to load a truncated model with a warning): refused
    from the shards' tables of contents, before any model is built."""
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", {**params, "n_layers": n_layers}, weights, 2)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was checked")

    monkeypatch.setattr("llama.generation.Transformer", no_model)
    with pytest.raises(CheckpointError) as info:
        _build(ckpt, tok)
    text = str(info.value)
    assert "consolidated.00.pth holds " + held in text and f"n_layers={n_layers}" in text, text


def test_missing_middle_layer_is_refused(tmp_path, llama3_checkpoint):
    _, tok, params, weights = llama3_checkpoint
    params = {**params, "n_layers": 3}
    weights = helpers.random_weights(params, params["vocab_size"])
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, {k: v for k, v in weights.items() if ".1." not in k})
    with pytest.raises(CheckpointError,
                       match=r"holds 2 layers \(layers\.0 \.\. layers\.2\), with layers \[1\] missing"):
        _build(ckpt, tok)


def test_ffn_width_disagreeing_with_the_shards_is_refused(tmp_path, llama3_checkpoint, monkeypatch):
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", {**params, "multiple_of": 256}, weights)
    monkeypatch.setattr("llama.generation.Transformer", None)  # never reached
    stored = list(weights["layers.0.feed_forward.w1.weight"].shape)
    with pytest.raises(CheckpointError) as info:
        _build(ckpt, tok)
    assert f"'layers.0.feed_forward.w1.weight' has shape {stored}, but params.json" in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["layers.1.feed_forward.w2.weight", "norm.weight"])
def test_non_finite_weight_is_named_with_its_file(tmp_path, llama3_checkpoint, name, bad):
    """One NaN/Inf anywhere used to load and decode garbage silently."""
    from llama.runtime.finite import NonFiniteError

    _, tok, params, weights = llama3_checkpoint
    damaged = dict(weights)
    damaged[name] = weights[name].clone()
    damaged[name].view(-1)[-1] = bad  # the last column: in the second shard of a row split
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, damaged, 2)
    with pytest.raises(NonFiniteError) as info:
        _build(ckpt, tok)
    text = str(info.value)
    shard = "consolidated.01.pth" if name.endswith("w2.weight") else "consolidated.00.pth"
    assert f"{shard}: tensor {name!r} holds" in text and "damaged" in text, text
    assert isinstance(info.value, RuntimeError)


def test_weights_too_large_for_float16_say_so(tmp_path, llama3_checkpoint):
    from llama.runtime.finite import NonFiniteError

    _, tok, params, weights = llama3_checkpoint
    big = dict(weights)
    big["layers.0.attention.wq.weight"] = weights["layers.0.attention.wq.weight"].clone()
    big["layers.0.attention.wq.weight"][0, 0] = 1e6  # finite in bfloat16, beyond float16's 65504
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", params, big, dtype=torch.bfloat16)
    with pytest.raises(NonFiniteError, match=r"beyond the range of torch.float16 .*load it in bfloat16 or float32"):
        Llama.build(ckpt, tok, max_seq_len=16, max_batch_size=1, device="cpu", dtype="float16")
    Llama.build(ckpt, tok, max_seq_len=16, max_batch_size=1, device="cpu", dtype="bfloat16")  # fits there


# -- params.json with absurd sizes -----------------------------------------------------------

def _run(command, ckpt, tok, tmp_path):
    from llama import convert
    if command == "build":
        return _build(ckpt, tok)
    if command == "reshard":
        return convert.reshard(ckpt, tmp_path / "out", model_parallel_size=1)
    return convert.meta_to_hf(ckpt, tmp_path / "out")


@pytest.mark.parametrize("command", ["build", "reshard", "meta_to_hf"])
@pytest.mark.parametrize("key, value, says", [
    ("n_layers", 10**9, "holds 2 layers (layers.0 .. layers.1), but params.json says n_layers=1000000000"),
    ("dim", 2**30, "fits neither a vocabulary split nor an embedding-dim split of (556, 1073741824)"),
    # w1 is 224 rows (LLAMA3_PARAMS by Meta's rule), 112 in each of two shards
    ("multiple_of", 10**12, "'layers.0.feed_forward.w1.weight' has shape [112, 64], but params.json"),
])
def test_absurd_size_in_params_json_is_refused_against_the_shards(tmp_path, llama3_checkpoint, monkeypatch,
                                                                   command, key, value, says):
    """n_layers 10**9 used to end in a MemoryError (or the OOM killer) while the shards'
    layers were compared with it: every size is checked against the shards' tables of
    contents, in a small memory budget, before a model is built or a file is written."""
    _, tok, params, weights = llama3_checkpoint
    ckpt = helpers.write_checkpoint(tmp_path / "ckpt", {**params, key: value}, weights, 2)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was checked")

    monkeypatch.setattr("llama.checkpoint.loader.Transformer", no_model)
    with helpers.memory_cap(2.0), pytest.raises(CheckpointError) as info:
        _run(command, ckpt, tok, tmp_path)
    assert says in str(info.value) and "consolidated.00.pth" in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("release_names", [False, True], ids=["plain", "release-named"])
@pytest.mark.parametrize("command", ["build", "reshard"])
def test_absurd_expert_count_is_refused_naming_the_file(tmp_path, tiny_tiktoken_path, command, release_names):
    """moe_args.num_experts that the shards do not hold: Meta's release-named shards (flattened
    experts) used to fail in a bare 'shape [...] is invalid' RuntimeError naming no file."""
    import llama4_helpers as H

    params = {**H.LLAMA4_PARAMS, "vocab_size": 556}
    weights = H.random_llama4_weights(params, 556, seed=5)
    write = H.write_release_checkpoint if release_names else H.write_llama4_checkpoint
    ckpt = write(tmp_path / "ckpt", params, weights, n_shards=2)
    hostile = {**params, "moe_args": {**params["moe_args"], "num_experts": 10**9}}
    (ckpt / "params.json").write_text(json.dumps(hostile))
    with helpers.memory_cap(2.0), pytest.raises(CheckpointError) as info:
        _run(command, ckpt, tiny_tiktoken_path, tmp_path)
    text = str(info.value)
    assert "consolidated.00.pth" in text and ("1000000000" in text) and "layers.1.feed_forward" in text, text
