"""Process setup: timeout variables, the memory a container allows, CPU threads per rank,
and ranks that wait long on each other (real torchrun processes for the last two)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import helpers
from llama.runtime import distributed
from llama.runtime import host as machine

GIB = 2**30


# -- timeout variables ------------------------------------------------------------------------

@pytest.mark.parametrize("variable, reader", [("LLAMA_COLLECTIVE_TIMEOUT_S", distributed.step_timeout),
                                              ("LLAMA_CONTROL_TIMEOUT_S", distributed.control_timeout)])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-5", "0", "1e400", "ten", "1e300"])
def test_bad_timeout_variable_is_named(monkeypatch, variable, reader, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}='{value}' must be a positive, finite number of seconds"):
        reader()


@pytest.mark.parametrize("value, seconds", [("2.5", 2.5), ("600", 600.0), ("", 60.0)])
def test_good_timeout_variable(monkeypatch, value, seconds):
    monkeypatch.setenv("LLAMA_COLLECTIVE_TIMEOUT_S", value)
    assert distributed.step_timeout().total_seconds() == seconds


# -- memory a container allows (fake cgroup trees) -----------------------------------------------

def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {4 * available_kib} kB\nMemAvailable:   {available_kib} kB\n")
    return path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_caps_available_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "job" / "memory.max", f"{GIB}\n")  # a 1 GiB container ...
    _write(root / "job" / "memory.current", f"{300 * 2**20}\n")  # ... using 300 MiB, 100 MiB of it dropable cache
    _write(root / "job" / "memory.stat", f"anon 1\ninactive_file {100 * 2**20}\nactive_file 5\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    host = _meminfo(tmp_path, 64 * 2**20)  # 64 GiB free on the host
    got = machine.available_memory(torch.device("cpu"), meminfo=host, proc_cgroup=proc, cgroup_root=root)
    assert got == GIB - 200 * 2**20
    # No limit ("max"): the host's figure.
    _write(root / "job" / "memory.max", "max\n")
    got = machine.available_memory(torch.device("cpu"), meminfo=host, proc_cgroup=proc, cgroup_root=root)
    assert got == 64 * GIB
    # A parent's limit is tighter than the group's own: the parent wins.
    _write(root / "memory.max", f"{512 * 2**20}\n")
    _write(root / "memory.current", f"{12 * 2**20}\n")
    got = machine.available_memory(torch.device("cpu"), meminfo=host, proc_cgroup=proc, cgroup_root=root)
    assert got == 500 * 2**20


def test_cgroup_v1_limit_caps_available_memory_shared_by_local_ranks(tmp_path, monkeypatch):
    root = tmp_path / "cg"
    # Inside a container the group's path in /proc/self/cgroup is not under the mount: its root is the group.
    _write(root / "memory" / "memory.limit_in_bytes", f"{2 * GIB}\n")
    _write(root / "memory" / "memory.usage_in_bytes", f"{GIB}\n")
    _write(root / "memory" / "memory.stat", f"cache 9\ntotal_inactive_file {GIB // 2}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    host = _meminfo(tmp_path, 64 * 2**20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    got = machine.available_memory(torch.device("cpu"), meminfo=host, proc_cgroup=proc, cgroup_root=root)
    assert got == (2 * GIB - GIB // 2) // 2
    # v1's "no limit" value.
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    got = machine.available_memory(torch.device("cpu"), meminfo=host, proc_cgroup=proc, cgroup_root=root)
    assert got == 64 * GIB // 2


def test_no_cgroup_files_means_the_host_figure(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    host = _meminfo(tmp_path, 2**20)
    got = machine.available_memory(torch.device("cpu"), meminfo=host, proc_cgroup=tmp_path / "none",
                                       cgroup_root=tmp_path)
    assert got == GIB


def test_cpu_quota_caps_cpu_count(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "cpu.max", "150000 100000\n")  # 1.5 CPUs
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    assert machine.cpu_count(proc, root) == min(2, len(os.sched_getaffinity(0)))
    _write(root / "cpu.max", "max 100000\n")
    assert machine.cpu_count(proc, root) == len(os.sched_getaffinity(0))


# -- CPU threads --------------------------------------------------------------------------------

def _parent_environ(tmp_path: Path, **env: str) -> Path:
    path = tmp_path / "environ"
    path.write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in {"PATH": "/bin", **env}.items()) + b"\0")
    return path


def test_threads_shared_among_local_ranks(tmp_path):
    torchrun_env = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}
    # torchrun put OMP_NUM_THREADS=1 there (its parent started without it): 16 CPUs / 4 ranks.
    threads, reason = machine.choose_cpu_threads(torchrun_env, cpus=16, parent_environ=_parent_environ(tmp_path))
    assert threads == 4 and "torchrun's default" in reason
    # The user ran OMP_NUM_THREADS=1 torchrun ...: respected.
    user = _parent_environ(tmp_path, OMP_NUM_THREADS="1")
    assert machine.choose_cpu_threads(torchrun_env, cpus=16, parent_environ=user)[0] is None
    # The user's own value under torchrun, any number: respected.
    assert machine.choose_cpu_threads({**torchrun_env, "OMP_NUM_THREADS": "3"}, cpus=16)[0] is None
    # One plain process: every CPU; more ranks than CPUs: one thread each.
    assert machine.choose_cpu_threads({}, cpus=16)[0] == 16
    assert machine.choose_cpu_threads({**torchrun_env, "LOCAL_WORLD_SIZE": "8"}, cpus=3,
                                          parent_environ=_parent_environ(tmp_path))[0] == 1
    assert machine.choose_cpu_threads({"LLAMA_NUM_THREADS": "5", **torchrun_env}, cpus=16)[0] == 5
    with pytest.raises(ValueError, match="LLAMA_NUM_THREADS='0' must be a positive integer"):
        machine.choose_cpu_threads({"LLAMA_NUM_THREADS": "0"}, cpus=16)


THREADS_SCRIPT = textwrap.dedent("""
    import os, torch
    from llama.runtime import distributed
    # whatever the library would not choose: its choice must replace it, or keep the user's
    torch.set_num_threads(int(os.environ["TEST_SET_THREADS"]))
    distributed.init_model_parallel(torch.device("cpu"))
    print(f"rank {os.environ['RANK']} threads {torch.get_num_threads()} omp {os.environ.get('OMP_NUM_THREADS')}")
