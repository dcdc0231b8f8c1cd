"""benchmarks/gpu_check.py: its one line where there is no CUDA, its targets, and a dry run of
every part on the CPU (the GPU runs it on the 8B shape; here the script itself is checked)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402
from helpers import DEVICES  # noqa: E402
from llama.engine.speculative import RowProposer  # noqa: E402


def test_without_cuda_it_says_so_in_one_line_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "no CUDA device here" in out.out and "--device cpu" in out.out
    assert not out.err and not list(tmp_path.iterdir())  # nothing written


def test_unknown_parts_and_variants_are_refused(capsys):
    for flags in (["--parts", "parity,speed"], ["--variants", "fp8"], ["--parity_rows", "0"]):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(flags)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown ['fp8']" in err and "--parity_rows: expected a positive whole number, got '0'" in err


def test_targets_compare_compiled_variants_at_batch_1():
    def row(variant, tok_s, share=None):
        return {"variant": variant, "tok_s": tok_s, "bandwidth_share": share}

    report = {"parts": {"decode": {"status": "ok", "rows": [
        row("bf16", 50.0, 0.4), row("bf16-compiled", 100.0, 0.8), row("int8-compiled", 170.0),
        {"variant": "int4-compiled", "error": "RuntimeError: no kernel"}]},
        "parity": {"status": "ok", "passed": True}}}
    got = [(t["value"], t["met"]) for t in gpu_check.targets(report)]
    assert got == [(0.8, True), (1.7, True), (None, None), (True, True), (None, None), (None, None)]
    report["parts"]["parity"] = {"status": "failed", "error": "..."}
    assert gpu_check.targets(report)[3]["met"] is None  # not measured is not "missed"
    # paged reads: FlexAttention's best size against gather decides; sizes where it did not run are not counted
    report["parts"]["paged"] = {"status": "ok", "rows": [
        {"flex_over_gather": 1.3}, {"flex_over_gather": 0.95}, {"flex_over_gather": None},
        {"rows": 8, "context": 4096, "error": "OutOfMemoryError"}]}
    assert (gpu_check.targets(report)[4]["value"], gpu_check.targets(report)[4]["met"]) == (0.95, True)
    report["parts"]["paged"]["rows"][0]["flex_over_gather"] = 0.5
    assert (gpu_check.targets(report)[4]["value"], gpu_check.targets(report)[4]["met"]) == (0.5, False)
    # speculation: its slowest row against none decides (5 % slower at most); rows not measured are not counted
    report["parts"]["speculative"] = {"status": "ok", "rows": [
        {"row": "b", "speedup": 2.4}, {"row": "c", "speedup": 0.96}, {"row": "d", "skipped": gpu_check.NOT_RUN}]}
    assert (gpu_check.targets(report)[5]["value"], gpu_check.targets(report)[5]["met"]) == (0.96, True)
    report["parts"]["speculative"]["rows"][1]["speedup"] = 0.9
    assert (gpu_check.targets(report)[5]["value"], gpu_check.targets(report)[5]["met"]) == (0.9, False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One --workdir for this module's runs of the checks on the tiny config: the random
    checkpoint of the full tiny shape, written by the first run that needs it, is reused by
    the others (write_checkpoint reuses one of the same params.json)."""
    return tmp_path_factory.mktemp("gpu_check")


