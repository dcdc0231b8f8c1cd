"""Grammar work bounded in time: compiles refused past their budget, in the Python API and the
server, and abandoned when their caller leaves (llama.structured.compiler); tokenising never
waiting behind a compile (llama.serve.serving); a constrained request whose masks are slow
waiting alone, or failing, while the rest of its batch goes on (llama.engine.sampler).

The slow grammars are real ones: ``a{1000}{1000}`` and its kin take about 3 s to compile
with the tests' tiny tiktoken vocabulary, held here to a budget of a fraction of a second;
with Llama 3's vocabulary (the slow tests) they take seconds to minutes.  Slow masks are
made by delaying one grammar's masks.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import REPO, build, delay_masks
from test_grammar import json_schema_format

BUDGET_S = 0.3  # the compile budget of this file's engine
SLACK_S = 1.5  # what a refusal may take beyond it (a worker's round trip; a replacement's start, ~0.3 s here)

# Each takes about 3 s to compile in-process with the tiny vocabulary.
SLOW_FORMATS = [
    ({"type": "regex", "regex": "a{1000}{1000}"}, "response_format.regex"),
    ({"type": "grammar", "grammar": "start: /b{999}{1001}/"}, "response_format.grammar"),
    (json_schema_format({"type": "string", "pattern": "^(?:c{1000}){1000}$"}), "response_format.json_schema.schema"),
]


def slow_tool(name: str = "lookup") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"key": {"type": "string", "pattern": "^a{1000}{1000}$"}},
        "required": ["key"]}}}


@pytest.fixture(scope="module")
def llama(llama3_checkpoint):
    llama = build(llama3_checkpoint, max_seq_len=128, max_batch_size=4)
    llama.structured.compile_timeout_s = BUDGET_S  # read when its first grammar is compiled
    llama.structured.response_format({"type": "regex", "regex": "ab"})  # its workers started
    return llama


def timed(f):
    start = time.monotonic()
    try:
        return f(), time.monotonic() - start
    except Exception as e:
        return e, time.monotonic() - start


# -- compiles --------------------------------------------------------------------------------


@pytest.mark.parametrize("response_format, param", SLOW_FORMATS, ids=["regex", "lark", "json_pattern"])
def test_a_grammar_too_slow_to_compile_is_refused_within_the_budget(llama, response_format, param):
    outcome, seconds = timed(lambda: llama.structured.response_format(response_format))
    assert isinstance(outcome, ValueError), f"compiled in {seconds:.2f} s: {outcome!r}"
    assert str(outcome).startswith(param) and f"longer than {BUDGET_S:g} s" in str(outcome), outcome
    assert seconds < BUDGET_S + SLACK_S


def test_the_python_api_refuses_a_slow_grammar_and_a_slow_tool_schema(llama):
    outcome, seconds = timed(lambda: llama.text_completion(["the"], max_gen_len=4, response_format=SLOW_FORMATS[0][0]))
    assert isinstance(outcome, ValueError) and "longer than" in str(outcome) and seconds < BUDGET_S + SLACK_S, outcome
    dialog = [{"role": "user", "content": "find it"}]
    outcome, seconds = timed(lambda: llama.structured.tool_choice([slow_tool()], "required"))
    assert isinstance(outcome, ValueError) and str(outcome).startswith("tools") and seconds < BUDGET_S + SLACK_S, \
        outcome
    assert llama.chat_completion([dialog], max_gen_len=4)  # the model still answers


def test_after_a_refusal_other_grammars_compile_at_once(llama):
    with pytest.raises(ValueError):
        llama.structured.response_format(SLOW_FORMATS[0][0])
    grammar, seconds = timed(lambda: llama.structured.response_format({"type": "regex", "regex": "[0-9]{3}"}))
    assert grammar is not None and seconds < 1.0
    (out,) = llama.text_completion(["the"], max_gen_len=8, response_format={"type": "regex", "regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", out["generation"])


def test_a_compile_whose_caller_left_stops_and_its_worker_is_killed(llama):
    from llama.structured import GrammarTokenizer, compile_response_format
    from llama.structured.compiler import CompileAbandoned, GrammarCompiler, abandon_when, worker_pids

    grammar_tokenizer = GrammarTokenizer(llama.tokenizer)
    grammar_tokenizer.compiler = GrammarCompiler(grammar_tokenizer, timeout_s=60)  # only the caller stops it
    compile_response_format({"type": "regex", "regex": "ab"}, grammar_tokenizer)
    before = set(worker_pids())
    abandon, outcome = threading.Event(), []

    def compile() -> None:
        with abandon_when(abandon):
            outcome.append(timed(lambda: compile_response_format(SLOW_FORMATS[0][0], grammar_tokenizer)))

    thread = threading.Thread(target=compile)
    thread.start()
    time.sleep(0.2)
    abandon.set()
    thread.join(5)
    error, seconds = outcome[0]
    assert isinstance(error, CompileAbandoned) and seconds < 0.2 + 0.5, outcome
    gone = [pid for pid in before if not os.path.exists(f"/proc/{pid}")]
    assert len(gone) == 1, (before, gone)  # the one compiling was killed, not left running


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_compiles_beyond_the_workers_wait_then_are_told_the_compilers_are_busy(llama):
    """One worker, three slow grammars at once: the first is compiled (and refused at its budget);
    of the two that wait, one takes the killed worker's replacement (and is refused in turn), the
    other, having waited a whole budget while the worker stayed busy, is told to retry (429 through
    the server)."""
    from llama.structured import GrammarTokenizer, compile_response_format
    from llama.structured.compiler import CompileRefused, GrammarCompiler, GrammarCompilerBusy

    grammar_tokenizer = GrammarTokenizer(llama.tokenizer)
    grammar_tokenizer.compiler = GrammarCompiler(grammar_tokenizer, timeout_s=0.4, processes=1)
    compile_response_format({"type": "regex", "regex": "ab"}, grammar_tokenizer)
    outcomes: dict = {}

    def compile(index: int) -> None:
        outcomes[index] = timed(lambda: compile_response_format(SLOW_FORMATS[0][0], grammar_tokenizer))

    threads = [threading.Thread(target=compile, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == [0, 1, 2], outcomes
    kinds = [type(outcomes[i][0]).__name__ for i in range(3)]
    # In the order they started: the first holds the worker until it is killed at its budget.  A
    # wait is extended while a replacement starts, so one of the other two may take the
    # replacement (and be refused in turn) while the other waits out its own budget during that
    # second trial and is told the compilers are busy; on a loaded machine the first trial
    # overruns its budget by more than the 20 ms between starts, and both waits end while it
    # still runs: both are told the compilers are busy.  Never is a waiting compile refused twice
    # over, nor does one wait past its budget.
    assert kinds[0] == "CompileRefused" and "GrammarCompilerBusy" in kinds[1:], outcomes
    assert set(kinds[1:]) <= {"CompileRefused", "GrammarCompilerBusy"}, outcomes
    outcomes = list(outcomes.values())
    assert all(seconds < 3 * 0.4 + SLACK_S for _, seconds in outcomes)
    assert issubclass(CompileRefused, ValueError) and not issubclass(GrammarCompilerBusy, ValueError)


# -- the server ------------------------------------------------------------------------------


@pytest.fixture
def fake(tmp_path):
    from fake_engine import FakeEngine, served_model
    from llama.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(REPO / "demo" / "tokenizer.model")
    engine = FakeEngine(tokenizer, max_batch_size=4, max_seq_len=256, max_queue=64)
    yield served_model(engine)
    engine.close()


def test_tokenising_never_waits_behind_grammar_compiles(fake):
    """More compiles than asyncio's default pool has threads, all stuck: a plain completion and a
    plain chat are still tokenised and answered at once."""
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    release, started = threading.Event(), []

    def compile_response_format(response_format, scope=None):
        started.append(1)
        release.wait(30)
        return None

    fake.structured.response_format = compile_response_format
    n_slow = min(32, (os.cpu_count() or 1) + 4) + 1  # asyncio's default pool, and one more
    with TestClient(create_app(fake, "m", max_queue=64)) as client:
        def post(path: str, body: dict, out: list) -> None:
            out.append(client.post(path, json={"model": "m", "max_tokens": 2, **body}))

        slow: list = []
        threads = [threading.Thread(target=post, args=("/v1/completions", {
            "prompt": "x", "response_format": {"type": "json_object"}}, slow)) for _ in range(n_slow)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(started) < min(n_slow, 4) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the rest are waiting for a thread
        try:
            for path, body in (("/v1/completions", {"prompt": "Once upon a time"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                plain: list = []
                start = time.monotonic()
                t = threading.Thread(target=post, args=(path, body, plain))
                t.start()
                t.join(5)
                seconds = time.monotonic() - start
                assert plain and plain[0].status_code == 200 and seconds < 1.0, (path, seconds, plain)
        finally:
            release.set()
            for t in threads:
                t.join(30)
    assert all(r.status_code in (200, 429) for r in slow), [r.text for r in slow if r.status_code not in (200, 429)]


def test_a_compile_is_abandoned_when_its_client_leaves(fake, llama):
    """The client of a request whose grammar is compiling disconnects (an ASGI ``http.disconnect``):
    the compile stops (its worker killed) at once, and the request is answered 499."""
    from starlette.requests import Request

    from llama.serve.metrics import ServerMetrics
    from llama.serve.openai_api import APIError
    from llama.serve.serving import OpenAIServing
    from llama.structured import GrammarTokenizer, compile_response_format
    from llama.structured.compiler import GrammarCompiler

    grammar_tokenizer = GrammarTokenizer(llama.tokenizer)
    grammar_tokenizer.compiler = GrammarCompiler(grammar_tokenizer, timeout_s=60)  # only the client stops it
    compile_response_format({"type": "regex", "regex": "ab"}, grammar_tokenizer)
    serving = OpenAIServing(fake, "m", ServerMetrics(fake.engine))
    left_at = time.monotonic() + 0.3
    ended: list = []

    async def receive() -> dict:  # as uvicorn's: it returns when the client has gone, and at once ever after
        await asyncio.sleep(max(0.0, left_at - time.monotonic()))
        return {"type": "http.disconnect"}

    def compile():
        try:
            return compile_response_format(SLOW_FORMATS[0][0], grammar_tokenizer)
        finally:
            ended.append(time.monotonic())

    async def run():
        request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)
        with pytest.raises(APIError) as info:
            await serving.compiled(compile, request)
        return info.value

    error = asyncio.run(run())
    assert error.status == 499 and time.monotonic() - left_at < 1.0  # (at once, on the disconnect)
    deadline = time.monotonic() + 2
    while serving._compiles and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended and ended[0] - left_at < 1.0 and serving._compiles == 0  # not compiled on for nobody (60 s)


def test_busy_compilers_are_a_429(fake):
    from llama.serve.metrics import ServerMetrics
    from llama.serve.openai_api import APIError
    from llama.serve.serving import OpenAIServing
    from llama.structured.compiler import GrammarCompilerBusy

    serving = OpenAIServing(fake, "m", ServerMetrics(fake.engine))

    def busy():
        raise GrammarCompilerBusy("all 2 grammar compilers stayed busy for 5 s: retry shortly")

    class Staying:  # a client that stays: its channel never says it left
        async def receive(self) -> dict:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

    async def run():
        with pytest.raises(APIError) as info:
            await serving.compiled(busy, Staying())
        return info.value

    error = asyncio.run(run())
    assert (error.status, error.code, error.headers.get("Retry-After")) == (429, "grammar_compilers_busy", "1")


def test_a_grammar_too_slow_to_follow_is_a_400_naming_its_field():
    from llama.engine.sampler import GrammarTooSlow
    from llama.serve.errors import failure

    error = failure(GrammarTooSlow("tools: the grammar took longer than 10 s ...", "tools"))
    assert (error.status, error.param, error.code) == (400, "tools", "grammar_too_slow")


# -- masks -----------------------------------------------------------------------------------


SLOW_MASK_S = 0.2


@pytest.fixture
def slow_masks(monkeypatch):
    """``slow_masks(grammar, seconds)``: every mask of ``grammar``'s matchers takes ``seconds`` more."""
    delays: dict[int, float] = {}
    delay_masks(monkeypatch, None, delays)
    return lambda grammar, seconds: delays.__setitem__(id(grammar), seconds)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_slow_mask_does_not_slow_the_rest_of_the_batch(llama3_checkpoint, slow_masks):
    """Beside a request whose every mask takes 0.2 s, a free request takes the time it takes
    alone (before: each step that sampled the slow one waited for its mask, 4 x 0.2 s); the
    slow request gets the tokens it gets with fast masks.  Best of two, alone and beside in
    turn, on one thread (the engine's thread tuner would time its trials into the steps)."""
    from llama.engine import RequestSettings

    llama = build(llama3_checkpoint, max_seq_len=128, max_batch_size=4)
    engine = llama.engine
    engine.runner.threads = None
    torch.set_num_threads(1)
    grammar = llama._grammar({"type": "regex", "regex": "[a-z ]{60}"})
    constrained = RequestSettings(max_new_tokens=4, temperature=1.0, seed=5, grammar=grammar)
    free = RequestSettings(max_new_tokens=40, temperature=0)
    prompt = llama.tokenizer.encode("the cat", bos=True, eos=False)
    # Warm up, masks fast: the mask threads, and the steps of one and two rows.
    fast = engine.submit(prompt, constrained)
    engine.submit(prompt, free).result()
    fast = fast.result()

    slow_masks(grammar, SLOW_MASK_S)
    alone_s, beside_s = [], []
    for rep in range(2):
        start = time.monotonic()
        alone = engine.submit(prompt, free).result()
        alone_s.append(time.monotonic() - start)
        start = time.monotonic()
        slow_handle = engine.submit(prompt, constrained)
        beside = engine.submit(prompt, free).result()
        beside_s.append(time.monotonic() - start)
        assert beside.tokens == alone.tokens
        if rep == 0:
            slow_handle.cancel()
    slow = slow_handle.result()
    slow_s = time.monotonic() - start
    assert min(beside_s) < min(alone_s) + 2 * SLOW_MASK_S, (alone_s, beside_s)
    assert slow.tokens == fast.tokens and slow_s >= len(slow.tokens) * SLOW_MASK_S