""")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_default_is_told_from_the_users_setting(tmp_path):
    """Real torchrun: without OMP_NUM_THREADS torchrun sets 1 (with its banner) and each of
    the 2 ranks gets cpus // 2 threads; with the user's own OMP_NUM_THREADS=1 the library
    leaves torch's thread count alone (the CPUs + 5, which the script set).  That second job has
    one rank (a second was another import of torch): the library tells the user's setting from
    torchrun's by torchrun's own environment, the same for one rank as for two, and had it
    taken the user's 1 for torchrun's it would give the rank the CPUs, not the CPUs + 5."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    set_by_script = machine.cpu_count() + 5  # (never the library's choice for one rank or two)
    env.update(PYTHONPATH=str(helpers.REPO), CUDA_VISIBLE_DEVICES="", TEST_SET_THREADS=str(set_by_script))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    expected = max(1, machine.cpu_count() // 2)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # (the two ranks share stdout: their lines can interleave, so find them rather than split)
    assert sorted(re.findall(r"rank \d threads \d+ omp \d+", out.stdout)) == [
        f"rank {r} threads {expected} omp 1" for r in range(2)], out.stdout
    one_rank = [arg if arg != "--nproc_per_node=2" else "--nproc_per_node=1" for arg in cmd]
    out = subprocess.run(one_rank, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.findall(r"rank \d threads \d+ omp \d+", out.stdout) == [f"rank 0 threads {set_by_script} omp 1"], \
        out.stdout


# -- ranks waiting long on each other --------------------------------------------------------------

WAIT_WORKER = Path(__file__).parent / "fault_worker.py"


def _slow_loader(tmp_path: Path, llama3_checkpoint, delay: str, env: dict) -> subprocess.CompletedProcess:
    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    out = tmp_path / "out"
    out.mkdir()
    return helpers.torchrun(WAIT_WORKER, ["slow_load", str(ckpt), str(tok), str(out)], nproc=2, timeout=120,
                            env={"SLOW_LOAD_S": delay, **env})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_long_wait_logs_who_is_awaited_and_the_control_timeout_says_what_it_waited_for(tmp_path, llama3_checkpoint):
    """One job, two builds in turn (the two tests this was, in one torchrun job).  First rank 1
    takes 3 s longer to load: rank 0 says, every second, that it waits for rank 1, and the
    build then completes on both ranks.  Then rank 1 takes 90 s longer: rank 0 gives up after
    the control timeout, saying what it waited for, and the job ends well before the 90 s."""
    # The control timeout also bounds joining the process group: 5 s was too short for two
    # ranks that start seconds apart on a loaded machine (gloo's connect timed out first).  The
    # worker's ranks meet in torchrun's store before they build, so they join together and the
    # timeout can be short; 10 s still leaves a margin for the steps between meeting and joining,
    # and for the first build's 3 s wait.
    start = time.monotonic()
    proc = _slow_loader(tmp_path, llama3_checkpoint, "3,90", {"LLAMA_WAIT_LOG_S": "1", "LLAMA_CONTROL_TIMEOUT_S": "10"})
    # the first build: logged while waiting (rank 0's lines before it says it built), then done on every rank
    first, built, second = proc.stderr.partition("rank 0 built 0")
    assert built, proc.stderr[-3000:]
    assert re.search(r"rank 0 has waited \d+ s for rank\(s\) \[1\] to finish loading the checkpoint", first), \
        proc.stderr[-3000:]
    assert "rank 1 built 0" in proc.stderr, proc.stderr[-3000:]
    # the second: the control timeout ends it
    assert proc.returncode != 0
    assert "rank 0 built 1" not in second
    assert time.monotonic() - start < 90
    assert re.search(r"gave up after waiting \d+ s \(LLAMA_CONTROL_TIMEOUT_S=10\) for rank\(s\) \[1\] to finish "
                     r"loading the checkpoint", second), proc.stderr[-3000:]
