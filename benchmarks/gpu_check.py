"""The GPU checks: correct logits and decoding speed on one CUDA device, in plans that each fit
one command of a short GPU lease (at most 10 minutes a command, 15 in all, start-up included).

    python benchmarks/gpu_check.py --plan first --deadline_s 420               # the first lease: 6-8 min on an H100
    python benchmarks/gpu_check.py --plan batch                                  # batches of 1, 8, 32
    python benchmarks/gpu_check.py --plan serve                                  # llama.serve, 32 clients
    python benchmarks/gpu_check.py --plan paged                                  # reading the paged KV cache
    python benchmarks/gpu_check.py --plan profile                                # where a step and a token go
    python benchmarks/gpu_check.py --plan speculative --deadline_s 420           # speculative decoding, batch 1
    python benchmarks/gpu_check.py --parts parity,decode --variants bf16         # any parts and variants
    python benchmarks/gpu_check.py --device cpu --config tiny --plan all         # a dry run on the CPU (CI)

Plans (``--plan``; ``--parts`` and the variant flags override what a plan chooses):
  first   imports and a bandwidth probe; parity of bf16 (eager, compiled), int8 and int4 (eager,
          compiled) on a 2-layer model of the 8B's widths; batch-1 decoding of the 8B shape
          compiled in bf16, int8 and int4; then the bf16, int8 and int4 products of the 8B's
          matrices timed alone (kernels).  Estimated 6-8 minutes on one H100, not yet run on one:
          writing the random 8B checkpoint (16 GB) to /dev/shm ~30 s and loading it 3 x ~15 s;
          compiling 3 two-layer models x 2 shapes (rows 1 and 2) and 3 eight-billion models x 2
          shapes (rows 1; contexts 256 and 512), where an H100 took 83-110 s for a 4-layer model
          of 30 shapes (BENCHMARKS.md); the CPU float32 reference ~40 s, overlapped with the
          GPU's work; timed decoding ~10 s a variant; the products alone ~30 s.  Run it with
          ``--deadline_s 420``: no variant starts after 7 minutes (one under way still finishes).
  batch   tok/s at batch 1, 8 and 32, compiled bf16, int8, int4 (each compiles rows 1 and 2..32).
  serve   ``python -m llama.serve`` on the 8B checkpoint with 32 concurrent streaming clients.
  paged   the ways of reading the paged KV cache, one 8B attention layer.
  profile batch-1 decoding of the 8B shape compiled in bf16, int8 and int4 again (decode), and where
          each one's step and token go (profile), sharing the builds.  Estimated 4.5-6 minutes on
          one H100: the decode part took 231 s on an H200 (the checkpoint written, 3 variants
          loaded and compiled in 40-66 s each); the profile part adds ~10 s a variant (3 + 20
          steps alone and 53 + 20 engine steps of ~6 ms, the profiler's start and its trace's
          parsing, a few seconds each).  Not in ``first``: it would make that plan ~7.6 minutes,
          past the 420-s deadline its command runs under, which would drop the kernels part.
  speculative
          batch-1 decoding of the 8B shape compiled in bf16, without speculation and with each
          proposer of ``benchmarks/bench_speculative.py``'s table (a Llama 3.2 1B-shaped draft for
          the draft rows), interleaved.  Estimated 4-6 minutes on one H100, not yet run on one:
          writing the random 8B checkpoint ~30 s and the 1B draft's ~5 s (none where an earlier
          plan of the same lease left them in /dev/shm); loading the 8B ~15 s and the draft ~3 s;
          compiling: the decode part's bf16 build took 66 s on an H200 for 2 shapes (rows 1;
          contexts 256 and 512), and the verification step adds one more compiled graph of 8
          shapes (k = 1..4 proposals x the 2 contexts) as CUDA graphs, about as long again
          (the CPU's measured share, runner.VERIFY_COMPILE_SHARE): ~2-2.5 min in all; replies
          settled ~5 s; measuring ~1 min (3 rounds x 7 runs of 129 + 1 tokens at ~6 ms a token,
          the draft rows' steps up to ~5x that while the rule tries them).  ``--deadline_s 420``
          stops after the round under way.
  all     every part (more than one command's 10 minutes on an H100: for a longer lease).

Every part writes the report (``--json``) and appends its table to ``--tables`` the moment it
ends, and the JSON is rewritten after each variant too, so a run stopped later keeps what it
measured; ``--deadline_s`` stops starting new variants and parts once that many seconds have
passed (recorded as not run), so that a plan ends inside the command's time limit.  Compile
times are logged (``llama.engine.runner``, INFO).  Every process the checks start (the CPU
reference, the server) ends with them: on exit, on SIGTERM/SIGINT/SIGHUP, and (Linux) when
the checks' process is killed outright.

Parts (each recorded on its own: one that fails is written down and the others still run):
  parity  logits of one set of random weights (the 8B's widths, ``--parity_layers`` layers, so the
          float32 reference fits on the CPU) on the CPU in float32 against the device's bfloat16
          eager and compiled steps, int8 and int4 (eager and compiled): prompt logits and
          teacher-forced decoding steps (``--parity_rows`` rows, 2 by default).  Each variant is
          held to two bounds: against float32 with exactly its own weights (the int8/int4 weights
          expanded by their formula: the kernel's error) and against the float32 model (what
          quantisation costs).
  decode  batch 1 on the 8B shape (dim 4096, 32 layers, 32/8 heads, FFN 14336, 128,256 tokens),
          each variant through ``Llama.generate``: tok/s, and the share of the device's memory
          bandwidth (measured here by a device-to-device copy) it reaches: weight bytes a decoding
          step reads / bandwidth / step time.  Also the step alone (CUDA events, no engine).
  batch   tok/s at batch 1, 8 and 32 (``--batch_variants``).
  profile for each decode variant (``--decode_variants``), batch 1: the compiled decoding step alone,
          then (separately) the engine's steps around it, ``--profile_steps`` of each under
          torch.profiler, their kernels' device time by group (products, attention,
          norms+elementwise, sampling, copies, other: by kernel name; sampling is what the
          engine's sampler launches) with each group's share and the top kernels; and the host's
          time per token by the engine's phases (``benchmarks/bench_host.py``'s: plan, input
          staging, forward, sampling, update, detokenise, output) over ``--host_steps`` steps
          without the profiler, with the GPU's idle time per token (a step's wall time less its
          kernels').  On the CPU (a dry run) operators' self CPU time stands for the kernels'.
  serve   ``python -m llama.serve`` on the same checkpoint (``--max_batch_size 32``) with 32
          concurrent streaming clients: aggregate tok/s, time to first token and inter-token
          latency p50/p99.
  paged   reading the paged KV cache, one attention layer of the shape (``benchmarks/bench_paged.py``):
          the engine's gather against rows kept contiguous and FlexAttention over the pool, eager
          and compiled, at 1, 8 and 32 rows of 1,024 and 4,096 positions: which is fastest here
          (three compilations per size).
  kernels the products of one 8B layer's matrices and the output matrix timed alone at 1, 8 and
          32 rows (``benchmarks/bench_int8.py``): bf16 ``F.linear``, int8 through the library's
          Triton kernel and through the ways it replaced (torch's ``_weight_int8pack_mm``, the
          weight converted to bf16 per call), int4 through torch's kernel; GB/s of weight read.
  speculative
          batch 1 on the 8B shape (``--spec_variant``, default bf16-compiled), built as a user
          builds it with ``speculative={"method": "draft", "draft_ckpt_dir": ..., "num_tokens":
          --spec_tokens}`` (the engine's rules and compiled verification step) with a random draft
          of Llama 3.2 1B's shape (dim 2048, 16 layers; the tiny config: dim 64, 1 layer) and the
          same tokenizer, eager as the engine runs drafts: decode tok/s without speculation and
          with each row's proposer, interleaved (``bench_speculative.measure``), acceptance and
          speed-up.  Random weights neither quote their prompt nor repeat themselves (the 150m
          shape's greedy reply to a prompt holding that reply already: 0 of 32 tokens the same), so
          acceptance is set by the proposer, not found: (a) the engine's n-gram proposer on a
          prompt that quotes itself (P, its reply R, P again: it proposes R, which the model does
          not repeat: what looking costs where it finds nothing true), (b) always right (the
          greedy reply replayed: the upper bound), (c) always wrong (what speculating costs),
          (p) each proposal right with probability 0.7 (~44 % of 4 accepted, the demo's n-gram
          rate), (d) the draft's own proposals (a random draft is never right: what the rule
          makes of a draft that does not pay), (e) the draft's forwards with proposals right
          with probability 0.88 (~73 % of 4, llama.cpp's 1B drafting 8B): the draft pair's speed.

Prints a table per part and the targets beside the results, and writes everything to JSON
(``--json``).  The random 8B checkpoint (bfloat16, 16 GB, Meta's real Llama 3 tokenizer from the
llama-models package, a test requirement) is drawn on the device and written once under
``--workdir``, then reused.  The output rows of the special tokens are zero, so greedy decoding
never emits an end-of-text token and every generation has the length asked for.  Exit status: 0
when every part ran and every parity bound held, 1 otherwise; without CUDA (and no ``--device
cpu``) it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

LLAMA3_VOCAB = 128256
SPECIAL_TOKENS_START = 128000  # Llama 3's special tokens are ids 128000..128255
CONFIGS = {
    # Llama 3 8B's shape: FFN int(1.3 * int(8 * 4096 / 3)) rounded up to 1024 = 14336; 8.03B parameters.
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
               norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True),
    # For the dry run: FFN 768, which int4's groups of 128 divide.
    "tiny": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=128, norm_eps=1e-5, rope_theta=500000.0),
}
# The work each part does, per config: the 8b's are each plan's on one H100 (most of it loading
# and compiling); the tiny's check the script on a CPU.  The server's KV cache is
# the in-process one's (32 rows of 512 positions), so its compiled steps of 1, 8 and 32 rows have
# the shapes compiled before, which Inductor's on-disk cache can serve.
SIZES = {
    "8b": dict(parity_prompt=32, parity_steps=16, prompt_tokens=32, new_tokens=128, max_seq_len=512, reps=3,
               step_repeat=50, batches=[1, 8, 32], clients=32, serve_prompt_tokens=128, serve_tokens=128,
               serve_max_seq_len=512, serve_reps=2, paged_rows=[1, 8, 32], paged_contexts=[1024, 4096],
               paged_reps=20, paged_rounds=3, paged_flex=True, kernel_rows=[1, 8, 32],
               kernel_repeat=20, profile_steps=20, host_steps=50),
    "tiny": dict(parity_prompt=8, parity_steps=4, prompt_tokens=8, new_tokens=8, max_seq_len=64, reps=1,
                 step_repeat=3, batches=[1, 8, 32], clients=8, serve_prompt_tokens=16, serve_tokens=8,
                 serve_max_seq_len=64, serve_reps=1, paged_rows=[1, 2], paged_contexts=[64], paged_reps=2,
                 paged_rounds=1, paged_flex=False, kernel_rows=[1, 2],
                 kernel_repeat=2, profile_steps=2, host_steps=4),
}
PARTS = ("parity", "decode", "batch", "profile", "serve", "paged", "kernels", "speculative")
# The parts that share one build of each variant of the full shape (run_speed)
SPEED_PARTS = ("decode", "batch", "profile")
# The speculative part's draft for each config: Llama 3.2 1B's shape (its tokenizer is Llama 3's,
# the draft people use for Llama 3.1 8B), and for the dry run a smaller one than tiny.
DRAFT_CONFIGS = {
    "8b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True),
    "tiny": dict(dim=64, n_layers=1, n_heads=1, n_kv_heads=1, multiple_of=64, norm_eps=1e-5, rope_theta=500000.0),
}
# bench_speculative.ROWS's, in the order measured (see the speculative part in the docstring)
SPEC_ROWS = ["a", "b", "c", "p", "d", "e"]
# name -> Llama.build options (dtype is bfloat16 for all: int8/int4 activations too)
VARIANTS = {
    "bf16": dict(quantize=None, compile=False),
    "bf16-compiled": dict(quantize=None, compile=True),
    "int8": dict(quantize="int8", compile=False),
    "int8-compiled": dict(quantize="int8", compile=True),
    "int4": dict(quantize="int4", compile=False),
    "int4-compiled": dict(quantize="int4", compile=True),
}
COMPILED = ["bf16-compiled", "int8-compiled", "int4-compiled"]  # as Llama.build runs on CUDA by default
# Each plan is one command of a GPU lease (see the module docstring for their estimated times):
# its parts, in the order they run, and the variants of those parts.
PLANS = {
    "first": dict(parts=["parity", "decode", "kernels"], variants=list(VARIANTS), decode_variants=COMPILED),
    "batch": dict(parts=["batch"], batch_variants=COMPILED),
    "serve": dict(parts=["serve"]),
    "paged": dict(parts=["paged"]),
    # the decoding rates again, then where each compiled variant's step and token go (sharing the builds)
    "profile": dict(parts=["decode", "profile"], decode_variants=COMPILED),
    # batch-1 decoding with and without speculation, compiled bf16 (bench_speculative's rows)
    "speculative": dict(parts=["speculative"]),
    "all": dict(parts=list(PARTS)),
}

# Parity bounds: relative error ||logits - reference|| / ||reference|| over every position, and
# the share of positions whose top-1 token is the reference's.
#  - Against float32 with the variant's own weights (its kernels' error): every variant computes
#    in bfloat16 (int8/int4 kernels take bfloat16 activations), so each product and each residual
#    add rounds to 2**-8 relative.  Measured on a CPU with the 8b widths and 2 layers: 0.0065-0.0077
#    for bf16, int8 and int4 alike (tiny shape, compiled steps too: 0.003-0.008).  3% leaves room
#    for more layers and the GPU's own summation orders, and still fails a wrong kernel (~100%).
#  - Top-1: a random model's logits are near-flat (the best two of 128,000 unit-scale logits are
#    ~0.2 apart), so rounding alone flips some positions (measured 0.88-1.00); a wrong kernel
#    agrees on ~0.
#  - Against the float32 model (what quantisation costs on random weights, the worst case: no
#    outliers, every bit of spread matters): measured 0.018 for int8's per-row scales and 0.187 for
#    int4's groups of 128 (8b widths, 2 layers); the bounds leave room for 4 layers, and a broken
#    quantiser gives ~100%.
KERNEL_REL_ERR = 0.03
KERNEL_TOP1 = 0.8
QUANTISED_REL_ERR = {None: 0.03, "int8": 0.08, "int4": 0.40}

# Speed targets on the 8B shape, batch 1, compiled (as ``Llama.build`` runs on CUDA by default).
TARGET_BANDWIDTH_SHARE = 0.75
TARGET_SPEEDUP = {"int8": 1.6, "int4": 2.5}
# The engine reads the paged KV cache by gathering each row's blocks (compiled, as on CUDA by
# default): kept while FlexAttention over the pool, which reads the blocks where they are, is not
# more than 10% faster at any size measured (flex / gather >= 0.9).  Rows kept contiguous are the
# bound, not a candidate: they need a second copy of every running request's keys and values.
TARGET_PAGED_READ = 0.9
# Speculative decoding never costs more than 5 % against none (issue 41), whatever the proposer.
TARGET_SPECULATION_COST = 0.95


# -- device helpers --------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of ``fn()``, with the device's queued work finished before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def device_seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Seconds per call of ``fn`` run ``repeat`` times back to back: CUDA events around the
    calls on a GPU (the device's own time, launch gaps included), the wall clock on the CPU."""
    if device.type != "cuda":
        return timed(lambda: [fn() for _ in range(repeat)], device) / repeat
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synchronize(device)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def copy_bandwidth(device: torch.device, mib: int, repeat: int = 10) -> float:
    """Bytes/s of a device-to-device copy of ``mib`` MiB (each byte read once and written once:
    2 x size per copy), the best of ``repeat``; far larger than the caches."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(device_seconds(lambda: dst.copy_(src), device, 1) for _ in range(repeat))
    return 2 * src.numel() / best


def free_memory(device: torch.device) -> None:
    """Release what the last variant held: its tensors, compiled graphs and CUDA graph pools."""
    gc.collect()
    if "torch._dynamo" in sys.modules:  # (nothing was compiled otherwise: importing it takes seconds)
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(name=props.name, cuda=torch.version.cuda, memory_gib=round(total / 2**30, 1),
                    free_gib_at_start=round(free / 2**30, 1), capability=f"{props.major}.{props.minor}")
    return info


# -- the processes the checks start ---------------------------------------------------------------

_children: list = []  # objects with stop(): what stop_children() ends


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start ``cmd`` in a process group of its own that ends with the checks: stop_children()
    at exit or on a signal, and SIGTERM from the kernel if this process is killed outright."""
    from bench_serve import die_with_parent

    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent, **kwargs)
    _children.append(_Child(proc))
    return proc


