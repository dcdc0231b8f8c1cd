"""Serving benchmark: concurrent streaming clients against ``python -m llama.serve``, and, in the
same run on the same weights, llama.cpp's: its own ``llama-server`` (``--llama_server``: continuous
batching over a unified KV cache shared by its slots, the peer of this library's paged cache) or
the OpenAI-compatible server of ``llama-cpp-python[server]`` (one request at a time).

    python benchmarks/bench_serve.py --llama_server /path/to/llama-server   # 150m, bf16, 2 threads, both
    python benchmarks/bench_serve.py                      # the peer: llama-cpp-python's server
    python benchmarks/bench_serve.py --config tiny --peer=False --new_tokens 32   # a quick check of the script
    python benchmarks/bench_serve.py --config 1b --scenarios shared --peer=False   # one scenario, a larger model

What it does, in order (one server at a time, nothing else running):
  1. writes a Meta-format checkpoint with random weights (the ``--config`` of benchmarks/bench.py,
     Llama 3 vocabulary and Meta's real Llama 3 tokenizer from llama-models) to ``--workdir``;
  2. times the Python API (``Llama.build`` + ``generate``, greedy) on one prompt: the baseline a
     single client through the server is compared with;
  3. starts this library's server on that checkpoint and runs the client scenarios;
  4. converts the same checkpoint for llama.cpp (``python -m llama.convert meta_to_hf``, an HF
     ``tokenizer.json`` made from the tiktoken file, then llama.cpp's ``convert_hf_to_gguf.py``
     at the same dtype), starts llama.cpp's server with the same thread count and runs the same
     scenarios: ``llama-server`` with ``--parallel 32 --kv-unified --ctx-size 16384`` (32 slots
     decoding together in one KV cache of 16,384 tokens, as this library's server holds them; its
     prompt cache in host memory, ``--cache-ram``, at its default), or ``python -m
     llama_cpp.server``, which serves one request at a time (its 32-client scenario is skipped).

Scenarios (every client streams ``/v1/completions`` greedily, ``--new_tokens`` tokens, from its own
prompt of ``--prompt_tokens`` tokens):
  - 1 client, then 8 concurrent clients: aggregate tokens/s (all tokens / wall time), time to
    first token (TTFT) and inter-token latency (ITL) p50/p99 over all clients and repetitions;
  - prefix reuse: a chat with a ~1,000-token history; TTFT of its first turn, then of a second
    turn that repeats the history (plus the answer and a short new question);
  - a shared system prompt: 16 clients whose prompts begin with the same ~1,000 tokens; client 1
    alone, then clients 2-16 together; TTFT of each;
  - 32 concurrent clients with prompts of ~200 tokens (this library's server holds them all at once
    in ``--kv_cache_tokens`` 16,384: 8 x 2,048).

Peer install (not a dependency of the library): a ``llama-server`` binary of llama.cpp, or
llama-cpp-python built from source with native CPU flags; and llama.cpp's converter from the same
source tree (with the ``gguf`` package)::

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install 'llama-cpp-python[server]' --no-binary llama-cpp-python gguf
    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp && tar xzf /tmp/lcp/*.tar.gz -C /tmp/lcp
    python benchmarks/bench_serve.py --converter /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import fire

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from peers import WORDS, find_converter, make_gguf, write_checkpoint  # noqa: E402  (benchmarks/peers.py)

logger = logging.getLogger("bench_serve")

CLIENT_COUNTS = (1, 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the prompts ----------------------------------------------------------------------------------


def prompts_for(tokenizer, n: int, n_tokens: int) -> list[str]:
    """``n`` different prompts of about ``n_tokens`` tokens each."""
    out = []
    for i in range(n):
        words, k = [], i * 7
        while len(tokenizer.encode(" ".join(words), bos=True, eos=False)) < n_tokens:
            words.append(WORDS[k % len(WORDS)] + (str(i) if k % 11 == 0 else ""))
            k += 1
        out.append(" ".join(words))
    return out


def python_api_tokens_per_s(ckpt: Path, dtype: str, prompt: str, new_tokens: int, reps: int) -> float:
    """Single-request tokens/s of the Python API: new tokens / (time of a whole greedy generate call), the
    engine built as the server's (32 rows, a pool of 8 x 2,048 tokens)."""
    from llama import Llama

    llama = Llama.build(ckpt_dir=ckpt, tokenizer_path=ckpt / "tokenizer.model", max_seq_len=2048,
                        max_batch_size=32, kv_cache_tokens=8 * 2048, device="cpu", dtype=dtype)
    llama.generate([llama.tokenizer.encode("warm-up " + prompt, bos=True, eos=False)], max_gen_len=8, temperature=0)
    rates = []
    for k in range(reps):
        tokens = llama.tokenizer.encode(fresh([prompt], f"1.{k}")[0], bos=True, eos=False)  # as the server's 1 client
        start = time.perf_counter()
        out, _ = llama.generate([tokens], max_gen_len=new_tokens, temperature=0)
        rates.append(len(out[0]) / (time.perf_counter() - start))
    del llama
    return statistics.median(rates)


