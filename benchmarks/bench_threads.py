"""How many CPU threads should a process use by default: decoding speed at each thread setting,
on a quiet machine and beside one competing CPU-bound process.

    python benchmarks/bench_threads.py                       # demo model and the 150m shape, 3 rounds
    python benchmarks/bench_threads.py --models demo --rounds 5 --tokens 100

Each measurement is a fresh process that builds the model as a user does (``Llama.build`` on a
Meta checkpoint, the CPU's default dtype, batch 1), completes one prompt as a warm-up, then
times greedy completions of 1 and ``tokens + 1`` new tokens after the same prompt: decode
tokens/s = tokens / (difference).  End-of-text never stops it early (the stop tokens are
cleared).  Settings, each in its own process's environment:

  1 thread          LLAMA_NUM_THREADS=1
  2 threads         LLAMA_NUM_THREADS=2 (what a 2-CPU machine gave by default before)
  2 threads passive LLAMA_NUM_THREADS=2 and OMP_WAIT_POLICY=PASSIVE (idle OpenMP workers
                    sleep instead of spinning)
  2 threads short spin  LLAMA_NUM_THREADS=2 and GOMP_SPINCOUNT=10000 (they spin 10,000 times,
                    not GNU OpenMP's default 300,000, before sleeping)
  default           nothing set: what the library chooses (a thread count by the CPUs it may
                    use, then tuned by timing decoding steps: llama.engine.cpu_threads)

"busy": one other process spins on a CPU (``while True: pass``) for the whole measurement.
Rounds interleave the conditions and rotate the order of the settings; the table gives the
median [min-max] over rounds and each setting's median divided by the better of the 1- and
2-thread medians in the same condition; "threads": the count(s) the processes ended on.  Check
``/proc/pressure/cpu`` before and after: the "quiet" rows are only quiet if nothing else runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

SETTINGS = {
    "1 thread": {"LLAMA_NUM_THREADS": "1"},
    "2 threads": {"LLAMA_NUM_THREADS": "2"},
    "2 threads passive": {"LLAMA_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "2 threads short spin": {"LLAMA_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"},
    "default": {},
}
# Variables a setting may set: removed from every process's environment first, so that only
# the setting's own reach it.
_THREAD_VARIABLES = ("LLAMA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def worker(ckpt_dir: str, tokens: int) -> None:
    """One measurement (in a fresh process): prints ``RESULT {json}``."""
    import torch

    from llama import Llama

    llama = Llama.build(ckpt_dir, str(Path(ckpt_dir) / "tokenizer.model"), max_seq_len=tokens + 64,
                        max_batch_size=1, device="cpu")
    llama.tokenizer.stop_tokens = frozenset()  # always generate the full length
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)

    def run(n: int) -> float:
        start = time.perf_counter()
        llama.generate([prompt], max_gen_len=n, temperature=0.0)
        return time.perf_counter() - start

    run(tokens + 1)  # warm-up
    one, many = run(1), run(tokens + 1)
    tuner = llama.engine.runner.threads  # the library's own choice, where it tunes the count
    threads = tuner.current if tuner is not None else torch.get_num_threads()
    print("RESULT " + json.dumps({"tok_s": tokens / (many - one), "threads": threads}), flush=True)


def _measure(ckpt_dir: Path, setting: str, tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARIABLES}
    env.update(SETTINGS[setting])
    proc = subprocess.run([sys.executable, __file__, "worker", str(ckpt_dir), str(tokens)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{setting} on {ckpt_dir} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _checkpoint(model: str, work: Path) -> Path:
    if model == "demo":
        return REPO / "demo"
    import peers

    return peers.write_checkpoint(model, "float32", work / model, silent_specials=True)


def _pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "unavailable"


def main(models: str = "demo,150m", rounds: int = 3, tokens: int = 100, work: str = "/tmp/bench_threads") -> None:
    model_names = [m.strip() for m in str(models).split(",") if m.strip()]
    checkpoints = {m: _checkpoint(m, Path(work)) for m in model_names}
    print(f"CPU pressure before: {_pressure()}", flush=True)
    results: dict[tuple[str, str, str], list[float]] = {}
    threads_used: dict[tuple[str, str, str], set[int]] = {}
    names = list(SETTINGS)
    for r in range(rounds):
        for condition in ("quiet", "busy"):
            competitor = None
            if condition == "busy":
                competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                time.sleep(0.5)
            try:
                for model, ckpt in checkpoints.items():
                    order = names[r % len(names):] + names[: r % len(names)]
                    for setting in order:
                        res = _measure(ckpt, setting, tokens)
                        results.setdefault((model, condition, setting), []).append(res["tok_s"])
                        threads_used.setdefault((model, condition, setting), set()).add(res["threads"])
                        print(f"round {r + 1} {condition:5} {model:5} {setting:20} {res['tok_s']:8.1f} tok/s "
                              f"({res['threads']} thread(s))", flush=True)
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    print(f"CPU pressure after: {_pressure()}\n")
    print(f"Decode tokens/s, batch 1, {tokens} new tokens, median [min-max] over {rounds} rounds; "
          "ratio: the median over the better of the 1- and 2-thread medians\n")
    print("| model | condition | setting | threads | tok/s | ratio |")
    print("|---|---|---|---:|---:|---:|")
    for model in model_names:
        for condition in ("quiet", "busy"):
            best = max(statistics.median(results[(model, condition, s)]) for s in ("1 thread", "2 threads"))
            for setting in names:
                runs = results[(model, condition, setting)]
                med = statistics.median(runs)
                used = "/".join(str(t) for t in sorted(threads_used[(model, condition, setting)]))
                print(f"| {model} | {condition} | {setting} | {used} | "
                      f"{med:.1f} [{min(runs):.1f}-{max(runs):.1f}] | {med / best:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        fire.Fire(main)