class _Child:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def stop(self) -> None:
        from bench_serve import stop_process_group

        stop_process_group(self.proc, grace_s=10)


def stop_children() -> None:
    """End every process the checks started and that still runs."""
    while _children:
        _children.pop().stop()


# -- the random checkpoint -------------------------------------------------------------------------


def write_checkpoint(out: Path, params: dict, device: torch.device, seed: int = 0) -> tuple[Path, float]:
    """A Meta-format checkpoint of seeded random bfloat16 weights (params.json, consolidated.00.pth,
    Llama 3's tokenizer.model) in ``out``, drawn on ``device`` tensor by tensor (an 8B model is
    8 billion normal draws: seconds on a GPU, minutes in one CPU thread).  Scales as bench.py's:
    unit-variance embeddings, norm gains near 1, linear weights 1/sqrt(fan-in) (unit-scale
    activations and logits).  Reused when ``out`` already holds one of the same params.json.
    Returns (directory, seconds spent writing, 0 when reused)."""
    from common import llama3_tokenizer
    from llama import ModelArgs
    from llama.model import Transformer
    from llama.runtime import distributed

    params = {**params, "vocab_size": LLAMA3_VOCAB}
    shard = out / "consolidated.00.pth"
    if shard.is_file() and (out / "tokenizer.model").is_file() and \
            json.loads((out / "params.json").read_text()) == params:
        return out, 0.0
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    distributed.init_model_parallel(device)  # the layers' shapes need it; the device's backend, as the runs will
    with torch.device("meta"):
        model = Transformer(ModelArgs(**params))
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        t = torch.randn(p.shape, generator=g, device=device)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif "tok_embeddings" not in name:
            t *= p.shape[-1] ** -0.5
        if name == "output.weight":
            t[SPECIAL_TOKENS_START:] = 0  # logit 0 against a best of ~4: greedy never ends early
        state[name] = t.to(torch.bfloat16).cpu()
        del t
    (out / "params.json").write_text(json.dumps(params))
    shutil.copyfile(llama3_tokenizer().model_path, out / "tokenizer.model")
    # renamed once complete: an interrupted run is not reused
    torch.save(state, out / "consolidated.00.pth.partial")
    (out / "consolidated.00.pth.partial").rename(shard)
    return out, time.perf_counter() - start


def build(ckpt: Path, variant: str, device: torch.device, max_seq_len: int, max_batch_size: int,
          group_size: int, speculative: Optional[dict] = None):
    """``Llama.build`` of ``variant`` (see :data:`VARIANTS`), as a user runs it (``speculative``:
    as ``Llama.build`` takes it)."""
    from llama import Llama

    options = VARIANTS[variant]
    if options["compile"]:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # a fresh compilation: no step of an earlier model, no recompile limit
        counters.clear()  # compile_counters() from here on
    llama = Llama.build(ckpt, ckpt / "tokenizer.model", max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                        device=str(device), dtype="bfloat16", quantize=options["quantize"],
                        quantize_group_size=group_size if options["quantize"] == "int4" else None,
                        compile=options["compile"], speculative=speculative)
    llama.tokenizer.stop_tokens = frozenset()  # always the full length (the weights never pick one anyway)
    return llama


