"""The Triton int8 kernels (llama.layers.triton_int8) against the dequantised product in float64,
run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1; skipped where Triton is not
installed), on CUDA where there is one (-m cuda); the custom op under torch.compile; the routing
of int8 products; and CPU int8 products untouched by any of it.

Error bound of one output, from the arithmetic (``ref`` the exact sum, ``mag`` the same sum of
absolute values): every product of a bfloat16/float16 activation and an int8 weight is exact in
float32 (8 or 11 significant bits times 8), so the error comes from the float32 sums (at most K
additions, split partial sums included: K * 2**-24 * mag), the scale (one more rounding) and the
rounding of the result to the output dtype (|ref| * u):

    |out - ref| <= u * |ref| + (K + 2) * 2**-24 * mag + 2**-24

u = 2**-8 for bfloat16 and 2**-11 for float16 rounded to nearest, as CUDA rounds; Triton's
interpreter truncates float32 to bfloat16 (its cast ignores the rounding mode), so under it
bfloat16's u is 2**-7.  2**-24 absolute covers float16's subnormal spacing (2**-24).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama.layers import triton_int8
from llama.layers.policy import KernelPolicy
from llama.layers.products import int8_product, int8_product_off_cpu, linear_by_blocks
from llama.layers.triton_int8 import KernelConfig, kernel_config, launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# M of the brief: one row, a few, non-powers of two, a tl.dot block and more, the cut-off
ROWS = (1, 2, 3, 7, 16, 33, 64)
# Llama 3 8B's products (N, K) scaled down 32 x in N and K (output: 128 x in N, a 1,002-row
# matrix), and shapes that no block size divides
SHAPES = {"wqkv": (192, 128), "wo": (128, 128), "w13": (896, 128), "w2": (128, 448), "output": (1002, 128),
          "odd": (100, 700), "narrow": (5, 33)}


@pytest.fixture
def interpreted():
    """Triton's interpreter, which runs the kernels on CPU tensors: conftest.py sets
    TRITON_INTERPRET=1 before Triton is imported where there is no GPU."""
    triton = pytest.importorskip("triton")
    import numpy
    from triton.runtime.interpreter import InterpretedFunction

    if not triton_int8.INTERPRETED or not isinstance(triton.language.zeros, InterpretedFunction):
        pytest.skip("Triton is not interpreting here (TRITON_INTERPRET=1 must be set before Triton is imported)")
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot take loop bounds from numpy "
                    f"{numpy.__version__} (fixed in Triton 3.7)")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
             scale_dtype: torch.dtype | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) / 64 + 1e-3).to(scale_dtype or dtype)
    return x.to(device), w.to(device), s.to(device)


def assert_within_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, interpreted: bool):
    """``out`` within the bound of the module docstring of x @ (w * s[:, None]).T in float64."""
    xd, wd, sd = x.double(), w.double(), s.double()  # on x's device: the 8B's shapes on a GPU
    ref = xd @ (wd * sd[:, None]).T
    mag = xd.abs() @ (wd.abs() * sd.abs()[:, None]).T
    u = {torch.bfloat16: 2.0**-7 if interpreted else 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    bound = u * ref.abs() + (x.shape[1] + 2) * 2.0**-24 * mag + 2.0**-24
    got = out.double()
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.isfinite(got).all(), "an output was not written (still NaN)"
    excess = (got - ref).abs() - bound
    assert (excess <= 0).all(), \
        f"{int((excess > 0).sum())} outputs beyond the bound, worst by {excess.max().item():.3g}"


@pytest.fixture
def poisoned_partials(monkeypatch):
    """Split products' partial sums start as NaN: a sum not written would show."""
    monkeypatch.setattr(triton_int8, "partial_sums",
                        lambda split, m, n, device: torch.full((split, m, n), float("nan"), device=device))


