"""The test session's own check (tests/conftest.py): a process a test leaves running fails the
session, named and killed; a test that ends what it starts passes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import helpers

pytestmark = pytest.mark.slow  # each runs a pytest session of its own (torch imported: seconds)

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


def test_a_process_left_running_fails_the_session_and_is_killed(tmp_path):
    start = time.monotonic()
    run = run_session(tmp_path, LEAKS)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout and "still running" in run.stdout and "sleep 120" in run.stdout, run.stdout
    pid = int(run.stdout.split("sleep 120")[0].rsplit("\n", 1)[1].strip().rstrip(":"))
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    state = open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] if os.path.exists(f"/proc/{pid}") else "gone"
    assert state in ("gone", "Z"), state  # killed (a zombie until init reaps it)
    assert time.monotonic() - start < 60


def test_a_session_that_ends_what_it_starts_passes(tmp_path):
    run = run_session(tmp_path, TIDY)
    assert run.returncode == 0 and "still running" not in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


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