def compile_counters() -> dict:
    """What dynamo and Inductor did since the last reset: graphs compiled, graph breaks, and
    CUDA graphs Inductor declined to record (each a step that runs without them)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


# -- part 1: parity --------------------------------------------------------------------------------


def expanded(weight: torch.Tensor, quantize: str, group_size: int) -> torch.Tensor:
    """``weight`` quantised to int8 / int4 and expanded back by the formula of
    :mod:`llama.layers.quantize`: the exact weight the quantised kernels multiply by."""
    from llama.layers.quantize import quantize_groups_int4, quantize_rows_int8

    if quantize == "int8":
        q, scale = quantize_rows_int8(weight)
        return q.float() * scale[:, None]
    codes, scale, zero = quantize_groups_int4(weight, group_size)
    out_f, in_f = codes.shape
    groups = (codes.reshape(out_f, -1, group_size).float() - 8) * scale[..., None] + zero[..., None]
    return groups.reshape(out_f, in_f)


def reference_main(ckpt: str, tokens_file: str, out_file: str, max_seq_len: str, group_size: str) -> int:
    """The child process of :class:`Reference`: float32 logits (B, T, V) of every position on
    the CPU, with the float weights ("float32") and with each quantisation's weights expanded."""
    from llama import Llama
    from llama.layers.packed import unpack_weights_
    from llama.layers.parallel import DenseWeight

    job = torch.load(tokens_file, weights_only=True)
    ckpt_dir = Path(ckpt)
    ref = Llama.build(ckpt_dir, ckpt_dir / "tokenizer.model", max_seq_len=int(max_seq_len),
                      max_batch_size=job["tokens"].shape[0], device="cpu", dtype="float32", compile=False)
    unpack_weights_(ref.model)  # plain weights, changed in place below
    layers = [m for m in ref.model.modules() if isinstance(m, DenseWeight)]
    originals = [m.weight.detach().clone() for m in layers]
    out = {"float32": ref.model.forward(job["tokens"], 0)}
    with torch.no_grad():
        for quantize in job["quantize"]:
            for layer, weight in zip(layers, originals):
                layer.weight.copy_(expanded(weight, quantize, int(group_size)))
            out[quantize] = ref.model.forward(job["tokens"], 0)
    torch.save(out, out_file)
    return 0