def poisoned_out(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_kernels_compute_the_dequantized_product(interpreted, poisoned_partials, m, dtype):
    """Every row count of the brief on a shape no block divides, with the configuration the op
    chooses (reduce for one row, dot for more) and small blocks that make K split in 3 slices
    (and tiles of 16 rows, the dot's least); every output written (poisoned before)."""
    n, k = SHAPES["odd"]
    x, w, s = operands(m, n, k, dtype, seed=m)
    configs = [kernel_config(m, n, k), KernelConfig("dot", 16, 64, block_m=max(16, 1 << (m - 1).bit_length()),
                                                    split=3, num_stages=2)]
    if m == 1:
        configs.append(KernelConfig("reduce", 8, 64, split=3))
    for config in configs:
        out = launch(x, w, s, config, out=poisoned_out(x, n))
        assert_within_bound(out, x, w, s, interpreted=True)


@pytest.mark.parametrize("fast_convert", [True, False])
@pytest.mark.parametrize("kind", ["reduce", "dot"])
def test_both_int8_conversions_give_the_same_products(interpreted, kind, fast_convert):
    """The exponent trick and Triton's cast both turn every int8 (-128..127) into its exact
    float: a weight holding all 256 values times a one-hot row is each value times its scale."""
    k = 256
    w = torch.arange(-128, 128, dtype=torch.int8).repeat(8, 1)  # (8, 256): every int8 in each row
    x = torch.zeros(1, k, dtype=torch.float16)
    s = torch.ones(8, dtype=torch.float32)
    for j in (0, 1, 127, 128, 255):
        x.zero_()[0, j] = 1.0
        out = launch(x, w, s, KernelConfig(kind, 8 if kind == "reduce" else 16, 64, fast_convert=fast_convert))
        assert torch.equal(out, torch.full((1, 8), j - 128.0, dtype=torch.float16)), j


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# "odd" too: test_kernels_compute_the_dequantized_product launches the same products on it (the
# op's own configuration, the same operands at each row count), among others
@pytest.mark.parametrize("name", sorted(set(SHAPES) - {"odd"}))
def test_every_row_count_on_every_shape(interpreted, poisoned_partials, name, dtype):
    """The 8B's products scaled down, and a narrow one, at every row count of the brief with the
    op's own configurations.  bfloat16 activations come with a float32 scale here (a scale of
    another dtype than the activations; the activations' own dtype for the scale is launched on
    the "odd" shape at every row count by test_kernels_compute_the_dequantized_product): on
    these shapes K is never split, and 1, 2-16 and 33-64 rows are the three configurations
    kernel_config makes (rows 8, once checked in a test of their own, take the configuration
    of 2-16)."""
    n, k = SHAPES[name]
    scale_dtype = torch.float32 if dtype == torch.bfloat16 else None
    assert len({kernel_config(m, n, k) for m in ROWS}) == 3
    for m in ROWS:
        x, w, s = operands(m, n, k, dtype, seed=m, scale_dtype=scale_dtype)
        assert_within_bound(launch(x, w, s, out=poisoned_out(x, n)), x, w, s, interpreted=True)


def test_splits_follow_the_grid():
    """kernel_config: one row takes the reduce kernel, more the dot with rows padded to a power
    of two from 16; K is split only where the output tiles are too few for the SMs, in slices
    of at least 4 blocks."""
    assert kernel_config(1, 4096, 4096).kind == "reduce"
    assert [kernel_config(m, 4096, 4096).block_m for m in (2, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    for m, (n, k) in [(m, shape) for m in (1, 8, 64) for shape in triton_int8.LLAMA_8B_SHAPES.values()]:
        c = kernel_config(m, n, k)
        assert c.split & (c.split - 1) == 0 and k // c.split >= 4 * c.block_k or c.split == 1
        assert c.split <= max(1, k // (16 * m))  # partial sums: at most half the weight's bytes
    assert kernel_config(8, 128256, 4096).split == 1  # 4,008 tiles: enough
    assert kernel_config(8, 4096, 4096).split > 1  # 128 tiles for 132 SMs
    # one row (batch-1 decoding) never pays the second kernel on the 8B's shapes
    assert all(kernel_config(1, n, k).split == 1 for n, k in triton_int8.LLAMA_8B_SHAPES.values())


def test_bad_operands_are_refused_with_what_to_do():
    x, w, s = operands(2, 16, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="flatten x's leading dimensions"):
        triton_int8.check_operands(x.unsqueeze(0), w, s)
    with pytest.raises(ValueError, match="do not match"):
        triton_int8.check_operands(x[:, :16], w, s)
    with pytest.raises(ValueError, match="bfloat16 or float16 activations"):
        triton_int8.check_operands(x.float(), w, s)
    with pytest.raises(ValueError, match="row-major"):
        triton_int8.check_operands(x, w.t().contiguous().t(), s)
    with pytest.raises(ValueError, match="int8 weight"):
        triton_int8.check_operands(x, w.to(torch.int16), s)
    # the fake implementation (shapes only) checks the same
    with pytest.raises(ValueError, match="do not match"):
        triton_int8.int8_weight_mm(x[:, :16].to("meta"), w.to("meta"), s.to("meta"))


def test_the_op_keeps_shapes_on_the_meta_device():
    x, w, s = (t.to("meta") for t in operands(5, 48, 64, torch.float16))
    out = triton_int8.int8_weight_mm(x, w, s)
    assert out.shape == (5, 48) and out.dtype == torch.float16 and out.device.type == "meta"


def test_int8_products_route_few_rows_to_the_kernels(interpreted):
    """int8_product_off_cpu: up to int8_direct_up_to_rows (64) rows through the op, exactly
    its output; more through the converted weight (the float product, within float32's
    rounding of it here)."""
    policy = KernelPolicy()
    assert policy.int8_direct_up_to_rows == triton_int8.MAX_ROWS == 64
    _, w, s = operands(1, 40, 96, torch.bfloat16)
    for rows, direct in ((1, True), (3, True), (64, True), (65, False)):
        x = torch.randn(rows, 1, 96, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = int8_product_off_cpu(x, w, s, policy)
        assert out.shape == (rows, 1, 40)
        kernel = launch(x.reshape(rows, 96), w, s).view(rows, 1, 40)
        converted = torch.nn.functional.linear(x, w.to(x.dtype)) * s
        assert torch.equal(out, kernel if direct else converted), rows


def _compiled_graph_ops(fn, *args):
    """Runs ``fn`` compiled with a backend that records the ATen graph's ops (AOTAutograd, no
    code generation); returns the output and the ops' names."""
    from torch._functorch.aot_autograd import aot_module_simplified

    names: list[str] = []

    def backend(gm, example_inputs):
        def record(graph, inputs):
            names.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
            return graph

        return aot_module_simplified(gm, example_inputs, fw_compiler=record)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return out, names


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_the_op_is_one_node_of_a_compiled_graph(interpreted):
    """Under torch.compile the op stays one opaque call (its fake implementation gives the
    shapes), and the compiled product equals the eager one bit for bit (same kernel)."""
    _, w, s = operands(1, 40, 96, torch.bfloat16)
    policy = KernelPolicy()
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out, ops = _compiled_graph_ops(lambda x: int8_product_off_cpu(x, w, s, policy) * 2, x)
        assert "llama.int8_weight_mm.default" in ops, ops
        assert not any("_to_copy" in op or "convert_element_type" in op for op in ops), ops  # no weight copy
        assert torch.equal(out, int8_product_off_cpu(x, w, s, policy) * 2)


@pytest.mark.slow
@pytest.mark.compile
def test_the_op_under_inductor_on_the_cpu(interpreted):
    """Inductor (C++ code around the op's opaque call; skipped without a C++ compiler) gives the
    eager result bit for bit, with rows a dynamic dimension."""
    from llama.runtime import host

    if host.cpp_compiler() is None:
        pytest.skip("no C++ compiler for Inductor's CPU code")
    _, w, s = operands(1, 40, 96, torch.bfloat16)
    policy = KernelPolicy()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(int8_product_off_cpu(x, w, s, policy)), dynamic=True)
    for rows in (2, 3, 7):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        assert torch.equal(compiled(x), torch.relu(launch(x, w, s)))


@pytest.mark.parametrize("rows", [1, 3, 31, 32, 40])
def test_cpu_int8_products_are_unchanged(monkeypatch, rows):
    """CPU tensors keep their kernels, Triton's interpreter or not: torch._weight_int8pack_mm
    below int8_convert_from_rows (32) rows, converted blocks from there (bit for bit), and no
    call of the Triton op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(triton_int8, "INTERPRETED", True)
    x, w, s = operands(rows, 48, 64, torch.bfloat16)
    policy = KernelPolicy()
    with Ops() as ops:
        out = int8_product(x, w, s, policy)
    if rows < policy.int8_convert_from_rows:
        expected = torch._weight_int8pack_mm(x, w, s)
    else:
        expected = linear_by_blocks(x, w, row_scale=s, block_bytes=policy.converted_block_bytes,
                                    block_dtype=policy.int8_block_dtype)
    assert torch.equal(out, expected)
    assert not any("int8_weight_mm" in f for f in ops.funcs), ops.funcs


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_cpu_products_never_import_triton():
    """Importing the library and running int8 products on the CPU (and on the meta device)
    imports no Triton, even with the interpreter's variable set: CPU-only installs need none."""
    code = ("import sys, torch\n"
            "from llama.layers.products import int8_product\n"
            "from llama.layers.policy import KernelPolicy\n"
            "x = torch.randn(2, 64).bfloat16(); w = torch.ones(8, 64, dtype=torch.int8); s = torch.ones(8).bfloat16()\n"
            "int8_product(x, w, s, KernelPolicy())\n"
            "int8_product(x.to('meta'), w.to('meta'), s.to('meta'), KernelPolicy())\n"
            "print('triton' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_without_triton_few_rows_off_the_cpu_convert_the_weight(monkeypatch):
    """Where Triton is missing, CUDA's int8 products of every row count take the converted
    weight (the op is never called); shown here for CPU tensors under the interpreter's variable."""
    monkeypatch.setattr(triton_int8, "INTERPRETED", True)
    monkeypatch.setattr(triton_int8, "TRITON_FOUND", False)
    assert not triton_int8.runs_on(torch.device("cuda")) and not triton_int8.runs_on(torch.device("cpu"))
    x, w, s = operands(2, 24, 32, torch.bfloat16)
    out = int8_product_off_cpu(x, w, s, KernelPolicy())
    assert torch.equal(out, torch.nn.functional.linear(x, w.to(x.dtype)) * s)


@pytest.mark.parametrize("interpret", [False, True])
def test_benchmark_dry_run_returns_well_formed_rows(monkeypatch, request, interpret):
    """benchmarks/bench_int8.py's benchmark_int8_kernels on the CPU, tiny shapes: a row per
    (shape, rows, kernel), the Triton column only under the interpreter, int4 where a group
    size is given, times and bandwidths consistent."""
    import bench_int8

    if interpret:
        request.getfixturevalue("interpreted")
    else:
        monkeypatch.setattr(triton_int8, "INTERPRETED", False)
    rows = bench_int8.benchmark_int8_kernels("cpu", shapes={"tiny": (32, 64)}, rows=(1, 2), repeat=2,
                                             int4_group_size=32)
    kernels = ["triton"] * interpret + ["int8pack_mm", "materialised"]
    assert [(r["rows"], r["kernel"]) for r in rows] == [(m, k) for m in (1, 2) for k in kernels] + \
           [(1, "dense"), (2, "dense"), (1, "int4"), (2, "int4")]
    for r in rows:
        assert r["shape"] == "tiny" and (r["n"], r["k"]) == (32, 64) and r["ms"] > 0 and "error" not in r
        per_weight = {"dense": 2, "int4": 0.5}.get(r["kernel"], 1)
        scales = 2 * (64 // 32) * 32 * 2 if r["kernel"] == "int4" else 0  # a bf16 scale and zero per group and row
        assert r["weight_bytes"] == 32 * 64 * per_weight + scales
        assert r["gb_s"] == pytest.approx(r["weight_bytes"] / (r["ms"] / 1e3) / 1e9)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_on_cuda(poisoned_partials, dtype):
    """The compiled kernels on the GPU: the 8B's shapes at the brief's row counts, the op's own
    configurations, within the bound (rounding to nearest)."""
    pytest.importorskip("triton")
    for name, (n, k) in triton_int8.LLAMA_8B_SHAPES.items():
        for m in ROWS:
            x, w, s = operands(m, n, k, dtype, device="cuda", seed=m)
            assert_within_bound(launch(x, w, s, out=poisoned_out(x, n)), x, w, s, interpreted=False)


@pytest.mark.slow
def test_bench_int8_sweep_dry_run(interpreted, tmp_path, capsys):
    """benchmarks/bench_int8.py --sweep on the CPU: every configuration it times (the first of
    each kind, with K split every way it allows) computes the product within the bound, and
    the table names a best configuration per shape and row count."""
    import json

    import bench_int8

    out = tmp_path / "sweep.jsonl"
    assert bench_int8.main(["--device", "cpu", "--shapes", "tiny", "--rows", "1,3", "--sweep", "--candidates", "1",
                            "--repeat", "1", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"reduce", "dot"} and {r["split"] for r in rows} > {1}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert sum(r["default"] for r in rows) == 4  # kernel_config's own, for each (shape, rows)
    assert capsys.readouterr().out.count("| tiny_") == 4


@pytest.mark.slow
def test_kernels_compile_for_an_h100_without_spills_or_slow_conversions(tmp_path):
    """benchmarks/bench_int8.py --compile_only: kernel_config's kernels for the 8B's shapes at 1,
    8, 32 and 64 rows, compiled for sm_90 by Triton's own ptxas (no GPU needed; a process without
    the interpreter), spill nothing, fit an H100's shared memory, convert int8 without the
    quarter-rate I2F instruction, load the weight 16 bytes at a time (one row) or through
    cp.async pipelines into tensor-core products (mma.sync for 16 rows, Hopper's wgmma from 32)."""
    import json

    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = tmp_path / "compiled.jsonl"
    result = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "bench_int8.py"),
                             "--compile_only", "--rows", "1,8,32,64", "--json", str(out)],
                            capture_output=True, text=True, env=env, timeout=900)
    if result.returncode == 3:  # bench_int8.EXIT_NO_COMPILER
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["rows"], r["kernel"]) for r in rows} >= {(1, "reduce"), (8, "dot"), (32, "dot"), (64, "dot"),
                                                         (8, "add_splits")}
    for r in rows:
        assert r["local_bytes"] == 0 and r["registers"] <= 255 and r["shared_bytes"] <= 227 * 1024, r
        if r["kernel"] == "reduce":
            assert r["I2F"] == 0 and r["LDG.E.128"] >= 4, r
        elif r["kernel"] == "dot":
            assert r["I2F"] == 0 and r["LDGSTS"] > 0, r
            assert (r["HMMA"] > 0) if r["block_m"] == 16 else (r["HGMMA"] > 0), r
