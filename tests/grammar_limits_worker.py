"""Worker for tests/test_grammar_limits.py: grammars compiled where a crash of llguidance's
compiler (a stack overflow, SIGSEGV) cannot take the test run down.

Usage: python tests/grammar_limits_worker.py MODE TOKENIZER; then one JSON request a line on
stdin, one JSON answer a line on stdout ("ready" first).

* MODE ``compile``: each request is compiled in a child forked for it, so that a crash ends
  only that child.  ``{"response_format": {...}}`` (llama.structured.compile_response_format)
  or ``{"tools": [...], "tool_prompt_format": "json"}`` (tool_call_grammar, tool_choice
  "required"); ``"unchecked": true`` compiles without llama.structured.limits' check (to show
  that a shape does crash).  Answer: ``{"outcome": "ok"}``, ``{"outcome": "error",
  "message": ...}`` (a ValueError) or ``{"outcome": "signal", "signal": N}``.
  A request ``{"path": ..., "body": {...}}`` goes to the server's app, as in MODE ``http``, in
  a child forked for it at the first such request (from this process, which runs no thread),
  which then answers every such request; a crash
  that ends that child ends this process too, as it ends a worker in MODE ``http``.
* MODE ``http``: the server's app (a fake engine that compiles real grammars) in this
  process; each request ``{"path": ..., "body": {...}}`` is posted and answered with
  ``{"status": ..., "body": ...}``.  A crash ends this process: the test sees it exit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def compile_in_child(request: dict, tokenizer) -> dict:
    from llama.structured import compile_response_format, limits, tool_call_grammar

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compile, say how it went, exit
        os.close(read)
        signal.alarm(120)  # a compile that hangs ends as a signal, never the test run
        code, message = 0, ""
        try:
            if request.get("unchecked"):
                limits.check_grammar_limits = lambda source, param: None
                limits.check_schema_limits = lambda schema, param, where="": None
                import llama.structured.response_format as rf
                import llama.structured.tool_choice as tc

                rf.check_grammar_limits = limits.check_grammar_limits
                tc.check_schema_limits = limits.check_schema_limits
            if "tools" in request:
                tool_call_grammar(request["tools"], "required", tokenizer, request.get("tool_prompt_format", "json"))
            else:
                compile_response_format(request["response_format"], tokenizer)
        except ValueError as e:
            code, message = 1, str(e)
        with os.fdopen(write, "w") as f:
            f.write(message)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"outcome": "signal", "signal": os.WTERMSIG(status)}
    return {"outcome": "ok"} if os.WEXITSTATUS(status) == 0 else {"outcome": "error", "message": message}


def http_client(tokenizer):
    """A function that posts a request to the server's app (a fake engine that compiles real
    grammars) and gives its answer."""
    from fastapi.testclient import TestClient

    from fake_engine import FakeEngine, served_model
    from llama.formats.chat import chat_format_for
    from llama.serve import create_app

    engine = FakeEngine(tokenizer, max_batch_size=4, max_seq_len=4096, max_queue=8)
    llama = served_model(engine, chat_format_for(tokenizer))
    client = TestClient(create_app(llama, "demo-test")).__enter__()

    def answer(request: dict) -> dict:
        r = client.post(request["path"], json=request["body"])
        return {"status": r.status_code, "body": r.json()}
    return answer


class HttpChild:
    """The server's app in a child forked for it, asked one request at a time through pipes."""

    def __init__(self, tokenizer) -> None:
        to_child, self._requests = os.pipe()
        self._answers, from_child = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._requests)
            os.close(self._answers)
            code = 0
            try:
                answer = http_client(tokenizer)
                with os.fdopen(to_child) as requests, os.fdopen(from_child, "w") as answers:
                    for line in requests:
                        answers.write(json.dumps(answer(json.loads(line))) + "\n")
                        answers.flush()
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(to_child)
        os.close(from_child)
        self._write = os.fdopen(self._requests, "w")
        self._read = os.fdopen(self._answers)

    def __call__(self, request: dict) -> dict:
        self._write.write(json.dumps(request) + "\n")
        self._write.flush()
        line = self._read.readline()
        if not line:  # the app's process died: so does this one, of the same signal (as in MODE http)
            _, status = os.waitpid(self.pid, 0)
            if os.WIFSIGNALED(status):
                signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
                os.kill(os.getpid(), os.WTERMSIG(status))
            os._exit(1)
        return json.loads(line)

    def close(self) -> None:
        self._write.close()  # the child's end of input: it exits
        os.waitpid(self.pid, 0)


def main(mode: str, tokenizer_path: str) -> None:
    from llama.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    http: list[HttpChild] = []
    if mode == "compile":
        from llama.structured import GrammarTokenizer

        grammar_tokenizer = GrammarTokenizer(tokenizer)

        def answer(request: dict) -> dict:
            if "path" in request:
                if not http:
                    http.append(HttpChild(tokenizer))
                return http[0](request)
            return compile_in_child(request, grammar_tokenizer)
    else:
        answer = http_client(tokenizer)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)
    for child in http:
        child.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