@pytest.mark.slow  # three processes, six small models, one compilation of the model's step
@pytest.mark.compile
@pytest.mark.parametrize("device", DEVICES)  # on CUDA: the script's GPU paths on the tiny shape
def test_every_part_runs_on_the_tiny_shape(tmp_path, workdir, device):
    out = tmp_path / "report.json"
    variants = ["bf16", "bf16-compiled", "int4"]
    # The least work the flags allow where the sizes are not what is checked: a 1 MiB bandwidth
    # probe, each step or product timed once, the paged reads at one size.  The parity model
    # has the tiny config's two layers and the decode part's cache (one row of 16 + 16 + 8
    # positions = --max_seq_len 40: the decode part builds bf16-compiled for batch 1, as the
    # batch part runs only bf16), so that bf16-compiled's decoding step compiles one graph
    # (one row) once: the decode part's build finds it in Inductor's disk cache.  (Parity on
    # one row of 32 positions compares as many positions as on two of 16, with a graph fewer
    # to compile.)  Speculative decoding eager (its compiled verification step is tested in
    # test_speculative.py).  The server eager on the CPU: its compiled step would be two more
    # graphs (1 and 2 rows, 14 s cold), and the decode part has compiled this model's step.
    serve_compile = ["--no-serve_compile"] if device == "cpu" else []
    cmd = [sys.executable, str(Path(gpu_check.__file__)), "--device", device, "--config", "tiny", "--plan", "all",
           "--variants", ",".join(variants), "--batch_variants", "bf16", "--batches", "1,2", "--clients", "2",
           "--parity_layers", "2", "--parity_rows", "1", "--parity_prompt", "16", "--parity_steps", "16",
           "--max_seq_len", "40",
           "--bandwidth_mib", "1", "--step_repeat", "1", "--paged_rows", "2", "--paged_reps", "1",
           "--kernel_repeat", "1", "--spec_variant", "bf16",
           *serve_compile, "--workdir", str(workdir), "--json", str(out)]
    # (Triton's interpreter off: its int8 kernel over the 128k-row output matrix would take minutes)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert report["dry_run"] == (device == "cpu") and report["config"] == "tiny" and parts["parity"]["layers"] == 2
    assert parts["parity"]["sequences"] == 1 and parts["parity"]["decode_steps"] == 16
    assert parts["decode"]["max_seq_len"] == 40
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(gpu_check.PARTS, "ok")
    assert all(p["seconds"] > 0 for p in parts.values())
    for name in gpu_check.PARTS:
        assert f"## {name}: ok" in run.stdout
    assert parts["serve"]["command"].endswith("--no-compile") == (device == "cpu"), parts["serve"]["command"]

    parity = {r["variant"]: r for r in parts["parity"]["rows"]}
    assert list(parity) == variants and parts["parity"]["passed"]
    for r in parity.values():
        assert r["passed"] and 0 < r["prefill_rel_err"] < gpu_check.KERNEL_REL_ERR, r
        assert 0 < r["decode_rel_err"] < gpu_check.KERNEL_REL_ERR and 0 <= r["decode_top1"] <= 1, r
    assert parity["bf16-compiled"]["compiled"] and not parity["bf16"]["compiled"]
    # 4 bits cost more than bfloat16 rounding against the float32 model, as they must
    assert parity["int4"]["rel_err_vs_float32"] > 5 * parity["bf16"]["rel_err_vs_float32"]

    decode = {r["variant"]: r for r in parts["decode"]["rows"]}
    assert list(decode) == variants and report["bandwidth_bytes_per_s"] > 0

    # paged reads: the size asked for timed each way but FlexAttention (not asked for in the dry run), gather included
    paged = parts["paged"]["rows"]
    assert [(r["rows"], r["context"]) for r in paged] == [(2, 64)]
    for r in paged:
        assert set(r["ms"]) == {"gather", "contiguous", "gather compiled", "contiguous compiled"}, r
        assert all(ms > 0 for ms in r["ms"].values()) and r["fastest"] == min(r["ms"], key=r["ms"].get)
        assert r["fastest_over_gather"] == pytest.approx(r["ms"][r["fastest"]] / r["ms"]["gather"])
        assert r["flex_over_gather"] is None
    assert "## paged: ok" in run.stdout and "fastest / gather" in run.stdout
    # the products alone: every matrix of the tiny layer at 1 and 2 rows, every way timed, none failed
    kernels = parts["kernels"]["rows"]
    shapes = {(r["shape"], r["n"], r["k"]) for r in kernels}
    assert shapes == {("wq|wk|wv", 4 * 64 + 2 * (2 * 64), 256), ("wo", 256, 256), ("w1|w3", 2 * 768, 256),
                      ("w2", 256, 768), ("output", 128256, 256)}  # wq: 4 heads of 64 | wk, wv: 2 each; FFN 768
    ways = {"dense", "materialised", "int8pack_mm", "int4"}  # (Triton's only on a GPU or its interpreter)
    assert sorted((r["shape"], r["rows"], r["kernel"]) for r in kernels) == \
        sorted((s, m, k) for s, _, _ in shapes for m in (1, 2) for k in ways)
    assert all(r["ms"] > 0 and "error" not in r for r in kernels)
    assert "| wo (256 x 256) | 1 |" in run.stdout
    # each part's table went to the tables file as it ended, in the order run
    tables = Path(report["tables"]).read_text()
    assert [line.split(":")[0] for line in tables.splitlines() if line.startswith("## ")] == \
        [f"## {name}" for name in ("parity", "decode", "batch", "profile", "serve", "paged", "kernels", "speculative")]
    # the profile shares decode's builds: a row per variant, each step's operators in groups
    assert [r["variant"] for r in parts["profile"]["rows"]] == variants
    for r in parts["profile"]["rows"]:
        assert r["step_alone"]["total_us"] > 0 and r["engine_step"]["groups_us"]["sampling"] > 0, r
        assert r["host"]["token_us"] > r["host"]["phases_us"]["plan"] > 0, r
    # the eager bf16 step profiled in detail: its operators by group (what the GPU's kernels will be)
    row = parts["profile"]["rows"][0]
    alone, engine = row["step_alone"], row["engine_step"]
    for p in (alone, engine):
        assert sum(p["groups_us"].values()) == pytest.approx(p["total_us"])
        assert p["groups_us"]["products"] > 0 and p["groups_us"]["attention"] > 0, p  # aten::linear, SDPA
    # the sampler's operators (a sum, isnan, argmax...) run in the engine's step, never in the step alone
    assert alone["groups_us"]["sampling"] == 0 < engine["groups_us"]["sampling"]
    host = row["host"]
    assert all(host["phases_us"][p] > 0 for p in ("plan", "staging", "forward", "sampling", "update")), host
    assert host["token_us"] > host["phases_us"]["forward"] and (host["gpu_idle_us"] is None) == (device == "cpu")
    assert "## profile: ok" in run.stdout and "| bf16 | step alone |" in run.stdout
    for r in decode.values():
        assert r["tok_s"] > 0 and r["ms_per_step"] > 0 and r["step_alone_ms"] > 0 and r["bandwidth_share"] > 0, r
    assert decode["int4"]["weight_bytes"] < decode["bf16"]["weight_bytes"] / 3
    assert decode["bf16-compiled"]["compiled"] and decode["bf16-compiled"]["graphs"] >= 1
    if device == "cpu":  # one row, one graph: the warm-up's serves parity's steps and the steps timed alone
        assert parity["bf16-compiled"]["graphs"] == decode["bf16-compiled"]["graphs"] == 1

    assert [(r["variant"], r["batch"]) for r in parts["batch"]["rows"]] == [("bf16", 1), ("bf16", 2)]
    assert all(r["tok_s"] > 0 for r in parts["batch"]["rows"])

    serve = parts["serve"]
    assert serve["streams"] == 2 and serve["tok_s"] > 0
    assert 0 < serve["ttft_p50_ms"] <= serve["ttft_p99_ms"] and 0 < serve["itl_p50_ms"] <= serve["itl_p99_ms"]
    assert "--max_batch_size 2" in serve["command"]

    # speculative decoding, with a random draft of its own (DRAFT_CONFIGS): every row measured, the
    # replayed proposals accepted, the always-wrong ones and the random draft's (a 128k vocabulary) not
    spec = {r["row"]: r for r in parts["speculative"]["rows"]}
    assert list(spec) == gpu_check.SPEC_ROWS and all(r["tok_s"] > 0 for r in spec.values())
    assert parts["speculative"]["draft"] == {"dim": 64, "n_layers": 1}
    assert spec["b"]["proposed"] > 0 and spec["b"]["accepted"] >= 0.75 * spec["b"]["proposed"]
    for wrong in ("c", "d"):
        assert spec[wrong]["proposed"] > 0 and spec[wrong]["accepted"] == 0, spec[wrong]
    assert spec["e"]["proposed"] > 0  # only where the random draft itself proposed

    # measured where their variants ran (int8-compiled did not; FlexAttention is not timed in the dry run)
    assert [t["value"] is not None for t in report["targets"]] == [True, False, False, True, False, True]
    assert report["targets"][3]["value"] is True


