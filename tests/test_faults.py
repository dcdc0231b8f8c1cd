"""A rank that dies, hangs or fails must not leave the others waiting forever; Ctrl-C
must leave no worker behind.  Real torchrun processes on gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # real torchrun jobs

WORKER = Path(__file__).parent / "fault_worker.py"


def start(mode: str, ckpt: Path, tok: Path, out: Path, timeout_s: str = "60") -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")]),
        "LLAMA_COLLECTIVE_TIMEOUT_S": timeout_s,
        "CUDA_VISIBLE_DEVICES": "",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), mode, str(ckpt), str(tok), str(out)]
    return subprocess.Popen(cmd, env=env, cwd=helpers.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_pids(out: Path, proc: subprocess.Popen, limit: float = 120) -> list[int]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        files = [out / f"rank{r}.pid" for r in range(2)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        if proc.poll() is not None:
            pytest.fail("workers ended before generating:\n" + proc.stderr.read()[-3000:])
        time.sleep(0.05)
    proc.kill()
    pytest.fail("workers never started generating")


def finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job was still running {limit} s later")
    return proc.returncode, err, time.monotonic() - start


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def ckpt(llama3_checkpoint):
    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    return ckpt, tok


def test_killed_rank_ends_the_job_quickly(ckpt, tmp_path):
    proc = start("die", *ckpt, tmp_path)
    pids = wait_for_pids(tmp_path, proc)
    code, err, elapsed = finish(proc, 60)  # rank 1 kills itself 0.5 s into generation
    assert code != 0
    assert elapsed < 60
    assert not any(alive(p) for p in pids)


def test_hung_rank_times_out_the_others(ckpt, tmp_path):
    """Rank 1 stays alive but stops taking part: rank 0's next collective gives up
    after LLAMA_COLLECTIVE_TIMEOUT_S instead of waiting forever."""
    proc = start("hang", *ckpt, tmp_path, timeout_s="5")
    pids = wait_for_pids(tmp_path, proc)
    code, err, elapsed = finish(proc, 60)
    assert code != 0
    error = (tmp_path / "error.txt").read_text()
    assert "another rank probably died or stopped responding" in error, error
    assert not any(alive(p) for p in pids)


def test_rank_failing_in_build_ends_the_job(ckpt, tmp_path):
    proc = start("fail_build", *ckpt, tmp_path)
    code, err, elapsed = finish(proc, 60)
    assert code != 0
    assert "tokenizer file not found" in err


def test_ctrl_c_leaves_no_workers(ckpt, tmp_path):
    proc = start("run", *ckpt, tmp_path)
    pids = wait_for_pids(tmp_path, proc)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground group
    code, err, elapsed = finish(proc, 60)
    assert code != 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