def test_a_mask_past_the_timeout_fails_its_request_alone(llama3_checkpoint, slow_masks):
    from llama.engine import RequestSettings
    from llama.engine.sampler import GrammarTooSlow

    llama = build(llama3_checkpoint, max_seq_len=128, max_batch_size=4)
    llama.engine.sampler.mask_timeout_s = 0.4
    grammar = llama._grammar({"type": "regex", "regex": "[a-z ]{60}"})
    slow_masks(grammar, 1.5)
    prompt = llama.tokenizer.encode("the cat", bos=True, eos=False)
    start = time.monotonic()
    slow = llama.engine.submit(prompt, RequestSettings(max_new_tokens=8, temperature=0, grammar=grammar))
    free = llama.engine.submit(prompt, RequestSettings(max_new_tokens=20, temperature=0))
    with pytest.raises(GrammarTooSlow, match=r"^response_format: .*longer than 0.4 s") as info:
        slow.result()
    assert info.value.param == "response_format" and time.monotonic() - start < 1.4  # before its mask was done
    assert len(free.result().tokens) == 20


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(delays=st.lists(st.sampled_from([0.0, 0.0, 0.005, 0.03, 0.08]), min_size=3, max_size=3),
       seeds=st.lists(st.integers(0, 50), min_size=3, max_size=3))