def test_the_speculative_part_runs_alone(tmp_path, llama3_checkpoint, capsys):
    """The speculative part as the GPU runs it (batch 1, the target built speculating with a
    draft, each of bench_speculative's rows against none, its report and table), eager, on the
    test checkpoint with its small vocabulary, which is also the draft: a draft that agrees.
    (On the tiny config's checkpoints, with a random draft of its own, in
    test_every_part_runs_on_the_tiny_shape.)"""
    folder = tmp_path / "ckpt"  # the checkpoint as the checks write theirs: tokenizer.model beside the weights
    folder.mkdir()
    for f in llama3_checkpoint.ckpt_dir.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "tokenizer.model").symlink_to(llama3_checkpoint.tokenizer_path)
    written = []

    def write_checkpoint(out, params, device, seed=0):
        written.append(Path(out).name)
        return folder, 0.0

    out = tmp_path / "report.json"
    threads = torch.get_num_threads()  # (the engine may set this process's: given back for the tests after)
    torch.set_num_threads(1)  # a tiny model's products: one thread does them without waiting on another
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(gpu_check, "write_checkpoint", write_checkpoint)
            code = gpu_check.main(["--device", "cpu", "--config", "tiny", "--plan", "speculative", "--spec_variant",
                                   "bf16", "--bandwidth_mib", "1", "--workdir", str(tmp_path), "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err[-3000:]
    assert written == ["tiny", "tiny-draft"]
    report = json.loads(out.read_text())
    assert [name for name, p in report["parts"].items() if p["status"] != "skipped"] == ["speculative"]
    part = report["parts"]["speculative"]
    assert part["status"] == "ok" and part["variant"] == "bf16" and not part["compiled"] and part["k"] == 4
    params = llama3_checkpoint.params
    assert part["draft"] == {"dim": params["dim"], "n_layers": params["n_layers"]} and part["rounds"] == 1
    assert part["verified_shapes"] == [[1, 2], [1, 3], [1, 4], [1, 5]]  # one row, 1 to k proposals
    rows = {r["row"]: r for r in part["rows"]}
    assert list(rows) == gpu_check.SPEC_ROWS
    for r in rows.values():
        assert r["tok_s"] > 0 and r["speedup"] == pytest.approx(r["tok_s"] / part["none_tok_s"]), r
        assert 0 <= r["accepted"] <= r["proposed"], r
    # replayed, and the target as its own draft: right (bfloat16 passes of 1 and of k + 1 positions may
    # round a near tie apart)
    for right in ("b", "d"):
        assert rows[right]["proposed"] > 0 and rows[right]["accepted"] >= 0.75 * rows[right]["proposed"], rows[right]
    assert rows["c"]["proposed"] > 0 and rows["c"]["accepted"] == 0  # a token the reply never holds
    assert rows["e"]["proposed"] > 0  # only where the draft itself proposed (DraftReplay)
    assert report["targets"][-1]["value"] == min(r["speedup"] for r in rows.values())
    printed = capsys.readouterr().out
    assert "## speculative: ok" in printed and "| (b) | always right |" in printed


def test_the_partly_right_proposer_and_the_draft_s_cost_with_its_proposals():
    """bench_speculative's proposers for random weights: (p) keeps each replayed token with the
    probability it is given (seeded), and (e) runs the draft for its cost but proposes the
    replay's tokens, as many as the draft proposed, where the draft proposed."""
    import bench_speculative

    bench = bench_speculative.BenchProposer(seed=5)
    bench.reference, bench.wrong_token = [[1, 2] + list(range(10, 1010))], 7
    bench.right = 0.7
    proposed = [t for _ in range(500) for t in bench.propose([1, 2], 4)]
    kept = sum(t == want for t, want in zip(proposed, [10, 11, 12, 13] * 500)) / len(proposed)
    assert set(proposed) <= {7, 10, 11, 12, 13} and abs(kept - 0.7) < 0.04  # 2000 draws: 4 sigma ~ 0.04
    bench.right = 1.0
    assert bench.propose([1, 2, 10], 3) == [11, 12, 13] and bench.propose([5], 3) == []

    class Request:
        def __init__(self, id, tokens):
            self.id, self._tokens = id, tokens

        def tokens_so_far(self):
            return self._tokens

    class Draft:
        released: list = []

        def propose_rows(self, rows):
            self.asked = [(r.id, k) for r, k in rows]
            return {1: [99, 98], 2: []}, {1: "probs"}  # request 3: no room

        def release(self, request_id):
            self.released.append(request_id)

    draft = Draft()
    replayed = bench_speculative.DraftReplay(draft, bench)
    assert isinstance(replayed, RowProposer)  # what the Speculator asks of a draft
    rows = [(Request(1, [1, 2]), 4), (Request(2, [1, 2]), 4), (Request(3, [1, 2]), 4)]
    assert replayed.propose_rows(rows) == ({1: [10, 11]}, {})
    assert draft.asked == [(1, 4), (2, 4), (3, 4)]
    replayed.release(1)
    assert draft.released == [1]


def test_parity_layers_are_honoured_and_capped_at_the_config_s():
    """--parity_layers sets the parity model's depth (the config's widths), at most the config's
    own layers: read from the checkpoint the part writes (stopped there)."""
    class Written(Exception):
        pass

    seen = []

    def write_checkpoint(out, params, device, seed=0):
        seen.append(params)
        raise Written

    for layers, want in ((1, 1), (2, 2), (9, 2)):  # tiny has 2 layers
        args = gpu_check.parse_args(["--device", "cpu", "--config", "tiny", "--parity_layers", str(layers)])
        assert args.parity_layers == layers
        with pytest.MonkeyPatch.context() as m:
            m.setattr(gpu_check, "write_checkpoint", write_checkpoint)
            with pytest.raises(Written):
                gpu_check.run_parity(args, torch.device("cpu"), None, None)
        assert seen[-1] == {**gpu_check.CONFIGS["tiny"], "n_layers": want}


def test_plans_choose_parts_and_variants_and_flags_override_them():
    first = gpu_check.parse_args([])
    assert first.plan == "first" and first.parts == ["parity", "decode", "kernels"]
    assert first.variants == list(gpu_check.VARIANTS)  # parity: bf16 eager and compiled, int8 and int4 both ways
    assert first.decode_variants == ["bf16-compiled", "int8-compiled", "int4-compiled"]
    assert gpu_check.parse_args(["--plan", "batch"]).batch_variants == gpu_check.COMPILED
    mine = gpu_check.parse_args(["--parts", "decode", "--variants", "bf16"])
    assert mine.parts == ["decode"] and mine.decode_variants == ["bf16"]  # decode follows --variants
    assert gpu_check.parse_args(["--plan", "all"]).parts == list(gpu_check.PARTS)
    profile = gpu_check.parse_args(["--plan", "profile"])  # decode again, and the profile sharing its builds
    assert profile.parts == ["decode", "profile"] and profile.decode_variants == gpu_check.COMPILED
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--deadline_s", "0"])


@pytest.mark.parametrize("name, phase, group", [
    # Hopper's cuBLAS (nvjet), cuBLASLt (xmma), a cuBLAS matrix-vector product, torch's int4 kernel,
    # the library's Triton int8 kernels and its split-K sum, Inductor's template and one-row product
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", None, "products"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", None, "products"),
    ("gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>", None, "products"),
    ("void at::native::(anonymous namespace)::tinygemm_m16n8k16_chunk_kernel<...>", None, "products"),
    ("int8_mm_reduce", None, "products"), ("add_splits", None, "products"),
    ("triton_tem_fused_mm_0", None, "products"), ("triton_red_fused_mm_3", None, "products"),
    ("aten::mm", None, "products"), ("aten::_weight_int4pack_mm_for_cpu", None, "products"),
    ("quantized::linear_dynamic_fp16", None, "products"), ("llama::packed_linear", None, "products"),
    ("flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", None, "attention"),
    ("triton_per_fused__softmax_5", None, "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", None, "attention"),
    # Inductor's fused RMSNorm holds _to_copy in its name: still a norm, not a copy
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", None, "norms+elementwise"),
    ("triton_poi_fused_add_mul_silu_2", None, "norms+elementwise"), ("aten::mul", None, "norms+elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", None,
     "norms+elementwise"),
    ("Memcpy HtoD (Pinned -> Device)", None, "copies"), ("Memset (Device)", None, "copies"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", None, "copies"),
    ("void at::native::index_elementwise_kernel<128, 4>", None, "copies"), ("aten::copy_", None, "copies"),
    # whatever the sampler launches is sampling
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
     "sampling", "sampling"), ("aten::isnan", "sampling", "sampling"),
    ("Torch-Compiled Region: 0/0", None, "other"), ("cudaGraphLaunch", None, "other"),
])
def test_kernels_are_grouped_by_name_and_by_the_phase_that_launched_them(name, phase, group):
    assert gpu_check.kernel_group(name, phase) == group


def test_the_profile_table_shows_each_group_s_share_and_the_host_s_phases():
    from bench_host import PHASES

    groups = dict(zip(gpu_check.KERNEL_GROUPS, [300.0, 50.0, 100.0, 0.0, 25.0, 25.0]))  # 500 in all
    part = {"status": "ok", "profile_steps": 20, "host_steps": 50, "rows": [
        {"variant": "bf16-compiled", "step_alone": {"groups_us": groups, "total_us": 500.0,
                                                    "top": [{"name": "nvjet_x", "group": "products", "us": 250.0,
                                                             "calls": 2.0}]},
         "engine_step": {"groups_us": {**groups, "sampling": 100.0}, "total_us": 600.0, "top": []},
         "host": {"phases_us": dict.fromkeys(PHASES, 10.0), "token_us": 900.0, "gpu_busy_us": 600.0,
                  "gpu_idle_us": 300.0}},
        {"variant": "int4-compiled", "error": "RuntimeError: out of memory"}]}
    lines = gpu_check.profile_table(part, "8b")
    assert "| bf16-compiled | step alone | 300 (60%) | 50 (10%) | 100 (20%) | 0 (0%) | 25 (5%) | 25 (5%) | 500 |" \
        in lines
    assert "| bf16-compiled | engine step | 300 (50%) | 50 (8%) | 100 (17%) | 100 (17%) | 25 (4%) | 25 (4%) | 600 |" \
        in lines
    assert "| bf16-compiled | `nvjet_x` | products | 250.0 (2) | 50.0% |" in lines
    assert "| bf16-compiled | " + " | ".join(["10"] * len(PHASES)) + " | 900 | 600 | 300 |" in lines
    assert any(line.startswith("| int4-compiled | error: RuntimeError: out of memory") for line in lines)


def test_the_profile_part_runs_alone_with_the_builds_its_own(monkeypatch, tmp_path):
    """Without the decode part (``--parts profile``), the profile part builds each variant
    itself and its build's seconds count there; decode and batch stay empty.  (The profiling
    itself runs in test_every_part_runs_on_the_tiny_shape, on decode's builds.)"""
    import common

    built = []

    class FakeLlama:
        compiled = False
        model = None

    def build(ckpt, variant, device, max_seq_len, max_batch_size, group_size, speculative=None):
        built.append((variant, max_batch_size))
        time.sleep(0.01)
        return FakeLlama()

    def profile_variant(llama, args):
        return {"step_alone": {"total_us": 1.0}}

    class Report:
        def part_progress(self, name, part):
            pass

    monkeypatch.setattr(gpu_check, "write_checkpoint", lambda out, params, device, seed=0: (out, 0.0))
    monkeypatch.setattr(gpu_check, "build", build)
    monkeypatch.setattr(gpu_check, "profile_variant", profile_variant)
    monkeypatch.setattr(common, "decode_weight_bytes", lambda model: 1)
    args = gpu_check.parse_args(["--device", "cpu", "--config", "tiny", "--parts", "profile", "--variants", "bf16",
                                 "--workdir", str(tmp_path)])
    out = gpu_check.run_speed(args, torch.device("cpu"), {"profile"}, 1e9, Report(), gpu_check.Deadline(0, None))
    assert built == [("bf16", 1)]  # one row: no batch part
    assert out["profile"]["rows"] == [{"variant": "bf16", "compiled": False, "step_alone": {"total_us": 1.0}}]
    assert out["profile"]["seconds"] >= 0.01 and out["decode"]["rows"] == [] and out["batch"]["rows"] == []
    assert out["decode"]["seconds"] == 0.0


def test_a_device_without_an_index_is_the_current_device(monkeypatch):
    """``cuda`` means the current GPU everywhere: the checks give it its index, and the library's
    process setup selects nothing for it (torch.cuda.set_device refuses a device without one)."""
    from llama.runtime import distributed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert gpu_check.resolve_check_device("cuda") == torch.device("cuda", 3)
    assert gpu_check.resolve_check_device("cuda:1") == torch.device("cuda", 1)
    assert gpu_check.resolve_check_device("cpu") == torch.device("cpu")
    selected = []

    def set_device(device):
        if torch.device(device).index is None:  # what torch.cuda.set_device does with one
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")
        selected.append(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    distributed.select_cuda_device(torch.device("cuda"))
    distributed.select_cuda_device(torch.device("cuda", 1))
    assert selected == [torch.device("cuda", 1)]


def _fake_parity(args, device, report, deadline):
    return {"layers": 2, "prompt_tokens": 8, "decode_steps": 4, "passed": True, "rows": [
        {"variant": "bf16", "prefill_rel_err": 0.01, "prefill_top1": 1.0, "decode_rel_err": 0.01, "decode_top1": 1.0,
         "rel_err_vs_float32": 0.01, "top1_vs_float32": 1.0, "passed": True}]}


def test_each_part_is_written_the_moment_it_ends(monkeypatch, tmp_path):
    """A part's table and JSON are on disk before the next part starts, and a part that fails is
    recorded without taking the earlier ones with it."""
    json_path = tmp_path / "r.json"
    seen = {}

    def failing_paged(args, device, report, deadline):
        seen["json"] = json.loads(json_path.read_text())
        seen["tables"] = json_path.with_suffix(".md").read_text()
        raise RuntimeError("the device fell over")

    monkeypatch.setitem(gpu_check.PART_RUNNERS, "parity", _fake_parity)
    monkeypatch.setitem(gpu_check.PART_RUNNERS, "paged", failing_paged)
    code = gpu_check.main(["--device", "cpu", "--config", "tiny", "--parts", "parity,paged", "--workdir",
                           str(tmp_path), "--json", str(json_path), "--bandwidth_mib", "1"])
    assert code == 1
    assert seen["json"]["parts"]["parity"]["status"] == "ok" and seen["json"]["parts"]["parity"]["passed"]
    assert seen["json"]["parts"]["paged"]["status"] == "skipped"  # not started yet when parity was written
    assert "## parity: ok" in seen["tables"] and "| bf16 | 0.0100 |" in seen["tables"]
    final = json.loads(json_path.read_text())
    assert final["parts"]["paged"]["status"] == "failed" and "the device fell over" in final["parts"]["paged"]["error"]
    assert final["parts"]["parity"]["status"] == "ok"


def test_parts_after_the_deadline_are_recorded_as_not_run(monkeypatch, tmp_path):
    def parity_past_the_deadline(args, device, report, deadline):
        assert not deadline.passed()  # (an hour: not before this part)
        deadline.at = time.perf_counter()  # the part took until the deadline
        return _fake_parity(args, device, report, deadline)

    monkeypatch.setitem(gpu_check.PART_RUNNERS, "parity", parity_past_the_deadline)
    json_path = tmp_path / "r.json"
    code = gpu_check.main(["--device", "cpu", "--config", "tiny", "--parts", "parity,kernels", "--deadline_s", "3600",
                           "--workdir", str(tmp_path), "--json", str(json_path), "--bandwidth_mib", "1"])
    assert code == 0
    parts = json.loads(json_path.read_text())["parts"]
    assert parts["parity"]["status"] == "ok" and parts["kernels"]["status"] == gpu_check.NOT_RUN


DRIVER = """
import sys, time
sys.path.insert(0, {benchmarks!r})
import gpu_check

def measured_part(args, device, report, deadline):
    # what a parity part that passed returns (no model: what the signal must keep is the report)
    return {fake_parity!r}

def hanging_part(args, device, report, deadline):
    child = gpu_check.spawn(["sleep", "600"])
    open({pid_file!r}, "w").write(str(child.pid))
    time.sleep(600)

gpu_check.PART_RUNNERS["parity"] = measured_part
gpu_check.PART_RUNNERS["paged"] = hanging_part
sys.exit(gpu_check.main(["--device", "cpu", "--config", "tiny", "--parts", {parts!r}, "--variants", "bf16",
                         "--workdir", {workdir!r}, "--json", {json_path!r}, "--bandwidth_mib", "1"]))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by its parent) has ended too
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _run_until_child_started(tmp_path, parts: str):
    """The checks running ``parts`` (paged last: it starts a child and hangs), once the child runs."""
    pid_file, json_path = tmp_path / "child.pid", tmp_path / "r.json"
    code = DRIVER.format(benchmarks=str(Path(gpu_check.__file__).parent), pid_file=str(pid_file),
                         workdir=str(tmp_path / "work"), json_path=str(json_path), parts=parts,
                         fake_parity=_fake_parity(None, None, None, None))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while not pid_file.exists() or not pid_file.read_text():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the hanging part never started"
        time.sleep(0.1)
    return proc, int(pid_file.read_text()), json_path


@pytest.mark.slow  # a process of its own (torch imported), ended by a signal
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")
def test_sigterm_keeps_what_was_measured_and_leaves_no_process_behind(tmp_path):
    """A part that ended (parity, its result given: what is checked is that the report keeps
    it, not the measuring) stays in the report when SIGTERM stops a later part, which is
    recorded as interrupted, and the later part's child process is ended."""
    proc, child, json_path = _run_until_child_started(tmp_path, "parity,paged")
    assert _alive(child)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the process the part started outlived the checks"
    report = json.loads(json_path.read_text())
    assert report["parts"]["parity"]["status"] == "ok" and report["parts"]["parity"]["passed"]
    assert report["parts"]["paged"]["status"] == f"interrupted by signal {int(signal.SIGTERM)}"
    assert "## parity: ok" in out and "stopped by signal" in out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_ends_even_when_the_checks_are_killed_outright(tmp_path):
    # the hanging part alone: nothing measured before it matters when no handler runs
    proc, child, _ = _run_until_child_started(tmp_path, "paged")
    proc.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal must end the child
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_checkpoints_go_to_memory_only_where_it_has_room(tmp_path, monkeypatch):
    assert gpu_check.default_workdir(tmp_path / "missing") == "/tmp/gpu_check"
    free = {"gib": 100}
    monkeypatch.setattr(gpu_check.shutil, "disk_usage", lambda path: type("U", (), {"free": free["gib"] * 2**30})())
    assert gpu_check.default_workdir(tmp_path) == str(tmp_path / "gpu_check")
    free["gib"] = gpu_check.WORKDIR_IN_MEMORY_GIB - 1  # a container's small /dev/shm, say
    assert gpu_check.default_workdir(tmp_path) == "/tmp/gpu_check"
