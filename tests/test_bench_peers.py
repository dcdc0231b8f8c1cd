"""benchmarks/bench.py peers and peers_batch: their prompts, their tables and the GGUF byte count (no peer
engine is run), and this library's rows decoded together in peers_batch's timing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402
import common  # noqa: E402
import peers  # noqa: E402


def test_prompts_have_the_exact_length_and_share_only_bos():
    tokenizer = common.llama3_tokenizer()
    prompts = peers.make_prompts(tokenizer, prompt_tokens=16, prefill_tokens=100)
    encoded = {role: tokenizer.encode(text, bos=True, eos=False) for role, text in prompts.items()}
    for role, tokens in encoded.items():
        assert len(tokens) == (100 if "prefill" in role else 16), role
    # the second token (the number) differs: no engine can reuse another prompt's cache past BOS
    assert len({tokens[1] for tokens in encoded.values()}) == len(encoded)
    with pytest.raises(ValueError, match="cannot make a prompt of 2 tokens"):
        peers.make_prompt(tokenizer, 101, 2)


def _run(long_s: float, short_s: float, prefill_s: float, ids: list[int], weight_bytes: int = 10**8) -> dict:
    return dict(long_s=long_s, short_s=short_s, prefill_s=prefill_s, prefill_prompt_tokens=256,
                weight_bytes=weight_bytes, model_bytes=200 * 2**20, agree_ids=ids)


def test_table_rows_and_ratios():
    ids = [1, 2, 3, 4]
    results = {
        # decode 128 / (2.1 - 0.1) = 64 tok/s, prefill 256 / 0.2 = 1280 tok/s
        ("llama", "float32", 1): [_run(2.1, 0.1, 0.2, ids), _run(4.1, 0.1, 0.2, ids)],  # 64 and 32 tok/s
        ("llama.cpp", "float32", 1): [_run(4.1, 0.1, 0.4, ids)],  # 32 tok/s, 640 tok/s
        ("transformers", "float32", 1): [_run(8.1, 0.1, 0.1, [1, 2, 9, 4])],  # 16 tok/s, 2560 tok/s
        ("llama.cpp", "int8", 1): [_run(1.1, 0.1, 0.2, ids)],
    }
    lines = bench.peer_table(results, {1: 10e9}, new_tokens=128, check_tokens=4)
    rows = [line for line in lines if line.startswith("| llama") or line.startswith("| transformers")]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| llama", "float32", "1"], ["| transformers", "float32", "1"], ["| llama.cpp", "F32", "1"],
        ["| llama.cpp", "Q8_0", "1"]]
    ours = rows[0].split(" | ")
    assert ours[3] == "48.0 [32.0-64.0]"  # median [min-max] over rounds
    # median step 1/48 s; 1e8 bytes at 10 GB/s = 10 ms: 48 %
    assert ours[5] == "48"
    assert ours[8:] == ["1.50 / 2.00", "3.00 / 0.50 |"]  # decode / prefill against each peer
    assert rows[1].split(" | ")[7] == "2/4"  # transformers' greedy tokens leave ours at the third
    assert rows[3].split(" | ")[7] == "-"  # no llama row at int8 to compare with


def test_batch_table_gives_each_engine_s_gain_and_ours_over_llama_cpp():
    """peers_batch's table: tok/s of 1 and of B rows from each process's step times (B / step),
    the gain B x step(1) / step(B) per process, and ours at B rows over llama.cpp's."""
    results = {
        # steps of 4 ms (1 row) and 10 ms (8 rows): 250 and 800 tok/s, 3.2x; a second process at 5 / 10 ms
        ("llama-compiled", "int4", 1): [{"step_s": {"1": [0.004, 0.004, 0.009], "8": [0.010, 0.010, 0.011]}},
                                        {"step_s": {"1": [0.005], "8": [0.010]}}],
        # 5 ms and 35 ms: 200 and 228.57 tok/s, 1.14x
        ("llama.cpp", "int4", 1): [{"step_s": {"1": [0.005], "8": [0.035]}}],
    }
    lines = bench.batch_table(results, 8)
    assert lines[0].startswith("| engine | precision | threads | 1 row tok/s | 8 rows tok/s | 8 rows / 1 row |")
    ours, peer = (line.split(" | ") for line in lines[2:])
    assert ours[:3] == ["| llama-compiled", "int4", "1"] and peer[:3] == ["| llama.cpp", "Q4_0", "1"]
    assert ours[3:6] == ["225.0 [200.0-250.0]", "800.0 [800.0-800.0]", "3.60 [3.20-4.00]"]
    assert ours[6] == "3.50 |"  # 800 / 228.57
    assert peer[5:] == ["1.14 [1.14-1.14]", "- |"]


@pytest.mark.slow  # a model of Llama 3's vocabulary, built and decoding (~10 s)
def test_peers_batch_decodes_this_library_s_rows_together(tmp_path):
    """peers_batch times this library's rows in one decoding step each (max_batch_size = rows),
    past their first tokens: a step time for 1 and for 4 rows, the 4 rows' steps 4 rows wide."""
    ckpt = peers.write_checkpoint("tiny", "float32", tmp_path / "meta", silent_specials=True)
    tokenizer = common.llama3_tokenizer()
    spec = dict(engine="llama", precision="float32", threads=1, ckpt=str(ckpt), max_seq_len=40, batch=4,
                quant_dtype="bfloat16", int4_group_size=64)
    engine = peers.Ours(spec)
    runner = engine.llama.engine.runner
    widths, step = [], runner.decode_step

    def recording(tokens, *rest):
        widths.append(tokens.shape[0])
        return step(tokens, *rest)

    runner.decode_step = recording
    prompts = [peers.make_prompt(tokenizer, 300 + r, 12) for r in range(4)]
    one = engine.decode_rows(prompts[:1], 6)
    assert widths and set(widths) == {1}
    widths.clear()
    four = engine.decode_rows(prompts, 6)
    assert one > 0 and four > 0
    assert set(widths) == {4}, widths  # every decoding step held the four rows


