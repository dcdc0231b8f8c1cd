"""Multi-node: two torchrun agents (two "nodes" on this machine, one process each) meet
through a c10d rendezvous, as docs/running.md's multi-node line says, and produce what one
process does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
from test_multiprocess import assert_same_as_single, single_workload

WORKER = Path(__file__).parent / "mp_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_match_one_process(tmp_path, llama3_checkpoint):
    ckpt1, tok, params, weights = llama3_checkpoint
    ckpt2 = helpers.write_checkpoint(tmp_path / "ckpt2", params, weights, n_shards=2, embedding_layout="vocab")
    out = tmp_path / "out"
    out.mkdir()
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
               str(WORKER), str(ckpt2), str(tok), str(out)]
        agents.append(subprocess.Popen(cmd, env=env, cwd=helpers.REPO, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True))
    logs = []
    try:
        for agent in agents:
            _, err = agent.communicate(timeout=240)
            logs.append(err)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for agent, err in zip(agents, logs):
        assert agent.returncode == 0, err[-4000:]

    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert_same_as_single(results, single_workload(ckpt1, tok))