class Reference:
    """The float32 CPU reference of the parity part, computed by a process of its own while the
    device runs the variants: float32 logits (B, T, V) of ``tokens`` at every position, on the
    CPU, by name: "float32" with the checkpoint's weights and "int8" / "int4" with those weights
    quantised and expanded back.  A process of its own because a process's torch.distributed
    group has one backend (nccl for CUDA, gloo for the CPU) and ``Llama.build`` refuses a model
    on the other kind of device; it runs on half the CPUs, leaving the others to compiling."""

    def __init__(self, ckpt: Path, tokens: torch.Tensor, max_seq_len: int, quantize: list[str], group_size: int,
                 workdir: Path) -> None:
        self.started = time.perf_counter()
        tokens_file, self.out_file = workdir / "parity-tokens.pt", workdir / "parity-reference.pt"
        self.out_file.unlink(missing_ok=True)
        torch.save({"tokens": tokens, "quantize": quantize}, tokens_file)
        threads = str(max(1, (os.cpu_count() or 2) // 2))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.log = workdir / "parity-reference.log"
        with self.log.open("w") as log:
            self.proc = spawn([sys.executable, str(Path(__file__).resolve()), "_reference", str(ckpt), str(tokens_file),
                               str(self.out_file), str(max_seq_len), str(group_size)], env=env, stdout=log,
                              stderr=subprocess.STDOUT)

    def result(self) -> dict[str, torch.Tensor]:
        """The logits, once the process has ended (a RuntimeError with its output's end if it failed)."""
        code = self.proc.wait()
        self.seconds = time.perf_counter() - self.started
        if code != 0:
            raise RuntimeError(f"the CPU float32 reference failed (exit {code}):\n{self.log.read_text()[-3000:]}")
        return torch.load(self.out_file, weights_only=True)


def variant_logits(llama, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits (B, T, V) float32 on the CPU: the prompt's in one prefill pass, then each later
    position by the engine's own decoding step (compiled where the variant is), fed the given
    tokens (teacher forcing, so every variant sees the same sequence), on the engine's cache,
    with the step's arguments made as ``ModelRunner`` makes them."""
    runner, model = llama.engine.runner, llama.model
    device = model.device
    rows, total = tokens.shape
    cache = runner.kv.cache
    with torch.inference_mode():  # the step's inputs made in it, as the runner's (guards see the difference)
        table = runner.kv.whole_sequences(rows, device)
        prompt = tokens[:, :prompt_len].to(device)
        positions = torch.arange(prompt_len, device=device).expand(rows, prompt_len)
        hidden = model.hidden_states(prompt, positions, prompt_len, cache, from_start=True, block_table=table)
        out = [model.logits(hidden).cpu()]
        for pos in range(prompt_len, total):
            kv_len = runner.max_seq_len if runner.fixed_shape else pos + 1
            # (a column of ``tokens`` copied in inference mode and contiguous, as the runner makes a
            # step's inputs: a compiled step's guards check both, and a view would compile another graph)
            column = tokens[:, pos : pos + 1].to(device, copy=True, memory_format=torch.contiguous_format)
            logits = runner.decode_step(column, torch.full((rows, 1), pos, device=device), kv_len, cache, table)
            out.append(logits.float().cpu().unsqueeze(1))  # copied at once: a CUDA graph reuses its output
    return torch.cat(out, dim=1)


def compare(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return {"rel_err": rel(logits, reference), "top1": top1}


def run_parity(args, device: torch.device, report: "Report", deadline: "Deadline") -> dict:
    params = {**CONFIGS[args.config], "n_layers": min(args.parity_layers, CONFIGS[args.config]["n_layers"])}
    ckpt, write_s = write_checkpoint(Path(args.workdir) / f"{args.config}-parity", params, device, seed=1)
    rows_n, prompt_len, steps = args.parity_rows, args.parity_prompt, args.parity_steps
    max_seq_len = prompt_len + steps + 8
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SPECIAL_TOKENS_START, (rows_n, prompt_len + steps), generator=g)
    out = {"layers": params["n_layers"], "sequences": rows_n, "prompt_tokens": prompt_len, "decode_steps": steps,
           "rows": [],
           "checkpoint_write_s": write_s,
           "bounds": {"kernel_rel_err": KERNEL_REL_ERR, "kernel_top1": KERNEL_TOP1,
                      "rel_err_vs_float32": {str(k): v for k, v in QUANTISED_REL_ERR.items()}}}
    quantize = sorted({VARIANTS[v]["quantize"] for v in args.variants} - {None})
    reference = Reference(ckpt, tokens, max_seq_len, quantize, args.int4_group_size, Path(args.workdir))
    logits_of = {}
    for variant in args.variants:  # the device's logits, while the reference computes its own
        row = {"variant": variant}
        out["rows"].append(row)
        if deadline.passed():
            row.update(passed=False, skipped=NOT_RUN)
            continue
        try:
            start = time.perf_counter()
            llama = build(ckpt, variant, device, max_seq_len, rows_n, args.int4_group_size)
            row["build_s"] = time.perf_counter() - start
            logits_of[variant] = variant_logits(llama, tokens, prompt_len)
            row["compiled"] = llama.compiled  # False after a fallback to eager
            if VARIANTS[variant]["compile"]:
                row.update(compile_counters())
            del llama
        except Exception as e:  # recorded; the next variant still runs
            row.update(passed=False, error=_error(e))
        free_memory(device)
        report.part_progress("parity", out)
    references = reference.result()
    out["reference_s"] = reference.seconds
    for row in out["rows"]:
        logits = logits_of.get(row["variant"])
        if logits is None:
            continue
        quantize = VARIANTS[row["variant"]]["quantize"]
        own, full = references[quantize or "float32"], references["float32"]
        parts = {"prefill": slice(0, prompt_len), "decode": slice(prompt_len, None)}
        for name, cut in parts.items():
            k = compare(logits[:, cut], own[:, cut])
            row[f"{name}_rel_err"], row[f"{name}_top1"] = k["rel_err"], k["top1"]
        against_float = compare(logits, full)
        row["rel_err_vs_float32"], row["top1_vs_float32"] = against_float["rel_err"], against_float["top1"]
        row["passed"] = bool(
            all(row[f"{p}_rel_err"] <= KERNEL_REL_ERR and row[f"{p}_top1"] >= KERNEL_TOP1 for p in parts)
            and row["rel_err_vs_float32"] <= QUANTISED_REL_ERR[quantize]
            and row["compiled"] == VARIANTS[row["variant"]]["compile"])
    ran = [r for r in out["rows"] if "skipped" not in r]
    out["passed"] = all(r["passed"] for r in ran) if ran else None
    return out


# -- parts 2 and 3: decoding speed -----------------------------------------------------------------


def decode_rate(llama, batch: int, prompt_len: int, new_tokens: int, reps: int) -> dict:
    """Tokens/s of ``Llama.generate`` (greedy) on ``batch`` prompts: batch x N / (time of N + 1
    new tokens - time of 1), medians over ``reps``, after a warm-up that compiles what it must."""
    device = llama.model.device
    g = torch.Generator().manual_seed(7 + batch)
    prompts = torch.randint(0, SPECIAL_TOKENS_START, (batch, prompt_len), generator=g).tolist()

    def generate(n: int) -> None:
        out, _ = llama.generate(prompts, max_gen_len=n, temperature=0)
        if any(len(o) != n for o in out):
            raise RuntimeError(f"asked for {n} tokens per row, got {[len(o) for o in out]}")

    warm = timed(lambda: generate(new_tokens + 1), device)
    generate(1)
    steps = []
    for _ in range(reps):
        long = timed(lambda: generate(new_tokens + 1), device)
        short = timed(lambda: generate(1), device)
        steps.append((long - short) / new_tokens)
    step = statistics.median(steps)
    return {"batch": batch, "tok_s": batch / step, "ms_per_step": 1e3 * step, "warmup_s": warm,
            "step_ms_range": [1e3 * min(steps), 1e3 * max(steps)]}


def step_alone(llama, batch: int, context: int, repeat: int) -> float:
    """Seconds of the engine's decoding step alone (no scheduling, sampling or host work around
    it), ``batch`` rows at the cache's scratch position (the slot padding uses, so the engine's
    cached prompts stay intact), attending to ``context`` slots (rounded up to the rows and
    context buckets of a compiled step, as the engine runs it)."""
    from llama.engine.runner import bucket

    runner = llama.engine.runner
    device = llama.model.device
    if runner.fixed_shape:
        batch, kv_len = bucket(batch, runner.row_buckets), bucket(context, runner.context_buckets)
    else:
        kv_len = context
    # made in inference mode, as the runner makes a step's inputs: a compiled step's guards check
    # that, and inputs made outside it would compile another graph
    with torch.inference_mode():
        tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
        positions = torch.full((batch, 1), runner.scratch, dtype=torch.long, device=device)
        table = runner.kv.block_table([None] * batch, device)  # padding rows: the scratch block

    def step():
        with torch.inference_mode():
            runner.decode_step(tokens, positions, kv_len, runner.kv.cache, table)

    for _ in range(3):
        step()
    return device_seconds(step, device, repeat)


def run_speed(args, device: torch.device, parts: set, bandwidth: float, report: "Report",
              deadline: "Deadline") -> dict:
    """Parts decode, batch and profile, sharing one build of each variant on the full shape
    (its loading and compiling counted in the first of them that runs it)."""
    from common import decode_weight_bytes

    ckpt, write_s = write_checkpoint(Path(args.workdir) / args.config, CONFIGS[args.config], device, seed=0)
    decode = {"rows": [], "checkpoint_write_s": write_s, "bandwidth_bytes_per_s": bandwidth,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "max_seq_len": args.max_seq_len}
    batch = {"rows": [], "batches": args.batches}
    profile = {"rows": [], "prompt_tokens": args.prompt_tokens, "profile_steps": args.profile_steps,
               "host_steps": args.host_steps, "context": args.prompt_tokens + args.new_tokens}
    in_decode = [v for v in args.decode_variants] if "decode" in parts else []
    in_batch = [v for v in args.batch_variants] if "batch" in parts else []
    in_profile = [v for v in args.decode_variants] if "profile" in parts else []
    wanted = [v for v in VARIANTS if v in in_decode or v in in_batch or v in in_profile]
    decode["seconds"] = batch["seconds"] = profile["seconds"] = 0.0
    outs = (("decode", decode, in_decode), ("batch", batch, in_batch), ("profile", profile, in_profile))

    def progress() -> None:
        for part, out, _ in outs:
            if part in parts:
                report.part_progress(part, out)

    for variant in wanted:
        first = next(out for _, out, variants in outs if variant in variants)  # where its build counts
        if deadline.passed():
            for part, out, variants in outs:
                if variant in variants:
                    out["rows"].append({"variant": variant, "skipped": NOT_RUN})
            continue
        start = time.perf_counter()
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # rows for the batch part's sizes only where it runs this variant: a compiled step is made
            # for every row count up to the engine's batch (on CUDA, a CUDA graph each), which the
            # batch-1 parts never use
            max_batch = max(args.batches) if variant in in_batch else 1
            llama = build(ckpt, variant, device, args.max_seq_len, max_batch, args.int4_group_size)
            load_s = time.perf_counter() - start
            weight_bytes = decode_weight_bytes(llama.model)
        except Exception as e:
            for _, out, variants in outs:
                if variant in variants:
                    out["rows"].append({"variant": variant, "error": _error(e)})
            free_memory(device)
            first["seconds"] += time.perf_counter() - start
            progress()
            continue
        if variant in in_decode:
            row = {"variant": variant, "load_s": load_s, "weight_bytes": weight_bytes}
            try:
                row.update(decode_rate(llama, 1, args.prompt_tokens, args.new_tokens, args.reps))
                row["bandwidth_share"] = weight_bytes / bandwidth / (row["ms_per_step"] / 1e3)
                alone = step_alone(llama, 1, args.prompt_tokens + args.new_tokens, args.step_repeat)
                row["step_alone_ms"] = 1e3 * alone
                row["step_alone_bandwidth_share"] = weight_bytes / bandwidth / alone
                row["compiled"] = llama.compiled
                if VARIANTS[variant]["compile"]:
                    row.update(compile_counters())
                if device.type == "cuda":
                    row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            except Exception as e:
                row["error"] = _error(e)
            decode["rows"].append(row)
        first["seconds"] += time.perf_counter() - start  # the build counts there
        start = time.perf_counter()
        if variant in in_profile:
            row = {"variant": variant, "compiled": llama.compiled}
            try:
                row.update(profile_variant(llama, args))
            except Exception as e:
                row["error"] = _error(e)
            profile["rows"].append(row)
            profile["seconds"] += time.perf_counter() - start
            start = time.perf_counter()
        if variant in in_batch:
            for b in args.batches:
                try:
                    batch["rows"].append({"variant": variant, **decode_rate(llama, b, args.prompt_tokens,
                                                                            args.new_tokens, args.reps)})
                except Exception as e:
                    batch["rows"].append({"variant": variant, "batch": b, "error": _error(e)})
        del llama
        free_memory(device)
        batch["seconds"] += time.perf_counter() - start
        progress()
    return {"decode": decode, "batch": batch, "profile": profile}


# -- part 4: where a step's time goes --------------------------------------------------------------

# The groups of a step's kernels (on the CPU: its operators), by name; "sampling" is what the
# engine's sampler launches (its calls' range in the trace), whatever the kernel
KERNEL_GROUPS = ("products", "attention", "norms+elementwise", "sampling", "copies", "other")
_PRODUCTS = re.compile(r"gemm|gemv|nvjet|cublas|cutlass|xmma|tinygemm|int8_mm|int8pack|int4pack|add_splits|"
                       r"splitk(?!v)|matmul|linear|(^|_)(add|b)?mm(_|$)|^aten::(mm|addmm|bmm|_weight_int\w*)$", re.I)
_ATTENTION = re.compile(r"attention|attn|flash|fmha|sdpa|softmax|flex", re.I)
_COPIES = re.compile(r"memcpy|memset|copy|^aten::(cat|fill_|zero_|clone)$|index|gather|scatter", re.I)
_ELEMENTWISE = re.compile(r"^triton_(poi|red|per)_|elementwise|reduce_kernel|norm|rsqrt|^aten::", re.I)


def kernel_group(name: str, phase: Optional[str] = None) -> str:
    """The group of :data:`KERNEL_GROUPS` of a kernel (or CPU operator) called ``name``, launched
    in the engine's phase ``phase`` (None: outside the engine's phases, or not known)."""
    if phase == "sampling":
        return "sampling"
    if _ATTENTION.search(name):
        return "attention"
    if _PRODUCTS.search(name):
        return "products"
    if name.startswith("triton_"):  # Inductor's fused kernels (norms, RoPE, residual adds...)
        return "norms+elementwise"
    if _COPIES.search(name):
        return "copies"
    if _ELEMENTWISE.search(name):
        return "norms+elementwise"
    return "other"


def _phase_of(event) -> Optional[str]:
    """The engine phase whose range (bench_host.PhaseClock's) holds a profiler event."""
    from bench_host import PHASE_RANGE

    while event is not None:
        if event.name.startswith(PHASE_RANGE):
            return event.name[len(PHASE_RANGE):]
        event = event.cpu_parent
    return None


def profiled_groups(prof, device: torch.device, steps: int, top: int = 12) -> dict:
    """A torch.profiler trace of ``steps`` steps by :data:`KERNEL_GROUPS`: on a GPU each kernel's
    (and copy's) device time, on the CPU each operator's self CPU time; us per step by group, their
    total, and the ``top`` kernels by time (name, group, us and calls per step)."""
    from torch.autograd import DeviceType

    from bench_host import PHASE_RANGE

    events = prof.events()
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if device.type == "cuda":
        phases = {e.id: _phase_of(e) for e in cpu}  # a CPU event's id is its correlation id
        timed = [(e.name, e.time_range.elapsed_us(), phases.get(getattr(e, "linked_correlation_id", 0)))
                 for e in events if e.device_type == DeviceType.CUDA]
    else:
        timed = [(e.name, e.self_cpu_time_total, _phase_of(e)) for e in cpu if not e.name.startswith(PHASE_RANGE)]
    groups = dict.fromkeys(KERNEL_GROUPS, 0.0)
    by_name: dict[tuple[str, str], list[float]] = {}
    for name, us, phase in timed:
        group = kernel_group(name, phase)
        groups[group] += us / steps
        entry = by_name.setdefault((name, group), [0.0, 0])
        entry[0] += us / steps
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"groups_us": groups, "total_us": sum(groups.values()),
            "top": [{"name": name[:160], "group": group, "us": us, "calls": calls / steps}
                    for (name, group), (us, calls) in ranked]}


def _profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def profile_variant(llama, args) -> dict:
    """Where batch-1 decoding's time goes (the profile part): the compiled decoding step alone
    (``args.profile_steps`` steps under torch.profiler, at the context of the decode part's middle
    token) and, separately, the engine's steps around it (as many, one request, its phases
    annotated), by kernel group; and the host's time per token, phase by phase, over
    ``args.host_steps`` engine steps without the profiler (bench_host.py's phases: on a GPU the
    sampling phase holds the wait for the step's tokens, the other phases run while the GPU
    idles).  *GPU idle per token*: a step's wall time less the device time of its kernels."""
    from bench_host import PHASES, PhaseClock, phases_wrapped
    from llama.engine import RequestSettings
    from llama.engine.runner import bucket

    device = llama.model.device
    engine, runner = llama.engine, llama.engine.runner
    context = args.prompt_tokens + args.new_tokens // 2
    rows, kv_len = (1, bucket(context, runner.context_buckets)) if runner.fixed_shape else (1, context)
    with torch.inference_mode():  # as step_alone's (another graph otherwise)
        tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        positions = torch.full((rows, 1), runner.scratch, dtype=torch.long, device=device)
        table = runner.kv.block_table([None] * rows, device)

    def step() -> None:
        with torch.inference_mode():
            runner.decode_step(tokens, positions, kv_len, runner.kv.cache, table)

    for _ in range(3):
        step()
    synchronize(device)
    with _profiler(device) as prof:
        for _ in range(args.profile_steps):
            step()
        synchronize(device)
    out: dict = {"step_alone": profiled_groups(prof, device, args.profile_steps)}

    # One request long enough for every step measured below; its prompt and first tokens first
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, SPECIAL_TOKENS_START, (args.prompt_tokens,), generator=g).tolist()
    settings = RequestSettings(max_new_tokens=3 + args.host_steps + args.profile_steps + 3, temperature=0,
                               stop_tokens=frozenset())
    handle = engine.submit(prompt, settings)
    for _ in range(3):
        engine.step()
    clock = PhaseClock()
    walls, phases = [], []
    with phases_wrapped(engine, clock):
        for _ in range(args.host_steps):
            clock.take()
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            taken = clock.take()
            taken["other"] = walls[-1] - sum(taken.values())
            phases.append(taken)
    synchronize(device)
    with phases_wrapped(engine, PhaseClock(annotate=True)), _profiler(device) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        synchronize(device)
    out["engine_step"] = profiled_groups(prof, device, args.profile_steps)
    handle.cancel()
    while not handle.finished:
        engine.step()
    token_us = 1e6 * statistics.median(walls)
    busy = out["engine_step"]["total_us"] if device.type == "cuda" else None
    out["host"] = {"phases_us": {p: 1e6 * statistics.median([s.get(p, 0.0) for s in phases]) for p in PHASES},
                   "token_us": token_us, "gpu_busy_us": busy, "gpu_idle_us": None if busy is None else token_us - busy}
    return out


# -- part 5: the server ----------------------------------------------------------------------------


def run_serve(args, device: torch.device, report: "Report", deadline: "Deadline") -> dict:
    from bench_serve import ServerProcess, concurrent, free_port, percentile, prompts_for
    from llama.tokenizer import load_tokenizer

    free_memory(device)  # the GPU for the server alone
    ckpt, write_s = write_checkpoint(Path(args.workdir) / args.config, CONFIGS[args.config], device, seed=0)
    tokenizer = load_tokenizer(ckpt / "tokenizer.model")
    prompts = prompts_for(tokenizer, args.clients, args.serve_prompt_tokens)
    port = free_port()
    cmd = [sys.executable, "-m", "llama.serve", "--ckpt_dir", str(ckpt), "--port", str(port),
           "--device", str(device), "--dtype", "bfloat16", "--max_batch_size", str(args.clients),
           "--max_seq_len", str(args.serve_max_seq_len), "--model_name", "gpu-check"]
    if args.serve_compile is not None:
        cmd.append("--compile" if args.serve_compile else "--no-compile")
    log = Path(args.workdir) / "serve.log"
    out = {"clients": args.clients, "prompt_tokens": args.serve_prompt_tokens, "new_tokens": args.serve_tokens,
           "max_seq_len": args.serve_max_seq_len, "command": " ".join(cmd[1:]), "log": str(log),
           "checkpoint_write_s": write_s}
    start = time.perf_counter()
    server = ServerProcess("llama.serve", cmd, port, torch.get_num_threads(), log, hide_gpus=False)
    _children.append(server)  # stopped on a signal too
    try:
        server.wait_ready("/health", timeout=900)
        out["startup_s"] = time.perf_counter() - start
        # Warm-up: 1, 2, 4 ... clients at once reach every row count a compiled step is made for
        # (powers of two), so that no compilation lands in the measured run.
        start = time.perf_counter()
        n = 1
        while True:
            asyncio.run(concurrent(server.url, "gpu-check", prompts[:n], 4))
            if n >= args.clients:
                break
            n = min(2 * n, args.clients)
        out["warmup_s"] = time.perf_counter() - start
        ttft, itl, rates, short = [], [], [], 0
        for _ in range(args.serve_reps):
            wall, runs = asyncio.run(concurrent(server.url, "gpu-check", prompts, args.serve_tokens))
            rates.append(sum(r.tokens for r in runs) / wall)
            short += sum(r.tokens < args.serve_tokens for r in runs)
            ttft += [r.ttft for r in runs]
            itl += [x for r in runs for x in r.itl]
        if short:
            raise RuntimeError(f"{short} streams ended before {args.serve_tokens} tokens")
        out.update(tok_s=statistics.median(rates), ttft_p50_ms=1e3 * percentile(ttft, 50),
                   ttft_p99_ms=1e3 * percentile(ttft, 99), itl_p50_ms=1e3 * percentile(itl, 50),
                   itl_p99_ms=1e3 * percentile(itl, 99), streams=len(ttft))
    finally:
        server.stop()
        _children.remove(server)
    return out


def run_paged(args, device: torch.device, report: "Report", deadline: "Deadline") -> dict:
    import bench_paged

    params = CONFIGS[args.config]
    heads = (params["n_heads"], params["n_kv_heads"], params["dim"] // params["n_heads"])
    torch._dynamo.config.recompile_limit = 64  # one graph per (rows, context), as bench_paged.py does
    rows = []
    for n_rows in args.paged_rows:
        for context in args.paged_contexts:
            if deadline.passed():
                rows.append({"rows": n_rows, "context": context, "variant": f"{n_rows} x {context}",
                             "skipped": NOT_RUN})
                continue
            try:
                times = bench_paged.measure(heads, n_rows, context, torch.bfloat16, device, args.paged_reps,
                                            args.paged_rounds, flex=args.paged_flex)
            except Exception as e:  # recorded; the other sizes still run
                rows.append({"rows": n_rows, "context": context, "variant": f"{n_rows} x {context}",
                             "error": _error(e)})
                continue
            ms = {name: statistics.median(t) for name, t in times.items() if t is not None}
            fastest = min(ms, key=ms.get)
            flex = ms.get("flex compiled")
            rows.append({"rows": n_rows, "context": context, "ms": ms, "fails_to_compile": sorted(set(times) - set(ms)),
                         "fastest": fastest, "fastest_over_gather": ms[fastest] / ms["gather"],
                         "flex_over_gather": None if flex is None or "gather compiled" not in ms
                         else flex / ms["gather compiled"]})
            report.part_progress("paged", {"rows": rows})
    return {"heads": heads, "block_size": bench_paged.BLOCK, "reps": args.paged_reps, "rounds": args.paged_rounds,
            "rows": rows}


# -- part 7: the products alone --------------------------------------------------------------------


def layer_matrices(config: str, device: torch.device) -> dict[str, tuple[int, int]]:
    """(out, in) of the matrices a decoding step multiplies by, one layer's (the products that
    read the same input fused, as the library runs them) and the output's, for ``config``."""
    from llama import ModelArgs
    from llama.model import Transformer
    from llama.runtime import distributed

    distributed.init_model_parallel(device)
    with torch.device("meta"):
        model = Transformer(ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB))
    attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
    dim = attention.wq.weight.shape[1]
    return {"wq|wk|wv": (sum(getattr(attention, w).weight.shape[0] for w in ("wq", "wk", "wv")), dim),
            "wo": tuple(attention.wo.weight.shape), "w1|w3": (2 * ffn.w1.weight.shape[0], dim),
            "w2": tuple(ffn.w2.weight.shape), "output": tuple(model.output.weight.shape)}


def run_kernels(args, device: torch.device, report: "Report", deadline: "Deadline") -> dict:
    """Each product of :func:`layer_matrices` alone, at ``args.kernel_rows`` rows, through
    ``benchmarks/bench_int8.py``'s benchmark: the int8 weight through the library's Triton
    kernel and through the two ways it replaced on CUDA (torch's ``_weight_int8pack_mm``; the
    weight converted to bf16 per call, then cuBLAS), a bf16 weight (``dense``) and int4
    (torch's kernel); ms per call (CUDA-graph replays under CUDA events, weights cycled
    through copies several times the L2 cache) and GB/s of weight read."""
    import bench_int8

    rows_out = []
    for name, shape in layer_matrices(args.config, device).items():
        if deadline.passed():
            rows_out.append({"matrix": name, "skipped": NOT_RUN})
            continue
        rows_out += bench_int8.benchmark_int8_kernels(device, {name: shape}, tuple(args.kernel_rows),
                                                      repeat=args.kernel_repeat, int4_group_size=args.int4_group_size)
        report.part_progress("kernels", {"rows": rows_out})
        free_memory(device)
    return {"rows": rows_out}


# -- part 8: speculative decoding ------------------------------------------------------------------


def run_speculative(args, device: torch.device, report: "Report", deadline: "Deadline") -> dict:
    """Batch-1 decoding of the full shape with and without speculation (see the module's
    docstring): one build of ``--spec_variant`` speculating with a random draft of
    :data:`DRAFT_CONFIGS`' shape, the rows of ``--spec_rows`` measured by
    ``bench_speculative.measure`` (``--reps`` interleaved rounds of ``--new_tokens``) on one
    prompt that quotes itself: ``--prompt_tokens`` random tokens, the model's greedy reply to
    them (``--new_tokens``), the same tokens again."""
    import bench_speculative
    from llama.engine.speculative import NgramProposer

    ckpt, write_s = write_checkpoint(Path(args.workdir) / args.config, CONFIGS[args.config], device, seed=0)
    draft_ckpt, draft_write_s = write_checkpoint(Path(args.workdir) / f"{args.config}-draft",
                                                 DRAFT_CONFIGS[args.config], device, seed=2)
    k = args.spec_tokens
    # the quoting prompt (2 x prompt + reply), then a reply of new_tokens + 1 with k proposed after it
    max_seq_len = max(args.max_seq_len, 2 * args.prompt_tokens + 2 * args.new_tokens + k + 8)
    out: dict = {"variant": args.spec_variant, "k": k, "prompt_tokens": args.prompt_tokens,
                 "new_tokens": args.new_tokens, "max_seq_len": max_seq_len, "reps": args.reps, "rows": [],
                 "right": args.spec_right, "draft_right": args.spec_draft_right, "checkpoint_write_s": write_s,
                 "draft_checkpoint_write_s": draft_write_s}
    if deadline.passed():
        out["rows"] = [{"row": row, "variant": row, "skipped": NOT_RUN} for row in args.spec_rows]
        return out
    start = time.perf_counter()
    speculative = {"method": "draft", "draft_ckpt_dir": str(draft_ckpt), "num_tokens": k}
    llama = build(ckpt, args.spec_variant, device, max_seq_len, 1, args.int4_group_size, speculative=speculative)
    out["build_s"] = time.perf_counter() - start
    out["compiled"] = llama.compiled
    if VARIANTS[args.spec_variant]["compile"]:
        out.update(compile_counters())
    out["verified_shapes"] = [list(shape) for shape in sorted(llama.engine.runner.verify_shapes)]
    engine = llama.engine
    draft = engine.speculator.proposer
    out["draft"] = {"dim": draft.model.params.dim, "n_layers": draft.model.params.n_layers}  # what was loaded
    g = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, min(SPECIAL_TOKENS_START, engine.n_decodable), (args.prompt_tokens,),
                           generator=g).tolist()
    reply = bench_speculative.generate(engine, [prompt], args.new_tokens, speculative=False)[0]
    prompts = [prompt + reply + prompt]
    report.part_progress("speculative", out)
    measured = bench_speculative.measure(engine, prompts, args.spec_rows, [1], args.new_tokens, args.reps,
                                         ngram=NgramProposer(), draft=draft,
                                         right=args.spec_right, draft_right=args.spec_draft_right,
                                         stop=deadline.passed, label="speculative")
    out.update(settle_runs=measured["settle_runs"][1], prepared_s=measured["prepared_s"],
               measured_s=measured["measured_s"], rounds=measured["rounds"])
    none = measured["batches"][1]["none"]
    out["none_tok_s"] = statistics.median(none) if none else None
    for row in args.spec_rows:
        m = measured["batches"][1][row]
        entry = {"row": row, "variant": row, "proposer": bench_speculative.ROWS[row], "rates": m["rates"],
                 "none_rates": none, "proposed": m["proposed"], "accepted": m["accepted"],
                 "acceptance": m["accepted"] / m["proposed"] if m["proposed"] else None}
        if m["rates"]:
            entry.update(tok_s=statistics.median(m["rates"]),
                         speedup=statistics.median([r / n for r, n in zip(m["rates"], none)]))
        else:
            entry["skipped"] = NOT_RUN
        out["rows"].append(entry)
    del llama, engine, draft
    free_memory(device)
    return out