def test_deferred_masks_change_when_tokens_come_never_which(llama3_checkpoint, delays, seeds):
    """Three constrained requests and a free one, with masks delayed around a 10 ms budget (so
    that rows are deferred and released in every order): each gets the tokens it gets with no
    delay."""
    from llama.engine import RequestSettings

    llama = build(llama3_checkpoint, max_seq_len=128, max_batch_size=4)
    llama.engine.sampler.mask_budget_s = 0.01
    formats = [{"type": "regex", "regex": "[a-z ]{12}"}, json_schema_format({"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}), {"type": "regex", "regex": "(yes|no|maybe)[.!]"}]
    grammars = [llama._grammar(f) for f in formats]
    prompt = llama.tokenizer.encode("the", bos=True, eos=False)

    def run() -> list[list[int]]:
        settings = [RequestSettings(max_new_tokens=14, temperature=1.0, seed=s, grammar=g)
                    for s, g in zip(seeds, grammars)]
        settings.append(RequestSettings(max_new_tokens=14, temperature=0))
        handles = [llama.engine.submit(prompt, s) for s in settings]
        return [h.result().tokens for h in handles]

    expected = run()
    released = []
    take_held = llama.engine.sampler.take_held
    llama.engine.sampler.take_held = lambda *a: released.append(len((out := take_held(*a))[0])) or out
    with pytest.MonkeyPatch.context() as monkeypatch:  # one example's patches, undone before the next
        delay_masks(monkeypatch, llama.engine.sampler, {id(g): d for g, d in zip(grammars, delays)})
        assert run() == expected
    if max(delays) > 0.01:
        assert sum(released), "no row was deferred"


# -- generated shapes ------------------------------------------------------------------------

ATOMS = ["a", "x", "[ab]", "(?:ab)", "\\d", "[^\"\\\\]"]


@st.composite
def repetition_formats(draw) -> tuple[dict, str]:
    """A response format whose text is an atom repeated, once or nested: ``atom{n}`` or
    ``(?:atom{n}){m}``, as a regex, a Lark terminal or a JSON string's pattern."""
    counts = st.one_of(st.integers(1, 60), st.integers(300, 1200))  # small, or near and past what compiles in time
    atom = draw(st.sampled_from(ATOMS))
    regex = f"{atom}{{{draw(counts)}}}"
    if draw(st.booleans()):
        regex = f"(?:{regex}){{{draw(counts)}}}"
    kind = draw(st.sampled_from(["regex", "grammar", "json_schema"]))
    if kind == "regex":
        return {"type": "regex", "regex": regex}, "response_format.regex"
    if kind == "grammar":
        return {"type": "grammar", "grammar": f"start: /{regex}/"}, "response_format.grammar"
    return json_schema_format({"type": "string", "pattern": f"^{regex}$"}), "response_format.json_schema.schema"


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=repetition_formats())
@example(case=SLOW_FORMATS[0])
@example(case=({"type": "regex", "regex": "(?:x{1000}){1000}"}, "response_format.regex"))
def test_every_generated_repetition_compiles_or_is_refused_within_the_budget(llama, case):
    response_format, param = case
    outcome, seconds = timed(lambda: llama.structured.response_format(response_format))
    assert seconds < BUDGET_S + SLACK_S, (response_format, seconds, outcome)
    if isinstance(outcome, Exception):
        assert isinstance(outcome, ValueError) and str(outcome).startswith(param), outcome


@pytest.fixture(scope="module")
def llama3_grammar_tokenizer(llama3_tokenizer_path):
    """Meta's Llama 3 vocabulary as grammars see it (seconds to build), with a compiler of a 2 s budget."""
    from llama.structured import GrammarTokenizer
    from llama.structured.compiler import GrammarCompiler
    from llama.tokenizer import load_tokenizer

    grammar_tokenizer = GrammarTokenizer(load_tokenizer(llama3_tokenizer_path))
    grammar_tokenizer.compiler = GrammarCompiler(grammar_tokenizer, timeout_s=2.0)
    return grammar_tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("regex, refused", [("a{1000}{1000}", True), ("a{300}{300}", True), ("x{100000}", True),
                                            ("x{20000}", False), ("[a-z]{1,30}", False)])
def test_with_llama3s_vocabulary(llama3_grammar_tokenizer, regex, refused):
    """With Meta's Llama 3 vocabulary, in-process: ``a{1000}{1000}`` runs for minutes,
    ``a{300}{300}`` 4 s and ``x{100000}`` 9 s; ``x{20000}`` 0.4 s."""
    from llama.structured import compile_response_format

    grammar_tokenizer = llama3_grammar_tokenizer
    compile_response_format({"type": "regex", "regex": "ab"}, grammar_tokenizer)  # its workers (re)started
    outcome, seconds = timed(lambda: compile_response_format({"type": "regex", "regex": regex}, grammar_tokenizer))
    assert isinstance(outcome, ValueError) == refused, outcome
    assert seconds < 2.0 + 2 * 0.4 + SLACK_S  # (a grammar that passes is compiled twice)


def test_a_mask_or_compile_thread_that_runs_on_does_not_keep_the_process_alive():
    """Masks and the server's compiles run on daemon threads (llama.runtime.daemon_pool): a
    task that never ends does not hold up the exit (a ThreadPoolExecutor's joins it)."""
    import subprocess
    import sys

    script = ("import threading\n"
              "from llama.runtime.daemon_pool import DaemonPool\n"
              "pool = DaemonPool(2, 'grammar-masks')\n"
              "futures = [pool.submit(pow, 2, k) for k in range(5)]\n"
              "assert [f.result() for f in futures] == [1, 2, 4, 8, 16]\n"
              "failing = pool.submit(int, 'x')\n"
              "assert isinstance(failing.exception(), ValueError)\n"
              "pool.submit(threading.Event().wait)\n"
              "print('done')\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert time.monotonic() - start < 10