def test_compiled_row_has_its_own_ratios():
    ids = [1, 2, 3, 4]
    results = {
        ("llama", "bfloat16", 2): [_run(2.1, 0.1, 0.2, ids)],  # 64 tok/s
        ("llama-compiled", "bfloat16", 2): [_run(1.1, 0.1, 0.2, [1, 2, 3, 5])],  # 128 tok/s
        ("llama.cpp", "bfloat16", 2): [_run(4.1, 0.1, 0.4, ids)],  # 32 tok/s
    }
    rows = [line.split(" | ") for line in bench.peer_table(results, {2: 10e9}, new_tokens=128, check_tokens=4)
            if line.startswith("| llama")]
    assert [r[0] for r in rows] == ["| llama", "| llama-compiled", "| llama.cpp"]
    assert rows[0][8] == "2.00 / 2.00" and rows[1][8] == "4.00 / 2.00"
    assert rows[1][7] == "3/4"  # its greedy tokens against the eager library's


def test_list_arguments():
    assert bench.as_list("1,2") == ["1", "2"]
    assert bench.as_list((1, 2)) == [1, 2]
    assert bench.as_list(1) == [1]
    assert bench.as_list("float32") == ["float32"]


def test_gguf_decode_bytes_leave_out_the_embedding_table(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), dtype=np.float32))
    writer.add_tensor("output.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert peers.gguf_decode_weight_bytes(path) == (16 + 32) * 4


@pytest.mark.slow  # a model of Llama 3's vocabulary (~1 s)
def test_in_process_modes_keep_the_thread_count_they_were_given(monkeypatch):
    """The first model built in a process chose its own thread count (every CPU), which
    silently turned bench.py's ``--threads 1`` runs into 2-thread ones on this machine.  In
    this process as in a fresh one: no thread variables, and the library's once-per-process
    choice not yet made (a process of its own was another import of torch, ~6 s)."""
    import torch

    from llama.runtime import host

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LLAMA_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(host, "_threads_configured", None)
    bench.set_threads(1)
    bench.build_ours("tiny", torch.bfloat16, 64, 1)
    assert host._threads_configured is not None  # the choice was made, and did not replace the 1
    assert torch.get_num_threads() == 1


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_step_anatomy_sees_every_product_once_and_replays_the_step():
    """bench.py step_anatomy's hooks: one decoding step records each weight product once
    (per layer wq/wk/wv, wo, w1/w3, w2, or 4 where the CPU packs wq/wk/wv and w1/w3 as
    one matrix each; then the output), replaying the records gives the step's own logits
    without computing a product, and the methods are restored afterwards."""
    import torch

    from llama.layers.parallel import ParallelLinear
    from llama.layers.quantized import FusedProjections

    model = bench.build_ours("tiny", torch.bfloat16, 64, 1).model
    per_layer = 4 if model.layers[0].attention.fused is not None else 7
    probe = bench.Products()
    step = dict(tokens=torch.tensor([[5]]), positions=torch.tensor([[8]]), kv_len=9, cache=model.forward_cache())
    with torch.inference_mode(), probe.hooked(model):
        model.forward(torch.randint(0, 1000, (1, 8)), 0)
        probe.mode = "record"
        logits = model.decode_logits(**step)
        assert len(probe.calls) == per_layer * model.n_layers + 1
        assert probe.calls[-1][3].shape[-1] == model.vocab_size
        probe.mode, computed = "replay", probe.seconds
        replayed = model.decode_logits(**step)
    assert torch.equal(replayed, logits)
    assert probe.seconds == computed and probe.next == len(probe.calls)
    products = [m for m in model.modules() if isinstance(m, (ParallelLinear, FusedProjections))]
    assert products and not any("local_matmul" in vars(m) or "product" in vars(m) for m in products)  # unwrapped


def test_bench_paged_reads_the_same_attention_every_way():
    """benchmarks/bench_paged.py: its gathered and in-place reads give the attention of a plain
    per-row reference over the same keys and values (its compiled variants are checked
    against the gathered one when it runs)."""
    import torch

    import bench_paged

    case = bench_paged.Case(bench_paged.SHAPES["150m"], rows=3, context=40, dtype=torch.float32,
                            device=torch.device("cpu"))
    size = bench_paged.BLOCK
    for b in range(3):
        n = int(case.lengths[b])
        slots = [int(case.table[b, p // size]) * size + p % size for p in range(n)]  # position p's slot
        # (H, n, D): head h reads h // n_rep
        keys = case.cache.k[slots].transpose(0, 1).repeat_interleave(case.n_rep, 0)
        values = case.cache.v[slots].transpose(0, 1).repeat_interleave(case.n_rep, 0)
        q = case.q[b, :, 0]  # (H, D)
        weights = torch.softmax((q[:, None] * keys).sum(-1) / q.shape[-1] ** 0.5, -1)
        expected = (weights[..., None] * values).sum(1)
        for read in (case.gather, case.contiguous):
            torch.testing.assert_close(read()[b, :, 0], expected, rtol=1e-5, atol=1e-5)
