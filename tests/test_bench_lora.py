"""benchmarks/bench_lora.py runs: its smallest setting (the tiny shape, two new tokens, one
round, eager) builds both engines, times every row and prints the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_lora  # noqa: E402


@pytest.mark.slow  # two engines of the tiny shape with Llama 3's vocabulary: seconds
def test_smallest_setting_runs(capsys):
    assert bench_lora.main(["--config", "tiny", "--dtype", "float32", "--new_tokens", "2", "--reps", "1",
                            "--threads", "1", "--no-compile"]) == 0
    table = capsys.readouterr().out
    for row in ("batch 1, one adapter, unmerged", "batch 1, the same adapter merged", "batch 8 over 4 adapters",
                "batch 8, one adapter", "adapter load"):
        assert row in table
    # every rate measured: a number, not nan
    assert "nan" not in table
