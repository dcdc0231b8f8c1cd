"""The test session's own check (tests/conftest.py): a process a test leaves running fails the
session, named and killed; a test that ends what it starts passes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import helpers

# The tests marked slow each run a pytest session of its own (torch imported: seconds).

LEAKS = '''
import subprocess
def test_leaves_a_process_running():
    subprocess.Popen(["sleep", "120"], start_new_session=True)  # its own session, as servers are started
'''

TIDY = '''
import subprocess
def test_ends_what_it_starts():
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    proc.kill()
    proc.wait()
'''


def run_session(tmp_path, body: str, inherit_mark: bool = False) -> subprocess.CompletedProcess:
    """A pytest run of ``body`` with tests/conftest.py: a session of its own, or (``inherit_mark``)
    one started by a test of this session, as test_demo.py starts one."""
    (tmp_path / "test_probe.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if inherit_mark or k != "LLAMA_TEST_SESSION"}
    # Without the installed pytest plugins (hypothesis, xdist, ...): the check is conftest.py's
    # alone, and they would double the run's start-up (importing hypothesis: ~2 s of CPU).
    env.update(LLAMA_TEST_LEFTOVER_GRACE_S="1", PYTHONPATH=str(helpers.REPO / "tests"),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_process_left_running_fails_the_session_and_is_killed(tmp_path):
    start = time.monotonic()
    run = run_session(tmp_path, LEAKS)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout and "still running" in run.stdout and "sleep 120" in run.stdout, run.stdout
    pid = int(run.stdout.split("sleep 120")[0].rsplit("\n", 1)[1].strip().rstrip(":"))
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        state = open(f"/proc/{pid}/stat").read().split(")")[1].split()[0]
    except FileNotFoundError:  # (reaped between the loop's look and this one)
        state = "gone"
    assert state in ("gone", "Z"), state  # killed (a zombie until init reaps it)
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_a_session_that_ends_what_it_starts_passes(tmp_path):
    run = run_session(tmp_path, TIDY)
    assert run.returncode == 0 and "still running" not in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.slow
def test_a_pytest_run_started_by_a_test_ends_nothing_of_this_session(tmp_path):
    """A pytest run a test starts inherits the mark: it checks nothing (the session that set the
    mark does), so the processes of this session (its xdist workers among them) live on."""
    ours = subprocess.Popen(["sleep", "120"])  # carries this session's mark
    try:
        run = run_session(tmp_path, TIDY, inherit_mark=True)
        assert run.returncode == 0 and "still running" not in run.stdout, run.stdout[-2000:]
        assert ours.poll() is None
    finally:
        ours.kill()
        ours.wait()


def test_the_check_names_marked_processes_and_waits_for_its_own_that_are_mid_exec(tmp_path):
    """conftest's look at /proc, on a made-up one: a process carrying the mark is named (its
    command line), one carrying another session's mark or Chromium's crash reporter is not; a
    descendant of this process with no environment yet (in the middle of execve) cannot be told
    yet, while init, kernel threads, zombies and others' processes without one are not waited for."""
    from conftest import _processes_left

    me = os.getpid()

    def process(pid: int, ppid: int, state: str = "S", environ: bytes = b"", cmdline: bytes = b"") -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_bytes(f"{pid} (a (b) c) {state} {ppid} {pid} 0 0 -1 4194560".encode())
        (tmp_path / str(pid) / "environ").write_bytes(environ)
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)

    marked = b"HOME=/root\0LLAMA_TEST_SESSION=7\0"
    process(1, 0, cmdline=b"/sbin/init\0")  # no environment, for good
    process(2, 0)  # a kernel thread
    process(101, me, environ=marked, cmdline=b"sleep\x00120\x00")
    process(102, me)  # mid-exec
    process(103, 102)  # a grandchild, mid-exec
    process(104, 1)  # not ours, no environment
    process(105, me, state="Z")  # a zombie: no environment
    process(106, me, environ=b"LLAMA_TEST_SESSION=8\0", cmdline=b"sleep\x00120\x00")
    process(107, 1, environ=marked, cmdline=b"chrome_crashpad_handler\x00--database\x00")
    process(108, 1, environ=marked, cmdline=b"python\x00-m\x00llama.serve\x00")  # orphaned, still marked
    (tmp_path / "self").mkdir()
    found, pending = _processes_left(b"LLAMA_TEST_SESSION=7", proc=str(tmp_path))
    assert found == {101: "sleep 120", 108: "python -m llama.serve"}
    assert pending == {102, 103}
