"""Model parallel with real torchrun processes on gloo, compared with one process.

The two-process cases share one job (``two_process_job``): its two processes build each
two-shard checkpoint in turn, as a fresh job would, and each test checks its checkpoint's
results against one process's.  The job is multi-node: two torchrun agents (two "nodes" on this
machine, one process each) meet through a c10d rendezvous, as docs/running.md's multi-node line
says.  (One agent running both processes, ``--standalone``, is what the other files' jobs do.)"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
from llama import Llama
from mp_worker import quantized_workload, workload

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # real torchrun jobs

WORKER = Path(__file__).parent / "mp_worker.py"


def run_plan(plan: dict[str, tuple], out: Path, nproc: int) -> subprocess.CompletedProcess:
    """One torchrun job of ``nproc`` processes that builds, in turn, each checkpoint of ``plan``
    (name -> (ckpt, tokenizer, quantize)) and runs its workload; read name's results with
    ``read_results(out / name, nproc)``."""
    out.mkdir(parents=True, exist_ok=True)
    steps = [[str(ckpt), str(tok), str(out / name), quantize] for name, (ckpt, tok, quantize) in plan.items()]
    (out / "plan.json").write_text(json.dumps(steps))
    return helpers.torchrun(WORKER, ["--plan", str(out / "plan.json")], nproc=nproc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plan_on_two_nodes(plan: dict[str, tuple], out: Path, timeout: float = 300) -> list[tuple[int, str]]:
    """run_plan's job as two nodes: two torchrun agents (``--nnodes 2``, one process each) that
    meet through a c10d rendezvous on this machine.  Returns each agent's (status, stderr)."""
    out.mkdir(parents=True, exist_ok=True)
    steps = [[str(ckpt), str(tok), str(out / name), quantize] for name, (ckpt, tok, quantize) in plan.items()]
    (out / "plan.json").write_text(json.dumps(steps))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(helpers.REPO), str(helpers.REPO / "tests"),
                                       os.environ.get("PYTHONPATH", "")]),
        "LLAMA_COLLECTIVE_TIMEOUT_S": "120",
        "LLAMA_CONTROL_TIMEOUT_S": "120",
        "CUDA_VISIBLE_DEVICES": "",
    }
    port = free_port()
    agents = []
    for node_rank in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "multinode-test", "--local-addr", "127.0.0.1", "--max-restarts", "0",
               str(WORKER), "--plan", str(out / "plan.json")]
        agents.append(subprocess.Popen(cmd, env=env, cwd=helpers.REPO, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True))
    logs = []
    try:
        for agent in agents:
            _, err = agent.communicate(timeout=timeout)
            logs.append(err)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return [(agent.returncode, err) for agent, err in zip(agents, logs)]


