"""The int8 weight kernels of llama.layers.triton_int8 on a GPU: their speed against torch's int8
kernel, the weight converted per call and a bfloat16 weight, and a sweep of kernel configurations
(where kernel_config's choices come from).

    python benchmarks/bench_int8.py                          # benchmark_int8_kernels: the 8B's shapes at 1, 8, 32 rows
    python benchmarks/bench_int8.py --sweep --rows 1,8,32,64 # every configuration of CANDIDATES, best per shape
    python benchmarks/bench_int8.py --device cpu --shapes tiny --rows 1,2  # a dry run (CPU, tiny shapes)
    python benchmarks/bench_int8.py --compile_only --rows 1,8,32,64  # what sm_90 code they compile to (no GPU needed)

Times are medians of CUDA-graph replays of calls rotating over copies of the weight (together
several times the L2 cache), under CUDA events; GB/s is weight bytes over time (int8 bytes for
the int8 kernels, bfloat16 bytes for ``dense``).  The sweep also checks each configuration's
outputs against the float32 product (the bound of tests/test_triton_int8.py, twice its
accumulation term for float32's own).  ``--json`` writes the rows, one JSON object a line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama.layers import triton_int8  # noqa: E402
from llama.layers.products import int4_product  # noqa: E402
from llama.layers.quantize import int4_matrix  # noqa: E402
from llama.layers.triton_int8 import KernelConfig, int8_weight_mm, kernel_config, launch, runs_on  # noqa: E402

SHAPES = {"8b": triton_int8.LLAMA_8B_SHAPES, "tiny": {"tiny_a": (96, 256), "tiny_b": (40, 2048)}}

# The configurations the sweep times, by kind: (block_n, block_k, num_warps, num_stages, fast_convert).
# Each also with K split in 1, 2, 4 and 8 slices and kernel_config's own split.
CANDIDATES = {
    "reduce": [(4, 512, 4, 3, True), (8, 256, 4, 3, True), (8, 512, 4, 3, True), (8, 1024, 4, 3, True),
               (16, 512, 4, 3, True), (8, 512, 8, 3, True), (8, 512, 4, 3, False)],
    "dot": [(16, 256, 4, 3, True), (32, 128, 4, 4, True), (32, 256, 4, 3, True), (64, 128, 4, 4, True),
            (64, 256, 4, 3, True), (128, 128, 4, 3, True), (64, 128, 4, 4, False)],
}


def _median_seconds(calls: list[Callable[[], object]], device: torch.device, repeat: int) -> float:
    """Median seconds per call of ``calls`` (run in turn).  On a GPU the calls are captured in
    one CUDA graph, replayed ``repeat`` times under CUDA events: the device's own time with no
    launch gaps (as in the engine's captured steps), the median replay divided by the calls.
    Elsewhere, the median of each call under the wall clock."""
    for call in calls:  # compile, allocate, fill the caches of whatever is cached
        call()
    if device.type != "cuda":
        times = []
        for _ in range(repeat):
            for call in calls:
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up on a side stream, as torch.cuda.graph asks
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def cache_bytes(device: torch.device) -> int:
    """The last-level cache a benchmark must not measure: the GPU's L2 (50 MB on an H100); 0
    on the CPU, whose dry runs only check that the benchmark runs."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return 0


def weight_copies(device: torch.device, weight_bytes: int) -> int:
    """How many copies of a weight of ``weight_bytes`` a product rotates over so that no call
    finds its weight in the cache: together at least 4 x :func:`cache_bytes`, and never fewer
    than 3; one on the CPU, whose dry runs have no cache to defeat (they only check that the
    benchmark runs)."""
    cache = cache_bytes(device)
    return max(3, math.ceil(4 * cache / weight_bytes)) if cache else 1


def benchmark_int8_kernels(device: torch.device | str, shapes: Optional[dict[str, tuple[int, int]]] = None,
                           rows: tuple[int, ...] = (1, 8, 32), dtype: torch.dtype = torch.bfloat16,
                           repeat: int = 20, int4_group_size: int = 0) -> list[dict]:
    """Times, for each shape (N, K) of ``shapes`` (default :data:`LLAMA_8B_SHAPES`) and each row
    count M of ``rows``, the products an (M, K) ``dtype`` input can take:

    * ``"triton"``: :func:`int8_weight_mm` (skipped where it does not run: :func:`runs_on`);
    * ``"int8pack_mm"``: ``torch._weight_int8pack_mm`` (bfloat16 only);
    * ``"materialised"``: ``F.linear(x, weight.to(dtype)) * scale``, the weight converted per call;
    * ``"dense"``: ``F.linear`` with a ``dtype`` weight of the same shape (the speed to beat);
    * ``"int4"``, where ``int4_group_size`` is given (and divides K): the library's int4 product
      (torch's kernel) of 4-bit groups of that many columns, bfloat16 only.

    Each product rotates over copies of its weight holding together at least 4 x the L2 cache
    (:func:`cache_bytes`; an H100's is 50 MB) and never fewer than 3, so that no call finds
    its weight in the cache (one on the CPU: :func:`weight_copies`).  Returns one dict per
    (shape, rows, kernel): ``shape``, ``n``, ``k``, ``rows``, ``kernel``, ``ms`` (median per
    call), ``weight_bytes`` (of one copy: int8 for the first three, ``dtype`` for dense) and
    ``gb_s`` (weight bytes / time, 1e9 bytes); a kernel
    that fails has NaN times and its ``error``.  On a GPU (CUDA graphs of the rotation, CUDA
    events) a few seconds for the 8B's shapes, most of them compiling; on the CPU a dry run for
    tiny ``shapes``."""
    device = torch.device(device)
    shapes = triton_int8.LLAMA_8B_SHAPES if shapes is None else shapes
    g = torch.Generator(device=device).manual_seed(0)
    results = []
    for name, (n, k) in shapes.items():
        copies = weight_copies(device, n * k)
        weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
                   for _ in range(copies)]
        scales = [torch.rand(n, device=device, generator=g).to(dtype) / 64 for _ in range(copies)]
        kernels: dict[str, Callable[..., torch.Tensor]] = {}
        if runs_on(device):
            kernels["triton"] = int8_weight_mm
        if dtype == torch.bfloat16:
            kernels["int8pack_mm"] = torch._weight_int8pack_mm
        kernels["materialised"] = lambda x, w, s: F.linear(x, w.to(x.dtype)) * s
        for m in rows:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            for kernel, fn in kernels.items():
                calls = [functools.partial(fn, x, w, s) for w, s in zip(weights, scales)]
                try:
                    seconds = _median_seconds(calls, device, repeat)
                except RuntimeError as e:  # a kernel this device or build lacks: the others still run
                    results.append(dict(shape=name, n=n, k=k, rows=m, kernel=kernel, ms=math.nan,
                                        weight_bytes=n * k, gb_s=math.nan, error=str(e).splitlines()[0]))
                    continue
                results.append(dict(shape=name, n=n, k=k, rows=m, kernel=kernel, ms=seconds * 1e3,
                                    weight_bytes=n * k, gb_s=n * k / seconds / 1e9))
        del weights, scales
        dense_copies = weight_copies(device, n * k * dtype.itemsize)
        dense = [torch.randn(n, k, device=device, generator=g).to(dtype) for _ in range(dense_copies)]
        for m in rows:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            calls = [functools.partial(F.linear, x, w) for w in dense]
            seconds = _median_seconds(calls, device, repeat)
            results.append(dict(shape=name, n=n, k=k, rows=m, kernel="dense", ms=seconds * 1e3,
                                weight_bytes=n * k * dtype.itemsize, gb_s=n * k * dtype.itemsize / seconds / 1e9))
        del dense
        if int4_group_size and k % int4_group_size == 0 and dtype == torch.bfloat16:
            int4_bytes = n * k // 2 + 2 * (k // int4_group_size) * n * 2  # 4-bit codes, a scale and a zero per group
            int4 = [int4_matrix(torch.randn(n, k, device=device, generator=g).to(dtype), int4_group_size)[:2]
                    for _ in range(weight_copies(device, int4_bytes))]
            for m in rows:
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                calls = [functools.partial(int4_product, x, packed, scales, int4_group_size) for packed, scales in int4]
                try:
                    seconds = _median_seconds(calls, device, repeat)
                except RuntimeError as e:
                    results.append(dict(shape=name, n=n, k=k, rows=m, kernel="int4", ms=math.nan,
                                        weight_bytes=int4_bytes, gb_s=math.nan, error=str(e).splitlines()[0]))
                    continue
                results.append(dict(shape=name, n=n, k=k, rows=m, kernel="int4", ms=seconds * 1e3,
                                    weight_bytes=int4_bytes, gb_s=int4_bytes / seconds / 1e9))
            del int4
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def sweep(device: torch.device, shapes: dict[str, tuple[int, int]], rows: list[int], repeat: int,
          out_file: Optional[Path], candidates: int = 0) -> list[dict]:
    """Every configuration of CANDIDATES (the first ``candidates`` of each kind if not 0) that
    fits each (shape, rows), and kernel_config's, timed and checked."""
    results = []
    sms = triton_int8._sm_count(device)
    for name, (n, k) in shapes.items():
        copies = weight_copies(device, n * k)
        g = torch.Generator(device=device).manual_seed(0)
        weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
                   for _ in range(copies)]
        scales = [(torch.rand(n, device=device, generator=g) / 64).to(torch.bfloat16) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            wf = weights[0].float() * scales[0].float()[:, None]
            ref = x.float() @ wf.T
            u = 2.0**-8 if device.type == "cuda" else 2.0**-7  # Triton's interpreter truncates to bfloat16
            bound = u * ref.abs() + 2 * (k + 2) * 2.0**-24 * (x.float().abs() @ wf.abs().T) + 2.0**-24
            del wf
            default = kernel_config(m, n, k, sms)
            configs = [default]
            for kind, kind_candidates in CANDIDATES.items():
                if kind == "reduce" and m != 1:
                    continue
                for block_n, block_k, warps, stages, fast in kind_candidates[: candidates or None]:
                    base = dict(kind=kind, block_n=block_n, block_k=block_k, block_m=max(16, 1 << (m - 1).bit_length()),
                                num_warps=warps, num_stages=stages, fast_convert=fast)
                    auto = triton_int8.split_for(math.ceil(n / block_n), k, block_k,
                                                 (2 if kind == "reduce" else 1) * sms, max(1, k // (16 * m)))
                    for split in sorted({1, 2, 4, 8, auto}):
                        config = KernelConfig(**base, split=split)
                        if (split == 1 or k // split >= 2 * block_k) and config not in configs:
                            configs.append(config)
            for config in configs:
                row = dict(shape=name, n=n, k=k, rows=m, default=config == default, **config.__dict__)
                try:
                    out = launch(x, weights[0], scales[0], config)
                    excess = ((out.float() - ref).abs() - bound).max().item()
                    calls = [lambda w=w, s=s: launch(x, w, s, config) for w, s in zip(weights, scales)]
                    seconds = _median_seconds(calls, device, repeat)
                    row.update(ok=excess <= 0 and bool(torch.isfinite(out).all()), excess=excess, ms=seconds * 1e3,
                               gb_s=n * k / seconds / 1e9)
                except Exception as e:  # a configuration the compiler or the GPU refuses: recorded
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                results.append(row)
                if out_file is not None:
                    with out_file.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        del weights, scales
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# SASS instructions counted by --compile_only: I2F (integer to float, a quarter of the float
# rate), HMMA / HGMMA (mma.sync and Hopper's wgmma tensor-core products), LDGSTS (cp.async: the
# pipelined loads), LDG.E.128 (16-byte loads), F2FP (packing floats to bfloat16/float16).
SASS_COUNTED = ("I2F", "HMMA", "HGMMA", "LDGSTS", "LDG.E.128", "F2FP")
EXIT_NO_COMPILER = 3  # --compile_only cannot compile here (no CUDA and no stand-in for this Triton)


def compile_report(shapes: dict[str, tuple[int, int]], rows: list[int], arch: int = 90) -> list[dict]:
    """Each kernel_config's kernels (and add_splits where K is split) compiled for sm_``arch``
    without launching them: registers, spilled bytes (local memory), shared memory and counts
    of SASS_COUNTED.  Where no GPU is visible, a stand-in for Triton's CUDA driver names the
    target (compiling needs only Triton's bundled ptxas and cuobjdump); RuntimeError if this
    Triton cannot take it."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    if triton_int8.INTERPRETED:
        raise RuntimeError("--compile_only needs compiled kernels: unset TRITON_INTERPRET")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        try:
            from triton.backends.nvidia.driver import CudaDriver

            class TargetOnly(CudaDriver):  # names the target; never launches (no libcuda here)
                def __init__(self) -> None:
                    pass

                def get_current_target(self):
                    return GPUTarget("cuda", arch, 32)

                def get_current_device(self):
                    return 0

                def get_current_stream(self, device=None):
                    return 0

            driver.set_active(TargetOnly())
        except Exception as e:
            raise RuntimeError(f"cannot stand in for Triton {triton.__version__}'s CUDA driver: {e}") from e
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    kernels = triton_int8._kernels()
    reports = []
    dumps: dict[bytes, tuple[str, str]] = {}  # cubin -> cuobjdump's (-res-usage, -sass): shapes share kernels
    for name, (n, k) in shapes.items():
        for m in rows:
            config = kernel_config(m, n, k, 132)
            k_per_split = math.ceil(math.ceil(k / config.split) / config.block_k) * config.block_k
            split = math.ceil(k / k_per_split)
            x = torch.empty(m, k, dtype=torch.bfloat16, device=device)
            w = torch.empty(n, k, dtype=torch.int8, device=device)
            scale = torch.empty(n, dtype=torch.bfloat16, device=device)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            target = torch.empty(split, m, n, device=device) if split > 1 else out
            common = dict(TO_PARTIAL=split > 1, FAST_CONVERT=config.fast_convert, num_warps=config.num_warps,
                          num_stages=config.num_stages, grid=(1,))
            args = (x, w, scale, target, m, n, k, k, k, k_per_split)
            try:
                if config.kind == "reduce":
                    compiled = [("reduce", kernels["reduce"].warmup(*args, BLOCK_N=config.block_n,
                                                                    BLOCK_K=config.block_k, **common))]
                else:
                    compiled = [("dot", kernels["dot"].warmup(*args, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                                                              BLOCK_K=config.block_k, INTERPRETED=False, **common))]
                if split > 1:
                    compiled.append(("add_splits", kernels["add_splits"].warmup(target, scale, out, m, n, SPLIT=split,
                                                                                BLOCK=1024, num_warps=4, grid=(1,))))
            except Exception as e:
                raise RuntimeError(f"compiling for sm_{arch} failed: {type(e).__name__}: {e}") from e
            for kernel, binary in compiled:
                row = dict(shape=name, n=n, k=k, rows=m, kernel=kernel, split=split, **{
                    f: getattr(config, f) for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                                     "fast_convert")}, shared_bytes=binary.metadata.shared)
                if binary.asm["cubin"] not in dumps:
                    with tempfile.TemporaryDirectory() as tmp:
                        cubin = os.path.join(tmp, "kernel.cubin")
                        Path(cubin).write_bytes(binary.asm["cubin"])
                        usage, sass = (subprocess.run([str(cuobjdump), flag, cubin], capture_output=True,
                                                      text=True).stdout for flag in ("-res-usage", "-sass"))
                        dumps[binary.asm["cubin"]] = usage, sass
                usage, sass = dumps[binary.asm["cubin"]]
                row["registers"] = int(re.search(r"REG:(\d+)", usage).group(1))
                row["local_bytes"] = int(re.search(r"LOCAL:(\d+)", usage).group(1))
                opcodes = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
                for op in SASS_COUNTED:
                    row[op] = sum(1 for o in opcodes if o == op or o.startswith(op + ".") and op != "LDG.E.128"
                                  or op == "LDG.E.128" and o.startswith("LDG.E.128"))
                row["instructions"] = len(opcodes)
                reports.append(row)
    return reports


def best_table(results: list[dict]) -> list[str]:
    lines = ["| shape | rows | default ms | default GB/s | best ms | best GB/s | best config |", "|---" * 7 + "|"]
    keys = sorted({(r["shape"], r["rows"]) for r in results}, key=lambda t: (t[0], t[1]))
    for shape, m in keys:
        rs = [r for r in results if (r["shape"], r["rows"]) == (shape, m) and r.get("ok")]
        if not rs:
            lines.append(f"| {shape} | {m} | - | - | - | - | none ran correctly |")
            continue
        best = min(rs, key=lambda r: r["ms"])
        d = next((r for r in rs if r["default"]), None)
        conf = f"{best['kind']} n{best['block_n']} k{best['block_k']} m{best['block_m']} split{best['split']} " \
               f"w{best['num_warps']} s{best['num_stages']}{'' if best['fast_convert'] else ' plain-cast'}"
        default = f"{d['ms']:.4f} | {d['gb_s']:.0f}" if d else "- | -"
        lines.append(f"| {shape} | {m} | {default} | {best['ms']:.4f} | {best['gb_s']:.0f} | {conf} |")
    return lines


def bench_table(rows: list[dict]) -> list[str]:
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    lines = ["| shape | rows | " + " | ".join(f"{k} ms (GB/s)" for k in kernels) + " |",
             "|---" * (2 + len(kernels)) + "|"]
    for shape, m in dict.fromkeys((r["shape"], r["rows"]) for r in rows):
        cells = []
        for kernel in kernels:
            r = next((r for r in rows if (r["shape"], r["rows"], r["kernel"]) == (shape, m, kernel)), None)
            cells.append(f"{r['ms']:.4f} ({r['gb_s']:.0f})" if r else "-")
        lines.append(f"| {shape} | {m} | " + " | ".join(cells) + " |")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,8,32", help="row counts, comma-separated (default %(default)s)")
    p.add_argument("--sweep", action="store_true", help="time every configuration of CANDIDATES")
    p.add_argument("--repeat", type=int, default=20, help="timed repetitions (CUDA-graph replays) per median")
    p.add_argument("--candidates", type=int, default=0, help="sweep: the first N configurations of each kind (0: all)")
    p.add_argument("--compile_only", action="store_true",
                   help="compile kernel_config's kernels for sm_90 and report registers, spills, shared memory and "
                        "instructions (no GPU needed; TRITON_INTERPRET unset)")
    p.add_argument("--json", type=Path, help="write the rows here, one JSON object a line (appended)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.compile_only:
        try:
            reports = compile_report(SHAPES[args.shapes], [int(r) for r in args.rows.split(",")])
        except RuntimeError as e:
            print(e)
            return EXIT_NO_COMPILER
        if args.json:
            with args.json.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in reports)
        keys = ["shape", "rows", "kernel", "block_m", "block_n", "block_k", "split", "registers", "local_bytes",
                "shared_bytes", *SASS_COUNTED, "instructions"]
        print("| " + " | ".join(keys) + " |\n" + "|---" * len(keys) + "|")
        print("\n".join("| " + " | ".join(str(r[key]) for key in keys) + " |" for r in reports))
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure (--device cpu runs a dry run)")
        return 0
    rows = [int(r) for r in args.rows.split(",")]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    if args.sweep:
        results = sweep(device, SHAPES[args.shapes], rows, args.repeat, args.json, args.candidates)
        print("\n".join(best_table(results)))
    else:
        results = benchmark_int8_kernels(device, SHAPES[args.shapes], tuple(rows), repeat=args.repeat)
        if args.json:
            with args.json.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in results)
        print("\n".join(bench_table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
