"""benchmarks/gpu_check.py: its one line where there is no CUDA, its targets, and a dry run of
every part on the CPU (the GPU runs it on the 8B shape; here the script itself is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402
from helpers import DEVICES  # noqa: E402


def test_without_cuda_it_says_so_in_one_line_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "no CUDA device here" in out.out and "--device cpu" in out.out
    assert not out.err and not list(tmp_path.iterdir())  # nothing written


def test_unknown_parts_and_variants_are_refused(capsys):
    for flags in (["--parts", "parity,speed"], ["--variants", "fp8"]):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(flags)
        assert e.value.code == 2
    assert "unknown ['fp8']" in capsys.readouterr().err


def test_targets_compare_compiled_variants_at_batch_1():
    def row(variant, tok_s, share=None):
        return {"variant": variant, "tok_s": tok_s, "bandwidth_share": share}

    report = {"parts": {"decode": {"status": "ok", "rows": [
        row("bf16", 50.0, 0.4), row("bf16-compiled", 100.0, 0.8), row("int8-compiled", 170.0),
        {"variant": "int4-compiled", "error": "RuntimeError: no kernel"}]},
        "parity": {"status": "ok", "passed": True}}}
    got = [(t["value"], t["met"]) for t in gpu_check.targets(report)]
    assert got == [(0.8, True), (1.7, True), (None, None), (True, True), (None, None)]
    report["parts"]["parity"] = {"status": "failed", "error": "..."}
    assert gpu_check.targets(report)[3]["met"] is None  # not measured is not "missed"
    # paged reads: FlexAttention's best size against gather decides; sizes where it did not run are not counted
    report["parts"]["paged"] = {"status": "ok", "rows": [
        {"flex_over_gather": 1.3}, {"flex_over_gather": 0.95}, {"flex_over_gather": None},
        {"rows": 8, "context": 4096, "error": "OutOfMemoryError"}]}
    assert (gpu_check.targets(report)[-1]["value"], gpu_check.targets(report)[-1]["met"]) == (0.95, True)
    report["parts"]["paged"]["rows"][0]["flex_over_gather"] = 0.5
    assert (gpu_check.targets(report)[-1]["value"], gpu_check.targets(report)[-1]["met"]) == (0.5, False)


@pytest.mark.slow  # ~35 s on 2 CPUs: three processes, six small models, one compilation
@pytest.mark.compile
@pytest.mark.parametrize("device", DEVICES)  # on CUDA: the script's GPU paths on the tiny shape
def test_every_part_runs_on_the_tiny_shape(tmp_path, device):
    out = tmp_path / "report.json"
    variants = ["bf16", "bf16-compiled", "int4"]
    cmd = [sys.executable, str(Path(gpu_check.__file__)), "--device", device, "--config", "tiny",
           "--variants", ",".join(variants), "--batch_variants", "bf16", "--batches", "1,2", "--clients", "2",
           "--workdir", str(tmp_path / "work"), "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert report["dry_run"] == (device == "cpu") and report["config"] == "tiny"
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(gpu_check.PARTS, "ok")
    assert all(p["seconds"] > 0 for p in parts.values())
    for name in gpu_check.PARTS:
        assert f"## {name}: ok" in run.stdout

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

    # paged reads: every size timed each way but FlexAttention (not asked for in the dry run), gather included
    paged = parts["paged"]["rows"]
    assert [(r["rows"], r["context"]) for r in paged] == [(1, 64), (2, 64)]
    for r in paged:
        assert set(r["ms"]) == {"gather", "contiguous", "gather compiled", "contiguous compiled"}, r
        assert all(ms > 0 for ms in r["ms"].values()) and r["fastest"] == min(r["ms"], key=r["ms"].get)
        assert r["fastest_over_gather"] == pytest.approx(r["ms"][r["fastest"]] / r["ms"]["gather"])
        assert r["flex_over_gather"] is None
    assert "## paged: ok" in run.stdout and "fastest / gather" in run.stdout
    for r in decode.values():
        assert r["tok_s"] > 0 and r["ms_per_step"] > 0 and r["step_alone_ms"] > 0 and r["bandwidth_share"] > 0, r
    assert decode["int4"]["weight_bytes"] < decode["bf16"]["weight_bytes"] / 3
    assert decode["bf16-compiled"]["compiled"] and decode["bf16-compiled"]["graphs"] >= 1

    assert [(r["variant"], r["batch"]) for r in parts["batch"]["rows"]] == [("bf16", 1), ("bf16", 2)]
    assert all(r["tok_s"] > 0 for r in parts["batch"]["rows"])

    serve = parts["serve"]
    assert serve["streams"] == 2 and serve["tok_s"] > 0
    assert 0 < serve["ttft_p50_ms"] <= serve["ttft_p99_ms"] and 0 < serve["itl_p50_ms"] <= serve["itl_p99_ms"]
    assert "--max_batch_size 2" in serve["command"]

    # measured where their variants ran (int8-compiled did not; FlexAttention is not timed in the dry run)
    assert [t["value"] is not None for t in report["targets"]] == [True, False, False, True, False]
    assert report["targets"][3]["value"] is True