def read_results(out: Path, nproc: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def run_workers(ckpt: Path, tok: Path, out: Path, nproc: int, extra: tuple[str, ...] = ()) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    proc = helpers.torchrun(WORKER, [str(ckpt), str(tok), str(out), *extra], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[:6000] + "\n...\n" + proc.stderr[-2000:]
    return read_results(out, nproc)


@functools.lru_cache(maxsize=None)
def single_workload(ckpt: Path, tok: Path) -> dict:
    """The full workload in this one process (kept for the session: test_checkpoint.py
    compares with the same references)."""
    return workload(Llama.build(ckpt, tok, max_seq_len=64, max_batch_size=3, device="cpu"))


def assert_same_as_single(results: list[dict], single: dict) -> None:
    for r in results:
        rel = ((r["logits"] - single["logits"]).norm() / single["logits"].norm()).item()
        assert rel < 1e-5, rel  # only the order of the row-parallel sums differs
        assert r["greedy"] == single["greedy"]
        assert r["text"] == single["text"]
        assert r["sampled"] == results[0]["sampled"]  # every rank emits the same tokens
        assert r["processed"] == single["processed"]  # the logits processor runs where tokens are chosen
        assert r["after_serving"] == single["after_serving"]
    assert all(5 not in row for row in single["processed"]) and single["processed"] != single["greedy"]
    assert results[0]["served"] == single["served"] == [g[:8] for g in single["greedy"]]
    assert all(r["served"] is None for r in results[1:])  # the other ranks only followed
    # A request failing on the first rank fails on every rank, its neighbour finishes.
    assert single["isolated"]["error"] == "ValueError: the processor failed"
    assert results[0]["isolated"] == single["isolated"]
    for r in results[1:]:
        assert r["isolated"]["error"] == "RuntimeError: the request failed on the first rank: " \
                                         "ValueError: the processor failed"
        assert r["isolated"]["bystander"] == single["isolated"]["bystander"]
    assert single["isolated"]["bystander"] == single["greedy"][1][:6]
    # Requests admitted in priority order, not in the order made: each rank matches them alike.
    assert all(r["prioritised"] == single["prioritised"] for r in results)
    assert single["prioritised"] == [g[:6] for g in single["greedy"]] + [single["greedy"][0][:6]]
    # Rows deferred for their masks on the first rank are held and sampled alike on every rank.
    assert all(r["deferred"]["tokens"] == single["deferred"]["tokens"] for r in results)
    assert results[0]["deferred"]["released"] > 0
    assert all(r["deferred"]["released"] == results[0]["deferred"]["released"] for r in results)


def _w8a8_reduce_range():
    """fbgemm's ``reduce_range`` for int8 activations here, or None where this torch build has
    no fbgemm int8 product (not x86)."""
    from llama.layers.cpu import CpuFeatures

    return CpuFeatures.probe().int8_activation_reduce_range


def _packs_bfloat16() -> bool:
    from llama.layers.policy import KernelPolicy

    return KernelPolicy.decide(torch.device("cpu"), torch.bfloat16).packing is not None


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory, llama2_checkpoint, llama3_checkpoint) -> dict[str, list[dict]]:
    """One job of two processes on two nodes (run_plan_on_two_nodes) over every two-shard
    checkpoint the tests below compare: name -> each rank's results.  Llama 2's shards split the
    embedding over dim, Llama 3's over the vocabulary; the quantised and bfloat16 builds load
    the same shards."""
    root = tmp_path_factory.mktemp("mp2")
    shards = {}
    for family, layout, checkpoint in (("llama2", "dim", llama2_checkpoint), ("llama3", "vocab", llama3_checkpoint)):
        _, tok, params, weights = checkpoint
        ckpt2 = helpers.write_checkpoint(root / f"{family}-2", params, weights, n_shards=2, embedding_layout=layout)
        shards[family] = (ckpt2, tok)
    plan = {"llama2": (*shards["llama2"], ""), "llama3": (*shards["llama3"], ""), "int4": (*shards["llama2"], "int4")}
    if _w8a8_reduce_range() is not None:
        plan["w8a8"] = (*shards["llama2"], "w8a8")
    if _packs_bfloat16():
        plan["bfloat16"] = (*shards["llama3"], "bfloat16")
    for code, err in run_plan_on_two_nodes(plan, root / "out"):
        assert code == 0, err[:6000] + "\n...\n" + err[-2000:]
    return {name: read_results(root / "out" / name, 2) for name in plan}


def test_two_nodes_match_one_process(two_process_job, llama3_checkpoint):
    """Two torchrun agents, one process each, meet through a c10d rendezvous and write what one
    process does (every test of this file reads the same two-node job; this one checks that it
    was two nodes).  Moved here from test_multinode.py, whose own two-node job it was."""
    results = two_process_job["llama3"]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert sorted(r["node"] for r in results) == [("0", "1"), ("1", "1")]  # (node rank, processes on that node)
    ckpt1, tok, _, _ = llama3_checkpoint
    assert_same_as_single(results, single_workload(ckpt1, tok))


def test_eager_ranks_never_import_the_compiler(two_process_job):
    """Processes that never compile (the tests' LLAMA_COMPILE=0) run their collectives without
    importing torch._dynamo: torch's functional collectives import it at their first call, 3-7 s
    in every rank.  (Whether compiled steps trace the collectives: test_compiled.py.)"""
    assert os.environ.get("LLAMA_COMPILE") == "0"  # conftest.py's, inherited by the job
    imported = {name: [r["compiler_imported"] for r in results] for name, results in two_process_job.items()}
    assert not any(flag for flags in imported.values() for flag in flags), imported


@pytest.mark.parametrize("family, layout", [("llama2", "dim"), ("llama3", "vocab")])
def test_two_shards_on_two_processes_match_one(request, two_process_job, family, layout):
    ckpt1, tok, _, _ = request.getfixturevalue(f"{family}_checkpoint")
    single = single_workload(ckpt1, tok)
    results = two_process_job[family]
    assert [r["rank"] for r in results] == [0, 1]
    assert_same_as_single(results, single)


def test_int4_weights_on_two_processes_match_one(llama2_checkpoint, two_process_job):
    """int4 groups are cut from each rank's slice after loading; with slices that are
    whole groups, two processes hold exactly one process's codes.  int4 products are
    computed in bfloat16, so the logits differ by bfloat16 roundings (each rank's partial
    product of a row-parallel layer is rounded before the sum, 2**-8 relative), not more."""
    ckpt1, tok, _, _ = llama2_checkpoint
    single = quantized_workload(
        Llama.build(ckpt1, tok, max_seq_len=64, max_batch_size=3, device="cpu", quantize="int4", quantize_group_size=32)
    )
    results = two_process_job["int4"]
    for r in results:
        assert ((r["logits"].float() - single["logits"].float()).norm() / single["logits"].float().norm()).item() < 2e-2
        assert r["greedy"] == single["greedy"]


def test_w8a8_on_two_processes_close_to_one(llama2_checkpoint, two_process_job):
    """quantize="w8a8" under torchrun: each rank packs its int8 slices for fbgemm.  Prompts
    (many rows) keep bfloat16 activations: logits as close as int8's are.  In a one-row
    step each rank quantises its own slice of a row-parallel layer's input (its own
    range), so the two-process step differs from one process's by the activations'
    8-bit rounding (about 2**-8 of a row's range per value): within 3%, and greedy
    decoding (two rows here) is int8's.  Where fbgemm needs ``reduce_range`` (AVX2
    without VNNI: 7-bit input codes, see CpuFeatures.int8_activation_reduce_range) the rounding step is
    twice as coarse, and so is the bound: 3.06% measured on an AMD Zen 3."""
    reduce_range = _w8a8_reduce_range()
    if reduce_range is None:
        pytest.skip("this torch build has no fbgemm int8 product (not x86)")
    one_row_bound = 6e-2 if reduce_range else 3e-2
    ckpt1, tok, _, _ = llama2_checkpoint
    single = quantized_workload(Llama.build(ckpt1, tok, max_seq_len=64, max_batch_size=3, device="cpu",
                                            dtype="bfloat16", quantize="w8a8"))
    results = two_process_job["w8a8"]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    for r in results:
        assert rel(r["logits"], single["logits"]) < 2e-2
        assert rel(r["one_row"], single["one_row"]) < one_row_bound
        assert r["greedy"] == single["greedy"]


def test_bfloat16_packed_weights_on_two_processes_match_one(llama3_checkpoint, two_process_job):
    """bfloat16 on CPU: each rank packs its own slices for this CPU's kernel (oneDNN's or
    fbgemm's; every linear layer: 7 per block and the output) and two processes compute
    what one does."""
    from llama.layers.packed import PackedWeight

    if not _packs_bfloat16():
        pytest.skip("this torch build has no packed bfloat16 kernel here (not x86)")
    ckpt1, tok, params, _ = llama3_checkpoint
    single_llama = Llama.build(ckpt1, tok, max_seq_len=64, max_batch_size=3, device="cpu", dtype="bfloat16")
    single = quantized_workload(single_llama)
    results = two_process_job["bfloat16"]
    packed = 7 * params["n_layers"] + 1
    assert sum(isinstance(m, PackedWeight) for m in single_llama.model.modules()) == packed
    for r in results:
        assert r["packed"] == packed
        # Row-parallel layers add two partial products, each rounded to bfloat16 first: the
        # logits differ by bfloat16 roundings (relative 2**-8 each), not more.
        assert ((r["logits"].float() - single["logits"].float()).norm() / single["logits"].float().norm()).item() < 2e-2
        assert r["greedy"] == single["greedy"]
