"""CPU int8 and int4 weight products for decoding (1 to 8 rows), on the 150m and 1B shapes'
matrices: torch's kernels against our own (llama.layers.cpu_kernels), in GB/s of weight bytes
read and as a share of the measured memory bandwidth.  Activations are bfloat16 and int8
scales bfloat16, as the int8/int4 models hold them.

    python benchmarks/bench_qmatvec.py                       # 150m, 1 and 8 rows, 1 and 2 threads
    python benchmarks/bench_qmatvec.py --config 1b --rows 1 --threads 1,2 --rounds 5
    python benchmarks/bench_qmatvec.py --rows 256 --kernels int8,ours-int8,int4,ours-int4   # prompts
    python benchmarks/bench_qmatvec.py --rows 1 --kernels ours-int4,ours-int4-g32     # groups of 128 against 32

Kernels:
  int8       torch._weight_int8pack_mm (bfloat16 activations): today's int8 decoding product
  int8-blocks  llama.layers.products.linear_by_blocks (today's int8 prompts, from 32 rows)
  int_mm     torch._int_mm on activations quantised per row (int32 sums, scaled back)
  ours-int8  llama_qcpu::q8_matmul (AVX-512 VNNI where the CPU has it, else AVX2)
  ours-int8-avx2   the same kernel's AVX2 path
  int4       torch._weight_int4pack_mm_for_cpu (bfloat16 activations): torch's int4
  ours-int4  llama_qcpu::q4_matmul (the same codes, scales and offsets in our layout)
  ours-int4-avx2
int4 kernels quantise in groups of --group_size values (default 128, the int4 models' default);
a name ending in -gN (ours-int4-g32, int4-g64, ours-int4-avx2-g32) takes groups of N instead.
Our int4 rows are laid out as a model on that path holds them: a scale per group with AVX-512
VNNI, per block of 32 with AVX2 (cpu_kernels.scale_per_group).

Each matrix's kernels are timed in interleaved rounds (A, B, C, A, B, C, ...), each round the
median of several calls, so a load from other processes falls on all of them alike; the table
gives the median over rounds and the range.  Weight bytes: int8 one a value plus the row scales;
torch's int4 half a byte a value plus a bfloat16 scale and offset per group; ours the rows as
packed (the same, widths padded to 256).  Rows of a matrix summed: the step total per kernel (the share of a
decoding step's products), and for our kernels the multiply-adds a second as a share of the
CPU's dot-product ceiling (dot_ceiling.py: what several rows, bound by the instructions rather
than by memory, can reach).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dot_ceiling  # noqa: E402
from common import measure_bandwidth, set_threads, timed_rounds  # noqa: E402
from llama.layers import cpu_kernels  # noqa: E402
from llama.layers.cpu import CpuFeatures  # noqa: E402
from llama.layers.products import linear_by_blocks  # noqa: E402
from llama.layers.quantize import int4_matrix, quantize_groups_int4, quantize_rows_int8  # noqa: E402

# (name, out, in) of the matrices a decoding step multiplies, with the layers that read the
# same input fused (wq/wk/wv, w1/w3) as the model runs them; how many of each a step runs.
SHAPES = {
    "150m": [("wqkv", 768, 512, 8), ("wo", 512, 512, 8), ("w13", 3072, 512, 8), ("w2", 512, 1536, 8),
             ("output", 128256, 512, 1)],
    "1b": [("wqkv", 3072, 2048, 16), ("wo", 2048, 2048, 16), ("w13", 16384, 2048, 16), ("w2", 2048, 8192, 16),
           ("output", 128256, 2048, 1)],
}
KERNELS = ("int8", "int_mm", "ours-int8", "ours-int8-avx2", "int4", "ours-int4", "ours-int4-avx2")


def kernel_isa(name: str, vnni: bool) -> str:
    """The instructions our kernel ``name`` runs: its AVX2 path, or the best this CPU has."""
    return "avx2" if name.endswith("-avx2") or not vnni else "avx512_vnni"


def split_group(name: str, group_size: int) -> tuple[str, int]:
    """(kernel, int4 group size) of a kernel's name: a -gN suffix sets the group to N."""
    match = re.fullmatch(r"(.+)-g(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, group_size)


def kernels_for(out_f: int, in_f: int, rows: int, wanted: list[str], vnni: bool,
                group_size: int = 128) -> dict[str, tuple[Callable, int]]:
    """name -> (call, weight bytes) for one matrix."""
    w = torch.randn(out_f, in_f) * 0.02
    x = torch.randn(rows, in_f)
    q, s = quantize_rows_int8(w)
    sb = s.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    made: dict[str, tuple[Callable, int]] = {}
    int8_bytes = out_f * in_f + 4 * out_f
    for name in wanted:
        kernel, group = split_group(name, group_size)
        if kernel == "int8":
            made[name] = (lambda: torch._weight_int8pack_mm(xb, q, sb), int8_bytes)
        elif kernel == "int8-blocks":
            made[name] = (lambda: linear_by_blocks(x, q, row_scale=s), int8_bytes)
        elif kernel == "int_mm":
            def int_mm() -> torch.Tensor:
                d = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
                xq = torch.round(x / d).to(torch.int8)
                if rows < 17:  # _int_mm wants more than 16 rows
                    xq = torch.cat([xq, xq.new_zeros(17 - rows, in_f)])
                return torch._int_mm(xq, q.t())[:rows].float() * d * s
            made[name] = (int_mm, int8_bytes)
        elif kernel.startswith("ours-int8"):
            isa = kernel_isa(kernel, vnni)
            made[name] = (lambda isa=isa: cpu_kernels.q8_linear(xb, q, sb, isa), int8_bytes)
        elif kernel == "int4":
            packed, sz, _ = int4_matrix(w, group)
            made[name] = (lambda packed=packed, sz=sz, group=group:
                          torch._weight_int4pack_mm_for_cpu(xb, packed, group, sz),
                          packed.numel() * packed.element_size() + sz.numel() * 2)
        elif kernel.startswith("ours-int4"):
            codes, scale, zero = quantize_groups_int4(w, group)
            isa = kernel_isa(kernel, vnni)
            p = cpu_kernels.pack_int4(codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16),
                                      per_group=cpu_kernels.scale_per_group(isa))  # as a model on this path
            made[name] = (lambda p=p, isa=isa: cpu_kernels.q4_linear(xb, p, in_f, isa), p.numel())
        else:
            raise SystemExit(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}, int8-blocks")
    return made


