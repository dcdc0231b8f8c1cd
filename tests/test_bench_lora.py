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
                "batch 8, one adapter", "adapter load", "from PEFT's files to ready to serve", "from memory"):
        assert row in table
    # every rate measured: a number, not nan
    assert "nan" not in table


def test_adapters_saved_as_peft_read_back_as_they_were(tmp_path):
    """The adapters the benchmark serves from PEFT's files are its in-memory ones: saved in
    transformers' names and q/k row order, read back by the library's reader to the same factors."""
    import torch

    from llama import ModelArgs
    from llama.layers.tensor_parallel import full_shapes
    from llama.lora.adapter import read_adapter

    args = ModelArgs(**bench_lora.CONFIGS["tiny"], vocab_size=bench_lora.LLAMA3_VOCAB)
    state = {name: torch.empty(shape) for name, shape in full_shapes(args).items() if name.startswith("layers.")}
    adapter = bench_lora.random_adapters(state, args.n_layers, 4, n=1)["adapter0"]
    back = read_adapter(bench_lora.save_peft(adapter, tmp_path / "a", args), args)
    assert back.scale == adapter.scale and set(back.factors) == set(adapter.factors)
    for name, f in adapter.factors.items():
        assert torch.equal(back.factors[name].a, f.a) and torch.equal(back.factors[name].b, f.b), name
    wq = adapter.factors["layers.0.attention.wq"].b
    assert not torch.equal(bench_lora.meta_to_hf_rope_rows(wq, args.n_heads), wq)  # the row order matters