# -- servers ---------------------------------------------------------------------------------------


def die_with_parent() -> None:
    """Run in a child process before its program starts (``preexec_fn``): on Linux the child
    gets SIGTERM when the process that started it dies, even killed outright (SIGKILL), so a
    server started in a session of its own never outlives the benchmark that started it."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the benchmark's own handlers still stop it
        pass


class ServerProcess:
    def __init__(self, name: str, cmd: list[str], port: int, threads: int, log: Path, hide_gpus: bool = True) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        if hide_gpus:  # a CPU comparison (benchmarks/gpu_check.py serves on the GPU)
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.log = open(log, "w")
        logger.info("starting %s: %s", name, " ".join(cmd))
        # a session of its own (stop() ends the server's whole process group), which ends with ours
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)

    def wait_ready(self, path: str, timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start within {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        stop_process_group(self.proc)
        self.log.close()


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """End ``proc`` (started with ``start_new_session``) and its process group: SIGTERM, then
    SIGKILL after ``grace_s`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- clients ---------------------------------------------------------------------------------------


@dataclass
class Run:
    tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)


def retried(stream):
    """``stream(client, url, body)`` sent again, once, where the server closed a kept-alive
    connection before answering (seen with llama-server after a long streamed reply: the request
    never reached it); anything else is raised."""
    import httpx

    async def call(client, url: str, body: dict):
        try:
            return await stream(client, url, body)
        except httpx.RemoteProtocolError as e:
            if "without sending a response" not in str(e):
                raise
            logger.warning("%s: the server closed the connection before answering; sending the request again", url)
            return await stream(client, url, body)

    return call


@retried
async def stream_one(client, url: str, body: dict) -> Run:
    """One streamed request; token arrival times from the SSE chunks (one per token on both servers)."""
    run = Run()
    start = time.perf_counter()
    last = None
    async with client.stream("POST", url, json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if chunk.get("usage"):
                run.tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if not choices or choices[0].get("finish_reason"):
                continue
            piece = choices[0].get("text", choices[0].get("delta", {}).get("content"))
            if piece is None:
                continue
            now = time.perf_counter()
            if last is None:
                run.ttft = now - start
            else:
                run.itl.append(now - last)
            last = now
    if not run.tokens:
        run.tokens = len(run.itl) + (1 if last is not None else 0)
    return run


async def concurrent(url: str, model: str, prompts: list[str], new_tokens: int) -> tuple[float, list[Run]]:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        start = time.perf_counter()
        runs = await asyncio.gather(*[
            stream_one(client, url + "/v1/completions", {
                "model": model, "prompt": p, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}})
            for p in prompts])
        return time.perf_counter() - start, list(runs)


async def shared_prefix(url: str, model: str, system: str, questions: list[str],
                        new_tokens: int, together: bool = True) -> tuple[float, list[float]]:
    """TTFT of client 1 (alone), then of clients 2..n together (or one after another), every prompt
    ``system`` + its question."""
    import httpx

    def body(q: str) -> dict:
        return {"model": model, "prompt": system + q, "max_tokens": new_tokens, "temperature": 0, "stream": True}

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        first = await stream_one(client, url + "/v1/completions", body(questions[0]))
        if together:
            rest = await asyncio.gather(*[stream_one(client, url + "/v1/completions", body(q)) for q in questions[1:]])
        else:
            rest = [await stream_one(client, url + "/v1/completions", body(q)) for q in questions[1:]]
        return first.ttft, [r.ttft for r in rest]


async def chat_turns(url: str, model: str, history: str, reply_tokens: int) -> tuple[float, float]:
    """TTFT of a chat's first turn (a long user message) and of its second turn."""
    import httpx

    async with httpx.AsyncClient() as client:
        messages = [{"role": "system", "content": "You are a patient assistant."},
                    {"role": "user", "content": history}]
        body = {"model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0, "stream": True}
        first = await stream_one_chat(client, url, body)
        messages = messages + [{"role": "assistant", "content": first[1]},
                               {"role": "user", "content": "And then what happened?"}]
        second = await stream_one_chat(client, url, {**body, "messages": messages})
        return first[0], second[0]


@retried
async def stream_one_chat(client, url: str, body: dict) -> tuple[float, str]:
    start = time.perf_counter()
    ttft = None
    text = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    if ttft is None:
                        ttft = time.perf_counter() - start
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(text)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


@dataclass
class Row:
    server: str
    clients: int
    tok_s: float
    ttft: list[float]
    itl: list[float]
    tokens: int


SCENARIOS = ("throughput", "shared", "turns", "clients32")


def fresh(prompts: list[str], tag: str) -> list[str]:
    """The prompts, each begun with ``tag``: a repetition's prompts are new to both servers' prompt
    caches (the same prompts again would be prefilled from the cache, timing the cache instead)."""
    return [f"{tag} {p}" for p in prompts]


def run_scenarios(name: str, url: str, model: str, prompts: list[str], new_tokens: int, reps: int,
                  history: str, reply_tokens: int, long_prompts: list[str] = (), scenarios: tuple = SCENARIOS,
                  ) -> tuple[list[Row], Optional[tuple[float, float]], Optional[tuple[float, float, float]]]:
    """The ``scenarios`` chosen: "throughput" (1 and 8 clients, and the 32 of ``long_prompts``),
    "clients32" (the 32 alone), "shared" (a shared system prompt), "turns" (a chat's second turn);
    the rows of the first and the TTFTs of the others (None where not run)."""
    asyncio.run(concurrent(url, model, ["warm-up " + prompts[0]], 8))
    rows = []
    for n in CLIENT_COUNTS if "throughput" in scenarios else ():
        rates, ttfts, itls, tokens = [], [], [], 0
        for k in range(reps):
            wall, runs = asyncio.run(concurrent(url, model, fresh(prompts[:n], f"{n}.{k}"), new_tokens))
            total = sum(r.tokens for r in runs)
            short = [r.tokens for r in runs if r.tokens < new_tokens]
            if short:
                logger.warning("%s: %d of %d streams ended early (%s tokens): an end-of-text token or an interrupted "
                               "stream", name, len(short), len(runs), short)
            rates.append(total / wall)
            ttfts += [r.ttft for r in runs]
            itls += [x for r in runs for x in r.itl]
            tokens += total
        rows.append(Row(name, n, statistics.median(rates), ttfts, itls, tokens))
        logger.info("%s, %d client(s): %.1f tok/s", name, n, rows[-1].tok_s)
    if long_prompts and ("throughput" in scenarios or "clients32" in scenarios):
        rates, ttfts, itls, tokens = [], [], [], 0
        for k in range(reps):
            wall, runs = asyncio.run(concurrent(url, model, fresh(long_prompts, f"long.{k}"), new_tokens))
            rates.append(sum(r.tokens for r in runs) / wall)
            ttfts += [r.ttft for r in runs]
            itls += [x for r in runs for x in r.itl]
            tokens += sum(r.tokens for r in runs)
        rows.append(Row(name + " (~200-token prompts)", len(long_prompts), statistics.median(rates), ttfts, itls,
                        tokens))
        logger.info("%s, %d clients of long prompts: %.1f tok/s", name, len(long_prompts), rows[-1].tok_s)
    shared_first, shared_rest, one_by_one = [], [], []
    for k in range(reps if "shared" in scenarios else 0):
        # a fresh system prompt each repetition (a different first word): no run reuses another's cache
        questions = [f" Question {i}: what does line {i} say?" for i in range(16)]
        a, rest = asyncio.run(shared_prefix(url, model, f"{k} {history}", questions, reply_tokens))
        shared_first.append(a)
        shared_rest.append(statistics.median(rest))
        a, rest = asyncio.run(shared_prefix(url, model, f"{k}b {history}", questions, reply_tokens, together=False))
        one_by_one.append(statistics.median(rest) / a)
    firsts, seconds = [], []
    for _ in range(reps if "turns" in scenarios else 0):
        # a fresh history each repetition (a different first word), so no run reuses another's cache
        a, b = asyncio.run(chat_turns(url, model, f"{len(firsts)} {history}", reply_tokens))
        firsts.append(a)
        seconds.append(b)
    return (rows, (statistics.median(firsts), statistics.median(seconds)) if firsts else None,
            (statistics.median(shared_first), statistics.median(shared_rest), statistics.median(one_by_one))
            if shared_first else None)


def keep_results(name: str, r: list[Row], turn: Optional[tuple], share: Optional[tuple], rows: list[Row],
                 turns: dict, shared: dict) -> None:
    rows += r
    if turn is not None:
        turns[name] = turn
    if share is not None:
        shared[name] = share


# -- the report ------------------------------------------------------------------------------------


def table(rows: list[Row], api_rate: Optional[float], turns: dict[str, tuple[float, float]],
          shared: dict[str, tuple[float, float, float]]) -> str:
    lines = []
    if rows:
        lines += ["| server | clients | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r.server} | {r.clients} | {r.tok_s:.1f} | {1e3 * percentile(r.ttft, 50):.0f} | "
                         f"{1e3 * percentile(r.ttft, 99):.0f} | {1e3 * percentile(r.itl, 50):.1f} | "
                         f"{1e3 * percentile(r.itl, 99):.1f} |")
        lines += [""] + ([f"Python API, one request (this library, no server): {api_rate:.1f} tok/s", ""]
                         if api_rate is not None else [])
    if turns:
        lines += ["| server | chat turn 1 TTFT ms | turn 2 TTFT ms | turn 2 / turn 1 |", "|---|---:|---:|---:|"]
        for name, (a, b) in turns.items():
            lines.append(f"| {name} | {1e3 * a:.0f} | {1e3 * b:.0f} | {b / a:.2f} |")
        lines.append("")
    if shared:
        lines += ["| server | shared prompt: client 1 TTFT ms | clients 2-16 together, TTFT p50 ms | 2-16 / 1 | "
                  "2-16 one after another / 1 |", "|---|---:|---:|---:|---:|"]
        for name, (a, b, c) in shared.items():
            lines.append(f"| {name} | {1e3 * a:.0f} | {1e3 * b:.0f} | {b / a:.2f} | {c:.2f} |")
        lines.append("")
    ours = {r.clients: r for r in rows if r.server == "llama.serve"}
    lines.append("Targets (llama.serve):")
    if 1 in ours and 8 in ours:
        lines += [f"- 8 clients vs 1, aggregate tok/s: {ours[8].tok_s / ours[1].tok_s:.2f}x (target >= 4x)",
                  f"- TTFT p50, 8 clients vs 1: {percentile(ours[8].ttft, 50) / percentile(ours[1].ttft, 50):.2f}x "
                  "(target <= 2x)",
                  f"- 1 client through the server vs the Python API: {ours[1].tok_s / api_rate:.2f} "
                  "(target >= 0.90)"]
    if "llama.serve" in turns:
        a, b = turns["llama.serve"]
        lines.append(f"- second chat turn TTFT / first: {b / a:.2f} (target <= 0.33)")
    if "llama.serve" in shared:
        a, b, c = shared["llama.serve"]
        lines.append(f"- shared system prompt, TTFT p50 of clients 2-16 / client 1: {b / a:.2f} together, "
                     f"{c:.2f} one after another (target <= 0.25)")
    return "\n".join(lines)


# --engine_process's choices: the server's name in the tables and its flags
DESIGNS = {"default": ("llama.serve", []), "one": ("llama.serve (one process)", ["--no-engine_process"]),
           "two": ("llama.serve (engine process)", ["--engine_process"]),
           "one_half": ("llama.serve (one process, half the threads)", ["--no-engine_process"]),
           "dp2": ("llama.serve (2 replicas, prefix routing)", ["--data_parallel", "2"]),
           "dp2_round_robin": ("llama.serve (2 replicas, round robin)", ["--data_parallel", "2", "--routing",
                                                                         "round_robin"])}


def cpu_pressure() -> Optional[float]:
    """/proc/pressure/cpu's "some avg10" (the share of the last 10 s some task waited for a CPU), or None."""
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def summary(rows: list[Row], share: Optional[tuple], before: Optional[float], after: Optional[float]) -> dict:
    """One server's numbers for the A/B table: the shared-prompt TTFTs, the 32 clients' tok/s and TTFT."""
    out: dict = {"pressure": [p for p in (before, after) if p is not None]}
    if share is not None:
        out["shared client 1 TTFT ms"] = 1e3 * share[0]
        out["shared clients 2-16 TTFT p50 ms"] = 1e3 * share[1]
    for r in rows:
        if r.clients == 32:
            out["32 clients tok/s"] = r.tok_s
            out["32 clients TTFT p50 ms"] = 1e3 * percentile(r.ttft, 50)
    return out


def ab_table(by_design: dict[str, list[dict]]) -> str:
    """Median and range over the rounds of each design, and the CPU pressure seen."""
    names = [k for k in next(iter(by_design.values()))[0] if k != "pressure"] if by_design else []
    lines = ["| server | rounds | " + " | ".join(names) + " | CPU pressure (some avg10) |",
             "|---|---:|" + "---:|" * len(names) + "---|"]
    for design, runs in by_design.items():
        cells = []
        for name in names:
            xs = [run[name] for run in runs if name in run]
            cells.append(f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]" if xs else "-")
        pressure = [p for run in runs for p in run["pressure"]]
        seen = f"{min(pressure):.0f}-{max(pressure):.0f}%" if pressure else "-"
        lines.append(f"| {DESIGNS[design][0]} | {len(runs)} | " + " | ".join(cells) + f" | {seen} |")
    return "\n".join(lines)


def main(config: str = "150m", dtype: str = "bfloat16", threads: int = 2, new_tokens: int = 128,
         prompt_tokens: int = 32, history_tokens: int = 1000, reply_tokens: int = 16, reps: int = 3,
         peer: bool = True, converter: Optional[str] = None, llama_server: Optional[str] = None,
         workdir: str = "/tmp/bench_serve", scenarios: str = ",".join(SCENARIOS[:3]),
         engine_process: str = "default", ab_rounds: int = 1) -> None:
    """Run the scenarios (``--scenarios``: a comma-separated choice of throughput, shared, turns,
    clients32; default the first three) on this library's server and (``--peer``) llama.cpp's
    (``--llama_server``: the path of its llama-server binary; else llama-cpp-python's server); print
    the tables.  ``--engine_process one,two``: this library's server in one process and with its
    engine in a process of its own, each ``--ab_rounds`` times, interleaved (one, two, one, two...),
    then a table of each one's median and range; ``dp2`` and ``dp2_round_robin``: two replicas
    (``--data_parallel 2``, the same threads shared) with prefix-aware or round-robin routing;
    ``one_half``: one process with half the threads (what each replica has)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(threads)
    from llama.tokenizer import load_tokenizer

    work = Path(workdir) / f"{config}-{dtype}"
    ckpt = write_checkpoint(config, dtype, work / "meta")
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    prompts = prompts_for(tokenizer, max(CLIENT_COUNTS), prompt_tokens)
    long_prompts = prompts_for(tokenizer, 32, 200)
    history = prompts_for(tokenizer, 1, history_tokens)[0]
    chosen = tuple(scenarios.split(",")) if isinstance(scenarios, str) else tuple(scenarios)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}: choose among {', '.join(SCENARIOS)}")
    api_rate = None
    if "throughput" in chosen:
        api_rate = python_api_tokens_per_s(ckpt, dtype, prompts[0], new_tokens, reps)
        logger.info("Python API: %.1f tok/s", api_rate)

    rows: list[Row] = []
    turns: dict[str, tuple[float, float]] = {}
    shared: dict[str, tuple[float, float, float]] = {}
    designs = tuple(engine_process.split(",")) if isinstance(engine_process, str) else tuple(engine_process)
    if set(designs) - set(DESIGNS):
        raise SystemExit(f"unknown --engine_process {sorted(set(designs) - set(DESIGNS))}: choose among "
                         f"{', '.join(DESIGNS)}")
    by_design: dict[str, list[dict]] = {d: [] for d in designs}
    for round_ in range(ab_rounds):  # A/B interleaved: each round runs every design once, in turn
        for design in designs:
            name = DESIGNS[design][0] + (f" #{round_ + 1}" if ab_rounds > 1 else "")
            port = free_port()
            ours = ServerProcess(name, [
                sys.executable, "-m", "llama.serve", "--ckpt_dir", str(ckpt), "--port", str(port), "--device", "cpu",
                "--dtype", dtype, "--max_batch_size", "32", "--max_seq_len", "2048", "--kv_cache_tokens",
                str(8 * 2048), "--model_name", "bench", *DESIGNS[design][1]], port,
                # the replicas share the threads; one_half: what one of them has, alone
                max(1, threads // 2) if design.startswith("dp2") or design == "one_half" else threads,
                work / f"llama_serve_{design}_{round_}.log")
            try:
                ours.wait_ready("/health")
                pressure = cpu_pressure()
                r, turn, share = run_scenarios(name, ours.url, "bench", prompts, new_tokens, reps, history,
                                               reply_tokens, long_prompts, chosen)
                keep_results(name, r, turn, share, rows, turns, shared)
                by_design[design].append(summary(r, share, pressure, cpu_pressure()))
            finally:
                ours.stop()

    if peer:
        if llama_server is None:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                raise SystemExit("neither --llama_server nor llama-cpp-python is given: see this script's docstring, "
                                 "or pass --peer=False")
        elif not os.access(llama_server, os.X_OK):
            raise SystemExit(f"--llama_server {llama_server} is not an executable file")
        conv = find_converter(converter)
        if conv is None:
            raise SystemExit("llama.cpp's convert_hf_to_gguf.py not found: pass --converter (see the docstring)")
        gguf = make_gguf(ckpt, work, dtype, conv)
        port = free_port()
        if llama_server is not None:
            name, ready = "llama.cpp (llama-server)", "/health"
            peer_server = ServerProcess(name, [
                llama_server, "--model", str(gguf), "--alias", "bench", "--host", "127.0.0.1", "--port", str(port),
                "--threads", str(threads), "--threads-batch", str(threads), "--ctx-size", str(8 * 2048),
                "--parallel", "32", "--kv-unified", "--batch-size", "512", "--no-webui"],
                port, threads, work / "llama_server.log")
        else:
            name, ready = "llama.cpp (llama-cpp-python)", "/v1/models"
            peer_server = ServerProcess(name, [
                sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "bench",
                "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
                "--n_threads_batch", str(threads), "--n_ctx", "2048", "--n_batch", "512",
                # its default cuts a running stream short when another request arrives; here every client
                # waits for its full answer, as with llama.serve
                "--interrupt_requests", "False"],
                port, threads, work / "llama_cpp.log")
        try:
            peer_server.wait_ready(ready)
            r, turn, share = run_scenarios(name, peer_server.url, "bench", prompts, new_tokens, reps, history,
                                           reply_tokens, long_prompts if llama_server is not None else (), chosen)
            keep_results(name, r, turn, share, rows, turns, shared)
        finally:
            peer_server.stop()

    print(f"\nconfig {config}, {dtype}, {threads} threads, prompts of ~{prompt_tokens} tokens, {new_tokens} new "
          f"tokens per client (greedy, streamed), {reps} repetitions; chat history ~{history_tokens} tokens\n")
    print(table(rows, api_rate, turns, shared))
    if len(designs) > 1 or ab_rounds > 1:
        print("\n" + ab_table(by_design))


if __name__ == "__main__":
    fire.Fire(main)
