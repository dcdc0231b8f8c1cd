"""The engine's host time per token: a decoding step of a tiny model split into its phases.

With a tiny model (dim 64, 2 layers, the demo's 4,096-token SentencePiece tokenizer) the
model's forward is a small part of a step, so what the engine does around it shows: the
plan (decisions, the scheduler's plan, grammar masks started), the staging of the step's
inputs (token ids, positions, block tables as tensors), the forward itself, sampling (the
choice and its one read of the chosen tokens), the update (the scheduler's record of what the
step did), detokenising (the requests' text assemblers) and the output (events to the
handles).  On a GPU the same host work runs while the device waits (BENCHMARKS.md "On a GPU":
1.1-1.5 ms a token outside the compiled step on an H200).

    python benchmarks/bench_host.py                                   # batches 1 and 8, eager and compiled
    python benchmarks/bench_host.py --modes eager --batches 1 --profile /tmp/host.prof   # cProfile of steps
    python benchmarks/bench_host.py --compare /tmp/base,. --clock cpu  # A/B of two source trees, interleaved
    python benchmarks/bench_host.py --ckpt /tmp/bench_peers/150m/meta --dtype bfloat16 --quantize int4 \
        --group_size 32 --modes compiled --batches 1 --gpu_paths false   # a real model, the CPU's own paths

With a real model (``--ckpt``: a Meta-format checkpoint directory with its tokenizer.model) the
host phases cost more than with the tiny one: the weights streamed through each forward pass
evict the code and data of what runs after it, so each torch operation outside the step (and
each Python function) starts cold.  On the 150m shape in int4 (Zen 4, 1 thread), sampling's
reductions after the step took 0.25-0.30 ms where they take ~0.05 ms warm; they now run inside
the compiled step (llama.engine.sampling.RowSummary).

Every number is the time of a decoding step (no prompt in it), in microseconds, wall time or
with ``--clock cpu`` this thread's CPU time (steadier on a machine busy with other work: torch
runs on this one thread): the median and the 10th-90th percentiles over every step of
``--rounds`` generations; a phase's time excludes the phases it calls (detokenising happens
inside the update, the forward inside the runner's call).  By default the host code of a GPU
runs (``--gpu_paths``: inputs through the staging buffers, sync-free sampling).  Wrapping the
phases costs about 1 us per wrapped call (~15 a step); the step's total is also timed without
the wrappers (*step, bare*), and as CPU time of this thread (*step CPU*).  *forward alone*: the
decoding step of the same shape called directly, without the engine.  ``--compare A,B`` runs
this script on the library of each source tree in turn (``--rounds`` alternations, each in a
fresh process) and prints each phase's median of A and B and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and "--lib" in sys.argv:  # the library of another source tree (--compare)
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--lib") + 1]).resolve()))
else:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

PHASES = ["plan", "staging", "forward", "sampling", "update", "detokenise", "output", "other"]
PARAMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64, norm_eps=1e-5, rope_theta=10000.0)


def write_checkpoint(out: Path, params: dict, seed: int = 0) -> Path:
    """A Meta-format checkpoint of seeded random float32 weights (unit-scale activations and
    logits) with the demo's tokenizer, in ``out``."""
    import shutil

    from llama import ModelArgs
    from llama.model import Transformer
    from llama.runtime import distributed

    tokenizer = REPO / "demo" / "tokenizer.model"
    vocab = json.loads((REPO / "demo" / "params.json").read_text())["vocab_size"]
    params = {**params, "vocab_size": vocab}
    distributed.init_model_parallel(torch.device("cpu"))
    with torch.device("meta"):
        model = Transformer(ModelArgs(**params))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        t = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif "tok_embeddings" not in name:
            t *= p.shape[-1] ** -0.5
        state[name] = t
    out.mkdir(parents=True, exist_ok=True)
    (out / "params.json").write_text(json.dumps(params))
    torch.save(state, out / "consolidated.00.pth")
    shutil.copyfile(tokenizer, out / "tokenizer.model")
    return out


# The name of a phase's range in a torch.profiler trace (PhaseClock(annotate=True)): PHASE_RANGE + phase
PHASE_RANGE = "llama.phase."