PART_RUNNERS = {"parity": run_parity, "serve": run_serve, "paged": run_paged, "kernels": run_kernels,
                "speculative": run_speculative}


# -- the report ------------------------------------------------------------------------------------


def _error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


def _f(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def targets(report: dict) -> list[dict]:
    """The targets, each with the value measured (None where its part did not run)."""
    rows = {r["variant"]: r for r in report["parts"].get("decode", {}).get("rows", []) if "tok_s" in r}
    bf16 = rows.get("bf16-compiled")
    out = [{"name": "bf16 compiled, batch 1: share of measured bandwidth", "target": TARGET_BANDWIDTH_SHARE,
            "value": bf16["bandwidth_share"] if bf16 else None}]
    for q, want in TARGET_SPEEDUP.items():
        row = rows.get(f"{q}-compiled")
        out.append({"name": f"{q} compiled / bf16 compiled tok/s, batch 1", "target": want,
                    "value": row["tok_s"] / bf16["tok_s"] if row and bf16 else None})
    parity = report["parts"].get("parity", {})
    out.append({"name": "parity bounds held by every variant", "target": True,
                "value": parity.get("passed") if parity.get("status") == "ok" else None})
    paged = [r["flex_over_gather"] for r in report["parts"].get("paged", {}).get("rows", [])
             if r.get("flex_over_gather") is not None]
    out.append({"name": "paged KV reads: FlexAttention / the engine's gather (compiled), its best size",
                "target": TARGET_PAGED_READ, "value": min(paged) if paged else None})
    speedups = [r["speedup"] for r in report["parts"].get("speculative", {}).get("rows", []) if "speedup" in r]
    out.append({"name": "speculative decoding, batch 1: its slowest row / none (never more than 5 % slower)",
                "target": TARGET_SPECULATION_COST, "value": min(speedups) if speedups else None})
    for t in out:
        t["met"] = None if t["value"] is None else (t["value"] is True if t["target"] is True
                                                     else t["value"] >= t["target"])
    return out


def _failed_row(r: dict, columns: int) -> str:
    why = r.get("skipped") or (f"error: {r['error'].splitlines()[-1][:120]}" if "error" in r else "not measured")
    return f"| {r['variant']} | {why} |" + " |" * (columns - 2)


def parity_table(part: dict, config: str) -> list[str]:
    lines = [f"{part['layers']} layers of the {config} shape, {part.get('sequences', 2)} row(s), "
             f"{part['prompt_tokens']} prompt tokens then "
             f"{part['decode_steps']} decoding steps; reference: CPU float32 with the variant's own weights (kernel) "
             "and with the float weights (float32)",
             f"bounds: kernel rel. err <= {KERNEL_REL_ERR}, kernel top-1 >= {KERNEL_TOP1}; rel. err vs float32 <= "
             + ", ".join(f"{bound} ({q or 'bf16'})" for q, bound in QUANTISED_REL_ERR.items()),
             "| variant | prefill rel. err | prefill top-1 | decode rel. err | decode top-1 | rel. err vs float32 "
             "| top-1 vs float32 | passed |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in part["rows"]:
        lines.append(_failed_row(r, 8) if "error" in r or "skipped" in r or "prefill_rel_err" not in r else
                     f"| {r['variant']} | {r['prefill_rel_err']:.4f} | {r['prefill_top1']:.2f} | "
                     f"{r['decode_rel_err']:.4f} | {r['decode_top1']:.2f} | {r['rel_err_vs_float32']:.4f} | "
                     f"{r['top1_vs_float32']:.2f} | {'yes' if r['passed'] else 'NO'} |")
    return lines


def decode_table(part: dict, config: str) -> list[str]:
    lines = [f"batch 1, {part['prompt_tokens']}-token prompts, {part['new_tokens']} new tokens, max_seq_len "
             f"{part['max_seq_len']}; % bandwidth = weight bytes a step reads / measured bandwidth / step time",
             "| variant | tok/s | ms/token | % bandwidth | step alone ms | % bandwidth (step alone) | weights GiB "
             "| peak GiB | load s | first generate s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in part["rows"]:
        if "tok_s" not in r:
            lines.append(_failed_row(r, 10))
            continue
        lines.append(f"| {r['variant']} | {r['tok_s']:.1f} | {r['ms_per_step']:.2f} | {100 * r['bandwidth_share']:.0f} "
                     f"| {_f(r.get('step_alone_ms'), '.2f')} | {_f(r.get('step_alone_bandwidth_share'), '.0f', 100)} "
                     f"| {r['weight_bytes'] / 2**30:.2f} | {_f(r.get('peak_memory_bytes'), '.1f', 2**-30)} "
                     f"| {r['load_s']:.0f} | {r['warmup_s']:.0f} |")
    compiled = [f"{r['variant']}: {r['graphs']} graph(s), {r['graph_breaks']} graph break(s), "
                f"{r['cudagraph_skips']} CUDA graph skip(s){'' if r['compiled'] else ', FELL BACK TO EAGER'}"
                for r in part["rows"] if "graphs" in r]
    return lines + (["compiled: " + "; ".join(compiled)] if compiled else [])


def batch_table(part: dict, config: str) -> list[str]:
    lines = ["| variant | batch | tok/s | ms/step |", "|---|---:|---:|---:|"]
    for r in part["rows"]:
        lines.append(f"| {r['variant']} | {r['batch']} | {r['tok_s']:.1f} | {r['ms_per_step']:.2f} |" if "tok_s" in r
                     else _failed_row({**r, "variant": f"{r['variant']} | {r.get('batch', '-')}"}, 3))
    return lines


def serve_table(part: dict, config: str) -> list[str]:
    return [f"python {part['command']}",
            f"{part['clients']} concurrent streaming clients, ~{part['prompt_tokens']}-token prompts, "
            f"{part['new_tokens']} new tokens each (greedy), {part['streams']} streams; server up in "
            f"{part['startup_s']:.0f} s, warm-up {part['warmup_s']:.0f} s",
            "| aggregate tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |", "|---:|---:|---:|---:|---:|",
            f"| {part['tok_s']:.1f} | {part['ttft_p50_ms']:.0f} | {part['ttft_p99_ms']:.0f} | {part['itl_p50_ms']:.1f} "
            f"| {part['itl_p99_ms']:.1f} |"]


def paged_table(part: dict, config: str) -> list[str]:
    names = ["gather", "contiguous", "gather compiled", "contiguous compiled", "flex compiled"]
    h, hkv, d = part["heads"]
    lines = [f"one {config} attention layer ({h} query heads, {hkv} K/V heads, head dim {d}), one new token per row, "
             f"blocks of {part['block_size']} scattered through the pool; ms per call, median of {part['rounds']} "
             f"round(s) of {part['reps']} calls",
             "| rows | context | " + " | ".join(names) + " | fastest | fastest / gather | flex / gather, compiled |",
             "|---:|---:|" + "---:|" * len(names) + "---|---:|---:|"]
    for r in part["rows"]:
        if "error" in r or "skipped" in r:
            why = r.get("skipped") or f"error: {r['error'].splitlines()[-1][:120]}"
            lines.append(f"| {r['rows']} | {r['context']} | {why} |")
            continue
        cells = [f"{r['ms'][n]:.3f}" if n in r["ms"] else ("fails to compile" if n in r["fails_to_compile"] else "-")
                 for n in names]
        lines.append(f"| {r['rows']} | {r['context']} | " + " | ".join(cells)
                     + f" | {r['fastest']} | {r['fastest_over_gather']:.2f} | {_f(r['flex_over_gather'], '.2f')} |")
    return lines


def profile_table(part: dict, config: str) -> list[str]:
    from bench_host import PHASES

    gpu = any(r.get("host", {}).get("gpu_busy_us") is not None for r in part["rows"])
    unit = "device us per step (share)" if gpu else "self CPU us per step (share; a dry run: operators, not kernels)"
    lines = [f"batch 1, the decoding step alone and the engine's step around it, {part['profile_steps']} "
             f"steps each under torch.profiler; {unit}; groups by kernel name",
             "| variant | what | " + " | ".join(KERNEL_GROUPS) + " | total |",
             "|---|---|" + "---:|" * (len(KERNEL_GROUPS) + 1)]
    for r in part["rows"]:
        if "step_alone" not in r:
            lines.append(_failed_row(r, len(KERNEL_GROUPS) + 3))
            continue
        for what, key in (("step alone", "step_alone"), ("engine step", "engine_step")):
            p = r[key]
            total = p["total_us"] or 1.0
            lines.append(f"| {r['variant']} | {what} | " + " | ".join(
                f"{p['groups_us'][g]:.0f} ({100 * p['groups_us'][g] / total:.0f}%)" for g in KERNEL_GROUPS)
                + f" | {p['total_us']:.0f} |")
    lines += ["", "the top kernels of the step alone: us per step (calls per step)",
              "| variant | kernel | group | us | share |", "|---|---|---|---:|---:|"]
    for r in part["rows"]:
        if "step_alone" in r:
            total = r["step_alone"]["total_us"] or 1.0
            lines += [f"| {r['variant']} | `{k['name'][:90]}` | {k['group']} | {k['us']:.1f} ({k['calls']:g}) "
                      f"| {100 * k['us'] / total:.1f}% |" for k in r["step_alone"]["top"][:8]]
    lines += ["", f"the host's time per token (batch 1), median of {part['host_steps']} engine steps, us by phase "
              "(bench_host.py's; the sampling phase holds the wait for the step's tokens)",
              "| variant | " + " | ".join(PHASES) + " | token | GPU busy | GPU idle |",
              "|---|" + "---:|" * (len(PHASES) + 3)]
    for r in part["rows"]:
        if "host" in r:
            h = r["host"]
            lines.append(f"| {r['variant']} | " + " | ".join(f"{h['phases_us'][p]:.0f}" for p in PHASES)
                         + f" | {h['token_us']:.0f} | {_f(h['gpu_busy_us'], '.0f')} | {_f(h['gpu_idle_us'], '.0f')} |")
    return lines


KERNELS = ["dense", "triton", "materialised", "int8pack_mm", "int4"]  # bench_int8's names, in the table's order


def kernels_table(part: dict, config: str) -> list[str]:
    names = {"dense": "bf16", "triton": "int8 (Triton)", "materialised": "int8 weight converted per call",
             "int8pack_mm": "int8 torch._weight_int8pack_mm", "int4": "int4"}
    lines = [f"one {config} layer's products and the output's, alone: GB/s of weight read (bytes as stored / time), "
             "ms per call in brackets; CUDA-graph replays, weights cycled through copies larger than the L2 cache",
             "| matrix (out x in) | rows | " + " | ".join(names[k] for k in KERNELS) + " |",
             "|---|---:|" + "---:|" * len(KERNELS)]
    cells: dict[tuple, dict] = {}
    errors = []
    for r in part["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['matrix']} | {r['skipped']} |")
            continue
        cells.setdefault((r["shape"], r["n"], r["k"], r["rows"]), {})[r["kernel"]] = r
        if r.get("error"):
            errors.append(f"error: {r['shape']} x {r['rows']}, {r['kernel']}: {r['error'][:160]}")
    for (shape, n, k, m), by_kernel in cells.items():
        shown = [f"{by_kernel[c]['gb_s']:.0f} ({by_kernel[c]['ms']:.3f})" if c in by_kernel and
                 math.isfinite(by_kernel[c]["ms"]) else ("error" if c in by_kernel else "-") for c in KERNELS]
        lines.append(f"| {shape} ({n} x {k}) | {m} | " + " | ".join(shown) + " |")
    return lines + errors


def speculative_table(part: dict, config: str) -> list[str]:
    d = part["draft"]
    lines = [f"batch 1, the {config} shape ({part['variant']}), k = {part['k']} proposed tokens, the engine's rules; "
             f"prompt: {part['prompt_tokens']} random tokens, the reply to them, the same tokens again; "
             f"{part['new_tokens']} new tokens, greedy; median of {part.get('rounds', 0)} interleaved round(s); "
             f"draft: random, dim {d['dim']}, {d['n_layers']} layers, eager; (p) right at {part['right']}, (e) at "
             f"{part['draft_right']}",
             "| row | proposer | tok/s none | tok/s speculating | speed-up | accepted |",
             "|---|---|---:|---:|---:|---:|"]
    for r in part["rows"]:
        if "tok_s" not in r:
            lines.append(_failed_row({**r, "variant": f"({r['row']})"}, 6))
            continue
        accepted = "none proposed" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f} %"
        lines.append(f"| ({r['row']}) | {r['proposer']} | {_f(part.get('none_tok_s'))} | {r['tok_s']:.1f} "
                     f"| {r['speedup']:.2f}x | {accepted} |")
    if "graphs" in part:
        lines.append(f"compiled: {part['graphs']} graph(s), {part['graph_breaks']} graph break(s), "
                     f"{part['cudagraph_skips']} CUDA graph skip(s){'' if part['compiled'] else ', FELL BACK TO EAGER'}"
                     f"; verification shapes (rows, positions): {part.get('verified_shapes')}")
    return lines


TABLES = {"parity": parity_table, "decode": decode_table, "batch": batch_table, "profile": profile_table,
          "serve": serve_table, "paged": paged_table, "kernels": kernels_table, "speculative": speculative_table}


def part_lines(name: str, report: dict) -> list[str]:
    """Part ``name``'s heading (status, seconds, failed rows) and its table or error."""
    part = report["parts"][name]
    failed_rows = sum("error" in r for r in part.get("rows", []))
    lines = [f"## {name}: {part['status']}" + (f" ({part['seconds']:.0f} s)" if "seconds" in part else "")
             + (f", {failed_rows} row(s) FAILED" if failed_rows else "")]
    if part.get("error"):
        lines.append(f"error: {part['error']}")
    elif part.get("rows") is not None or part["status"] == "ok":
        try:
            lines += TABLES[name](part, report["config"])
        except (KeyError, TypeError, ValueError) as e:  # a partial part: its rows so far, raw
            lines.append(f"(table incomplete: {e!r}) rows: {json.dumps(part.get('rows'), default=str)[:2000]}")
    return lines


def print_report(report: dict) -> None:
    print(f"\nGPU checks: plan {report.get('plan')}, config {report['config']}, "
          f"{report['device'].get('name', report['device']['type'])}, torch {report['device']['torch']}")
    if report.get("bandwidth_bytes_per_s"):
        print(f"measured copy bandwidth: {report['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s "
              "(device-to-device copy: bytes read + bytes written / time)")
    for name, part in report["parts"].items():
        if part["status"] != "skipped":
            print("\n" + "\n".join(part_lines(name, report)))
    print("\n## targets" + ("" if report["config"] == "8b" and not report["dry_run"]
                              else " (set for the 8b shape on CUDA: here they only show the script works)"))
    for t in report["targets"]:
        value = t["value"]
        shown = "-" if value is None else (str(value) if isinstance(value, bool) else f"{value:.2f}")
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"- {t['name']}: {shown} (target {'yes' if t['target'] is True else t['target']}): {verdict}")
    print(f"\nwhole run: {report['seconds'] / 60:.1f} min; JSON: {report['json']}; tables: {report.get('tables')}")


# -- the command -----------------------------------------------------------------------------------


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _yes_no(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    sizes = "; ".join(f"{c}: {json.dumps(v)}" for c, v in SIZES.items())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"Lists are comma-separated.  Sizes not given are the config's: {sizes}")
    p.add_argument("--plan", default="first", choices=list(PLANS),
                   help="what to run: a plan's parts and variants (default %(default)s; see above)")
    p.add_argument("--device", default="cuda", help="cuda (the current GPU), cuda:N, or cpu for a dry run "
                   "(default %(default)s)")
    p.add_argument("--config", default="8b", choices=sorted(CONFIGS), help="model shape (default %(default)s)")
    p.add_argument("--parts", type=_list, default=None, help=f"parts to run, instead of the plan's ({','.join(PARTS)})")
    p.add_argument("--skip", type=_list, default=[], help="parts not to run")
    p.add_argument("--variants", type=_list, default=None, help="variants of parity (and of decode, unless "
                   f"--decode_variants is given); default: the plan's, else all of {','.join(VARIANTS)}")
    p.add_argument("--decode_variants", type=_list, default=None,
                   help="variants of the decode part (default: --variants where given, else the plan's)")
    p.add_argument("--batch_variants", type=_list, default=None,
                   help="variants of the batch part (default: the plan's, else bf16,bf16-compiled; each compiled "
                   "one compiles rows 1 and 2..max)")
    p.add_argument("--batches", type=lambda t: [int(x) for x in _list(t)], help="batch sizes of the batch part")
    p.add_argument("--int4_group_size", type=int, default=128, choices=(32, 64, 128, 256),
                   help="int4: input columns per scale (default %(default)s, the library's)")
    p.add_argument("--parity_layers", type=int, default=2,
                   help="layers of the parity model (the config's widths; default %(default)s)")
    p.add_argument("--parity_rows", type=_positive_int, default=2,
                   help="parity: rows decoded together, the variants' --max_batch_size (default %(default)s)")
    p.add_argument("--parity_prompt", type=int, help="parity: prompt tokens")
    p.add_argument("--parity_steps", type=int, help="parity: decoding steps after the prompt")
    p.add_argument("--prompt_tokens", type=int, help="decode/batch: prompt tokens")
    p.add_argument("--new_tokens", type=int, help="decode/batch: new tokens N of the timed generations")
    p.add_argument("--max_seq_len", type=int,
                   help="decode/batch: KV cache length (compiled steps attend to the live context's bucket)")
    p.add_argument("--reps", type=int, help="decode/batch: timed repetitions")
    p.add_argument("--step_repeat", type=int, help="decode: steps timed alone")
    p.add_argument("--profile_steps", type=int, help="profile: steps under torch.profiler (the step alone, and "
                   "the engine's)")
    p.add_argument("--host_steps", type=int, help="profile: engine steps whose host phases are timed")
    p.add_argument("--bandwidth_mib", type=int, default=None,
                   help="bytes the bandwidth probe copies (default 4096 MiB on CUDA, 256 MiB on the CPU)")
    p.add_argument("--clients", type=int, help="serve: concurrent streaming clients, the server's --max_batch_size")
    p.add_argument("--serve_prompt_tokens", type=int, help="serve: prompt tokens")
    p.add_argument("--serve_tokens", type=int, help="serve: new tokens per client")
    p.add_argument("--serve_max_seq_len", type=int, help="serve: the server's --max_seq_len")
    p.add_argument("--serve_reps", type=int, help="serve: measured rounds")
    p.add_argument("--serve_compile", action=argparse.BooleanOptionalAction, default=None,
                   help="serve: the server's --compile / --no-compile (default: the server's own default)")
    p.add_argument("--paged_rows", type=lambda t: [int(x) for x in _list(t)], help="paged: rows of a step")
    p.add_argument("--paged_contexts", type=lambda t: [int(x) for x in _list(t)], help="paged: positions per row")
    p.add_argument("--paged_reps", type=int, help="paged: calls timed per round")
    p.add_argument("--paged_rounds", type=int, help="paged: rounds, the ways of reading interleaved")
    p.add_argument("--paged_flex", type=_yes_no,
                   help="paged: time FlexAttention too (compiles once per size)")
    p.add_argument("--kernel_rows", type=lambda t: [int(x) for x in _list(t)], help="kernels: rows of a product")
    p.add_argument("--kernel_repeat", type=int, help="kernels: timed replays of each product's rotation")
    p.add_argument("--spec_variant", default="bf16-compiled", choices=list(VARIANTS),
                   help="speculative: the target's variant (default %(default)s)")
    p.add_argument("--spec_rows", type=_list, default=list(SPEC_ROWS),
                   help=f"speculative: bench_speculative's rows to measure (default {','.join(SPEC_ROWS)})")
    p.add_argument("--spec_tokens", type=int, default=4, help="speculative: tokens proposed a step, k "
                   "(default %(default)s)")
    p.add_argument("--spec_right", type=float, default=0.7,
                   help="speculative: (p)'s probability that a proposal is right (default %(default)s)")
    p.add_argument("--spec_draft_right", type=float, default=0.88,
                   help="speculative: (e)'s probability that a proposal is right (default %(default)s)")
    p.add_argument("--deadline_s", type=_seconds, default=None,
                   help="start no variant or part after this many seconds (recorded as not run), so that the run "
                   "ends inside a command's time limit (default: none)")
    p.add_argument("--workdir", default=None, help="checkpoints and logs (default: /dev/shm/gpu_check where "
                   f"/dev/shm has {WORKDIR_IN_MEMORY_GIB} GiB free, as on a GPU machine: the random 8B checkpoint is "
                   "16 GB, written and read back faster there; else /tmp/gpu_check)")
    p.add_argument("--json", default=None, help="where the report goes (default WORKDIR/gpu_check.json)")
    p.add_argument("--tables", default=None, help="where each part's table is appended as it ends "
                   "(default: the JSON's path with .md)")
    args = p.parse_args(argv)
    if args.workdir is None:
        args.workdir = default_workdir()
    for name, value in SIZES[args.config].items():  # sizes not given: the config's
        if getattr(args, name) is None:
            setattr(args, name, value)
    plan = PLANS[args.plan]
    if args.parts is None:
        args.parts = list(plan["parts"])
    if args.decode_variants is None:  # --variants given: decode follows it, else the plan's
        args.decode_variants = list(args.variants or plan.get("decode_variants", plan.get("variants", VARIANTS)))
    if args.variants is None:
        args.variants = list(plan.get("variants", VARIANTS))
    if args.batch_variants is None:
        args.batch_variants = list(plan.get("batch_variants", ["bf16", "bf16-compiled"]))
    for name, values, allowed in (("--parts", args.parts, PARTS), ("--skip", args.skip, PARTS),
                                  ("--variants", args.variants, VARIANTS),
                                  ("--decode_variants", args.decode_variants, VARIANTS),
                                  ("--batch_variants", args.batch_variants, VARIANTS),
                                  ("--spec_rows", args.spec_rows, SPEC_ROWS)):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            p.error(f"{name}: unknown {unknown}; choose among {','.join(allowed)}")
    for name, value in (("--spec_right", args.spec_right), ("--spec_draft_right", args.spec_draft_right)):
        if not 0 <= value <= 1:
            p.error(f"{name}: a probability, between 0 and 1; got {value}")
    if args.spec_tokens < 1:
        p.error(f"--spec_tokens: at least 1 proposed token, got {args.spec_tokens}")
    return args


WORKDIR_IN_MEMORY_GIB = 40  # the 8B checkpoint (16 GB) and the parity model's, with room to spare


def default_workdir(shm: Path = Path("/dev/shm")) -> str:
    """Where checkpoints go when ``--workdir`` is not given: memory (``shm``) where it has
    :data:`WORKDIR_IN_MEMORY_GIB` GiB free, else ``/tmp``."""
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        free = 0
    return str(shm / "gpu_check") if free >= WORKDIR_IN_MEMORY_GIB * 2**30 else "/tmp/gpu_check"


def resolve_check_device(name: str) -> torch.device:
    """The device the checks run on: ``cuda`` is the current GPU (as in torch), given its index
    so that every CUDA call accepts it; ``cuda:N`` and ``cpu`` as given."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived: the run stops, keeping what it measured (a BaseException, so
    that no part's ``except Exception`` records it as the part's own failure)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


class Report:
    """The run's report, written whole to ``json_path`` whenever it changes (a part or a
    variant ended: a run stopped later keeps it), each part's table appended to
    ``tables_path`` and printed as the part ends."""

    def __init__(self, data: dict, json_path: Path, tables_path: Path, started: float) -> None:
        self.data, self.json_path, self.tables_path, self.started = data, json_path, tables_path, started
        for path in (json_path, tables_path):
            path.parent.mkdir(parents=True, exist_ok=True)
        device_name = data['device'].get('name', data['device']['type'])
        tables_path.write_text(f"# GPU checks: config {data['config']}, {device_name}, "
                               f"torch {data['device']['torch']}\n")

    def save(self) -> None:
        self.data["targets"] = targets(self.data)
        self.data["seconds"] = time.perf_counter() - self.started
        partial = self.json_path.with_name(self.json_path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=1, default=str))
        partial.replace(self.json_path)  # never a half-written report

    def part_progress(self, name: str, part: dict) -> None:
        """A variant of part ``name`` ended: its rows so far go to the JSON."""
        self.data["parts"][name] = {"status": "running", **part}
        self.save()

    def part_ended(self, name: str) -> None:
        self.save()
        lines = part_lines(name, self.data)
        with self.tables_path.open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
        print("\n" + "\n".join(lines), flush=True)


class Deadline:
    """The time after which no variant or part starts (``seconds`` after ``started``; None: none)."""

    def __init__(self, started: float, seconds: Optional[float]) -> None:
        self.at = None if seconds is None else started + seconds

    def passed(self) -> bool:
        return self.at is not None and time.perf_counter() >= self.at


NOT_RUN = "not run: --deadline_s passed"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}), nothing to check; "
              "--device cpu --config tiny runs the script on the CPU")
        return 0
    device = resolve_check_device(args.device)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("llama").setLevel(logging.INFO)  # loading, quantising and compile times
    started = time.perf_counter()
    deadline = Deadline(started, args.deadline_s)
    parts = [p for p in args.parts if p not in args.skip]  # in the order given
    json_path = Path(args.json or Path(args.workdir) / "gpu_check.json")
    tables_path = Path(args.tables) if args.tables else json_path.with_suffix(".md")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    report = Report({"config": args.config, "plan": args.plan, "dry_run": device.type != "cuda",
                     "device": device_info(device), "args": vars(args), "json": str(json_path),
                     "tables": str(tables_path), "parts": {p: {"status": "skipped"} for p in PARTS}},
                    json_path, tables_path, started)
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    current: list[str] = []
    status = 0
    try:
        mib = args.bandwidth_mib or (4096 if device.type == "cuda" else 256)
        report.data["bandwidth_bytes_per_s"] = copy_bandwidth(device, mib)
        print(f"[{time.perf_counter() - started:6.0f} s] bandwidth probe: "
              f"{report.data['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s", file=sys.stderr, flush=True)
        report.save()
        results: dict = {}  # decode and batch share one build of each variant
        for name in parts:
            if name in SPEED_PARTS and name in results:  # measured with an earlier one of them
                report.data["parts"][name] = results.pop(name)
                report.part_ended(name)
                continue
            if deadline.passed():
                report.data["parts"][name] = {"status": NOT_RUN}
                report.save()
                continue
            print(f"[{time.perf_counter() - started:6.0f} s] {name} ...", file=sys.stderr, flush=True)
            current[:] = [name]
            start = time.perf_counter()
            try:
                if name in SPEED_PARTS:
                    speed = set(SPEED_PARTS) & set(parts)
                    results.update(run_speed(args, device, speed, report.data["bandwidth_bytes_per_s"],
                                             report, deadline))
                    for p in speed:
                        results[p] = {"status": "ok", **results[p]}
                    out = results.pop(name)
                else:
                    out = {"status": "ok", **PART_RUNNERS[name](args, device, report, deadline)}
            except Exception as e:  # recorded; the other parts still run
                out = {"status": "failed", "error": _error(e)}
                traceback.print_exc()
            out.setdefault("seconds", time.perf_counter() - start)
            report.data["parts"][name] = out
            current.clear()
            report.part_ended(name)
    except (Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"gpu_check: stopped by signal {signum}; the report keeps what was measured", file=sys.stderr)
        for name in current:
            report.data["parts"][name] = {**report.data["parts"][name], "status": f"interrupted by signal {signum}"}
        status = 128 + signum
    finally:
        stop_children()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report.save()
    print_report(report.data)
    if status:
        return status
    failed = [p for p in parts if report.data["parts"][p]["status"] not in ("ok", NOT_RUN)
              or any("error" in r for r in report.data["parts"][p].get("rows", []))]
    if report.data["parts"]["parity"].get("passed") is False:
        failed.append("parity bounds")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_reference"]:  # the parity part's CPU reference (start_reference)
        sys.exit(reference_main(*sys.argv[2:]))
    sys.exit(main())
