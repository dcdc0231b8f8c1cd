"""The most integer multiply-adds a second this CPU's dot-product instructions give, the ceiling
of a product that is bound by them rather than by memory (several activation rows a weight read:
a decoding batch).  A loop of 16 independent accumulators per thread, nothing loaded:

* ``avx512_vnni``: ``vpdpbusd`` on 512-bit vectors, 64 byte products each (the instruction of
  our AVX-512 kernels, int8 and int4);
* ``avx2``: ``vpmaddubsw`` and a 16-bit add, 32 byte products (the least our AVX2 kernels
  spend on 32 products).

Built on first use with torch's C++ extension tooling into ``$LLAMA_KERNEL_CACHE`` (beside our
kernels), function target attributes as ``qmatmul.cpp``'s.

    python benchmarks/dot_ceiling.py            # 1 and 2 threads, each instruction this CPU has

On an AMD EPYC Zen 4 (2026-11-29): 110 GMAC/s a thread with either instruction, 512-bit
``vpdpbusd`` at 0.47 a cycle (3.67 GHz)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama.layers import cpu_kernels  # noqa: E402
from llama.layers.cpu import CpuFeatures  # noqa: E402

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <chrono>

// 16 independent accumulators: the instruction's throughput, not its latency
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int64_t vnni_loop(int64_t n) {
  __m512i acc[16];
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < n; ++k) {
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    __asm__ volatile("" : "+v"(w), "+v"(x));  // operands the compiler cannot fold
  }
  int64_t s = 0;
  for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_epi32(acc[i]);
  return s;
}

__attribute__((target("avx2"))) static int64_t maddubs_loop(int64_t n) {
  __m256i acc[16];
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t k = 0; k < n; ++k) {
    for (int i = 0; i < 16; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(w, x));
    __asm__ volatile("" : "+x"(w), "+x"(x));
  }
  int64_t s = 0;
  for (int i = 0; i < 16; ++i) s += _mm256_extract_epi16(acc[i], 0);
  return s;
}

// Multiply-adds a second, summed over `threads` threads each running `n` iterations
double dot_ceiling(int64_t isa, int64_t threads, int64_t n) {
  const double per_iteration = isa == 2 ? 16.0 * 64 : 16.0 * 32;
  int64_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(threads) reduction(+ : sink)
  for (int64_t t = 0; t < threads; ++t) sink += isa == 2 ? vnni_loop(n) : maddubs_loop(n);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return sink == 42 ? 0.0 : per_iteration * n * threads / seconds;
}
"""


@functools.lru_cache(maxsize=None)
def _module():
    from torch.utils import cpp_extension

    build = cpu_kernels.cache_dir() / "dot_ceiling"
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load_inline(name="llama_dot_ceiling", cpp_sources=_SOURCE, functions=["dot_ceiling"],
                                     extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                     build_directory=str(build), verbose=False)


def gmacs(isa: str, threads: int, iterations: int = 10_000_000) -> float:
    """Billions of int8 multiply-adds a second over ``threads`` threads with ``isa``'s
    instruction ("avx512_vnni" or "avx2"): the best of 3 runs."""
    code = cpu_kernels.isa_code(isa)
    return max(_module().dot_ceiling(code, threads, iterations) for _ in range(3)) / 1e9


def isas_here() -> list[str]:
    """The instruction paths this CPU runs: AVX2, and AVX-512 VNNI where it has it."""
    best = CpuFeatures.probe().int8_dot
    return [] if best is None else (["avx512_vnni", "avx2"] if best == "avx512_vnni" else ["avx2"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    print(f"CPU: {CpuFeatures.probe().capability}; torch {torch.__version__}")
    print("| threads | " + " | ".join(isas_here()) + " |")
    print("|---:|" + "---:|" * len(isas_here()))
    for threads in [int(t) for t in args.threads.split(",")]:
        print(f"| {threads} | " + " | ".join(f"{gmacs(isa, threads):.1f} GMAC/s" for isa in isas_here()) + " |")


if __name__ == "__main__":
    main()
