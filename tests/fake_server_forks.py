"""Forks fake servers (tests/fake_engine.py ``main``) for tests/test_serve_process.py from one
process that has imported what they run (torch, through the engine's types, and the server):
each test's server is still a process of its own, with its own sockets, limits, signals and exit
status, but it starts in a fraction of a second instead of importing all that anew (seconds each,
most of a test's time).

Usage: python tests/fake_server_forks.py; it writes "ready", then reads one JSON request a line
on stdin: ``{"port": P, "options": {...}, "log": PATH, "nofile": N or null}`` forks a server
(``main(P, options)``, its output to PATH, its file-descriptor limit N) and is answered
``{"pid": PID}``.  When a server exits: ``{"exited": PID, "returncode": R}``, R as
``subprocess.Popen``'s (the exit status, or minus the signal that ended it).  At the end of its
input it kills the servers still running, and exits.

It runs on one thread, so that a fork copies no lock another thread holds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# What a fake server imports (fake_engine imports torch through llama.engine), imported once here.
import uvicorn  # noqa: E402, F401
import uvicorn.protocols.http.auto  # noqa: E402, F401

import fake_engine  # noqa: E402
import helpers  # noqa: E402, F401  (fake_engine.main imports it)
import llama.formats.chat  # noqa: E402, F401
import llama.runtime.host  # noqa: E402, F401
import llama.serve  # noqa: E402, F401
import llama.serve.app  # noqa: E402, F401
import llama.serve.connections  # noqa: E402, F401
import llama.structured  # noqa: E402, F401
import llama.tokenizer  # noqa: E402, F401


def say(message: object) -> None:
    sys.stdout.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
    sys.stdout.flush()


def run_server(request: dict) -> None:
    """In the forked child: what ``subprocess.Popen`` with ``close_fds`` and a ``preexec_fn``
    setting the file limit gave the server (stdin from /dev/null, stdout and stderr to its log,
    no other descriptor), then the fake server, then the interpreter's own ending (threads
    joined, exit functions run) with the server's exit status."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        if request.get("nofile"):
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (request["nofile"], request["nofile"]))
        try:
            fake_engine.main(str(request["port"]), json.dumps(request.get("options", {})))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        threading._shutdown()  # type: ignore[attr-defined]  # (as the interpreter does at its end)
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main() -> None:
    # The forks must not inherit a thread (a fork copies only the thread that forks).
    assert threading.active_count() == 1, threading.enumerate()
    servers: set[int] = set()

    def reap() -> None:
        while servers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            servers.discard(pid)
            say({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})

    say("ready")
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.01)  # (exits are reported within 10 ms)
        reap()
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                run_server(request)
            servers.add(pid)
            say({"pid": pid})
    for pid in servers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in list(servers):
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