class PhaseClock:
    """Exclusive wall time per phase within one step: a wrapped call's time, less that of the
    wrapped calls inside it (which count to their own phase); ``clock``: wall time by default, or
    ``time.thread_time`` (this thread's CPU time).  ``annotate``: each call is also a range of a
    torch.profiler trace, named :data:`PHASE_RANGE` + its phase."""

    def __init__(self, annotate: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        self.totals: dict[str, float] = {}
        self.annotate = annotate
        self.clock = clock
        self._stack: list[list[Any]] = []  # [phase, start, time of the wrapped calls inside]

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            frame = [phase, self.clock(), 0.0]
            self._stack.append(frame)
            try:
                if self.annotate:
                    with torch.profiler.record_function(PHASE_RANGE + phase):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - frame[1]
                self._stack.pop()
                self.totals[phase] = self.totals.get(phase, 0.0) + elapsed - frame[2]
                if self._stack:
                    self._stack[-1][2] += elapsed

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def take(self) -> dict[str, float]:
        totals, self.totals = self.totals, {}
        return totals


@contextlib.contextmanager
def phases_wrapped(engine, clock: PhaseClock) -> Iterator[None]:
    """Each phase's methods of ``engine`` wrapped by ``clock`` (on the instances; the text
    assemblers' ``push`` on their class), unwrapped after."""
    from llama.engine.detokenize import TextAssembler

    where = {
        "plan": [(engine, "_apply"), (engine, "_sample_released"), (engine.scheduler, "decide"),
                 (engine.scheduler, "plan"), (engine.sampler, "forget_held"), (engine.sampler, "start_masks")],
        "staging": [(engine.runner, "run")],  # the runner's own work: its inputs as tensors
        "forward": [(engine.runner, "decode_step")],
        "sampling": [(engine, "_sample")],
        "update": [(engine.scheduler, "update_from_output")],
        "output": [(engine.output, "deliver")],
    }
    saved = []
    for phase, places in where.items():
        for obj, name in places:
            had = name in vars(obj)
            saved.append((obj, name, had, vars(obj).get(name)))
            setattr(obj, name, clock.wrap(phase, getattr(obj, name)))
    push = TextAssembler.push
    TextAssembler.push = clock.wrap("detokenise", push)  # type: ignore[method-assign]
    try:
        yield
    finally:
        TextAssembler.push = push  # type: ignore[method-assign]
        for obj, name, had, value in reversed(saved):
            if had:
                setattr(obj, name, value)
            else:
                delattr(obj, name)


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def as_on_a_gpu(engine) -> None:
    """The host code a GPU runs, on the CPU: step inputs written into staging buffers
    (unpinned here, copied at once) and sampling that never reads the device but once."""
    from llama.engine.staging import InputStaging

    engine.runner.use_staging(InputStaging(engine.runner.device, pin_memory=False, new_event=_NoEvent,
                                           copy=lambda dst, src: dst.copy_(src)))
    engine.sampler.sync_free = True


def run_generation(llama, batch: int, prompt_tokens: int, new_tokens: int, temperature: float, seed: int,
                   clock: Optional[PhaseClock], profiler: Optional[cProfile.Profile] = None) -> list[dict]:
    """``batch`` requests of ``new_tokens`` tokens each, driven step by step; per decoding step
    (one that feeds no prompt): its wall and thread CPU seconds, and with ``clock`` its phases'.
    Each step's events are taken from the handles after it (a streaming caller's reads; not
    timed)."""
    from llama.engine import RequestSettings

    engine = llama.engine
    g = torch.Generator().manual_seed(seed)
    settings = RequestSettings(max_new_tokens=new_tokens, temperature=temperature, seed=seed,
                               stop_tokens=frozenset())
    handles = [engine.submit(torch.randint(3, engine.n_decodable, (prompt_tokens,), generator=g).tolist(), settings)
               for _ in range(batch)]
    prefilling = [False]
    runner = engine.runner
    run, wrapped = runner.run, vars(runner).get("run")  # the phase clock's wrapper, if any

    def noting_prefill(plan):
        prefilling[0] = prefilling[0] or bool(plan.prefill)
        return run(plan)

    runner.run = noting_prefill
    steps = []
    try:
        while not all(h.finished for h in handles):
            prefilling[0] = False
            if clock is not None:
                clock.take()
            wall, cpu = time.perf_counter(), time.thread_time()
            if profiler is not None:
                profiler.enable()
            engine.step()
            if profiler is not None:
                profiler.disable()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            for h in handles:
                with engine.lock:
                    while h.ready and not h.finished:
                        if h.take_event() is None:
                            break
            if not prefilling[0]:
                step = {"step": wall, "cpu": cpu}
                if clock is not None:
                    phases = clock.take()
                    step.update(phases)
                    step["other"] = (cpu if clock.clock is time.thread_time else wall) - sum(phases.values())
                steps.append(step)
    finally:
        if wrapped is not None:
            runner.run = wrapped
        else:
            del runner.run
    for h in handles:
        result = h.result()
        if len(result.tokens) != new_tokens:
            raise RuntimeError(f"a request gave {len(result.tokens)} tokens, not {new_tokens}")
    return steps


def forward_alone(llama, batch: int, context: int, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` calls of the engine's decoding step alone (``batch`` rows at
    the scratch position attending to ``context`` positions, bucketed as a compiled step's)."""
    from llama.engine.runner import bucket

    runner = llama.engine.runner
    if runner.fixed_shape:
        batch, context = bucket(batch, runner.row_buckets), bucket(context, runner.context_buckets)
    tokens = torch.zeros((batch, 1), dtype=torch.long)
    positions = torch.full((batch, 1), runner.scratch, dtype=torch.long)
    table = runner.kv.block_table([None] * batch, runner.device)
    out = []
    with torch.inference_mode():
        for _ in range(3 + repeat):
            start = time.perf_counter()
            runner.decode_step(tokens, positions, context, runner.kv.cache, table)
            out.append(time.perf_counter() - start)
    return out[3:]


def summary(values: list[float]) -> dict:
    """Median and 10th/90th percentiles, in microseconds."""
    values = sorted(values)
    q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    return {"median": 1e6 * statistics.median(values), "p10": 1e6 * q[0], "p90": 1e6 * q[-1], "n": len(values)}


def measure(args) -> dict:
    """Every mode x batch: the phases of its decoding steps, the bare steps and the forward alone."""
    from llama import Llama
    from llama.runtime import host

    # One torch thread (--threads), set after the count the first model built would choose (small
    # tensors on several threads of a busy machine wait for each other: a 4,096-wide sum took 3 ms on 2)
    host.configure_cpu_threads()
    torch.set_num_threads(args.threads)
    params = PARAMS if args.ckpt is None else json.loads((Path(args.ckpt) / "params.json").read_text())
    report: dict = {"library": str(Path(sys.modules["llama"].__file__).parent), "torch": torch.__version__,
                    "params": params, "ckpt": args.ckpt, "dtype": args.dtype, "quantize": args.quantize,
                    "threads": args.threads, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                    "temperature": args.temperature, "rounds": args.rounds, "gpu_paths": args.gpu_paths,
                    "clock": args.clock, "rows": []}
    profiler = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp), PARAMS) if args.ckpt is None else Path(args.ckpt)
        for mode in args.modes:
            start = time.perf_counter()
            llama = Llama.build(ckpt, ckpt / "tokenizer.model", max_seq_len=args.max_seq_len,
                                max_batch_size=max(args.batches), device="cpu", dtype=args.dtype,
                                quantize=args.quantize, quantize_group_size=args.group_size,
                                compile=mode == "compiled")
            build_s = time.perf_counter() - start
            engine = llama.engine
            engine.runner.threads = None  # no thread tuning: --threads throughout
            torch.set_num_threads(args.threads)
            if args.gpu_paths:
                as_on_a_gpu(engine)
            clock = PhaseClock(clock=time.thread_time if args.clock == "cpu" else time.perf_counter)
            for batch in args.batches:
                run_generation(llama, batch, args.prompt_tokens, 4, args.temperature, 0, None)  # warm-up
                timed, bare = [], []
                for r in range(args.rounds):  # with and without the phase wrappers, alternately
                    with phases_wrapped(engine, clock):
                        timed += run_generation(llama, batch, args.prompt_tokens, args.new_tokens,
                                                args.temperature, 1 + r, clock)
                    bare += run_generation(llama, batch, args.prompt_tokens, args.new_tokens, args.temperature,
                                           1 + r, None, profiler)
                context = args.prompt_tokens + args.new_tokens // 2
                row = {"mode": mode, "batch": batch, "compiled": llama.compiled, "build_s": build_s,
                       "phases": {p: summary([s.get(p, 0.0) for s in timed]) for p in PHASES},
                       "step_wrapped": summary([s["step"] for s in timed]),
                       "step_bare": summary([s["step"] for s in bare]),
                       "step_cpu": summary([s["cpu"] for s in bare]),
                       "forward_alone": summary(forward_alone(llama, batch, context, args.forward_repeat))}
                report["rows"].append(row)
            del llama, engine
            torch._dynamo.reset()
    if profiler is not None:
        profiler.dump_stats(args.profile)
        report["profile"] = args.profile
    return report


def table(report: dict) -> list[str]:
    model = (f"tiny model ({report['params']['dim']} dim, {report['params']['n_layers']} layers, demo tokenizer)"
             if report.get("ckpt") is None else
             f"{report['ckpt']} ({report['params']['dim']} dim, {report['params']['n_layers']} layers)")
    precision = report.get("dtype", "float32") + (f" {report['quantize']}" if report.get("quantize") else "")
    threads = report.get("threads", 1)
    lines = [f"{model}, {precision} on the CPU, {threads} torch thread(s); {report['prompt_tokens']}-token prompts, "
             f"{report['new_tokens']} "
             f"new tokens, temperature {report['temperature']}, {report['rounds']} round(s); us per decoding step "
             f"({'CPU time of the thread' if report['clock'] == 'cpu' else 'wall time'}), median [p10-p90]",
             "| mode | batch | " + " | ".join(PHASES) + " | step (phases timed) | step, bare | step CPU | per token, "
             "bare | forward alone | host share |",
             "|---|---:|" + "---:|" * (len(PHASES) + 6)]

    def cell(s: dict) -> str:
        return f"{s['median']:.0f} [{s['p10']:.0f}-{s['p90']:.0f}]"

    for r in report["rows"]:
        bare, alone = r["step_bare"]["median"], r["forward_alone"]["median"]
        lines.append(f"| {r['mode']} | {r['batch']} | " + " | ".join(cell(r["phases"][p]) for p in PHASES)
                     + f" | {cell(r['step_wrapped'])} | {cell(r['step_bare'])} | {cell(r['step_cpu'])} "
                     f"| {bare / r['batch']:.0f} | {cell(r['forward_alone'])} | {max(0.0, 1 - alone / bare):.0%} |")
    return lines


def compare(args) -> dict:
    """``--compare A,B``: this script on each tree's library in turn, ``--rounds`` times each
    (one round per process, A and B alternating), the steps of every process pooled."""
    trees = [str(Path(t).resolve()) for t in args.compare]
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k, tree in enumerate(trees):
                out = Path(tmp) / f"{k}-{r}.json"
                cmd = [sys.executable, __file__, "--lib", tree, "--rounds", "1", "--json", str(out),
                       "--modes", ",".join(args.modes), "--batches", ",".join(map(str, args.batches)),
                       "--new_tokens", str(args.new_tokens), "--prompt_tokens", str(args.prompt_tokens),
                       "--temperature", str(args.temperature), "--max_seq_len", str(args.max_seq_len),
                       "--gpu_paths", str(args.gpu_paths), "--clock", args.clock, "--dtype", args.dtype,
                       "--threads", str(args.threads)] + (["--group_size", str(args.group_size)]
                                                          if args.group_size else [])
                cmd += (["--ckpt", args.ckpt] if args.ckpt else []) + (["--quantize", args.quantize]
                                                                       if args.quantize else [])
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": tree})
                runs[tree].append(json.loads(out.read_text()))
                print(f"round {r + 1}/{args.rounds}: {tree} done", file=sys.stderr, flush=True)
    names = PHASES + ["step_wrapped", "step_bare", "step_cpu", "forward_alone"]
    rows = []
    for i, row in enumerate(runs[trees[0]][0]["rows"]):
        medians = {}
        for tree in trees:
            # the median over the rounds' medians: each round is one process
            medians[tree] = {n: statistics.median((run["rows"][i]["phases"].get(n) or run["rows"][i][n])["median"]
                                                  for run in runs[tree]) for n in names}
        rows.append({"mode": row["mode"], "batch": row["batch"], "medians": medians})
    return {"trees": trees, "rounds": args.rounds, "rows": rows}


def compare_table(result: dict) -> list[str]:
    a, b = result["trees"]
    names = PHASES + ["step_wrapped", "step_bare", "step_cpu", "forward_alone"]
    lines = [f"A = {a}, B = {b}; us per decoding step, the median of {result['rounds']} processes' medians each, "
             "A and B interleaved", "| mode | batch | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for r in result["rows"]:
        cells = [f"{r['medians'][a][n]:.0f} / {r['medians'][b][n]:.0f} ({r['medians'][b][n] / r['medians'][a][n]:.2f})"
                 if r["medians"][a][n] else f"{r['medians'][a][n]:.0f} / {r['medians'][b][n]:.0f}" for n in names]
        lines.append(f"| {r['mode']} | {r['batch']} | " + " | ".join(cells) + " |")
    return lines


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    def ints(t: str) -> list[int]:
        return [int(x) for x in t.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 8], help="requests decoded together (default 1,8)")
    p.add_argument("--modes", type=lambda t: [x for x in t.split(",") if x], default=["eager", "compiled"],
                   help="eager and/or compiled (default both)")
    p.add_argument("--prompt_tokens", type=int, default=32, help="prompt tokens per request (default %(default)s)")
    p.add_argument("--new_tokens", type=int, default=128, help="tokens generated per request (default %(default)s)")
    p.add_argument("--max_seq_len", type=int, default=512, help="the KV cache's length (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as the GPU checks (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="generations timed per mode and batch (default %(default)s)")
    p.add_argument("--forward_repeat", type=int, default=200, help="calls of the forward alone (default %(default)s)")
    p.add_argument("--gpu_paths", type=lambda t: t.lower() in ("1", "true", "yes"), default=True,
                   help="run the host code a GPU runs: inputs through staging buffers, sampling without reading "
                   "the device (default true; false: the CPU's own paths)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="what the phases are timed by: wall time, or this thread's CPU time (steadier on a machine "
                   "busy with other work; default %(default)s)")
    p.add_argument("--ckpt", default=None, help="a Meta-format checkpoint directory (default: the tiny random model)")
    p.add_argument("--dtype", default="float32", help="the model's dtype (default %(default)s)")
    p.add_argument("--quantize", default=None, help="int8, w8a8 or int4 (default: none)")
    p.add_argument("--group_size", type=int, default=None, help="int4's group (default: the library's)")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default %(default)s)")
    p.add_argument("--profile", default=None, help="write a cProfile of the bare steps here, and print its top")
    p.add_argument("--json", default=None, help="write the report here too")
    p.add_argument("--compare", type=lambda t: t.split(","), default=None,
                   help="A,B: two source trees, timed in turn (--rounds processes each)")
    p.add_argument("--lib", default=None, help="import llama from this source tree (what --compare passes)")
    args = p.parse_args(argv)
    if any(m not in ("eager", "compiled") for m in args.modes):
        p.error(f"--modes: eager and/or compiled, got {args.modes}")
    if args.compare is not None and len(args.compare) != 2:
        p.error("--compare takes two source trees: A,B")
    if args.prompt_tokens + args.new_tokens > args.max_seq_len:
        p.error("--prompt_tokens + --new_tokens must fit in --max_seq_len")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.compare:
        result = compare(args)
        lines = compare_table(result)
    else:
        result = measure(args)
        lines = table(result)
    print("\n".join(lines))
    if args.profile and not args.compare:
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(40)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