def _share_of_ceiling(kernel: str, gmacs: float, ceiling: dict[str, float], vnni: bool) -> str:
    """", N GMAC/s (P % of the ceiling)" for our kernels, by the instructions they run."""
    if not kernel.startswith("ours-"):
        return ""
    isa = kernel_isa(split_group(kernel, 0)[0], vnni)
    return f", {gmacs:.0f} GMAC/s ({100 * gmacs / ceiling[isa]:.0f} % of {isa}'s)" if isa in ceiling else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="150m", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--group_size", type=int, default=128, help="int4's groups (a kernel's -gN overrides)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.2, help="per kernel and round")
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("our kernels could not be built (see the log): nothing to compare")
    features = CpuFeatures.probe()
    vnni = features.int8_dot == "avx512_vnni"
    wanted = args.kernels.split(",")
    print(f"CPU: {features.capability}, AVX-512 VNNI {vnni}; torch {torch.__version__}; {args.config}")
    for threads in [int(t) for t in args.threads.split(",")]:
        set_threads(threads)
        bandwidth = measure_bandwidth(threads) / 1e9
        ceiling = {isa: dot_ceiling.gmacs(isa, threads) for isa in dot_ceiling.isas_here()}
        print(f"\n{threads} thread(s): measured bandwidth {bandwidth:.1f} GB/s; dot-product ceiling "
              + ", ".join(f"{isa} {g:.1f} GMAC/s" for isa, g in ceiling.items()))
        for rows in [int(r) for r in args.rows.split(",")]:
            print(f"\n| rows {rows} | " + " | ".join(wanted) + " |")
            print("|---|" + "---:|" * len(wanted))
            step = {name: 0.0 for name in wanted}
            step_bytes = {name: 0 for name in wanted}
            step_macs = 0
            for label, out_f, in_f, per_step in SHAPES[args.config]:
                calls = kernels_for(out_f, in_f, rows, wanted, vnni, args.group_size)
                step_macs += per_step * out_f * in_f * rows
                times = timed_rounds({name: call for name, (call, _) in calls.items()}, args.rounds, args.seconds)
                cells = []
                for name in wanted:
                    med = statistics.median(times[name])
                    nbytes = calls[name][1]
                    step[name] += per_step * med
                    step_bytes[name] += per_step * nbytes
                    cells.append(f"{nbytes / med / 1e9:.1f} GB/s {1e3 * med:.3f} ms "
                                 f"[{1e3 * min(times[name]):.3f}-{1e3 * max(times[name]):.3f}]")
                print(f"| {label} {out_f}x{in_f} | " + " | ".join(cells) + " |")
            cells = [f"{1e3 * step[n]:.2f} ms, {step_bytes[n] / step[n] / 1e9:.1f} GB/s "
                     f"({100 * step_bytes[n] / step[n] / 1e9 / bandwidth:.0f} %)"
                     + _share_of_ceiling(n, step_macs / step[n] / 1e9, ceiling, vnni) for n in wanted]
            print("| step's products | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
